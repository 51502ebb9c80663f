"""Showing search results: a text table, JSON, a self-contained HTML grid of thumbnails, and
the thumbnails themselves (PNG bytes, also served by ``deepmetric serve``)."""
from __future__ import annotations

import base64
import html
import io
import json
import unicodedata
from pathlib import Path

from PIL import Image

__all__ = ["results_text", "results_json", "query_answer", "results_html", "thumbnail_png", "displayable"]


def thumbnail_png(path: str | Path, size: int = 160, max_bytes: int | None = None) -> bytes:
    """PNG bytes of the image at ``path`` scaled to fit ``size`` x ``size`` (small images are
    enlarged with nearest-neighbour so 32-pixel glyphs stay sharp). Read with the decoder
    queries use (EXIF orientation, 8 bits, transparency onto white; grey stays grey), under
    the decode limit ``max_bytes`` (``deepmetric serve``: the model's, as for queries)."""
    from deepmetric.data.decode import decode_image

    im = decode_image(path, mode=None, max_bytes=max_bytes)
    scale = size / max(im.size)
    new = (max(1, round(im.width * scale)), max(1, round(im.height * scale)))
    im = im.resize(new, Image.NEAREST if scale > 1 else Image.LANCZOS)
    buf = io.BytesIO()
    im.save(buf, "PNG")
    return buf.getvalue()


def _width(text: str) -> int:
    """Terminal columns of ``text`` (East Asian wide characters take two)."""
    return sum(2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in text)


def displayable(text: str) -> str:
    """``text`` that prints as UTF-8: a file name that is not UTF-8 (lone surrogates from the OS)
    gets its undecodable bytes escaped (``caf\\xe9.png``)."""
    return str(text).encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def _shown(path: str) -> str:
    """``path`` relative to the working directory when it lies below it."""
    if not path:
        return "-"
    try:
        return displayable(str(Path(path).relative_to(Path.cwd())))
    except ValueError:
        return displayable(path)


def results_text(queries: list[str], results: list[list[dict]]) -> str:
    """One block per query: rank, cosine, class name (label) and path of every neighbour
    (relative to the working directory when below it)."""
    lines = []
    for q, rows in zip(queries, results):
        lines.append(f"query: {displayable(q)}")
        labels = [f"{r['class_name']} ({r['label']})" for r in rows]
        width = max([_width(lab) for lab in labels] + [5])
        lines.append(f"  {'rank':>4}  {'cosine':>7}  {'label':<{width}}  path")
        for r, lab in zip(rows, labels):
            pad = " " * (width - _width(lab))
            lines.append(f"  {r['rank']:>4}  {r['cosine']:>7.4f}  {lab}{pad}  {_shown(r['path'])}")
    return "\n".join(lines)


def query_answer(query: str, rows: list[dict]) -> dict:
    """One query's answer as ``search --json`` and ``serve`` give it: ``{"query", "k",
    "neighbours"}``, where ``k`` is the number of neighbours given, fewer than the k asked when
    the index holds fewer images (or an approximate index finds fewer)."""
    return {"query": displayable(query), "k": len(rows), "neighbours": rows}


def results_json(queries: list[str], results: list[list[dict]]) -> str:
    """``{"k", "queries": [query_answer, ...]}``; the top ``k`` is the most neighbours any query
    was given (the k asked, or the index's size when it holds fewer), as each query's own ``k``."""
    answers = [query_answer(q, rows) for q, rows in zip(queries, results)]
    return json.dumps({"k": max((a["k"] for a in answers), default=0), "queries": answers}, indent=1,
                      ensure_ascii=False)


def _data_uri(path: str, size: int) -> str:
    try:
        return "data:image/png;base64," + base64.b64encode(thumbnail_png(path, size)).decode()
    except (OSError, ValueError):
        return ""


def results_html(queries: list[str], results: list[list[dict]], out: str | Path, size: int = 128) -> Path:
    """Write a self-contained HTML page (thumbnails embedded as data URIs): one row per query,
    the query first, then its neighbours with rank, class name and cosine."""
    esc = html.escape
    rows = []
    for q, res in zip(queries, results):
        cells = [f'<figure class="query"><img src="{_data_uri(q, size)}" alt="query"><figcaption>'
                 f'<b>query</b><br>{esc(displayable(Path(q).name))}</figcaption></figure>']
        for r in res:
            cells.append(f'<figure><img src="{_data_uri(r["path"], size)}" alt="{esc(r["class_name"])}">'
                         f'<figcaption>#{r["rank"]} <b>{esc(r["class_name"])}</b><br>cos {r["cosine"]:.3f}'
                         f'<br><span title="{esc(r["path"])}">{esc(Path(r["path"]).name)}</span></figcaption></figure>')
        rows.append('<section class="row">' + "".join(cells) + "</section>")
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>deepmetric search results</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }}
.row {{ display: flex; flex-wrap: wrap; gap: 10px; margin-bottom: 1.5em; }}
figure {{ margin: 0; width: {size + 8}px; text-align: center; font-size: 12px; }}
figure img {{ width: {size}px; height: {size}px; object-fit: contain; background: #eee;
  border: 1px solid #ccc; image-rendering: pixelated; }}
figure.query img {{ border: 3px solid #1565c0; }}
figcaption {{ overflow-wrap: anywhere; }}
</style></head><body>
<h1>deepmetric search results</h1>
{''.join(rows)}
</body></html>
"""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page, encoding="utf-8")
    return out
