"""The routes of ``deepmetric serve``, one function per route, each taking the app's
:class:`AppState` first (bound with :func:`functools.partial` by :func:`routes`). Imported by
:func:`deepmetric.search.serve.create_app` only, when serving: Starlette is imported here.

Decoding, embedding, searching and thumbnails run in the state's pool of worker threads, never
on the event loop, and hold a slot (:class:`~deepmetric.search.limits.Slots`) until the worker
is done with them."""
from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from deepmetric.wording import counted
from deepmetric.data.decode import ImageDecodeError, ImageSizeError, decode_image

from .guard import BodyTooLarge
from .limits import THUMB_IN_FLIGHT, Slots, ThumbnailCache, read_k, read_thumb_size, too_large_message
from .output import displayable, query_answer, thumbnail_png
from .served import Loaded, load_folder

__all__ = ["AppState", "routes", "exception_handlers", "reload"]


@dataclass
class AppState:
    """What the routes of one app share: its settings, the index it serves (``served["now"]``,
    replaced by a reload), the worker pool and the counted resources."""

    served: dict
    page: str
    upload_bytes: int
    default_k: int
    thumb_size: int
    workers: int
    timeout_s: float
    max_decode_mb: float | None
    checkpoint: object
    device: str
    pool: concurrent.futures.ThreadPoolExecutor
    searches: Slots
    say: Callable[[str], None]
    thumbs: Slots = field(default_factory=lambda: Slots(THUMB_IN_FLIGHT))
    thumbnails: ThumbnailCache = field(default_factory=ThumbnailCache)
    reload_lock: asyncio.Lock = field(default_factory=asyncio.Lock)


def _error(status: int, message: str, headers: dict | None = None):
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def _busy(what: str, slots: Slots):
    return _error(503, f"the server is busy ({slots.cap} {what} in flight); try again in a second",
                  {"retry-after": "1"})


def _reason(exc: Exception) -> str:
    """The part of a decode error after the file's name (no server path in an answer)."""
    return getattr(exc, "reason", None) or type(exc).__name__


async def _run_job(state: AppState, slots: Slots, fn, *args, deadline: float):
    """``fn(*args)`` in the pool; the slot is freed when the worker is done with it."""
    fut = state.pool.submit(fn, *args)
    fut.add_done_callback(slots.release)
    return await asyncio.wait_for(asyncio.wrap_future(fut), timeout=max(0.0, deadline - time.monotonic()))


async def home(state: AppState, request):
    return HTMLResponse(state.page)


async def info(state: AppState, request):
    now = state.served["now"]
    index = now.index
    c = index.meta.get("checkpoint") or {}
    return JSONResponse({"count": len(index), "dim": index.dim, "kind": index.kind,
                         "classes": len(index.class_names), "checkpoint_sha256": c.get("sha256"),
                         "max_upload_bytes": state.upload_bytes, "max_decode_bytes": now.decode_bytes,
                         "default_k": state.default_k, "approximate": index.meta.get("approximate"),
                         "workers": int(state.workers), "max_in_flight": state.searches.cap,
                         "in_flight": state.searches.used, "timeout_s": state.timeout_s,
                         "generation": now.generation, "loaded_at": now.loaded_at,
                         "changed_on_disk": now.changed_on_disk()})


def _search_in_worker(now: Loaded, data: bytes, name: str, k: int):
    img = decode_image(data, name=name, mode=now.preprocessing.mode, max_bytes=now.decode_bytes)
    sims, idx = now.index.search([img], k)
    return now.index.neighbours(sims, idx)[0]


async def _read_form(state: AppState, request):
    """The multipart form of a search, or the error answer when it cannot be read in time."""
    try:
        return await asyncio.wait_for(request.form(max_files=1, max_fields=4), timeout=state.timeout_s), None
    except BodyTooLarge:
        return None, _error(413, too_large_message(state.upload_bytes))
    except asyncio.TimeoutError:
        return None, _error(408, f"the upload did not arrive within the limit of {state.timeout_s:g} s")
    except Exception as exc:  # malformed multipart bodies
        return None, _error(400, f"could not read the form: {exc}")


async def search(state: AppState, request):
    deadline = time.monotonic() + state.timeout_s
    ctype = request.headers.get("content-type", "").lower()
    if not ctype.startswith("multipart/form-data"):
        return _error(415, "send the image as multipart/form-data with a field named 'image'")
    if not state.searches.try_acquire():
        return _busy("searches", state.searches)
    handed = False  # once the work is in the pool, the worker frees the slot
    form = None
    try:
        form, refused = await _read_form(state, request)
        if refused is not None:
            return refused
        upload = form.get("image")
        if upload is None or isinstance(upload, str):
            return _error(400, "missing file field 'image'")
        try:
            k = read_k(str(form.get("k") or request.query_params.get("k") or state.default_k).strip())
        except ValueError as exc:
            return _error(400, str(exc))
        data = await upload.read()
        name = displayable(upload.filename or "upload")
        handed = True
        try:
            rows = await _run_job(state, state.searches, _search_in_worker, state.served["now"], data, name, k,
                                  deadline=deadline)
        except asyncio.TimeoutError:
            return _error(504, f"the search took longer than the limit of {state.timeout_s:g} s")
        except ImageSizeError as exc:
            return _error(413, str(exc))
        except (ImageDecodeError, ValueError) as exc:
            return _error(400, str(exc))
    finally:
        if not handed:
            state.searches.release()
        if form is not None:
            await form.close()
    for r in rows:
        r["thumbnail"] = f"/thumb/{r['id']}"
        r["path"] = Path(r["path"]).name if r["path"] else ""
    return JSONResponse(query_answer(name, rows))  # "k": the neighbours given, as 'search --json' says


async def thumb(state: AppState, request):
    i = request.path_params["item"]
    try:
        size = read_thumb_size(request.query_params.get("size", str(state.thumb_size)))
    except ValueError as exc:
        return _error(400, str(exc))
    now = state.served["now"]
    if not 0 <= i < len(now.index) or not now.index.paths[i]:
        return _error(404, f"no image {i} in this index")
    key = (now.generation, i, size)
    png = state.thumbnails.recall(key)
    if png is None:
        if not state.thumbs.try_acquire():
            return _busy("thumbnails", state.thumbs)
        try:
            png = await _run_job(state, state.thumbs, thumbnail_png, now.index.paths[i], size, now.decode_bytes,
                                 deadline=time.monotonic() + state.timeout_s)
        except asyncio.TimeoutError:
            return _error(504, f"the thumbnail took longer than the limit of {state.timeout_s:g} s")
        except (OSError, ValueError) as exc:
            return _error(404, f"image {i} of the index cannot be read ({_reason(exc)})")
        state.thumbnails.keep(key, png)
    return Response(png, media_type="image/png", headers={"cache-control": "max-age=3600"})


async def reload(state: AppState, request):
    """Read the index folder again and switch to it; refused (409, the loaded index keeps
    serving) when the folder does not check out. ``request`` is None for ``kill -HUP``."""
    if state.reload_lock.locked():
        return _error(409, "a reload is already running")
    async with state.reload_lock:
        now = state.served["now"]
        if now.directory is None:
            return _error(409, "this index was not loaded from a folder: nothing to reload")
        loop = asyncio.get_running_loop()
        try:
            new = await loop.run_in_executor(
                None, lambda: load_folder(now.directory, generation=now.generation + 1,
                                          max_decode_mb=state.max_decode_mb, checkpoint=state.checkpoint,
                                          device=state.device, previous=now))
        except (ValueError, OSError, KeyError, RuntimeError) as exc:
            state.say(f"deepmetric serve: reload refused, still serving the previous index: {exc}")
            return _error(409, f"reload refused, still serving the previous index: {exc}")
        state.served["now"] = new
        state.thumbnails.keep_generation(new.generation)
        if state.default_k > len(new.index):
            state.say(f"deepmetric serve: the reloaded index holds {len(new.index)} images, fewer than "
                      f"--k {state.default_k}")
        images = counted(len(new.index), "image")
        state.say(f"deepmetric serve: reloaded {now.directory}: {images} (was {len(now.index)})")
        return JSONResponse({"reloaded": True, "count": len(new.index), "previous_count": len(now.index),
                             "generation": new.generation})


async def _not_found(request, exc):
    return _error(404, f"not found: {request.url.path}")


async def _server_error(request, exc):
    return _error(500, f"internal error: {type(exc).__name__}")


def routes(state: AppState) -> list[Route]:
    """The app's routes over ``state``."""
    return [Route("/", partial(home, state)), Route("/api/info", partial(info, state)),
            Route("/api/reload", partial(reload, state), methods=["POST"]),
            Route("/search", partial(search, state), methods=["POST"]),
            Route("/thumb/{item:int}", partial(thumb, state))]


def exception_handlers() -> dict:
    """JSON answers for unknown paths (404) and for errors no route expected (500)."""
    return {404: _not_found, 500: _server_error}
