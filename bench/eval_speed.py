"""Speed / memory benchmark of deepmetric.evaluate vs pytorch-metric-learning's AccuracyCalculator.

Default (SOP-sized): 60,502 x 128 synthetic clustered embeddings, 11,316 classes of 2-12 samples.
In ONE process on the same arrays, alternating (repeats), it times
  (a) deepmetric.evaluate: Recall@{1,10,100,1000}, MAP@R, R-Precision, NMI
  (b) PML 2.9 AccuracyCalculator: precision_at_1, mean_average_precision_at_r, r_precision, NMI
and prints wall times, their ratio, peak memory of each and whether shared metrics agree.

Peak memory: a thread samples the process RSS (psutil) every 5 ms during each call; the figure
is (peak RSS during the call) - (RSS just before it), i.e. the extra memory the call needed.
It sees faiss/BLAS allocations that tracemalloc would miss, but can miss spikes < 5 ms.

--large: 1,000,000 x 128, 10,000 classes, Recall@1 + MAP@R of deepmetric only. Exact search
over 1M x 1M is ~2.6e14 flops; with --large-queries Q only Q random queries are ranked against
the full 1M gallery (same memory profile, time scales linearly and is extrapolated).

  python bench/eval_speed.py [--repeats 2] [--threads 2] [--retrieval-only]
  python bench/eval_speed.py --large [--large-queries 20000] [--backend faiss]
  python bench/eval_speed.py --large --large-queries 0     # all 1M queries, exact (tqdm progress)
"""
from __future__ import annotations

import argparse
import os
import threading
import time

import numpy as np


def sop_like(rng, n=60_502, n_classes=11_316, lo=2, hi=12, d=128, noise=1.4):
    """Class sizes in [lo, hi] summing to n; samples = class centre + Gaussian noise."""
    sizes = rng.integers(lo, hi + 1, n_classes)
    while sizes.sum() != n:  # nudge random classes by one (small batches keep the 2-12 spread)
        diff = int(sizes.sum() - n)
        cand = np.flatnonzero(sizes > lo if diff > 0 else sizes < hi)
        pick = rng.choice(cand, min(len(cand), abs(diff), 500), replace=False)
        sizes[pick] -= np.sign(diff)
    y = np.repeat(np.arange(n_classes), sizes)
    y = y[rng.permutation(n)]
    x = rng.standard_normal((n_classes, d), dtype=np.float32)[y]
    x += noise * rng.standard_normal((n, d), dtype=np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x, y


class PeakRSS:
    """Context manager: extra peak RSS (bytes) over the RSS at entry, sampled every 5 ms."""

    def __init__(self):
        import psutil

        self.proc = psutil.Process()

    def __enter__(self):
        self.base = self.peak = self.proc.memory_info().rss
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.005)

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)
        self.extra = self.peak - self.base


def run_ours(x, y, backend, nmi=True):
    from deepmetric.evaluate import evaluate

    metrics = ["recall", "map@r", "r_precision"] + (["nmi"] if nmi else [])
    return evaluate(x, y, ks=(1, 10, 100, 1000), metrics=metrics, backend=backend, seed=0)


def run_pml(x, y, nmi=True):
    import torch
    from pytorch_metric_learning.utils.accuracy_calculator import AccuracyCalculator

    include = ("precision_at_1", "mean_average_precision_at_r", "r_precision") + (("NMI",) if nmi else ())
    calc = AccuracyCalculator(include=include, k="max_bin_count",
                              device=torch.device("cpu"))
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    # PML 2.9: reference=None means the queries are their own references (self excluded)
    return calc.get_accuracy(xt, yt)


def sop_bench(args):
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    x, y = sop_like(rng)
    print(f"data: {x.shape[0]} x {x.shape[1]} float32, {len(np.unique(y))} classes, sizes "
          f"{np.bincount(y).min()}-{np.bincount(y).max()} (built in {time.perf_counter() - t0:.1f} s)")
    times = {"deepmetric": [], "pml": []}
    mems = {"deepmetric": [], "pml": []}
    res = {}
    for rep in range(args.repeats):
        for name in (("deepmetric", "pml") if rep % 2 == 0 else ("pml", "deepmetric")):
            nmi = not args.retrieval_only
            fn = (lambda nmi=nmi: run_ours(x, y, args.backend, nmi)) if name == "deepmetric" else (lambda nmi=nmi: run_pml(x, y, nmi))
            with PeakRSS() as m:
                t = time.perf_counter()
                res[name] = fn()
                times[name].append(time.perf_counter() - t)
            mems[name].append(m.extra)
            print(f"  run {rep + 1} {name:<10} {times[name][-1]:7.1f} s  peak +{m.extra / 2**20:7.0f} MiB")
    ours, pml = res["deepmetric"], res["pml"]
    t_o, t_p = min(times["deepmetric"]), min(times["pml"])
    m_o, m_p = max(mems["deepmetric"]), max(mems["pml"])
    print(f"\nwall time (best of {args.repeats}): deepmetric {t_o:.1f} s   PML {t_p:.1f} s   "
          f"speed-up PML/deepmetric = {t_p / t_o:.2f}x")
    print(f"peak extra RSS (max over runs): deepmetric {m_o / 2**20:.0f} MiB   PML {m_p / 2**20:.0f} MiB")
    print("\nmetric                deepmetric     PML")
    pairs = [("recall@1", "precision_at_1"), ("map@r", "mean_average_precision_at_r"),
             ("r_precision", "r_precision")] + ([] if args.retrieval_only else [("nmi", "NMI")])
    for a, b in pairs:
        print(f"{a:<20} {ours[a]:10.5f} {pml[b]:10.5f}   diff {abs(ours[a] - pml[b]):.2e}")
    for k in ("recall@10", "recall@100", "recall@1000"):
        print(f"{k:<20} {ours[k]:10.5f}")
    exact_ok = all(abs(ours[a] - pml[b]) < 1e-4 for a, b in pairs[:3])
    nmi_ok = args.retrieval_only or abs(ours["nmi"] - pml["NMI"]) < 0.01
    print(f"\nretrieval metrics agree (|diff| < 1e-4): {exact_ok}; "
          f"NMI agrees within 0.01 (different k-means seeds): {nmi_ok}")
    if not args.retrieval_only:
        kmeans_detail(x, y, args.repeats)


def kmeans_detail(x, y, repeats):
    """k-means alone: ours (early stop + bounds) vs faiss.Kmeans(niter=20) as PML runs it."""
    import faiss
    from sklearn.metrics import normalized_mutual_info_score

    from deepmetric.evaluate import kmeans

    k = len(np.unique(y))
    print(f"\nk-means alone, K = {k}, niter = 20 (seeds 0..{max(repeats, 3) - 1} for ours)")
    for seed in range(max(repeats, 3)):
        t = time.perf_counter()
        a, info = kmeans(x, k, seed=seed, niter=20, return_info=True)
        dt = time.perf_counter() - t
        full = sum(info["searched"]) / len(x)
        print(f"  deepmetric seed {seed}: {dt:5.1f} s  fixed point after {info['iterations']} updates "
              f"(converged={info['converged']}), {len(info['searched'])} assignments = "
              f"{full:.2f} full searches, searched per assignment {info['searched']}, "
              f"NMI {normalized_mutual_info_score(y, a):.5f}")
    t = time.perf_counter()
    km = faiss.Kmeans(x.shape[1], k, niter=20, seed=1234)  # PML 2.9's FaissKMeans(niter=20)
    km.train(x)
    a = km.index.search(x, 1)[1][:, 0]
    print(f"  faiss.Kmeans (as PML): {time.perf_counter() - t:5.1f} s  21 full searches, "
          f"NMI {normalized_mutual_info_score(y, a):.5f}")


def large_bench(args):
    from deepmetric.evaluate import evaluate

    rng = np.random.default_rng(0)
    n, c, d = 1_000_000, 10_000, 128
    t0 = time.perf_counter()
    with PeakRSS():
        x, y = sop_like(rng, n=n, n_classes=c, lo=100, hi=100, d=d)
    print(f"data: {n} x {d} float32 ({x.nbytes / 2**30:.2f} GiB), {c} classes of 100 "
          f"(built in {time.perf_counter() - t0:.1f} s)")
    is_query = None
    nq = n
    if args.large_queries and args.large_queries < n:
        nq = args.large_queries
        is_query = np.zeros(n, bool)
        is_query[rng.choice(n, nq, replace=False)] = True
    import psutil

    with PeakRSS() as m:
        t = time.perf_counter()
        res = evaluate(x, y, is_query=is_query, ks=(1,), metrics=["recall", "map@r"],
                       backend=args.backend, progress=True)
        dt = time.perf_counter() - t
    rss = psutil.Process().memory_info().rss
    print(f"queries {nq} vs gallery {n} ({args.backend}): {dt:.1f} s = {dt / 60:.1f} min"
          + (f"; extrapolated to all {n} queries: {dt * n / nq / 60:.1f} min" if nq < n else ""))
    print(f"peak process RSS during evaluate: {m.peak / 2**30:.2f} GiB "
          f"(extra over data: {m.extra / 2**30:.2f} GiB); RSS after: {rss / 2**30:.2f} GiB; limit 16 GiB")
    print("metrics:", {k: round(v, 5) for k, v in res.items()})


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2, help="torch / faiss / BLAS threads")
    p.add_argument("--backend", default="auto")
    p.add_argument("--retrieval-only", action="store_true",
                   help="leave NMI (k-means, the same faiss algorithm on both sides) out of both")
    p.add_argument("--large", action="store_true")
    p.add_argument("--large-queries", type=int, default=20_000)
    args = p.parse_args()
    import faiss
    import torch

    torch.set_num_threads(args.threads)
    faiss.omp_set_num_threads(args.threads)
    print(f"threads={args.threads} cpus={os.cpu_count()} backend={args.backend} "
          f"load average at start={os.getloadavg()}")
    (large_bench if args.large else sop_bench)(args)


if __name__ == "__main__":
    main()
