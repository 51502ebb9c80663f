"""Run an ASGI app (``deepmetric serve``'s) with uvicorn in a thread, or ``deepmetric serve`` in a
subprocess, on a free loopback port the server binds itself (no port chosen first that another
process could take)."""
from __future__ import annotations

import contextlib
import threading
import time


@contextlib.contextmanager
def serve_in_thread(app, host: str = "127.0.0.1", **limits):
    """Serve ``app`` in a daemon thread with deepmetric serve's uvicorn server (its connection
    ``limits``: header_timeout_s, max_connections); yields its base URL and stops the server
    afterwards."""
    from deepmetric.search.connections import make_server

    from deepmetric.search.connections import bind

    sock = bind(host, 0)  # bound here, before the server starts: no other process can take the port meanwhile
    port = sock.getsockname()[1]
    server = make_server(app, host, port, **limits)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started:
        if time.time() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.05)
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def request(url, method, path, body=None, headers=None, timeout=60):
    """One HTTP request: ``(status, headers dict (lower-case names), body bytes)``."""
    import http.client

    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def multipart(fields: dict, files: dict, content_type: str = "multipart/form-data"):
    """A multipart body: ``files`` maps a field to ``(file name as str or bytes, data)``."""
    import uuid

    boundary = uuid.uuid4().hex
    parts = []
    for k, v in fields.items():
        parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode())
    for k, (name, data) in files.items():
        raw = name if isinstance(name, bytes) else name.encode()
        parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"; filename="'.encode() + raw
                     + b'"\r\nContent-Type: application/octet-stream\r\n\r\n' + data + b"\r\n")
    body = b"".join(parts) + f"--{boundary}--\r\n".encode()
    return body, {"Content-Type": f"{content_type}; boundary={boundary}"}


def memory_kib(pid: int) -> dict:
    """``VmRSS`` (now) and ``VmHWM`` (peak) of a Linux process, in KiB."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                out[line.split(":")[0]] = int(line.split()[1])
    return out


@contextlib.contextmanager
def serve_subprocess(index_dir, *args, host: str | None = "127.0.0.1", start_timeout: float = 180,
                     sigint_ignored: bool = False):
    """``deepmetric serve INDEX_DIR --port 0 *args`` in a subprocess (``--host host`` unless
    ``host`` is None: serve's default); yields ``(url, proc, output)``, the URL read from the
    banner (the port the server itself bound: no race with other processes for a port chosen
    first), where ``output()`` returns what it printed so far (after it stops: everything).
    Stops it with SIGTERM."""
    import os
    import re
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1] / "src"),
                                                         os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    log = tempfile.TemporaryFile("w+")
    # sigint_ignored: start it as a script's background job starts (SIGINT inherited ignored)
    launch = (["-c", "import signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
                     "from deepmetric.cli import main; sys.exit(main(sys.argv[1:]))"]
              if sigint_ignored else ["-m", "deepmetric.cli"])
    proc = subprocess.Popen([sys.executable, *launch, "serve", str(index_dir),
                             *(["--host", host] if host is not None else []), "--port", "0", *args],
                            env=env, stdout=log, stderr=subprocess.STDOUT, text=True)

    def output() -> str:
        log.flush()
        log.seek(0)
        return log.read()

    try:
        deadline = time.time() + start_timeout
        url = None
        while True:
            banner = re.search(r"^deepmetric serve: .* on (http://\S+):(\d+)/ ", output(), re.M)
            if banner:  # printed once the socket listens
                url = f"{banner[1]}:{banner[2]}"
                try:
                    if request(url, "GET", "/api/info", timeout=5)[0] == 200:
                        break
                except OSError:
                    pass
            if time.time() > deadline or proc.poll() is not None:
                raise AssertionError(f"deepmetric serve did not start: {output()}")
            time.sleep(0.3)
        yield url, proc, output
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)
        log.close()


def _poller_program() -> str:
    """bench/serve_load.py's ``POLLER``: a program that times ``GET /api/info`` from a process of
    its own (in the test's process the upload threads would hold the GIL and add their own
    delays to the measurement), every 20 ms until the stop file exists or 120 s have passed,
    then prints the latencies as JSON. One program for the bench and the tests."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("serve_load", Path(__file__).parents[1] / "bench" / "serve_load.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.POLLER


def info_latencies_during(url, stop, jobs, join_timeout: float = 60) -> list:
    """Run ``jobs`` (callables, each in a thread of its own, all at once) while ``GET /api/info``
    of the server at ``url`` is polled from a separate process; ``[status, seconds]`` of every
    answer. The poller stops when the file ``stop`` is created, once the jobs are done."""
    import json
    import subprocess
    import sys
    import threading

    host, port = url.removeprefix("http://").rsplit(":", 1)
    poller = subprocess.Popen([sys.executable, "-c", _poller_program(), host, port, str(stop)], stdout=subprocess.PIPE,
                              text=True)
    threads = [threading.Thread(target=job) for job in jobs]
    time.sleep(0.3)  # a few answers before the jobs start
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=join_timeout)
    time.sleep(0.3)  # and a few after they end
    stop.touch()
    return json.loads(poller.communicate(timeout=60)[0])
