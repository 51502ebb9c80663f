"""The tune's report.html fits a 1280 px window (issue 32, item 17: the trials table of a real
tune, bench/studies/emoji_fair/tunes/LN, ran off the page): measured in headless Chromium."""
import csv
from pathlib import Path

from browser import open_page, requires_chromium
from deepmetric.report.tune_report import write_tune_report

pytestmark = requires_chromium
TRIALS = Path(__file__).resolve().parents[2] / "bench" / "studies" / "emoji_fair" / "tunes" / "LN" / "trials.csv"


def _rows():
    def value(v):
        try:
            return float(v)
        except ValueError:
            return v or None
    return [{k: value(v) for k, v in r.items()} for r in csv.DictReader(open(TRIALS, encoding="utf-8"))]


def test_the_tune_tables_fit_1280_px(tmp_path):
    rows = _rows()
    assert len(rows[0]) >= 20  # the wide case: 3 parameters, 10 test metrics, run_dir
    path = write_tune_report(tmp_path / "report.html", title="Tune LN", summary=[("recipe", "r.yaml")], rows=rows,
                             plots={})
    with open_page(path.as_uri(), width=1280) as (page, errors):
        page_width = page.evaluate("document.documentElement.scrollWidth")
        rights = page.evaluate("[...document.querySelectorAll('table')].map(t => t.getBoundingClientRect().right)")
        scrolls = page.evaluate("[...document.querySelectorAll('div.wide')].map(d => d.scrollWidth - d.clientWidth)")
        tables = page.evaluate("document.querySelectorAll('table.metrics').length")
    assert errors == []
    assert page_width <= 1280 and max(rights) <= 1280, (page_width, rights)
    assert scrolls and max(scrolls) == 0  # fits without its scroll box
    assert tables == 1  # the search only: a tune's page shows no test metric (issue 30)
    html = path.read_text()
    assert html[html.rindex("<table class=\"metrics\">"):].count("<tr>") == 1 + len(rows)  # the trials table
    assert any(k.startswith("test/") for k in rows[0])  # the old storage's test columns ...
    assert "<th>test" not in html  # ... are never shown
