"""deepmetric serve over HTTP (uvicorn on a free loopback port): the page, POST /search with the
expected neighbours, the upload bound (413), undecodable uploads (400 with a message) and
thumbnails that only serve rows of the index (no path traversal)."""
import http.client
import io
import json
import uuid
from pathlib import Path

import pytest
from PIL import Image

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")


@pytest.fixture(scope="module")
def server(serve_shapes):
    return serve_shapes(max_upload_mb=0.25, default_k=4)


def _request(url, method, path, body=None, headers=None):
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request(method, path, body=body, headers=headers or {})
    r = conn.getresponse()
    data = r.read()
    conn.close()
    return r.status, r.getheader("content-type", ""), data


def _multipart(fields: dict, files: dict):
    boundary = uuid.uuid4().hex
    parts = []
    for k, v in fields.items():
        parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode())
    for k, (name, data) in files.items():
        parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"; filename="{name}"\r\n'
                     f'Content-Type: application/octet-stream\r\n\r\n'.encode() + data + b"\r\n")
    body = b"".join(parts) + f"--{boundary}--\r\n".encode()
    return body, {"Content-Type": f"multipart/form-data; boundary={boundary}"}


def test_page_info_and_search_returns_expected_neighbours(server):
    url, shapes, index = server
    status, ctype, page = _request(url, "GET", "/")
    assert status == 200 and ctype.startswith("text/html") and b'<input type="file"' in page
    status, _, info = _request(url, "GET", "/api/info")
    assert json.loads(info)["count"] == len(index) == 32
    for q in sorted(Path(shapes["queries"]).glob("*/*_00.png")):
        body, headers = _multipart({"k": "5"}, {"image": (q.name, q.read_bytes())})
        status, ctype, data = _request(url, "POST", "/search", body, headers)
        assert status == 200 and ctype == "application/json", data
        out = json.loads(data)
        assert out["k"] == 5 and out["query"] == q.name
        assert [n["class_name"] for n in out["neighbours"]] == [q.parent.name] * 5
        # same answer as the library
        sims, idx = index.search(str(q), k=5)
        assert [n["id"] for n in out["neighbours"]] == list(idx[0])
        assert [n["cosine"] for n in out["neighbours"]] == pytest.approx(list(sims[0]), abs=1e-5)
        assert all(n["thumbnail"] == f"/thumb/{n['id']}" for n in out["neighbours"])
    # k past the index's 32 images: every image, and "k" says how many (it said 100)
    body, headers = _multipart({"k": "100"}, {"image": (q.name, q.read_bytes())})
    out = json.loads(_request(url, "POST", "/search", body, headers)[2])
    assert out["k"] == len(out["neighbours"]) == 32


def test_upload_bounds_and_bad_images(server):
    url, shapes, _ = server
    big = bytes(300 * 1024)
    body, headers = _multipart({}, {"image": ("big.png", big)})
    status, _, data = _request(url, "POST", "/search", body, headers)
    assert status == 413 and b"larger than the limit" in data
    # a chunked body without Content-Length is cut off while streaming
    def chunks():
        for a in range(0, len(body), 10 * 1024):
            yield body[a:a + 10 * 1024]
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("POST", "/search", body=chunks(), headers={**headers, "Transfer-Encoding": "chunked"},
                 encode_chunked=True)
    r = conn.getresponse()
    assert r.status == 413
    conn.close()
    body, headers = _multipart({}, {"image": ("notes.png", b"this is text, not a picture")})
    status, _, data = _request(url, "POST", "/search", body, headers)
    assert status == 400 and "notes.png: not an image" in json.loads(data)["error"]
    png = io.BytesIO()
    Image.new("RGB", (40, 40), (200, 30, 30)).save(png, "PNG")
    truncated = png.getvalue()[:-40]
    body, headers = _multipart({}, {"image": ("cut.png", truncated)})
    assert _request(url, "POST", "/search", body, headers)[0] == 400
    # a 1 KB PNG claiming 8000 x 8000 pixels (IHDR patched, CRC recomputed) is refused undecoded
    import struct
    import zlib
    raw = bytearray(png.getvalue())
    raw[16:24] = struct.pack(">II", 8000, 8000)
    raw[29:33] = struct.pack(">I", zlib.crc32(bytes(raw[12:29])))
    body, headers = _multipart({}, {"image": ("bomb.png", bytes(raw))})
    status, _, data = _request(url, "POST", "/search", body, headers)
    assert status == 413 and json.loads(data)["error"].startswith(
        "bomb.png: image of 8000 x 8000 pixels (RGB) takes 244.1 MiB to decode, more than the limit of 64.0 MiB")
    raw[16:24] = struct.pack(">II", 30000, 30000)  # past Pillow's own limit: its message answered
    raw[29:33] = struct.pack(">I", zlib.crc32(bytes(raw[12:29])))
    body, headers = _multipart({}, {"image": ("huge.png", bytes(raw))})
    status, _, data = _request(url, "POST", "/search", body, headers)
    assert status == 413 and json.loads(data)["error"].startswith(
        "huge.png: image of 30000 x 30000 pixels (RGB) takes 3,433.2 MiB to decode, more than the limit of 64.0 MiB")
    for k, error in [("0", "k must lie in 1..100, got 0"), ("-1", "k must lie in 1..100, got -1"),
                     ("101", "k must lie in 1..100, got 101"), ("99999999", "k must lie in 1..100, got 99999999"),
                     ("five", "k must be an integer in 1..100, got 'five'")]:  # '-1' was 'must be an integer'
        body, headers = _multipart({"k": k}, {"image": ("ok.png", png.getvalue())})
        status, _, data = _request(url, "POST", "/search", body, headers)
        assert status == 400 and json.loads(data)["error"] == error, (k, data)
    body, headers = _multipart({}, {"other": ("ok.png", png.getvalue())})
    assert _request(url, "POST", "/search", body, headers)[0] == 400
    assert _request(url, "POST", "/search", png.getvalue(), {"Content-Type": "image/png"})[0] == 415


def test_thumbnails_only_serve_rows_of_the_index(server):
    url, shapes, index = server
    status, ctype, data = _request(url, "GET", "/thumb/5")
    assert status == 200 and ctype == "image/png"
    im = Image.open(io.BytesIO(data))
    assert max(im.size) == 160
    secret = Path(shapes["base"]) / "secret.png"
    Image.new("RGB", (8, 8)).save(secret)
    for path in ["/thumb/../../etc/passwd", "/thumb/..%2F..%2Fetc%2Fpasswd", "/thumb/%2Fetc%2Fpasswd",
                 "/thumb//etc/passwd", f"/thumb/{secret}", "/thumb/-1", "/thumb/32", "/thumb/99999999999",
                 "/thumb/abc", "/thumb/1.png", "/../etc/passwd", "/thumb/0/../../secret.png",
                 "/static/../../etc/passwd"]:
        status, _, data = _request(url, "GET", path)
        assert status == 404, (path, status, data[:100])
        assert b"root:" not in data and not data.startswith(b"\x89PNG")


def test_serve_command_binds_loopback_and_answers(server):
    """``deepmetric serve`` itself, in a subprocess: binds 127.0.0.1 by default and serves; with
    ``--port 0`` on the free port its banner names."""
    import os

    from serving import serve_subprocess

    _, shapes, _ = server
    with serve_subprocess(shapes["index_dir"], host=None) as (url, proc, output):
        status, _, data = _request(url, "GET", "/api/info")
        assert status == 200 and json.loads(data)["count"] == 32
        host, port = url.removeprefix("http://").rsplit(":", 1)
        assert host == "127.0.0.1"
        # listening sockets on the port (Linux /proc/net/tcp[6]: local address hex, state 0A = LISTEN)
        listening = []
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            if os.path.exists(table):
                for line in open(table).read().splitlines()[1:]:
                    local, state = line.split()[1], line.split()[3]
                    if state == "0A" and int(local.split(":")[1], 16) == int(port):
                        listening.append(local.split(":")[0])
        assert listening == ["0100007F"]  # 127.0.0.1 only
