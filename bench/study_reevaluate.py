"""Evaluate the finished runs of a study again, from their final checkpoints, with other
evaluation settings (e.g. more k-means restarts for NMI / F1), and compare the variants on the
new numbers by seed (the study's ``compare`` pairs).

    python bench/study_reevaluate.py studies/fashion_mnist_two_head.yaml \
        --set eval.kmeans_restarts=10 --metrics nmi f1 --name kmeans10
    # -> bench/studies/fashion_mnist_two_head/reevaluated_kmeans10.json (+ .md)

Each run's ``last.pt`` (the final model: nothing is selected) is loaded with its own config,
the overrides are applied to that config's ``eval`` keys only (the data, model and weights
stay as trained), the test split is embedded once and evaluated with ``eval.metrics`` =
``--metrics``.  Training is not touched; the study's own ``results.json`` is not changed.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def reevaluate_run(run_dir: Path, overrides: list[str], metrics: list[str]) -> dict[str, float]:
    """``final/<metric>`` of the run's ``last.pt`` on its test split with ``eval`` overrides."""
    import torch

    from deepmetric.run.builders import build_test_sets
    from deepmetric.run.config import config_to_dict
    from deepmetric.run.config_io import apply_overrides, config_from_dict
    from deepmetric.run.embed import load_model_from_checkpoint
    from deepmetric.run.evaluation import evaluate_model

    model, losses, cfg, _ = load_model_from_checkpoint(run_dir / "last.pt", "cpu")
    raw = config_to_dict(cfg)
    bad = [o for o in overrides if not o.startswith("eval.")]
    if bad:
        raise SystemExit(f"--set: only eval.* keys can change after training, got {bad}")
    apply_overrides(raw, list(overrides) + [f"eval.metrics=[{', '.join(metrics)}]", "eval.classification=false",
                                            "eval.train_neighbours=false", "eval.cross_domain=false"])
    cfg = config_from_dict(raw)
    sets = build_test_sets(cfg)
    with torch.no_grad():
        res, _ = evaluate_model(model, sets, cfg, device=torch.device("cpu"), losses=losses)
    return {f"final/{k}": float(v) for k, v in res.items()}


def main() -> None:
    import torch

    from deepmetric.report.study_tables import mean_ci, paired_differences
    from deepmetric.workflows.study_file import load_study

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("study", help="a study file (studies/*.yaml)")
    ap.add_argument("--set", nargs="+", default=[], metavar="eval.KEY=VALUE", help="eval overrides")
    ap.add_argument("--metrics", nargs="+", required=True, help="metrics to compute (e.g. nmi f1)")
    ap.add_argument("--name", required=True, help="suffix of the output files")
    ap.add_argument("--out-dir", default=None, help="default bench/studies/<study name>/")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    study = load_study(args.study)
    out_dir = Path(args.out_dir or ROOT / "bench" / "studies" / study.name)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows, t0 = [], time.perf_counter()
    for run in study.runs:
        if not run.finished or not (run.out_dir / "last.pt").is_file():
            print(f"{run.key}: not finished, skipped", flush=True)
            continue
        m = reevaluate_run(run.out_dir, args.set, args.metrics)
        print(f"{run.key}: " + ", ".join(f"{k} {v:.4f}" for k, v in m.items()), flush=True)
        rows.append({"benchmark": run.benchmark, "variant": run.variant, "seed": run.seed, **m})
    cols = sorted({k for r in rows for k in r if k.startswith("final/")})
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    summary = {v: {c: mean_ci([r.get(c) for r in rows if r["variant"] == v]) for c in cols} for v in variants}
    pairs = [p for a, b in study.compare for p in paired_differences(rows, a, b, cols)]
    record = {"study": study.name, "overrides": args.set, "metrics": args.metrics, "rows": rows,
              "summary": summary, "paired": pairs, "seconds": round(time.perf_counter() - t0, 1),
              "command": "python bench/study_reevaluate.py " + " ".join(sys.argv[1:])}
    (out_dir / f"reevaluated_{args.name}.json").write_text(json.dumps(record, indent=1) + "\n")
    lines = [f"# {study.name}: final models evaluated again ({', '.join(args.set) or 'same settings'})", "",
             f"`{record['command']}`", "", "| variant | runs | " + " | ".join(cols) + " |",
             "|---|---|" + "---|" * len(cols)]
    for v in variants:
        cells = [f"{100 * s['mean']:.1f} ± {100 * s['std']:.1f} [{100 * s['ci_low']:.1f}, {100 * s['ci_high']:.1f}]"
                 for s in (summary[v][c] for c in cols)]
        lines.append(f"| {v} | {summary[v][cols[0]]['n']} | " + " | ".join(cells) + " |")
    lines += ["", "Paired differences A - B by seed (points, mean [95 % t interval]):", "",
              "| A - B | pairs | " + " | ".join(cols) + " |", "|---|---|" + "---|" * len(cols)]
    for p in pairs:
        cells = [f"{100 * s['mean']:+.1f} [{100 * s['ci_low']:+.1f}, {100 * s['ci_high']:+.1f}]"
                 for s in (p["stats"][c] for c in cols)]
        lines.append(f"| {p['a']} - {p['b']} | {len(p['seeds'])} | " + " | ".join(cells) + " |")
    (out_dir / f"reevaluated_{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
