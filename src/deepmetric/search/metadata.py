"""Per-row metadata of an index (image path, label) and its class names in Apache Arrow IPC
files, read lazily.

``metadata.arrow`` holds the columns ``path`` (string, relative to the index folder when the
image is inside it) and ``label`` (int64, an index into the class names); ``class_names.arrow``
the column ``name``. Both are written in record batches of :data:`BATCH_ROWS` rows, without
compression, and opened with ``pyarrow.memory_map``: loading reads only the file footers, the
labels are copied into one int64 array (8 bytes a row) and a path is decoded only when a row is
shown (:class:`LazyPaths`), so opening a 10 M-image index parses no JSON and holds no Python
string per row. Indexes written before (``paths.json``, ``labels.npy``, ``class_names.json``)
still load; ``deepmetric index migrate`` or an ``--add`` rewrites them in this form.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .store import IndexFilesError, write_file

__all__ = ["METADATA_FILE", "CLASS_NAMES_FILE", "BATCH_ROWS", "write_metadata", "read_metadata", "LazyPaths",
           "check_label_range", "MAX_UNNAMED_LABEL"]

METADATA_FILE = "metadata.arrow"
CLASS_NAMES_FILE = "class_names.arrow"
BATCH_ROWS = 1 << 20


def _write_table(path: Path, columns: dict, n: int) -> None:
    """Assembled in memory and written by Python (:func:`deepmetric.search.store.write_file`):
    a full disk is then an OSError (ENOSPC) that the index transaction explains."""
    import pyarrow as pa

    schema = pa.schema([(name, typ) for name, (typ, _) in columns.items()])
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, schema) as writer:
        for a in range(0, max(n, 1), BATCH_ROWS):
            arrays = [pa.array(values[a:a + BATCH_ROWS], type=typ) for typ, values in columns.values()]
            writer.write_batch(pa.record_batch(arrays, schema=schema))
    write_file(path, sink.getvalue())


def write_metadata(folder: Path, paths: Sequence[str], labels: np.ndarray, class_names: Sequence[str]) -> None:
    """Write ``metadata.arrow`` and ``class_names.arrow`` into ``folder``."""
    import pyarrow as pa

    labels = np.asarray(labels, np.int64)
    _write_table(Path(folder) / METADATA_FILE, {"path": (pa.string(), paths), "label": (pa.int64(), labels)},
                 len(labels))
    _write_table(Path(folder) / CLASS_NAMES_FILE, {"name": (pa.string(), list(class_names))}, len(class_names))


def _open(path: Path, data=None):
    import pyarrow as pa

    try:
        source = pa.BufferReader(pa.py_buffer(data)) if data is not None else pa.memory_map(str(path), "r")
        return pa.ipc.open_file(source).read_all()
    except (pa.ArrowInvalid, OSError) as exc:
        raise ValueError(f"{path}: not a readable Arrow IPC file ({exc})") from None


class LazyPaths(Sequence):
    """The ``path`` column as a read-only sequence of absolute path strings: row ``i`` is decoded
    when asked for (relative paths are joined to the index folder ``root``)."""

    def __init__(self, column, root: Path):
        self.column, self.root = column, str(root)

    def __len__(self) -> int:
        return len(self.column)

    def _absolute(self, p: str | None) -> str:
        if not p:
            return ""
        return p if os.path.isabs(p) else os.path.join(self.root, p)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self._absolute(p) for p in self.column[i].to_pylist()]
        i = int(i)
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"row {i} is outside the index ({len(self)} rows)")
        return self._absolute(self.column[i].as_py())

    def __iter__(self):
        for chunk in self.column.chunks:
            yield from (self._absolute(p) for p in chunk.to_pylist())

    def __eq__(self, other):
        return list(self) == list(other)


def _check_inside(column, where: Path) -> None:
    """Relative paths never climb out of the index folder (as
    :func:`deepmetric.search.store.check_inside`, vectorised over the Arrow column)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if not pa.types.is_string(column.type):
        raise IndexFilesError(f"{where}: column 'path' is {column.type}, expected string")
    climbs = pc.and_(pc.match_substring_regex(column, r"(^|[/\\])\.\.([/\\]|$)"),
                     pc.invert(pc.starts_with(column, "/")))
    if pc.any(climbs).as_py():
        i = int(pc.index(climbs, True).as_py())
        raise IndexFilesError(f"{where}: entry {i} ({column[i].as_py()!r}) leaves the index folder; relative image "
                              "paths must lie inside it. Rebuild the index with 'deepmetric index ... --overwrite'")


def read_metadata(folder: Path, raw: dict | None = None) -> tuple[LazyPaths, np.ndarray, list[str]]:
    """``(paths, labels, class_names)`` of an index folder written with :func:`write_metadata`:
    from the files' bytes in ``raw`` (``{file name: bytes}``, already read) where given, else
    memory-mapped (a file rewritten in place would then change what is read)."""
    folder, raw = Path(folder), raw or {}
    table = _open(folder / METADATA_FILE, raw.get(METADATA_FILE))
    names = _open(folder / CLASS_NAMES_FILE, raw.get(CLASS_NAMES_FILE))
    if table.schema.names != ["path", "label"] or names.schema.names != ["name"]:
        raise ValueError(f"{folder}: {METADATA_FILE} / {CLASS_NAMES_FILE} have columns {table.schema.names} / "
                         f"{names.schema.names}, expected ['path', 'label'] / ['name']")
    _check_inside(table.column("path"), folder / METADATA_FILE)
    labels = table.column("label").to_numpy()
    return LazyPaths(table.column("path"), folder.resolve()), np.asarray(labels, np.int64), \
        [str(c) for c in names.column("name").to_pylist()]


#: the largest label an index without class names takes (it names every class 0..max)
MAX_UNNAMED_LABEL = 10_000_000


def check_label_range(labels: np.ndarray, class_names) -> None:
    """Labels are class numbers: none negative (an index of them could not be read back), and
    without class names none so large that naming 0..max would exhaust memory."""
    if not labels.size:
        return
    low, high = int(labels.min()), int(labels.max())
    renumber = "renumber them (numpy.unique(labels, return_inverse=True)) and give their class_names"
    if low < 0:
        raise ValueError(f"index: label {low} is negative; labels are class numbers 0, 1, ...: {renumber}")
    if class_names is None and high > MAX_UNNAMED_LABEL:
        raise ValueError(f"index: label {high} without class_names: the index would name every class from 0 to "
                         f"{high}; {renumber}")
