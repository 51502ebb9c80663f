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
from .store import IndexFilesError, check_inside, check_listed_names, files_error, plain_file, verify_files

__all__ = ["Folder", "read_manifest", "check_present", "check_files", "read_parts", "check_rows", "load_postprocess",
           "exists", "INDEX_FORMAT", "INDEX_VERSION", "KINDS"]

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
        nofollow = getattr(os, "O_NOFOLLOW", 0)  # a writer never stores links: refuse to follow one
        return open(rel, "rb", opener=lambda p, flags: os.open(p, flags | nofollow, dir_fd=self.fd))

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
    """The checked manifest (its ``files`` names too: never outside the folder, checked before
    any listed file is opened) and ``{"manifest.json": bytes}``."""
    check_present(d, ("manifest.json",))
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
    if manifest.get("files") is not None:
        check_listed_names(d, manifest["files"])
    elif manifest.get("version", 1) >= 2:  # every writer of version 2 on lists them: not to be skipped silently
        raise ValueError(f"{d / 'manifest.json'}: index version {manifest['version']} but no 'files' (the size and "
                         "SHA-256 of every file, written with the index): the manifest was edited or damaged, so "
                         f"the index cannot be checked; rebuild it ('deepmetric index ... --out {d} --overwrite')")
    return manifest, raw


def check_present(d: Path, names) -> None:
    """Each of ``names`` is a plain file in ``d``: FileNotFoundError for missing ones, else
    IndexFilesError for links and other odd files (a writer only stores plain files)."""
    state = {name: plain_file(d, name) for name in dict.fromkeys(names)}
    missing = [f for f, st in state.items() if st == "missing"]
    if missing:
        raise FileNotFoundError(f"{d} is not a deepmetric index: missing {', '.join(missing)}")
    odd = [f"{f}: {st}" for f, st in state.items() if isinstance(st, str)]
    if odd:
        raise files_error(d, odd)


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
        raise files_error(d, bad)
    verify_files(d, {k: v for k, v in files.items() if k not in raw}, hashes=verify_hashes)


def read_parts(d: Path, raw: dict, kind: str, v3: bool, mapped: bool):
    """``(embeddings, labels, class_names, paths, faiss index)`` from the bytes read / the folder."""
    import faiss

    vectors = VECTORS_FILE if kind == "ivfpq" else "embeddings.npy"
    emb = (np.load(d / vectors, mmap_mode="r", allow_pickle=False) if mapped
           else _npy_from_buffer(raw[vectors], str(d / vectors)))
    if v3:
        paths, labels, names_ = read_metadata(d, raw)  # checks that relative paths stay inside
    else:
        labels = _npy_from_buffer(raw["labels.npy"], str(d / "labels.npy"))
        names_ = json.loads(bytes(raw["class_names.json"]).decode("utf-8"))
        rel = json.loads(bytes(raw["paths.json"]).decode("utf-8"))
        if not isinstance(rel, list):
            raise IndexFilesError(f"{d / 'paths.json'}: expected a list of paths, got {type(rel).__name__}")
        check_inside(rel, str(d / "paths.json"))
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




def check_rows(d: Path, emb: np.ndarray, labels: np.ndarray, class_names: list, *, v3: bool, vectors: str) -> None:
    """Every row of a loaded index is searchable and named: finite embeddings (faiss would
    silently drop a NaN row from the results) and labels that index the class names. A mapped
    file is read in chunks of ~64 MiB (its pages are dropped with the mapping afterwards)."""
    labels_file, names_file = ("metadata.arrow", "class_names.arrow") if v3 else ("labels.npy", "class_names.json")
    if not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"{d / labels_file}: labels must be integers, got dtype {labels.dtype}")
    if len(labels) and (int(labels.min()) < 0 or int(labels.max()) >= len(class_names)):
        bad = int(np.flatnonzero((labels < 0) | (labels >= len(class_names)))[0])
        raise ValueError(f"{d / labels_file}: row {bad} has label {int(labels[bad])}, but {names_file} "
                         f"names {len(class_names)} classes (labels 0..{len(class_names) - 1})")
    step = max(1, (1 << 26) // max(1, emb.shape[1] * emb.itemsize))
    for a in range(0, emb.shape[0], step):
        finite = np.isfinite(_rows(emb, a, step)).all(axis=1)
        if not finite.all():
            bad = a + int(np.flatnonzero(~finite)[0])
            raise ValueError(f"{d / vectors}: row {bad} holds NaN or infinite values; "
                             "the index is damaged: rebuild it with 'deepmetric index ... --overwrite'")


def _rows(emb: np.ndarray, a: int, n: int) -> np.ndarray:
    """Rows ``a:a+n``; of a mapped file read with ``pread`` into a buffer, so that checking a
    large mapped file never leaves its pages resident in this process."""
    if not isinstance(emb, np.memmap) or emb.filename is None or not emb.flags.c_contiguous:
        return emb[a:a + n]
    n = min(n, emb.shape[0] - a)
    row = emb.shape[1] * emb.itemsize
    fd = os.open(emb.filename, os.O_RDONLY)
    try:
        buf = os.pread(fd, n * row, emb.offset + a * row)
    finally:
        os.close(fd)
    return np.frombuffer(buf, emb.dtype).reshape(n, emb.shape[1])


def load_postprocess(meta: dict, raw: bytearray | None, d: Path):
    """The fitted :class:`~deepmetric.search.postprocess.Postprocessor` of a loaded index
    (``postprocess.npz``, read into ``raw``), or None when the manifest lists no steps."""
    entry = meta.get("postprocess")
    if not entry:
        return None
    from .postprocess import Postprocessor

    if raw is None:
        raise FileNotFoundError(f"{d}: the manifest lists post-processing but postprocess.npz is missing; "
                                "rebuild the index with 'deepmetric index ... --overwrite'")
    try:
        with np.load(io.BytesIO(bytes(raw)), allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
        return Postprocessor.from_state(entry["steps"], arrays, where=f"{d / 'manifest.json'} postprocess")
    except (ValueError, KeyError, OSError) as exc:
        raise ValueError(f"{d / 'postprocess.npz'}: {exc}") from None
