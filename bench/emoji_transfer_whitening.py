"""Does whitening the embedding after training widen the margin over the ImageNet features?
Measured on the cross-vendor *validation* emoji only (never the test).

    python bench/emoji_transfer_whitening.py RUN_DIR/last.pt [--out FILE.md]

PCA whitening with shrinkage, fitted on the training emoji (the training split without the
validation classes, the test transform): the l2-normalised pooled features are centred on their
training mean, multiplied by the inverse square root of their shrunk covariance
(``sklearn.covariance.ShrunkCovariance``: (1 - s) C + s tr(C) / d I) and l2-normalised again.
The same fit is applied to the fine-tuned checkpoint's pooled features and to the untouched
ImageNet network's (the baseline a user could whiten just as well), so the table says whether the
whitening helps *our* embedding more than the baseline: only then would it widen the margin.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

SHRINKS = (0.0, 0.1, 0.3)


def whitening(x: np.ndarray, shrink: float):
    """x [N, d] (l2-normalised rows) -> (mean [d], matrix [d, d]) of the shrunk PCA whitening."""
    from sklearn.covariance import ShrunkCovariance

    cov = ShrunkCovariance(shrinkage=shrink, assume_centered=False).fit(x)
    w, v = np.linalg.eigh(cov.covariance_)
    return cov.location_, (v * np.clip(w, 1e-12, None) ** -0.5) @ v.T


def l2n(x: np.ndarray) -> np.ndarray:
    return x / np.clip(np.linalg.norm(x, axis=1, keepdims=True), 1e-12, None)


def features(model, cfg, split: str) -> tuple[np.ndarray, object]:
    """The l2-normalised pooled features of ``split`` (the test transform) and its dataset."""
    import torch

    from deepmetric.run.builders import build_split
    from deepmetric.run.embed import compute_embeddings

    ds = build_split(cfg, split, train=False)
    with torch.no_grad():
        f = compute_embeddings(model, ds, batch_size=cfg.eval.batch_size, output="features")
    return l2n(np.asarray(f["embeddings"], dtype=np.float64)), ds


def cross_vendor(x: np.ndarray, ds, cfg) -> tuple[float, float]:
    """Cross-vendor Recall@1 and MAP@R in points, as the runs compute them."""
    from deepmetric.run.evaluation import cross_domain_metrics

    m = cross_domain_metrics({"embeddings": x.astype(np.float32), "labels": np.asarray(ds.labels)}, ds, cfg)
    return 100 * m["cross_domain_recall@1"], 100 * m["cross_domain_map@r"]


def table(model, cfg) -> list[tuple[str, float, float]]:
    xt, _ = features(model, cfg, "train")
    xv, val = features(model, cfg, "val")
    rows = [("none", *cross_vendor(xv, val, cfg))]
    for s in SHRINKS:
        mean, w = whitening(xt, s)
        rows.append((f"PCA whitening, shrinkage {s}", *cross_vendor(l2n((xv - mean) @ w), val, cfg)))
    return rows


def main() -> None:
    import torch

    from deepmetric.run.builders import build_model
    from deepmetric.run.embed import load_model_from_checkpoint

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", type=Path, help="a checkpoint of recipes/emoji_transfer.yaml (e.g. last.pt)")
    ap.add_argument("--out", type=Path, default=None, help="write the markdown table here")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    tuned, _, cfg, _ = load_model_from_checkpoint(args.checkpoint)
    imagenet = build_model(cfg, num_classes=2).eval()  # the untouched pretrained network
    ours, base = table(tuned, cfg), table(imagenet, cfg)
    lines = [f"Validation emoji, cross-vendor (`{args.checkpoint}`); points.", "",
             "| whitening | fine-tuned R@1 | fine-tuned MAP@R | ImageNet R@1 | ImageNet MAP@R | margin R@1 | margin MAP@R |",
             "|---|---|---|---|---|---|---|"]
    for (name, r, m), (_, br, bm) in zip(ours, base):
        lines.append(f"| {name} | {r:.2f} | {m:.2f} | {br:.2f} | {bm:.2f} | {r - br:+.2f} | {m - bm:+.2f} |")
    lines += ["", f"Computed by `python bench/emoji_transfer_whitening.py` in {time.perf_counter() - t0:.0f} s."]
    text = "\n".join(lines) + "\n"
    if args.out:
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
