"""Reading embedding files and the ``deepmetric evaluate`` command."""
from __future__ import annotations

import json
import zipfile
from pathlib import Path

import numpy as np


def load_npz(path) -> dict[str, np.ndarray | None]:
    """Load ``embeddings`` (N x d float), ``labels`` (N int) and optional boolean ``is_query`` /
    ``is_gallery`` from an .npz file; every problem is reported with the file and key."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    try:
        data = np.load(path, allow_pickle=False)
    except (zipfile.BadZipFile, ValueError, OSError) as exc:
        raise ValueError(f"{path}: not a readable .npz file ({exc})") from None
    with data:
        keys = set(data.files)
        out = {}
        for key in ("embeddings", "labels"):
            if key not in keys:
                raise ValueError(f"{path}: missing array '{key}' (found: {', '.join(sorted(keys)) or 'none'})")
            out[key] = data[key]
        for key in ("is_query", "is_gallery"):
            out[key] = data[key] if key in keys else None
    emb, lab = out["embeddings"], out["labels"]
    if emb.ndim != 2 or not np.issubdtype(emb.dtype, np.floating):
        raise ValueError(f"{path}: 'embeddings' must be a 2-D float array (N x d), "
                         f"got shape {emb.shape} dtype {emb.dtype}")
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


def run_evaluate_cli(args) -> int:
    """Body of ``deepmetric evaluate`` (argument parsing lives in deepmetric.cli)."""
    from deepmetric.evaluate.engine import evaluate

    data = load_npz(args.npz)
    try:
        res = evaluate(data["embeddings"], data["labels"], is_query=data["is_query"],
                       is_gallery=data["is_gallery"], ks=args.ks, metrics=args.metrics,
                       seed=args.seed, chunk_size=args.chunk_size, backend=args.backend,
                       memory_mb=args.memory_mb, nmi_average=args.nmi_average)
    except (ValueError, TypeError) as exc:
        raise type(exc)(f"{args.npz}: {exc}") from None
    print(format_table(res))
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({k: (int(v) if isinstance(v, (int, np.integer)) else float(v))
                                   for k, v in res.items()}, indent=2) + "\n")
        print(f"wrote {out}")
    return 0
