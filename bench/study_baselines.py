"""The raw-pixel baseline of a study's test split, computed once (the runs skip it when the
exact search is large: glyphs cross-family has ~63,000 test images).

    python bench/study_baselines.py studies/glyphs_cross_family.yaml
    # -> bench/studies/glyphs_cross_family/baselines.json

Uses the first run's config (every variant of a study shares the data), the test split as the
training loop evaluates it (its queries against its gallery where the split marks them) and
:func:`deepmetric.train.preflight.raw_pixel_baseline` without its size limit.  The untrained /
pretrained network baseline is in the runs themselves (``metrics.json`` ``baselines.epoch0``).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def main() -> None:
    from deepmetric.train.builders import build_dataset
    from deepmetric.train.config import config_from_dict
    from deepmetric.train.preflight import raw_pixel_baseline
    from deepmetric.train.study import load_study

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("study", help="a study file (studies/*.yaml)")
    ap.add_argument("--out", default=None, help="default bench/studies/<study name>/baselines.json")
    args = ap.parse_args()
    study = load_study(args.study)
    cfg = config_from_dict(study.runs[0].raw)
    sets = {"query": build_dataset(cfg, cfg.eval.split, train=False)}
    if cfg.eval.gallery_split is not None:
        sets["gallery"] = build_dataset(cfg, cfg.eval.gallery_split, train=False)
    t0 = time.perf_counter()
    metrics, desc = raw_pixel_baseline(sets, cfg, max_work=float("inf"))
    out = Path(args.out or ROOT / "bench" / "studies" / study.name / "baselines.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {"study": study.name, "split": cfg.eval.split, "images": sum(len(s) for s in sets.values()),
              "raw_pixels": {"label": desc, "metrics": metrics}, "seconds": round(time.perf_counter() - t0, 1),
              "command": f"python bench/study_baselines.py {args.study}"}
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
