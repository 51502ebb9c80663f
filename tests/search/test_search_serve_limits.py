"""deepmetric serve against the cases of issue 32, each reproduced against a real uvicorn on
127.0.0.1 started here (the app in a thread with the server's own protocol, or ``deepmetric
serve`` in a subprocess); every loop is bounded by a count or a deadline.

* idle sockets and slow headers: 200 idle connections do not lock anyone out (uvicorn's
  ``limit_concurrency`` counted them: 103 made every request 503), a client trickling header
  lines is cut off with 408 at the header timeout, idle connections are closed after it, and
  beyond ``max_connections`` the longest idle are closed to make room;
* palette + transparency PNG bombs (64 KB, 8192 x 8192) are refused by the memory their
  decode takes, while 200 idle sockets are held: RSS and /api/info stay bounded;
* thumbnails: the model's decode limit, a cache bounded in bytes;
* cross-site requests (Sec-Fetch-Site, Origin) get 403, the page itself still loads;
* ``serve --port -5 / 70000`` and a port in use: one clear line, no banner, no traceback.
"""
import json
import shutil
import socket
import time
from functools import partial
from pathlib import Path

import numpy as np
import pytest
from PIL import ImageFile

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from deepmetric import cli  # noqa: E402
from deepmetric.search import Index  # noqa: E402
from deepmetric.search import limits as serve_limits  # noqa: E402
from deepmetric.search.serve import create_app  # noqa: E402
from odd_images import small_bomb_png  # noqa: E402
from search_data import shapes_setup  # noqa: E402
from serving import info_latencies_during, memory_kib, multipart, request, serve_in_thread, serve_subprocess  # noqa: E402


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    return shapes_setup(tmp_path_factory)


def _address(url):
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def _idle_sockets(url, n):
    out = []
    for _ in range(n):
        s = socket.create_connection(_address(url), timeout=5)
        out.append(s)
    return out


def _closed_by_server(sock, wait: float) -> bytes | None:
    """What the server sent before closing ``sock`` within ``wait`` s (None: still open)."""
    sock.settimeout(wait)
    got = b""
    try:
        while True:
            chunk = sock.recv(4096)
            if not chunk:
                return got
            got += chunk
    except (socket.timeout, TimeoutError):
        return None
    except OSError:
        return got


def _timed_info(url, n=10):
    out = []
    for _ in range(n):
        t = time.perf_counter()
        status = request(url, "GET", "/api/info", timeout=10)[0]
        out.append((status, time.perf_counter() - t))
    return out


def test_idle_sockets_and_slow_headers_do_not_lock_anyone_out(shapes):
    index = Index.load(shapes["index_dir"])
    with serve_in_thread(create_app(index, default_k=4), header_timeout_s=1.5) as url:
        idle = _idle_sockets(url, 200)
        try:
            info = _timed_info(url)
            assert all(s == 200 for s, _ in info), info
            assert sorted(dt for _, dt in info)[len(info) // 2] < 0.1, info  # median; see the subprocess test
            # a client sending one header line every 0.3 s is cut off at the header timeout
            slow = socket.create_connection(_address(url), timeout=5)
            slow.sendall(b"GET /api/info HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            t0 = time.monotonic()
            answer = None
            while answer is None and time.monotonic() - t0 < 6:
                try:
                    slow.sendall(b"X-Slow: 1\r\n")
                except OSError:
                    answer = _closed_by_server(slow, 1) or b""
                    break
                answer = _closed_by_server(slow, 0.3)
            waited = time.monotonic() - t0
            assert answer is not None and answer.startswith(b"HTTP/1.1 408"), answer
            assert b"headers did not arrive within the limit of 1.5 s" in answer and 1.0 < waited < 4.0, waited
            # the idle ones were closed by then too (the first opened ~1.5 s ago)
            assert all(_closed_by_server(s, 2.0) == b"" for s in idle[:20])
        finally:
            for s in idle:
                s.close()


def test_connections_beyond_the_bound_close_the_longest_idle(shapes):
    index = Index.load(shapes["index_dir"])
    with serve_in_thread(create_app(index, default_k=4), max_connections=50) as url:
        idle = _idle_sockets(url, 120)
        try:
            assert all(s == 200 for s, _ in _timed_info(url, 3))
            closed = [_closed_by_server(s, 0.05) == b"" for s in idle]
            assert sum(closed) >= 70 and all(closed[:60]) and not any(closed[-40:]), closed
        finally:
            for s in idle:
                s.close()


def test_when_every_connection_is_busy_a_new_one_gets_503(shapes):
    index = Index.load(shapes["index_dir"])
    with serve_in_thread(create_app(index, default_k=4, timeout_s=3), max_connections=2) as url:
        busy = _idle_sockets(url, 2)
        try:
            for s in busy:  # headers complete, the body never comes: requests under way
                s.sendall(b"POST /search HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: multipart/form-data; "
                          b"boundary=x\r\nContent-Length: 100000\r\n\r\n")
            time.sleep(0.3)
            status, headers, body = request(url, "GET", "/api/info")
            assert status == 503 and headers["retry-after"] == "1" and "2 connections" in json.loads(body)["error"]
        finally:
            for s in busy:
                s.close()
        # once the server has seen them close, a new connection is served again (a fixed 0.3 s
        # was a guess at when that happens on a loaded machine)
        deadline = time.monotonic() + 10
        while (status := request(url, "GET", "/api/info")[0]) == 503 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert status == 200


@pytest.mark.slow
def test_idle_sockets_and_palette_bombs_at_once_keep_memory_and_info_bounded(shapes, tmp_path):
    """Done-when of issue 32: 200 idle connections and 8 concurrent 64 KB palette + tRNS
    8192 x 8192 uploads; before, 103 idle sockets made every request 503 and the bombs took
    the server to 2.5 GB with /api/info answering in up to 989 ms."""
    bomb = small_bomb_png(8192, "palette")
    with serve_subprocess(shapes["index_dir"]) as (url, proc, output):
        idle = _idle_sockets(url, 200)
        try:
            results = []

            def upload(i):
                body, headers = multipart({"k": "3"}, {"image": (f"palette{i}.png", bomb)})
                results.append(request(url, "POST", "/search", body, headers, timeout=60))

            latencies = info_latencies_during(url, tmp_path / "stop", [partial(upload, i) for i in range(8)])
            peak = memory_kib(proc.pid)
            assert proc.poll() is None, output()
        finally:
            for s in idle:
                s.close()
    assert len(results) == 8
    for status, _, body in results:
        assert status == 413, body
        assert "(P, transparency) takes 832.0 MiB to decode, more than the limit of 64.0 MiB" in json.loads(body)["error"]
    assert len(latencies) >= 10 and all(s == 200 for s, _ in latencies)
    worst = max(dt for _, dt in latencies)
    fast = np.mean([dt < 0.1 for _, dt in latencies])
    # alone on the machine every answer is < 100 ms (bench/serve_load.py --hostile in bench/RESULTS.md);
    # this suite shares 2 cores with other jobs, so 95 % of them and none over 1 s
    assert fast >= 0.95 and worst < 1.0, f"{fast:.0%} of /api/info answers < 100 ms, worst {worst * 1000:.0f} ms"
    assert peak["VmHWM"] < 1.5 * 1024**2, peak  # KiB: under 1.5 GiB at its peak


def test_thumbnails_use_the_models_limit_and_a_cache_bounded_in_bytes(shapes, tmp_path, monkeypatch):
    d = tmp_path / "ix"
    shutil.copytree(shapes["index_dir"], d)
    index = Index.load(d)
    app = create_app(index, default_k=4)
    monkeypatch.setattr(serve_limits, "THUMB_CACHE_BYTES", 40_000)
    with serve_in_thread(app) as url:
        sizes = {}
        for size in range(16, 400, 7):
            status, headers, png = request(url, "GET", f"/thumb/{size % 8}?size={size}")
            assert status == 200 and headers["content-type"] == "image/png"
            sizes[(size % 8, size)] = len(png)
        cache = app.thumbnails
        assert 0 < sum(len(v) for v in cache.values()) <= 40_000 < sum(sizes.values())
        # least recently used out first: the newest requests are the ones kept
        newest = list(sizes)[-len(cache):]
        assert [k[1:] for k in cache] == newest
        # an indexed file replaced by a 64 KB 16-bit grey PNG of 5792 x 5792 (over 1 GB to decode before)
        victim = Path(index.paths[3])
        original = victim.read_bytes()  # the shared shapes gallery: put the image back for later tests
        victim.write_bytes(small_bomb_png(5792, "grey16"))

        def never(self):  # refused from the header: decoding any pixel of the bomb fails the test
            raise AssertionError("the bomb was decoded")

        try:
            with monkeypatch.context() as m:
                m.setattr(ImageFile.ImageFile, "load", never)
                status, _, body = request(url, "GET", "/thumb/3?size=17")
        finally:
            victim.write_bytes(original)
        assert status == 404
        assert json.loads(body)["error"] == ("image 3 of the index cannot be read (image of 5792 x 5792 pixels "
                                             "(I;16) takes 202.0 MiB to decode, more than the limit of 64.0 MiB "
                                             "(67,108,864 bytes))")


def test_cross_site_requests_are_refused(shapes, tmp_path):
    d = tmp_path / "ix"
    shutil.copytree(shapes["index_dir"], d)
    index = Index.load(d)
    query = sorted(Path(shapes["queries"]).glob("*/*.png"))[0].read_bytes()
    with serve_in_thread(create_app(index, default_k=4)) as url:
        host = url.removeprefix("http://")
        generation = lambda: json.loads(request(url, "GET", "/api/info")[2])["generation"]  # noqa: E731
        foreign = [{"Sec-Fetch-Site": "cross-site", "Origin": "http://evil.example"},
                   {"Sec-Fetch-Site": "same-site", "Origin": "http://localhost:9999"},
                   {"Origin": "http://evil.example"}, {"Origin": "null"}, {"Origin": f"http://{host}.evil.example"}]
        for headers in foreign:
            status, answer_headers, body = request(url, "POST", "/api/reload", headers=headers)
            assert status == 403 and "not to another site's page" in json.loads(body)["error"], (headers, body)
            body, form = multipart({}, {"image": ("q.png", query)})
            assert request(url, "POST", "/search", body, {**form, **headers})[0] == 403, headers
        assert generation() == 0  # no reload ran
        for path in ("/thumb/0", "/api/info"):
            assert request(url, "GET", path, headers={"Sec-Fetch-Site": "cross-site"})[0] == 403, path
        # the page itself opens from a link anywhere; the page's own requests and other clients pass
        status, headers, _ = request(url, "GET", "/", headers={"Sec-Fetch-Site": "cross-site"})
        assert status == 200 and headers["cross-origin-resource-policy"] == "same-origin"
        page = {"Sec-Fetch-Site": "same-origin", "Origin": f"http://{host}"}
        body, form = multipart({}, {"image": ("q.png", query)})
        assert request(url, "POST", "/search", body, {**form, **page})[0] == 200
        assert request(url, "GET", "/thumb/0", headers=page)[0] == 200
        assert request(url, "POST", "/api/reload", headers=page)[0] == 200 and generation() == 1
        assert request(url, "POST", "/api/reload")[0] == 200 and generation() == 2  # curl: no browser headers


def test_port_errors_are_one_line_and_come_before_the_banner(shapes, capsys):
    for port in ("-5", "70000", "65536"):
        assert cli.main(["serve", str(shapes["index_dir"]), "--port", port]) == 2
        out, err = capsys.readouterr()
        assert err.strip() == (f"deepmetric serve: error: --port {port}: a port must be an integer in 1..65535, "
                               "or 0 for a free one"), err
        assert out == ""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        assert cli.main(["serve", str(shapes["index_dir"]), "--port", str(port)]) == 2
    out, err = capsys.readouterr()
    assert err.strip() == (f"deepmetric serve: error: port {port} on 127.0.0.1 is already in use (another server?); "
                           "choose another with --port"), err
    assert "Traceback" not in err and out == ""
