"""The sections of a run report read from its files: the configuration and ``metrics.json``
summary, the training log (curves and evaluations) and the full configuration; and the
:class:`Report` every section writes into (Markdown lines, HTML sections and figures).
The sections about embeddings are in :mod:`deepmetric.report.embedding_sections`."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from . import diagnostics as dg
from . import page as pg
from . import plots

__all__ = ["Report", "format_value", "summary_rows", "summary_section", "training_section", "full_config_section"]


@dataclass
class Report:
    """A run report being written into ``out``: ``report.md`` as lines, ``report.html`` as
    sections of ``html``, and the figures (title, PNG name in ``out``) listed at the end of
    ``report.md``."""

    out: Path
    html: pg.HtmlPage
    md: list[str] = field(default_factory=list)
    figures: list[tuple[str, str]] = field(default_factory=list)

    def write(self) -> Path:
        """Write ``report.md`` (figures listed last) and ``report.html``; the path of ``report.md``."""
        md = list(self.md)
        if self.figures:
            md += ["## Figures", ""]
            md += [f"### {title}\n\n![{title}]({name})\n" for title, name in self.figures]
        report = self.out / "report.md"
        report.write_text("\n".join(md).rstrip() + "\n", encoding="utf-8")
        self.html.write(self.out / "report.html")
        return report


def format_value(v: Any, pct: bool = True) -> str:
    """A number as the report shows it: a fraction in [0, 1] as a percentage, "-" for none."""
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    if isinstance(v, float):
        return f"{100 * v:.2f}" if pct and 0.0 <= v <= 1.0 else f"{v:.4g}"
    return str(v)


def _config_md(cfg: dict, path: Path) -> list[str]:
    lines = [f"## Configuration (`{path.name}`)", ""]
    if isinstance(cfg.get("description"), str) and cfg["description"]:
        lines += [f"> {cfg['description']}", ""]
    lines += ["| key | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in _config_rows(cfg)]
    return lines + [""]


def _config_rows(cfg: dict) -> list[tuple[str, Any]]:
    """(key, value) rows summarising a run's config: data, model, loss terms, optimiser,
    temperature schedule, length, batch (keys a config lacks are left out)."""
    def get(*keys):
        node: Any = cfg
        for k in keys:
            if not isinstance(node, dict) or k not in node:
                return None
            node = node[k]
        return node

    losses = get("loss")
    if isinstance(losses, dict):
        losses = [losses]
    loss_txt = ", ".join(
        f"{t.get('weight', 1)} x {t.get('name', '?')}" + (f" {t['options']}" if t.get("options") else "")
        for t in losses or [] if isinstance(t, dict)
    ) or "-"
    temp = get("schedule", "temperature") or {}
    rows = [
        ("name", get("name")),
        ("data", f"{get('data', 'name')} (root: {get('data', 'root')})"),
        ("model", f"{get('model', 'name')} {get('model', 'options') or ''}".strip()
         if get("model", "name") else None),
        ("loss", loss_txt),
        ("optimiser", f"{get('optim', 'name')} lr {get('optim', 'lr')}" if get("optim", "name") else None),
        ("temperature schedule", temp.get("name") if isinstance(temp, dict) else None),
        ("length", f"{get('train', 'epochs') or get('train', 'iterations')} "
                   f"{'epochs' if get('train', 'epochs') else 'iterations'}"
         if get("train", "epochs") or get("train", "iterations") else None),
        ("batch", f"{get('train', 'batch_size')} ({get('train', 'sampler')}"
                  + (f" {get('train', 'm')} x {get('train', 'n')}" if get('train', 'm') else "") + ")"
         if get("train", "batch_size") else None),
    ]
    return [(k, v) for k, v in rows if v is not None]


_METRIC_PREFIXES = ("recall@", "map@", "precision@", "r_precision", "nmi", "f1", "top1", "top5",
                    "mean_per_class", "accuracy")
_SPLIT_KEYS = ("val", "validation", "test", "train", "query", "gallery")


def _is_metric_key(k: str) -> bool:
    return isinstance(k, str) and k.startswith(_METRIC_PREFIXES)


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))


def summary_rows(summary: dict, default_split: str | None = None) -> tuple[list[dict], list[str]]:
    """Metric rows of ``metrics.json`` for :func:`page.metrics_table`, and notes.

    Reads today's keys (``metrics``: last evaluation, ``best``: the selection) and the
    split-aware ones (``final``: ``{"val": {...}, "test": {...}}``, ``selected``,
    ``baselines``: ``{name: {metrics} or {split: {metrics}}}``); any nesting of
    ``{split: {metric: value}}`` is walked, split names mark the rows. ``default_split``
    (the run's ``eval.split``) marks today's ``metrics``."""
    rows: list[dict] = []
    notes: list[str] = []

    def walk(obj: Any, label: str, split: str | None, kind: str) -> None:
        if not isinstance(obj, dict):
            return
        nums = {k: v for k, v in obj.items() if _is_metric_key(k) and _number(v)}
        scal = {k: v for k, v in obj.items()
                if not isinstance(v, (dict, list)) and not _is_metric_key(k) and k != "split"}
        own_split = obj.get("split") if isinstance(obj.get("split"), str) else split
        extra = ", ".join(f"{k} {v:g}" if _number(v) else f"{k} {v}" for k, v in scal.items())
        if extra:  # e.g. selected: {"epoch": 3, "metric": "recall@1", "val": {...}}
            label = f"{label} ({extra})"
        if nums:
            rows.append({"label": pg.esc(label), "text": label,
                         "split": own_split, "kind": kind, "metrics": nums})
        for k, v in obj.items():
            if isinstance(v, dict):
                if str(k).lower() in _SPLIT_KEYS:
                    walk(v, label, str(k), kind)
                else:
                    walk(v, f"{label}: {k}", own_split, kind)

    for key, val in summary.items():
        if key == "best" and isinstance(val, dict) and "metric" in val:
            notes.append(f"best.pt selected by {val.get('metric')} = {pg.format_metric(str(val.get('metric')), val.get('value'))}"
                         f" at epoch {val.get('epoch')}")
        elif key == "metrics":
            walk(val, "last evaluation", default_split, "eval")  # on eval.split
        elif key == "final":
            walk(val, "final", None, "eval")
        elif key == "selected":
            walk(val, "selected", None, "eval")
        elif key == "baselines":
            if isinstance(val, dict):
                for name, b in val.items():
                    if isinstance(b, dict) and isinstance(b.get("label"), str):  # {"label", "metrics"}
                        walk(b.get("metrics") or {}, f"baseline: {b['label']}", None, "baseline")
                    else:  # older files: {name: {metrics} or {split: {metrics}}}
                        walk(b, f"baseline: {name}", None, "baseline")
        elif isinstance(val, dict):
            walk(val, str(key), None, "eval")
        elif key in ("epochs", "steps") and _number(val):
            notes.append(f"{key}: {val}")
    return rows, notes


def _eval_rows(log: dg.TrainingLog, default_split: str | None) -> list[dict]:
    """Baseline records, then one row per evaluation record (split from the record)."""
    rows = []
    for b in log.baselines():  # labelled as in metrics.json, so that each baseline is listed once
        name = b.get("label") or b.get("name") or b.get("baseline") or b.get("kind") or "baseline"
        rows.append({"label": pg.esc(f"baseline: {name}"), "text": f"baseline: {name}",
                     "split": b.get("split"), "kind": "baseline",
                     "metrics": {k: v for k, v in b.items() if _is_metric_key(k) and _number(v)}})
    for rec in log.evals:
        ep = rec.get("epoch")
        label = f"epoch {ep:g}" if _number(ep) else "evaluation"
        rows.append({"label": pg.esc(label), "text": label,
                     "split": rec.get("split", default_split if len(log.splits()) == 1 else None),
                     "kind": "eval",
                     "metrics": {k: v for k, v in rec.items() if k in log.metric_keys() and _number(v)}})
    return rows


def _md_table(rows: list[dict], best: bool = False) -> list[str]:
    keys = pg.order_metric_keys(k for r in rows for k in r["metrics"])
    if not keys:
        return []
    with_split = any(r.get("split") for r in rows)
    best_at = {}
    if best:
        for k in keys:
            for sp in {r.get("split") for r in rows}:
                c = [(float(r["metrics"][k]), i) for i, r in enumerate(rows)
                     if r.get("split") == sp and r["kind"] == "eval" and _number(r["metrics"].get(k))]
                if c:
                    best_at[(k, sp)] = max(c, key=lambda t: (t[0], -t[1]))[1]
    head = ["", "split"] if with_split else [""]
    out = ["| " + " | ".join(head + keys) + " |", "|---" * (len(head) + len(keys)) + "|"]
    for i, r in enumerate(rows):
        cells = [pg.format_metric(k, r["metrics"].get(k)) + ("*" if best_at.get((k, r.get("split"))) == i else "")
                 for k in keys]
        first = [r["text"]] + ([str(r.get("split") or "")] if with_split else [])
        out.append("| " + " | ".join(first + cells) + " |")
    return out


def _log_section(log: dg.TrainingLog) -> list[str]:
    lines = ["## Training", ""]
    if log.steps:
        loss = log.column("step", "loss")
        ok = np.isfinite(loss)
        last_step = log.steps[-1]
        lines.append(f"- {len(log.steps)} logged steps"
                     + (f", last step {last_step.get('step')}, epoch {last_step.get('epoch')}"
                        if "step" in last_step else ""))
        if ok.any():
            k = max(1, int(ok.sum()) // 10)
            lines.append(f"- loss: first {loss[ok][0]:.4g}, mean of the last {k} logged steps "
                         f"{np.mean(loss[ok][-k:]):.4g}")
        alpha = log.column("step", "alpha")
        if np.isfinite(alpha).any():
            a = alpha[np.isfinite(alpha)]
            lines.append(f"- alpha: start {a[0]:.4g}, end {a[-1]:.4g}")
    else:
        lines.append("- no step records")
    keys = [k for k in log.metric_keys() if log.has("eval", k)]
    split_tagged = any(s is not None for s in log.splits())
    if log.evals and keys and not split_tagged and not log.baselines():
        # today's logs: one split, the compact table
        epoch = log.column("eval", "epoch")
        lines += ["", "Evaluations (%, best marked *):", "",
                  "| epoch | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
        best = {k: np.nanargmax(log.column("eval", k)) for k in keys}
        for i, rec in enumerate(log.evals[-20:], start=max(0, len(log.evals) - 20)):
            cells = []
            for k in keys:
                v = rec.get(k)
                cell = format_value(float(v)) if isinstance(v, (int, float)) else "-"
                cells.append(cell + ("*" if best[k] == i and cell != "-" else ""))
            ep = epoch[i]
            lines.append(f"| {int(ep) if np.isfinite(ep) else '-'} | " + " | ".join(cells) + " |")
        if len(log.evals) > 20:
            lines.append(f"\n(last 20 of {len(log.evals)} evaluations)")
    elif log.evals or log.baselines():
        lines += ["", "Evaluations (%, validation and test marked; best per split marked *):", ""]
        lines += _md_table(_eval_rows(log, None), best=True)
    return lines + [""]


def summary_section(report: Report, cfg_raw: dict | None, cfg_path: Path | None, summary: dict | None,
                    eval_split: str) -> list[dict]:
    """Configuration and summary: the config's key rows, ``metrics.json``'s tables, notes and the
    run's warnings (the verdict against the baselines among them); the baseline rows it lists."""
    body = []
    if cfg_raw is not None and cfg_path is not None:
        report.md += _config_md(cfg_raw, cfg_path)
        body.append(pg.kv_table(_config_rows(cfg_raw)))
    else:
        body.append('<p class="note">no config.yaml in the run directory</p>')
    baselines: list[dict] = []  # for the Recall@K table and curve
    if summary is not None:
        rows, notes = summary_rows(summary, eval_split)
        baselines += [r for r in rows if r["kind"] == "baseline"]
        if rows:
            body.append(pg.metrics_table(rows, caption="metrics.json (%, validation and test marked)",
                                         table_id="summary-metrics"))
            report.md += ["## Summary (`metrics.json`)", ""] + _md_table(rows) + [""]
        if notes:
            body.append("<ul>" + "".join(f"<li>{pg.esc(n)}</li>" for n in notes) + "</ul>")
            report.md += [f"- {n}" for n in notes] + [""]
        warns = [str(w) for w in summary.get("warnings") or []]
        if warns:  # the run's warnings, the verdict against the baselines among them
            body.append('<ul class="warnings">' + "".join(f"<li>warning: {pg.esc(w)}</li>" for w in warns) + "</ul>")
            report.md += ["## Warnings", ""] + [f"- {w}" for w in warns] + [""]
    report.html.add("summary", "Configuration and summary", "\n".join(body), "summary")
    return baselines


def training_section(report: Report, log_path: Path, title: str, eval_split: str,
                     log: dg.TrainingLog | None = None) -> list[dict]:
    """Evaluations during training and the training curves, from ``log`` (default: read from
    ``log_path``; a note when there is none); the baseline rows the log holds."""
    if log is None and not log_path.is_file():
        report.md += ["## Training", "", f"- no `{log_path.name}` in the run directory", ""]
        report.html.add("training", "Training curves", f'<p class="note">no {log_path.name} in the run directory</p>')
        return []
    log = log if log is not None else dg.read_training_log(log_path)
    plots.plot_training_curves(log, report.out / "training_curves.png", title=title)
    report.figures.append(("training curves", "training_curves.png"))
    report.md += _log_section(log)
    rows = _eval_rows(log, eval_split)
    if rows:
        report.html.add("metrics", "Evaluations during training", pg.metrics_table(
            rows, caption="% per evaluation; validation and test marked; the best of each "
                          "split marked *; baselines in italics", best=True, table_id="eval-metrics"), "evaluations")
    steps = [ln[2:] for ln in _log_section(log)[2:] if ln.startswith("- ")]
    report.html.add("training", "Training curves",
                    "<ul>" + "".join(f"<li>{pg.esc(t)}</li>" for t in steps) + "</ul>"
                    + pg.figure(report.out / "training_curves.png", "loss, learning rate and alpha per step "
                                "(heat-up events dashed); metrics per evaluation (validation dashed, "
                                "test solid, baselines dotted)", "training curves"), "curves")
    return [r for r in rows if r["kind"] == "baseline"]


def full_config_section(report: Report, cfg_raw: dict | None, cfg_path: Path | None) -> None:
    """The configuration file as it is, folded."""
    if cfg_raw is not None and cfg_path is not None:
        report.html.add("config", f"Full configuration ({cfg_path.name})",
                        f"<details><summary>show</summary><pre>{pg.esc(cfg_path.read_text())}</pre></details>",
                        "config")
