"""Scale of the compressed index (``deepmetric index --embeddings FILE --approximate ivfpq``)
against raw faiss with the same factory string, in one run on one machine.

Data (synthetic, clustered, stated so it can be regenerated): ``--clusters`` centres drawn
N(0, I_d); each vector is its centre plus a point of a 16-dimensional subspace (one of 32
shared random bases, scale 0.6) plus isotropic noise (scale 0.05 per coordinate), l2-normalised. Written in
chunks of 262,144 rows to ``WORK/vectors.npy`` (float32, memory-mapped: never all in memory).
1,000 queries are fresh draws of the same process (not indexed); their exact top-10 comes from
a chunked scan of the file (:func:`deepmetric.search.compressed.exact_top_k_chunked`).

Each phase runs in its own child process and reports its own peak RSS (``ru_maxrss``):

  ours-build   ``deepmetric index --embeddings WORK/vectors.npy --approximate ivfpq`` (the CLI)
  raw-build    faiss ``index_factory`` with the factory string ours recorded, trained on as many
               rows, filled in the same chunks, wrapped in ``IndexRefine`` with a float16
               ``IndexScalarQuantizer`` (faiss's own re-ranking, vectors in memory), same
               nprobe and k_factor as ours
  speed        at 1 and 2 threads: ours and raw in one process, 3 alternating rounds of 1,000
               queries (batches of 100), k=10, best round each; recall@10 against the exact top-10
  memory       RSS after loading (ours: ``Index.load(verify_hashes=True)``, as ``deepmetric serve``
               does) and answering the 1,000 queries; one process per system
  serve        ``deepmetric serve`` itself on ours (127.0.0.1, a 1-epoch 256-d digit model to embed the
               uploads), ``--queries`` image uploads one after another; the server's VmRSS and VmHWM

  OMP_WAIT_POLICY=PASSIVE nice -n 10 python bench/index_scale.py --n 10000000 --work /tmp/scale10m

A projection table (memory from :func:`deepmetric.search.compressed.resident_bytes`, disk
from N * (d * 2 + M + 8 + metadata), time linear in N from the measured build) ends the
report, for 100 M and 1 B vectors and clusters of N machines.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

CHUNK = 262144


def _peak_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20


def _generator(d: int, clusters: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((clusters, d)).astype(np.float32)
    bases = (rng.standard_normal((32, 16, d)) / np.sqrt(16)).astype(np.float32)

    def draw(n: int, chunk_seed: int) -> np.ndarray:
        r = np.random.default_rng([seed, chunk_seed])
        c = r.integers(0, clusters, n)
        z = r.standard_normal((n, 16), dtype=np.float32)
        x = centres[c] + 0.05 * r.standard_normal((n, d), dtype=np.float32)
        for b in range(32):  # each cluster's subspace: one of the shared bases
            rows = np.flatnonzero(c % 32 == b)
            x[rows] += 0.6 * (z[rows] @ bases[b])
        return x / np.linalg.norm(x, axis=1, keepdims=True)

    return draw


def phase_data(a) -> dict:
    t = time.perf_counter()
    draw = _generator(a.d, a.clusters)
    out = np.lib.format.open_memmap(Path(a.work) / "vectors.npy", mode="w+", dtype=np.float32, shape=(a.n, a.d))
    for i, s in enumerate(range(0, a.n, CHUNK)):
        out[s:s + CHUNK] = draw(min(CHUNK, a.n - s), i)
    out.flush()
    del out
    q = draw(a.queries, 10 ** 6)
    np.save(Path(a.work) / "queries.npy", q)
    from deepmetric.search.compressed import exact_top_k_chunked

    t_gt = time.perf_counter()
    sims, idx = exact_top_k_chunked(np.load(Path(a.work) / "vectors.npy", mmap_mode="r"), q, 10)
    np.save(Path(a.work) / "exact.npy", idx)
    return {"write_s": round(t_gt - t, 1), "exact_scan_s": round(time.perf_counter() - t_gt, 1),
            "peak_rss_gib": round(_peak_gib(), 3)}


def phase_ours_build(a) -> dict:
    from deepmetric.cli import main

    argv = ["index", "--embeddings", str(Path(a.work) / "vectors.npy"), "--out", str(Path(a.work) / "ours"),
            "--approximate", "ivfpq", "--overwrite"] + (["--memory-budget", str(a.memory_budget)]
                                                        if a.memory_budget else [])
    t = time.perf_counter()
    if main(argv) != 0:
        raise SystemExit("deepmetric index failed")
    manifest = json.loads((Path(a.work) / "ours" / "manifest.json").read_text())
    size = sum(p.stat().st_size for p in (Path(a.work) / "ours").iterdir())
    return {"build_s": round(time.perf_counter() - t, 1), "peak_rss_gib": round(_peak_gib(), 3),
            "disk_gib": round(size / 2 ** 30, 3), "approximate": manifest["approximate"]}


def phase_raw_build(a) -> dict:
    import faiss

    ap = json.loads((Path(a.work) / "ours" / "manifest.json").read_text())["approximate"]
    from deepmetric.search.interchange import NpyRows

    x = NpyRows(Path(a.work) / "vectors.npy")  # read as ours reads it (os.pread, not a memory map)
    t = time.perf_counter()
    if a.raw_build == "reuse":
        # the same trained and filled OPQ+IVF+PQ that ours wrote (faiss.read_index of its file), with
        # faiss's own float16 re-ranking filled here: the same index and parameters, without a
        # second hour-long training and assignment (the build-time comparison is the "full" mode's)
        base = faiss.read_index(str(Path(a.work) / "ours" / "index.faiss"))
        refine = faiss.IndexScalarQuantizer(a.d, faiss.ScalarQuantizer.QT_fp16, faiss.METRIC_INNER_PRODUCT)
        for s in range(0, len(x), CHUNK):
            refine.add(np.ascontiguousarray(x[s:s + CHUNK]))
        index = faiss.IndexRefine(base, refine)
        faiss.write_index(index, str(Path(a.work) / "raw.faiss"))
        return {"build_s": round(time.perf_counter() - t, 1), "peak_rss_gib": round(_peak_gib(), 3),
                "disk_gib": round(os.path.getsize(Path(a.work) / "raw.faiss") / 2 ** 30, 3),
                "mode": "reuse: ours' index.faiss + a float16 IndexScalarQuantizer (not a second training)"}
    base = faiss.index_factory(a.d, ap["factory"], faiss.METRIC_INNER_PRODUCT)
    rows = np.sort(np.random.default_rng(0).choice(len(x), size=ap["train_rows"], replace=False))
    base.train(np.concatenate([x[s:s + CHUNK][rows[(rows >= s) & (rows < s + CHUNK)] - s]
                               for s in range(0, len(x), CHUNK)]))
    refine = faiss.IndexScalarQuantizer(a.d, faiss.ScalarQuantizer.QT_fp16, faiss.METRIC_INNER_PRODUCT)
    index = faiss.IndexRefine(base, refine)
    for s in range(0, len(x), CHUNK):
        index.add(np.ascontiguousarray(x[s:s + CHUNK]))
    faiss.write_index(index, str(Path(a.work) / "raw.faiss"))
    return {"build_s": round(time.perf_counter() - t, 1), "peak_rss_gib": round(_peak_gib(), 3),
            "disk_gib": round(os.path.getsize(Path(a.work) / "raw.faiss") / 2 ** 30, 3)}


def _run_queries(search, q: np.ndarray) -> tuple[float, np.ndarray]:
    t = time.perf_counter()
    got = np.concatenate([search(q[s:s + 100], 10)[1] for s in range(0, len(q), 100)])
    return time.perf_counter() - t, got


def _recall(got: np.ndarray, exact: np.ndarray) -> float:
    return round(float(np.mean([len(set(g[g >= 0]) & set(e)) / len(e) for g, e in zip(got, exact)])), 4)


def _raw_index(a):
    import faiss

    ap = json.loads((Path(a.work) / "ours" / "manifest.json").read_text())["approximate"]
    index = faiss.read_index(str(Path(a.work) / "raw.faiss"))
    faiss.extract_index_ivf(index).nprobe = ap["nprobe"]
    params = faiss.IndexRefineSearchParameters(k_factor=ap["k_factor"])
    return lambda x, k: index.search(x, k, params=params)


def phase_speed(a) -> dict:
    """Ours and raw faiss in one process, alternating 3 rounds of 1,000 queries (the machine is
    shared: the best round of each is reported)."""
    import faiss

    from deepmetric.search import Index

    faiss.omp_set_num_threads(a.threads)
    q, exact = np.load(Path(a.work) / "queries.npy"), np.load(Path(a.work) / "exact.npy")
    systems = {"ours": Index.load(Path(a.work) / "ours").search, "raw": _raw_index(a)}
    best = {name: (np.inf, None) for name in systems}
    for search in systems.values():
        search(q[:100], 10)  # warm-up
    for _ in range(3):
        for name, search in systems.items():
            dt, got = _run_queries(search, q)
            best[name] = min(best[name], (dt, got), key=lambda t: t[0])
    return {name: {"queries_per_s": round(len(q) / dt, 1), "recall@10": _recall(got, exact)}
            for name, (dt, got) in best.items()}


def phase_memory(a) -> dict:
    """Resident memory after loading (as ``deepmetric serve`` does) and answering 1,000 queries."""
    q = np.load(Path(a.work) / "queries.npy")
    t = time.perf_counter()
    if a.system == "ours":
        from deepmetric.search import Index

        search = Index.load(Path(a.work) / "ours", verify_hashes=True).search
    else:
        search = _raw_index(a)
    load_s = time.perf_counter() - t
    _run_queries(search, q)
    rss = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return {"load_s": round(load_s, 1), "rss_after_gib": round(rss / 2 ** 30, 3), "peak_rss_gib": round(_peak_gib(), 3)}


def _tiny_checkpoint(work: Path, d: int) -> tuple[Path, list[Path]]:
    """A 1-epoch ``glyph_resnet`` making ``d``-d embeddings of 28 px digits (``deepmetric serve``
    needs a model to embed an upload; its quality is beside the point here), and its images."""
    from deepmetric.data.synthetic import write_digit_folder
    from deepmetric.run.config_io import config_from_dict
    from deepmetric.train.loop import train

    digits = write_digit_folder(work / "digits", per_class=8, seed=0)
    if not (work / "run" / "last.pt").is_file():
        train(config_from_dict({
            "data": {"name": "folder", "root": str(digits), "options": {"class_split": "half", "mode": "L"},
                     "transform": "mnist", "transform_options": {"size": 28}},
            "model": {"name": "glyph_resnet", "options": {"embedding_dim": d, "in_chans": 1, "widths": [8, 16],
                                                          "depths": [1, 1]}},
            "loss": [{"name": "heated_softmax", "options": {"alpha": 16.0}}],
            "optim": {"name": "sgd", "lr": 0.05},
            "train": {"epochs": 1, "batch_size": 16, "seed": 0, "out_dir": str(work / "run"), "progress": False},
            "eval": {"every": 0, "baselines": False}}))
    return work / "run" / "last.pt", sorted(digits.rglob("*.png"))


def _post_image(url: str, path: Path) -> dict:
    import urllib.request
    import uuid

    boundary = uuid.uuid4().hex
    body = (f'--{boundary}\r\nContent-Disposition: form-data; name="image"; filename="{path.name}"\r\n'
            f"Content-Type: image/png\r\n\r\n").encode() + path.read_bytes() + f"\r\n--{boundary}--\r\n".encode()
    req = urllib.request.Request(url, data=body, method="POST",
                                 headers={"Content-Type": f"multipart/form-data; boundary={boundary}"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def _proc_gib(pid: int) -> dict:
    fields = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status"))
    return {k: round(int(fields[k].split()[0]) / 2 ** 20, 3) for k in ("VmRSS", "VmHWM")}


def phase_serve(a) -> dict:
    """``deepmetric serve`` on ours (the real server, a child process on 127.0.0.1), answering
    ``--queries`` uploads one after another; its VmRSS after them and VmHWM (peak, load included)."""
    import signal
    import socket
    import urllib.request

    ckpt, images = _tiny_checkpoint(Path(a.work) / "serve", a.d)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t = time.perf_counter()
    server = subprocess.Popen([sys.executable, "-m", "deepmetric.cli", "serve", str(Path(a.work) / "ours"),
                               "--checkpoint", str(ckpt), "--host", "127.0.0.1", "--port", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        base = f"http://127.0.0.1:{port}"
        while True:
            if server.poll() is not None:
                raise SystemExit(f"deepmetric serve exited: {server.stderr.read()[-2000:]}")
            if time.perf_counter() - t > 900:
                raise SystemExit("deepmetric serve did not answer /api/info within 900 s")
            try:
                with urllib.request.urlopen(base + "/api/info", timeout=5) as r:
                    info = json.loads(r.read())
                break
            except OSError:
                time.sleep(1)
        ready_s = time.perf_counter() - t
        t = time.perf_counter()
        for i in range(a.queries):
            hits = _post_image(base + "/search", images[i % len(images)])
        mem = _proc_gib(server.pid)
        return {"ready_s": round(ready_s, 1), "count": info.get("count"), "uploads": a.queries,
                "uploads_per_s": round(a.queries / (time.perf_counter() - t), 1),
                "last_answer_rows": len(hits.get("results", hits.get("neighbours", []))),
                "server_rss_after_gib": mem["VmRSS"], "server_peak_rss_gib": mem["VmHWM"]}
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()


def _child(a, phase: str, **extra) -> dict:
    argv = [sys.executable, __file__, "--phase", phase, "--n", str(a.n), "--d", str(a.d), "--work", a.work,
            "--clusters", str(a.clusters), "--queries", str(a.queries)]
    argv += ["--memory-budget", str(a.memory_budget)] if a.memory_budget else []
    for k, v in extra.items():
        argv += [f"--{k}", str(v)]
    r = subprocess.run(argv, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"phase {phase} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _resumable(a, name: str, phase: str, **extra) -> dict:
    """One phase's result, from ``WORK/<name>.json`` when a run killed later already wrote it (the same
    command resumes after the last finished phase)."""
    done = Path(a.work) / f"{name}.json"
    if done.is_file():
        res = json.loads(done.read_text())
    else:
        res = _child(a, phase, **extra)
        done.with_suffix(".tmp").write_text(json.dumps(res))
        os.replace(done.with_suffix(".tmp"), done)
    print(name, json.dumps(res), file=sys.stderr, flush=True)
    return res


def projection(ap: dict, n_measured: int, build_s: float, d: int) -> list[str]:
    """Memory from the formula, disk from N * (d * 2 + M + 8 + 60), build time scaled by
    N * nlist (the coarse assignment dominates; nlist grows as sqrt(N)) from the measured run."""
    from deepmetric.search.compressed import plan_ivfpq, resident_bytes

    rows = ["| vectors | PQ bytes | nlist | resident (formula) | disk: float16 + codes + metadata | build on "
            "1 such machine (scaled by N * nlist) | machines for resident <= 16 GiB each |",
            "|---|---|---|---|---|---|---|"]
    nlist0 = plan_ivfpq(n_measured, d)["nlist"]
    for n in sorted({n_measured, 10_000_000, 100_000_000, 1_000_000_000}):
        plan = plan_ivfpq(n, d)
        m = ap["pq_bytes"]
        res = resident_bytes(n, d, m, plan["nlist"])
        disk = n * (d * 2 + m + 8 + 60)  # + ~60 bytes of metadata per row
        machines = max(1, int(np.ceil(res / (16 * 2 ** 30))))
        hours = build_s * (n / n_measured) * (plan["nlist"] / nlist0) / 3600
        rows.append(f"| {n:,} | {m} | {plan['nlist']} | {res / 2 ** 30:.2f} GiB | {disk / 2 ** 30:.1f} GiB | "
                    f"{hours:.2f} h | {machines} ({n // machines:,} vectors, {res / machines / 2 ** 30:.2f} GiB each) |")
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=1_000_000)
    p.add_argument("--d", type=int, default=256)
    p.add_argument("--clusters", type=int, default=10_000)
    p.add_argument("--queries", type=int, default=1000)
    p.add_argument("--memory-budget", type=float, default=None)
    p.add_argument("--work", default="/tmp/index_scale")
    p.add_argument("--phase", default=None)
    p.add_argument("--system", default="ours")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--raw-build", choices=("full", "reuse"), default="full",
                   help="full: train and fill raw faiss from scratch (build times compared); reuse: wrap "
                        "ours' index.faiss in faiss's IndexRefine (same index, speed and memory compared)")
    a = p.parse_args()
    if a.phase:
        fn = {"data": phase_data, "ours-build": phase_ours_build, "raw-build": phase_raw_build,
              "speed": phase_speed, "memory": phase_memory, "serve": phase_serve}[a.phase]
        print(json.dumps(fn(a)))
        return
    Path(a.work).mkdir(parents=True, exist_ok=True)
    res = {"n": a.n, "d": a.d, "clusters": a.clusters, "queries": a.queries, "cpus": os.cpu_count()}
    for phase in ("data", "ours-build", "raw-build"):
        res[phase] = _resumable(a, phase, phase, **({"raw-build": a.raw_build} if phase == "raw-build" else {}))
    for threads in (1, 2):
        res[f"speed-{threads}t"] = _resumable(a, f"speed-{threads}t", "speed", threads=threads)
        res[f"speed_ratio_{threads}t"] = round(res[f"speed-{threads}t"]["ours"]["queries_per_s"]
                                               / res[f"speed-{threads}t"]["raw"]["queries_per_s"], 3)
    for system in ("ours", "raw"):
        res[f"memory-{system}"] = _resumable(a, f"memory-{system}", "memory", system=system)
    res["serve"] = _resumable(a, "serve", "serve")
    res["projection"] = projection(res["ours-build"]["approximate"], a.n, res["ours-build"]["build_s"], a.d)
    print(json.dumps(res, indent=1))
    print("\n".join(res["projection"]))


if __name__ == "__main__":
    main()
