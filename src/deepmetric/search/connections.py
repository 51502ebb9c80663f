"""Connections of ``deepmetric serve``: binding the port with clear errors, and a uvicorn HTTP
protocol that idle sockets cannot exhaust (issue 32).

uvicorn alone counts every open connection against ``limit_concurrency`` (103 idle sockets
answered everyone else 503) and arms no timer on a new connection or on unfinished headers (a
client sending one header line a second was still being read after 40 s). Here:

* **a header timeout**: from the moment a connection opens, or finishes a response, the next
  request's headers must be complete within ``header_timeout_s`` (default 10 s); otherwise the
  connection is closed (with **408** when part of a request came in);
* **idle connections are not requests**: ``limit_concurrency`` is not used (the app bounds its
  own work: searches and thumbnails in flight); open connections are bounded by
  ``max_connections`` (default 512), and when a new one would exceed it, the connections that
  have been waiting longest for a request are closed to make room, so a client that sends a
  request is answered however many idle sockets are held. Only when every connection is in the
  middle of a request is the new one answered **503** and closed.

The protocol is uvicorn's h11 implementation (``uvicorn.protocols.http.h11_impl``) with these
timers added; the headers' size is h11's bound (16 KiB, then 400).
"""
from __future__ import annotations

import json
import socket

__all__ = ["DEFAULT_HEADER_TIMEOUT_S", "DEFAULT_MAX_CONNECTIONS", "bind", "make_server", "protocol_class"]

DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_MAX_CONNECTIONS = 512


def _raw_response(status: str, message: str, extra: str = "") -> bytes:
    body = json.dumps({"error": message}).encode()
    return (f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"{extra}connection: close\r\n\r\n").encode() + body


def protocol_class(header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
                   max_connections: int = DEFAULT_MAX_CONNECTIONS):
    """A subclass of uvicorn's ``H11Protocol`` with the header timeout and the connection bound
    of the module docstring (uvicorn makes one instance per connection)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    if not header_timeout_s > 0:
        raise ValueError(f"header_timeout_s must be > 0, got {header_timeout_s}")
    if int(max_connections) < 1:
        raise ValueError(f"max_connections must be >= 1, got {max_connections}")
    late = _raw_response("408 Request Timeout",
                         f"the request's headers did not arrive within the limit of {header_timeout_s:g} s")
    full = _raw_response("503 Service Unavailable", f"the server is busy ({int(max_connections)} connections "
                         "with requests under way); try again in a second", "retry-after: 1\r\n")

    class GuardedH11Protocol(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._header_timer = None
            self._partial = False
            self._wait_for_request()
            if len(self.connections) > max_connections:
                self._make_room()

        def _wait_for_request(self) -> None:
            self._waiting, self._waiting_since, self._partial = True, self.loop.time(), False
            self._cancel_timer()
            self._header_timer = self.loop.call_later(header_timeout_s, self._headers_late)

        def _cancel_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_late(self) -> None:
            self._header_timer = None
            if self._waiting and not self.transport.is_closing():
                if self._partial:
                    self.transport.write(late)
                self.transport.close()

        def _make_room(self) -> None:
            """Close the connections waiting longest for a request; refuse this one when
            none waits."""
            idle = sorted((c for c in self.connections if c is not self and getattr(c, "_waiting", False)),
                          key=lambda c: c._waiting_since)
            for c in idle[:len(self.connections) - max_connections]:
                c._waiting = False
                c._cancel_timer()
                c.transport.close()
                self.connections.discard(c)  # closing is asynchronous: count it gone now
            if len(self.connections) > max_connections:
                self._waiting = False
                self._cancel_timer()
                self.transport.write(full)
                self.transport.close()
                self.connections.discard(self)

        def data_received(self, data: bytes) -> None:
            if self._waiting:
                self._partial = True
            super().data_received(data)

        def handle_events(self) -> None:
            before = self.cycle
            super().handle_events()
            if self.cycle is not before and self._waiting:  # a request's headers are complete
                self._waiting = False
                self._cancel_timer()

        def on_response_complete(self) -> None:
            self._wait_for_request()  # before: a pipelined request found by the parent clears it
            super().on_response_complete()

        def connection_lost(self, exc) -> None:
            self._waiting = False
            self._cancel_timer()
            super().connection_lost(exc)

    return GuardedH11Protocol


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (port 0: a free port the system picks; read it with
    ``sock.getsockname()[1]``), or a ValueError / OSError that says what is wrong (a port outside
    0..65535, an address in use, a host that does not resolve)."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"--port {port}: a port must be an integer in 1..65535, or 0 for a free one")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise ValueError(f"--host {host}: not an address or name this machine can bind ({exc.strerror})") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        import errno

        if exc.errno == errno.EADDRINUSE:
            raise OSError(f"port {port} on {host} is already in use (another server?); choose another with "
                          "--port") from None
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.set_inheritable(True)
    return sock


def make_server(app, host: str, port: int, *, header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
                max_connections: int = DEFAULT_MAX_CONNECTIONS, log_level: str = "warning"):
    """A ``uvicorn.Server`` for ``app`` with the guarded protocol (``server.run()`` binds
    ``host:port``; ``server.run(sockets=[bind(host, port)])`` uses a socket bound first)."""
    import uvicorn

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_keep_alive=5,
                            http=protocol_class(header_timeout_s, max_connections), ws="none",
                            timeout_graceful_shutdown=5)
    return uvicorn.Server(config)
