"""Reading embedding files for ``deepmetric evaluate`` (the command itself: deepmetric.cli.evaluate)."""
from __future__ import annotations

import re
import zipfile
from pathlib import Path

import numpy as np

from deepmetric.files import HEAD_BYTES, text_start


_EXPECTED = ("an .npz file with arrays 'embeddings' (N x d float) and 'labels' (N integers), "
             "as written by 'deepmetric embed CHECKPOINT --out EMB.npz' or "
             "numpy.savez(path, embeddings=E, labels=y)")

# (leading bytes, what the file is, what to do instead)
_SIGNATURES = (
    (b"\x89PNG\r\n\x1a\n", "a PNG image", "to embed images, train a model and run 'deepmetric embed'"),
    (b"\xff\xd8\xff", "a JPEG image", "to embed images, train a model and run 'deepmetric embed'"),
    (b"GIF8", "a GIF image", "to embed images, train a model and run 'deepmetric embed'"),
    (b"BM", "a BMP image", "to embed images, train a model and run 'deepmetric embed'"),
    (b"RIFF", "a RIFF file (e.g. a WebP image)", "to embed images, train a model and run 'deepmetric embed'"),
    (b"\x1f\x8b", "a gzip archive", "extract it first"),
    (b"%PDF", "a PDF document", ""),
)


def describe_file(path: Path) -> str | None:
    """What ``path`` is when it is clearly not an .npz of embeddings (None when it may be one):
    a single-array ``.npy``, an image, a PyTorch checkpoint, an ONNX model, a text file, any other
    binary file (numpy reads those as pickles, and its error advises ``allow_pickle=True``)."""
    with open(path, "rb") as f:
        head = f.read(HEAD_BYTES)
    if not head:
        return "an empty file"
    if head.startswith(b"\x93NUMPY"):
        try:
            arr = np.load(path, mmap_mode="r", allow_pickle=False)
            what = f"a single .npy array of shape {arr.shape} and dtype {arr.dtype}"
        except (ValueError, OSError):
            what = "a single .npy array"
        return (f"{what}, not an .npz archive. Save the embeddings together with their labels: "
                "numpy.savez('emb.npz', embeddings=E, labels=y)")
    for magic, what, todo in _SIGNATURES:
        if head.startswith(magic):
            return what + (f"; {todo}" if todo else "")
    if head.startswith(b"PK"):
        try:
            with zipfile.ZipFile(path) as z:
                names = z.namelist()
        except zipfile.BadZipFile:
            return None
        if any(n.endswith("data.pkl") for n in names):
            return ("a PyTorch checkpoint (torch.save), not embeddings; write the embeddings of a split "
                    "with 'deepmetric embed CHECKPOINT --out EMB.npz' and evaluate that")
        if names and not all(n.endswith(".npy") for n in names):
            return f"a zip archive of {', '.join(names[:3])}{', ...' if len(names) > 3 else ''}, not an .npz"
        return None
    if path.suffix.lower() == ".onnx" or re.match(rb"\x08[\x01-\x7f]\x12", head):  # ModelProto: ir_version, producer
        return ("an ONNX model ('deepmetric export'), not embeddings; write the embeddings of a split with "
                "'deepmetric embed CHECKPOINT --out EMB.npz' and evaluate that")
    first = text_start(head)
    if first is None:  # numpy would read it as a pickle, and advise allow_pickle=True
        return f"a binary file of another kind (it starts with bytes {head[:8].hex(' ')}), not an .npz archive"
    return f"a text file (it starts with {first[:60]!r})"


def load_npz(path, *, require_labels: bool = True) -> dict[str, np.ndarray | None]:
    """Load ``embeddings`` (N x d float), ``labels`` (N int) and optional boolean ``is_query`` /
    ``is_gallery`` from an .npz file; every problem is reported with the file and key.  A file
    that is something else (an .npy array, an image, a checkpoint, text) is named as such.
    ``require_labels=False`` (a whitening fit set: no labels needed) makes ``labels`` optional."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{path}: is a folder; expected {_EXPECTED}")
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    what = describe_file(path)
    if what is not None:
        raise ValueError(f"{path}: this is {what}. 'deepmetric evaluate' expects {_EXPECTED}.")
    try:
        data = np.load(path, allow_pickle=False)
    except (zipfile.BadZipFile, ValueError, OSError) as exc:
        raise ValueError(f"{path}: not a readable .npz file ({exc}); expected {_EXPECTED}") from None
    with data:
        keys = set(data.files)
        out = {}
        for key in ("embeddings", "labels"):
            if key not in keys and (key == "embeddings" or require_labels):
                raise ValueError(f"{path}: missing array '{key}' (found: {', '.join(sorted(keys)) or 'none'})")
        for key in ("embeddings", "labels", "is_query", "is_gallery"):
            try:  # an object array (pickled) or a damaged member fails only here, when it is read
                out[key] = data[key] if key in keys else None
            except (ValueError, OSError, EOFError, zipfile.BadZipFile) as exc:
                raise ValueError(f"{path}: array '{key}' cannot be read ({exc}); expected {_EXPECTED}") from None
    emb, lab = out["embeddings"], out["labels"]
    # integers are numbers too (quantised vectors): as `report`, `index --embeddings` and the
    # Python API read them; bool, complex, strings are not
    if emb.ndim != 2 or not (np.issubdtype(emb.dtype, np.floating) or np.issubdtype(emb.dtype, np.integer)):
        raise ValueError(f"{path}: 'embeddings' must be a 2-D float array (N x d), "
                         f"got shape {emb.shape} dtype {emb.dtype}")
    if lab is None:
        return out
    if lab.ndim != 1 or not np.issubdtype(lab.dtype, np.integer):
        raise ValueError(f"{path}: 'labels' must be a 1-D integer array, got shape {lab.shape} dtype {lab.dtype}")
    if len(lab) != len(emb):
        raise ValueError(f"{path}: 'labels' has {len(lab)} entries but 'embeddings' has {len(emb)} rows")
    for key in ("is_query", "is_gallery"):
        m = out[key]
        if m is not None and (m.dtype != bool or m.shape != (len(emb),)):
            raise ValueError(f"{path}: '{key}' must be a boolean array of shape ({len(emb)},), "
                             f"got shape {m.shape} dtype {m.dtype}")
    return out


def format_table(metrics: dict[str, float]) -> str:
    """A two-column plain-text table; rates are shown as percentages."""
    width = max(len(k) for k in metrics) if metrics else 6
    lines = [f"{'metric':<{width}}  value", f"{'-' * width}  ------"]
    for k, v in metrics.items():
        shown = f"{v}" if isinstance(v, (int, np.integer)) else f"{100 * v:6.2f}"
        lines.append(f"{k:<{width}}  {shown}")
    return "\n".join(lines)


def evaluate_cli_search_device(args, nbytes: int = 0, *, cuda_available: bool | None = None):
    """Where ``deepmetric evaluate`` searches: ``--device`` (auto | cpu | cuda[:i]) with
    ``--backend`` (:func:`deepmetric.evaluate.choose_search_device`; errors name the flags)."""
    from deepmetric.evaluate.knn import choose_search_device

    return choose_search_device(getattr(args, "device", "auto"), backend=args.backend, nbytes=nbytes,
                                memory_mb=args.memory_mb, cuda_available=cuda_available)
