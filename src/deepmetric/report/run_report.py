"""``deepmetric report RUN_DIR``: PNG figures and a short Markdown summary of a run.

Reads what a training run leaves in its directory - the JSON-lines log ``log.jsonl`` and
the resolved ``config.yaml`` - and optionally an embeddings file (``deepmetric embed``
output, ``.npz``) and writes into ``RUN_DIR/report/``:

==========================  =======================================================
``training_curves.png``     loss, lr, alpha per step; metrics per evaluation
``recall_at_k.png``         Recall@K, K = 1, 2, 4, ... (needs embeddings)
``cosine_histograms.png``   same- vs different-class cosine similarity (Fig. 4)
``embedding_2d.png``        2-d scatter / PCA coloured by class (Fig. 2)
``grad_norm_alpha.png``     gradient norm vs alpha (Fig. 1; needs class weights)
``report.md``               the numbers, with links to the figures
==========================  =======================================================

The ``.npz`` holds ``embeddings`` (N x d) and ``labels`` (N); optional keys add sections:
``is_query`` / ``is_gallery`` (In-shop protocol), ``train_embeddings`` +
``train_labels`` (train-split histogram; with ``class_weights`` (C x d) of the trained
classifier also Fig. 1 on real samples), ``logits`` (N x C) or ``predictions`` (N) of a
classifier (two-head model: accuracy and the nearest-training-image analysis of
misclassified test images, two-head paper Sec. 4.3).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from . import diagnostics as dg
from . import plots

__all__ = ["make_report", "load_embeddings_npz", "CONFIG_NAMES", "LOG_NAME"]

LOG_NAME = "log.jsonl"
CONFIG_NAMES = ("config.yaml", "config.yml", "resolved_config.yaml")
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
    lines = [f"## Configuration (`{path.name}`)", ""]
    if get("description"):
        lines += [f"> {get('description')}", ""]
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
    lines += ["| key | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows if v is not None]
    return lines + [""]


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
    if log.evals and keys:
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
    return lines + [""]


def make_report(run_dir: str | Path, embeddings: str | Path | None = None, *,
                out_dir: str | Path | None = None, max_pairs: int = 1_000_000, seed: int = 0,
                ks: tuple[int, ...] = (1, 2, 4, 8, 16, 32)) -> Path:
    """Write the figures and ``report.md`` of a run; returns the path of ``report.md``.

    ``run_dir`` must exist; ``log.jsonl`` and ``config.yaml`` in it are used when present.
    ``embeddings`` is an ``.npz`` as described in the module docstring; when omitted,
    ``RUN_DIR/embeddings.npz`` is used if it exists. ``out_dir`` defaults to
    ``RUN_DIR/report``. ``max_pairs`` bounds the pairs per histogram (exact below it).
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory not found: {run_dir}")
    out = Path(out_dir) if out_dir is not None else run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    if embeddings is None and (run_dir / "embeddings.npz").is_file():
        embeddings = run_dir / "embeddings.npz"

    md: list[str] = [f"# Run report: `{run_dir.name}`", ""]
    figures: list[tuple[str, str]] = []

    cfg, cfg_path = _read_config(run_dir)
    if cfg is not None and cfg_path is not None:
        md += _config_section(cfg, cfg_path)

    log_path = run_dir / LOG_NAME
    if log_path.is_file():
        log = dg.read_log(log_path)
        plots.plot_training_curves(log, out / "training_curves.png", title=run_dir.name)
        figures.append(("training curves", "training_curves.png"))
        md += _log_section(log)
    else:
        md += ["## Training", "", f"- no `{LOG_NAME}` in the run directory", ""]

    if embeddings is not None:
        md += _embedding_sections(load_embeddings_npz(embeddings), Path(embeddings), out, figures,
                                  max_pairs=max_pairs, seed=seed, ks=ks)

    if figures:
        md += ["## Figures", ""]
        md += [f"### {title}\n\n![{title}]({name})\n" for title, name in figures]
    report = out / "report.md"
    report.write_text("\n".join(md).rstrip() + "\n", encoding="utf-8")
    return report


def _embedding_sections(data: dict[str, np.ndarray], path: Path, out: Path,
                        figures: list[tuple[str, str]], *, max_pairs: int, seed: int,
                        ks: tuple[int, ...]) -> list[str]:
    x = data["embeddings"]
    y = dg._as_labels(data["labels"], len(x))
    is_q = data.get("is_query")
    is_g = data.get("is_gallery")
    md = [f"## Embeddings (`{path.name}`: {x.shape[0]} x {x.shape[1]}, "
          f"{len(np.unique(y))} classes)", ""]

    # Recall@K: K limited by the number of references a query can retrieve
    n_ref = int(np.sum(is_g)) if is_g is not None else len(x) - 1
    ks_ok = tuple(k for k in ks if k <= n_ref)
    if ks_ok:
        rc = dg.recall_curve(x, y, ks_ok, is_query=is_q, is_gallery=is_g)
        plots.plot_recall_curve({path.stem: rc}, out / "recall_at_k.png")
        figures.append(("Recall@K", "recall_at_k.png"))
        md += ["| " + " | ".join(f"R@{k}" for k in rc) + " |", "|---" * len(rc) + "|",
               "| " + " | ".join(_fmt(v) for v in rc.values()) + " |", ""]

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
    for name, h in hists.items():
        mid = (h["edges"][:-1] + h["edges"][1:]) / 2
        ms = float(mid @ h["same"] / h["same"].sum()) if h["same"].sum() else math.nan
        mdf = float(mid @ h["diff"] / h["diff"].sum()) if h["diff"].sum() else math.nan
        md.append(f"| {name} | {ms:.3f} | {mdf:.3f} | {ms - mdf:.3f} |")
    md.append("")

    plots.plot_embedding_2d(x, y, out / "embedding_2d.png", seed=seed,
                            normalize=x.shape[1] > 2)
    figures.append(("embedding (heated-up Fig. 2 style)", "embedding_2d.png"))

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

    pred = data.get("predictions", data.get("logits"))
    if pred is not None:
        p = np.asarray(pred)
        p = p.argmax(axis=1) if p.ndim == 2 else p.astype(np.int64)
        acc = float(np.mean(p == y))
        per_class = [float(np.mean(p[y == c] == c)) for c in np.unique(y)]
        md += ["## Classification", "", f"- top-1 accuracy {_fmt(acc)} %, mean per-class "
               f"{_fmt(float(np.mean(per_class)))} %", ""]
        if "train_embeddings" in data:
            res = dg.misclassified_neighbours(data["train_embeddings"], data["train_labels"], x, y, p)
            md += [f"- {res['n_misclassified']} of {res['n_test']} test images misclassified; "
                   f"their nearest training image carries the **predicted** label for "
                   f"{_fmt(res['share_neighbour_is_predicted'])} % and the true label for "
                   f"{_fmt(res['share_neighbour_is_true'])} % (two-head paper: 79.34 % "
                   f"predicted, Flowers-102)", ""]
    return md
