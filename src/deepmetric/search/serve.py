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

Staying up (each point is tested against a real uvicorn server in tests/test_search_serve_hostile.py):

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
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ipaddress
import json
import os
import re
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from .connections import DEFAULT_HEADER_TIMEOUT_S, DEFAULT_MAX_CONNECTIONS, bind, make_server, protocol_class

__all__ = ["create_app", "serve", "is_loopback", "DEFAULT_MAX_UPLOAD_MB", "DEFAULT_WORKERS",
           "DEFAULT_MAX_IN_FLIGHT", "DEFAULT_TIMEOUT_S", "MAX_K", "THUMB_CACHE_BYTES"]

DEFAULT_MAX_UPLOAD_MB = 10.0
DEFAULT_WORKERS = 2
DEFAULT_MAX_IN_FLIGHT = 8
DEFAULT_TIMEOUT_S = 30.0
MAX_K = 100
_THUMB_IN_FLIGHT = 64  # thumbnails of indexed images: a page shows up to 100 of them
#: bytes of thumbnail PNGs kept in memory (least recently used out first)
THUMB_CACHE_BYTES = 32 * 2**20
_PAGE = Path(__file__).with_name("page.html")
_CHECK_EVERY_S = 2.0  # how often the index folder is compared with what was loaded


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


class _BodyTooLarge(Exception):
    pass


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


class _Guard:
    """ASGI middleware: the Host check (400), the cross-site check (403), then 413 when
    Content-Length or the streamed body exceeds ``limit`` bytes."""

    def __init__(self, app, limit: int, allowed_hosts: tuple[str, ...]):
        self.app, self.limit = app, int(limit)
        self.any_host = "*" in allowed_hosts
        self.allowed = {_host_name(h) for h in allowed_hosts if h != "*"}

    def host_allowed(self, header: str) -> bool:
        name = _host_name(header)
        return self.any_host or is_loopback(name) or name in self.allowed

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        host = headers.get(b"host", b"").decode("latin-1")
        if not self.host_allowed(host):
            for m in _json_message(400, f"host {host!r} is not served here (a page on another site, or "
                                        "start deepmetric serve with --allow-host NAME)"):
                await send(m)
            return
        why = _cross_site(scope["method"], scope["path"], headers, host)
        if why is not None:
            for m in _json_message(403, f"{scope['path'][:80]} is only answered to the search page this server "
                                        f"serves, not to another site's page ({why})"):
                await send(m)
            return
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await self._too_large(send)
        seen = 0
        started = False

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise _BodyTooLarge()
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
        except _BodyTooLarge:
            if not started:
                await self._too_large(send)

    async def _too_large(self, send):
        for m in _json_message(413, f"upload larger than the limit of {self.limit} bytes "
                                    f"({self.limit / 2**20:.1f} MiB)"):
            await send(m)


class _Slots:
    """A count of accepted requests with a cap; released from any thread."""

    def __init__(self, cap: int):
        self.cap, self.used = int(cap), 0
        self._lock = threading.Lock()

    def try_acquire(self) -> bool:
        with self._lock:
            if self.used >= self.cap:
                return False
            self.used += 1
            return True

    def release(self, *_):
        with self._lock:
            self.used -= 1


_WATCHED = ("manifest.json", "embeddings.npy", "vectors.f16.npy", "metadata.arrow", "class_names.arrow", "labels.npy",
            "class_names.json", "paths.json", "index.faiss", "postprocess.npz")


def _lower_priority() -> None:
    """Run a worker thread at a lower CPU priority than the event loop (Linux: per thread), so
    that light requests are answered promptly while uploads are decoded."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), os.getpriority(os.PRIO_PROCESS, 0) + 5)


def _file_stats(d: Path) -> dict:
    out = {}
    for name in _WATCHED:
        try:
            st = os.stat(d / name)
            out[name] = (st.st_ino, st.st_size, st.st_mtime_ns)
        except OSError:
            out[name] = None
    return out


@dataclass
class _Loaded:
    """One loaded, verified index with its model: what a request uses from start to end."""

    index: object
    preprocessing: object
    decode_bytes: int
    directory: Path | None
    stats: dict
    generation: int
    loaded_at: float = field(default_factory=time.time)

    def changed_on_disk(self) -> bool:
        return self.directory is not None and _file_stats(self.directory) != self.stats


def _prepare(index, *, generation: int, max_decode_mb, checkpoint=None, device: str = "cpu",
             previous: _Loaded | None = None) -> _Loaded:
    """Load the model (reused from ``previous`` when the checkpoint is the same file), check
    that it makes embeddings of the index's size, and derive the decode limit."""
    import numpy as np
    from PIL import Image

    prev_sha = ((previous.index.meta.get("checkpoint") or {}).get("sha256") if previous else None)
    sha = (index.meta.get("checkpoint") or {}).get("sha256")
    if previous is not None and sha is not None and sha == prev_sha and previous.index._model is not None:
        index._model = previous.index._model
    _, pre = index.model(checkpoint, device)
    probe = index.embed(Image.new(pre.mode, (64, 64), 128))
    if probe.shape[1] != index.query_dim or not np.isfinite(probe).all():
        raise ValueError(f"the checkpoint makes {probe.shape[1]}-d embeddings but the index holds {index.query_dim}-d ones")
    d = Path(index.directory) if index.directory is not None else None
    return _Loaded(index, pre, pre.decode_limit(max_decode_mb), d, _file_stats(d) if d else {}, generation)


def _reason(exc: Exception) -> str:
    """The part of a decode error after the file's name (no server path in an answer)."""
    return getattr(exc, "reason", None) or type(exc).__name__


def _load_folder(index_dir: Path, **kw) -> _Loaded:
    from .index import Index

    return _prepare(Index.load(index_dir, verify_hashes=True), **kw)


def create_app(index, *, max_upload_mb: float = DEFAULT_MAX_UPLOAD_MB, default_k: int = 10,
               thumb_size: int = 160, workers: int = DEFAULT_WORKERS,
               max_in_flight: int = DEFAULT_MAX_IN_FLIGHT, timeout_s: float = DEFAULT_TIMEOUT_S,
               allowed_hosts=(), max_decode_mb: float | None = None, checkpoint=None,
               device: str = "cpu", handle_sighup: bool = False, log=None):
    """The ASGI application over a loaded :class:`~deepmetric.search.index.Index` (reloads read
    ``index.directory`` again). ``log``: where notices go (default stderr)."""
    from starlette.applications import Starlette
    from starlette.responses import HTMLResponse, JSONResponse, Response
    from starlette.routing import Route

    from deepmetric.data.decode import ImageDecodeError, ImageSizeError, decode_image

    from .output import displayable, thumbnail_png

    if not max_upload_mb > 0:
        raise ValueError(f"max_upload_mb must be > 0, got {max_upload_mb}")
    for name, v in (("workers", workers), ("max_in_flight", max_in_flight)):
        if int(v) < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    if not 1 <= int(default_k) <= min(MAX_K, len(index)):
        raise ValueError(f"--k {default_k}: the default number of neighbours must lie in 1..{min(MAX_K, len(index))} "
                         f"(the index holds {len(index)} images; searches take at most {MAX_K})")
    limit = int(max_upload_mb * 2**20)
    say = log or (lambda text: print(text, file=sys.stderr, flush=True))
    page = _PAGE.read_text(encoding="utf-8").replace("__DEFAULT_K__", str(int(default_k)))
    served = {"now": _prepare(index, generation=0, max_decode_mb=max_decode_mb, checkpoint=checkpoint,
                              device=device)}
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=int(workers), thread_name_prefix="deepmetric-serve",
                                                 initializer=_lower_priority)
    searches, thumbs = _Slots(max_in_flight), _Slots(_THUMB_IN_FLIGHT)
    cache: OrderedDict[tuple[int, int, int], bytes] = OrderedDict()  # least recently used first
    cached = {"bytes": 0}
    reload_lock = asyncio.Lock()
    noticed = {"generation": -1}

    def error(status: int, message: str, headers: dict | None = None):
        return JSONResponse({"error": message}, status_code=status, headers=headers)

    def busy(what: str, slots: _Slots):
        return error(503, f"the server is busy ({slots.cap} {what} in flight); try again in a second",
                     {"retry-after": "1"})

    async def run_job(slots: _Slots, fn, *args, deadline: float):
        """``fn(*args)`` in the pool; the slot is freed when the worker is done with it."""
        fut = pool.submit(fn, *args)
        fut.add_done_callback(slots.release)
        return await asyncio.wait_for(asyncio.wrap_future(fut), timeout=max(0.0, deadline - time.monotonic()))

    async def home(request):
        return HTMLResponse(page)

    async def info(request):
        now = served["now"]
        index = now.index
        c = index.meta.get("checkpoint") or {}
        return JSONResponse({"count": len(index), "dim": index.dim, "kind": index.kind,
                             "classes": len(index.class_names), "checkpoint_sha256": c.get("sha256"),
                             "max_upload_bytes": limit, "max_decode_bytes": now.decode_bytes,
                             "default_k": default_k, "approximate": index.meta.get("approximate"),
                             "workers": int(workers), "max_in_flight": searches.cap, "in_flight": searches.used,
                             "timeout_s": timeout_s, "generation": now.generation,
                             "loaded_at": now.loaded_at, "changed_on_disk": now.changed_on_disk()})

    def do_search(now: _Loaded, data: bytes, name: str, k: int):
        img = decode_image(data, name=name, mode=now.preprocessing.mode, max_bytes=now.decode_bytes)
        sims, idx = now.index.search([img], k)
        return now.index.neighbours(sims, idx)[0]

    async def search(request):
        deadline = time.monotonic() + timeout_s
        ctype = request.headers.get("content-type", "").lower()
        if not ctype.startswith("multipart/form-data"):
            return error(415, "send the image as multipart/form-data with a field named 'image'")
        if not searches.try_acquire():
            return busy("searches", searches)
        handed = False
        form = None
        try:
            try:
                form = await asyncio.wait_for(request.form(max_files=1, max_fields=4), timeout=timeout_s)
            except _BodyTooLarge:
                return error(413, f"upload larger than the limit of {limit} bytes ({limit / 2**20:.1f} MiB)")
            except asyncio.TimeoutError:
                return error(408, f"the upload did not arrive within the limit of {timeout_s:g} s")
            except Exception as exc:  # malformed multipart bodies
                return error(400, f"could not read the form: {exc}")
            upload = form.get("image")
            if upload is None or isinstance(upload, str):
                return error(400, "missing file field 'image'")
            raw_k = str(form.get("k") or request.query_params.get("k") or default_k).strip()
            if not re.fullmatch(r"[0-9]{1,4}", raw_k):  # ASCII digits only: int("²") fails
                return error(400, f"k must be an integer, got {raw_k[:20]!r}")
            k = int(raw_k)
            if not 1 <= k <= MAX_K:
                return error(400, f"k must lie in 1..{MAX_K}, got {k}")
            data = await upload.read()
            name = displayable(upload.filename or "upload")
            handed = True
            try:
                rows = await run_job(searches, do_search, served["now"], data, name, k, deadline=deadline)
            except asyncio.TimeoutError:
                return error(504, f"the search took longer than the limit of {timeout_s:g} s")
            except ImageSizeError as exc:
                return error(413, str(exc))
            except (ImageDecodeError, ValueError) as exc:
                return error(400, str(exc))
        finally:
            if not handed:
                searches.release()
            if form is not None:
                await form.close()
        for r in rows:
            r["thumbnail"] = f"/thumb/{r['id']}"
            r["path"] = Path(r["path"]).name if r["path"] else ""
        return JSONResponse({"query": name, "k": k, "neighbours": rows})

    async def thumb(request):
        i = request.path_params["item"]
        size = request.query_params.get("size", str(thumb_size))
        if not re.fullmatch(r"[0-9]{1,3}", size) or not 16 <= int(size) <= 512:
            return error(400, "size must be an integer in 16..512")
        now = served["now"]
        if not 0 <= i < len(now.index) or not now.index.paths[i]:
            return error(404, f"no image {i} in this index")
        key = (now.generation, i, int(size))
        png = cache.get(key)
        if png is None:
            if not thumbs.try_acquire():
                return busy("thumbnails", thumbs)
            try:
                png = await run_job(thumbs, thumbnail_png, now.index.paths[i], int(size), now.decode_bytes,
                                    deadline=time.monotonic() + timeout_s)
            except asyncio.TimeoutError:
                return error(504, f"the thumbnail took longer than the limit of {timeout_s:g} s")
            except (OSError, ValueError) as exc:
                return error(404, f"image {i} of the index cannot be read ({_reason(exc)})")
            if key not in cache and len(png) <= THUMB_CACHE_BYTES:
                cache[key] = png
                cached["bytes"] += len(png)
            while cached["bytes"] > THUMB_CACHE_BYTES:
                cached["bytes"] -= len(cache.popitem(last=False)[1])
        else:
            cache.move_to_end(key)
        return Response(png, media_type="image/png", headers={"cache-control": "max-age=3600"})

    async def reload(request):
        if reload_lock.locked():
            return error(409, "a reload is already running")
        async with reload_lock:
            now = served["now"]
            if now.directory is None:
                return error(409, "this index was not loaded from a folder: nothing to reload")
            loop = asyncio.get_running_loop()
            try:
                new = await loop.run_in_executor(
                    None, lambda: _load_folder(now.directory, generation=now.generation + 1,
                                               max_decode_mb=max_decode_mb, checkpoint=checkpoint,
                                               device=device, previous=now))
            except (ValueError, OSError, KeyError, RuntimeError) as exc:
                say(f"deepmetric serve: reload refused, still serving the previous index: {exc}")
                return error(409, f"reload refused, still serving the previous index: {exc}")
            served["now"] = new
            for key in [key for key in cache if key[0] != new.generation]:
                cached["bytes"] -= len(cache.pop(key))
            if default_k > len(new.index):
                say(f"deepmetric serve: the reloaded index holds {len(new.index)} images, fewer than --k {default_k}")
            say(f"deepmetric serve: reloaded {now.directory}: {len(new.index)} images (was {len(now.index)})")
            return JSONResponse({"reloaded": True, "count": len(new.index), "previous_count": len(now.index),
                                 "generation": new.generation})

    async def watch():
        """Say once per change that the folder on disk is not what is served."""
        while True:
            await asyncio.sleep(_CHECK_EVERY_S)
            now = served["now"]
            if noticed["generation"] != now.generation and now.directory is not None:
                changed = await asyncio.get_running_loop().run_in_executor(None, now.changed_on_disk)
                if changed and served["now"] is now:
                    noticed["generation"] = now.generation
                    say(f"deepmetric serve: the index folder {now.directory} changed on disk; still serving the "
                        f"index loaded at start or last reload (reload: POST /api/reload or kill -HUP {os.getpid()})")

    @contextlib.asynccontextmanager
    async def lifespan(app):
        loop = asyncio.get_running_loop()
        watcher = loop.create_task(watch())
        hup = False
        if handle_sighup:
            import signal

            def on_hup():
                loop.create_task(reload(None))

            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError, AttributeError):
                loop.add_signal_handler(signal.SIGHUP, on_hup)
                hup = True
        try:
            yield
        finally:
            watcher.cancel()
            if hup:
                loop.remove_signal_handler(signal.SIGHUP)
            pool.shutdown(wait=False, cancel_futures=True)

    async def not_found(request, exc):
        return error(404, f"not found: {request.url.path}")

    async def server_error(request, exc):
        return error(500, f"internal error: {type(exc).__name__}")

    app = Starlette(routes=[Route("/", home), Route("/api/info", info),
                            Route("/api/reload", reload, methods=["POST"]),
                            Route("/search", search, methods=["POST"]),
                            Route("/thumb/{item:int}", thumb)],
                    exception_handlers={404: not_found, 500: server_error}, lifespan=lifespan)
    guarded = _Guard(app, limit, tuple(allowed_hosts))
    guarded.served = served  # for tests and the benchmark: the loaded index
    guarded.thumbnails = cache  # and the thumbnail cache
    return guarded


def serve(index_dir, *, host: str = "127.0.0.1", port: int = 8000, checkpoint=None,
          max_upload_mb: float = DEFAULT_MAX_UPLOAD_MB, k: int = 10, device: str = "cpu",
          workers: int = DEFAULT_WORKERS, max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
          timeout_s: float = DEFAULT_TIMEOUT_S, allow_hosts=(), max_decode_mb: float | None = None,
          header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S, max_connections: int = DEFAULT_MAX_CONNECTIONS) -> None:
    """Bind ``host:port`` (a clear error when it cannot be), load the index into memory (every
    file's SHA-256 checked) and its checkpoint, then serve until Ctrl-C; ``kill -HUP``
    reloads the index folder."""
    from .index import Index

    protocol_class(header_timeout_s, max_connections)  # its checks, before anything is loaded
    sock = bind(host, port)
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
        print(f"deepmetric serve: {len(index)} images ({index.kind}, d={index.dim}) on http://{host}:{port}/ "
              f"(Ctrl-C stops; kill -HUP {os.getpid()} reloads the index)", flush=True)
        import gc

        gc.collect()
        gc.freeze()  # the loaded model, index and libraries: full collections while serving skip them
        server.run(sockets=[sock])
    finally:
        sock.close()
