"""What the raw-pixel baseline costs on the emoji test split: wall time and peak memory of
``deepmetric.run.baselines.raw_pixel_baseline`` (reading the pixels, then
``deepmetric.evaluate``: the memory-bounded k-NN, k-means for NMI / F1) at a given image size,
with the metrics of the emoji study, next to the estimate its limits (``RAW_PIXEL_MAX_*``)
are decided on.

One size per process, so that the peak memory is this size's:

    PYTHONPATH=src .venv/bin/python bench/raw_pixel_cost.py --size 64 [--threads 1] [--no-limits]

Peak memory: a thread samples the process RSS (/proc/self/statm) every 5 ms; reported as the
peak above the RSS before the baseline starts (the dataset's uint8 arrays already loaded).
"""
from __future__ import annotations

import argparse
import os
import resource
import threading
import time

import numpy as np
import torch

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class PeakRSS:
    """Context manager: peak RSS (bytes) above the RSS at entry, sampled every 5 ms."""

    def __enter__(self):
        self.base = self.peak = rss()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, rss())
            time.sleep(0.005)

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, rss())
        self.extra = self.peak - self.base


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--metrics", nargs="+", default=["recall", "map@r", "nmi", "f1"])
    ap.add_argument("--no-limits", action="store_true",
                    help="every metric whatever the estimate (the full cost); default: the run's limits")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from deepmetric.run import baselines as P
    from deepmetric.run.builders import build_split
    from deepmetric.run.config_io import config_from_dict

    cfg = config_from_dict({
        "data": {"name": "emoji", "options": {"protocol": "zero_shot", "size": args.size},
                 "transform": "emoji", "transform_options": {"normalize": "minus_one_one"}},
        "model": {"name": "synthetic_mlp"}, "train": {"epochs": 1},
        "eval": {"split": "test", "ks": [1, 2, 4, 8], "metrics": args.metrics}})
    t0 = time.perf_counter()
    ds = build_split(cfg, "test", train=False)
    t_load = time.perf_counter() - t0
    labels = np.asarray(ds.labels, dtype=np.int64)
    n, c, d = len(ds), len(np.unique(labels)), int(torch.as_tensor(ds[0][0]).numel())
    print(f"emoji test split at {args.size} px: {n} images, {c} classes, {d} values each "
          f"(built in {t_load:.1f} s); threads={args.threads} cpus={os.cpu_count()} "
          f"load average={tuple(round(v, 2) for v in os.getloadavg())}", flush=True)
    rate = P.RAW_PIXEL_MACS_PER_SECOND
    search, kmeans = float(n) * n * d, float(n) * c * d * 20
    print(f"  estimate     search {search / rate:.0f} s + k-means {kmeans / rate:.0f} s at {rate:.0e} "
          f"multiply-adds/s (limit {P.RAW_PIXEL_MAX_SECONDS:.0f} s); peak search "
          f"{P.RAW_PIXEL_SEARCH_COPIES * 4 * n * d / 2**20:.0f} MiB, k-means "
          f"{P.RAW_PIXEL_KMEANS_COPIES * 4 * n * d / 2**20:.0f} MiB (limit {P.RAW_PIXEL_MAX_BYTES / 2**30:.0f} GiB)",
          flush=True)
    limits = {"max_work": float("inf"), "max_bytes": float("inf")} if args.no_limits else {}
    with PeakRSS() as mem:
        t0 = time.perf_counter()
        m, label = P.raw_pixel_baseline({"query": ds}, cfg, **limits)
        seconds = time.perf_counter() - t0
    shown = ", ".join(f"{k}={v:.4f}" for k, v in (m or {}).items())
    print(f"  baseline     {label}: {seconds:.1f} s, peak +{mem.extra / 2**20:.0f} MiB "
          f"({mem.extra / (4 * n * d):.1f} x the float32 rows); {shown}")
    print(f"  process peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10:.0f} MiB; "
          f"CPU {time.process_time():.0f} s")


if __name__ == "__main__":
    main()
