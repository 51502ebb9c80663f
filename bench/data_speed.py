"""Images per second of the two data pipelines through make_loader.

* glyphs: the full glyph benchmark (train split, from the cache; built first if missing) with
  the "glyph" training augmentation, class-balanced batches (m x n = 32 x 4).
* JPEG folder: a temporary ImageFolder-style tree of photo-sized JPEGs (500x375, smooth random
  content so the files have realistic sizes) read by build_dataset("folder") with the
  "resize_crop" training transform (256x256 resize, random 224 crop, flip), random batches of 32.

Each (pipeline, num_workers) configuration is timed ``--repeats`` times, interleaved, after one
warm-up batch (worker start-up excluded); the median is reported. The machine may be shared:
compare numbers from the same run only.

    python bench/data_speed.py [--batches 40] [--workers 0 1 2] [--repeats 3] [--max-classes N]
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from deepmetric.data import (ClassBalancedBatchSampler, RandomBatchSampler, build_dataset, build_glyph_dataset,
                             build_transform, make_loader)


def make_jpeg_tree(root: Path, classes: int, per_class: int, seed: int = 0) -> int:
    rng = np.random.default_rng(seed)
    n = 0
    for c in range(classes):
        d = root / f"class_{c:03d}"
        d.mkdir(parents=True)
        for i in range(per_class):
            small = rng.integers(0, 256, (12, 16, 3), dtype=np.uint8)  # upsampled: smooth, photo-like
            img = Image.fromarray(small).resize((500, 375), Image.Resampling.BICUBIC)
            img.save(d / f"{i:04d}.jpg", quality=90)
            n += 1
    return n


def time_loader(loader, batches: int) -> float:
    it = iter(loader)
    next(it)  # warm-up: worker start-up, first prefetch
    t0 = time.perf_counter()
    images = 0
    for _ in range(batches):
        x, _ = next(it)
        images += x.shape[0]
    return images / (time.perf_counter() - t0)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, default=40)
    ap.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-classes", type=int, default=None, help="glyph subset (default: full benchmark)")
    args = ap.parse_args()
    torch.set_num_threads(1)

    t0 = time.perf_counter()
    glyphs = build_glyph_dataset("train", transform=build_transform("glyph", True), max_classes=args.max_classes)
    load_s = time.perf_counter() - t0
    print(f"glyph train split: {len(glyphs)} images, {glyphs.num_classes} classes, {len(glyphs.faces)} faces; "
          f"{'loaded from cache' if glyphs.from_cache else 'built'} in {load_s:.1f} s "
          f"(original rendering took {glyphs.build_seconds:.1f} s)")

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        n_jpeg = make_jpeg_tree(Path(tmp), classes=20, per_class=30)
        print(f"JPEG folder: {n_jpeg} images 500x375 written in {time.perf_counter() - t0:.1f} s")
        folder = build_dataset("folder", root=tmp, split="all", transform=build_transform("resize_crop", True))

        def glyph_loader(w):
            s = ClassBalancedBatchSampler(glyphs.labels, 32, 4, seed=0)
            return make_loader(glyphs, batch_sampler=s, num_workers=w, seed=0)

        def jpeg_loader(w):
            # batches cycle over the small folder: enough batches for the timing
            s = RandomBatchSampler(len(folder), 32, seed=0)
            return _Cycle(make_loader(folder, batch_sampler=s, num_workers=w, seed=0), s)

        results = {}
        for _ in range(args.repeats):
            for name, make in (("glyphs (32x32, glyph aug, 32x4)", glyph_loader),
                               ("JPEG folder (500x375 -> 224, resize_crop, 32)", jpeg_loader)):
                for w in args.workers:
                    loader = make(w)
                    results.setdefault((name, w), []).append(time_loader(loader, args.batches))
                    del loader

    print(f"\nmachine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores visible, "
          f"torch {torch.__version__}, {args.batches} batches x {args.repeats} repeats (median)")
    print("| pipeline | num_workers | images/s (median) | runs |")
    print("|---|---|---|---|")
    for (name, w), v in results.items():
        print(f"| {name} | {w} | {statistics.median(v):,.0f} | {', '.join(f'{x:,.0f}' for x in v)} |")


class _Cycle:
    """Iterate a loader over and over (new epoch each time) for a fixed number of batches."""

    def __init__(self, loader, sampler):
        self.loader, self.sampler = loader, sampler

    def __iter__(self):
        epoch = 0
        while True:
            self.sampler.set_epoch(epoch)
            yield from self.loader
            epoch += 1


if __name__ == "__main__":
    main()
