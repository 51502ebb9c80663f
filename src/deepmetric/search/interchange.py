"""Vectors in and out of an index: ``deepmetric index --embeddings FILE`` and
``deepmetric index export INDEX --to parquet:FILE | qdrant:PATH_OR_URL``.

Input files (:func:`read_embeddings_file`):

- ``.npz`` (``numpy.savez`` / ``deepmetric embed``): ``embeddings`` [N, d], optional ``labels``
  (integers, or strings that become the class names), ``class_names``, ``paths``;
- ``.npy``: the embeddings alone, read with ``os.pread`` (in chunks for ``ivfpq``, so a file larger
  than memory can be indexed);
- ``.parquet`` written by ``index export --to parquet`` (so an export round-trips).

Parquet export (:func:`export_parquet`): one row per indexed image with ``id`` (row), ``path``,
``label``, ``class_name`` and ``vector`` (``fixed_size_list<float32>[d]``, l2-normalised, so
cosine = dot product); the file's key-value metadata ``deepmetric`` holds the index manifest
(checkpoint, preprocessing, kind) that a query needs, and for a post-processed index the
fitted whitening every query must go through (``postprocess``: :func:`_manifest`). Written in
row groups of 65,536 rows.

Qdrant export (:func:`export_qdrant`, the ``qdrant`` extra): a collection (default
``deepmetric``) with cosine distance, point id = row, payload ``path`` / ``label`` /
``class_name``; ``qdrant:PATH`` runs Qdrant embedded in this process (``QdrantClient(path=...)``),
``qdrant:http://HOST:6333`` talks to a server or cluster with the same code. The manifest is
stored as the payload of no point but in ``PATH/deepmetric_manifest.json`` (embedded) and is
returned for a server.
"""
from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from deepmetric.errors import MissingPackageError
from deepmetric.evaluate.io import describe_file

if TYPE_CHECKING:
    from .index import Index

__all__ = ["index_from_file", "read_embeddings_file", "export_parquet", "export_qdrant", "export_warning",
           "parse_target", "is_server_url", "ROW_GROUP"]

ROW_GROUP = 65536


def _labels_and_names(labels, class_names, where: str):
    if labels is None:
        return None, None if class_names is None else [str(c) for c in class_names]
    labels = np.asarray(labels)
    if labels.dtype.kind in "US":  # string labels: their sorted distinct values are the classes
        names, codes = np.unique(labels.astype(str), return_inverse=True)
        return codes.astype(np.int64), [str(c) for c in names]
    if labels.dtype.kind not in "iu":
        raise ValueError(f"{where} must be integers or strings, got dtype {labels.dtype}")
    return labels.astype(np.int64), None if class_names is None else [str(c) for c in class_names]


def _npz_array(z, key: str, p: Path) -> np.ndarray:
    """Array ``key`` of the open .npz ``z`` (the file ``p``); what numpy cannot read is named
    with the file and the key (numpy's own message names neither)."""
    try:
        return z[key]
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as exc:
        if "Object arrays" in str(exc):  # allow_pickle=False: reading them would run pickled code
            dtype = "np.float32" if key == "embeddings" else "str"
            raise ValueError(f"--embeddings {p}: array '{key}' holds Python objects (dtype object), which are not "
                             "read (unpickling a file can run code); save it as numbers or strings, e.g. "
                             f"np.savez(..., {key}=np.asarray({key}, dtype={dtype}))") from None
        raise ValueError(f"--embeddings {p}: array '{key}' cannot be read ({exc})") from None


def _refuse_non_finite(emb: np.ndarray, what: str) -> None:
    """ValueError naming ``what`` (the file and its array or column) and the first row of
    ``emb`` that holds NaN or infinite values."""
    finite = np.isfinite(emb).all(axis=1)
    if not finite.all():
        row = int(np.flatnonzero(~finite)[0])
        raise ValueError(f"{what}: {int((~finite).sum())} row(s) hold NaN or infinite values, the first row {row}")


def _read_npz(p: Path, z) -> dict:
    """The parts of the open .npz ``z`` (the file ``p``), each checked against the embeddings'
    shape [N, d]: errors name the file, the key, the shape found and the one expected."""
    if "embeddings" not in z.files:
        raise KeyError(f"--embeddings {p} has no array 'embeddings' (it has {', '.join(z.files) or 'none'})")
    emb = _npz_array(z, "embeddings", p)
    if emb.ndim != 2:  # a 1-d array was taken for one vector, a 0-d one failed with a traceback
        raise ValueError(f"--embeddings {p}: array 'embeddings' has shape {emb.shape}, expected (N, d): one row "
                         "of d numbers per vector (a single vector v: save v[None, :])")
    if emb.dtype.kind not in "fiu":
        raise ValueError(f"--embeddings {p}: array 'embeddings' holds {emb.dtype}; expected numbers (float32)")
    _refuse_non_finite(emb, f"--embeddings {p}: array 'embeddings'")
    parts = {}
    for key in ("labels", "paths"):
        if key in z.files:
            arr = parts[key] = _npz_array(z, key, p)
            if arr.shape != (emb.shape[0],):
                raise ValueError(f"--embeddings {p}: array '{key}' has shape {arr.shape}, expected "
                                 f"({emb.shape[0]},): one per row of 'embeddings' {emb.shape}")
    names = _npz_array(z, "class_names", p) if "class_names" in z.files else None
    labels, names = _labels_and_names(parts.get("labels"), names, where=f"--embeddings {p}: array 'labels'")
    paths = [str(s) for s in parts["paths"]] if "paths" in parts else None
    return {"embeddings": emb, "labels": labels, "paths": paths, "class_names": names}


def read_embeddings_file(path: str | Path) -> dict:
    """``{"embeddings", "labels", "paths", "class_names"}`` from an ``.npz``, ``.npy`` or exported
    ``.parquet`` file (missing parts are ``None``); errors name the file and what was expected."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"--embeddings {p} not found (an .npz with 'embeddings', an .npy, or a "
                                "parquet file of 'deepmetric index export')")
    if p.suffix == ".npy":
        return {"embeddings": NpyRows(p), "labels": None, "paths": None, "class_names": None}
    if p.suffix == ".parquet" or _is_parquet(p):  # an export named out.pq is still parquet
        return _read_parquet(p)
    try:
        z = np.load(p, allow_pickle=False)
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as exc:  # empty, truncated, not an archive
        what = describe_file(p)  # text, an image, a checkpoint: numpy's reason would say "pickled data"
        raise ValueError(f"--embeddings {p}: {f'this is {what}' if what else f'not a readable .npz / .npy ({exc})'}; "
                         "expected an .npz with 'embeddings', an .npy, or a parquet file of "
                         "'deepmetric index export'") from None
    with z:
        return _read_npz(p, z)


class NpyRows:
    """Rows of a C-ordered 2-d ``.npy`` file read on demand with ``os.pread`` (``rows[a:b]``):
    unlike a memory map, the pages read are not counted in this process's resident memory, so a
    file larger than memory is converted chunk by chunk within a bounded RSS."""

    def __init__(self, path: Path):
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            shape, fortran, dtype = (np.lib.format.read_array_header_1_0(f) if version == (1, 0)
                                     else np.lib.format.read_array_header_2_0(f))
            self.offset = f.tell()
        if fortran or len(shape) != 2 or dtype.hasobject:
            raise ValueError(f"--embeddings {path}: expected a C-ordered 2-d array of numbers, got shape {shape}, "
                             f"dtype {dtype}{' (Fortran order)' if fortran else ''}")
        self.path, self.shape, self.dtype, self.ndim = path, tuple(shape), dtype, 2

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, rows):
        if not isinstance(rows, slice):
            raise TypeError("NpyRows reads slices of rows")
        a, b, step = rows.indices(self.shape[0])
        if step != 1:
            raise TypeError("NpyRows reads contiguous rows")
        row = self.shape[1] * self.dtype.itemsize
        fd = os.open(self.path, os.O_RDONLY)
        try:
            buf = bytearray(max(0, b - a) * row)
            view, got = memoryview(buf), 0
            while got < len(buf):  # one read returns at most ~2 GiB on Linux
                n = os.preadv(fd, [view[got:]], self.offset + a * row + got)
                if n == 0:
                    raise ValueError(f"--embeddings {self.path}: file shorter than its header says")
                got += n
        finally:
            os.close(fd)
        return np.frombuffer(buf, dtype=self.dtype).reshape(-1, self.shape[1])


def _read_parquet(p: Path) -> dict:
    """The parts of a parquet file (an ``index export``, or one written elsewhere with the same
    columns): ``vector`` a list of numbers per row, all of one length (fixed-size or not),
    ``label`` integers or strings, ``path`` and ``class_name`` strings; errors name the file,
    the column, what it holds and what was expected."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    table = pq.read_table(p)
    need = {"vector", "label", "class_name", "path"}
    if not need <= set(table.schema.names):
        raise KeyError(f"--embeddings {p}: a parquet file needs the columns {sorted(need)} "
                       f"('deepmetric index export --to parquet:FILE'); it has {table.schema.names}")
    where = f"--embeddings {p}: column"
    for name in need - {"class_name"}:  # a missing class name falls back to the label's number
        nulls = table.column(name).null_count
        if nulls:
            first = int(pc.index(pc.is_null(table.column(name)), True).as_py())
            raise ValueError(f"{where} '{name}' is empty (null) in {nulls} row(s), the first row {first}")
    emb = _parquet_vectors(table.column("vector").combine_chunks(), f"{where} 'vector'")
    labels, class_names = _parquet_labels(table, f"{where} 'label'")
    return {"embeddings": emb, "labels": labels, "paths": [str(s) for s in table.column("path").to_pylist()],
            "class_names": class_names}


def _parquet_vectors(vec, where: str) -> np.ndarray:
    """[N, d] array of the list column ``vec`` (fixed-size or plain lists of numbers, all of one
    length, finite); integers become float32."""
    import pyarrow as pa
    import pyarrow.compute as pc

    is_list = pa.types.is_list(vec.type) or pa.types.is_large_list(vec.type) or pa.types.is_fixed_size_list(vec.type)
    if not is_list or not (pa.types.is_floating(vec.type.value_type) or pa.types.is_integer(vec.type.value_type)):
        raise ValueError(f"{where} holds {vec.type}; expected a list of numbers per row "
                         "(fixed_size_list<float32>[d], as 'index export' writes)")
    lengths = pc.list_value_length(vec).to_numpy(zero_copy_only=False) if len(vec) else np.zeros(0, int)
    if len(lengths) and (lengths != lengths[0]).any():
        row = int(np.flatnonzero(lengths != lengths[0])[0])
        raise ValueError(f"{where}: row {row} has {lengths[row]} numbers, row 0 has {lengths[0]}; "
                         "every vector must have the same length")
    d = int(lengths[0]) if len(lengths) else (vec.type.list_size if pa.types.is_fixed_size_list(vec.type) else 0)
    values = pc.list_flatten(vec).to_numpy(zero_copy_only=False)
    emb = np.array(values, dtype=np.float32 if values.dtype.kind in "iu" else values.dtype).reshape(-1, d)
    _refuse_non_finite(emb, where)  # np.array above: a writable copy, for torch
    return emb


def _parquet_labels(table, where: str) -> tuple[np.ndarray, list[str]]:
    """(labels, class names) of the ``label`` column: strings become class numbers (their sorted
    distinct values, as for an .npz); integers take their names from ``class_name``."""
    import pyarrow as pa

    label_type = table.column("label").type
    if pa.types.is_string(label_type) or pa.types.is_large_string(label_type):
        return _labels_and_names(table.column("label").to_numpy(zero_copy_only=False).astype(str), None, where=where)
    if not pa.types.is_integer(label_type):
        raise ValueError(f"{where} holds {label_type}; expected integers (class numbers) or strings (class names)")
    labels = table.column("label").to_numpy(zero_copy_only=False).astype(np.int64)
    names = {}
    for lab, name in zip(labels.tolist(), table.column("class_name").to_pylist()):
        if name is not None:
            names.setdefault(lab, str(name))
    top = int(labels.max()) + 1 if len(labels) and labels.max() >= 0 else 0
    return labels, [names.get(i, str(i)) for i in range(top)]


def parse_target(target: str) -> tuple[str, str]:
    """``parquet:FILE`` / ``qdrant:PATH_OR_URL`` -> (scheme, rest)."""
    scheme, sep, rest = target.partition(":")
    if not sep or scheme not in ("parquet", "qdrant") or not rest:
        raise ValueError(f"--to {target!r}: expected parquet:FILE or qdrant:PATH_OR_URL")
    if scheme == "qdrant" and "://" in rest and not is_server_url(rest):  # else a folder named 'grpc:'
        raise ValueError(f"--to {target!r}: a Qdrant server is reached at http://HOST:PORT or https://HOST:PORT "
                         "(the REST port, 6333 by default); anything else is a local folder")
    return scheme, rest


def is_server_url(where: str) -> bool:
    """Whether ``qdrant:WHERE`` names a server (``http(s)://``), not a local folder."""
    return where.startswith(("http://", "https://"))


#: query-side steps an engine that ranks by plain cosine does not apply (they need the gallery)
_GALLERY_QUERY_STEPS = ("aqe", "kreciprocal")


def _not_applied(post) -> list[str]:
    """The steps of ``post`` (a Postprocessor) that another engine leaves out."""
    return [s for s in _GALLERY_QUERY_STEPS if post.step(s) is not None]


def _manifest(index) -> dict:
    """The index manifest for another engine; with post-processing, ``postprocess`` also holds
    the fitted whitening (``whiten_mean`` [d], ``whiten_projection`` [d, d'] as lists), which
    every query must go through before it is searched, and ``not_applied``, the steps that
    engine leaves out (alpha-QE and k-reciprocal re-ranking read the gallery)."""
    meta = {"kind": index.kind, "count": len(index), "dim": index.dim, **index.meta}
    post = index.postprocessor
    if post is not None:
        meta["postprocess"] = {**meta.get("postprocess", {}),
                               **{k: v.tolist() for k, v in post.state().items()},
                               "queries": "y = l2normalise((x - whiten_mean) @ whiten_projection) of the "
                                          "l2-normalised query embedding x" if post.whitening is not None
                                          else "the l2-normalised query embedding as it is",
                               "not_applied": _not_applied(post)}
    return meta


def export_warning(index) -> str | None:
    """What a user exporting ``index`` must know: its queries need the stored whitening, and
    alpha-QE / k-reciprocal re-ranking are lost (the engine's ranking differs from ``search``)."""
    post = index.postprocessor
    if post is None:
        return None
    lost = _not_applied(post)
    parts = []
    if post.whitening is not None:
        parts.append("queries must be whitened before they are searched (whiten_mean / whiten_projection "
                     "are in the exported manifest's 'postprocess', and in INDEX_DIR/postprocess.npz)")
    if lost:
        parts.append(f"{' and '.join(lost)} cannot be applied by that engine, so its ranking differs from "
                     "'deepmetric search'")
    return "; ".join(parts) or None


def _batches(index, rows: int):
    n = len(index)
    for a in range(0, n, rows):
        b = min(n, a + rows)
        vec = np.asarray(index.embeddings[a:b], dtype=np.float32)
        yield a, b, vec, np.asarray(index.labels[a:b]), list(index.paths[a:b])


def _is_parquet(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"PAR1"


def export_parquet(index, out: str | Path) -> Path:
    """Write every row of ``index`` to a parquet file (atomically: a temporary file renamed)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(out)
    if out.is_file() and not _is_parquet(out):  # an earlier export is replaced; anything else is kept
        raise ValueError(f"--to parquet:{out}: that file exists and is not a parquet file; writing there would "
                         "destroy it (remove it first, or choose another path)")
    out.parent.mkdir(parents=True, exist_ok=True)
    schema = pa.schema([("id", pa.int64()), ("path", pa.string()), ("label", pa.int64()),
                        ("class_name", pa.string()), ("vector", pa.list_(pa.float32(), index.dim))],
                       metadata={"deepmetric": json.dumps(_manifest(index), ensure_ascii=False)})
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    try:
        with pq.ParquetWriter(str(tmp), schema) as w:
            for a, b, vec, lab, paths in _batches(index, ROW_GROUP):
                flat = pa.array(vec.reshape(-1), type=pa.float32())
                w.write_table(pa.table([pa.array(np.arange(a, b)), pa.array(paths, pa.string()), pa.array(lab),
                                        pa.array([index.class_names[i] for i in lab], pa.string()),
                                        pa.FixedSizeListArray.from_arrays(flat, index.dim)], schema=schema))
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def qdrant_client_for(where: str):
    """A ``QdrantClient``: ``http(s)://`` -> a server, anything else -> embedded at that folder."""
    try:
        from qdrant_client import QdrantClient
    except ImportError:
        raise MissingPackageError("exporting to Qdrant needs qdrant-client: pip install 'deepmetric[qdrant]'") from None
    if is_server_url(where):
        return QdrantClient(url=where)
    return QdrantClient(path=where)


def export_qdrant(index, where: str, *, collection: str = "deepmetric", batch: int = 1024) -> dict:
    """Upload every row of ``index`` as a point (id = row, cosine distance, payload path / label /
    class_name) into ``collection`` (re-created). Returns the manifest stored with it."""
    from qdrant_client import models
    from qdrant_client.http.exceptions import ResponseHandlingException

    client = qdrant_client_for(where)
    try:
        try:
            exists = client.collection_exists(collection)
        except ResponseHandlingException as exc:  # no server there (connection refused, a bad name)
            raise OSError(f"--to qdrant:{where}: cannot reach a Qdrant server there ({exc}); start it, or give "
                          "a folder for an embedded store") from None
        if exists:
            client.delete_collection(collection)
        client.create_collection(collection, vectors_config=models.VectorParams(
            size=index.dim, distance=models.Distance.COSINE))
        for a, b, vec, lab, paths in _batches(index, batch):
            client.upsert(collection, points=models.Batch(
                ids=list(range(a, b)), vectors=vec.tolist(),
                payloads=[{"path": p, "label": int(lb), "class_name": index.class_names[lb]}
                          for p, lb in zip(paths, lab)]), wait=True)
    finally:
        client.close()
    manifest = _manifest(index)
    if not where.startswith(("http://", "https://")):
        side = Path(where) / "deepmetric_manifest.json"
        side.write_text(json.dumps(manifest, indent=1, ensure_ascii=False), encoding="utf-8")
    return manifest


def _skip_indexed(got: dict, indexed) -> int:
    """Drop from ``got`` (:func:`read_embeddings_file`) the rows whose path the index already
    holds, as ``index --add`` of images skips the images already indexed (adding them again
    would answer every query with the same image twice); returns how many were dropped. Rows
    without a path are always added: nothing says they are already there."""
    have = {p for p in indexed if p}
    if got["paths"] is None or not have:
        return 0
    keep = [i for i, p in enumerate(got["paths"]) if not (p and p in have)]
    skipped = len(got["paths"]) - len(keep)
    if skipped:
        got["embeddings"] = np.asarray(got["embeddings"])[keep]
        got["labels"] = None if got["labels"] is None else got["labels"][keep]
        got["paths"] = [got["paths"][i] for i in keep]
    return skipped


def index_from_file(path: str | Path, out: str | Path, *, approximate: str | None = None, add: bool = False,
                    overwrite: bool = False, options: dict | None = None, postprocess=None) -> "Index":
    """``deepmetric index --embeddings FILE``: an index of the vectors in ``path``
    (:func:`deepmetric.search.interchange.read_embeddings_file`), written to ``out`` as a
    transaction; ``add=True`` appends them to the index there (its kind, settings and
    post-processing)."""
    from .index import Index, check_out_dir
    from .store import index_transaction

    got = read_embeddings_file(path)
    if not hasattr(got["embeddings"], "__array__") and (add or approximate != "ivfpq"):
        got["embeddings"] = got["embeddings"][:]  # an .npy read on demand: all of it (only ivfpq reads chunks)
    if got["paths"] is not None:  # relative paths are relative to where the command runs
        got["paths"] = [os.path.abspath(p) if p and not os.path.isabs(p) else p for p in got["paths"]]
    source = {"embeddings": str(Path(path).resolve()), "images": int(got["embeddings"].shape[0])}
    out = Path(out)
    if not add:
        check_out_dir(out, overwrite=overwrite)
        index = Index(got["embeddings"], got["labels"], got["paths"], got["class_names"],
                      kind=approximate or "exact", meta={"data": source}, options=options, postprocess=postprocess)
        index.save(out)
        return index
    if approximate not in (None, "exact") or options or postprocess:
        raise ValueError("--add keeps the index's kind and settings; leave out --approximate / --memory-budget / "
                         "--postprocess")
    with index_transaction(out) as tmp:
        index = Index.load(out, verify_hashes=True)  # never bless a damaged index with fresh hashes
        if index.meta.get("checkpoint"):  # vectors of unknown origin among a model's: search would mix them
            raise ValueError(f"--add --embeddings {path}: {out} holds images embedded by the checkpoint "
                             f"{index.meta['checkpoint'].get('path')}, and vectors from a file cannot be checked to "
                             "come from it; add images with 'deepmetric index CHECKPOINT ... --add', or build a "
                             "separate index of the vectors")
        skipped = _skip_indexed(got, index.paths)
        if len(got["embeddings"]):
            index.add(got["embeddings"], got["labels"], got["paths"], got["class_names"])
        index.meta.setdefault("added", []).append({**source, "images": len(got["embeddings"])})
        index.meta["skipped_already_indexed"] = skipped
        rel_paths = index._write(tmp, out)
    index._settle(out, rel_paths)
    return index
