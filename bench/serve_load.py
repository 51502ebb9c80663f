"""Load on ``deepmetric serve``: requests/s, latency percentiles and peak memory for N
concurrent clients, and (``--hostile``) how the server holds up under decompression bombs.

The server is ``deepmetric serve INDEX_DIR`` in a child process on 127.0.0.1 (a free port;
only loopback addresses are accepted). For each client count, that many threads each send
``--requests`` POST /search uploads (the index's own images, cycled, so every answer is
known: the image must come back first with cosine 1), one after another, and the script
reports:

  clients  requests  ok  busy(503)  other  req/s  p50/p95/p99 ms  peak RSS MiB

``req/s`` counts answered requests (200 and 503) over the wall time of the round; latencies
are of the 200 answers; ``peak RSS`` is the server's largest resident set during the round,
sampled every 20 ms from /proc (plus the kernel's high-water mark, reset per round where the
kernel allows). Every loop is bounded (requests per client, a deadline per round).

``--hostile``: 8 concurrent uploads of a 78 KB PNG claiming 1 x 40,000,000 pixels, 8 of a
3500 x 3500 gradient PNG (36.8 MB decoded), while a separate process times GET /api/info
every 20 ms; reports the statuses, the worst /api/info latency and the server's peak RSS.
Then (issue 32) the same measurements while 200 idle TCP connections are held open and 8
concurrent 64 KB palette + tRNS 8192 x 8192 PNGs and 8 16-bit grey 5792 x 5792 PNGs are
uploaded (``idle+bombs``), and, with ``--photos N``, 4,000 distinct thumbnails
(``/thumb/i?size=s``) of an index of N synthetic 1600 x 1200 JPEG photos built with the
index's checkpoint, against the server's resident memory at idle (``thumbs``).

  python bench/serve_load.py runs/demo/index                    # 1, 4 and 16 clients
  python bench/serve_load.py runs/demo/index --clients 1 4 --requests 20 --hostile
  python bench/serve_load.py runs/demo/index --clients 1 --hostile --photos 40
  python bench/serve_load.py --checkpoint runs/demo/last.pt     # index its test split first
"""
from __future__ import annotations

import argparse
import io
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def http(host, port, method, path, body=None, headers=None, timeout=120):
    import http.client

    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def multipart(name: str, data: bytes, k: int):
    boundary = "deepmetricbench"
    body = (f'--{boundary}\r\nContent-Disposition: form-data; name="k"\r\n\r\n{k}\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="image"; filename="{name}"\r\n'
            'Content-Type: application/octet-stream\r\n\r\n').encode() + data + f"\r\n--{boundary}--\r\n".encode()
    return body, {"Content-Type": f"multipart/form-data; boundary={boundary}"}


def memory_kib(pid: int) -> dict:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                out[line.split(":")[0]] = int(line.split()[1])
    return out


def reset_peak(pid: int) -> bool:
    """Reset the kernel's VmHWM of ``pid`` (Linux: ``echo 5 > /proc/PID/clear_refs``)."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class Sampler:
    """The largest VmRSS of a process, sampled every 20 ms until stopped."""

    def __init__(self, pid: int):
        self.pid, self.peak, self._stop = pid, 0, threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, memory_kib(self.pid).get("VmRSS", 0))
            time.sleep(0.02)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self.thread.join(timeout=5)


def start_server(index_dir: Path, host: str, args) -> tuple[subprocess.Popen, int, object]:
    port = free_port(host)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    log = tempfile.TemporaryFile("w+")
    cmd = [sys.executable, "-m", "deepmetric.cli", "serve", str(index_dir), "--host", host, "--port", str(port),
           "--workers", str(args.workers), "--max-in-flight", str(args.max_in_flight), "--k", str(args.k)]
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 300
    while True:
        try:
            if http(host, port, "GET", "/api/info", timeout=5)[0] == 200:
                return proc, port, log
        except OSError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            log.seek(0)
            raise SystemExit(f"deepmetric serve did not start:\n{log.read()}")
        time.sleep(0.3)


def load_round(host, port, pid, queries, clients: int, requests: int, k: int) -> dict:
    lat, statuses, wrong = [], [], []
    lock = threading.Lock()

    def client(c):
        for r in range(requests):
            i, name, data = queries[(c * requests + r) % len(queries)]
            body, headers = multipart(name, data, k)
            t = time.perf_counter()
            status, out = http(host, port, "POST", "/search", body, headers)
            dt = time.perf_counter() - t
            with lock:
                statuses.append(status)
                if status == 200:
                    lat.append(dt)
                    first = json.loads(out)["neighbours"][0]
                    if first["id"] != i and first["cosine"] < 0.9999:
                        wrong.append((i, first))

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    peak_reset = reset_peak(pid)
    with Sampler(pid) as sampler:
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=600)
        wall = time.perf_counter() - t0
    hwm = memory_kib(pid)["VmHWM"] if peak_reset else None
    ms = np.asarray(lat) * 1000
    ok, busy = statuses.count(200), statuses.count(503)
    return {"clients": clients, "requests": len(statuses), "ok": ok, "busy": busy,
            "other": len(statuses) - ok - busy, "req_s": (ok + busy) / wall,
            "p50": float(np.percentile(ms, 50)) if ok else None, "p95": float(np.percentile(ms, 95)) if ok else None,
            "p99": float(np.percentile(ms, 99)) if ok else None,
            "peak_mib": max(sampler.peak, hwm or 0) / 1024, "wrong_first": len(wrong)}


POLLER = r"""
import http.client, json, os, sys, time
host, port, stop = sys.argv[1], int(sys.argv[2]), sys.argv[3]
out, end = [], time.monotonic() + 120
while not os.path.exists(stop) and time.monotonic() < end:
    t = time.perf_counter()
    c = http.client.HTTPConnection(host, port, timeout=10)
    c.request("GET", "/api/info")
    r = c.getresponse(); r.read(); c.close()
    out.append([r.status, time.perf_counter() - t])
    time.sleep(0.02)
print(json.dumps(out))
"""


def long_thin_png(width: int, height: int) -> bytes:
    import struct
    import zlib

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    comp = zlib.compressobj(9)
    total = (1 + width) * height
    block = b"\x00" * min(total, 1 << 22)
    parts = [comp.compress(block[:min(len(block), total - a)]) for a in range(0, total, len(block))]
    parts.append(comp.flush())
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0))
            + chunk(b"IDAT", b"".join(parts)) + chunk(b"IEND", b""))


def hostile_round(host, port, pid) -> dict:
    from PIL import Image

    bomb = long_thin_png(1, 40_000_000)
    side = 3500
    y, x = np.mgrid[0:side, 0:side]
    a = np.stack([x * 255 // (side - 1), y * 255 // (side - 1), ((x + y) // 28) % 256], -1).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, "PNG")
    big = buf.getvalue()
    uploads = [(f"bomb{i}.png", bomb) for i in range(8)] + [(f"big{i}.png", big) for i in range(8)]
    results, polls = uploads_while_polling(host, port, pid, uploads, settle_s=0.2)
    return {"bomb_statuses": sorted(s for n, s, _ in results if n.startswith("bomb")),
            "big_statuses": sorted(s for n, s, _ in results if n.startswith("big")), **polls}


def uploads_while_polling(host, port, pid, uploads, *, settle_s: float) -> tuple[list, dict]:
    """POST every ``(name, png)`` of ``uploads`` to /search at once while another process polls
    /api/info; returns ``[(name, status, seconds)]`` and the polls' and memory's summary."""
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        stop = Path(tmp) / "stop"
        poller = subprocess.Popen([sys.executable, "-c", POLLER, host, str(port), str(stop)],
                                  stdout=subprocess.PIPE, text=True)
        time.sleep(0.3)

        def upload(name, data):
            body, headers = multipart(name, data, 5)
            t = time.perf_counter()
            status, _ = http(host, port, "POST", "/search", body, headers)
            results.append((name, status, time.perf_counter() - t))

        threads = [threading.Thread(target=upload, args=u) for u in uploads]
        reset_peak(pid)
        before = memory_kib(pid)["VmRSS"]
        with Sampler(pid) as sampler:
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=300)
            time.sleep(settle_s)
        stop.touch()
        info = json.loads(poller.communicate(timeout=60)[0])
    lat = np.asarray([dt for _, dt in info]) * 1000
    return results, {"uploads_s": max(dt for *_, dt in results), "info_polls": len(info),
                     "info_ok": sum(s == 200 for s, _ in info), "info_p50_ms": float(np.median(lat)),
                     "info_max_ms": float(lat.max()), "info_over_100ms": int((lat > 100).sum()),
                     "rss_before_mib": before / 1024,
                     "peak_mib": max(sampler.peak, memory_kib(pid)["VmHWM"]) / 1024}


def small_bomb_png(side: int, kind: str) -> bytes:
    """A 64 KB PNG of zeros, ``side`` x ``side``: ``palette`` (with a transparent entry) or
    ``grey16`` (as tests/odd_images.py)."""
    import struct
    import zlib

    def chunk(kind_, data):
        return struct.pack(">I", len(data)) + kind_ + data + struct.pack(">I", zlib.crc32(kind_ + data))

    depth, colour, per = {"palette": (8, 3, 1), "grey16": (16, 0, 2)}[kind]
    comp = zlib.compressobj(6)
    row = b"\x00" * (1 + side * per)
    rows = max(1, (1 << 22) // len(row))
    idat = b"".join([comp.compress(row * min(rows, side - a)) for a in range(0, side, rows)] + [comp.flush()])
    extra = chunk(b"PLTE", bytes(range(256)) * 3) + chunk(b"tRNS", b"\x00" + b"\xff" * 255) if kind == "palette" else b""
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", side, side, depth, colour, 0, 0, 0))
            + extra + chunk(b"IDAT", idat) + chunk(b"IEND", b""))


def idle_bombs_round(host, port, pid, idle: int = 200) -> dict:
    """``idle`` open connections that send nothing, while 8 palette + tRNS and 8 16-bit grey
    bombs are uploaded at once and /api/info is polled from another process."""
    palette, grey = small_bomb_png(8192, "palette"), small_bomb_png(5792, "grey16")
    socks = [socket.create_connection((host, port), timeout=5) for _ in range(idle)]
    uploads = [(f"palette{i}.png", palette) for i in range(8)] + [(f"grey16_{i}.png", grey) for i in range(8)]
    try:
        results, polls = uploads_while_polling(host, port, pid, uploads, settle_s=0.5)
    finally:
        for s in socks:
            s.close()
    return {"idle_sockets": idle, "palette_statuses": sorted(s for n, s, _ in results if n.startswith("palette")),
            "grey16_statuses": sorted(s for n, s, _ in results if n.startswith("grey16")), **polls}


def photo_index(checkpoint: str, count: int, out: Path) -> Path:
    """An index of ``count`` synthetic 1600 x 1200 JPEG photos (smooth colour fields with
    8 x 8-pixel noise, texture that survives the thumbnail's down-scaling; 2 classes) built
    with ``checkpoint``."""
    from PIL import Image

    from deepmetric.search import Index

    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:1200, 0:1600].astype(np.float32)
    for i in range(count):
        d = out / "photos" / f"class{i % 2}"
        d.mkdir(parents=True, exist_ok=True)
        f = rng.uniform(0.001, 0.01, 3)
        a = np.stack([127 + 100 * np.sin(x * f[0] + i), 127 + 100 * np.cos(y * f[1]), 127 + 100 * np.sin((x + y) * f[2])], -1)
        a += np.kron(rng.normal(0, 40, (150, 200, 3)), np.ones((8, 8, 1))).astype(np.float32)
        Image.fromarray(np.clip(a, 0, 255).astype(np.uint8)).save(d / f"photo{i:03d}.jpg", quality=90)
    Index.build(checkpoint, data="folder", root=str(out / "photos"), split="all", out=out / "index", progress=False)
    return out / "index"


def thumbs_round(host, port, pid, rows: int, total: int = 4000, clients: int = 4) -> dict:
    """``total`` distinct ``/thumb/i?size=s`` requests (drawn from every row x sizes 16..512) from
    ``clients`` threads; the server's resident memory before, at its peak and after."""
    import http.client

    every = [(i, s) for s in range(16, 513) for i in range(rows)]
    pairs = [every[j] for j in np.random.default_rng(0).choice(len(every), min(total, len(every)), replace=False)]
    order = np.arange(len(pairs))
    statuses, lock = [], threading.Lock()

    def client(c):
        conn = http.client.HTTPConnection(host, port, timeout=60)
        for j in order[c::clients]:
            i, s = pairs[j]
            conn.request("GET", f"/thumb/{i}?size={s}")
            r = conn.getresponse()
            body = r.read()
            with lock:
                statuses.append((r.status, len(body)))
        conn.close()

    before = memory_kib(pid)["VmRSS"]
    reset_peak(pid)
    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    t0 = time.perf_counter()
    with Sampler(pid) as sampler:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=1200)
    wall = time.perf_counter() - t0
    after = memory_kib(pid)["VmRSS"]
    return {"requests": len(statuses), "ok": sum(s == 200 for s, _ in statuses),
            "png_mib": sum(n for s, n in statuses if s == 200) / 2**20, "wall_s": wall,
            "rss_before_mib": before / 1024, "peak_mib": max(sampler.peak, memory_kib(pid)["VmHWM"]) / 1024,
            "rss_after_mib": after / 1024, "growth_mib": (after - before) / 1024}


def queries_of(index_dir: Path, limit: int) -> list:
    """(row, name, bytes) of up to ``limit`` indexed images, spread over the index."""
    from deepmetric.search import Index

    paths = Index.load(index_dir, mmap=True).paths  # any index format (3: Arrow metadata), paths resolved
    rows = [i for i, p in enumerate(paths) if p]
    rows = rows[:: max(1, len(rows) // limit)][:limit]
    out = []
    for i in rows:
        p = Path(paths[i])
        out.append((i, p.name, p.read_bytes()))
    if not out:
        raise SystemExit(f"{index_dir}: no indexed image files to send as queries")
    return out


def shown(path) -> str | None:
    """``path`` as a result may print it: relative to the repository, or ``.../NAME`` outside it
    (a machine's own folders are not part of a committed result)."""
    if path is None:
        return None
    p = Path(path).resolve()
    try:
        return str(p.relative_to(ROOT))
    except ValueError:
        return f".../{p.name}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("index", nargs="?", help="index folder (or give --checkpoint to build one)")
    ap.add_argument("--checkpoint", help="index this checkpoint's test split into a temporary folder first")
    ap.add_argument("--host", default="127.0.0.1", help="loopback address to serve on (default 127.0.0.1)")
    ap.add_argument("--clients", type=int, nargs="*", default=[1, 4, 16],
                    help="client counts of the load rounds (default 1 4 16; none: no load round)")
    ap.add_argument("--requests", type=int, default=40, help="requests per client and round (default 40)")
    ap.add_argument("--queries", type=int, default=64, help="distinct query images (default 64)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--max-in-flight", type=int, default=8)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--hostile", action="store_true", help="also the bomb rounds (with 200 idle sockets too)")
    ap.add_argument("--idle", type=int, default=200, help="idle connections held in the bombs round (default 200)")
    ap.add_argument("--photos", type=int, default=0,
                    help="also the thumbnail round: 4,000 distinct thumbnails of an index of this many "
                         "1600 x 1200 JPEG photos built with the index's checkpoint (default 0: skip)")
    a = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT / "src"))
    from deepmetric.search.guard import is_loopback

    if not is_loopback(a.host):
        raise SystemExit(f"--host {a.host}: this benchmark only serves on loopback addresses")
    tmp = None
    if a.index is None:
        if a.checkpoint is None:
            raise SystemExit("give an index folder or --checkpoint")
        from deepmetric.search import Index

        tmp = tempfile.TemporaryDirectory()
        Index.build(a.checkpoint, out=Path(tmp.name) / "index", progress=False)
        a.index = Path(tmp.name) / "index"
    index_dir = Path(a.index)
    manifest = json.loads((index_dir / "manifest.json").read_text(encoding="utf-8"))
    queries = queries_of(index_dir, a.queries)
    proc, port, log = start_server(index_dir, a.host, a)
    try:
        info = json.loads(http(a.host, port, "GET", "/api/info")[1])
        print(f"index {shown(index_dir)}: {info['count']} images, d={info['dim']}, {info['kind']}; checkpoint "
              f"{shown((manifest.get('checkpoint') or {}).get('path'))} (sha256 {str(info['checkpoint_sha256'])[:12]}); "
              f"workers {a.workers}, max in flight {a.max_in_flight}, k {a.k}, {len(queries)} query images; "
              f"cpus {os.cpu_count()}, load average {os.getloadavg()}")
        print(f"server idle RSS {memory_kib(proc.pid)['VmRSS'] / 1024:.0f} MiB")
        print("| clients | requests | ok | busy (503) | other | req/s | p50 ms | p95 ms | p99 ms | peak RSS MiB |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        http(a.host, port, "POST", "/search", *multipart(queries[0][1], queries[0][2], a.k))  # warm-up
        for c in a.clients:
            r = load_round(a.host, port, proc.pid, queries, c, a.requests, a.k)
            fmt = lambda v: "-" if v is None else f"{v:.0f}"  # noqa: E731
            print(f"| {c} | {r['requests']} | {r['ok']} | {r['busy']} | {r['other']} | {r['req_s']:.1f} | "
                  f"{fmt(r['p50'])} | {fmt(r['p95'])} | {fmt(r['p99'])} | {r['peak_mib']:.0f} |", flush=True)
            if r["wrong_first"]:
                print(f"  warning: {r['wrong_first']} answers did not find the query image first")
        show = lambda name, h: print(f"{name}: " + ", ".join(  # noqa: E731
            f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in h.items()), flush=True)
        if a.hostile:
            show("hostile", hostile_round(a.host, port, proc.pid))
            show("idle+bombs", idle_bombs_round(a.host, port, proc.pid, a.idle))
        if proc.poll() is not None:
            raise SystemExit("the server died")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
    if a.photos:
        ckpt = (manifest.get("checkpoint") or {}).get("path")
        with tempfile.TemporaryDirectory() as tmp2:
            t = time.perf_counter()
            photos = photo_index(ckpt, a.photos, Path(tmp2))
            print(f"photo index: {a.photos} images of 1600 x 1200 (JPEG) built in {time.perf_counter() - t:.0f} s")
            proc, port, log = start_server(photos, a.host, a)
            try:
                time.sleep(1.0)
                show("thumbs", thumbs_round(a.host, port, proc.pid, a.photos))
            finally:
                proc.terminate()
                proc.wait(timeout=30)
                log.close()
        if tmp is not None:
            tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
