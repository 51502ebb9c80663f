"""A search index: l2-normalised embeddings of a gallery with their labels, class names and
image paths, the checkpoint that made them (path, SHA-256, config) and a faiss index.

On disk (``deepmetric index ... --out INDEX_DIR``)::

    INDEX_DIR/manifest.json     format, kind, count, dim, checkpoint {path, sha256, config},
                                preprocessing, data {name, root, split}, approximate recall
    INDEX_DIR/embeddings.npy    float32 [N, d], l2-normalised (numpy .npy, no pickles)
    INDEX_DIR/labels.npy        int64 [N], indices into class_names.json
    INDEX_DIR/class_names.json  class name per label
    INDEX_DIR/paths.json        image path per row (relative ones are inside INDEX_DIR)
    INDEX_DIR/index.faiss       faiss index: IndexFlatIP (exact), IndexIVFFlat or IndexHNSWFlat
    INDEX_DIR/images/           PNG copies of images that exist only in memory (glyphs, MNIST)
    INDEX_DIR/postprocess.npz   with post-processing (manifest ``postprocess``: the steps and the
                                query dimension): the fitted whitening (whiten_mean, whiten_projection)

With post-processing (``search.postprocess`` of the checkpoint's config or ``--postprocess``;
:mod:`deepmetric.search.postprocess`) ``embeddings.npy`` holds the processed gallery (whitened
and reduced, DBA-augmented); :meth:`Index.search` applies the query side (whitening, alpha-QE)
and the k-reciprocal re-ranking, so ``search`` and ``serve`` answer with the processed ranking.

``manifest.json`` (version 2) lists every other file's size and SHA-256 (``files``). Folders
are written as transactions (:mod:`deepmetric.search.store`): into a temporary folder beside
the target, swapped in atomically, so a failed ``index`` / ``index --add`` leaves the old
index byte-identical. :meth:`Index.load` checks every listed file's size (and SHA-256 with
``verify_hashes=True``, as ``deepmetric serve`` does at start and on reload); an index written
before version 2 has no ``files`` and loads with a warning saying how to rebuild it.

Exact search ranks by inner product with the exact faiss backend of
:mod:`deepmetric.evaluate.knn` (chunked by a memory budget, ties by the smaller index), or
its torch backend on a GPU when the index's ``search_device`` is CUDA (``deepmetric index``
on a GPU machine: the exact search behind an approximate index's recall);
``index.faiss`` is then only written for other tools. Approximate indexes (``ivf`` / ``hnsw``,
built by the same module's approximate backends) are searched through ``index.faiss``; their
recall@10 against exact search is measured when they are built and stored in the manifest.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import time
import warnings
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from .query import (Preprocessing, approximate_search, as_query_list, embed_images, exact_search,
                    recall_against_exact)
from .store import (IndexFilesError, carry_file, check_inside, check_listed_names, check_utf8, file_entries,
                    file_sha256, files_error, index_transaction, plain_file, verify_files, write_file)

__all__ = ["Index", "EmbeddingIndex", "INDEX_FORMAT", "file_sha256", "IndexFilesError", "is_index_dir"]

INDEX_FORMAT = "deepmetric-index"
INDEX_VERSION = 2  # 2: manifest.json lists every file's size and SHA-256 ("files")
KINDS = ("exact", "ivf", "hnsw")
_FILES = ("manifest.json", "embeddings.npy", "labels.npy", "class_names.json", "paths.json")
_MANIFEST_OWN = ("format", "version", "kind", "count", "dim", "classes", "files")


def is_index_dir(path: str | Path) -> bool:
    """Whether ``path`` is a folder with a deepmetric ``manifest.json``."""
    m = Path(path) / "manifest.json"
    try:
        return m.is_file() and json.loads(m.read_text(encoding="utf-8")).get("format") == INDEX_FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def check_out_dir(out: str | Path, *, overwrite: bool) -> None:
    """Refuse to replace an existing index without ``overwrite``, and any non-empty folder that
    is not an index (``--overwrite`` only ever replaces an index)."""
    d = Path(out)
    if not d.exists():
        return
    if not d.is_dir():
        raise FileExistsError(f"--out {d} is a file, not an index folder")
    if not any(d.iterdir()):
        return
    if not is_index_dir(d):
        raise FileExistsError(f"--out {d} is a folder that is not empty and not a deepmetric index; choose "
                              "another --out (--overwrite only replaces an index)")
    if not overwrite:
        try:
            count = json.loads((d / "manifest.json").read_text(encoding="utf-8")).get("count")
        except (OSError, ValueError):
            count = "?"
        raise FileExistsError(f"--out {d} already holds an index ({count} images); add images to it with "
                              "--add, replace it with --overwrite, or choose another --out")


class _Folder:
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


def _normalised(x, name: str) -> np.ndarray:
    from deepmetric.evaluate import check_embeddings

    arr = np.asarray(x.detach().cpu().numpy() if hasattr(x, "detach") else x)
    if arr.ndim == 1:
        arr = arr[None, :]
    return check_embeddings(arr, name)


class Index:
    """Embeddings + labels + class names + paths + provenance, searchable by cosine.

    Build one with :meth:`build` (from a checkpoint and a dataset) or :meth:`from_embeddings`,
    keep it with :meth:`save`, open it with :meth:`load`, query it with :meth:`search`
    (embeddings or images) and turn the result into rows with :meth:`neighbours`.
    ``search_device`` (default the CPU) is where exact searches run (a CUDA device: the
    torch backend on the GPU, same results as faiss).
    """

    def __init__(self, embeddings, labels=None, paths: Sequence[str] | None = None,
                 class_names: Sequence[str] | None = None, *, kind: str = "exact",
                 meta: dict | None = None, directory: str | Path | None = None, search_device=None,
                 postprocess=None):
        if kind not in KINDS:
            raise ValueError(f"index kind must be one of {KINDS}, got {kind!r}")
        self.embeddings = _normalised(embeddings, "index embeddings")
        self.postprocessor, meta = _fit_postprocess(self, postprocess, meta)
        n = self.embeddings.shape[0]
        self.labels = (np.zeros(n, np.int64) if labels is None
                       else np.asarray(labels, dtype=np.int64).reshape(-1))
        if self.labels.shape[0] != n:
            raise ValueError(f"index: {self.labels.shape[0]} labels for {n} embeddings")
        self.class_names = ([str(c) for c in class_names] if class_names is not None
                            else [str(i) for i in range(int(self.labels.max()) + 1 if n else 0)])
        if n and self.labels.max() >= len(self.class_names):
            raise ValueError(f"index: label {int(self.labels.max())} has no class name "
                             f"({len(self.class_names)} names)")
        self.paths = [str(p) for p in paths] if paths is not None else [""] * n
        if len(self.paths) != n:
            raise ValueError(f"index: {len(self.paths)} paths for {n} embeddings")
        self.kind = kind
        self.meta: dict[str, Any] = dict(meta or {})
        self.directory = Path(directory) if directory is not None else None
        self.faiss_index = None
        self.manifest_files = None  # {relative path: {bytes, sha256}} of a loaded index
        self._model = None
        self.search_device = search_device or "cpu"
        if kind != "exact":
            self._build_approximate()

    # ------------------------------------------------------------------ basics
    def __len__(self) -> int:
        return self.embeddings.shape[0]

    @property
    def dim(self) -> int:
        return self.embeddings.shape[1]

    @property
    def query_dim(self) -> int:
        """The dimension of the model's embeddings (``dim`` unless a whitening reduced it)."""
        return int((self.meta.get("postprocess") or {}).get("query_dim", self.dim))

    def __repr__(self) -> str:
        return (f"Index(kind={self.kind!r}, n={len(self)}, dim={self.dim}, classes={len(self.class_names)}, "
                f"directory={str(self.directory) if self.directory else None!r})")

    def _build_approximate(self) -> None:
        from deepmetric.evaluate.knn import build_approximate_index

        t = time.perf_counter()
        self.faiss_index = build_approximate_index(self.embeddings, f"faiss-{self.kind}", k=10)
        self.meta["approximate"] = {
            "kind": self.kind, "build_s": round(time.perf_counter() - t, 3),
            "recall@10_vs_exact": recall_against_exact(self.embeddings, self.faiss_index, k=10,
                                                       device=self.search_device),
            "recall_queries": min(1000, len(self)),
        }

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_embeddings(cls, embeddings, labels=None, paths=None, class_names=None, *,
                        approximate: str | None = None, meta: dict | None = None, postprocess=None) -> "Index":
        return cls(embeddings, labels, paths, class_names, kind=approximate or "exact", meta=meta,
                   postprocess=postprocess)

    @classmethod
    def build(cls, checkpoint: str | Path, *, data: str | None = None, root: str | None = None,
              split: str | None = None, out: str | Path | None = None, approximate: str | None = None,
              add: bool = False, overwrite: bool = False, options: dict | None = None,
              batch_size: int = 256, device: str = "auto", num_workers: int = 0,
              progress: bool = True, search_device: str = "auto", postprocess=None) -> "Index":
        """Embed a dataset split with ``checkpoint`` (its test transform) and index it.

        ``data`` / ``root`` default to the checkpoint's training data; ``split`` defaults to
        ``all`` for ``folder`` / ``csv`` and ``test`` otherwise. With ``add=True`` the images are
        added to the index in ``out`` (which must come from the same checkpoint; images whose
        path is already indexed are skipped). The index is saved to ``out`` when given, as a
        transaction: any failure leaves what was in ``out`` byte-identical. An existing index
        in ``out`` is refused unless ``add`` or ``overwrite``; a non-empty folder that is not an
        index always is. The model runs on ``device``; the exact searches (an approximate
        index's recall against exact search) where
        :func:`~deepmetric.train.embed.command_search_device` says. ``postprocess``: steps
        (:func:`deepmetric.search.postprocess.check_steps`; default the checkpoint's
        ``search.postprocess``; ``[]`` for none) fitted on the indexed gallery.
        """
        if add and out is None:
            raise ValueError("add=True needs out=INDEX_DIR, the index to add to")
        if approximate not in (None, "exact", "ivf", "hnsw"):
            raise ValueError(f"approximate must be 'ivf' or 'hnsw' (or None for exact), got {approximate!r}")
        from deepmetric.train.embed import command_search_device

        command_search_device(device, search_device)  # bad values are refused before any work
        if postprocess is not None:
            from .postprocess import check_steps

            postprocess = check_steps(postprocess, "--postprocess")  # refused before any work
        kw = dict(data=data, root=root, split=split, options=options, batch_size=batch_size, device=device,
                  num_workers=num_workers, progress=progress, search_device=search_device, postprocess=postprocess)
        if out is None:
            return cls._build(checkpoint, None, None, approximate=approximate, add=False, **kw)
        out = Path(out)
        if not add:
            check_out_dir(out, overwrite=overwrite)
        with index_transaction(out) as tmp:  # the old index is read and replaced under one lock
            index = cls._build(checkpoint, out, tmp, approximate=approximate, add=add, **kw)
            rel_paths = index._write(tmp, out)
        index._settle(out, rel_paths)
        return index

    @classmethod
    def _build(cls, checkpoint, out: Path | None, tmp: Path | None, *, data, root, split, options,
               approximate, add, batch_size, device, num_workers, progress, search_device,
               postprocess=None) -> "Index":
        from .build import embed_dataset_for_index

        old = None
        if add:
            old = cls.load(out, verify_hashes=True)  # never bless a damaged index with fresh hashes
            approximate = old.kind if old.kind != "exact" else None
        sha = file_sha256(checkpoint) if Path(checkpoint).is_file() else None
        if old is not None and sha is not None and old.meta.get("checkpoint", {}).get("sha256") != sha:
            c = old.meta.get("checkpoint", {})
            raise ValueError(
                f"index {out} was built with checkpoint {c.get('path')} (sha256 {str(c.get('sha256'))[:12]}), "
                f"not {checkpoint} (sha256 {sha[:12]}): embeddings of different models cannot be "
                "compared; build a new index with another --out")
        skip = set(old.paths) if old is not None else set()
        images_dir = tmp / "images" if tmp is not None else None
        got = embed_dataset_for_index(checkpoint, data=data, root=root, split=split, options=options,
                                      batch_size=batch_size, device=device, num_workers=num_workers,
                                      progress=progress, skip_paths=skip, images_dir=images_dir,
                                      first_image_number=len(old) if old is not None else 0)
        from deepmetric.train.embed import command_search_device

        where = command_search_device(device, search_device, nbytes=got["embeddings"].nbytes)
        if old is not None:
            old.search_device = where
            if len(got["paths"]):
                old.add(got["embeddings"], got["labels"], got["paths"], got["class_names"])
            old.meta.setdefault("added", []).append(got["data"])
            index = old
        else:
            meta = {"checkpoint": {"path": str(Path(checkpoint).resolve()), "sha256": sha,
                                   "config": got["config"]},
                    "preprocessing": got["preprocessing"], "data": got["data"]}
            if postprocess is None:  # the checkpoint's search.postprocess
                postprocess = ((got["config"] or {}).get("search") or {}).get("postprocess") or []
            index = cls(got["embeddings"], got["labels"], got["paths"], got["class_names"],
                        kind=approximate or "exact", meta=meta, search_device=where, postprocess=postprocess)
        index.meta["skipped_already_indexed"] = got["skipped"]
        return index

    def add(self, embeddings, labels=None, paths: Sequence[str] | None = None,
            class_names: Sequence[str] | None = None) -> None:
        """Append rows. Labels are given in ``class_names`` (default: this index's names) and
        are mapped by name: new names are appended to :attr:`class_names`. With post-processing
        the rows are whitened with the stored fit (an index with DBA is refused: rebuild it)."""
        e = _normalised(embeddings, "added embeddings")
        if self.postprocessor is not None:
            e = self.postprocessor.add_gallery_rows(e)
        if e.shape[1] != self.dim:
            raise ValueError(f"added embeddings have dimension {e.shape[1]} but the index has {self.dim} "
                             "(another model or embedding size?)")
        n = e.shape[0]
        lab = np.zeros(n, np.int64) if labels is None else np.asarray(labels, np.int64).reshape(-1)
        if lab.shape[0] != n:
            raise ValueError(f"{lab.shape[0]} labels for {n} added embeddings")
        if class_names is not None:
            where = {c: i for i, c in enumerate(self.class_names)}
            mapping = []
            for c in map(str, class_names):
                if c not in where:
                    where[c] = len(self.class_names)
                    self.class_names.append(c)
                mapping.append(where[c])
            lab = np.asarray(mapping, np.int64)[lab] if n else lab
        elif n and lab.max() >= len(self.class_names):
            raise ValueError(f"added label {int(lab.max())} has no class name; pass class_names")
        new_paths = [str(p) for p in paths] if paths is not None else [""] * n
        if len(new_paths) != n:
            raise ValueError(f"{len(new_paths)} paths for {n} added embeddings")
        self.embeddings = np.ascontiguousarray(np.concatenate([self.embeddings, e]))
        self.labels = np.concatenate([self.labels, lab])
        self.paths += new_paths
        if self.faiss_index is not None:
            self.faiss_index.add(e)
            self.meta["approximate"]["recall@10_vs_exact"] = recall_against_exact(
                self.embeddings, self.faiss_index, k=10, device=self.search_device)

    # ------------------------------------------------------------------ search
    def model(self, checkpoint: str | Path | None = None, device: str = "cpu"):
        """``(model, preprocessing)`` of the checkpoint that built the index (loaded once). The
        checkpoint file is checked against the SHA-256 in the manifest."""
        if self._model is None:
            from deepmetric.train.embed import load_model_from_checkpoint

            c = self.meta.get("checkpoint") or {}
            path = checkpoint or c.get("path")
            if not path:
                raise ValueError("this index has no checkpoint (built from embeddings): search it with "
                                 "embeddings, not images")
            if not Path(path).is_file():
                raise FileNotFoundError(f"the index's checkpoint {path} is missing; pass the moved file "
                                        "(--checkpoint FILE / checkpoint=...)")
            sha = file_sha256(path)
            if c.get("sha256") and sha != c["sha256"]:
                raise ValueError(f"checkpoint {path} (sha256 {sha[:12]}) is not the one that built this index "
                                 f"(sha256 {c['sha256'][:12]}, {c.get('path')}): its embeddings would not "
                                 "be comparable")
            model, _, _, _ = load_model_from_checkpoint(path, device)
            self._model = (model, Preprocessing.from_dict(self.meta["preprocessing"]), device)
        return self._model[:2]

    def embed(self, images, *, batch_size: int = 64) -> np.ndarray:
        """l2-normalised embeddings of image paths / PIL images with the index's checkpoint."""
        model, pre = self.model()
        return embed_images(model, pre, as_query_list(images), batch_size=batch_size, device=self._model[2])

    def search(self, queries, k: int = 10, *, memory_mb: float | None = None):
        """Top-``k`` neighbours of each query: ``(sims, idx)``, (Nq, min(k, len(index))) cosine
        similarities (descending; ties by the smaller row) and row numbers (an approximate index
        pads rows it could not fill with -1 / -inf).

        ``queries``: embeddings (``[d]`` or ``[Nq, d]`` array / tensor) or images (a path, a PIL
        image, or a list of them), embedded with the index's checkpoint."""
        if isinstance(queries, np.ndarray) or hasattr(queries, "detach"):
            q = _normalised(queries, "query embeddings")
        else:
            q = self.embed(queries)
            bad = np.flatnonzero(~np.isfinite(q).all(axis=1))
            if len(bad):  # faiss would answer such a row with fewer (or no) neighbours
                raise ValueError(f"query image {as_query_list(queries)[bad[0]]} embeds as NaN / inf with this "
                                 "index's checkpoint; no neighbours can be ranked for it")
        if q.shape[1] != self.query_dim:
            raise ValueError(f"query embeddings have dimension {q.shape[1]} but the index has {self.query_dim} "
                             "(another model or embedding size?)")
        k = int(k)
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        post = self.postprocessor
        width = max(k, post.list_length) if post is not None else k
        if post is not None:
            q = post.transform_queries(q, self.embeddings)
        if self.faiss_index is not None:
            sims, idx = approximate_search(self.faiss_index, q, width)
        else:
            sims, idx = exact_search(self.embeddings, q, width, memory_mb=memory_mb, device=self.search_device)
        if post is not None and post.list_length:
            sims, idx = post.rerank(q, self.embeddings, sims, idx)
        return sims[:, :k], idx[:, :k]

    def neighbours(self, sims: np.ndarray, idx: np.ndarray) -> list[list[dict]]:
        """Per query, its neighbours as dicts: rank (1-based), id (row), path, label, class_name,
        cosine."""
        out = []
        for srow, irow in zip(sims, idx):
            out.append([{"rank": r + 1, "id": int(i), "path": self.paths[i], "label": int(self.labels[i]),
                         "class_name": self.class_names[self.labels[i]], "cosine": float(s)}
                        for r, (s, i) in enumerate(zip(srow, irow)) if i >= 0])
        return out

    # ------------------------------------------------------------------ files
    def save(self, directory: str | Path) -> Path:
        """Write the index to ``directory`` as a transaction (:mod:`deepmetric.search.store`):
        an index already there is replaced atomically, a failure leaves it byte-identical; a
        non-empty folder that is not an index is refused."""
        d = Path(directory)
        if d.exists() and d.is_dir() and any(d.iterdir()) and not is_index_dir(d):
            check_out_dir(d, overwrite=True)  # raises: not an index
        with index_transaction(d) as tmp:
            rel_paths = self._write(tmp, d)
        self._settle(d, rel_paths)
        return d

    def _write(self, tmp: Path, final: Path) -> list[str]:
        """Write every file into the empty folder ``tmp`` (to become ``final``): images the index
        owns (below ``final`` or its current folder) are carried along; ``manifest.json`` last,
        with every file's size and SHA-256. Returns the paths as stored."""
        import faiss

        for name in self.class_names:
            check_utf8(name, "class name")
        for p in self.paths:
            check_utf8(p, "image path")
        roots = [tmp.resolve()]
        for r in (final, self.directory):
            if r is not None and Path(r).exists() and Path(r).resolve() not in roots:
                roots.append(Path(r).resolve())
        stored = []
        for p in self.paths:
            rel = None
            if p:
                rp = Path(p).resolve()
                for k, r in enumerate(roots):
                    try:
                        rel = rp.relative_to(r).as_posix()
                    except ValueError:
                        continue
                    if k and not (tmp / rel).exists():
                        carry_file(rp, tmp / rel)
                    break
            stored.append(rel if rel is not None else p)
        index = self.faiss_index
        if index is None:
            index = faiss.IndexFlatIP(self.dim)
            index.add(np.ascontiguousarray(self.embeddings, dtype=np.float32))
        with open(tmp / "embeddings.npy", "wb") as f:
            np.save(f, np.ascontiguousarray(self.embeddings), allow_pickle=False)
        with open(tmp / "labels.npy", "wb") as f:
            np.save(f, np.asarray(self.labels, np.int64), allow_pickle=False)
        write_file(tmp / "class_names.json", json.dumps(self.class_names, ensure_ascii=False).encode("utf-8"))
        write_file(tmp / "paths.json", json.dumps(stored, ensure_ascii=False).encode("utf-8"))
        # serialised here and written by Python: a full disk is an OSError (ENOSPC) that
        # index_transaction explains, not faiss's RuntimeError
        write_file(tmp / "index.faiss", faiss.serialize_index(index))
        extra = ()
        if self.postprocessor is not None:
            with open(tmp / "postprocess.npz", "wb") as f:
                np.savez(f, **self.postprocessor.state())
            extra = ("postprocess.npz",)
        manifest = {"format": INDEX_FORMAT, "version": INDEX_VERSION, "kind": self.kind,
                    "count": len(self), "dim": self.dim, "classes": len(self.class_names),
                    **{k: v for k, v in self.meta.items() if k not in _MANIFEST_OWN},
                    "files": file_entries(tmp)}
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1, ensure_ascii=False), encoding="utf-8")
        for name in _FILES + ("index.faiss",) + extra:  # on disk before the swap makes them the index
            with open(tmp / name, "rb") as f:
                os.fsync(f.fileno())
        return stored

    def _settle(self, d: Path, stored: list[str]) -> None:
        """After the swap: this object describes the files in ``d``."""
        root = d.resolve()
        self.directory = d
        self.paths = [p if (not p or os.path.isabs(p)) else str(root / p) for p in stored]

    @classmethod
    def load(cls, directory: str | Path, *, mmap: bool = False, verify_hashes: bool = False) -> "Index":
        """Open a saved index. Every file listed in the manifest must have its recorded size
        (``verify_hashes=True`` also compares SHA-256s); IndexFilesError names the files that
        differ. ``mmap=True`` maps ``embeddings.npy`` instead of reading it; without it every
        file is read into memory through one descriptor of the folder, so replacing the folder
        or its files later cannot change or break the loaded index."""
        import faiss

        d = Path(directory)
        if not d.is_dir():
            raise FileNotFoundError(f"index folder {d} does not exist (make one with 'deepmetric index')")
        folder = _Folder(d)
        try:
            missing = [f for f in _FILES if plain_file(d, f) == "missing"]
            if missing:
                raise FileNotFoundError(f"{d} is not a deepmetric index: missing {', '.join(missing)}")
            odd = [f"{f}: {st}" for f in _FILES + ("index.faiss",) if isinstance(st := plain_file(d, f), str)
                   and st != "missing"]
            if odd:
                raise files_error(d, odd)
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
            files = manifest.get("files")
            if files is not None:  # before any listed file is opened: never outside the folder
                check_listed_names(d, files)
            kind = manifest["kind"]
            names = ["labels.npy", "class_names.json", "paths.json"] + (["index.faiss"] if kind != "exact" else [])
            if manifest.get("postprocess"):
                names.append("postprocess.npz")
            if not mmap:
                names.append("embeddings.npy")
            for name in names:
                raw[name] = folder.read(name)
            if files is None:
                warnings.warn(f"{d}: index written by an older deepmetric (version {manifest.get('version', 1)}) "
                              "without file sizes and SHA-256s, so it cannot be checked; rebuild it with "
                              f"'deepmetric index CHECKPOINT ... --out {d} --overwrite' (an --add also "
                              "rewrites it with them)", stacklevel=2)
            else:
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
            emb = (np.load(d / "embeddings.npy", mmap_mode="r", allow_pickle=False) if mmap
                   else _npy_from_buffer(raw["embeddings.npy"], str(d / "embeddings.npy")))
            labels = _npy_from_buffer(raw["labels.npy"], str(d / "labels.npy"))
            names_ = json.loads(bytes(raw["class_names.json"]).decode("utf-8"))
            rel = json.loads(bytes(raw["paths.json"]).decode("utf-8"))
            faiss_index = (faiss.deserialize_index(np.frombuffer(raw["index.faiss"], dtype=np.uint8))
                           if kind != "exact" else None)
        finally:
            folder.close()
        if emb.shape != (manifest["count"], manifest["dim"]) or labels.shape != (manifest["count"],) \
                or len(rel) != manifest["count"]:
            raise ValueError(f"{d}: files disagree with manifest.json (count {manifest['count']}, dim "
                             f"{manifest['dim']}; embeddings {emb.shape}, labels {labels.shape}, {len(rel)} paths)")
        _check_rows(d, emb, labels, names_)
        check_inside(rel, str(d / "paths.json"))
        root = d.resolve()
        paths = [p if (not p or os.path.isabs(p)) else str(root / p) for p in rel]
        meta = {k: v for k, v in manifest.items() if k not in _MANIFEST_OWN}
        obj = cls.__new__(cls)
        obj.embeddings, obj.labels, obj.paths, obj.class_names = emb, labels, paths, names_
        obj.kind, obj.meta, obj.directory, obj._model = kind, meta, d, None
        obj.manifest_files = files
        obj.search_device = "cpu"  # a loaded index answers a few queries at a time: faiss
        obj.faiss_index = faiss_index
        obj.postprocessor = _load_postprocess(meta, raw.get("postprocess.npz"), d)
        return obj


def _check_rows(d: Path, emb: np.ndarray, labels: np.ndarray, class_names: list) -> None:
    """Every row of a loaded index is searchable and named: finite embeddings (faiss would
    silently drop a NaN row from the results) and labels that index ``class_names.json``."""
    if not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"{d / 'labels.npy'}: labels must be integers, got dtype {labels.dtype}")
    if len(labels) and (int(labels.min()) < 0 or int(labels.max()) >= len(class_names)):
        bad = int(np.flatnonzero((labels < 0) | (labels >= len(class_names)))[0])
        raise ValueError(f"{d / 'labels.npy'}: row {bad} has label {int(labels[bad])}, but class_names.json "
                         f"names {len(class_names)} classes (labels 0..{len(class_names) - 1})")
    step = max(1, (1 << 26) // max(1, emb.shape[1] * emb.itemsize))  # ~64 MiB of rows at a time
    for a in range(0, emb.shape[0], step):
        finite = np.isfinite(emb[a:a + step]).all(axis=1)
        if not finite.all():
            bad = a + int(np.flatnonzero(~finite)[0])
            raise ValueError(f"{d / 'embeddings.npy'}: row {bad} holds NaN or infinite values; "
                             "the index is damaged: rebuild it with 'deepmetric index ... --overwrite'")


def _fit_postprocess(index: Index, steps, meta: dict | None):
    """Fit ``steps`` on the index's (normalised) embeddings, which it replaces with the processed
    gallery; returns the fitted :class:`~deepmetric.search.postprocess.Postprocessor` (None
    without steps) and ``meta`` with its ``postprocess`` entry."""
    meta = dict(meta or {})
    if not steps:
        return None, meta
    from .postprocess import Postprocessor

    post = Postprocessor(steps, where="--postprocess")
    meta["postprocess"] = {"steps": post.steps, "query_dim": int(index.embeddings.shape[1]),
                           "file": "postprocess.npz"}
    index.embeddings = np.ascontiguousarray(post.fit(index.embeddings), dtype=np.float32)
    return post, meta


def _load_postprocess(meta: dict, raw: bytearray | None, d: Path):
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


EmbeddingIndex = Index
