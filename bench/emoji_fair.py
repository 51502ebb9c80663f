"""Run the fair emoji loss comparison (studies/emoji_fair.py): for each loss in order, its tune
(10 trials for every loss, finished or pruned, on the cross-vendor validation emoji; v1, kept as
history: protocol v2, bench/protocol_v2.py, replaces it), then its 3 seeds at the
chosen settings; the result files are copied to bench/studies/emoji_fair/ (with the baseline rows
of its baselines.json) and committed after each step, with bench/studies/CLAIMS.md rewritten
(bench/study_claims.py).  Resumable: a rerun continues the unfinished tune or seeds.

    nohup python bench/emoji_fair.py > runs/emoji_fair.log 2>&1 &
    python bench/emoji_fair.py --only BN HBN SM        # some losses
    python bench/emoji_fair.py --summary                # rewrite the tables from what finished
    python bench/emoji_fair.py --tunes bench/studies/emoji_fair/tunes   # the seeds only, at the
                                                        # committed tuned settings (no tuning)
"""
from __future__ import annotations

import argparse
import copy
import json
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "studies"))

import emoji_fair as spec  # noqa: E402

from deepmetric.workflows.study import run_study, write_results  # noqa: E402
from deepmetric.workflows.study_file import load_study  # noqa: E402

RUNS = ROOT / "runs"
TUNES = RUNS / "tune" / "emoji_fair"
COPY = ROOT / "bench" / "studies" / "emoji_fair"
TUNE_FILES = ("trials.md", "trials.csv", "best.yaml", "best_overrides.json", "optimization_history.png",
              "param_importances.png")


def tune(name: str, workers: int) -> bool:
    out = TUNES / name
    cmd = [sys.executable, "-m", "deepmetric.cli", "tune", str(ROOT / "recipes" / "emoji_fair.yaml"), "--space",
           str(ROOT / "spaces" / "emoji_fair" / f"{name}.yaml"), "--trials", str(spec.TRIALS), "--workers",
           str(workers), "--out", str(out)]
    print("$", " ".join(cmd), flush=True)
    ok = subprocess.call(cmd, cwd=ROOT) == 0
    dest = COPY / "tunes" / name
    dest.mkdir(parents=True, exist_ok=True)
    for f in TUNE_FILES:
        if (out / f).is_file():
            shutil.copy(out / f, dest / f)
    return ok and (out / "best_overrides.json").is_file()


def study(names: list[str], tunes: Path = TUNES):
    """The study restricted to the losses whose tune has finished (from_tune needs it), their
    tuned values read from ``tunes/<loss>/best_overrides.json``."""
    raw = yaml.safe_load((ROOT / "studies" / "emoji_fair.yaml").read_text())
    raw = copy.deepcopy(raw)
    raw["base"] = str(ROOT / "recipes" / "emoji_fair.yaml")
    # the tuned values last: the loss's own overrides (loss=[...]) would replace the tuned option
    raw["variants"] = {n: [*spec.LOSSES[n][0], {"from_tune": str(Path(tunes).resolve() / n)}] for n in names}
    raw["compare"] = [p for p in raw["compare"] if p[0] in names and p[1] in names]
    # written to a file: the study's worker processes (--workers > 1) load it from there
    path = RUNS / "studies" / "emoji_fair.tuned.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("# bench/emoji_fair.py: studies/emoji_fair.yaml restricted to the tuned losses\n"
                    + yaml.safe_dump(raw, sort_keys=False, width=120))
    return load_study(path, out_dir=RUNS / "studies" / "emoji_fair")


def baselines_markdown(record: dict) -> str:
    """The rows every table of the comparison carries: raw pixels and the untouched ImageNet
    network at the study's input size, on the same test emoji (``bench/study_baselines.py``'s
    ``baselines.json``)."""
    keys = ("cross_domain_recall@1", "cross_domain_map@r", "recall@1", "map@r")
    lines = ["", "## Baselines (the same test emoji, no training)", "",
             f"From `{record.get('command', 'bench/study_baselines.py')}`; the numbers are deterministic, so "
             "a variant's paired difference against them is its mean minus the value below.", "",
             "| baseline | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
    for name in ("raw_pixels", "pretrained_features"):
        entry = record.get(name)
        if entry and entry.get("metrics"):
            m = entry["metrics"]
            lines.append(f"| {entry['label']} | " + " | ".join(f"{m[k]:.4f}" if k in m else "-" for k in keys) + " |")
    return "\n".join(lines) + "\n"


def copy_study(s) -> list[Path]:
    paths = write_results(s)
    COPY.mkdir(parents=True, exist_ok=True)
    out = []
    for p in paths.values():
        shutil.copy(p, COPY / p.name)
        out.append(COPY / p.name)
    base = COPY / "baselines.json"  # python bench/study_baselines.py studies/emoji_fair.yaml
    if base.is_file() and (COPY / "summary.md").is_file():
        with open(COPY / "summary.md", "a") as f:
            f.write(baselines_markdown(json.loads(base.read_text())))
    return out


def commit(message: str) -> None:
    """Commit the copied results and the claims they settle (bench/studies/CLAIMS.md, rewritten)."""
    claims = ROOT / "bench" / "studies" / "CLAIMS.md"
    subprocess.run([sys.executable, str(ROOT / "bench" / "study_claims.py"), "--out", str(claims)], cwd=ROOT,
                   check=False)
    subprocess.run(["git", "add", "-f", str(COPY), str(claims)], cwd=ROOT, check=False)
    subprocess.run(["git", "commit", "-q", "-m", message, "--", str(COPY), str(claims)], cwd=ROOT, check=False)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="+", default=None, help="these losses (default: all, in the table's order)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--summary", action="store_true", help="train nothing: rewrite the tables")
    ap.add_argument("--tunes", type=Path, default=None,
                    help="tune nothing: run the seeds at the tuned settings in TUNES/<loss>/best_overrides.json "
                         "(e.g. bench/studies/emoji_fair/tunes, the committed ones; a fresh clone has no runs/tune)")
    args = ap.parse_args(argv)
    names = args.only or list(spec.LOSSES)
    unknown = [n for n in names if n not in spec.LOSSES]
    if unknown:
        raise SystemExit(f"unknown loss(es) {unknown}; the table has {list(spec.LOSSES)}")
    tunes = args.tunes if args.tunes is not None else TUNES
    done = [n for n in spec.LOSSES if (tunes / n / "best_overrides.json").is_file()]
    if args.summary:
        copy_study(study(done, tunes))
        return 0
    if args.tunes is not None:
        missing = [str(tunes / n / "best_overrides.json") for n in names if n not in done]
        if missing:
            raise SystemExit(f"--tunes {tunes}: no tuned settings for {len(missing)} loss(es): {', '.join(missing)}")
        s = study(done, tunes)
        result = run_study(s, workers=args.workers, only=names)
        copy_study(s)
        commit(f"bench/studies/emoji_fair: 3 seeds of {', '.join(names)} at the tuned settings of {tunes}")
        return 130 if result["interrupted"] else 0
    for name in names:
        if not tune(name, args.workers):
            print(f"[emoji_fair] {name}: the tune did not finish; rerun to continue", flush=True)
            return 1
        commit(f"bench/studies/emoji_fair: {name} tuned ({spec.TRIALS} trials on validation)")
        done = [n for n in spec.LOSSES if (TUNES / n / "best_overrides.json").is_file()]
        s = study(done)
        result = run_study(s, workers=args.workers, only=[name])
        copy_study(s)
        commit(f"bench/studies/emoji_fair: {name} 3 seeds at the tuned settings")
        if result["interrupted"]:
            return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
