"""Forward + backward speed of deepmetric losses next to their pytorch-metric-learning 2.9 counterparts.

Batch 256 (64 classes x 4 samples), 512-d embeddings by default. Both sides get the same
inputs in the same process; repeats are interleaved (ours, theirs, theirs, ours, ...) so a
noisy shared CPU hits both alike, and the median is reported.

    .venv/bin/python bench/loss_speed.py                # defaults: 30 repeats, 1 thread
    .venv/bin/python bench/loss_speed.py --repeats 50 --threads 2 --device cuda
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from deepmetric.losses import (
    CenterLoss,
    ContrastiveLoss,
    LiftedStructureLoss,
    NPairLoss,
    ProxyNCALoss,
    TripletLoss,
    build_loss,
)


def pml_pairs(num_classes: int, dim: int):
    """(name, ours, theirs) triples; theirs is None where pml has no counterpart."""
    from pytorch_metric_learning import losses as pl
    from pytorch_metric_learning import miners as pm
    from pytorch_metric_learning.distances import LpDistance

    def pml_with_miner(loss, miner):
        return lambda x, y: loss(x, y, miner(x, y))

    sq = LpDistance(power=2)
    alpha = 16.0
    rows = [
        (
            "heated_softmax (alpha 16) | NormalizedSoftmaxLoss",
            build_loss("heated_softmax", num_classes=num_classes, embedding_dim=dim, alpha=alpha),
            pl.NormalizedSoftmaxLoss(num_classes=num_classes, embedding_size=dim, temperature=1 / alpha),
        ),
        ("npair | NPairsLoss", NPairLoss(), pl.NPairsLoss()),
        ("lifted | LiftedStructureLoss", LiftedStructureLoss(normalize=True), pl.LiftedStructureLoss()),
        (
            "proxy_nca | ProxyNCALoss",
            ProxyNCALoss(num_classes, dim),
            pl.ProxyNCALoss(num_classes=num_classes, embedding_size=dim),
        ),
        ("contrastive | ContrastiveLoss", ContrastiveLoss(), pl.ContrastiveLoss()),
        (
            "triplet hard | TripletMarginLoss+BatchHardMiner",
            TripletLoss(mining="hard", margin=0.2),
            pml_with_miner(pl.TripletMarginLoss(margin=0.2, distance=sq), pm.BatchHardMiner(distance=sq)),
        ),
        (
            "triplet semihard | TripletMarginLoss+TripletMarginMiner(semihard)",
            TripletLoss(mining="semihard", margin=0.2),
            pml_with_miner(
                pl.TripletMarginLoss(margin=0.2, distance=sq),
                pm.TripletMarginMiner(margin=0.2, type_of_triplets="semihard", distance=sq),
            ),
        ),
        (
            "triplet all | TripletMarginLoss (all triplets)",
            TripletLoss(mining="all", margin=0.2),
            pl.TripletMarginLoss(margin=0.2, distance=sq),
        ),
        ("almn (beta 3)", build_loss("almn", num_classes=num_classes, embedding_dim=dim), None),
        ("center", CenterLoss(num_classes, dim), None),
    ]
    return rows


def time_once(fn, base: torch.Tensor, labels: torch.Tensor, sync) -> float:
    x = base.clone().requires_grad_(True)
    sync()
    t0 = time.perf_counter()
    loss = fn(x, labels)
    loss.backward()
    sync()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--classes", type=int, default=64)
    ap.add_argument("--per-class", type=int, default=4)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    b = args.classes * args.per_class
    labels = torch.arange(args.classes).repeat_interleave(args.per_class)
    labels = labels[torch.randperm(b)].to(device)
    base = torch.nn.functional.normalize(torch.randn(b, args.dim), dim=1).to(device)

    rows = pml_pairs(args.classes, args.dim)
    for _, ours, theirs in rows:
        for m in (ours, theirs):
            if isinstance(m, torch.nn.Module):
                m.to(device).train()

    times = {name: ([], []) for name, _, _ in rows}
    for _ in range(args.warmup):
        for _, ours, theirs in rows:
            time_once(ours, base, labels, sync)
            if theirs is not None:
                time_once(theirs, base, labels, sync)
    for rep in range(args.repeats):
        for name, ours, theirs in rows:
            order = [(0, ours), (1, theirs)] if rep % 2 == 0 else [(1, theirs), (0, ours)]
            for side, fn in order:
                if fn is not None:
                    times[name][side].append(time_once(fn, base, labels, sync))

    print(
        f"torch {torch.__version__}, device {device}, threads {args.threads}, batch {b} "
        f"({args.classes} classes x {args.per_class}), dim {args.dim}, median of {args.repeats} interleaved repeats"
    )
    header = f"| {'loss (ours | pml 2.9)':<68} | {'ours ms':>8} | {'pml ms':>8} | {'pml/ours':>8} |"
    print(header)
    print("|" + "-" * 70 + "|" + ("-" * 9 + ":|") * 3)
    for name, _, theirs in rows:
        ours_ms = 1000 * statistics.median(times[name][0])
        if theirs is None:
            print(f"| {name:<68} | {ours_ms:8.2f} | {'-':>8} | {'-':>8} |")
        else:
            pml_ms = 1000 * statistics.median(times[name][1])
            print(f"| {name:<68} | {ours_ms:8.2f} | {pml_ms:8.2f} | {pml_ms / ours_ms:8.2f} |")


if __name__ == "__main__":
    main()
