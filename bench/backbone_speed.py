"""CPU training speed (images/s) of a backbone + 128-d BN embedding head, by input size and
``freeze_stages``.

One training step = forward + backward + SGD step (momentum 0.9) on a random batch with a
cross-entropy loss on a 100-class linear classifier over the embedding (the loss costs nothing
next to the backbone).  After ``--warmup`` steps, ``--steps`` steps are timed one by one and the
median step time gives images/s; forward-only (``torch.no_grad``, eval mode) embedding speed is
measured the same way.  Weights are the installed ImageNet weights (``pretrained="imagenet"``)
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

from deepmetric.models import create_model, get_backbone_spec


def _median_step_time(step, warmup: int, steps: int) -> float:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(name: str, size: int, freeze: int, batch: int, warmup: int, steps: int,
            channels_last: bool) -> tuple[float, float, int, int]:
    """(train img/s, forward-only img/s, trainable params, all params)."""
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

    model.train()
    t_train = _median_step_time(train_step, warmup, steps)
    model.eval()
    t_embed = _median_step_time(embed_step, 1, max(2, steps // 2))
    return batch / t_train, batch / t_embed, sum(p.numel() for p in params), sum(p.numel() for p in model.parameters())


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backbone", default="efficientnet_lite0", help="backbone name (default efficientnet_lite0)")
    ap.add_argument("--sizes", type=int, nargs="+", default=[64, 96, 128], help="square input sizes in pixels")
    ap.add_argument("--freeze", type=int, nargs="+", default=[0, 3, 5, 7],
                    help="freeze_stages values (0 = train everything)")
    ap.add_argument("--batch", type=int, default=64, help="batch size (default 64)")
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps; the median is used (default 5)")
    ap.add_argument("--channels-last", action="store_true", help="channels_last memory format")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    print(f"backbone={args.backbone} batch={args.batch} threads={args.threads} cpus={os.cpu_count()} "
          f"channels_last={args.channels_last} torch={torch.__version__} load average={os.getloadavg()}")
    print(f"{'size':>5} {'freeze':>6} {'train img/s':>12} {'embed img/s':>12} {'trainable':>10} {'params':>10}")
    for size in args.sizes:
        for freeze in args.freeze:
            tr, ev, n_train, n_all = measure(args.backbone, size, freeze, args.batch, args.warmup,
                                             args.steps, args.channels_last)
            print(f"{size:>5} {freeze:>6} {tr:>12.1f} {ev:>12.1f} {n_train:>10,} {n_all:>10,}", flush=True)
    print(f"load average at end={os.getloadavg()}")


if __name__ == "__main__":
    main()
