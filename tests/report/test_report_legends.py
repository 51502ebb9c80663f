"""The report's legends never cover the curves (issue 32, item 17): no point of any drawn curve
lies inside a legend's box, on the training curves (many metrics, two splits, a baseline) and
on the Recall@K plot with baselines."""
import matplotlib
import numpy as np
import pytest

from deepmetric.report import plots
from deepmetric.report.diagnostics import read_training_log as read_log

matplotlib.use("Agg")


@pytest.fixture
def figures(monkeypatch):
    captured = []
    original = plots._save

    def grab(fig, out):
        fig.canvas.draw()
        captured.append(_covered_points(fig))
        return original(fig, out)

    monkeypatch.setattr(plots, "_save", grab)
    return captured


def _covered_points(fig) -> list[str]:
    """``"legend of AXES covers LINE at (x, y)"`` for every curve point inside a legend box."""
    found = []
    for holder in fig.axes:
        legend = holder.get_legend()
        if legend is None:
            continue
        box = legend.get_window_extent()
        for ax in fig.axes:
            for line in ax.get_lines():
                xy = ax.transData.transform(np.column_stack(line.get_data()).astype(float))
                inside = (xy[:, 0] >= box.x0) & (xy[:, 0] <= box.x1) & (xy[:, 1] >= box.y0) & (xy[:, 1] <= box.y1)
                if inside.any():
                    found.append(f"legend of {holder.get_title()!r} covers {line.get_label()!r}")
    return found


def _log(tmp_path):
    import json

    recs = [{"type": "step", "step": s, "epoch": s / 10, "loss": 5.0 / (1 + s) + 0.3 * np.sin(s), "lr": 0.1}
            for s in range(1, 81)]
    recs.append({"type": "baseline", "name": "epoch0", "label": "epoch 0 (pretrained network)", "split": "test",
                 "recall@1": 0.31})
    rng = np.random.default_rng(0)
    for epoch in range(1, 9):
        for split, level in (("val", 0.9), ("test", 0.5)):
            rec = {"type": "eval", "epoch": epoch, "split": split}
            for k, m in enumerate(["recall@1", "recall@2", "recall@4", "recall@8", "map@r", "r_precision", "nmi",
                                   "f1"]):
                rec[m] = float(np.clip(level + 0.05 * k - 0.3 * (m in ("map@r", "nmi")) + 0.02 * rng.standard_normal(),
                                       0, 1))
            recs.append(rec)
    path = tmp_path / "log.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return read_log(path)


def test_training_curve_legends_leave_the_curves_free(tmp_path, figures):
    plots.plot_training_curves(_log(tmp_path), tmp_path / "curves.png")
    assert figures == [[]]


def test_recall_curve_legend_leaves_the_curves_free(tmp_path, figures):
    curves = {"this run": {1: 0.95, 2: 0.97, 4: 0.99, 8: 1.0},
              "baseline: epoch 0 (pretrained network)": {1: 0.90, 2: 0.94, 4: 0.97, 8: 0.99},
              "baseline: raw pixels (28x28x1 = 784-d)": {1: 0.60, 2: 0.70, 4: 0.80, 8: 0.88}}
    plots.plot_recall_curve(curves, tmp_path / "recall.png")
    assert figures == [[]]
