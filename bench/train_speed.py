"""Training throughput: ``deepmetric train`` against a bare PyTorch loop.

For one recipe (``glyph``: the demo recipe, compact ResNet on 32x32 glyphs, batch 64, heated
softmax, glyph augmentation; ``emoji``: studies/emoji.yaml's BN run, EfficientNet-Lite0 on
64x64 emoji, first 3 stages frozen, batch 64, heated softmax, emoji augmentation; needs the
emoji benchmark and the EfficientNet-Lite backbones) it measures images/s of

* **deepmetric**: ``deepmetric.train.train(cfg)``, i.e. the real loop with the dataset, the
  augmentation, the batch sampler, the DataLoader (``data.num_workers`` workers) and logging;
  timed from the start of training step ``--warmup`` to the start of the last step (a
  forward pre-hook on the model), so each timed step includes its wait for the loader;
  evaluation and checkpoints at the end are outside;
* **bare**: the same model, loss, optimiser and batch size in a plain loop over random
  batches of images already in memory as one tensor (no loader, no augmentation): forward,
  loss, backward, step, ``loss.item()``.

Both run in this process with ``torch.set_num_threads(T)``, one after the other and
alternating the order each repeat, so machine load affects both; the ratio of each
deepmetric run to the bare run of the same repeat is reported, by wall time and by CPU time
of this process (images per CPU-second: robust to other jobs on a shared machine when the
loader has no workers).

    python bench/train_speed.py --recipe glyph [--threads 1 2] [--workers 0 1] [--steps 60]
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import yaml

from deepmetric.run.config_io import apply_overrides, config_from_dict
from deepmetric.run.builders import build_split as build_dataset_split, build_losses, build_model
from deepmetric.train.loop import train
from deepmetric.train.optim import build_optimizer


def recipe(name: str) -> dict:
    """The raw config of a recipe (speed only: short evaluation on a few test classes)."""
    if name == "glyph":
        from deepmetric.workflows.demo import demo_recipe

        raw = yaml.safe_load(demo_recipe("glyphs").read_text())
        # training on the demo's 400 characters; evaluate only 20 test characters (not timed)
        raw["data"]["options"] = {"max_train_classes": 400, "max_classes": 20, "size": 32}
        return raw
    if name == "emoji":  # studies/emoji.yaml's BN run (speed only: no pretrained weights needed)
        return {
            "data": {"name": "emoji", "options": {"size": 64}, "transform": "emoji",
                     "transform_options": {"normalize": "minus_one_one"}},
            "model": {"name": "efficientnet_lite0", "options": {"embedding_dim": 64, "norm": "bn", "freeze_stages": 3}},
            "loss": [{"name": "heated_softmax", "options": {"alpha": 16.0}}],
            "optim": {"name": "sgd", "lr": 0.01, "momentum": 0.9, "weight_decay": 0.0001, "new_layer_lr_mult": 10.0},
            "train": {"batch_size": 64},
        }
    raise SystemExit(f"unknown recipe {name!r}; use glyph or emoji")


def make_config(name: str, out_dir: Path, threads: int, workers: int, iterations: int, extra: list[str]):
    raw = recipe(name)
    raw.setdefault("train", {}).update({"iterations": iterations, "num_threads": threads, "progress": False,
                                        "out_dir": str(out_dir), "checkpoint_every": 1000})
    raw["train"].pop("epochs", None)
    raw["data"]["num_workers"] = workers
    raw["eval"] = {"every": 0, "metrics": ["recall"], "ks": [1], "baselines": False}
    raw["schedule"] = {"temperature": {"name": "none"}}
    apply_overrides(raw, extra)
    return config_from_dict(raw)


class StepClock:
    """Forward pre-hook on the model: wall and process CPU time at the start of every
    training forward (grad enabled; evaluation forwards are not counted).  The interval from
    the start of step ``warmup`` to the start of the last step covers whole steps, each with
    its wait for the next batch."""

    def __init__(self):
        self.wall: list[float] = []
        self.cpu: list[float] = []

    def __call__(self, module, args):
        if torch.is_grad_enabled() and module.training:
            self.wall.append(time.perf_counter())
            self.cpu.append(time.process_time())

    def rates(self, batch: int, warmup: int) -> tuple[float, float]:
        n = len(self.wall) - 1 - warmup
        return (batch * n / (self.wall[-1] - self.wall[warmup]), batch * n / (self.cpu[-1] - self.cpu[warmup]))


def deepmetric_images_per_s(cfg, warmup: int) -> tuple[float, float]:
    """(wall, CPU) images/s of ``train(cfg)``: the model built by the loop gets a StepClock."""
    import deepmetric.train.setup as loop

    clock = StepClock()
    original = loop.build_model

    def build_model_with_clock(*a, **k):
        model = original(*a, **k)
        model.register_forward_pre_hook(clock)
        return model

    loop.build_model = build_model_with_clock
    try:
        train(cfg)
    finally:
        loop.build_model = original
    batch = cfg.train.m * cfg.train.n if cfg.train.sampler == "class_balanced" else cfg.train.batch_size
    return clock.rates(batch, warmup)


def in_memory_images(cfg, limit: int = 4096):
    ds = build_dataset_split(cfg, cfg.data.train_split, train=False)  # test transform: no augmentation
    idx = np.random.default_rng(0).permutation(len(ds))[:limit]
    x = torch.stack([torch.as_tensor(ds[int(i)][0]) for i in idx])
    y = torch.as_tensor(np.asarray(ds.labels)[idx], dtype=torch.long)
    return x, y, int(getattr(ds, "num_classes", int(np.max(ds.labels)) + 1))


def bare_images_per_s(cfg, data, threads: int, warmup: int, steps: int) -> tuple[float, float]:
    """(wall, CPU) images/s of a plain loop over in-memory random batches."""
    x_all, y_all, num_classes = data
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = build_model(cfg, num_classes=num_classes)
    clock = StepClock()
    model.register_forward_pre_hook(clock)
    emb_dim = getattr(model, "embedding_dim", None)
    losses = build_losses(cfg, num_classes=num_classes, embedding_dim=emb_dim)
    opt = build_optimizer(model, losses, cfg.optim)
    model.train()
    batch = cfg.train.m * cfg.train.n if cfg.train.sampler == "class_balanced" else cfg.train.batch_size
    g = torch.Generator().manual_seed(0)
    for _ in range(warmup + steps + 1):
        idx = torch.randint(len(x_all), (batch,), generator=g)
        x, y = x_all[idx], y_all[idx]
        out = model(x)
        loss = sum(t.weight * l(out[t.input], y) for t, l in zip(cfg.loss, losses))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        loss.item()
    return clock.rates(batch, warmup)


def _label(c) -> str:
    return f"workers={c[0]}, {'batched' if c[1] else 'per-image'} aug"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="glyph", choices=["glyph", "emoji"])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="torch threads T (both sides)")
    ap.add_argument("--workers", type=int, nargs="+", default=[0, 1], help="deepmetric data.num_workers")
    ap.add_argument("--batched", type=int, nargs="+", default=None, choices=[0, 1],
                    help="deepmetric with per-image (0) and/or batched (1) augmentation "
                         "(data.transform_options.batched; default: 0 1 for glyph, 0 for emoji)")
    ap.add_argument("--steps", type=int, default=60, help="timed steps per measurement")
    ap.add_argument("--warmup", type=int, default=8, help="untimed steps first")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("overrides", nargs="*", help="config overrides for both sides, e.g. train.batch_size=128")
    args = ap.parse_args()
    if args.batched is None:
        args.batched = [0, 1] if args.recipe == "glyph" else [0]

    print(f"machine: {platform.machine()}, {len(os.sched_getaffinity(0))} cores visible, torch {torch.__version__}, "
          f"load average {tuple(round(v, 2) for v in os.getloadavg())}")
    print(f"recipe {args.recipe}: {args.warmup} warm-up + {args.steps} timed steps, {args.repeats} repeats; "
          f"overrides {args.overrides}")
    tmp = Path(tempfile.mkdtemp(prefix="train_speed_"))
    base_cfg = make_config(args.recipe, tmp / "probe", 1, 0, 1, args.overrides)
    t = time.perf_counter()
    data = in_memory_images(base_cfg)
    print(f"in-memory data for the bare loop: {tuple(data[0].shape)} ({time.perf_counter() - t:.1f} s)")
    results: dict[tuple, list[float]] = {}
    ratios: dict[tuple, list[float]] = {}
    for rep in range(args.repeats):
        for threads in args.threads:
            dm = [(w, b) for b in args.batched for w in args.workers]
            order = [("bare", None)] + [("deepmetric", c) for c in dm]
            if rep % 2:
                order.reverse()
            bare = None
            runs = {}
            for kind, w in order:
                if kind == "bare":
                    cfg = make_config(args.recipe, tmp / "bare", threads, 0, 1, args.overrides)
                    v = bare_images_per_s(cfg, data, threads, args.warmup, args.steps)
                    bare = v
                else:
                    out = tmp / f"dm_r{rep}_t{threads}_w{w[0]}_b{w[1]}"
                    extra = args.overrides + (["data.transform_options.batched=true"] if w[1] else [])
                    cfg = make_config(args.recipe, out, threads, w[0], args.warmup + args.steps + 1, extra)
                    v = deepmetric_images_per_s(cfg, args.warmup)
                runs[(kind, w)] = v
                results.setdefault((threads, kind, w), []).append(v)
                print(f"  repeat {rep + 1} T={threads} {kind:10s} {'' if w is None else _label(w):22s} "
                      f"wall {v[0]:8.1f} images/s   CPU {v[1]:8.1f} images/CPU-s   (load {os.getloadavg()[0]:.2f})",
                      flush=True)
            for c in dm:
                ratios.setdefault((threads, c), []).append(tuple(a / b for a, b in zip(runs[("deepmetric", c)], bare)))
    print()
    print("| T | loop | data | wall images/s (median) | CPU images/s (median) | "
          "deepmetric / bare, wall (per repeat) | deepmetric / bare, CPU (per repeat) |")
    print("|---|---|---|---|---|---|---|")
    for threads in args.threads:
        for kind, w in [("bare", None)] + [("deepmetric", (w, b)) for b in args.batched for w in args.workers]:
            vals = results[(threads, kind, w)]
            wall = statistics.median(v[0] for v in vals)
            cpu = statistics.median(v[1] for v in vals)
            rw = rc = ""
            if kind != "bare":
                rw = ", ".join(f"{r[0]:.2f}" for r in ratios[(threads, w)])
                rc = ", ".join(f"{r[1]:.2f}" for r in ratios[(threads, w)])
            data_col = "in memory, no augmentation" if w is None else _label(w)
            print(f"| {threads} | {kind} | {data_col} | {wall:,.0f} | {cpu:,.0f} | {rw} | {rc} |")
    print("\nCPU images/s = images per CPU-second of this process (load-independent for workers=0; "
          "loader workers' CPU is not counted, so compare those by wall time on a quiet machine).")


if __name__ == "__main__":
    sys.exit(main())
