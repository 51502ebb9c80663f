"""deepmetric serve under hostile use, against real uvicorn servers on loopback started here
(``deepmetric serve`` subprocesses, or the app in a thread where a test slows the work down).
Every loop is bounded by a count or a deadline and stops by itself.

* 8 concurrent 1 x 40,000,000 PNG uploads (and 8 large, legitimate ones) keep the server's
  peak memory under 2 GB while /api/info keeps answering within 100 ms (see the test for how
  strictly on a shared machine);
* replacing or truncating the served files changes neither the answers nor the server's
  health until a reload; a reload of a damaged folder is refused, a good one (endpoint or
  SIGHUP) switches;
* searches beyond the in-flight cap get 503 + Retry-After, work over the time limit 504, an
  upload that never completes 408;
* the Host header is checked (DNS rebinding), loopback addresses other than 127.0.0.1 are
  loopback; the smaller defects of issue 20 (thumbnail size '²', upper-case content type,
  --k larger than the index, a file name that is not UTF-8).
"""
import json
import shutil
import signal
import threading
import time
from functools import partial
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from deepmetric import cli  # noqa: E402
from deepmetric.search import Index  # noqa: E402
from deepmetric.search.guard import is_loopback  # noqa: E402
from deepmetric.search.serve import create_app  # noqa: E402
from odd_images import long_thin_png, png_bytes  # noqa: E402
from search_data import make_shapes_folder, shapes_setup  # noqa: E402
from serving import info_latencies_during, memory_kib, multipart, request, serve_in_thread, serve_subprocess  # noqa: E402


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    return shapes_setup(tmp_path_factory)


def _search(url, data, name="q.png", k=5, host=None, content_type="multipart/form-data", timeout=60):
    body, headers = multipart({"k": str(k)}, {"image": (name, data)}, content_type)
    if host:
        headers["Host"] = host
    return request(url, "POST", "/search", body, headers, timeout=timeout)


def _gradient_png(side: int) -> bytes:
    y, x = np.mgrid[0:side, 0:side]
    a = np.stack([x * 255 // (side - 1), y * 255 // (side - 1), ((x + y) // 28) % 256], -1).astype(np.uint8)
    return png_bytes(Image.fromarray(a))


@pytest.mark.slow
def test_bomb_uploads_keep_memory_bounded_and_info_fast(shapes, tmp_path):
    bomb = long_thin_png(1, 40_000_000)  # 78 KB that claims 40 M pixels
    big = _gradient_png(3500)  # 145 KB, 36.8 MB decoded: under the limit, so it is decoded
    # all 16 are accepted at once (--max-in-flight 16); the 2 workers bound the decoding
    with serve_subprocess(shapes["index_dir"], "--max-in-flight", "16") as (url, proc, output):
        before = memory_kib(proc.pid)
        results = []

        def upload(data, name):
            results.append((name, *_search(url, data, name)))

        uploads = [partial(upload, bomb, f"bomb{i}.png") for i in range(8)]
        uploads += [partial(upload, big, f"big{i}.png") for i in range(8)]
        latencies = info_latencies_during(url, tmp_path / "stop", uploads, join_timeout=120)
        peak = memory_kib(proc.pid)
        assert proc.poll() is None, output()
    assert len(results) == 16
    for name, status, _, body in results:
        if name.startswith("bomb"):
            assert status == 413, (name, status, body)
            # refused from its header by the memory its decode takes (grey -> RGB: 5 bytes a pixel)
            assert json.loads(body)["error"] == (f"{name}: image of 1 x 40000000 pixels (L) takes 190.7 MiB to "
                                                 "decode, more than the limit of 64.0 MiB (67,108,864 bytes)")
        else:
            assert status == 200 and len(json.loads(body)["neighbours"]) == 5, (name, status, body)
    worst = max(dt for _, dt in latencies)
    print(f"peak {peak}, before {before}, /api/info worst {worst * 1000:.1f} ms of {len(latencies)} "
          f"(slowest {sorted(round(dt * 1000) for _, dt in latencies)[-6:]} ms)")
    assert len(latencies) >= 10 and all(s == 200 for s, _ in latencies)
    # Alone on the machine every answer takes < 100 ms (12-72 ms worst here; bench/serve_load.py
    # --hostile records it in bench/RESULTS.md). This suite shares 2 cores with its other
    # worker and other jobs, whose scheduling delays reach the poller too, so the test asks
    # that 95 % of the answers take < 100 ms and none 1 s: decoding on the event loop (the
    # defect) held every answer for the whole decode of each upload.
    fast = np.mean([dt < 0.1 for _, dt in latencies])
    assert fast >= 0.95 and worst < 1.0, f"{fast:.0%} of /api/info answers < 100 ms, worst {worst * 1000:.0f} ms"
    assert peak["VmHWM"] < 2 * 1024**2, (before, peak)  # KiB: under 2 GiB at its peak


@pytest.mark.slow
def test_replaced_files_change_nothing_until_a_reload(shapes, tmp_path):
    """The server runs on 127.0.0.2 (loopback too: no warning)."""
    d = tmp_path / "ix"
    shutil.copytree(shapes["index_dir"], d)
    query = sorted(Path(shapes["queries"]).glob("red_disc/*.png"))[0].read_bytes()
    with serve_subprocess(d, "--k", "5", host="127.0.0.2") as (url, proc, output):
        status, _, first = _search(url, query)
        assert status == 200
        # another tool rewrites the files in place (a memory map would now read garbage or SIGBUS)
        emb = d / "embeddings.npy"
        raw = bytearray(emb.read_bytes())
        with open(emb, "r+b") as f:
            f.seek(len(raw) - 2048)
            f.write(bytes(reversed(raw[-2048:])))
        with open(d / "metadata.arrow", "r+b") as f:
            f.truncate(10)
        for _ in range(3):
            status, _, again = _search(url, query)
            assert status == 200 and again == first and proc.poll() is None
        info = json.loads(request(url, "GET", "/api/info")[2])
        assert info["changed_on_disk"] is True and info["count"] == 32
        deadline = time.monotonic() + 20  # the server notices within seconds, and says so once
        while "changed on disk; still serving" not in output() and time.monotonic() < deadline:
            time.sleep(0.2)
        status, _, body = request(url, "POST", "/api/reload")
        assert status == 409 and "reload refused, still serving the previous index" in json.loads(body)["error"]
        assert "metadata.arrow" in json.loads(body)["error"]
        assert _search(url, query)[2] == first
        # a proper rebuild with more images: served only after the reload
        gallery = tmp_path / "gallery"
        shutil.copytree(shapes["folder"], gallery)
        make_shapes_folder(tmp_path / "extra", per_class=3, seed=11)
        for cls in (tmp_path / "extra").iterdir():
            for p in cls.iterdir():
                shutil.copy(p, gallery / cls.name / f"extra_{p.name}")
        assert cli.main(["index", str(shapes["checkpoint"]), "--data", "folder", "--root", str(gallery),
                         "--out", str(d), "--overwrite", "--no-progress"]) == 0
        assert _search(url, query)[2] == first
        assert json.loads(request(url, "GET", "/api/info")[2])["count"] == 32
        status, _, body = request(url, "POST", "/api/reload")
        assert status == 200 and json.loads(body)["count"] == 44
        new = Index.load(d)
        _, idx = new.search(Image.open(sorted(Path(shapes["queries"]).glob("red_disc/*.png"))[0]), k=5)
        got = json.loads(_search(url, query)[2])["neighbours"]
        assert [n["id"] for n in got] == list(idx[0])
        # SIGHUP reloads too
        more = make_shapes_folder(tmp_path / "more", classes=["blue_square"], per_class=2, seed=12)
        assert cli.main(["index", str(shapes["checkpoint"]), "--data", "folder", "--root", str(more),
                         "--out", str(d), "--add", "--no-progress"]) == 0
        proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 60
        while json.loads(request(url, "GET", "/api/info")[2])["count"] != 46 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert json.loads(request(url, "GET", "/api/info")[2])["count"] == 46
        text = output()
    assert "warning" not in text and "on http://127.0.0.2:" in text
    assert text.count("changed on disk; still serving") >= 1 and text.count("reloaded") == 2, text


@pytest.fixture
def slow_app(shapes):
    """The app in a thread, one worker, 2 searches in flight, 1.5 s per request; every search
    sleeps 1 s in the worker."""
    index = Index.load(shapes["index_dir"])
    app = create_app(index, default_k=4, workers=1, max_in_flight=2, timeout_s=1.5)
    served = app.served["now"].index
    plain = served.search

    def slow(*a, **kw):
        time.sleep(1.0)
        return plain(*a, **kw)

    served.search = slow
    with serve_in_thread(app) as url:
        yield url, shapes


def test_in_flight_cap_and_time_limits(slow_app):
    url, shapes = slow_app
    query = sorted(Path(shapes["queries"]).glob("*/*.png"))[0].read_bytes()
    out = []

    def one():
        t = time.perf_counter()
        status, headers, body = _search(url, query)
        out.append((status, headers.get("retry-after"), time.perf_counter() - t, body))

    threads = [threading.Thread(target=one) for _ in range(5)]
    for t in threads:
        t.start()
    t0 = time.perf_counter()
    info = []
    while any(t.is_alive() for t in threads) and time.perf_counter() - t0 < 30:
        s = time.perf_counter()
        info.append((request(url, "GET", "/api/info")[0], time.perf_counter() - s))
        time.sleep(0.05)
    for t in threads:
        t.join(timeout=30)
    statuses = sorted(s for s, *_ in out)
    assert statuses == [200, 503, 503, 503, 504], [(s, b[:80]) for s, _, _, b in out]
    for status, retry, dt, body in out:
        if status == 503:
            assert retry == "1" and dt < 1.0 and "busy" in json.loads(body)["error"]
        if status == 504:
            assert 1.4 < dt < 4.0 and "longer than the limit of 1.5 s" in json.loads(body)["error"]
    # /api/info never queues behind a search: one that did would take the search's 1 s sleep
    assert all(s == 200 for s, _ in info) and max(dt for _, dt in info) < 1.0
    time.sleep(1.0)  # the timed-out search finishes in its worker and frees its slot
    assert _search(url, query)[0] == 200
    # an upload that never completes: 408 after the time limit, and the slot comes back
    import socket

    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        body, headers = multipart({}, {"image": ("slow.png", query)})
        head = (f"POST /search HTTP/1.1\r\nHost: {host}\r\nContent-Type: {headers['Content-Type']}\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        t = time.perf_counter()
        sock.sendall(head + body[:100])
        answer = b""
        while b"did not arrive" not in answer and time.perf_counter() - t < 10:
            chunk = sock.recv(4096)
            if not chunk:
                break
            answer += chunk
            if len(answer) == len(chunk):
                waited = time.perf_counter() - t
        assert answer.startswith(b"HTTP/1.1 408") and 1.4 < waited < 4.0, (answer, waited)
        assert b"did not arrive within the limit of 1.5 s" in answer
    assert _search(url, query)[0] == 200


@pytest.fixture(scope="module")
def app_url(shapes):
    index = Index.load(shapes["index_dir"])
    with serve_in_thread(create_app(index, default_k=4, allowed_hosts=("search.lan",))) as url:
        yield url, index


def test_host_header_is_checked(app_url):
    url, _ = app_url
    port = url.rsplit(":", 1)[1]
    for host in ["evil.example", f"evil.example:{port}", f"127.0.0.1.evil.example:{port}", "search.lan.evil"]:
        status, _, body = request(url, "GET", "/api/info", headers={"Host": host})
        assert status == 400 and "is not served here" in json.loads(body)["error"], host
        assert request(url, "GET", "/thumb/0", headers={"Host": host})[0] == 400
    for host in [f"127.0.0.1:{port}", f"localhost:{port}", "127.0.0.2", f"[::1]:{port}", "search.lan", "search.lan:80"]:
        assert request(url, "GET", "/api/info", headers={"Host": host})[0] == 200, host
    assert [is_loopback(h) for h in ("127.0.0.2", "127.255.0.1", "::1", "[::1]", "localhost", "a.localhost",
                                     "0.0.0.0", "10.0.0.1", "example.com", "")] == [True] * 6 + [False] * 4


def test_small_defects_of_issue_20(app_url, shapes, tmp_path, capsys):
    url, index = app_url
    for size in ["²", "١٢", "16.0", "-16", "", "99999999999999999999"]:
        status, _, body = request(url, "GET", f"/thumb/0?size={size}".replace("²", "%C2%B2").replace("١٢", "%D9%A1%D9%A2"))
        assert status == 400 and "size must be an integer" in json.loads(body)["error"], size
    query = sorted(Path(shapes["queries"]).glob("*/*.png"))[0].read_bytes()
    status, _, body = _search(url, query, content_type="MULTIPART/FORM-DATA")
    assert status == 200 and len(json.loads(body)["neighbours"]) == 5
    status, _, body = _search(url, query, name=b"caf\xe9.png")  # not UTF-8
    assert status == 200 and json.loads(body)["query"].startswith("caf")
    for k in ["²", "1e3", "0x10"]:
        assert _search(url, query, k=k)[0] == 400
    with pytest.raises(ValueError, match=r"--k 33: .* must lie in 1\.\.32 \(the index holds 32 images"):
        create_app(index, default_k=33)
    assert cli.main(["serve", str(shapes["index_dir"]), "--k", "500", "--port", "9"]) == 2
    assert "--k 500" in capsys.readouterr().err


def test_search_cli_names_a_query_whose_name_is_not_utf8(shapes, tmp_path):
    """In a subprocess, so stdout really encodes UTF-8 (strict) as a terminal does."""
    import os
    import subprocess
    import sys

    src = sorted(Path(shapes["queries"]).glob("red_disc/*.png"))[0]
    odd = os.fsencode(tmp_path) + b"/disc\xe9.png"
    with open(odd, "wb") as f:
        f.write(src.read_bytes())
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2] / "src"), "PYTHONIOENCODING": "utf-8"}
    r = subprocess.run([sys.executable, "-m", "deepmetric.cli", "search", str(shapes["index_dir"]),
                        os.fsdecode(odd), "--k", "2"], env=env, capture_output=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert f"query: {tmp_path}/disc\\xe9.png".encode() in r.stdout and b"red_disc" in r.stdout
    cut = os.fsencode(tmp_path) + b"/cut\xe9.png"
    with open(cut, "wb") as f:
        f.write(src.read_bytes()[:-40])
    r = subprocess.run([sys.executable, "-m", "deepmetric.cli", "search", str(shapes["index_dir"]),
                        os.fsdecode(cut)], env=env, capture_output=True, timeout=300)
    assert r.returncode == 2 and f"{tmp_path}/cut\\xe9.png: not an image that can be decoded".encode() in r.stderr
