"""Building blocks of the one-file HTML run report (``report.html``).

Plain string building with :func:`html.escape` everywhere user text (class names, config
values, file names) enters the page. Figures and thumbnails are embedded as base64
``data:`` URIs, so the page is one self-contained file that opens from disk (``file://``)
with no server, no script and nothing fetched.
"""
from __future__ import annotations

import base64
import html
import io
import math
from pathlib import Path
from typing import Any, Iterable, Sequence

__all__ = ["HtmlPage", "data_uri", "image_data_uri", "metrics_table", "esc", "METRIC_ORDER",
           "order_metric_keys", "format_metric"]

METRIC_ORDER = ("map@r", "r_precision", "nmi", "f1", "top1", "mean_per_class")


def esc(v: Any) -> str:
    return html.escape(str(v), quote=True)


def data_uri(data: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"


def png_file_uri(path: str | Path) -> str:
    return data_uri(Path(path).read_bytes(), "image/png")


def image_data_uri(img, size: int = 96) -> str:
    """A PIL image scaled so its longer side is ``size`` pixels (nearest-neighbour when
    enlarging small glyphs, so pixels stay sharp), as a PNG (grayscale / small) or JPEG
    data URI."""
    from PIL import Image

    w, h = img.size
    scale = size / max(w, h, 1)
    new = (max(1, round(w * scale)), max(1, round(h * scale)))
    resample = Image.NEAREST if scale > 1 else Image.BICUBIC
    img = img.resize(new, resample)
    buf = io.BytesIO()
    if img.mode in ("L", "1", "P") or max(w, h) <= 64:
        img.save(buf, format="PNG", optimize=True)
        return data_uri(buf.getvalue(), "image/png")
    img.convert("RGB").save(buf, format="JPEG", quality=85)
    return data_uri(buf.getvalue(), "image/jpeg")


def order_metric_keys(keys: Iterable[str]) -> list[str]:
    """Recall@K by K, then MAP@R, R-Precision, NMI, F1, accuracies, then the rest."""
    keys = list(dict.fromkeys(keys))

    def rank(k: str):
        if k.startswith("recall@") and k[7:].isdigit():
            return (0, int(k[7:]), k)
        if k in METRIC_ORDER:
            return (1, METRIC_ORDER.index(k), k)
        return (2, 0, k)

    return sorted(keys, key=rank)


def format_metric(key: str, v: Any) -> str:
    """Fractions of known metrics as percentages with 2 decimals; other numbers as they are."""
    if v is None or isinstance(v, bool):
        return "-"
    if isinstance(v, (int, float)):
        v = float(v)
        if not math.isfinite(v):
            return "-"
        is_fraction = key.startswith("recall@") or key in METRIC_ORDER
        if is_fraction and 0.0 <= v <= 1.0:
            return f"{100 * v:.2f}"
        return f"{v:.4g}"
    return esc(v)


_SPLIT_BADGE = {"val": "val", "validation": "val", "test": "test", "train": "train"}


def split_badge(split: Any) -> str:
    if split is None or split == "":
        return ""
    cls = _SPLIT_BADGE.get(str(split).lower(), "other")
    return f'<span class="badge {cls}">{esc(split)}</span>'


def metrics_table(rows: Sequence[dict], *, caption: str | None = None, best: bool = False,
                  table_id: str | None = None) -> str:
    """``rows``: ``{"label": html, "split": str | None, "kind": "eval" | "baseline" | ...,
    "metrics": {key: value}}``. Metric columns are the union of the rows' keys, ordered by
    :func:`order_metric_keys`. With ``best`` the highest value of each column among the
    rows of each split is marked (validation and test separately)."""
    keys = order_metric_keys(k for r in rows for k, v in r["metrics"].items()
                             if isinstance(v, (int, float)) and not isinstance(v, bool))
    best_at: dict[tuple, int] = {}
    if best:
        for k in keys:
            for s in {r.get("split") for r in rows}:
                cand = [(float(r["metrics"][k]), i) for i, r in enumerate(rows)
                        if r.get("split") == s and r.get("kind", "eval") == "eval"
                        and isinstance(r["metrics"].get(k), (int, float))
                        and math.isfinite(float(r["metrics"][k]))]
                if len(cand) > 1:
                    best_at[(k, s)] = max(cand, key=lambda t: (t[0], -t[1]))[1]
    out = [f'<p class="note">{caption}</p>'] if caption else []
    out.append(f'<table class="metrics"{f" id={chr(34)}{esc(table_id)}{chr(34)}" if table_id else ""}>')
    out.append("<thead><tr><th></th><th>split</th>" + "".join(f"<th>{esc(k)}</th>" for k in keys)
               + "</tr></thead><tbody>")
    for i, r in enumerate(rows):
        kind = r.get("kind", "eval")
        cells = []
        for k in keys:
            txt = format_metric(k, r["metrics"].get(k))
            mark = best_at.get((k, r.get("split"))) == i
            cells.append(f'<td class="best">{txt}*</td>' if mark else f"<td>{txt}</td>")
        out.append(f'<tr class="{esc(kind)}" data-split="{esc(r.get("split") or "")}">'
                   f'<th>{r["label"]}</th><td>{split_badge(r.get("split"))}</td>' + "".join(cells) + "</tr>")
    out.append("</tbody></table>")
    return "\n".join(out)


_CSS = """
:root { --ok: #1a9641; --bad: #d7191c; --muted: #666; --line: #ddd; }
* { box-sizing: border-box; }
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", "Noto Sans", "DejaVu Sans", sans-serif;
       margin: 0; color: #222; background: #fafafa; }
header { background: #243447; color: #fff; padding: 14px 24px; }
header h1 { margin: 0; font-size: 20px; }
header p { margin: 4px 0 0; color: #cfd8e3; }
nav { background: #fff; border-bottom: 1px solid var(--line); padding: 6px 24px; position: sticky; top: 0; z-index: 2;
      display: flex; flex-wrap: wrap; gap: 2px 14px; }
nav a { color: #245; text-decoration: none; font-size: 13px; white-space: nowrap; }
main { padding: 8px 24px 40px; max-width: 1400px; }
section { background: #fff; border: 1px solid var(--line); border-radius: 6px; padding: 10px 16px 14px; margin: 14px 0; }
h2 { font-size: 17px; margin: 4px 0 10px; }
h3 { font-size: 14px; margin: 12px 0 6px; }
p.note { color: var(--muted); margin: 4px 0 8px; }
ul.warnings li { color: #8a4b00; }
div.wide { overflow-x: auto; max-width: 100%; }
table { border-collapse: collapse; margin: 6px 0 10px; font-size: 13px; }
th, td { border: 1px solid var(--line); padding: 3px 8px; text-align: right; }
thead th { background: #f0f3f7; }
tbody th { text-align: left; font-weight: normal; }
caption { text-align: left; color: var(--muted); padding: 2px 0; }
table.kv td { text-align: left; }
td.best { font-weight: bold; }
tr.baseline { background: #f7f7f2; font-style: italic; }
.badge { display: inline-block; padding: 0 6px; border-radius: 8px; font-size: 11px; color: #fff; background: #888; }
.badge.val { background: #e08a00; } .badge.test { background: #2b6cb0; } .badge.train { background: #4a8a4a; }
figure.plot { margin: 8px 0; }
figure.plot img { max-width: 100%; height: auto; border: 1px solid var(--line); }
figure.plot figcaption { color: var(--muted); font-size: 12px; }
.grid { display: flex; flex-direction: column; gap: 6px; }
.row { display: flex; gap: 6px; align-items: flex-start; padding: 4px; border-bottom: 1px solid #eee; }
.tile { margin: 0; width: 104px; flex: none; text-align: center; font-size: 11px; }
.tile .img { width: 104px; height: 104px; display: flex; align-items: center; justify-content: center;
             border: 4px solid #bbb; background: #f4f4f4; overflow: hidden; }
.tile img { max-width: 96px; max-height: 96px; display: block; image-rendering: auto; }
.tile.query .img { border-color: #243447; }
.tile.hit .img { border-color: var(--ok); }
.tile.miss .img { border-color: var(--bad); }
.tile.pred .img { border-color: #e08a00; }
.tile figcaption { margin-top: 2px; overflow-wrap: anywhere; line-height: 1.2; }
.tile.hit figcaption b { color: var(--ok); } .tile.miss figcaption b { color: var(--bad); }
.tile .noimg { color: var(--muted); font-size: 11px; padding: 4px; }
.sep { width: 10px; flex: none; border-left: 2px dashed #ccc; align-self: stretch; }
.pairs { display: flex; flex-wrap: wrap; gap: 10px; }
.pair { display: flex; gap: 4px; border: 1px solid var(--line); padding: 4px; border-radius: 4px; }
details pre { background: #f6f8fa; padding: 8px; overflow: auto; max-height: 420px; font-size: 12px; }
"""


class HtmlPage:
    """Sections of one page; :meth:`write` adds a navigation bar and the stylesheet."""

    def __init__(self, title: str, subtitle: str = ""):
        self.title = title
        self.subtitle = subtitle
        self.sections: list[tuple[str, str, str]] = []

    def add(self, section_id: str, heading: str, body: str, nav: str | None = None) -> None:
        """One ``<section id=section_id>``; ``nav`` is its (short) link text in the bar."""
        self.sections.append((section_id, heading, body, nav or heading))

    def render(self) -> str:
        nav = "".join(f'<a href="#{esc(i)}">{esc(n)}</a>' for i, _, _, n in self.sections)
        body = "\n".join(f'<section id="{esc(i)}"><h2>{esc(h)}</h2>\n{b}\n</section>'
                         for i, h, b, _ in self.sections)
        sub = f"<p>{esc(self.subtitle)}</p>" if self.subtitle else ""
        return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
                f'<meta name="viewport" content="width=device-width, initial-scale=1">'
                f"<title>{esc(self.title)}</title><style>{_CSS}</style></head>\n"
                f"<body><header><h1>{esc(self.title)}</h1>{sub}</header>\n<nav>{nav}</nav>\n"
                f"<main>\n{body}\n</main></body></html>\n")

    def write(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(self.render(), encoding="utf-8")
        return path


def figure(png_path: str | Path, caption: str, alt: str) -> str:
    return (f'<figure class="plot"><img src="{png_file_uri(png_path)}" alt="{esc(alt)}">'
            f"<figcaption>{caption}</figcaption></figure>")


def kv_table(rows: Iterable[tuple[str, Any]]) -> str:
    return ('<table class="kv"><tbody>' + "".join(
        f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in rows if v is not None)
        + "</tbody></table>")

