"""The index ``deepmetric serve`` answers from: loaded into memory and verified (the model makes
embeddings of the index's size), numbered by generation (each reload is the next), and compared
with its folder on disk so that a change is noticed and printed, never served before a reload."""
from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Loaded", "prepare", "load_folder", "watch_folder"]

_WATCHED = ("manifest.json", "embeddings.npy", "vectors.f16.npy", "metadata.arrow", "class_names.arrow", "labels.npy",
            "class_names.json", "paths.json", "index.faiss", "postprocess.npz")
_CHECK_EVERY_S = 2.0  # how often the index folder is compared with what was loaded


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
class Loaded:
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


def prepare(index, *, generation: int, max_decode_mb, checkpoint=None, device: str = "cpu",
            previous: Loaded | None = None) -> Loaded:
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
    return Loaded(index, pre, pre.decode_limit(max_decode_mb), d, _file_stats(d) if d else {}, generation)


def load_folder(index_dir: Path, **kw) -> Loaded:
    """:func:`prepare` over the index folder read again (every file's SHA-256 checked)."""
    from .index import Index

    return prepare(Index.load(index_dir, verify_hashes=True), **kw)


async def watch_folder(served: dict, say) -> None:
    """Say once per change that the folder on disk is not what is served (``served["now"]``)."""
    noticed = -1  # the generation whose change was said
    while True:
        await asyncio.sleep(_CHECK_EVERY_S)
        now = served["now"]
        if noticed != now.generation and now.directory is not None:
            changed = await asyncio.get_running_loop().run_in_executor(None, now.changed_on_disk)
            if changed and served["now"] is now:
                noticed = now.generation
                say(f"deepmetric serve: the index folder {now.directory} changed on disk; still serving the "
                    f"index loaded at start or last reload (reload: POST /api/reload or kill -HUP {os.getpid()})")
