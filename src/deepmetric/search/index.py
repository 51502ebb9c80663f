"""A search index: l2-normalised embeddings of a gallery with their labels, class names and
image paths, the checkpoint that made them (path, SHA-256, config) and a faiss index.

On disk (``deepmetric index ... --out INDEX_DIR``)::

    INDEX_DIR/manifest.json     format, kind, count, dim, checkpoint {path, sha256, config}, embedding_output
                                (the model output embedded: eval.embedding), preprocessing, data, recall
    INDEX_DIR/embeddings.npy    float32 [N, d], l2-normalised (numpy .npy, no pickles); ivfpq:
    INDEX_DIR/vectors.f16.npy   float16 [N, d] instead, mapped, read for re-ranked candidates
    INDEX_DIR/metadata.arrow    path (relative ones are inside INDEX_DIR) and label per row
    INDEX_DIR/class_names.arrow class name per label (version 2: paths.json, labels.npy, class_names.json)
    INDEX_DIR/index.faiss       faiss index: IndexFlatIP (exact), IndexIVFFlat, IndexHNSWFlat or OPQ+IVF+PQ
    INDEX_DIR/images/           PNG copies of images that exist only in memory (glyphs, MNIST)
    INDEX_DIR/postprocess.npz   with post-processing (manifest ``postprocess``: the steps and the
                                query dimension): the fitted whitening (whiten_mean, whiten_projection)

With post-processing (the config's ``search.postprocess`` or ``--postprocess``; :mod:`.postprocess`)
``embeddings.npy`` holds the processed gallery (whitened and reduced, DBA-augmented); :meth:`Index.search`
applies the query side and the k-reciprocal re-ranking: ``search`` and ``serve`` answer processed rankings.

``manifest.json`` (version 2 and 3) lists every other file's size and SHA-256 (``files``). Folders
are written as transactions (:mod:`deepmetric.search.store`): into a temporary folder beside
the target, swapped in atomically, so a failed ``index`` / ``index --add`` leaves the old
index byte-identical. :meth:`Index.load` checks every listed file's size (and SHA-256 with
``verify_hashes=True``, as ``deepmetric serve`` does at start and on reload); an index written
before version 2 has no ``files`` and loads with a warning saying how to rebuild it. Before any
listed file is opened its name is checked (no path outside the folder), links and odd files are
refused, and the rows must be finite with labels naming a class (:mod:`deepmetric.search.reading`).
``ivfpq`` takes no post-processing (refused when built).

Exact search ranks by inner product with the exact faiss backend of :mod:`deepmetric.evaluate.knn`
(chunked by a memory budget, ties by the smaller index), or its torch backend on a GPU when the
index's ``search_device`` is CUDA (``deepmetric index`` on a GPU machine: the exact search behind an
approximate index's recall); ``index.faiss`` is then only written for other tools. Approximate indexes
(``ivf`` / ``hnsw``, built by the same module's approximate backends) are searched through
``index.faiss``; their recall@10 against exact search is measured when built and kept in the manifest.
"""
from __future__ import annotations

import io
import json
import os
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from .compressed import VECTORS_FILE, RefinedIndex
from .metadata import CLASS_NAMES_FILE, METADATA_FILE, check_label_range, write_metadata
from .reading import (INDEX_FORMAT, INDEX_VERSION, KINDS, Folder, check_files, check_present, check_rows, exists,
                      load_postprocess, read_manifest, read_parts)
from .query import (Preprocessing, approximate_search, as_query_list, embed_images, exact_search,
                    preprocessing_from_config, recall_against_exact)
from .store import IndexFilesError, carry_file, check_utf8, file_entries, file_sha256, index_transaction, write_file

__all__ = ["Index", "EmbeddingIndex", "INDEX_FORMAT", "file_sha256", "IndexFilesError", "is_index_dir"]

_FILES = ("manifest.json", "embeddings.npy", "labels.npy", "class_names.json", "paths.json")  # version 2
_FILES_V3 = ("manifest.json", METADATA_FILE, CLASS_NAMES_FILE)  # + embeddings.npy or vectors.f16.npy
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


def normalised_f16(x, name: str, chunk_rows: int = 1 << 18) -> np.ndarray:
    """l2-normalised float16 copy of ``x`` (array, memmap or tensor), checked and converted in
    chunks of ``chunk_rows`` so that at most one chunk is float32 at a time."""
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    if getattr(x, "ndim", 2) == 1:
        x = np.asarray(x)[None, :]
    n = x.shape[0]
    out = np.empty((n, x.shape[1] if x.ndim == 2 else 0), np.float16)
    for a in range(0, max(n, 1), chunk_rows):
        part = _normalised(np.asarray(x[a:a + chunk_rows]), f"{name} (rows from {a})")
        out[a:a + len(part)] = part
    return out


def _normalised(x, name: str) -> np.ndarray:
    from deepmetric.evaluate import check_embeddings

    arr = np.asarray(x.detach().cpu().numpy() if hasattr(x, "detach") else x)
    return check_embeddings(arr[None, :] if arr.ndim == 1 else arr, name)


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
                 options: dict | None = None, postprocess=None):
        if kind not in KINDS:
            raise ValueError(f"index kind must be one of {KINDS}, got {kind!r}")
        if kind == "ivfpq" and postprocess:
            raise ValueError("--approximate ivfpq takes no --postprocess: its candidates are re-ranked with the "
                             "stored float16 vectors, not whitened / expanded / k-reciprocal ones (reduce the "
                             "dimension with --reduce-dim); use --postprocess none, or an exact / ivf / hnsw index")
        # ivfpq keeps float16 vectors (normalised in chunks: never all of them in float32)
        self.embeddings = (normalised_f16(embeddings, "index embeddings") if kind == "ivfpq"
                           else _normalised(embeddings, "index embeddings"))
        self.postprocessor, meta = _fit_postprocess(self, postprocess, meta)
        n = self.embeddings.shape[0]
        self.labels = (np.zeros(n, np.int64) if labels is None
                       else np.asarray(labels, dtype=np.int64).reshape(-1))
        if self.labels.shape[0] != n:
            raise ValueError(f"index: {self.labels.shape[0]} labels for {n} embeddings")
        check_label_range(self.labels, class_names)
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
        self.refined = None  # ivfpq: the PQ index + float16 vectors it re-ranks with
        if kind != "exact":
            self._build_approximate(options or {})

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

    def _build_approximate(self, options: dict) -> None:
        from deepmetric.evaluate.knn import build_approximate_index

        if self.kind == "ivfpq":
            from .compressed import build_refined

            self.refined, self.meta["approximate"] = build_refined(self.embeddings, **options)
            self.faiss_index = self.refined.index
            return
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
                        approximate: str | None = None, meta: dict | None = None,
                        options: dict | None = None, postprocess=None) -> "Index":
        """An index of vectors a user already has (``options``: ivfpq's ``memory_gb`` /
        ``reduce_dim``, see :func:`deepmetric.search.compressed.build_refined`; ``postprocess``:
        steps fitted on them, not with ivfpq)."""
        return cls(embeddings, labels, paths, class_names, kind=approximate or "exact", meta=meta,
                   options=options, postprocess=postprocess)

    @classmethod
    def build(cls, checkpoint: str | Path, *, data: str | None = None, root: str | None = None,
              split: str | None = None, out: str | Path | None = None, approximate: str | None = None,
              add: bool = False, overwrite: bool = False, options: dict | None = None,
              index_options: dict | None = None, batch_size: int = 256, device: str = "auto", num_workers: int = 0,
              progress: bool = True, search_device: str = "auto", shard_size: int | None = None,
              postprocess=None) -> "Index | None":
        """Embed a dataset split with ``checkpoint`` (its test transform) and index it.

        ``data`` / ``root`` default to the checkpoint's training data; ``split`` defaults to
        ``all`` for ``folder`` / ``csv`` and ``test`` otherwise. With ``add=True`` the images are
        added to the index in ``out`` (which must come from the same checkpoint; images whose
        path is already indexed are skipped). The index is saved to ``out`` when given, as a
        transaction: any failure leaves what was in ``out`` byte-identical. An existing index
        in ``out`` is refused unless ``add`` or ``overwrite``; a non-empty folder that is not an
        index always is. The model runs on ``device``; the exact searches (an approximate
        index's recall against exact search) where
        :func:`~deepmetric.run.evaluation.command_search_device` says. ``postprocess``: steps
        (:func:`deepmetric.search.postprocess.check_steps`; default the checkpoint's
        ``search.postprocess``; ``[]`` for none) fitted on the indexed gallery.
        """
        if add and out is None:
            raise ValueError("add=True needs out=INDEX_DIR, the index to add to")
        if approximate not in (None,) + KINDS:
            raise ValueError(f"approximate must be 'ivf', 'hnsw' or 'ivfpq' (or None for exact), got {approximate!r}")
        from deepmetric.run.evaluation import command_search_device

        command_search_device(device, search_device)  # bad values are refused before any work
        if postprocess is not None:
            from .postprocess import check_steps

            postprocess = check_steps(postprocess, "--postprocess")  # refused before any work
            if postprocess and approximate == "ivfpq":
                raise ValueError("--approximate ivfpq takes no --postprocess (its candidates are re-ranked with "
                                 "the stored float16 vectors); use --postprocess none, or another kind")
        kw = dict(data=data, root=root, split=split, options=options, index_options=index_options,
                  batch_size=batch_size, device=device, num_workers=num_workers, progress=progress,
                  search_device=search_device, postprocess=postprocess)
        if out is None:
            return cls._build(checkpoint, None, None, approximate=approximate, add=False, **kw)
        out = Path(out)
        if not add:
            check_out_dir(out, overwrite=overwrite)
        from deepmetric.run.shards import DEFAULT_SHARD_SIZE, torchrun_world

        if torchrun_world() is not None:  # under torchrun: shards, then rank 0 assembles (shards.py)
            return cls._build_sharded(checkpoint, out, approximate=approximate, add=add,
                                      shard_size=shard_size or DEFAULT_SHARD_SIZE, **kw)
        with index_transaction(out) as tmp:  # the old index is read and replaced under one lock
            index = cls._build(checkpoint, out, tmp, approximate=approximate, add=add, **kw)
            rel_paths = index._write(tmp, out)
        index._settle(out, rel_paths)
        return index

    @classmethod
    def _build_sharded(cls, checkpoint, out: Path, *, shard_size: int, **kw) -> "Index | None":
        """``build`` on every torchrun rank: each embeds its shards; rank 0 builds and writes the
        index from all of them (the others return ``None``)."""
        from .build import embed_dataset_for_index
        from deepmetric.run.shards import ShardPlan, torchrun_group

        with torchrun_group() as (rank, world):
            old = cls.load(out) if kw["add"] else None
            skip = set(old.paths) if old is not None else set()
            sha = file_sha256(checkpoint) if Path(checkpoint).is_file() else None
            plan = ShardPlan(out, rank=rank, world_size=world, shard_size=shard_size, checkpoint_sha256=sha)
            got = embed_dataset_for_index(checkpoint, data=kw["data"], root=kw["root"], split=kw["split"],
                                          options=kw["options"], batch_size=kw["batch_size"], device=kw["device"],
                                          num_workers=kw["num_workers"], progress=kw["progress"],
                                          skip_paths=skip, shards=plan, index_meta=None if old is None else old.meta)
            if got is None:
                return None
            with index_transaction(out) as tmp:
                index = cls._build(checkpoint, out, tmp, got=got, **kw)
                rel_paths = index._write(tmp, out)
            index._settle(out, rel_paths)
            plan.finish()
            return index

    @classmethod
    def _build(cls, checkpoint, out: Path | None, tmp: Path | None, *, data, root, split, options, index_options,
               approximate, add, batch_size, device, num_workers, progress, search_device,
               got: dict | None = None, postprocess=None) -> "Index":
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
        got = got or embed_dataset_for_index(checkpoint, data=data, root=root, split=split, options=options,
                                      batch_size=batch_size, device=device, num_workers=num_workers,
                                      progress=progress, skip_paths=skip, images_dir=images_dir,
                                      first_image_number=len(old) if old is not None else 0,
                                      index_meta=old.meta if old is not None else None)
        from deepmetric.run.evaluation import command_search_device

        where = command_search_device(device, search_device, nbytes=got["embeddings"].nbytes)
        if old is not None:
            old.search_device = where
            if len(got["paths"]):
                old.add(got["embeddings"], got["labels"], got["paths"], got["class_names"])
            old.meta.setdefault("added", []).append(got["data"])
            index = old
        else:
            meta = {"checkpoint": {"path": str(Path(checkpoint).resolve()), "sha256": sha, "config": got["config"]},
                    "preprocessing": got["preprocessing"], "data": got["data"],
                    "embedding_output": got.get("embedding_output", "embedding")}
            if postprocess is None:  # the checkpoint's search.postprocess
                postprocess = ((got["config"] or {}).get("search") or {}).get("postprocess") or []
            index = cls(got["embeddings"], got["labels"], got["paths"], got["class_names"],
                        kind=approximate or "exact", meta=meta, search_device=where, options=index_options,
                        postprocess=postprocess)
        index.meta["skipped_already_indexed"] = got["skipped"]
        if got.get("shards"):
            index.meta["shards"] = got["shards"]
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
        if self.kind == "ivfpq":
            e = e.astype(np.float16)
        self.embeddings = np.ascontiguousarray(np.concatenate([self.embeddings, e]))
        self.labels = np.concatenate([self.labels, lab])
        self.paths = list(self.paths) + new_paths
        if self.refined is not None:
            from .compressed import add_refined

            add_refined(self.refined, e, self.embeddings, self.meta["approximate"])
        elif self.faiss_index is not None:
            self.faiss_index.add(e)
            self.meta["approximate"]["recall@10_vs_exact"] = recall_against_exact(
                self.embeddings, self.faiss_index, k=10, device=self.search_device)

    # ------------------------------------------------------------------ search
    def model(self, checkpoint: str | Path | None = None, device: str = "cpu"):
        """``(model, preprocessing)`` of the index's checkpoint (loaded once; SHA-256 as in the manifest)."""
        if self._model is None:
            from .build import load_query_network

            c = self.meta.get("checkpoint") or {}
            path = checkpoint or c.get("path")
            if not path:
                raise ValueError("this index has no checkpoint (built from embeddings), so nothing here can embed "
                                 "an image: give the checkpoint whose model made the vectors (--checkpoint FILE; "
                                 "index.model(checkpoint) in Python), or search with vectors (Index.search)")
            if not Path(path).is_file():
                raise FileNotFoundError(f"the index's checkpoint {path} is missing; pass the moved file "
                                        "(--checkpoint FILE / checkpoint=...)")
            sha = file_sha256(path)
            if c.get("sha256") and sha != c["sha256"]:
                raise ValueError(f"checkpoint {path} (sha256 {sha[:12]}) is not the one that built this index "
                                 f"(sha256 {c['sha256'][:12]}, {c.get('path')}): its embeddings would not "
                                 "be comparable")
            model, cfg, _, _ = load_query_network(self.meta, path, device)
            pre = self.meta.get("preprocessing")  # none for --embeddings vectors: the checkpoint's own
            self._model = (model, Preprocessing.from_dict(pre) if pre else preprocessing_from_config(cfg), device)
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
        if self.refined is not None:  # ivfpq (never with post-processing)
            return self.refined.search(q, k)
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
        vectors = VECTORS_FILE if self.kind == "ivfpq" else "embeddings.npy"
        with open(tmp / vectors, "wb") as f:
            np.save(f, np.ascontiguousarray(self.embeddings), allow_pickle=False)
        write_metadata(tmp, stored, self.labels, self.class_names)
        # serialised here and written by Python: a full disk is an OSError (ENOSPC) that
        # index_transaction explains, not faiss's RuntimeError
        write_file(tmp / "index.faiss", faiss.serialize_index(index))
        extra = ()
        if self.postprocessor is not None:
            buf = io.BytesIO()
            np.savez(buf, **self.postprocessor.state())
            write_file(tmp / "postprocess.npz", buf.getbuffer())
            extra = ("postprocess.npz",)
        manifest = {"format": INDEX_FORMAT, "version": INDEX_VERSION, "kind": self.kind,
                    "count": len(self), "dim": self.dim, "classes": len(self.class_names),
                    **{k: v for k, v in self.meta.items() if k not in _MANIFEST_OWN},
                    "files": file_entries(tmp)}
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1, ensure_ascii=False), encoding="utf-8")
        for name in _FILES_V3 + (vectors, "index.faiss") + extra:  # on disk before the swap makes them the index
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
        or its files later cannot change or break the loaded index. An ``ivfpq`` index always
        maps ``vectors.f16.npy`` (only re-ranked candidates are read). Version-3 metadata
        (``metadata.arrow``) is decoded per row shown, from memory or (``mmap``) the mapped file."""
        d = Path(directory)
        if not d.is_dir():
            raise FileNotFoundError(f"index folder {d} does not exist (make one with 'deepmetric index')")
        folder = Folder(d)
        try:
            manifest, raw = read_manifest(folder, d)  # links refused, listed names checked
            kind, files = manifest["kind"], manifest.get("files")
            # version 3 (or a folder with its files): Arrow metadata; else paths.json / labels.npy / ...
            v3 = manifest.get("version", 0) >= 3 or exists(folder, METADATA_FILE)
            vectors = VECTORS_FILE if kind == "ivfpq" else "embeddings.npy"
            mapped = mmap or kind == "ivfpq"
            post = ("postprocess.npz",) if manifest.get("postprocess") else ()
            check_present(d, (_FILES_V3 if v3 else _FILES) + (vectors,)
                          + (("index.faiss",) if kind != "exact" else ()) + post)
            names = ([] if mmap else [METADATA_FILE, CLASS_NAMES_FILE]) if v3 else \
                ["labels.npy", "class_names.json", "paths.json"]
            names += (["index.faiss"] if kind != "exact" else []) + ([] if mapped else [vectors]) + list(post)
            for name in names:
                raw[name] = folder.read(name)
            check_files(d, files, raw, manifest, verify_hashes)  # and the unread listed files on disk
            emb, labels, names_, paths, faiss_index = read_parts(d, raw, kind, v3, mapped)
        finally:
            folder.close()
        if emb.shape != (manifest["count"], manifest["dim"]) or labels.shape != (manifest["count"],) \
                or len(paths) != manifest["count"]:
            raise ValueError(f"{d}: files disagree with manifest.json (count {manifest['count']}, dim "
                             f"{manifest['dim']}; embeddings {emb.shape}, labels {labels.shape}, {len(paths)} paths)")
        check_rows(d, emb, labels, names_, v3=v3, vectors=vectors)
        meta = {k: v for k, v in manifest.items() if k not in _MANIFEST_OWN}
        obj = cls.__new__(cls)
        obj.embeddings, obj.labels, obj.paths, obj.class_names = emb, labels, paths, names_
        obj.kind, obj.meta, obj.directory, obj._model = kind, meta, d, None
        obj.manifest_files = files
        obj.search_device = "cpu"  # a loaded index answers a few queries at a time: faiss
        obj.faiss_index = faiss_index
        obj.refined = None
        if kind == "ivfpq":
            a = meta.get("approximate", {})
            obj.refined = RefinedIndex(faiss_index, d / VECTORS_FILE, k_factor=a.get("k_factor", 8),
                                       nprobe=a.get("nprobe"))
            obj.embeddings = obj.refined.vectors  # the checked mapping above is dropped with its pages
        obj.postprocessor = load_postprocess(meta, raw.get("postprocess.npz"), d)
        return obj


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


EmbeddingIndex = Index
