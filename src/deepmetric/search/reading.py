"""Reading an index folder: its files through one descriptor of the folder, the manifest's
checks, and the parts of both formats (version 2: JSON metadata; version 3: Arrow). Used by
:meth:`deepmetric.search.index.Index.load`."""
from __future__ import annotations

import hashlib
import io
import json
import os
import warnings
from pathlib import Path

import numpy as np

from .compressed import VECTORS_FILE
from .metadata import read_metadata
from .store import IndexFilesError, verify_files

__all__ = ["Folder", "read_manifest", "check_files", "read_parts", "exists", "INDEX_FORMAT", "INDEX_VERSION", "KINDS"]

INDEX_FORMAT = "deepmetric-index"
INDEX_VERSION = 3  # 2: manifest.json lists every file's size and SHA-256 ("files"); 3: metadata.arrow
KINDS = ("exact", "ivf", "hnsw", "ivfpq")


class Folder:
    """Reads the files of one index folder through a descriptor of the folder, so that a
    folder swapped in by a writer meanwhile is never mixed with the old one."""

    def __init__(self, d: Path):
        self.d = d
        self.fd = os.open(d, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))

    def close(self):
        os.close(self.fd)

    def open(self, rel: str):
        return open(rel, "rb", opener=lambda p, flags: os.open(p, flags, dir_fd=self.fd))

    def read(self, rel: str) -> bytearray:
        with self.open(rel) as f:
            size = os.fstat(f.fileno()).st_size
            buf = bytearray(size)
            view, got = memoryview(buf), 0
            while got < size:
                n = f.readinto(view[got:])
                if not n:
                    raise IndexFilesError(f"{self.d / rel}: file shrank while it was read")
                got += n
        return buf

    def size(self, rel: str) -> int:
        return os.stat(rel, dir_fd=self.fd).st_size


def _npy_from_buffer(buf: bytearray, name: str) -> np.ndarray:
    """A ``.npy`` array viewing ``buf`` (no copy, no pickles)."""
    f = io.BytesIO(buf)
    version = np.lib.format.read_magic(f)
    if version == (1, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
    else:
        shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
    if dtype.hasobject:
        raise ValueError(f"{name}: holds Python objects; an index stores plain numbers")
    count = int(np.prod(shape)) if shape else 1
    arr = np.frombuffer(buf, dtype=dtype, count=count, offset=f.tell())
    return arr.reshape(shape, order="F" if fortran else "C")


def read_manifest(folder: "Folder", d: Path) -> tuple[dict, dict]:
    if not exists(folder, "manifest.json"):
        raise FileNotFoundError(f"{d} is not a deepmetric index: missing manifest.json")
    raw = {"manifest.json": folder.read("manifest.json")}
    try:
        manifest = json.loads(bytes(raw["manifest.json"]).decode("utf-8"))
    except ValueError as exc:
        raise ValueError(f"{d / 'manifest.json'}: not valid JSON ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != INDEX_FORMAT:
        raise ValueError(f"{d / 'manifest.json'}: format {manifest.get('format') if isinstance(manifest, dict) else None!r}, "
                         f"expected {INDEX_FORMAT!r}")
    if manifest.get("version", 0) > INDEX_VERSION:
        raise ValueError(f"{d}: index version {manifest['version']} is newer than this deepmetric "
                         f"reads ({INDEX_VERSION}); upgrade deepmetric")
    if manifest.get("kind") not in KINDS:
        raise ValueError(f"{d / 'manifest.json'}: kind {manifest.get('kind')!r}, expected one of {KINDS}")
    return manifest, raw


def check_files(d: Path, files: dict | None, raw: dict, manifest: dict, verify_hashes: bool) -> None:
    """Sizes (and SHA-256s) of the manifest's files: those read into ``raw`` from memory, the
    others on disk (:func:`verify_files`)."""
    if files is None:
        warnings.warn(f"{d}: index written by an older deepmetric (version {manifest.get('version', 1)}) "
                      "without file sizes and SHA-256s, so it cannot be checked; rebuild it with "
                      f"'deepmetric index CHECKPOINT ... --out {d} --overwrite' (an --add also "
                      "rewrites it with them)", stacklevel=3)
        return
    bad = []
    for rel, entry in files.items():
        if rel in raw:
            if len(raw[rel]) != entry["bytes"]:
                bad.append(f"{rel}: {len(raw[rel])} bytes, the manifest says {entry['bytes']}")
            elif verify_hashes and hashlib.sha256(raw[rel]).hexdigest() != entry["sha256"]:
                bad.append(f"{rel}: SHA-256 differs from the manifest's")
    if bad:
        raise IndexFilesError(f"{d}: files changed since the index was written: {'; '.join(bad)}. "
                              "Rebuild it with 'deepmetric index ... --overwrite'")
    verify_files(d, {k: v for k, v in files.items() if k not in raw}, hashes=verify_hashes)


def read_parts(d: Path, raw: dict, kind: str, v3: bool, mapped: bool):
    """``(embeddings, labels, class_names, paths, faiss index)`` from the bytes read / the folder."""
    import faiss

    vectors = VECTORS_FILE if kind == "ivfpq" else "embeddings.npy"
    emb = (np.load(d / vectors, mmap_mode="r", allow_pickle=False) if mapped
           else _npy_from_buffer(raw[vectors], str(d / vectors)))
    if v3:
        paths, labels, names_ = read_metadata(d, raw)
    else:
        labels = _npy_from_buffer(raw["labels.npy"], str(d / "labels.npy"))
        names_ = json.loads(bytes(raw["class_names.json"]).decode("utf-8"))
        rel = json.loads(bytes(raw["paths.json"]).decode("utf-8"))
        root = d.resolve()
        paths = [p if (not p or os.path.isabs(p)) else str(root / p) for p in rel]
    faiss_index = (faiss.deserialize_index(np.frombuffer(raw["index.faiss"], dtype=np.uint8))
                   if kind != "exact" else None)
    return emb, labels, names_, paths, faiss_index


def exists(folder: Folder, rel: str) -> bool:
    try:
        folder.size(rel)
        return True
    except FileNotFoundError:
        return False


