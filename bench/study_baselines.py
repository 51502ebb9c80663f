"""The baselines of a study's test split, computed once (the runs skip raw pixels when the
exact search is large: glyphs cross-family has ~63,000 test images).

    python bench/study_baselines.py studies/glyphs_cross_family.yaml
    # -> bench/studies/glyphs_cross_family/baselines.json

Uses the first run's config (every variant of a study shares the data), the test split as the
training loop evaluates it (its queries against its gallery where the split marks them):

* ``raw_pixels``: :func:`deepmetric.run.baselines.raw_pixel_baseline` without its size limit;
* ``pretrained_features`` (a pretrained backbone, or any with ``--features``): the backbone's
  pooled features before any training (e.g. EfficientNet-Lite0's 1,280 ImageNet features), what a user gets from the
  ImageNet network without metric learning;
* with ``eval.cross_domain`` each also gets its ``cross_domain_*`` metrics.

The network at epoch 0 (the untrained or pretrained network with its new embedding head) is in
the runs themselves (``metrics.json`` ``baselines.epoch0``).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def _with_cross_domain(metrics: dict, embeddings, dataset, cfg) -> dict:
    from deepmetric.run.evaluation import cross_domain_metrics

    if not cfg.eval.cross_domain:
        return metrics
    return {**metrics, **cross_domain_metrics({"embeddings": embeddings, "labels": np.asarray(dataset.labels)},
                                              dataset, cfg)}


def main() -> None:
    import torch

    from deepmetric.run.builders import build_test_sets
    from deepmetric.run.config_io import config_from_dict
    from deepmetric.run.baselines import backbone_features_baseline, pixel_rows, raw_pixel_baseline
    from deepmetric.workflows.study_file import load_study

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("study", help="a study file (studies/*.yaml)")
    ap.add_argument("--out", default=None, help="default bench/studies/<study name>/baselines.json")
    ap.add_argument("--features", action="store_true",
                    help="also the backbone's features when it is not pretrained (the untrained network)")
    args = ap.parse_args()
    study = load_study(args.study)
    cfg = config_from_dict(study.runs[0].raw)
    sets = build_test_sets(cfg)
    t0 = time.perf_counter()
    metrics, desc = raw_pixel_baseline(sets, cfg, max_work=float("inf"), max_bytes=float("inf"))
    if metrics is not None and cfg.eval.cross_domain:
        x, _ = pixel_rows(sets["query"], max_side=10**9)
        metrics = _with_cross_domain(metrics, x, sets["query"], cfg)
    record = {"study": study.name, "split": cfg.eval.split, "images": sum(len(s) for s in sets.values()),
              "raw_pixels": {"label": desc, "metrics": metrics}}
    if (args.features or cfg.model.options.get("pretrained")) and len(sets) == 1:
        torch.set_num_threads(cfg.train.num_threads or torch.get_num_threads())
        m, label, f = backbone_features_baseline(cfg, sets["query"])
        m = _with_cross_domain(m, f["embeddings"], sets["query"], cfg)
        record["pretrained_features"] = {"label": label, "metrics": m}
    record.update(seconds=round(time.perf_counter() - t0, 1), command=f"python bench/study_baselines.py {args.study}")
    out = Path(args.out or ROOT / "bench" / "studies" / study.name / "baselines.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
