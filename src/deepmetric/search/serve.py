"""``deepmetric serve``: a small local search page and JSON API over an index (Starlette +
uvicorn, imported only here, only when serving; install with ``pip install deepmetric[serve]``).

Routes:
    ``GET /``                  the search page: drop or pick an image, see its top-k neighbours
    ``POST /search``           multipart form, field ``image`` (the file) and optional ``k``;
                               answers JSON ``{"query", "k", "neighbours": [{rank, id, path, label,
                               class_name, cosine, thumbnail}]}``
    ``GET /thumb/{id}``        PNG thumbnail of indexed image ``id`` (an integer row of the index)
    ``GET /api/info``          the index's size, dimension, kind, classes and checkpoint hash

Safety: binds 127.0.0.1 unless told otherwise; request bodies over ``max_upload_mb`` are
refused with 413 before they are read; uploads that do not decode as images get 400 with a
message; thumbnails are looked up by row number only, so no path from a request ever reaches
the file system (anything that is not a row of the index is 404).
"""
from __future__ import annotations

import json
from pathlib import Path

__all__ = ["create_app", "serve", "DEFAULT_MAX_UPLOAD_MB"]

DEFAULT_MAX_UPLOAD_MB = 10.0
MAX_K = 100
_PAGE = Path(__file__).with_name("page.html")


class _BodyTooLarge(Exception):
    pass


class _LimitBody:
    """ASGI middleware: 413 when Content-Length or the streamed body exceeds ``limit`` bytes."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, int(limit)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
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
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _BodyTooLarge:
            if not started:
                await self._too_large(send)

    async def _too_large(self, send):
        body = json.dumps({"error": f"upload larger than the limit of {self.limit} bytes "
                                    f"({self.limit / 2**20:.1f} MiB)"}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def create_app(index, *, max_upload_mb: float = DEFAULT_MAX_UPLOAD_MB, default_k: int = 10,
               thumb_size: int = 160):
    """The Starlette application over a loaded :class:`~deepmetric.search.index.Index`."""
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.responses import HTMLResponse, JSONResponse, Response
    from starlette.routing import Route

    from .output import thumbnail_png
    from deepmetric.data.decode import ImageSizeError

    from .query import decode_image

    if not max_upload_mb > 0:
        raise ValueError(f"max_upload_mb must be > 0, got {max_upload_mb}")
    limit = int(max_upload_mb * 2**20)
    _, pre = index.model()  # load (and hash-check) the checkpoint now, not on the first request
    decode_bytes = pre.decode_limit()
    page = _PAGE.read_text(encoding="utf-8").replace("__DEFAULT_K__", str(int(default_k)))
    cache: dict[tuple[int, int], bytes] = {}

    def error(status: int, message: str):
        return JSONResponse({"error": message}, status_code=status)

    async def home(request):
        return HTMLResponse(page)

    async def info(request):
        c = index.meta.get("checkpoint") or {}
        return JSONResponse({"count": len(index), "dim": index.dim, "kind": index.kind,
                             "classes": len(index.class_names), "checkpoint_sha256": c.get("sha256"),
                             "max_upload_bytes": limit, "default_k": default_k,
                             "approximate": index.meta.get("approximate")})

    async def search(request):
        ctype = request.headers.get("content-type", "")
        if not ctype.startswith("multipart/form-data"):
            return error(415, "send the image as multipart/form-data with a field named 'image'")
        try:
            form = await request.form(max_files=1, max_fields=4)
        except _BodyTooLarge:
            return error(413, f"upload larger than the limit of {limit} bytes ({limit / 2**20:.1f} MiB)")
        except Exception as exc:  # malformed multipart bodies
            return error(400, f"could not read the form: {exc}")
        upload = form.get("image")
        if upload is None or isinstance(upload, str):
            return error(400, "missing file field 'image'")
        raw_k = form.get("k") or request.query_params.get("k") or default_k
        try:
            k = int(raw_k)
        except (TypeError, ValueError):
            return error(400, f"k must be an integer, got {raw_k!r}")
        if not 1 <= k <= MAX_K:
            return error(400, f"k must lie in 1..{MAX_K}, got {k}")
        data = await upload.read()
        name = upload.filename or "upload"
        try:
            img = decode_image(data, name, mode=pre.mode, max_bytes=decode_bytes)
        except ImageSizeError as exc:
            return error(413, str(exc))
        except ValueError as exc:
            return error(400, str(exc))

        def run():
            sims, idx = index.search([img], k)
            return index.neighbours(sims, idx)[0]

        rows = await run_in_threadpool(run)
        for r in rows:
            r["thumbnail"] = f"/thumb/{r['id']}"
            r["path"] = Path(r["path"]).name if r["path"] else ""
        return JSONResponse({"query": name, "k": k, "neighbours": rows})

    async def thumb(request):
        i = request.path_params["item"]
        size = request.query_params.get("size", str(thumb_size))
        if not size.isdigit() or not 16 <= int(size) <= 512:
            return error(400, "size must be an integer in 16..512")
        if not 0 <= i < len(index) or not index.paths[i]:
            return error(404, f"no image {i} in this index")
        key = (i, int(size))
        if key not in cache:
            try:
                cache[key] = await run_in_threadpool(thumbnail_png, index.paths[i], int(size))
            except (OSError, ValueError):
                return error(404, f"image {i} of the index cannot be read")
            if len(cache) > 4096:
                cache.pop(next(iter(cache)))
        return Response(cache[key], media_type="image/png", headers={"cache-control": "max-age=3600"})

    async def not_found(request, exc):
        return error(404, f"not found: {request.url.path}")

    async def server_error(request, exc):
        return error(500, f"internal error: {type(exc).__name__}")

    app = Starlette(routes=[Route("/", home), Route("/api/info", info),
                            Route("/search", search, methods=["POST"]),
                            Route("/thumb/{item:int}", thumb)],
                    exception_handlers={404: not_found, 500: server_error})
    return _LimitBody(app, limit)


def serve(index_dir, *, host: str = "127.0.0.1", port: int = 8000, checkpoint=None,
          max_upload_mb: float = DEFAULT_MAX_UPLOAD_MB, k: int = 10, device: str = "cpu") -> None:
    """Load the index and its checkpoint, then serve until Ctrl-C."""
    import uvicorn

    from .index import Index

    index = Index.load(index_dir, mmap=True)
    index.model(checkpoint, device)
    app = create_app(index, max_upload_mb=max_upload_mb, default_k=k)
    if host not in ("127.0.0.1", "localhost", "::1"):
        print(f"warning: serving on {host}: other machines can reach this page and everything in the index")
    print(f"deepmetric serve: {len(index)} images ({index.kind}, d={index.dim}) on http://{host}:{port}/ (Ctrl-C stops)")
    uvicorn.run(app, host=host, port=port, log_level="warning")
