"""The training options of issue 21 item 2 against each other on the cross-vendor *validation*
emoji (never the test): one row per finished run of ``recipes/emoji_transfer.yaml`` with one
option changed.

    python bench/emoji_transfer_ablations.py NAME=RUN_DIR [NAME=RUN_DIR ...] [--copy DIR]

Per run, from its own ``log.jsonl`` and ``metrics.json``: the validation cross-vendor Recall@1 and
MAP@R at the best epoch (the one ``best.pt`` keeps) and at the last, the WiSE-FT mixture chosen on
validation and its value, the epochs and the wall time.  ``--copy DIR`` copies each run's
``config.yaml``, ``metrics.json`` and ``log.jsonl`` to ``DIR/NAME/`` (the record, not the
checkpoints).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

R1, MAP = "cross_domain_recall@1", "cross_domain_map@r"


def row(name: str, run: Path) -> dict:
    from deepmetric.run.rundir import read_log

    val = [r for r in read_log(run, type="eval", strict=True) if r.get("split") == "val"]
    if not val:
        raise SystemExit(f"{run}: no validation evaluations in log.jsonl (a run with data.val_classes?)")
    best = max(val, key=lambda r: r[R1])  # ties: the earliest, as best.pt keeps it
    m = json.loads((run / "metrics.json").read_text())
    wise = m.get("wise_ft") or {}
    chosen = next((r for r in wise.get("val", []) if r["alpha"] == wise.get("alpha")), None)
    return {"name": name, "run": str(run), "best_epoch": best["epoch"], "best_r1": best[R1], "best_map": best[MAP],
            "last_epoch": val[-1]["epoch"], "last_r1": val[-1][R1], "last_map": val[-1][MAP],
            "wise_alpha": wise.get("alpha"), "wise_r1": chosen[R1] if chosen else None,
            "wise_map": chosen[MAP] if chosen else None, "epochs": m.get("epochs"),
            "wall_min": round(m["wall_time_s"] / 60, 1) if m.get("wall_time_s") else None}


def markdown(rows: list[dict]) -> str:
    p = lambda v: "-" if v is None else f"{100 * v:.2f}"  # noqa: E731
    out = ["| run | best epoch | val xv R@1 (best) | val xv MAP@R (best) | val xv R@1 (last) | WiSE a | "
           "val xv R@1 (WiSE) | val xv MAP@R (WiSE) | epochs | wall (min) |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['name']} | {r['best_epoch']} | {p(r['best_r1'])} | {p(r['best_map'])} | {p(r['last_r1'])} | "
                   f"{r['wise_alpha'] if r['wise_alpha'] is not None else '-'} | {p(r['wise_r1'])} | "
                   f"{p(r['wise_map'])} | {r['epochs']} | {r['wall_min']} |")
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="NAME=RUN_DIR")
    ap.add_argument("--copy", type=Path, default=None, help="copy each run's record to DIR/NAME/")
    args = ap.parse_args()
    rows = []
    for item in args.runs:
        name, _, path = item.partition("=")
        if not path:
            raise SystemExit(f"expected NAME=RUN_DIR, got {item!r}")
        rows.append(row(name, Path(path)))
        if args.copy is not None and (args.copy / name).resolve() != Path(path).resolve():  # a copied record
            dst = args.copy / name
            dst.mkdir(parents=True, exist_ok=True)
            for f in ("config.yaml", "metrics.json", "log.jsonl"):
                shutil.copy2(Path(path) / f, dst / f)
    print(markdown(rows), end="")


if __name__ == "__main__":
    main()
