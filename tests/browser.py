"""Headless Chromium for the browser tests (the report page, the served search page).

Drives Debian's ``/usr/bin/chromium`` (installed by install.sh) through Playwright for
Python; nothing is downloaded (never ``playwright install``). Tests use::

    from browser import open_page, requires_chromium

    @requires_chromium
    def test_page(tmp_path):
        with open_page(path.as_uri()) as (page, errors):
            ...                       # page: a playwright Page, already loaded
        assert errors == []           # console errors, page errors, failed requests

When chromium or Playwright is missing, the tests are skipped with a loud reason (a
``BROWSER TESTS SKIPPED`` line in the pytest summary); install.sh installs both, so in CI
they run.
"""
from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Iterator

import pytest

CHROMIUM = os.environ.get("DEEPMETRIC_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run", "--disable-sync",
                 "--disable-dev-shm-usage"]


def _missing() -> str | None:
    if not (Path(CHROMIUM).is_file() and os.access(CHROMIUM, os.X_OK)) and not shutil.which(CHROMIUM):
        return f"{CHROMIUM} not found (install.sh installs Debian's chromium)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright package is missing (pip install -e '.[dev]')"
    return None


_WHY = _missing()
requires_chromium = pytest.mark.skipif(
    _WHY is not None, reason=f"BROWSER TESTS SKIPPED: {_WHY}; run bash install.sh")


@contextlib.contextmanager
def open_page(url: str, *, width: int = 1280, height: int = 900, wait_until: str = "load",
              timeout_ms: int = 30_000) -> Iterator[tuple[object, list[str]]]:
    """Open ``url`` in a fresh headless Chromium and yield ``(page, errors)``.

    ``errors`` collects, while the page lives: console messages of type ``error``, uncaught
    page exceptions and failed requests (each as one line of text).
    """
    from playwright.sync_api import sync_playwright

    errors: list[str] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": width, "height": height})
            page.set_default_timeout(timeout_ms)
            page.on("console", lambda m: errors.append(f"console.{m.type}: {m.text}")
                    if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(f"page error: {e}"))
            page.on("requestfailed", lambda r: errors.append(
                f"request failed: {r.url[:120]} ({r.failure})"))
            page.goto(url, wait_until=wait_until)
            yield page, errors
        finally:
            browser.close()


def broken_images(page) -> list[str]:
    """``src`` (first 80 characters) of every ``<img>`` that did not load (naturalWidth 0)."""
    return page.eval_on_selector_all(
        "img", "els => els.filter(e => !e.complete || e.naturalWidth === 0)"
               ".map(e => (e.getAttribute('src') || '').slice(0, 80))")
