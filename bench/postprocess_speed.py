"""Cost of each retrieval post-processing step (deepmetric.search.postprocess) by gallery size.

    python bench/postprocess_speed.py [--sizes 5000 100000] [--dim 128] [--queries 1000]
                                      [--device cpu|cuda] [--out bench/results/postprocess_speed.md]

Synthetic clustered unit vectors (20 per class) of ``--dim`` dimensions; for each gallery size N,
in its own process (so that its peak memory is its own), the wall time of:
whitening (fit on the gallery, to dim/2, and applying it to the gallery), DBA (k 3: one k-NN
pass of the gallery against itself), alpha-QE of ``--queries`` queries (k 2), the k-reciprocal
graph of the gallery (k1 20, k2 6: one k-NN pass plus the sparse encoding) and the re-ranking of
the queries' top 100; with the peak resident memory of the process, the graph's sparse sizes and
the bytes of the input itself. The k-NN runs through deepmetric.evaluate.knn (faiss on the CPU,
torch on a GPU). Results: a Markdown table and a JSON file beside it.
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def _data(n: int, d: int, seed: int):
    import numpy as np

    rng = np.random.default_rng(seed)
    classes = max(2, n // 20)
    centres = rng.normal(size=(classes, d)).astype(np.float32)
    y = rng.integers(0, classes, n)
    x = centres[y] + 0.8 * rng.normal(size=(n, d)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def one_size(n: int, d: int, nq: int, device: str) -> dict:
    """Time every step at gallery size ``n`` (run in a fresh process)."""
    import torch

    from deepmetric.evaluate.knn import iter_knn
    from deepmetric.search.postprocess import KReciprocalGraph, aqe, apply_whitening, dba, fit_whitening, rerank

    w = _data(300, d, 2)  # warm-up: first calls load LAPACK / faiss kernels, not timed
    KReciprocalGraph.build(dba(apply_whitening(w, fit_whitening(w, d // 2)), 3), 20, 6)
    g, q = _data(n, d, 0), _data(nq, d, 1)
    if device != "cpu":
        g, q = torch.from_numpy(g).to(device), torch.from_numpy(q).to(device)
    out = {"n": n, "dim": d, "queries": nq, "device": device, "input_mb": round(n * d * 4 / 2**20, 1),
           "rss_start_mb": round(_rss_mb(), 1)}

    def timed(name, fn):
        if device != "cpu":
            torch.cuda.synchronize()
        t = time.perf_counter()
        r = fn()
        if device != "cpu":
            torch.cuda.synchronize()
        out[f"{name}_s"] = round(time.perf_counter() - t, 3)
        return r

    p = timed("whiten_fit", lambda: fit_whitening(g, d // 2))
    timed("whiten_apply", lambda: apply_whitening(g, p))
    timed("dba", lambda: dba(g, 3, 3.0))
    timed("aqe", lambda: aqe(q, g, 2, 3.0))
    rss0 = _rss_mb()
    graph = timed("kreciprocal_graph", lambda: KReciprocalGraph.build(g, 20, 6))
    parts = list(iter_knn(q, g, 100))
    import numpy as np

    sims, idx = np.concatenate([x[1] for x in parts]), np.concatenate([x[2] for x in parts])
    timed("kreciprocal_rerank", lambda: rerank(graph, q, g, sims, idx, lam=0.3, candidates=100))
    out["graph_nnz_v_per_row"] = round(graph.v.nnz / n, 1)
    out["graph_nnz_vqe_per_row"] = round(graph.vqe.nnz / n, 1)
    out["graph_mb"] = round((graph.v.data.nbytes + graph.v.indices.nbytes + graph.vqe.data.nbytes
                             + graph.vqe.indices.nbytes + graph.nbr.nbytes + graph.sim.nbytes
                             + graph.half_sets.nbytes) / 2**20, 1)
    out["rss_before_graph_mb"] = round(rss0, 1)
    out["rss_peak_mb"] = round(_rss_mb(), 1)
    return out


def table(rows: list[dict]) -> str:
    cols = [("n", "gallery"), ("whiten_fit_s", "whiten fit s"), ("whiten_apply_s", "whiten apply s"),
            ("dba_s", "DBA s"), ("aqe_s", "alpha-QE s (queries)"), ("kreciprocal_graph_s", "k-recip. graph s"),
            ("kreciprocal_rerank_s", "k-recip. re-rank s (queries)"), ("graph_mb", "graph MiB"),
            ("graph_nnz_vqe_per_row", "V* nnz/row"), ("rss_peak_mb", "peak RSS MiB"), ("input_mb", "input MiB")]
    lines = ["| " + " | ".join(c[1] for c in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(f"{r[c[0]]:,}" if c[0] == "n" else str(r.get(c[0], "-")) for c in cols) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[5000, 100000])
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--queries", type=int, default=1000)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "postprocess_speed.md"))
    ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # a child: one size
    args = ap.parse_args(argv)
    if args.one is not None:
        print(json.dumps(one_size(args.one, args.dim, args.queries, args.device)))
        return 0
    rows = []
    for n in args.sizes:
        r = subprocess.run([sys.executable, __file__, "--one", str(n), "--dim", str(args.dim), "--queries",
                            str(args.queries), "--device", args.device], capture_output=True, text=True)
        if r.returncode:
            print(r.stderr, file=sys.stderr)
            return r.returncode
        rows.append(json.loads(r.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    import torch

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    head = (f"# Post-processing cost by gallery size\n\n`python bench/postprocess_speed.py --sizes "
            f"{' '.join(map(str, args.sizes))} --dim {args.dim} --queries {args.queries} --device {args.device}` "
            f"({args.device}, {torch.get_num_threads()} torch threads; synthetic {args.dim}-d unit vectors, "
            f"20 per class; {args.queries} queries; whitening to {args.dim // 2}-d; DBA k 3; alpha-QE k 2; "
            "k-reciprocal k1 20, k2 6, top 100 re-ranked). Times in seconds, one run each.\n\n")
    out.write_text(head + table(rows) + "\n")
    out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    print(table(rows))
    print(f"wrote {out} and {out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
