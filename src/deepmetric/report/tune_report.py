"""The HTML page of a tune (``deepmetric tune``, :mod:`deepmetric.workflows.tune`): its set-up,
the best trial, Optuna's optimisation-history and parameter-importance plots and the table of
every trial (state, parameters, validation value, wall time; no test metric: trials never
evaluate the test split, and any ``test``-named column is dropped here too).  One self-contained file, like the run report."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from . import page as pg

__all__ = ["write_tune_report"]


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _header(name: str) -> str:
    """A column name that may wrap after its dots, slashes and underscores (``optim.<wbr>lr``)."""
    out = pg.esc(name)
    for sep in (".", "/", "_"):
        out = out.replace(sep, sep + "<wbr>")
    return out


def _table(rows: Sequence[dict], cols: Sequence[str], names: Sequence[str] | None = None) -> str:
    head = "".join(f"<th>{_header(n)}</th>" for n in (names or cols))
    body = "".join("<tr>" + "".join(f"<td>{pg.esc(_cell(r.get(c)))}</td>" for c in cols) + "</tr>" for r in rows)
    # a scroll box of its own, so that a very wide table never widens the page
    return f'<div class="wide"><table class="metrics"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>'


def _tables(rows: Sequence[dict]) -> str:
    """The trials in one table that fits a 1280 px window (state, parameters, validation
    objective, epochs, time).  No test metric is ever shown: a tune chooses on validation, and
    a column of an older storage named ``test...`` is dropped (issue 30)."""
    cols = [c for c in dict.fromkeys(k for r in rows for k in r) if c != "run_dir" and not c.lower().startswith("test")]
    return _table(rows, cols)


def write_tune_report(path: str | Path, *, title: str, summary: Sequence[tuple[str, Any]], rows: Sequence[dict],
                      plots: dict[str, Path], notes: Sequence[str] = ()) -> Path:
    """Write ``path`` (report.html of a tune directory) and return it."""
    page = pg.HtmlPage(title, "hyper-parameter search on validation classes (deepmetric tune)")
    page.add("summary", "Set-up and best trial", pg.kv_table(summary))
    figs = []
    if "optimization_history" in plots:
        figs.append(pg.figure(plots["optimization_history"], "Optimisation history (Optuna): each finished "
                              "trial's validation objective and the best so far.", "optimisation history"))
    if "param_importances" in plots:
        figs.append(pg.figure(plots["param_importances"], "Parameter importances (Optuna's fANOVA) of the "
                              "validation objective over the finished trials.", "parameter importances"))
    body = "".join(figs) + "".join(f'<p class="note">{pg.esc(n)}</p>' for n in notes)
    page.add("plots", "Plots", body or '<p class="note">no plot yet (fewer than 2 finished trials)</p>')
    page.add("trials", "Trials", '<p class="note">val/ = the objective (validation, the trial\'s best '
             'evaluation); the trials never evaluated the test split.</p>' + (_tables(rows) if rows else "<p>no trial yet</p>"))
    return page.write(Path(path))
