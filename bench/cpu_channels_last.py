"""channels_last on the CPU: is a training step faster, and what does it change?

Issue 30 asks to make a run cheaper where it does not change the result.  ``train.channels_last``
was only measured on a GPU (section 8 of bench/RESULTS.md).  This measures it on the CPU for
the two-head closed-set model of bench/two_head_accuracy.py (EfficientNet-Lite0 with a 1,911-way
classifier at 64 px, batch 64, every stage trained), three ways:

* **speed**: training steps (forward, cross-entropy on the logits, backward, SGD step) on one
  random batch already in memory, contiguous and channels_last in alternating order each repeat
  (``--repeats``), so load on a shared machine affects both alike; the median step of each;
* **what it computes**: the gradients of one train-mode step (batch-norm on batch statistics)
  in float64 for both layouts (the same mathematics: they must agree to rounding), each layout's
  float32 gradients against the float64 ones (what the layout changes is rounding), and, as the
  scale to read those against, how far apart the gradients of the batch's two halves are;
* **a real run** (``--real``, optional): ``deepmetric train`` of a recipe for one epoch with each
  layout (one after the other, alternating with ``--real-repeats``), its ``wall_time_s``.

    python bench/cpu_channels_last.py --out bench/results/cpu_channels_last.json
    python bench/cpu_channels_last.py --real recipes/two_head/emoji_closed_set_semihard.yaml
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from deepmetric.models import create_model  # noqa: E402

CLASSES = 1911  # every emoji class (the closed-set task)
# the two-head runs set these overrides for the lr phase (bench/two_head_accuracy.py LR_OVERRIDES)
REAL_OVERRIDES = ("train.epochs=1", "train.seed=0", "optim.lr=0.01", "train.num_threads=1",
                  "data.options.val_vendor=facebook", "data.val_split=val", "eval.split=null", "eval.every=1",
                  "eval.best_metric=top1")


def build(size: int, channels_last: bool, dtype=torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)  # the same weights for both layouts
    net = create_model("two_head", backbone="efficientnet_lite0", input_size=size, embedding_dim=256,
                       norm="l2", num_classes=CLASSES).train().to(dtype)
    return net.to(memory_format=torch.channels_last) if channels_last else net


def batch(size: int, n: int, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 3, size, size, generator=g).to(dtype), torch.randint(0, CLASSES, (n,), generator=g)


def as_layout(x: torch.Tensor, channels_last: bool) -> torch.Tensor:
    return x.contiguous(memory_format=torch.channels_last) if channels_last else x.contiguous()


def step_seconds(size: int, n: int, channels_last: bool, steps: int) -> list[float]:
    net = build(size, channels_last)
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    x, y = batch(size, n)
    x = as_layout(x, channels_last)
    times = []
    for _ in range(steps + 1):  # the first step (allocations, kernel choice) is not counted
        t = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(net(x)["logits"], y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        loss.item()
        times.append(time.perf_counter() - t)
    return times[1:]


def gradients(size: int, n: int, channels_last: bool, dtype, rows: slice = slice(None)) -> torch.Tensor:
    net = build(size, channels_last, dtype)
    x, y = batch(size, n, dtype)
    x, y = x[rows], y[rows]
    loss = torch.nn.functional.cross_entropy(net(as_layout(x, channels_last))["logits"], y)
    loss.backward()
    return torch.cat([p.grad.flatten().double() for p in net.parameters() if p.grad is not None])


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def real_run(recipe: str, channels_last: bool, out: Path) -> float:
    cmd = [sys.executable, "-m", "deepmetric.cli", "train", recipe, *REAL_OVERRIDES,
           f"train.channels_last={str(channels_last).lower()}", f"train.out_dir={out}", "train.progress=false"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    return float(json.loads((out / "metrics.json").read_text())["wall_time_s"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--grad-batch", type=int, default=16, help="batch of the float64 gradient check")
    ap.add_argument("--real", metavar="RECIPE", help="also one epoch of this recipe with each layout")
    ap.add_argument("--real-repeats", type=int, default=1)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    medians = {False: [], True: []}
    for rep in range(args.repeats):
        for cl in ((False, True) if rep % 2 == 0 else (True, False)):
            medians[cl].append(statistics.median(step_seconds(args.size, args.batch, cl, args.steps)))
    speed = {("channels_last" if cl else "contiguous"): statistics.median(v) for cl, v in medians.items()}
    ref = gradients(args.size, args.grad_batch, False, torch.float64)
    numerics = {
        "grad_rel_diff_float64_channels_last_vs_contiguous": rel(
            gradients(args.size, args.grad_batch, True, torch.float64), ref),
        "grad_rel_err_float32_contiguous_vs_float64": rel(
            gradients(args.size, args.grad_batch, False, torch.float32), ref),
        "grad_rel_err_float32_channels_last_vs_float64": rel(
            gradients(args.size, args.grad_batch, True, torch.float32), ref),
        # the scale SGD already lives with: two halves of the same batch give gradients this far
        # apart (relative to the whole batch's), so a rounding difference far below it is noise
        "grad_rel_diff_float64_between_batch_halves": float(
            (gradients(args.size, args.grad_batch, False, torch.float64, slice(0, args.grad_batch // 2))
             - gradients(args.size, args.grad_batch, False, torch.float64, slice(args.grad_batch // 2, None))).norm()
            / ref.norm()),
    }
    result = {"model": "two_head efficientnet_lite0, 1,911 classes", "size": args.size, "batch": args.batch, "threads": args.threads,
              "steps": args.steps, "repeats": args.repeats, "step_seconds_median": speed,
              "step_seconds_per_repeat": {("channels_last" if cl else "contiguous"): v for cl, v in medians.items()},
              "speedup": speed["contiguous"] / speed["channels_last"], **numerics,
              "torch": torch.__version__, "machine": platform.machine(), "cpus": os.cpu_count(),
              "load_average": os.getloadavg(), "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}
    if args.real:
        walls = {"contiguous": [], "channels_last": []}
        with tempfile.TemporaryDirectory() as tmp:
            for rep in range(args.real_repeats):
                for cl in ((False, True) if rep % 2 == 0 else (True, False)):
                    name = "channels_last" if cl else "contiguous"
                    walls[name].append(real_run(args.real, cl, Path(tmp) / f"{name}_{rep}"))
        result["real"] = {"recipe": os.path.relpath(Path(args.real).resolve(), ROOT), "overrides": list(REAL_OVERRIDES),
                          "wall_time_s": walls,
                          "speedup": statistics.median(walls["contiguous"]) / statistics.median(walls["channels_last"])}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        tmp = args.out.with_suffix(".tmp")
        tmp.write_text(text + "\n")
        tmp.replace(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
