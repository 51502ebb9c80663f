"""CPU training speed (images/s) of a backbone + 128-d BN embedding head, by input size and
``freeze_stages``.

One training step = forward + backward + SGD step (momentum 0.9) on a random batch with a
cross-entropy loss on a 100-class linear classifier over the embedding (the loss costs nothing
next to the backbone).  After ``--warmup`` steps, ``--steps`` steps are timed one by one and the
median step time gives images/s; forward-only (``torch.no_grad``, eval mode) embedding speed is
measured the same way.  ``train img/cpu-s`` divides by the process CPU time instead of wall
time (all threads together): on a shared machine it is less sensitive to other jobs than the
wall-clock figure (with 2 threads and no contention, wall img/s is at most 2x it).
``train GFLOP/img`` estimates one training step's work per image from exact forward counts
(:func:`training_gflops_estimate`) -- independent of the load, it shows what freezing saves
(depthwise convolutions do little arithmetic per byte, so time falls less than FLOPs).
``--steps 0`` prints only the FLOP estimates.  Weights are the installed ImageNet weights (``pretrained="imagenet"``)
where the backbone has them.

    .venv/bin/python bench/backbone_speed.py                          # lite0, 64/96/128 px, freeze 0/3/5/7
    .venv/bin/python bench/backbone_speed.py --sizes 64 --freeze 0 --threads 1 --steps 10
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

from deepmetric.models import create_model, get_backbone_spec


def _median_step_time(step, warmup: int, steps: int) -> tuple[float, float]:
    """(median wall seconds, median process CPU seconds) per step."""
    for _ in range(warmup):
        step()
    wall, cpu = [], []
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return statistics.median(wall), statistics.median(cpu)


def _forward_gflops(fn, x: torch.Tensor) -> float:
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        fn(x)
    return counter.get_total_flops() / x.shape[0] / 1e9


def training_gflops_estimate(model, x: torch.Tensor, freeze: int) -> float:
    """Forward GFLOPs per image of the whole model + 2 x those of its trainable part (backward
    = gradient w.r.t. input + w.r.t. weights, each about one forward).  Forward FLOPs come from
    ``torch.utils.flop_counter``; its backward count is not used because it ignores ``groups``
    for the input gradient of depthwise convolutions (128x too high for a 256-channel one)."""
    model.eval()
    total = _forward_gflops(model, x)
    frozen = 0.0
    if freeze:
        stages = model.backbone.stages()[:freeze]

        def run_frozen(t):
            for stage in stages:
                for module in (stage if isinstance(stage, torch.nn.ModuleList) else [stage]):
                    t = module(t)
            return t

        frozen = _forward_gflops(run_frozen, x)
    return total + 2 * (total - frozen)


def measure(name: str, size: int, freeze: int, batch: int, warmup: int, steps: int,
            channels_last: bool) -> tuple[float, float, float, float, int, int]:
    """(train img/s, train img per CPU-second, forward-only img/s, training GFLOPs per image,
    trainable params, all params).  ``steps=0``: only the FLOP count (times are NaN)."""
    torch.manual_seed(0)
    pretrained = "imagenet" if get_backbone_spec(name).imagenet is not None else None
    options = {"freeze_stages": freeze} if freeze else {}
    model = create_model(name, embedding_dim=128, norm="bn", num_classes=100, pretrained=pretrained, **options)
    x = torch.randn(batch, 3, size, size)
    y = torch.randint(0, 100, (batch,))
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.01, momentum=0.9)

    def train_step():
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x)["logits"], y)
        loss.backward()
        opt.step()

    def embed_step():
        with torch.no_grad():
            model(x)

    gflops = training_gflops_estimate(model, x[:2], freeze)
    model.train()
    if steps == 0:
        return float("nan"), float("nan"), float("nan"), gflops, sum(p.numel() for p in params), \
            sum(p.numel() for p in model.parameters())
    t_train, c_train = _median_step_time(train_step, warmup, steps)
    model.eval()
    t_embed, _ = _median_step_time(embed_step, 1, max(2, steps // 2))
    return (batch / t_train, batch / c_train, batch / t_embed, gflops, sum(p.numel() for p in params),
            sum(p.numel() for p in model.parameters()))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backbone", default="efficientnet_lite0", help="backbone name (default efficientnet_lite0)")
    ap.add_argument("--sizes", type=int, nargs="+", default=[64, 96, 128], help="square input sizes in pixels")
    ap.add_argument("--freeze", type=int, nargs="+", default=[0, 3, 5, 7],
                    help="freeze_stages values (0 = train everything)")
    ap.add_argument("--batch", type=int, default=64, help="batch size (default 64)")
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    ap.add_argument("--steps", type=int, default=5,
                    help="timed steps; the median is used (default 5; 0 = FLOP counts only)")
    ap.add_argument("--channels-last", action="store_true", help="channels_last memory format")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    print(f"backbone={args.backbone} batch={args.batch} threads={args.threads} cpus={os.cpu_count()} "
          f"channels_last={args.channels_last} torch={torch.__version__} load average={os.getloadavg()}")
    print(f"{'size':>5} {'freeze':>6} {'train img/s':>12} {'train img/cpu-s':>16} {'embed img/s':>12} "
          f"{'train GFLOP/img':>16} {'trainable':>10} {'params':>10}")
    for size in args.sizes:
        for freeze in args.freeze:
            tr, tc, ev, gf, n_train, n_all = measure(args.backbone, size, freeze, args.batch, args.warmup,
                                                     args.steps, args.channels_last)
            print(f"{size:>5} {freeze:>6} {tr:>12.1f} {tc:>16.1f} {ev:>12.1f} {gf:>16.3f} {n_train:>10,} "
                  f"{n_all:>10,}", flush=True)
    print(f"load average at end={os.getloadavg()}")


if __name__ == "__main__":
    main()
