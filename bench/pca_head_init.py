"""The embedding head at epoch 0: a random head against the PCA of the pretrained features
(``model.options.head_init``, docs/models.md#keeping-what-the-backbone-learnt), on the emoji
training split, searched cross-vendor.  Nothing is trained and the test split is not touched.

The ImageNet EfficientNet-Lite0 embeds ``--classes`` random training emoji classes (every vendor's
image, ``--size`` px, [-1, 1] input); the head (PCA or the projection's running BN statistics) is
fitted on half of these classes and evaluated on the other half: Recall@1 / MAP@R cross-vendor
(each vendor's images against the other vendors') and the share of each image's 10 cosine
neighbours among the pooled features' own 10 that the embedding keeps.

    PYTHONPATH=src .venv/bin/python bench/pca_head_init.py                    # 64 px, 400 classes, k 128
    PYTHONPATH=src .venv/bin/python bench/pca_head_init.py --dims 128 512 --size 96
"""
from __future__ import annotations

import argparse

import numpy as np
import torch

from deepmetric.data.emoji import build_emoji_dataset
from deepmetric.evaluate import evaluate_cross_domain
from deepmetric.models import create_model
from deepmetric.models.heads import EmbeddingHead


def pooled_features(size: int, classes: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    ds = build_emoji_dataset("train", size=size)
    chosen = np.random.default_rng(seed).permutation(ds.num_classes)[:classes]
    idx = np.flatnonzero(np.isin(ds.labels, chosen))
    x = (torch.from_numpy(ds.images[idx]).permute(0, 3, 1, 2).float() / 255.0 - 0.5) / 0.5
    model = create_model("efficientnet_lite0", pretrained="imagenet").eval()
    with torch.no_grad():
        f = torch.cat([model.forward_head(model.forward_features(x[i:i + 128]), pre_logits=True)
                       for i in range(0, len(x), 128)])
    return f.numpy(), ds.labels[idx], ds.vendor_ids[idx]


def neighbours(x: np.ndarray, k: int = 10) -> np.ndarray:
    x = x / np.linalg.norm(x, axis=1, keepdims=True)
    s = x @ x.T
    np.fill_diagonal(s, -np.inf)
    return np.argsort(-s, axis=1)[:, :k]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--classes", type=int, default=400)
    ap.add_argument("--dims", type=int, nargs="+", default=[128])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(2)
    f, y, v = pooled_features(args.size, args.classes, args.seed)
    cls = np.unique(y)
    fit = np.isin(y, np.random.default_rng(args.seed + 1).permutation(cls)[: len(cls) // 2])
    ev = ~fit
    truth = neighbours(f[ev])

    def row(name: str, e: np.ndarray) -> None:
        m = evaluate_cross_domain(e, y[ev], v[ev], ks=(1,), metrics=("recall", "map@r"))["mean"]
        kept = np.mean([len(set(a) & set(b)) / len(a) for a, b in zip(neighbours(e), truth)])
        print(f"| {name} | {100 * m['recall@1']:.1f} | {100 * m['map@r']:.1f} | {100 * kept:.0f} % |")

    print(f"{len(f)} images, {len(cls)} classes ({fit.sum()} images fit the head, {ev.sum()} evaluated), "
          f"{args.size} px")
    print("| embedding | cross-vendor R@1 | MAP@R | 10-NN kept |\n|---|---|---|---|")
    row(f"pooled features ({f.shape[1]}-d)", f[ev])
    features = torch.from_numpy(f)
    for k in args.dims:
        for norm in ("bn", "l2"):
            for init in ("random", "pca", "pca_whiten"):
                torch.manual_seed(args.seed)
                head = EmbeddingHead(f.shape[1], k, norm=norm)
                if init != "random":
                    head.init_from_pca(features[fit], whiten=init == "pca_whiten")
                elif head.bn is not None:  # the running statistics a few training steps would give
                    with torch.no_grad():
                        z = head.proj(features[fit])
                        head.bn.running_mean.copy_(z.mean(0))
                        head.bn.running_var.copy_(z.var(0))
                with torch.no_grad():
                    e = head.eval()(features[ev]).numpy()
                row(f"{k}-d {norm} head, {init}", e)


if __name__ == "__main__":
    main()
