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

Exact search ranks by inner product with the exact faiss backend of
:mod:`deepmetric.evaluate.knn` (chunked by a memory budget, ties by the smaller index);
``index.faiss`` is then only written for other tools. Approximate indexes (``ivf`` / ``hnsw``,
built by the same module's approximate backends) are searched through ``index.faiss``; their
recall@10 against exact search is measured when they are built and stored in the manifest.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from .query import (Preprocessing, approximate_search, as_query_list, embed_images, exact_search,
                    recall_against_exact)

__all__ = ["Index", "EmbeddingIndex", "INDEX_FORMAT", "file_sha256"]

INDEX_FORMAT = "deepmetric-index"
INDEX_VERSION = 1
KINDS = ("exact", "ivf", "hnsw")
_FILES = ("manifest.json", "embeddings.npy", "labels.npy", "class_names.json", "paths.json")


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _normalised(x, name: str) -> np.ndarray:
    from deepmetric.evaluate import check_embeddings

    arr = np.asarray(x.detach().cpu().numpy() if hasattr(x, "detach") else x)
    if arr.ndim == 1:
        arr = arr[None, :]
    return check_embeddings(arr, name)


def _save_npy(path: Path, arr: np.ndarray) -> None:
    with open(path, "wb") as f:  # a file object: np.save would append ".npy" to the temporary name
        np.save(f, arr, allow_pickle=False)


def _atomic_write(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    write(tmp)
    os.replace(tmp, path)


class Index:
    """Embeddings + labels + class names + paths + provenance, searchable by cosine.

    Build one with :meth:`build` (from a checkpoint and a dataset) or :meth:`from_embeddings`,
    keep it with :meth:`save`, open it with :meth:`load`, query it with :meth:`search`
    (embeddings or images) and turn the result into rows with :meth:`neighbours`.
    """

    def __init__(self, embeddings, labels=None, paths: Sequence[str] | None = None,
                 class_names: Sequence[str] | None = None, *, kind: str = "exact",
                 meta: dict | None = None, directory: str | Path | None = None):
        if kind not in KINDS:
            raise ValueError(f"index kind must be one of {KINDS}, got {kind!r}")
        self.embeddings = _normalised(embeddings, "index embeddings")
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
        self._model = None
        if kind != "exact":
            self._build_approximate()

    # ------------------------------------------------------------------ basics
    def __len__(self) -> int:
        return self.embeddings.shape[0]

    @property
    def dim(self) -> int:
        return self.embeddings.shape[1]

    def __repr__(self) -> str:
        return (f"Index(kind={self.kind!r}, n={len(self)}, dim={self.dim}, classes={len(self.class_names)}, "
                f"directory={str(self.directory) if self.directory else None!r})")

    def _build_approximate(self) -> None:
        from deepmetric.evaluate.knn import build_approximate_index

        t = time.perf_counter()
        self.faiss_index = build_approximate_index(self.embeddings, f"faiss-{self.kind}", k=10)
        self.meta["approximate"] = {
            "kind": self.kind, "build_s": round(time.perf_counter() - t, 3),
            "recall@10_vs_exact": recall_against_exact(self.embeddings, self.faiss_index, k=10),
            "recall_queries": min(1000, len(self)),
        }

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_embeddings(cls, embeddings, labels=None, paths=None, class_names=None, *,
                        approximate: str | None = None, meta: dict | None = None) -> "Index":
        return cls(embeddings, labels, paths, class_names, kind=approximate or "exact", meta=meta)

    @classmethod
    def build(cls, checkpoint: str | Path, *, data: str | None = None, root: str | None = None,
              split: str | None = None, out: str | Path | None = None, approximate: str | None = None,
              add: bool = False, options: dict | None = None, batch_size: int = 256,
              device: str = "auto", num_workers: int = 0, progress: bool = True) -> "Index":
        """Embed a dataset split with ``checkpoint`` (its test transform) and index it.

        ``data`` / ``root`` default to the checkpoint's training data; ``split`` defaults to
        ``all`` for ``folder`` / ``csv`` and ``test`` otherwise. With ``add=True`` the images are
        added to the index in ``out`` (which must come from the same checkpoint; images whose
        path is already indexed are skipped). The index is saved to ``out`` when given.
        """
        from .build import embed_dataset_for_index

        old = None
        if add:
            if out is None:
                raise ValueError("add=True needs out=INDEX_DIR, the index to add to")
            old = cls.load(out)
            approximate = old.kind if old.kind != "exact" else None
        if approximate not in (None, "exact", "ivf", "hnsw"):
            raise ValueError(f"approximate must be 'ivf' or 'hnsw' (or None for exact), got {approximate!r}")
        sha = file_sha256(checkpoint) if Path(checkpoint).is_file() else None
        if old is not None and sha is not None and old.meta.get("checkpoint", {}).get("sha256") != sha:
            c = old.meta.get("checkpoint", {})
            raise ValueError(
                f"index {out} was built with checkpoint {c.get('path')} (sha256 {str(c.get('sha256'))[:12]}), "
                f"not {checkpoint} (sha256 {sha[:12]}): embeddings of different models cannot be "
                "compared; build a new index with another --out")
        skip = set(old.paths) if old is not None else set()
        images_dir = Path(out) / "images" if out is not None else None
        got = embed_dataset_for_index(checkpoint, data=data, root=root, split=split, options=options,
                                      batch_size=batch_size, device=device, num_workers=num_workers,
                                      progress=progress, skip_paths=skip, images_dir=images_dir,
                                      first_image_number=len(old) if old is not None else 0)
        if old is not None:
            if len(got["paths"]):
                old.add(got["embeddings"], got["labels"], got["paths"], got["class_names"])
            old.meta.setdefault("added", []).append(got["data"])
            index = old
        else:
            meta = {"checkpoint": {"path": str(Path(checkpoint).resolve()), "sha256": sha,
                                   "config": got["config"]},
                    "preprocessing": got["preprocessing"], "data": got["data"]}
            index = cls(got["embeddings"], got["labels"], got["paths"], got["class_names"],
                        kind=approximate or "exact", meta=meta)
        index.meta["skipped_already_indexed"] = got["skipped"]
        if out is not None:
            index.save(out)
        return index

    def add(self, embeddings, labels=None, paths: Sequence[str] | None = None,
            class_names: Sequence[str] | None = None) -> None:
        """Append rows. Labels are given in ``class_names`` (default: this index's names) and
        are mapped by name: new names are appended to :attr:`class_names`."""
        e = _normalised(embeddings, "added embeddings")
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
                self.embeddings, self.faiss_index, k=10)

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
        if q.shape[1] != self.dim:
            raise ValueError(f"query embeddings have dimension {q.shape[1]} but the index has {self.dim} "
                             "(another model or embedding size?)")
        k = int(k)
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        if self.faiss_index is not None:
            return approximate_search(self.faiss_index, q, k)
        return exact_search(self.embeddings, q, k, memory_mb=memory_mb)

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
        import faiss

        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        root = d.resolve()
        paths = []
        for p in self.paths:
            try:
                paths.append(Path(p).resolve().relative_to(root).as_posix() if p else p)
            except ValueError:
                paths.append(p)
        manifest = {"format": INDEX_FORMAT, "version": INDEX_VERSION, "kind": self.kind,
                    "count": len(self), "dim": self.dim, "classes": len(self.class_names),
                    **{k: v for k, v in self.meta.items() if k not in ("format", "version", "kind", "count",
                                                                       "dim", "classes")}}
        index = self.faiss_index
        if index is None:
            index = faiss.IndexFlatIP(self.dim)
            index.add(self.embeddings)
        _atomic_write(d / "embeddings.npy", lambda t: _save_npy(t, self.embeddings))
        _atomic_write(d / "labels.npy", lambda t: _save_npy(t, self.labels))
        _atomic_write(d / "class_names.json", lambda t: t.write_text(json.dumps(self.class_names, ensure_ascii=False)))
        _atomic_write(d / "paths.json", lambda t: t.write_text(json.dumps(paths, ensure_ascii=False)))
        _atomic_write(d / "index.faiss", lambda t: faiss.write_index(index, str(t)))
        _atomic_write(d / "manifest.json", lambda t: t.write_text(json.dumps(manifest, indent=1, ensure_ascii=False)))
        self.directory = d
        return d

    @classmethod
    def load(cls, directory: str | Path, *, mmap: bool = False) -> "Index":
        """Open a saved index (``mmap=True`` maps the embeddings instead of reading them)."""
        import faiss

        d = Path(directory)
        if not d.is_dir():
            raise FileNotFoundError(f"index folder {d} does not exist (make one with 'deepmetric index')")
        missing = [f for f in _FILES if not (d / f).is_file()]
        if missing:
            raise FileNotFoundError(f"{d} is not a deepmetric index: missing {', '.join(missing)}")
        manifest = json.loads((d / "manifest.json").read_text())
        if manifest.get("format") != INDEX_FORMAT:
            raise ValueError(f"{d / 'manifest.json'}: format {manifest.get('format')!r}, expected {INDEX_FORMAT!r}")
        if manifest.get("version", 0) > INDEX_VERSION:
            raise ValueError(f"{d}: index version {manifest['version']} is newer than this deepmetric "
                             f"reads ({INDEX_VERSION}); upgrade deepmetric")
        emb = np.load(d / "embeddings.npy", mmap_mode="r" if mmap else None, allow_pickle=False)
        labels = np.load(d / "labels.npy", allow_pickle=False)
        names = json.loads((d / "class_names.json").read_text())
        rel = json.loads((d / "paths.json").read_text())
        if emb.shape != (manifest["count"], manifest["dim"]) or labels.shape != (manifest["count"],) \
                or len(rel) != manifest["count"]:
            raise ValueError(f"{d}: files disagree with manifest.json (count {manifest['count']}, dim "
                             f"{manifest['dim']}; embeddings {emb.shape}, labels {labels.shape}, {len(rel)} paths)")
        paths = [p if (not p or os.path.isabs(p)) else str(d.resolve() / p) for p in rel]
        kind = manifest["kind"]
        meta = {k: v for k, v in manifest.items() if k not in ("format", "version", "kind", "count", "dim", "classes")}
        obj = cls.__new__(cls)
        obj.embeddings, obj.labels, obj.paths, obj.class_names = emb, labels, paths, names
        obj.kind, obj.meta, obj.directory, obj._model = kind, meta, d, None
        obj.faiss_index = faiss.read_index(str(d / "index.faiss")) if kind != "exact" else None
        return obj


EmbeddingIndex = Index
