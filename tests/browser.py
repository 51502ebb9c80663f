"""Shared helpers for tests that drive a web page: a uvicorn server in a thread on a free
loopback port, and a headless Chromium page through Playwright for Python (the system
``chromium``; Playwright's own browser download is never used).

    with serve_in_thread(app) as url: ...
    def test_x(browser_page): browser_page.goto(url) ...   # fixture: a fresh page per test

``browser_page`` records console errors and failed requests in ``page.console_errors`` /
``page.failed_requests``; :func:`broken_images` lists the <img> elements that failed to load.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import socket
import threading
import time

import pytest

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run"]


def chromium_path() -> str | None:
    for p in (os.environ.get("DEEPMETRIC_CHROMIUM"), "/usr/bin/chromium", shutil.which("chromium"),
              shutil.which("chromium-browser")):
        if p and os.path.isfile(p):
            return p
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_in_thread(app, host: str = "127.0.0.1"):
    """Run an ASGI app with uvicorn in a daemon thread; yields its base URL."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
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


@pytest.fixture
def browser_page():
    """A Playwright page in headless system Chromium (skipped when chromium is not installed)."""
    path = chromium_path()
    if path is None:
        pytest.skip("chromium is not installed (install.sh installs the Debian package)")
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=path, headless=True, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.console_errors = []
        page.failed_requests = []
        page.on("console", lambda m: m.type == "error" and page.console_errors.append(m.text))
        page.on("pageerror", lambda e: page.console_errors.append(str(e)))
        page.on("requestfailed", lambda r: page.failed_requests.append(r.url))
        try:
            yield page
        finally:
            browser.close()


def broken_images(page) -> list[str]:
    """The src of every <img> on the page that has not loaded (complete with naturalWidth 0)."""
    return page.evaluate(
        "() => [...document.images].filter(i => !i.complete || i.naturalWidth === 0).map(i => i.src)")
