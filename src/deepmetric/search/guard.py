"""What a request to ``deepmetric serve`` must pass before any route sees it: the ``Host`` header
names an allowed host (400 otherwise: DNS rebinding), it was not sent by a page of another site
(403), and its body is within the upload limit (413, by ``Content-Length`` or while streaming).
Every answer carries ``Cross-Origin-Resource-Policy: same-origin``."""
from __future__ import annotations

import ipaddress
import json
from urllib.parse import urlsplit

from .limits import too_large_message

__all__ = ["is_loopback", "BodyTooLarge", "Guard"]


def is_loopback(host: str) -> bool:
    """``localhost`` (and ``*.localhost``) or a loopback address (``127.0.0.0/8``, ``::1``)."""
    h = host.strip().strip("[]").lower().rstrip(".")
    if h == "localhost" or h.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


def _host_name(header: str) -> str:
    """The host of a ``Host`` header without its port: ``a:8000`` -> ``a``, ``[::1]:80`` -> ``::1``."""
    h = header.strip().lower()
    if h.startswith("["):
        return h[1:h.index("]")] if "]" in h else h
    return h.rsplit(":", 1)[0] if h.count(":") == 1 else h


class BodyTooLarge(Exception):
    """The streamed body went over the upload limit."""


def _json_message(status: int, message: str, headers: dict | None = None):
    body = json.dumps({"error": message}).encode()
    h = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    h += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    return ({"type": "http.response.start", "status": status, "headers": h},
            {"type": "http.response.body", "body": body})


def _cross_site(method: str, path: str, headers: dict, host: str) -> str | None:
    """Why a request a browser sent for a page of another origin is refused (None: it is not
    one). Browsers send ``Sec-Fetch-Site`` with every request (``same-origin`` from the search
    page, ``none`` when the user typed the address) and ``Origin`` with every cross-origin
    POST; neither can be set by the page. Other clients (curl, scripts) send neither."""
    if path == "/" and method in ("GET", "HEAD"):
        return None  # the page itself: a link from anywhere may open it
    site = headers.get(b"sec-fetch-site", b"").decode("latin-1").strip().lower()
    if site and site not in ("same-origin", "none"):
        return f"Sec-Fetch-Site: {site[:40]}"
    origin = headers.get(b"origin")
    if origin is not None and method not in ("GET", "HEAD"):
        o = origin.decode("latin-1").strip().lower()
        parts = urlsplit(o) if o != "null" else None
        default = {"http": ":80", "https": ":443"}.get(parts.scheme, "") if parts else ""
        if parts is None or parts.netloc.removesuffix(default) != host.strip().lower().removesuffix(default):
            return f"Origin: {o[:80]}"
    return None


class Guard:
    """ASGI middleware: the Host check (400), the cross-site check (403), then 413 when
    Content-Length or the streamed body exceeds ``limit`` bytes."""

    def __init__(self, app, limit: int, allowed_hosts: tuple[str, ...]):
        self.app, self.limit = app, int(limit)
        self.any_host = "*" in allowed_hosts
        self.allowed = {_host_name(h) for h in allowed_hosts if h != "*"}

    def host_allowed(self, header: str) -> bool:
        name = _host_name(header)
        return self.any_host or is_loopback(name) or name in self.allowed

    def refusal(self, scope, headers: dict) -> tuple[int, str] | None:
        """The status and message a request is refused with before it is read (None: it may go on)."""
        host = headers.get(b"host", b"").decode("latin-1")
        if not self.host_allowed(host):
            return 400, (f"host {host!r} is not served here (a page on another site, or "
                         "start deepmetric serve with --allow-host NAME)")
        why = _cross_site(scope["method"], scope["path"], headers, host)
        if why is not None:
            return 403, (f"{scope['path'][:80]} is only answered to the search page this server "
                         f"serves, not to another site's page ({why})")
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return 413, too_large_message(self.limit)
        return None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        refused = self.refusal(scope, dict(scope.get("headers") or []))
        if refused is not None:
            for m in _json_message(*refused):
                await send(m)
            return
        seen = 0
        started = False

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise BodyTooLarge()
            return message

        async def tracking_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message = {**message, "headers": [*message.get("headers", []),
                                                  (b"cross-origin-resource-policy", b"same-origin"),
                                                  (b"x-content-type-options", b"nosniff")]}
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLarge:
            if not started:
                for m in _json_message(413, too_large_message(self.limit)):
                    await send(m)
