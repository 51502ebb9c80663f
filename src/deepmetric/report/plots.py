"""Matplotlib figures of a run and of the papers' diagnostics (Agg backend, files only).

Every ``plot_*`` function takes plain arrays (or the results of
:mod:`deepmetric.report.diagnostics`), writes one PNG to ``out`` and returns its path.
They never open a window, so they work on headless machines and inside training jobs.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping, Sequence

import matplotlib

matplotlib.use("Agg")  # files only: no display needed (must precede pyplot)
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402
import numpy as np  # noqa: E402

from . import diagnostics as dg  # noqa: E402

__all__ = [
    "plot_training_curves",
    "plot_grad_norm_vs_alpha",
    "plot_embedding_2d",
    "plot_cosine_histograms",
    "plot_recall_curve",
    "plot_misclassified_neighbours",
    "plot_retrieval_grid",
]

_DPI = 110


def legend_beside(ax, *, fontsize: int = 7, ncol: int = 1):
    """The legend to the right of the axes, never over the curves (figures are saved with
    ``bbox_inches="tight"``, so the figure grows to hold it)."""
    return ax.legend(fontsize=fontsize, ncol=ncol, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)


def _save(fig, out: str | Path) -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=_DPI, bbox_inches="tight")
    plt.close(fig)
    return out


_FALLBACK_FAMILIES = ("Noto Sans CJK JP", "Noto Sans CJK SC", "WenQuanYi Zen Hei", "WenQuanYi Micro Hei",
                      "AR PL UMing CN", "Noto Sans", "DejaVu Sans")


def _font_context(texts: Sequence[str] | None):
    """Matplotlib renders text with one font; class names in other scripts (the glyph
    benchmark's hanzi) would be empty boxes. When any text is not ASCII, list installed
    fonts that cover it after DejaVu Sans (matplotlib >= 3.6 falls back glyph by glyph)."""
    import contextlib

    if not texts or all(str(t).isascii() for t in texts):
        return contextlib.nullcontext()
    from matplotlib import font_manager

    installed = {f.name for f in font_manager.fontManager.ttflist if f.weight in (400, "normal", "regular")}
    families = ["DejaVu Sans"] + [f for f in _FALLBACK_FAMILIES if f in installed and f != "DejaVu Sans"]
    return plt.rc_context({"font.family": families})


def _smooth(y: np.ndarray, window: int) -> np.ndarray:
    """Moving average that ignores NaN (missing keys) and keeps the array length."""
    if window <= 1 or y.size < 3:
        return y
    ok = np.isfinite(y).astype(float)
    v = np.where(ok > 0, y, 0.0)
    k = np.ones(window)
    num = np.convolve(v, k, mode="same")
    den = np.convolve(ok, k, mode="same")
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(ok > 0, num / np.maximum(den, 1), np.nan)


# --------------------------------------------------------------------------- training
def plot_training_curves(log: dg.TrainingLog | str | Path, out: str | Path, *,
                         metrics: Sequence[str] | None = None, title: str | None = None) -> Path:
    """Loss, learning rate, alpha (per step) and evaluation metrics (per evaluation).

    ``log`` is a :class:`~deepmetric.report.diagnostics.TrainingLog` or the path of a
    ``log.jsonl``. Panels whose keys never occur are left out; a log without any usable
    record still yields a figure saying so. ``metrics`` picks the evaluation keys (default:
    every ``recall@K`` plus ``nmi``, ``map@r``, ``f1`` and ``top1`` present).
    """
    if not isinstance(log, dg.TrainingLog):
        log = dg.read_training_log(log)
    panels: list[tuple[str, Any]] = []
    xs, xname = log.x_axis("step")
    for key, label in (("loss", "training loss"), ("lr", "learning rate"), ("alpha", "alpha (1/T)")):
        if log.has("step", key):
            panels.append((label, ("step", key)))
    eval_keys = list(metrics) if metrics is not None else [
        k for k in log.metric_keys()
        if k.startswith("recall@") or k in ("nmi", "map@r", "r_precision", "f1", "top1", "mean_per_class")
    ]
    eval_keys = [k for k in eval_keys if log.has("eval", k)]
    if eval_keys:
        panels.append(("evaluation", ("eval", eval_keys)))

    n = max(1, len(panels))
    cols = min(2, n)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.4 * rows), squeeze=False)
    flat = axes.ravel()
    if not panels:
        flat[0].text(0.5, 0.5, "no step or evaluation records in the log", ha="center", va="center")
        flat[0].set_axis_off()
    for ax, (label, (kind, key)) in zip(flat, panels):
        if kind == "step":
            _step_panel(ax, log, key, xs, xname)
        else:
            _eval_panel(ax, log, key)
        ax.set_title(label)
        ax.grid(alpha=0.3)
    for ax in flat[len(panels) or 1:]:
        ax.set_axis_off()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return _save(fig, out)


def _step_panel(ax, log: dg.TrainingLog, key: str, xs: np.ndarray, xname: str) -> None:
    """One per-step value (loss, lr, alpha) against steps, heating-up events dashed."""
    y = log.column("step", key)
    ok = np.isfinite(y)
    if key == "loss":
        w = max(1, int(ok.sum()) // 50)
        if w > 1:  # noisy per-step values plus a moving average
            ax.plot(xs[ok], y[ok], lw=0.6, alpha=0.35, color="C0", label="per step")
            ax.plot(xs[ok], _smooth(y, w)[ok], lw=1.6, color="C0", label=f"mean of {w} steps")
            ax.legend(fontsize=8, loc="best")  # the corner the curve leaves free
        else:
            ax.plot(xs[ok], y[ok], lw=1.4, color="C0")
    else:  # schedules change in steps: draw them as steps
        ax.plot(xs[ok], y[ok], lw=1.4, color="C1" if key == "lr" else "C3", drawstyle="steps-post")
        if key == "lr" and np.all(y[ok] > 0) and y[ok].max() / y[ok].min() > 20:
            ax.set_yscale("log")
    if xname == "step":
        for i, h in enumerate(log.heat_up_steps()):  # mark heating-up events
            ax.axvline(h, color="grey", ls="--", lw=1, label="heat-up" if i == 0 else None)
    ax.set_xlabel(xname)


def _eval_panel(ax, log: dg.TrainingLog, keys: list[str]) -> None:
    """The evaluation metrics ``keys`` against epochs (validation dashed, test solid) with the
    baselines of the first key dotted."""
    ex, exname = log.x_axis("eval")
    epoch = log.column("eval", "epoch")
    if np.isfinite(epoch).all() and epoch.size:
        ex, exname = epoch, "epoch"
    splits = log.splits()
    split_of = np.array([str(r.get("split")) for r in log.evals])
    for i, k in enumerate(keys):
        y = log.column("eval", k)
        for s in splits:  # validation dashed, test solid: never confuse the two
            ok = np.isfinite(y) & (split_of == str(s))
            if ok.any():
                ax.plot(ex[ok], y[ok], marker="o" if s != "val" else "s", ms=3.5, lw=1.3,
                        color=f"C{i}", ls="--" if s in ("val", "validation") else "-",
                        label=k if len(splits) == 1 or s is None else f"{k} ({s})")
    for b in log.baselines():  # reference levels: epoch-0 model, raw pixels, ...
        v = b.get(keys[0])
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            what = b.get("label") or b.get("name") or b.get("baseline") or "baseline"
            ax.axhline(float(v), color="grey", ls=":", lw=1.2,
                       label=f"{keys[0]}: {what}" + (f" ({b['split']})" if b.get("split") else ""))
    if exname == "epoch":  # evaluations happen at whole epochs: no 4.25, 4.5 ticks
        from matplotlib.ticker import MaxNLocator

        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel(exname)
    legend_beside(ax, ncol=2 if len(ax.get_lines()) > 12 else 1)


# --------------------------------------------------------------------------- Fig. 1
def plot_grad_norm_vs_alpha(alphas: Sequence[float], curves: Mapping[str, np.ndarray],
                            out: str | Path, *, marks: Sequence[float] = (4.0, 16.0),
                            title: str | None = None) -> Path:
    """Heated-up paper, Fig. 1 (a-c): ``||d l / d f_hat||`` against alpha, one panel per
    sample type (e.g. ``{"incorrect": g1, "boundary": g2, "centroid": g3}``; each value a
    1-d curve or a 2-d (samples, alphas) array drawn as thin lines with their median).
    Vertical dashed lines mark the alphas in ``marks`` (16 -> 4 of heating-up)."""
    a = np.asarray(alphas, dtype=float)
    names = list(curves)
    if not names:
        raise ValueError("curves is empty: give at least one sample type")
    fig, axes = plt.subplots(1, len(names), figsize=(4.0 * len(names), 3.3), squeeze=False)
    for ax, name, color in zip(axes[0], names, ("C3", "C1", "C2", "C0", "C4")):
        g = np.atleast_2d(np.asarray(curves[name], dtype=float))
        if g.shape[1] != a.size:
            raise ValueError(f"curve {name!r} has {g.shape[1]} points but there are {a.size} alphas")
        if g.shape[0] > 1:
            for row in g:
                ax.plot(a, row, color=color, lw=0.5, alpha=0.25)
            ax.plot(a, np.median(g, axis=0), color=color, lw=2, label=f"median of {g.shape[0]}")
        else:
            ax.plot(a, g[0], color=color, lw=2)
        for m, ls in zip(marks, ("--", ":", "-.")):
            ax.axvline(m, color="grey", ls=ls, lw=1, label=f"alpha = {m:g}")
        ax.legend(fontsize=7)
        if np.all(a > 0) and a.max() / a.min() > 20:
            ax.set_xscale("log")
        ax.set_xlabel("alpha")
        ax.set_title(f'"{name}" sample')
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(r"$\|\partial \ell / \partial \hat f\|_2$")
    fig.suptitle(title or "Gradient norm w.r.t. the normalised embedding (heated-up Fig. 1)")
    fig.tight_layout()
    return _save(fig, out)


# --------------------------------------------------------------------------- Fig. 2
def plot_embedding_2d(embeddings: Any, labels: Any, out: str | Path, *, normalize: bool = False,
                      class_weights: Any = None, max_points: int = 20_000, seed: int = 0,
                      title: str | None = None, class_names: Sequence[str] | None = None,
                      max_legend: int = 20, max_annotations: int = 60) -> Path:
    """Heated-up paper, Fig. 2: scatter of 2-d embeddings coloured by class (PCA when
    the embedding has more dimensions). ``class_weights`` (C, 2) are drawn as diamonds,
    scaled to sit inside the cloud as in the paper. At most ``max_points`` random points
    are drawn.

    Classes are named by ``class_names[label]`` when given. Up to ``max_legend`` classes get
    a legend beside the axes; with more, each class's name is written at its median point
    for up to ``max_annotations`` classes (the most populous ones), and the title says how
    many classes are drawn, so the plot stays readable with hundreds of classes."""
    x = dg._as_2d_float(embeddings, "embeddings")
    y = dg._as_labels(labels, x.shape[0])
    if x.shape[0] > max_points:
        keep = np.sort(np.random.default_rng(seed).choice(x.shape[0], max_points, replace=False))
        x, y = x[keep], y[keep]
    xy, what = dg.embedding_2d(x, normalize=normalize, seed=seed)
    classes, counts = np.unique(y, return_counts=True)

    def name(c) -> str:
        c = int(c)
        return str(class_names[c]) if class_names is not None and 0 <= c < len(class_names) else str(c)

    if len(classes) <= 20:  # qualitative palette, indexed by integer
        cmap = plt.get_cmap("tab10" if len(classes) <= 10 else "tab20")
        colors = {c: cmap(i) for i, c in enumerate(classes)}
    else:  # many classes: spread them around the hue circle
        cmap = plt.get_cmap("hsv")
        colors = {c: cmap(i / len(classes)) for i, c in enumerate(classes)}
    legend = len(classes) <= max_legend
    with _font_context([name(c) for c in classes]):
        return _draw_embedding_2d(xy, y, x, classes, counts, colors, name, legend, out, normalize,
                                  class_weights, max_annotations, title, what)


def _draw_embedding_2d(xy, y, x, classes, counts, colors, name, legend, out, normalize,
                       class_weights, max_annotations, title, what) -> Path:
    fig, ax = plt.subplots(figsize=(7.4 if legend else 6.4, 5.6))
    size = float(np.clip(4000 / len(xy), 2, 30))  # visible dots for small sets, no blobs for large
    for c in classes:
        m = y == c
        ax.scatter(xy[m, 0], xy[m, 1], s=size, alpha=0.6, color=colors[c],
                   label=name(c) if legend else None, linewidths=0)
    if class_weights is not None and x.shape[1] == 2:
        w = dg._as_2d_float(class_weights, "class_weights").astype(float)
        if normalize:
            w = dg._l2n(w)
        # place the diamonds inside the cloud (the paper moves them towards the origin)
        r = np.percentile(np.linalg.norm(xy, axis=1), 75) / max(np.linalg.norm(w, axis=1).max(), 1e-12)
        for c in range(w.shape[0]):
            ax.scatter(w[c, 0] * r, w[c, 1] * r, marker="D", s=60, edgecolors="k",
                       color=colors.get(c, "k"), zorder=3)
    if normalize and x.shape[1] == 2:
        ax.set_aspect("equal")
    if legend:
        ax.legend(markerscale=max(1.0, 12 / size), fontsize=7, ncol=1 if len(classes) <= 12 else 2,
                  loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, title="class",
                  frameon=False)
    else:
        # names at class medians, largest classes first, skipping any that would sit on top
        # of an earlier name (closer than 9% of the axis ranges): no pile of labels
        span = np.ptp(xy, axis=0) + 1e-12
        shown, placed = [], []
        for c in classes[np.argsort(-counts, kind="stable")]:
            med = np.median(xy[y == c], axis=0)
            if all(np.max(np.abs((med - p) / span) / (0.09, 0.04)) >= 1 for p in placed):
                shown.append(c)
                placed.append(med)
            if len(shown) >= max_annotations:
                break
        for c in shown:
            med = np.median(xy[y == c], axis=0)
            ax.annotate(name(c), med, fontsize=6, ha="center", va="center", color="k",
                        bbox=dict(boxstyle="round,pad=0.15", fc="white", ec=colors[c], lw=0.8, alpha=0.75))
        what += (f"\n{len(classes)} classes, no legend; "
                 + (f"{len(shown)} class names at their medians" if len(shown) < len(classes)
                    else "names at their medians"))
    ax.set_title(title or what, fontsize=10)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return _save(fig, out)


# --------------------------------------------------------------------------- Fig. 4
def plot_cosine_histograms(hists: Mapping[str, Mapping[str, Any]], out: str | Path, *,
                           title: str | None = None) -> Path:
    """Heated-up paper, Fig. 4: normalised histograms of the cosine similarity of
    same-class (red) and different-class (blue) pairs, one panel per entry of ``hists``
    (e.g. ``{"train": h1, "test": h2}``, each from
    :func:`~deepmetric.report.diagnostics.pair_cosine_histograms`)."""
    if not hists:
        raise ValueError("hists is empty: give at least one histogram set (e.g. {'test': h})")
    fig, axes = plt.subplots(1, len(hists), figsize=(4.6 * len(hists), 3.4), squeeze=False)
    for ax, (name, h) in zip(axes[0], hists.items()):
        e = np.asarray(h["edges"])
        mid, width = (e[:-1] + e[1:]) / 2, np.diff(e)
        ax.bar(mid, h["diff_density"], width=width, color="tab:blue", alpha=0.55,
               label=f"different class ({h['n_diff_counted']:,} pairs)")
        ax.bar(mid, h["same_density"], width=width, color="tab:red", alpha=0.55,
               label=f"same class ({h['n_same_counted']:,} pairs)")
        ax.set_xticks(np.linspace(e[0], e[-1], 5))  # -1, -0.5, 0, 0.5, 1: no overlapping labels
        ax.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.set_xlim(e[0], e[-1])
        ax.set_xlabel("cosine similarity")
        ax.set_ylabel("density")
        how = "all pairs" if h["exact"] else ("all same-class, sampled different-class pairs"
                                              if h.get("same_exact") else "sampled pairs")
        ax.set_title(f"{name} ({how})", fontsize=10)
        ax.legend(fontsize=8, loc="upper left")
        ax.grid(alpha=0.3)
    fig.suptitle(title or "Cosine similarity of pairs (heated-up Fig. 4)")
    fig.tight_layout()
    return _save(fig, out)


# --------------------------------------------------------------------------- retrieval
def plot_recall_curve(curves: Mapping[str, Mapping[int, float]], out: str | Path, *,
                      title: str | None = None) -> Path:
    """Recall@K against K (log2 axis) for one or more runs: ``{"name": {K: recall}}``,
    recall as a fraction in [0, 1]."""
    if not curves:
        raise ValueError("curves is empty: give at least one {K: recall} mapping")
    fig, ax = plt.subplots(figsize=(5.2, 3.6))
    all_ks: set[int] = set()
    for i, (name, c) in enumerate(curves.items()):
        ks = sorted(int(k) for k in c)
        all_ks.update(ks)
        r = [100 * float(c[k]) for k in ks]
        ax.plot(ks, r, marker="o", color=f"C{i}", label=name, ls="-" if i == 0 else "--")
        for k, v in zip(ks, r):  # this run's values above its points, the baselines' below theirs
            ax.annotate(f"{v:.1f}", (k, v), textcoords="offset points", xytext=(0, 5 if i == 0 else -11),
                        ha="center", fontsize=7, color="black" if i == 0 else f"C{i}")
    ks = sorted(all_ks)  # ticks of every curve, not only the last one's
    if ks and ks[-1] / max(ks[0], 1) >= 4:
        ax.set_xscale("log", base=2)
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.set_xlabel("K")
    ax.set_ylabel("Recall@K (%)")
    ax.set_title(title or "Recall@K")
    ax.margins(y=0.12)  # room for the values written above and below the points
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(0.0, -0.2), borderaxespad=0.0)  # below the axes
    fig.tight_layout()
    return _save(fig, out)


def plot_misclassified_neighbours(test_images: Any, train_images: Any, result: Mapping[str, Any],
                                  out: str | Path, *, max_pairs: int = 9,
                                  class_names: Sequence[str] | None = None) -> Path:
    """Two-head paper, Fig. 10: misclassified test images (top) above their nearest
    training image (bottom), from :func:`~deepmetric.report.diagnostics.misclassified_neighbours`.

    ``test_images`` / ``train_images`` are indexable collections of (H, W), (H, W, 3) or
    (3, H, W) arrays/tensors in [0, 1] or [0, 255], indexed like the embeddings.
    """
    idx = np.asarray(result["misclassified"])[:max_pairs]
    nb = np.asarray(result["neighbour"])[:max_pairs]
    n = max(1, len(idx))
    fig, axes = plt.subplots(2, n, figsize=(1.9 * n, 4.2), squeeze=False)

    def name(c: int) -> str:
        return class_names[c] if class_names is not None and 0 <= c < len(class_names) else str(c)

    for j in range(n):
        for r in range(2):
            axes[r][j].set_axis_off()
        if j >= len(idx):
            axes[0][j].text(0.5, 0.5, "nothing misclassified", ha="center", va="center")
            continue
        axes[0][j].imshow(_to_hwc(test_images[int(idx[j])]), cmap="gray")
        axes[0][j].set_title(f"true {name(int(result['true'][j]))}\npred {name(int(result['predicted'][j]))}",
                             fontsize=7)
        axes[1][j].imshow(_to_hwc(train_images[int(nb[j])]), cmap="gray")
        same = int(result["neighbour_label"][j]) == int(result["predicted"][j])
        axes[1][j].set_title(f"NN train: {name(int(result['neighbour_label'][j]))}", fontsize=7,
                             color="tab:red" if same else "k")
    share = result.get("share_neighbour_is_predicted", math.nan)
    fig.suptitle(f"misclassified test images (top) and nearest training image (bottom); "
                 f"neighbour has the predicted label for {100 * share:.1f}%", fontsize=9)
    fig.tight_layout()
    return _save(fig, out)


def plot_retrieval_grid(images: Any, labels: Any, examples: Mapping[str, Any], out: str | Path, *,
                        rows: Sequence[tuple[str, int]] | None = None,
                        class_names: Sequence[str] | None = None, title: str | None = None) -> Path:
    """Queries and their nearest neighbours as one picture (ALMN Fig. 8, two-head Fig. 9).

    ``examples`` is :func:`~deepmetric.report.diagnostics.retrieval_examples`' result; one row
    per query of ``rows`` (``[("random", q), ("worst", q), ...]``, default: its random then its
    worst queries): the query (black frame) then its ``k`` neighbours, framed green when they
    share the query's label and red when not, each titled with its rank and cosine.
    ``images`` is indexable like the embeddings: (H, W), (H, W, 3) or (3, H, W) arrays.
    """
    y = np.asarray(labels)
    if rows is None:
        rows = [("random", q) for q in examples["random"]] + [("worst", q) for q in examples["worst"]]
    k = int(examples["k"])
    n = max(1, len(rows))
    shown = [class_names[int(y[q])] for _, q in rows] if class_names is not None else None
    with _font_context(shown):  # hanzi class names need a CJK font
        return _draw_retrieval_grid(images, y, examples, rows, k, n, class_names, title, out)


def _draw_retrieval_grid(images, y, examples, rows, k, n, class_names, title, out) -> Path:
    fig, axes = plt.subplots(n, k + 1, figsize=(1.05 * (k + 1), 1.2 * n + 0.4), squeeze=False)

    def name(c: int) -> str:
        return str(class_names[c]) if class_names is not None and 0 <= c < len(class_names) else str(c)

    def framed(ax, img, color, text, text_color="k"):
        ax.imshow(_to_hwc(img), cmap="gray")
        ax.set_xticks([]), ax.set_yticks([])
        for spine in ax.spines.values():
            spine.set_edgecolor(color)
            spine.set_linewidth(3)
        ax.set_title(text, fontsize=6.5, color=text_color)

    for r, (kind, q) in enumerate(rows):
        framed(axes[r][0], images[int(q)], "black", f"{kind} query\n{name(int(y[q]))}"[:40])
        for j in range(k):
            ax = axes[r][j + 1]
            nb = int(examples["neighbours"][q][j])
            if nb < 0:
                ax.set_axis_off()
                continue
            ok = bool(examples["correct"][q][j])
            framed(ax, images[nb], "tab:green" if ok else "tab:red",
                   f"{j + 1}{' ok' if ok else ' x'}  {examples['similarity'][q][j]:.2f}",
                   "tab:green" if ok else "tab:red")
    fig.suptitle(title or "queries (left) and their nearest neighbours: green = same class, red = other class",
                 fontsize=8)
    fig.tight_layout()
    return _save(fig, out)


def _to_hwc(img: Any) -> np.ndarray:
    a = np.asarray(img.detach().cpu() if hasattr(img, "detach") else img, dtype=float)
    if a.ndim == 3 and a.shape[0] in (1, 3) and a.shape[-1] not in (1, 3):
        a = np.moveaxis(a, 0, -1)
    if a.ndim == 3 and a.shape[-1] == 1:
        a = a[..., 0]
    lo, hi = np.nanmin(a), np.nanmax(a)
    return (a - lo) / (hi - lo) if hi > lo else np.zeros_like(a)
