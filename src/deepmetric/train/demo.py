"""``deepmetric demo``: the offline demo on the glyph benchmark (CPU, a few minutes).

Trains a heated-up BN embedding (heated-up softmax paper: BN head, l2-normalised class
weights, alpha = 16, then alpha x 1/4 and lr x 1/10 for the last third of training) with
a compact ResNet on glyphs of GB2312 characters rendered from the installed CJK fonts,
and evaluates Recall@{1,2,4,8} and NMI on the *unseen* test characters before heating-up
(at the heat-up epoch) and after it (at the end).  Writes, under ``--out``:
``last.pt`` (the final model: no validation split, nothing is selected), ``config.yaml``, ``log.jsonl``, ``metrics.json``,
``demo_metrics.json`` (before/after/timings) and the plots ``training_curves.png``,
``cosine_histograms.png`` (paper Fig. 4, test pairs) and ``recall_curve.png``.

The configuration is ``DEMO_CONFIG`` below; ``recipes/demo_glyphs.yaml`` is the same file
(a test keeps them identical) so ``deepmetric train recipes/demo_glyphs.yaml`` trains the
same model without the demo's summary and plots.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import yaml

from .config import apply_overrides, config_from_dict

__all__ = ["DEMO_CONFIG", "QUICK_OVERRIDES", "demo_config", "run_demo"]

DEMO_CONFIG = """\
# Offline demo (deepmetric demo): heated-up BN embedding on the glyph benchmark, CPU only.
name: demo_glyphs
description: >-
  Heated-up softmax (HBN) on glyphs: compact ResNet, 64-d BN head, heated softmax with
  alpha 16 -> 4 and lr x 1/10 after epoch 4 of 6; trained on 400 characters, zero-shot
  test on all 1,877 unseen characters (evaluated at the heat-up epoch and at the end).
data:
  name: glyphs
  options: {max_train_classes: 400, size: 32}
  transform: glyph
  num_workers: 1          # augmentation in one worker, the model on the other core
model:
  name: glyph_resnet
  options: {embedding_dim: 64, norm: bn}
loss:
  - name: heated_softmax
    options: {alpha: 16.0}
optim: {name: sgd, lr: 0.05, momentum: 0.9, weight_decay: 0.0005}
schedule:
  lr: {name: constant}
  temperature: {name: heat_up, at: 4, alpha_factor: 0.25, lr_factor: 0.1}
train: {epochs: 6, batch_size: 64, seed: 0, num_threads: 1, out_dir: runs/demo}
eval: {every: 4, ks: [1, 2, 4, 8]}
"""

#: ``--quick``: a seconds-long run for smoke tests (few characters and fonts).
QUICK_OVERRIDES = [
    "data.options={max_classes: 16, max_faces: 8, size: 32}",
    "train.epochs=2", "train.batch_size=32", "schedule.temperature.at=1", "eval.every=1",
    "data.num_workers=0",
]


def demo_config(out: str | Path = "runs/demo", *, quick: bool = False, overrides=None):
    raw = yaml.safe_load(DEMO_CONFIG)
    apply_overrides(raw, (QUICK_OVERRIDES if quick else []) + [f"train.out_dir={out}"] + list(overrides or []))
    return config_from_dict(raw)


def _plots(out: Path, snapshots: dict, at: int) -> list[Path]:
    """Training curves, test cosine histograms and recall curves before/after heating-up."""
    from deepmetric.report.diagnostics import pair_cosine_histograms
    from deepmetric.report.plots import plot_cosine_histograms, plot_recall_curve, plot_training_curves

    paths = [plot_training_curves(out / "log.jsonl", out / "training_curves.png",
                                  title="glyphs: heated-up BN (alpha 16 -> 4)")]
    hists, curves = {}, {}
    for name, snap in snapshots.items():
        hists[name] = pair_cosine_histograms(snap["embeddings"], snap["labels"], max_pairs=300_000)
        curves[name] = {int(k.split("@")[1]): v for k, v in snap["metrics"].items() if k.startswith("recall@")}
    if hists:
        paths.append(plot_cosine_histograms(hists, out / "cosine_histograms.png",
                                            title="test characters: cosine similarity of pairs"))
        paths.append(plot_recall_curve(curves, out / "recall_curve.png", title="test Recall@K"))
    return paths


def run_demo(out: str | Path = "runs/demo", *, quick: bool = False, overrides=None, overwrite: bool = False) -> dict:
    """Run the demo; returns the summary written to ``demo_metrics.json``."""
    from .builders import build_dataset
    from .loop import train

    t_start = time.perf_counter()
    cfg = demo_config(out, quick=quick, overrides=overrides)
    out = Path(cfg.train.out_dir)
    at = cfg.schedule.temperature.at

    # Rendering (or loading the cached glyphs) is timed on its own; train() then reads the cache.
    t0 = time.perf_counter()
    train_ds = build_dataset(cfg, "train", train=True)
    test_ds = build_dataset(cfg, "test", train=False)
    t_data = time.perf_counter() - t0
    cached = getattr(train_ds, "from_cache", None)
    print(f"[demo] glyphs: {train_ds.num_classes} train / {test_ds.num_classes} unseen test characters, "
          f"{len(train_ds)} / {len(test_ds)} images from {len(getattr(train_ds, 'faces', []))} font faces "
          f"({'loaded from cache' if cached else 'rendered'} in {t_data:.1f} s)", flush=True)

    snapshots: dict[str, dict] = {}

    def keep(epoch: int, metrics: dict, embedded: dict) -> None:
        if epoch == at:
            snapshots["before heat-up"] = {**embedded, "metrics": metrics, "epoch": epoch}
        snapshots["final"] = {**embedded, "metrics": metrics, "epoch": epoch}

    t0 = time.perf_counter()
    result = train(cfg, on_eval=keep, overwrite=overwrite)
    t_train = time.perf_counter() - t0
    if "final" in snapshots:
        snapshots["after heat-up"] = snapshots.pop("final")

    keys = [f"recall@{k}" for k in cfg.eval.ks] + ["map@r", "nmi"]
    before = snapshots.get("before heat-up", {}).get("metrics", {})
    after = snapshots.get("after heat-up", {}).get("metrics", {})
    t0 = time.perf_counter()
    plots = _plots(out, snapshots, at)
    t_plots = time.perf_counter() - t0
    summary = {
        "before_heat_up": {"epoch": at, "alpha": cfg.loss[0].options.get("alpha", 16.0),
                           **{k: before.get(k) for k in keys}},
        "after_heat_up": {"epoch": result.epochs_completed,
                          "alpha": cfg.loss[0].options.get("alpha", 16.0) * cfg.schedule.temperature.alpha_factor,
                          **{k: after.get(k) for k in keys}},
        "seconds": {"data": round(t_data, 1), "train_and_eval": round(t_train, 1),
                    "plots": round(t_plots, 1), "total": round(time.perf_counter() - t_start, 1)},
        "train_images": len(train_ds), "test_images": len(test_ds),
        "train_classes": int(train_ds.num_classes), "test_classes": int(test_ds.num_classes),
    }
    (out / "demo_metrics.json").write_text(json.dumps(summary, indent=2))

    def row(name: str, m: dict) -> str:
        return f"  {name:<22}" + "".join(f"{100 * m[k]:>10.2f}" if m.get(k) is not None else f"{'-':>10}"
                                         for k in keys)

    print("\n[demo] zero-shot retrieval on unseen characters (%):")
    print("  " + " " * 22 + "".join(f"{k:>10}" for k in keys))
    print(row(f"epoch {at}, alpha {summary['before_heat_up']['alpha']:g}", before))
    print(row(f"epoch {result.epochs_completed}, alpha {summary['after_heat_up']['alpha']:g}", after))
    print(f"\n[demo] total {summary['seconds']['total']:.0f} s (data {t_data:.0f} s, training+evaluation "
          f"{t_train:.0f} s, plots {t_plots:.0f} s)")
    print(f"[demo] checkpoint: {out / 'last.pt'}")
    print(f"[demo] metrics:    {out / 'demo_metrics.json'} (log: {out / 'log.jsonl'})")
    for p in plots:
        print(f"[demo] plot:       {p}")
    return summary
