"""Fill in the test metrics of ``best.pt`` for finished runs made before ``eval.test_selected``
(2026-11-24): with ``eval.test_every: 0`` such a run evaluated its test split only at the end,
so where validation chose an earlier epoch its ``metrics.json`` has ``selected.test: null`` and
a study's ``selected/`` cells cover only some runs ("(1 of 3 runs)").

    python bench/study_selected.py runs/studies/emoji_fair          # every run folder under it
    python bench/study_selected.py runs/studies/emoji_fair --dry-run

For each run folder (one holding ``metrics.json`` and ``best.pt``) whose ``selected.test`` is
null, ``best.pt`` is loaded with its own config and its test split is evaluated exactly as the
training loop's ``eval.test_selected`` step does (the same ``evaluate_split``, cross-vendor
search included); the metrics go into ``selected.test`` and ``metrics.json`` is rewritten
atomically, with ``selected.test_filled_by`` naming this script.  Nothing is chosen: the epoch
is the one validation chose during training.  Rerunning skips the runs already filled, so a
killed pass continues.  Then rewrite the study's tables (e.g. ``python bench/emoji_fair.py
--summary``).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def pending_runs(root: Path) -> list[Path]:
    """Run folders under ``root`` (itself included) whose best.pt has no test metrics yet."""
    from deepmetric.run import rundir as R

    out = []
    for metrics in sorted(Path(root).rglob(R.METRICS)):
        run = metrics.parent
        if ".study" in run.parts or not (run / R.BEST).is_file():
            continue
        summary = R.read_metrics(run)
        selected = summary.get("selected")
        if selected and selected.get("test") is None:
            out.append(run)
    return out


def fill_selected_test(run: Path, device: str = "cpu") -> dict[str, float]:
    """Evaluate ``run/best.pt`` on its test split and write the metrics into ``selected.test``."""
    import torch

    from deepmetric.run import rundir as R
    from deepmetric.run.builders import build_test_sets
    from deepmetric.run.embed import load_model_from_checkpoint
    from deepmetric.run.evaluation import evaluate_split

    model, losses, cfg, state = load_model_from_checkpoint(run / R.BEST, device)
    summary = R.read_metrics(run)
    if state.get("epoch") is not None and int(state["epoch"]) != int(summary["selected"]["epoch"]):
        raise SystemExit(f"{run / R.BEST}: epoch {state['epoch']}, but {run / R.METRICS} says validation chose "
                         f"epoch {summary['selected']['epoch']}; not filling it")
    sets = build_test_sets(cfg)
    with torch.no_grad():
        metrics = evaluate_split(model, sets, cfg, device=torch.device(device), losses=losses)[0]
    summary["selected"]["test"] = metrics
    summary["selected"]["test_filled_by"] = "bench/study_selected.py"
    R.write_metrics(run, summary)
    return metrics


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("root", type=Path, help="a study's output folder (or one run folder)")
    ap.add_argument("--dry-run", action="store_true", help="list the runs that would be evaluated")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args(argv)
    if not args.root.is_dir():
        raise SystemExit(f"{args.root}: not a folder")
    runs = pending_runs(args.root)
    print(f"[study_selected] {len(runs)} run(s) under {args.root} with best.pt not evaluated on test", flush=True)
    if args.dry_run:
        print("\n".join(str(r) for r in runs))
        return 0
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    for i, run in enumerate(runs, 1):
        t0 = time.perf_counter()
        m = fill_selected_test(run)
        shown = ", ".join(f"{k}={v:.4f}" for k, v in m.items() if k.endswith(("recall@1", "map@r")))
        print(f"[study_selected] {i}/{len(runs)} {run}: {shown} ({time.perf_counter() - t0:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
