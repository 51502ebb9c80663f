"""The served search page in headless Chromium: it loads without console errors, a query
uploaded through the file input shows the expected neighbours, and every image loads.
Screenshots go to ``$DEEPMETRIC_SCREENSHOTS`` when set (look at them), else to tmp_path."""
import os
from pathlib import Path

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from browser import broken_images, open_page, requires_chromium  # noqa: E402


@pytest.fixture(scope="module")
def served(serve_shapes):
    return serve_shapes(default_k=6)


def _shot(tmp_path, name) -> str:
    d = Path(os.environ.get("DEEPMETRIC_SCREENSHOTS") or tmp_path)
    d.mkdir(parents=True, exist_ok=True)
    return str(d / name)


@requires_chromium
def test_search_page_in_chromium(served, tmp_path):
    url, shapes, index = served
    with open_page(url + "/") as (page, errors):
        page.wait_for_function("document.getElementById('info').textContent.includes('32 images')")
        page.screenshot(path=_shot(tmp_path, "search_page_empty.png"), full_page=True)
        for cls in ("red_disc", "green_triangle"):
            query = Path(shapes["queries"]) / cls / f"{cls}_01.png"
            page.set_input_files("#file", str(query))
            page.wait_for_function(f"document.getElementById('status').textContent === '6 nearest neighbours of {query.name}'"
                                   " && document.querySelectorAll('.card[data-rank]').length === 6")
            labels = page.eval_on_selector_all(".card[data-rank]", "cs => cs.map(c => c.dataset.label)")
            ranks = page.eval_on_selector_all(".card[data-rank]", "cs => cs.map(c => +c.dataset.rank)")
            assert labels == [cls] * 6 and ranks == [1, 2, 3, 4, 5, 6]
            # the page shows what the library finds
            _, idx = index.search(str(query), k=6)
            srcs = page.eval_on_selector_all(".card[data-rank] img", "is => is.map(i => i.getAttribute('src'))")
            assert srcs == [f"/thumb/{i}" for i in idx[0]]
            page.wait_for_function("[...document.images].every(i => i.complete)")
            assert broken_images(page) == []
            sizes = page.eval_on_selector_all("img", "is => is.map(i => [i.naturalWidth, i.clientWidth])")
            assert len(sizes) == 7 and all(w > 0 and cw > 100 for w, cw in sizes)
            page.screenshot(path=_shot(tmp_path, f"search_page_{cls}.png"), full_page=True)
        assert page.is_hidden("#error")
    assert errors == []


@requires_chromium
def test_search_page_shows_upload_errors(served, tmp_path):
    url, _, _ = served
    bad = tmp_path / "notes.png"
    bad.write_text("not an image")
    with open_page(url + "/") as (page, errors):
        page.set_input_files("#file", str(bad))
        page.wait_for_selector("#error", state="visible")
        assert "notes.png: not an image" in page.inner_text("#error")
        page.screenshot(path=_shot(tmp_path, "search_page_error.png"), full_page=True)
    # the only console message is the browser's note on the 400 answer itself
    assert len(errors) == 1 and "status of 400" in errors[0], errors
