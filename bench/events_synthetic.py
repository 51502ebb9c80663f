"""Synthetic ego-motion event recognition: softmax vs two-head (semi-hard), micro / macro accuracy.

Exercises the whole event path of the two-head paper's Sec. 4.2 on CPU: rendered long-tailed
clips (``synthetic_events``) -> 3 fps sampling, events < 2 s dropped -> random six-frame window
-> 5-channel stack of differences -> two-head compact ResNet (5 input channels) -> CE (+ semi-hard
triplet, lambda 1) with the training loop of ``deepmetric.train`` -> test: softmax averaged over
``--test-windows`` windows per event (``predict_events``), micro / macro accuracy and the
per-class table.  It tests the machinery, not the paper's HDD numbers.

    # hyper-parameters are chosen on the validation part of the training pool:
    nice -n 10 .venv/bin/python bench/events_synthetic.py --eval-split val --seeds 0 --lr 0.02 0.1
    # final runs on the test pool with the chosen lr:
    nice -n 10 .venv/bin/python bench/events_synthetic.py --eval-split test --seeds 0 1 2 --lr LR
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import time

import numpy as np
import torch

from deepmetric.data import build_dataset, build_transform, predict_events
from deepmetric.evaluate import format_per_class_table, per_class_accuracy
from deepmetric.train import train
from deepmetric.run.config_io import config_from_dict
from deepmetric.run.embed import load_model_from_checkpoint

METHODS = ("softmax", "two_head_semihard")


def make_config(method: str, seed: int, args, out_dir: str) -> dict:
    loss = [{"name": "cross_entropy", "weight": 1.0, "input": "logits"}]
    if method == "two_head_semihard":
        loss.append({"name": "triplet", "weight": args.lam, "input": "embedding",
                     "options": {"mining": "semihard", "margin": 0.2}})
    train_opts = {"iterations": args.iterations, "batch_size": args.batch_size, "sampler": "random",
                  "seed": seed, "out_dir": out_dir, "progress": False, "device": "cpu",
                  "num_threads": args.threads}
    if args.balanced:
        train_opts.update(sampler="class_balanced", m=args.balanced[0], n=args.balanced[1],
                          batch_size=args.balanced[0] * args.balanced[1])
    return {
        "name": f"events_{method}_s{seed}",
        "data": {"name": "synthetic_events", "options": {"size": args.size, "cache": True, "seed": args.data_seed},
                 "train_split": "train", "transform": "sod", "transform_options": {}, "num_workers": 0},
        "model": {"name": "two_head", "options": {"backbone": "glyph_resnet", "in_chans": 5,
                                                  "input_size": args.size, "embedding_dim": args.embedding_dim,
                                                  "widths": args.widths, "depths": [1] * len(args.widths)}},
        "loss": loss,
        "optim": {"name": "sgd", "lr": args.lr_value, "momentum": 0.9, "weight_decay": 5e-4},
        "schedule": {"lr": {"name": "poly", "unit": "iteration", "power": 1.0, "end_factor": 0.0}},
        "train": train_opts,
        # the loop's own evaluation (centre window, retrieval + accuracy) on the chosen split
        "eval": {"every": 0, "split": args.eval_split, "ks": [1], "metrics": ["recall"],
                 "classification": True},
    }


def run_one(method: str, seed: int, args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cfg = config_from_dict(make_config(method, seed, args, tmp))
        t0 = time.perf_counter()
        train(cfg)
        seconds = time.perf_counter() - t0
        model, _, _, _ = load_model_from_checkpoint(os.path.join(tmp, "last.pt"))
    ds = build_dataset("synthetic_events", split=args.eval_split, transform=build_transform("sod", train=False),
                       size=args.size, cache=True, seed=args.data_seed, test_windows=args.test_windows)
    torch.set_num_threads(args.threads)
    pred = predict_events(model, ds)
    res = per_class_accuracy(pred["probs"], pred["labels"], class_names=ds.class_names)
    res["train_seconds"] = seconds
    return res


def ci95(values: list[float]) -> float:
    """Half-width of the t-based 95% confidence interval of the mean."""
    t = {2: 12.706, 3: 4.303, 4: 3.182, 5: 2.776}.get(len(values), 1.96)
    return t * statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else float("nan")


def summarize(results: dict[str, list[dict]], title: str) -> None:
    """Print mean, std and 95% CI over seeds of micro / macro accuracy, and the per-class table."""
    methods = list(results)
    print(f"\n### {title}\n")
    print("| method | seeds | micro acc. % (mean +- std, 95% CI) | macro acc. % (mean +- std, 95% CI) |\n|---|---|---|---|")
    for m in methods:
        row = []
        for key in ("micro", "macro"):
            v = [100 * r[key] for r in results[m]]
            sd = statistics.stdev(v) if len(v) > 1 else float("nan")
            row.append(f"{statistics.mean(v):.2f} +- {sd:.2f} (+- {ci95(v):.2f})")
        print(f"| {m} | {len(results[m])} | {row[0]} | {row[1]} |")
    mean_tables = {}
    for m in methods:
        first = results[m][0]
        classes = [dict(c, accuracy=float(np.mean([r["classes"][i]["accuracy"] for r in results[m]])))
                   for i, c in enumerate(first["classes"])]
        mean_tables[m] = {"classes": classes, "count": first["count"],
                          "micro": float(np.mean([r["micro"] for r in results[m]])),
                          "macro": float(np.mean([r["macro"] for r in results[m]]))}
    print("\nper-class accuracy (%), mean over seeds:\n")
    print(format_per_class_table(mean_tables))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="training seeds")
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--lr", type=float, nargs="+", default=[0.1], help="learning rate(s); several = a sweep (default: 0.1, chosen on val)")
    ap.add_argument("--iterations", type=int, default=250)
    ap.add_argument("--batch-size", type=int, default=33)
    ap.add_argument("--balanced", type=int, nargs=2, metavar=("M", "N"), default=None,
                    help="class-balanced sampler: M classes x N events per batch (instead of random)")
    ap.add_argument("--lam", type=float, default=1.0, help="triplet weight lambda")
    ap.add_argument("--size", type=int, default=32, help="rendered frame size")
    ap.add_argument("--widths", type=int, nargs="+", default=[16, 32, 64], help="compact ResNet stage widths")
    ap.add_argument("--embedding-dim", type=int, default=64)
    ap.add_argument("--data-seed", type=int, default=0, help="seed of the rendered clips (fixed across runs)")
    ap.add_argument("--eval-split", default="test", choices=["val", "test"])
    ap.add_argument("--test-windows", type=int, default=3, help="windows averaged per test event")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None, help="also write all results here")
    ap.add_argument("--summarize", nargs="+", default=None, metavar="JSON",
                    help="only print the summary of earlier --json outputs (methods merged), no training")
    args = ap.parse_args(argv)
    if args.summarize:
        merged: dict[str, list] = {}
        for path in args.summarize:
            with open(path) as fh:
                for _lr, res in json.load(fh).items():
                    for m, runs in res.items():
                        merged.setdefault(m, []).extend(runs)
        summarize(merged, f"merged from {', '.join(args.summarize)}")
        return 0
    print(f"load average at start: {os.getloadavg()}; cpus={os.cpu_count()} threads={args.threads}", flush=True)
    everything = {}
    for lr in args.lr:
        args.lr_value = lr
        results = {m: [] for m in args.methods}
        for seed in args.seeds:
            for m in args.methods:
                r = run_one(m, seed, args)
                results[m].append(r)
                print(f"lr={lr:g} seed={seed} {m:18s} micro={r['micro']:.4f} macro={r['macro']:.4f} "
                      f"({r['train_seconds']:.0f} s)", flush=True)
        summarize(results, f"lr={lr:g}, {args.iterations} iterations, batch {args.batch_size}, split "
                           f"{args.eval_split}, {len(args.seeds)} seed(s), {args.test_windows} windows per event")
        everything[str(lr)] = results
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(everything, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
