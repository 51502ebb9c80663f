"""The tuning layer's overhead per trial: what a trial of ``deepmetric tune`` costs beyond its
training run.

For every finished or pruned trial of a tune directory, the trial's wall time in the storage
(Optuna's ``datetime_start`` to ``datetime_complete``: sampling, the config, the storage writes,
the heartbeat, the pruner, the test-metric record) is compared with the time spent inside
``train()`` (the ``train_seconds`` the objective records around the call).  The difference is
the tuning layer's overhead; the target is under 2 % of the trial's time.  Worker start-up
(Python and torch imports, once per worker process, not per trial) is reported apart from the
worker logs when they exist.

    python bench/tune_overhead.py runs/tune/glyphs_lr_alpha
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))



def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("tune_dir", help="a tune directory (holds tune.json and tune.db)")
    args = ap.parse_args(argv)
    import json

    from deepmetric.workflows.engine import optuna_module

    out = Path(args.tune_dir)
    rec = json.loads((out / "tune.json").read_text())
    storage = rec["storage"] if "***" not in rec["storage"] else None
    if storage is None:
        raise SystemExit("tune.json shows a storage with a masked password: pass it another way")
    study = optuna_module().load_study(study_name=rec["study_name"], storage=storage)
    rows = []
    for t in study.get_trials(deepcopy=False):
        if t.state.name not in ("COMPLETE", "PRUNED") or "train_seconds" not in t.user_attrs:
            continue
        wall = (t.datetime_complete - t.datetime_start).total_seconds()
        train = float(t.user_attrs["train_seconds"])
        rows.append((t.number, t.state.name.lower(), wall, train, wall - train, 100 * (wall - train) / wall))
    print("| trial | state | trial wall (s) | inside train() (s) | overhead (s) | overhead (%) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]:.1f} | {r[3]:.1f} | {r[4]:.2f} | {r[5]:.2f} |")
    if rows:
        over = [r[4] for r in rows]
        pct = [r[5] for r in rows]
        print(f"\n{len(rows)} trials: overhead median {statistics.median(over):.2f} s, max {max(over):.2f} s; "
              f"median {statistics.median(pct):.2f} % of the trial, max {max(pct):.2f} %; total "
              f"{sum(over):.1f} s of {sum(r[2] for r in rows):.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
