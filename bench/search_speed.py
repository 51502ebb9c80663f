"""Speed / memory of deepmetric.search: building, saving, loading and querying an index.

Default: a 1,000,000 x 128 exact index of random l2-normalised vectors (speed does not depend
on the values for exact search), 1,000 queries, k=10. Each phase runs in its own child
process, so each peak is that phase's own (``ru_maxrss`` of the child = peak resident set of
the whole process, from Python start to exit):

  build   Index.from_embeddings(1M x 128) + save (embeddings.npy, labels, paths, index.faiss)
  query   Index.load(mmap) + 1,000 queries (embeddings) k=10, exact; checked against numpy
  embed   images/s of embedding image files with a small checkpoint (``Index.build``), optional

  python bench/search_speed.py [--n 1000000] [--dim 128] [--queries 1000] [--k 10]
  python bench/search_speed.py --approximate ivf --n 200000   # approximate build + recall

Peak memory is compared with the evaluator's 16 GiB bound (bench/RESULTS.md section 1.3).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np


def _rss_gib() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**30


def _peak_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # kB on Linux


def _data(n: int, d: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d), dtype=np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x


def phase_build(a) -> dict:
    from deepmetric.search import Index

    x = _data(a.n, a.dim, 0)
    labels = np.arange(a.n) % 1000
    base = _rss_gib()
    t = time.perf_counter()
    index = Index.from_embeddings(x, labels, approximate=a.approximate)
    t_build = time.perf_counter() - t
    t = time.perf_counter()
    index.save(a.dir)
    t_save = time.perf_counter() - t
    size = sum(os.path.getsize(os.path.join(a.dir, f)) for f in os.listdir(a.dir))
    out = {"build_s": t_build, "save_s": t_save, "data_gib": x.nbytes / 2**30, "rss_before_gib": base,
           "peak_gib": _peak_gib(), "files_gib": size / 2**30}
    if a.approximate:
        out["recall@10_vs_exact"] = index.meta["approximate"]["recall@10_vs_exact"]
    return out


def phase_query(a) -> dict:
    from deepmetric.search import Index

    t = time.perf_counter()
    index = Index.load(a.dir, mmap=True)
    t_load = time.perf_counter() - t
    q = _data(a.queries, a.dim, 1)
    index.search(q[:10], a.k)  # warm-up: maps the embeddings into memory
    base = _rss_gib()
    t = time.perf_counter()
    sims, idx = index.search(q, a.k)
    t_query = time.perf_counter() - t
    # numpy check on the first 20 queries
    g = np.asarray(index.embeddings)
    ref = np.argsort(-(q[:20] @ g.T), axis=1)[:, :a.k]
    agree = float(np.mean([len(set(r) & set(i)) / a.k for r, i in zip(ref, idx[:20])]))
    return {"load_s": t_load, "query_s": t_query, "queries_per_s": a.queries / t_query,
            "rss_before_gib": base, "peak_gib": _peak_gib(), "agree_with_numpy_top_k": agree}


def phase_embed(a) -> dict:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    import torch
    from search_data import make_shapes_folder, train_tiny_checkpoint

    from deepmetric.search import Index

    torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory() as tmp:
        small = make_shapes_folder(os.path.join(tmp, "small"), per_class=8)
        ckpt = train_tiny_checkpoint(small, os.path.join(tmp, "run"))  # a few seconds, not timed
        folder = make_shapes_folder(os.path.join(tmp, "g"), per_class=a.embed_images // 4, seed=1)
        t = time.perf_counter()
        index = Index.build(ckpt, data="folder", root=folder, out=os.path.join(tmp, "ix"), progress=False,
                            device="cpu")
        t_build = time.perf_counter() - t
        files = [index.paths[i] for i in range(0, len(index), max(1, len(index) // 200))]
        index.model()  # load and hash-check the checkpoint before timing the queries
        t = time.perf_counter()
        index.search(files, 10)
        t_q = time.perf_counter() - t
    return {"images": len(index), "build_s": t_build, "images_per_s": len(index) / t_build,
            "image_queries": len(files), "image_queries_per_s": len(files) / t_q, "peak_gib": _peak_gib()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--queries", type=int, default=1000)
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--approximate", default=None, choices=["ivf", "hnsw"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--embed-images", type=int, default=2000, help="images for the embed phase (0: skip)")
    p.add_argument("--phases", default="build,query,embed", help="comma-separated subset of build,query,embed")
    p.add_argument("--phase", default=None, help=argparse.SUPPRESS)
    p.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.phase:
        import faiss

        faiss.omp_set_num_threads(a.threads)
        print(json.dumps({"build": phase_build, "query": phase_query, "embed": phase_embed}[a.phase](a)))
        return
    print(f"n={a.n} dim={a.dim} queries={a.queries} k={a.k} approximate={a.approximate} threads={a.threads} "
          f"cpus={os.cpu_count()} load average at start={os.getloadavg()}")
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads)}
    with tempfile.TemporaryDirectory() as tmp:
        phases = [ph for ph in a.phases.split(",") if ph != "embed" or a.embed_images]
        for ph in phases:
            cmd = [sys.executable, __file__, "--phase", ph, "--dir", tmp, "--n", str(a.n), "--dim", str(a.dim),
                   "--queries", str(a.queries), "--k", str(a.k), "--threads", str(a.threads),
                   "--embed-images", str(a.embed_images)] + (["--approximate", a.approximate] if a.approximate else [])
            r = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if r.returncode:
                sys.exit(f"phase {ph} failed:\n{r.stderr[-3000:]}")
            res = json.loads(r.stdout.strip().splitlines()[-1])
            print(f"{ph}: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in res.items()))
    print(f"load average at end={os.getloadavg()}")


if __name__ == "__main__":
    main()
