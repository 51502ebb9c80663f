"""Study tables: statistics over seeds, ``summary.md`` and ``summary.png``.

Statistics (:func:`mean_ci`): for values ``x_1..x_n``, ``mean = sum x_i / n``, ``sd`` with
``n - 1`` in the denominator, and ``mean +- t_{(1 + confidence) / 2, n-1} sd / sqrt(n)``
(Student's t).  Paired differences (:func:`paired_values`, summarised by
:func:`paired_differences` and by the bench scripts' claim tables) use ``d_i = a_i - b_i`` over
the seeds at which both variants have a value.  Rows are the study's results rows (``benchmark``,
``variant``, ``seed``, ``final/<metric>``, ``selected/<metric>``, ...).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

__all__ = ["mean_ci", "last_gain", "metric_columns", "summarize", "paired_values", "paired_differences",
           "summary_markdown",
           "plot_summary", "format_number"]


def last_gain(curve: Sequence[float]) -> float | None:
    """How much the best of a validation curve's last two values exceeds the best of every value
    before them (the convergence rule of bench/studies/protocol_v2/PREREGISTRATION.md: a curve has
    flattened when this is at most 0.5 points); None with fewer than three values."""
    if len(curve) < 3:
        return None
    return max(curve[-2:]) - max(curve[:-2])


def mean_ci(values: Sequence[float], confidence: float = 0.95) -> dict:
    """``{n, mean, std, ci_low, ci_high, half_width}`` of ``values`` (NaN/None dropped).

    ``std`` is the sample standard deviation (denominator ``n - 1``); the interval is
    ``mean +- t_{(1 + confidence) / 2, n - 1} * std / sqrt(n)`` (Student's t).  With one
    value ``std`` and the interval are NaN; with none everything but ``n`` is NaN.
    """
    from scipy import stats

    xs = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    n = len(xs)
    nan = float("nan")
    if n == 0:
        return {"n": 0, "mean": nan, "std": nan, "ci_low": nan, "ci_high": nan, "half_width": nan}
    mean = math.fsum(xs) / n
    if n == 1:
        return {"n": 1, "mean": mean, "std": nan, "ci_low": nan, "ci_high": nan, "half_width": nan}
    std = math.sqrt(math.fsum((x - mean) ** 2 for x in xs) / (n - 1))
    half = float(stats.t.ppf(0.5 + confidence / 2, n - 1)) * std / math.sqrt(n)
    return {"n": n, "mean": mean, "std": std, "ci_low": mean - half, "ci_high": mean + half, "half_width": half}


def metric_columns(rows: Sequence[dict], wanted: Sequence[str] | None = None) -> list[str]:
    """The numeric metric columns of ``rows``: ``wanted`` if given, else every ``final/*``,
    then ``selected/*``, then ``wise/*`` (the WiSE-FT mixture chosen on validation) column, then
    ``wall_time_s`` and ``images_per_s``."""
    if wanted:
        return list(wanted)
    seen: dict[str, None] = {}
    for r in rows:
        for k in r:
            seen.setdefault(k, None)
    final = [k for k in seen if k.startswith("final/")]
    sel = [k for k in seen if k.startswith("selected/") and k != "selected/epoch"]
    wise = [k for k in seen if k.startswith("wise/") and k != "wise/alpha"]
    return final + sel + wise + ["wall_time_s", "images_per_s"]


def summarize(rows: Sequence[dict], metrics: Sequence[str], confidence: float = 0.95) -> list[dict]:
    """One record per (benchmark, variant) in row order: ``{benchmark, variant, n_runs,
    seeds, stats: {metric: mean_ci(...)}}``."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["benchmark"], r["variant"]), []).append(r)
    out = []
    for (b, v), rs in groups.items():
        out.append({"benchmark": b, "variant": v, "n_runs": len(rs), "seeds": [r["seed"] for r in rs],
                    "stats": {m: mean_ci([r.get(m) for r in rs], confidence) for m in metrics}})
    return out


def paired_values(rows: Sequence[dict], a: str, b: str, metric: str, key: str = "variant") -> tuple[list[int], list[float]]:
    """The seeds (sorted) at which the rows whose ``key`` is ``a`` and those whose ``key`` is
    ``b`` both hold a finite ``metric``, and ``d_i = metric(a, seed_i) - metric(b, seed_i)`` at
    each.  A missing value (None, or "" as read from a CSV: a diverged run without a model)
    leaves its seed out of the pairing.  Seeds are read with ``int`` (a CSV gives strings)."""
    def by_seed(name: str) -> dict[int, float]:
        out = {}
        for r in rows:
            v = r.get(metric)
            if r.get(key) == name and v not in (None, "") and math.isfinite(float(v)):
                out[int(r["seed"])] = float(v)
        return out

    x, y = by_seed(a), by_seed(b)
    seeds = sorted(set(x) & set(y))
    return seeds, [x[s] - y[s] for s in seeds]


def paired_differences(rows: Sequence[dict], a: str, b: str, metrics: Sequence[str],
                       confidence: float = 0.95) -> list[dict]:
    """Per benchmark: :func:`paired_values` of each metric summarised with :func:`mean_ci`;
    ``seeds`` are those both variants ran (a metric's ``n`` counts those with both values)."""
    out = []
    for bench in dict.fromkeys(r["benchmark"] for r in rows):
        here = [r for r in rows if r["benchmark"] == bench]
        ran = {(r["variant"], r["seed"]) for r in here}
        seeds = sorted(s for (v, s) in ran if v == a and (b, s) in ran)
        stats = {m: mean_ci(paired_values(here, a, b, m)[1], confidence) for m in metrics}
        out.append({"benchmark": bench, "a": a, "b": b, "seeds": seeds, "stats": stats})
    return out


# --------------------------------------------------------------------------- writing results
def format_number(x: float | None, digits: int = 4) -> str:
    if x is None or not math.isfinite(x):
        return "-"
    if abs(x) >= 100:
        return f"{x:,.0f}"
    return f"{x:.{digits}f}"


def _cell(st: dict, runs: int | None = None) -> str:
    """``mean ± sd [CI]`` of one metric; when only some of the variant's ``runs`` have the metric
    (e.g. ``selected/`` test metrics, measured only where the best validation epoch was also
    tested), the cell says over how many, so that one seed's value never reads as the mean."""
    if st["n"] == 0:
        return "-"
    some = f" ({st['n']} of {runs} runs)" if runs is not None and st["n"] < runs else ""
    if st["n"] == 1:
        return format_number(st["mean"]) + some
    return (f"{format_number(st['mean'])} ± {format_number(st['std'])} "
            f"[{format_number(st['ci_low'])}, {format_number(st['ci_high'])}]{some}")


def summary_markdown(study, rows: list[dict], metrics: list[str], groups: list[dict],
                     pairs: list[dict], plot: Path | None) -> str:
    """``summary.md`` of a study: per benchmark the variants' cells (:func:`mean_ci`), the
    paired differences, and one row per run.  ``study`` gives ``name``, ``description``,
    ``confidence``, ``variants``, ``seeds``, ``benchmarks`` and ``runs`` (each with ``key`` and
    ``finished``), as :class:`deepmetric.workflows.study.Study` does."""
    pct = round(100 * study.confidence)
    done = sum(r.finished for r in study.runs)
    lines = [f"# Study {study.name}", ""]
    if study.description:
        lines += [study.description.strip(), ""]
    lines += [f"{done} of {len(study.runs)} runs finished "
              f"({len(study.variants)} variants x {len(study.seeds)} seeds"
              + (f" x {len(study.benchmarks)} benchmarks" if study.benchmarks != [None] else "") + "). "
              f"Cells: mean ± sample standard deviation [{pct} % Student-t confidence interval] over seeds; "
              "`final/` = the model at the end of training, `selected/` = the model selected on "
              "validation classes; both evaluated on the test classes (`selected/` missing where the "
              "selected epoch's test split was not evaluated: runs made before `eval.test_selected`, "
              "with `eval.test_every: 0`; a cell over fewer runs than its row says so).", ""]
    tested = any(k.startswith(("final/", "selected/")) and k != "selected/epoch" for r in rows for k in r)
    if rows and not tested:  # eval.test: false in every run (a protocol that keeps the test split out of sight)
        lines += ["No finished run evaluated the test split (as with `eval.test: false`): the tables hold no test "
                  "metric. Each run's validation curve is in its `log.jsonl`, its chosen epoch in "
                  "`metrics.json`.", ""]
    for bench in study.benchmarks:
        bname = bench or ""
        gs = [g for g in groups if g["benchmark"] == bname]
        if bench is not None:
            lines += [f"## {bench}", ""]
        if not gs:
            lines += ["(no finished run yet)", ""]
            continue
        lines.append("| variant | runs | " + " | ".join(metrics) + " |")
        lines.append("|---|---|" + "---|" * len(metrics))
        for g in gs:
            lines.append(f"| {g['variant']} | {g['n_runs']} | "
                         + " | ".join(_cell(g["stats"][m], g["n_runs"]) for m in metrics) + " |")
        lines.append("")
        bp = [p for p in pairs if p["benchmark"] == bname]
        if bp:
            lines += [f"Paired differences A − B (same seed), mean ± sd [{pct} % CI]:", "",
                      "| A − B | pairs | " + " | ".join(metrics) + " |",
                      "|---|---|" + "---|" * len(metrics)]
            for p in bp:
                lines.append(f"| {p['a']} − {p['b']} | {len(p['seeds'])} | "
                             + " | ".join(_cell(p["stats"][m]) for m in metrics) + " |")
            lines.append("")
    lines += ["## Runs", "", "| run | wall time (s) | images/s | " + " | ".join(metrics[:4]) + " |",
              "|---|---|---|" + "---|" * len(metrics[:4])]
    for r in rows:
        key = "/".join(p for p in (r["benchmark"], r["variant"], f"seed{r['seed']}") if p)
        lines.append(f"| {key} | {format_number(r.get('wall_time_s'), 1)} | {format_number(r.get('images_per_s'), 1)} | "
                     + " | ".join(format_number(r.get(m)) for m in metrics[:4]) + " |")
    pending = [run.key for run in study.runs if not run.finished]
    if pending:
        lines += ["", f"Pending: {', '.join(pending)}"]
    if plot is not None:
        lines += ["", f"![means with {pct} % CI]({plot.name})"]
    return "\n".join(lines) + "\n"


def plot_summary(groups: list[dict], metrics: list[str], out: Path, confidence: float = 0.95) -> Path | None:
    """One panel per metric: the mean per variant (one colour per benchmark) with the
    confidence interval as error bars."""
    metrics = [m for m in metrics if any(g["stats"][m]["n"] for g in groups)][:12]
    if not groups or not metrics:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    benches = list(dict.fromkeys(g["benchmark"] for g in groups))
    variants = list(dict.fromkeys(g["variant"] for g in groups))
    cols = min(3, len(metrics))
    rows = math.ceil(len(metrics) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
    width = 0.8 / len(benches)
    for ax, m in zip(axes.flat, metrics):
        for j, b in enumerate(benches):
            xs, ys, errs = [], [], []
            for i, v in enumerate(variants):
                g = next((g for g in groups if g["benchmark"] == b and g["variant"] == v), None)
                if g is None or g["stats"][m]["n"] == 0:
                    continue
                st = g["stats"][m]
                xs.append(i + (j - (len(benches) - 1) / 2) * width)
                ys.append(st["mean"])
                errs.append(st["half_width"] if math.isfinite(st["half_width"]) else 0.0)
            ax.errorbar(xs, ys, yerr=errs, fmt="o", capsize=3, label=b or None)
        ax.set_xticks(np.arange(len(variants)))
        ax.set_xticklabels(variants, rotation=45, ha="right", fontsize=8)
        ax.set_title(m, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    for ax in list(axes.flat)[len(metrics):]:
        ax.axis("off")
    if len(benches) > 1:
        axes.flat[0].legend(fontsize=7)
    fig.suptitle(f"mean with {round(100 * confidence)} % CI over seeds", fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return out
