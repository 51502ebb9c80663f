"""``deepmetric report RUN_DIR``: one HTML page, PNG figures and a Markdown summary of a run.

Reads what a training run leaves in its directory - the JSON-lines log ``log.jsonl``, the
resolved ``config.yaml``, ``metrics.json`` and the checkpoint - and writes into
``RUN_DIR/report/``:

==========================  =======================================================
``report.html``             the whole report as one self-contained page (figures and
                            image thumbnails embedded): configuration and summary,
                            metric tables (validation / test marked, baselines),
                            training curves, Recall@K, cosine histograms, 2-d
                            embedding, retrieval grids (random and worst queries with
                            their top-8 neighbours, right / wrong marked), per-class
                            recall, misclassified test images beside their nearest
                            training image (classifiers)
``training_curves.png``     loss, lr, alpha per step; metrics per evaluation
``recall_at_k.png``         Recall@K, K = 1, 2, 4, ... (needs embeddings)
``cosine_histograms.png``   same- vs different-class cosine similarity (Fig. 4)
``embedding_2d.png``        2-d scatter / PCA coloured by class (Fig. 2)
``grad_norm_alpha.png``     gradient norm vs alpha (Fig. 1; needs class weights)
``report.md``               the numbers, with links to the figures
==========================  =======================================================

Embeddings come from ``--embeddings EMB.npz`` (``deepmetric embed`` output), else
``RUN_DIR/embeddings.npz``, else they are computed with the run's checkpoint (``best.pt``,
else ``last.pt``) on the test split rebuilt from ``config.yaml``. The ``.npz`` holds
``embeddings`` (N x d) and ``labels`` (N); optional keys add sections: ``is_query`` /
``is_gallery`` (In-shop protocol), ``train_embeddings`` + ``train_labels`` (train-split
histogram; with ``class_weights`` (C x d) of the trained classifier also Fig. 1 on real
samples), ``logits`` (N x C) or ``predictions`` (N) of a classifier (two-head model:
accuracy and the nearest-training-image analysis of misclassified test images, two-head
paper Sec. 4.3). The retrieval grids show images when the rebuilt split matches the
embedding rows label for label.
"""
from __future__ import annotations

import copy
import math
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from . import diagnostics as dg
from . import page as pg
from . import plots
from deepmetric.run import rundir

from deepmetric.run.evaluation import command_search_device

from .run_inputs import check_run_dir, embed_run, find_checkpoint, image_source_for

__all__ = ["make_report", "load_embeddings_npz", "CONFIG_NAMES", "LOG_NAME"]

LOG_NAME = rundir.LOG
CONFIG_NAMES = rundir.CONFIG_NAMES
_ALPHAS = np.geomspace(0.25, 256, 61)


def load_embeddings_npz(path: str | Path) -> dict[str, np.ndarray]:
    """Read an embeddings ``.npz`` and check the keys the report uses (see module doc)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"embeddings file not found: {path}")
    try:
        with np.load(path, allow_pickle=False) as z:
            data = {k: z[k] for k in z.files}
    except (ValueError, OSError) as exc:
        raise ValueError(f"{path}: not a readable .npz file ({exc})") from None
    for key in ("embeddings", "labels"):
        if key not in data:
            raise ValueError(f"{path}: missing array '{key}' (found: {', '.join(sorted(data)) or 'none'})")
    n = len(data["embeddings"])
    for key in ("labels", "is_query", "is_gallery", "logits", "predictions"):
        if key in data and len(data[key]) != n:
            raise ValueError(f"{path}: '{key}' has {len(data[key])} rows but 'embeddings' has {n}")
    if ("train_embeddings" in data) != ("train_labels" in data):
        raise ValueError(f"{path}: 'train_embeddings' and 'train_labels' must be given together")
    return data


def _read_config(run_dir: Path) -> tuple[dict | None, Path | None]:
    import yaml

    for name in CONFIG_NAMES:
        p = run_dir / name
        if p.is_file():
            try:
                raw = yaml.safe_load(p.read_text())
            except yaml.YAMLError as exc:
                raise ValueError(f"{p}: invalid YAML ({exc})") from None
            return (raw if isinstance(raw, dict) else None), p
    return None, None


def _fmt(v: Any, pct: bool = True) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    if isinstance(v, float):
        return f"{100 * v:.2f}" if pct and 0.0 <= v <= 1.0 else f"{v:.4g}"
    return str(v)


def _config_section(cfg: dict, path: Path) -> list[str]:
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
                cell = _fmt(float(v)) if isinstance(v, (int, float)) else "-"
                cells.append(cell + ("*" if best[k] == i and cell != "-" else ""))
            ep = epoch[i]
            lines.append(f"| {int(ep) if np.isfinite(ep) else '-'} | " + " | ".join(cells) + " |")
        if len(log.evals) > 20:
            lines.append(f"\n(last 20 of {len(log.evals)} evaluations)")
    elif log.evals or log.baselines():
        lines += ["", "Evaluations (%, validation and test marked; best per split marked *):", ""]
        lines += _md_table(_eval_rows(log, None), best=True)
    return lines + [""]


def _class_name(names: list[str] | None, c: int) -> str:
    return names[c] if names is not None and 0 <= c < len(names) else str(c)


def make_report(run_dir: str | Path, embeddings: str | Path | None = None, *,
                out_dir: str | Path | None = None, max_pairs: int = 1_000_000, seed: int = 0,
                ks: tuple[int, ...] = (1, 2, 4, 8, 16, 32), checkpoint: str | Path | bool | None = None,
                split: str | None = None, device: str = "cpu", batch_size: int = 256,
                embed_train: bool | None = None, images: bool = True, n_queries: int = 8,
                top_k: int = 8, search_device: str = "auto") -> Path:
    """Write ``report.html``, the figures and ``report.md`` of a run; returns the path of
    ``report.md`` (``report.html`` sits beside it).

    ``run_dir`` must be a training run (holding at least one of ``log.jsonl``,
    ``config.yaml``, ``metrics.json``, ``best.pt`` / ``last.pt``); anything else is a
    ``ValueError`` naming the folder. ``embeddings`` is an ``.npz`` as described in the
    module docstring; when omitted, ``RUN_DIR/embeddings.npz`` is used if it exists, else
    the embeddings of the test split (``split``: another split, or ``query+gallery``) are
    computed with ``checkpoint`` (default ``best.pt``, else ``last.pt``; ``False``: never)
    on ``device``. ``out_dir`` defaults to ``RUN_DIR/report``. ``max_pairs`` bounds the
    pairs per histogram (exact below it). ``images``: show dataset images in the grids;
    ``n_queries`` random and ``n_queries`` worst queries with their ``top_k`` neighbours.
    ``search_device``: where the neighbour searches run (:func:`~deepmetric.run.evaluation.command_search_device`:
    ``auto`` = ``device``, ``cpu`` = faiss on the CPU).
    """
    run_dir = Path(run_dir)
    check_run_dir(run_dir)
    command_search_device(device, search_device)  # a bad --device / --search-device fails before any work
    for flag, value in (("--queries", n_queries), ("--top-k", top_k), ("--max-pairs", max_pairs),
                        ("--batch-size", batch_size)):  # before any figure is drawn
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{flag} must be a whole number >= 1, got {value!r}")
    out = Path(out_dir) if out_dir is not None else run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    if embeddings is None and (run_dir / "embeddings.npz").is_file():
        embeddings = run_dir / "embeddings.npz"

    md: list[str] = [f"# Run report: `{run_dir.name}`", ""]
    figures: list[tuple[str, str]] = []
    cfg_raw, cfg_path = _read_config(run_dir)
    html = pg.HtmlPage(f"Run report: {run_dir.name}",
                       str(cfg_raw.get("description") or "") if cfg_raw else "")
    cfg_obj, cfg_note = _config_object(cfg_raw)

    # --- summary: configuration and metrics.json ----------------------------------------
    body = []
    if cfg_raw is not None and cfg_path is not None:
        md += _config_section(cfg_raw, cfg_path)
        body.append(pg.kv_table(_config_rows(cfg_raw)))
    else:
        body.append('<p class="note">no config.yaml in the run directory</p>')
    eval_cfg = (cfg_raw or {}).get("eval")
    eval_split = str(eval_cfg.get("split", "test")) if isinstance(eval_cfg, dict) else "test"
    summary = rundir.read_metrics(run_dir)
    baselines: list[dict] = []  # for the Recall@K table and curve
    if summary is not None:
        rows, notes = summary_rows(summary, eval_split)
        baselines += [r for r in rows if r["kind"] == "baseline"]
        if rows:
            body.append(pg.metrics_table(rows, caption="metrics.json (%, validation and test marked)",
                                         table_id="summary-metrics"))
            md += ["## Summary (`metrics.json`)", ""] + _md_table(rows) + [""]
        if notes:
            body.append("<ul>" + "".join(f"<li>{pg.esc(n)}</li>" for n in notes) + "</ul>")
            md += [f"- {n}" for n in notes] + [""]
        warns = [str(w) for w in summary.get("warnings") or []]
        if warns:  # the run's warnings, the verdict against the baselines among them
            body.append('<ul class="warnings">' + "".join(f"<li>warning: {pg.esc(w)}</li>" for w in warns) + "</ul>")
            md += ["## Warnings", ""] + [f"- {w}" for w in warns] + [""]
    html.add("summary", "Configuration and summary", "\n".join(body), "summary")

    # --- log -----------------------------------------------------------------------------
    log_path = run_dir / LOG_NAME
    if log_path.is_file():
        log = dg.read_log(log_path)
        plots.plot_training_curves(log, out / "training_curves.png", title=run_dir.name)
        figures.append(("training curves", "training_curves.png"))
        md += _log_section(log)
        rows = _eval_rows(log, eval_split)
        baselines += [r for r in rows if r["kind"] == "baseline"]
        if rows:
            html.add("metrics", "Evaluations during training", pg.metrics_table(
                rows, caption="% per evaluation; validation and test marked; the best of each "
                              "split marked *; baselines in italics", best=True, table_id="eval-metrics"), "evaluations")
        steps = [ln[2:] for ln in _log_section(log)[2:] if ln.startswith("- ")]
        html.add("training", "Training curves",
                 "<ul>" + "".join(f"<li>{pg.esc(t)}</li>" for t in steps) + "</ul>"
                 + pg.figure(out / "training_curves.png", "loss, learning rate and alpha per step "
                             "(heat-up events dashed); metrics per evaluation (validation dashed, "
                             "test solid, baselines dotted)", "training curves"), "curves")
    else:
        md += ["## Training", "", f"- no `{LOG_NAME}` in the run directory", ""]
        html.add("training", "Training curves", f'<p class="note">no {LOG_NAME} in the run directory</p>')

    # --- embeddings ---------------------------------------------------------------------
    data, source, why_none = None, None, ("no embeddings: pass --embeddings EMB.npz, or keep "
                                          "best.pt / last.pt in the run directory")
    if embeddings is not None:
        data, source = load_embeddings_npz(embeddings), f"`{Path(embeddings).name}`"
    elif checkpoint is not False:
        explicit = checkpoint not in (None, True)
        ckpt = Path(checkpoint) if explicit else find_checkpoint(run_dir)
        if explicit and not ckpt.is_file():
            raise FileNotFoundError(f"checkpoint not found: {ckpt}")
        if ckpt is not None:
            try:
                data, cfg_from_ckpt = embed_run(ckpt, split=split, device=device,
                                                batch_size=batch_size, embed_train=embed_train)
            except Exception as exc:  # noqa: BLE001 - reported on the page and as a warning
                if explicit:
                    raise
                # e.g. the dataset is not on this machine: still report the log and metrics
                why_none = (f"no embeddings: embedding with {ckpt.name} failed "
                            f"({type(exc).__name__}: {str(exc)[:300]}); pass "
                            f"--embeddings EMB.npz, or --no-embed")
                warnings.warn(why_none)
            else:
                cfg_obj = cfg_obj or cfg_from_ckpt
                source = f"`{ckpt.name}` on the {split or 'test'} split"
    if data is not None:
        where = command_search_device(device, search_device, nbytes=4 * int(np.asarray(data["embeddings"]).size))
        emb_md, emb_html = _embedding_sections(
            data, source, out, figures, max_pairs=max_pairs, seed=seed, ks=ks, cfg=cfg_obj, search_device=where,
            baselines=[b for b in baselines if b.get("split") in (None, "test", split or "test")],
            cfg_note=cfg_note, split=split, images=images, n_queries=n_queries, top_k=top_k)
        md += emb_md
        for sec in emb_html:
            html.add(*sec)
    else:
        html.add("embeddings", "Embeddings", f'<p class="note">{pg.esc(why_none)}</p>', "embeddings")
        md += [f"- {why_none}", ""]

    if cfg_raw is not None and cfg_path is not None:
        html.add("config", f"Full configuration ({cfg_path.name})",
                 f"<details><summary>show</summary><pre>{pg.esc(cfg_path.read_text())}</pre></details>", "config")

    if figures:
        md += ["## Figures", ""]
        md += [f"### {title}\n\n![{title}]({name})\n" for title, name in figures]
    report = out / "report.md"
    report.write_text("\n".join(md).rstrip() + "\n", encoding="utf-8")
    html.write(out / "report.html")
    return report


def _config_object(raw: dict | None):
    """The run's :class:`~deepmetric.run.config.Config` (to rebuild its data), or None
    with a note when the file does not describe a current config."""
    if raw is None:
        return None, "no config.yaml"
    try:
        from deepmetric.run.config_io import config_from_dict

        return config_from_dict(copy.deepcopy(raw)), ""
    except Exception as exc:  # noqa: BLE001 - only the images depend on it
        return None, f"config.yaml could not be read as a training config ({exc})"


def _embedding_sections(data: dict[str, np.ndarray], source: str, out: Path,
                        figures: list[tuple[str, str]], *, max_pairs: int, seed: int,
                        ks: tuple[int, ...], cfg=None, cfg_note: str = "", split: str | None = None,
                        images: bool = True, n_queries: int = 8, top_k: int = 8,
                        baselines: list[dict] | None = None, search_device=None,
                        ) -> tuple[list[str], list[tuple[str, str, str, str]]]:
    x = data["embeddings"]
    y = dg._as_labels(data["labels"], len(x))
    is_q = data.get("is_query")
    is_g = data.get("is_gallery")
    sections: list[tuple[str, str, str, str]] = []
    head = (f"{source}: {x.shape[0]} x {x.shape[1]}, {len(np.unique(y))} classes")
    md = [f"## Embeddings ({head})", ""]

    # images behind the rows (for the grids) and class names
    src, img_note = None, "images not shown (--no-images)"
    if images and cfg is not None:
        src, img_note = image_source_for(cfg, y, has_gallery=is_q is not None, split=split)
    elif images:
        img_note = f"images not shown: {cfg_note}"
    names = src.class_names if src is not None else None
    if names is None and "class_names" in data:
        names = [str(n) for n in data["class_names"]]

    # Recall@K: K limited by the number of references a query can retrieve
    n_ref = int(np.sum(is_g)) if is_g is not None else len(x) - 1
    ks_ok = tuple(k for k in ks if k <= n_ref)
    body = [f"<p>{pg.esc(head.replace('`', ''))}</p>"]
    if ks_ok:
        steps = list(getattr(getattr(cfg, "search", None), "postprocess", None) or [])
        rc = dg.recall_curve(x, y, ks_ok, is_query=is_q, is_gallery=is_g, device=search_device, postprocess=steps)
        if steps:  # the run's search.postprocess, as every search of this embedding applies it
            from deepmetric.evaluate.postprocess import format_steps

            body.append(f"<p>Recall@K after the run's post-processing: {pg.esc(format_steps(steps))}.</p>")
            md += [f"Recall@K after the run's post-processing: {format_steps(steps)}.", ""]
        # logged baselines (epoch-0 model, raw pixels, ...) with Recall@K, drawn beside the run
        base = {}
        for b in baselines or []:
            c = {int(k[7:]): float(v) for k, v in b["metrics"].items()
                 if k.startswith("recall@") and k[7:].isdigit() and int(k[7:]) in rc}
            if c and b["text"] not in base:
                base[b["text"]] = c
        plots.plot_recall_curve({"this run": rc, **base}, out / "recall_at_k.png")
        figures.append(("Recall@K", "recall_at_k.png"))
        md += ["| " + " | ".join(f"R@{k}" for k in rc) + " |", "|---" * len(rc) + "|",
               "| " + " | ".join(_fmt(v) for v in rc.values()) + " |", ""]
        body.append(pg.metrics_table(
            [{"label": "this run", "split": None, "kind": "eval",
              "metrics": {f"recall@{k}": v for k, v in rc.items()}}]
            + [{"label": pg.esc(name), "split": None, "kind": "baseline",
                "metrics": {f"recall@{k}": v for k, v in c.items()}} for name, c in base.items()],
            table_id="recall-table"))
        body.append(pg.figure(out / "recall_at_k.png", "Recall@K (%), K on a log2 axis", "Recall@K"))
    sections.append(("recall", "Recall@K", "\n".join(body), "Recall@K"))

    hists = {"test": dg.pair_cosine_histograms(x, y, max_pairs=max_pairs, seed=seed)}
    if "train_embeddings" in data:
        xtr = data["train_embeddings"]
        ytr = dg._as_labels(data["train_labels"], len(xtr), "train_labels")
        hists = {"train": dg.pair_cosine_histograms(xtr, ytr, max_pairs=max_pairs, seed=seed), **hists}
    plots.plot_cosine_histograms(hists, out / "cosine_histograms.png")
    figures.append(("cosine similarity of pairs (heated-up Fig. 4)", "cosine_histograms.png"))
    md += ["Cosine similarity of pairs (mean, %s):" % ("exact" if all(h["exact"] for h in hists.values())
                                                       else "sampled"), "",
           "| split | same class | different class | gap |", "|---|---|---|---|"]
    cos_rows = []
    for name, h in hists.items():
        mid = (h["edges"][:-1] + h["edges"][1:]) / 2
        ms = float(mid @ h["same"] / h["same"].sum()) if h["same"].sum() else math.nan
        mdf = float(mid @ h["diff"] / h["diff"].sum()) if h["diff"].sum() else math.nan
        md.append(f"| {name} | {ms:.3f} | {mdf:.3f} | {ms - mdf:.3f} |")
        cos_rows.append(f"<tr><th>{pg.esc(name)}</th><td>{ms:.3f}</td><td>{mdf:.3f}</td><td>{ms - mdf:.3f}</td></tr>")
    md.append("")
    sections.append(("cosine", "Cosine similarity of pairs (heated-up Fig. 4)",
                     '<table><thead><tr><th>split</th><th>same class</th><th>different class</th>'
                     '<th>gap</th></tr></thead><tbody>' + "".join(cos_rows) + "</tbody></table>"
                     + pg.figure(out / "cosine_histograms.png", "normalised histograms of the cosine "
                                 "similarity of same-class (red) and different-class (blue) pairs",
                                 "cosine histograms"), "cosine"))

    plots.plot_embedding_2d(x, y, out / "embedding_2d.png", seed=seed, normalize=x.shape[1] > 2,
                            class_names=names)
    figures.append(("embedding (heated-up Fig. 2 style)", "embedding_2d.png"))
    emb_body = [pg.figure(out / "embedding_2d.png", "2-d embedding coloured by class (PCA of the "
                          "l2-normalised embedding when it has more than 2 dimensions)", "2-d embedding")]

    if "class_weights" in data and "train_embeddings" in data:
        w = data["class_weights"]
        xtr, ytr = data["train_embeddings"], dg._as_labels(data["train_labels"], len(data["train_embeddings"]))
        picked = dg.select_paper_samples(xtr, ytr, w)
        curves = {}
        for kind, i in picked.items():
            if i is not None:
                curves[kind] = dg.gradient_norm_vs_alpha(xtr[i:i + 1], ytr[i:i + 1], _ALPHAS, weights=w)[0]
        if curves:
            plots.plot_grad_norm_vs_alpha(_ALPHAS, curves, out / "grad_norm_alpha.png")
            figures.append(("gradient norm vs alpha (heated-up Fig. 1)", "grad_norm_alpha.png"))
            md += ["Fig. 1 samples (training split): " + ", ".join(f"{k} = #{v}" for k, v in picked.items()), ""]
            emb_body.append(pg.figure(out / "grad_norm_alpha.png", "gradient norm w.r.t. the "
                                      "normalised embedding against alpha (heated-up Fig. 1)",
                                      "gradient norm vs alpha"))
    sections.append(("embedding", "Embedding", "\n".join(emb_body), "embedding"))

    # --- retrieval grids and per-class recall -------------------------------------------
    ex = dg.retrieval_examples(x, y, k=top_k, n_random=n_queries, n_worst=n_queries, seed=seed,
                               is_query=is_q, is_gallery=is_g, device=search_device)
    note = f'<p class="note">{pg.esc(img_note)}. Green border: same class as the query; red: another class.</p>'
    sections.append(("grids", f"Retrieval: random queries and their top-{top_k}",
                     note + _grid_html(ex, "random", y, names, src, "grid-random"), "random queries"))
    sections.append(("worst", f"Retrieval: worst queries (fewest correct in the top-{top_k})",
                     note + _grid_html(ex, "worst", y, names, src, "grid-worst"), "worst queries"))
    pcr = dg.per_class_recall(x, y, k=1, is_query=is_q, is_gallery=is_g, device=search_device)
    cls_html, cls_md = _per_class_html(pcr, names, src, y, is_q)
    sections.append(("classes", "Per-class Recall@1", cls_html, "per class"))
    md += cls_md

    # --- classifier ---------------------------------------------------------------------
    pred = data.get("predictions", data.get("logits"))
    if pred is not None:
        p = np.asarray(pred)
        p = p.argmax(axis=1) if p.ndim == 2 else p.astype(np.int64)
        acc = float(np.mean(p == y))
        per_class = [float(np.mean(p[y == c] == c)) for c in np.unique(y)]
        md += ["## Classification", "", f"- top-1 accuracy {_fmt(acc)} %, mean per-class "
               f"{_fmt(float(np.mean(per_class)))} %", ""]
        body = [f"<p>top-1 accuracy <b>{_fmt(acc)} %</b>, mean per-class {_fmt(float(np.mean(per_class)))} %</p>"]
        if "train_embeddings" in data:
            res = dg.misclassified_neighbours(data["train_embeddings"], data["train_labels"], x, y, p,
                                              device=search_device)
            line = (f"{res['n_misclassified']} of {res['n_test']} test images misclassified; "
                    f"their nearest training image carries the **predicted** label for "
                    f"{_fmt(res['share_neighbour_is_predicted'])} % and the true label for "
                    f"{_fmt(res['share_neighbour_is_true'])} % (two-head paper: 79.34 % "
                    f"predicted, Flowers-102)")
            md += [f"- {line}", ""]
            body.append(f'<p id="misclassified-share">{pg.esc(line).replace("**predicted**", "<b>predicted</b>")}</p>')
            tr_src = None
            if images and cfg is not None and src is not None:
                tr_src, _ = image_source_for(cfg, dg._as_labels(data["train_labels"], len(data["train_labels"])),
                                             has_gallery=False, train=True)
            body.append(_pairs_html(res, names, src, tr_src, limit=2 * n_queries))
        sections.append(("classification", "Classification: misclassified test images (two-head Fig. 10)",
                         "\n".join(body), "misclassified"))
    return md, sections


def _tile(row: int, kind: str, caption: str, src, label: int, alt: str) -> str:
    uri = src.thumbnail(int(row)) if src is not None else None
    img = (f'<img src="{uri}" alt="{pg.esc(alt)}">' if uri is not None
           else f'<span class="noimg">no image<br>#{row}</span>')
    return (f'<figure class="tile {kind}" data-row="{row}" data-label="{label}">'
            f'<div class="img">{img}</div><figcaption>{caption}</figcaption></figure>')


def _grid_html(ex: dict, which: str, y: np.ndarray, names, src, grid_id: str) -> str:
    rows = []
    for q in ex[which]:
        yq = int(y[q])
        tiles = [_tile(q, "query", f"query #{q}<br><b>{pg.esc(_class_name(names, yq))}</b>", src, yq,
                       f"query {q}"), '<div class="sep"></div>']
        for r, (n, s, c) in enumerate(zip(ex["neighbours"][q], ex["similarity"][q], ex["correct"][q])):
            if n < 0:
                continue
            yn = int(y[n])
            mark = "&#10003;" if c else "&#10007;"
            tiles.append(_tile(int(n), "hit" if c else "miss",
                               f"<b>{mark} {r + 1}</b> {pg.esc(_class_name(names, yn))}<br>cos {s:.3f}",
                               src, yn, f"rank {r + 1} of query {q}"))
        rows.append(f'<div class="row" data-query="{q}" data-label="{yq}" '
                    f'data-correct="{ex["n_correct"][q]}">' + "".join(tiles) + "</div>")
    return f'<div class="grid" id="{grid_id}">' + "\n".join(rows) + "</div>"


def _per_class_html(pcr: dict, names, src, y: np.ndarray, is_q) -> tuple[str, list[str]]:
    cls, rec, nq = pcr["classes"], pcr["recall"], pcr["n_queries"]
    order = np.lexsort((cls, -rec))  # best first, ties by class id
    m = min(10, max(1, len(cls) // 2)) if len(cls) > 1 else 1
    best, worst = order[:m], order[::-1][:m]
    q_rows = np.flatnonzero(np.ones(len(y), bool) if is_q is None else np.asarray(is_q, bool))

    def table(idx, tid: str, title: str) -> str:
        out = [f'<table id="{tid}"><caption>{title}</caption><thead><tr><th>class</th>'
               f'<th>example</th><th>queries</th><th>Recall@1 (%)</th></tr></thead><tbody>']
        for i in idx:
            c = int(cls[i])
            ex_row = int(q_rows[np.argmax(y[q_rows] == c)])
            uri = src.thumbnail(ex_row) if src is not None else None
            img = f'<img src="{uri}" alt="class {c}" style="height:40px">' if uri else ""
            out.append(f"<tr><th>{pg.esc(_class_name(names, c))}</th><td>{img}</td>"
                       f"<td>{int(nq[i])}</td><td>{100 * rec[i]:.1f}</td></tr>")
        return "".join(out) + "</tbody></table>"

    zero = int(np.sum(rec == 0))
    head = (f"<p>{len(cls)} query classes; Recall@1 per class: mean {100 * rec.mean():.1f} %, "
            f"median {100 * np.median(rec):.1f} %, {zero} classes at 0 %.</p>")
    html = (head + '<div style="display:flex;gap:24px;flex-wrap:wrap">'
            + table(best, "best-classes", f"best {len(best)} classes")
            + table(worst, "worst-classes", f"worst {len(worst)} classes") + "</div>")
    md = ["Per-class Recall@1 (best / worst classes):", "", "| class | queries | R@1 (%) |", "|---|---|---|"]
    md += [f"| {_class_name(names, int(cls[i]))} | {int(nq[i])} | {100 * rec[i]:.1f} |" for i in best]
    md += ["| ... | | |"] + [f"| {_class_name(names, int(cls[i]))} | {int(nq[i])} | {100 * rec[i]:.1f} |"
                             for i in worst[::-1]] + [""]
    return html, md


def _pairs_html(res: dict, names, te_src, tr_src, limit: int) -> str:
    pairs = []
    for j in range(min(limit, res["n_misclassified"])):
        t, n = int(res["misclassified"][j]), int(res["neighbour"][j])
        yt, yp, yn = int(res["true"][j]), int(res["predicted"][j]), int(res["neighbour_label"][j])
        test_tile = _tile(t, "miss", f"test #{t}<br>true <b>{pg.esc(_class_name(names, yt))}</b><br>"
                                     f"pred {pg.esc(_class_name(names, yp))}", te_src, yt, f"test {t}")
        kind = "pred" if yn == yp else "query"
        nb_tile = _tile(n, kind, f"nearest train #{n}<br><b>{pg.esc(_class_name(names, yn))}</b>"
                                 + (" (= predicted)" if yn == yp else ""), tr_src, yn, f"train {n}")
        pairs.append(f'<div class="pair" data-test="{t}" data-neighbour-is-predicted="{int(yn == yp)}">'
                     f"{test_tile}{nb_tile}</div>")
    if not pairs:
        return '<p class="note">nothing misclassified</p>'
    return ('<p class="note">each pair: a misclassified test image (red) and its nearest training '
            'image; orange when that image carries the predicted label.</p>'
            f'<div class="pairs" id="misclassified">{"".join(pairs)}</div>')
