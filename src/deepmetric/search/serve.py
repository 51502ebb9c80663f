"""``deepmetric serve``: a small local search page and JSON API over an index (Starlette +
uvicorn, imported only here, only when serving; install with ``pip install deepmetric[serve]``).

Routes:
    ``GET /``                  the search page: drop or pick an image, see its top-k neighbours
    ``POST /search``           multipart form, field ``image`` (the file) and optional ``k``;
                               answers JSON ``{"query", "k", "neighbours": [{rank, id, path, label,
                               class_name, cosine, thumbnail}]}``
    ``GET /thumb/{id}``        PNG thumbnail of indexed image ``id`` (an integer row of the index)
    ``GET /api/info``          the index's size, dimension, kind, classes and checkpoint hash, the
                               server's limits, and whether the index folder changed on disk
    ``POST /api/reload``       read the index folder again, check it (every file's size and
                               SHA-256, the model's embedding size) and switch to it; a bad folder
                               is refused with 409 and the loaded index keeps serving. ``kill -HUP``
                               does the same for ``deepmetric serve``.

Staying up (each point is tested against a real uvicorn server in tests/search/test_search_serve_hostile.py):

* decoding, embedding, searching and thumbnails run in a pool of ``workers`` threads, never on
  the event loop, so ``/api/info`` answers while uploads are decoded;
* at most ``max_in_flight`` searches are accepted at once (running or waiting for a worker);
  beyond that the answer is 503 with ``Retry-After``, before the upload is read;
* every search gets ``timeout_s`` seconds, reading the upload included: 408 when the body is
  not in by then, 504 when the work is not done (the worker finishes and frees its slot);
* uploads go through the one decoder (:mod:`deepmetric.data.decode`): the decoded size is
  checked from the header against a limit derived from the model's input (capped by
  ``max_decode_mb``) before decoding, 413 naming the limit; undecodable files get 400;
* request bodies over ``max_upload_mb`` get 413 before they are read (Content-Length, or while
  streaming);
* the ``Host`` header must name an allowed host (loopback names and addresses by default,
  others with ``allowed_hosts``): a page on another site that rebinds its DNS name to 127.0.0.1
  is answered 400, so the browser cannot read the index through it;
* requests a page on another site could make a browser send are refused with 403 (everything
  but the page itself when ``Sec-Fetch-Site`` is not ``same-origin`` / ``none``; a POST whose
  ``Origin`` is not this server), so a foreign page can neither reload the index nor make the
  server decode uploads or thumbnails; responses carry ``Cross-Origin-Resource-Policy:
  same-origin``;
* thumbnails are decoded under the same limit as uploads (the model's), and their cache is
  bounded in bytes (``THUMB_CACHE_BYTES``, least recently used out first);
* connections: a header timeout, idle connections closed to make room for new ones, no
  request cap counting idle sockets (:mod:`deepmetric.search.connections`);
* the index is read into memory (not memory-mapped) and verified at start; replacing or
  truncating its files changes nothing until a reload, and a change is noticed and printed;
* thumbnails are looked up by row number only, so no path from a request reaches the file
  system (anything that is not a row of the index is 404).

The pieces: this module (the app factory and ``serve``), :mod:`.routes` (one function per
route), :mod:`.guard` (Host, cross-site and body-size checks before any route), :mod:`.limits`
(the request limits and the counted resources), :mod:`.served` (the loaded index, reloads and
the watch on its folder) and :mod:`.connections` (connection limits).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import sys
import threading
from functools import partial
from pathlib import Path

from deepmetric.wording import counted
from .connections import DEFAULT_HEADER_TIMEOUT_S, DEFAULT_MAX_CONNECTIONS, bind, make_server, protocol_class
from .guard import Guard, is_loopback
from .limits import DEFAULT_MAX_IN_FLIGHT, DEFAULT_MAX_UPLOAD_MB, DEFAULT_TIMEOUT_S, DEFAULT_WORKERS, Slots, check_options
from .served import prepare, watch_folder

__all__ = ["create_app", "serve"]

_PAGE = Path(__file__).with_name("page.html")


def _lower_priority() -> None:
    """Run a worker thread at a lower CPU priority than the event loop (Linux: per thread), so
    that light requests are answered promptly while uploads are decoded."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), os.getpriority(os.PRIO_PROCESS, 0) + 5)


@contextlib.asynccontextmanager
async def _lifespan(state, handle_sighup: bool, app):
    """While the app runs: the watch on the index folder, ``kill -HUP`` reloading (when
    ``handle_sighup``); afterwards the worker pool is shut down."""
    from .routes import reload

    loop = asyncio.get_running_loop()
    watcher = loop.create_task(watch_folder(state.served, state.say))
    hup = False
    if handle_sighup:
        import signal

        def on_hup():
            loop.create_task(reload(state, None))

        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError, AttributeError):
            loop.add_signal_handler(signal.SIGHUP, on_hup)
            hup = True
    try:
        yield
    finally:
        watcher.cancel()
        if hup:
            loop.remove_signal_handler(signal.SIGHUP)
        state.pool.shutdown(wait=False, cancel_futures=True)


def create_app(index, *, max_upload_mb: float = DEFAULT_MAX_UPLOAD_MB, default_k: int = 10,
               thumb_size: int = 160, workers: int = DEFAULT_WORKERS,
               max_in_flight: int = DEFAULT_MAX_IN_FLIGHT, timeout_s: float = DEFAULT_TIMEOUT_S,
               allowed_hosts=(), max_decode_mb: float | None = None, checkpoint=None,
               device: str = "cpu", handle_sighup: bool = False, log=None):
    """The ASGI application over a loaded :class:`~deepmetric.search.index.Index` (reloads read
    ``index.directory`` again). ``log``: where notices go (default stderr)."""
    from starlette.applications import Starlette

    from .routes import AppState, exception_handlers, routes

    check_options(len(index), max_upload_mb=max_upload_mb, workers=workers, max_in_flight=max_in_flight,
                  timeout_s=timeout_s, default_k=default_k)
    state = AppState(
        served={"now": prepare(index, generation=0, max_decode_mb=max_decode_mb, checkpoint=checkpoint,
                               device=device)},
        page=_PAGE.read_text(encoding="utf-8").replace("__DEFAULT_K__", str(int(default_k))),
        upload_bytes=int(max_upload_mb * 2**20), default_k=default_k, thumb_size=thumb_size, workers=workers,
        timeout_s=timeout_s, max_decode_mb=max_decode_mb, checkpoint=checkpoint, device=device,
        pool=concurrent.futures.ThreadPoolExecutor(max_workers=int(workers), thread_name_prefix="deepmetric-serve",
                                                   initializer=_lower_priority),
        searches=Slots(max_in_flight), say=log or (lambda text: print(text, file=sys.stderr, flush=True)))
    app = Starlette(routes=routes(state), exception_handlers=exception_handlers(),
                    lifespan=partial(_lifespan, state, handle_sighup))
    guarded = Guard(app, state.upload_bytes, tuple(allowed_hosts))
    guarded.served = state.served  # for tests and the benchmark: the loaded index
    guarded.thumbnails = state.thumbnails  # and the thumbnail cache
    return guarded


def _sigint_ends_as_ctrl_c() -> None:
    """A server started as a background job of a script (``deepmetric serve ... &``) inherits
    SIGINT ignored, so Python installs no KeyboardInterrupt handler; uvicorn still stops on
    SIGINT, but then returned as if nothing had happened (exit 0, no line). With Python's own
    handler back, that stop ends as every Ctrl-C does: one line and exit 130."""
    import signal

    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def serve(index_dir, *, host: str = "127.0.0.1", port: int = 8000, checkpoint=None,
          max_upload_mb: float = DEFAULT_MAX_UPLOAD_MB, k: int = 10, device: str = "cpu",
          workers: int = DEFAULT_WORKERS, max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
          timeout_s: float = DEFAULT_TIMEOUT_S, allow_hosts=(), max_decode_mb: float | None = None,
          header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S, max_connections: int = DEFAULT_MAX_CONNECTIONS) -> None:
    """Bind ``host:port`` (a clear error when it cannot be; port 0: a free one, named in the
    banner), load the index into memory (every
    file's SHA-256 checked) and its checkpoint, then serve until Ctrl-C; ``kill -HUP``
    reloads the index folder."""
    from .index import Index

    from deepmetric.run.device import resolve_device

    protocol_class(header_timeout_s, max_connections)  # its checks, before anything is loaded
    device = str(resolve_device(device, name="--device"))
    sock = bind(host, port)
    port = sock.getsockname()[1]  # --port 0: the one the system picked, for the banner
    try:
        index = Index.load(index_dir, verify_hashes=True)
        index.model(checkpoint, device)
        allowed = list(allow_hosts)
        if not is_loopback(host) and host not in ("0.0.0.0", "::", ""):
            allowed.append(host)  # the address it was told to bind is a name clients use
        app = create_app(index, max_upload_mb=max_upload_mb, default_k=k, workers=workers,
                         max_in_flight=max_in_flight, timeout_s=timeout_s, allowed_hosts=tuple(allowed),
                         max_decode_mb=max_decode_mb, checkpoint=checkpoint, device=device, handle_sighup=True)
        server = make_server(app, host, port, header_timeout_s=header_timeout_s, max_connections=max_connections)
        if not is_loopback(host):
            names = ", ".join(allowed) if allowed else "none: add --allow-host NAME for the name clients use"
            print(f"warning: serving on {host}: other machines can reach this page and everything in the index "
                  f"(host names answered besides loopback: {names})")
        print(f"deepmetric serve: {counted(len(index), 'image')} ({index.kind}, d={index.dim}) on http://{host}:{port}/ "
              f"(Ctrl-C stops; kill -HUP {os.getpid()} reloads the index)", flush=True)
        import gc

        gc.collect()
        gc.freeze()  # the loaded model, index and libraries: full collections while serving skip them
        _sigint_ends_as_ctrl_c()
        server.run(sockets=[sock])
    finally:
        sock.close()
