"""Where the time of one training run goes (issue 30: make a run cheaper where it does not change
the result).  Runs one recipe (default: recipes/emoji_fair.yaml, 1 epoch, 1 thread) under
cProfile and reports the cumulative wall time of the parts of a run, each a function of the
code path (a part's time includes the parts nested in it, as marked):

    python bench/profile_run.py [--recipe R] [--epochs 1] [--threads 1] [KEY=VALUE ...]

The machine may be shared: the shares matter more than the seconds (give the load average with
them).
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

#: (label, file suffix, function name): the parts of a run, in the order of a run
PARTS = [
    ("set-up: data arrays, splits (build_split)", "run/builders.py", "build_split"),
    ("set-up: pre-flight checks", "train/checks.py", "check_run"),
    ("set-up: head initialisation (PCA)", "train/setup.py", "_init_head"),
    ("train: images decoded + augmented (dataset __getitem__)", "data/emoji.py", "__getitem__"),
    ("train: batch collation", "_utils/collate.py", "default_collate"),
    ("train: forward, model + loss (TrainingModule.forward)", "train/module.py", "forward"),
    ("train: backward", "torch/_tensor.py", "backward"),
    ("train: optimiser step", "amp/grad_scaler.py", "step"),
    ("eval: all evaluations (Evaluator, every epoch)", "train/evaluator.py", "__call__"),
    ("eval:   embedding the split (compute_embeddings, all calls)", "run/embed.py", "compute_embeddings"),
    ("eval:   k-NN + metrics, all vs all (evaluate)", "evaluate/engine.py", "evaluate"),
    ("eval:   k-NN + metrics, cross-vendor (evaluate_cross_domain)", "evaluate/cross_domain.py",
     "evaluate_cross_domain"),
    ("after: best.pt on test (test_selected)", "train/evaluator.py", "test_selected"),
    ("after: WiSE-FT (4 mixtures on validation + test)", "train/wise_ft.py", "run_wise_ft"),
    ("checkpoints written (save_checkpoint)", "run/checkpoint.py", "save_checkpoint"),
]


def part_times(stats: pstats.Stats) -> dict[str, tuple[float, int]]:
    """label -> (cumulative seconds, calls), over every function matching the part (the
    recursion-safe cumulative time cProfile keeps for each function)."""
    out = {}
    for label, suffix, name in PARTS:
        total, calls = 0.0, 0
        for (filename, _, func), (_cc, nc, _tt, ct, _callers) in stats.stats.items():
            if func == name and filename.replace(os.sep, "/").endswith(suffix):
                total += ct
                calls += nc
        out[label] = (total, calls)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", default=str(ROOT / "recipes" / "emoji_fair.yaml"))
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dump", default=None, help="also write the raw profile here (pstats)")
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    args = ap.parse_args(argv)
    from deepmetric.run.config_io import load_config
    from deepmetric.train.loop import train

    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(args.recipe, [f"train.epochs={args.epochs}", f"train.num_threads={args.threads}",
                                        f"train.out_dir={tmp}/run", "train.progress=false", *args.overrides])
        prof = cProfile.Profile()
        t0, load0 = time.perf_counter(), os.getloadavg()
        prof.enable()
        result = train(cfg)
        prof.disable()
        wall = time.perf_counter() - t0
    if args.dump:
        prof.dump_stats(args.dump)
    stats = pstats.Stats(prof)
    print(f"\nrecipe {args.recipe} {args.overrides}, {args.epochs} epoch(s), {args.threads} thread(s); "
          f"load average {load0[0]:.1f} -> {os.getloadavg()[0]:.1f}")
    print(f"run: {wall:.1f} s wall (profiled), {result.epochs_completed} epochs, {result.iteration} steps\n")
    print("| part | seconds | share of the run | calls |\n|---|---|---|---|")
    for label, (sec, calls) in part_times(stats).items():
        print(f"| {label} | {sec:.1f} | {100 * sec / wall:.1f} % | {calls} |")
    print(f"\nfinal metrics: {result.metrics}\nselected: {result.selected}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
