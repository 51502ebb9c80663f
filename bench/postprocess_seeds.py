"""Does the validation-chosen post-processing raise test cross-vendor MAP@R? Paired over seeds.

    python bench/postprocess_seeds.py RUN_DIR [RUN_DIR ...] [--out bench/results/postprocess_seeds.md]
                                      [--checkpoint auto|wise.pt|best.pt|last.pt] [--device auto]

Each RUN_DIR is a finished run of ``recipes/emoji_transfer.yaml`` (one per seed: ``deepmetric
train recipes/emoji_transfer.yaml train.seed=S train.out_dir=runs/emoji_transfer_sS``). For
each run, its validation-chosen model (``--checkpoint auto``: wise.pt, else best.pt, else
last.pt) embeds the validation split (``data.val_classes``) and the test split once (the test
transform). The post-processing (whiten, dba, aqe) is chosen on the *validation* cross-vendor
MAP@R (:func:`deepmetric.evaluate.postprocess_choice.choose_postprocess`; a run without domains
uses all-vs-all MAP@R), then the test split is measured with and without it: cross-vendor
Recall@1 and MAP@R. The table gives each seed, the means and the paired difference's mean with
its 95 % Student-t interval across seeds (report.study_tables.mean_ci). The test split chooses
nothing. Writes the Markdown file and a JSON file beside it.
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

CHECKPOINTS = ("wise.pt", "best.pt", "last.pt")


def pick_checkpoint(run_dir: Path, name: str) -> Path:
    if name != "auto":
        path = run_dir / name
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such checkpoint")
        return path
    for n in CHECKPOINTS:
        if (run_dir / n).is_file():
            return run_dir / n
    raise FileNotFoundError(f"{run_dir}: none of {', '.join(CHECKPOINTS)} (is it a finished run of deepmetric train?)")


def metrics(x, labels, domains, steps, ks=(1,)) -> dict:
    """Recall@1 and MAP@R after ``steps``: cross-domain means with ``domains``, else all-vs-all."""
    from deepmetric.evaluate import evaluate, evaluate_cross_domain

    if domains is not None:
        m = evaluate_cross_domain(x, labels, domains, ks=ks, metrics=("recall", "map@r"), postprocess=steps)["mean"]
    else:
        m = evaluate(x, labels, ks=ks, metrics=("recall", "map@r"), postprocess=steps)
    return {"recall@1": float(m["recall@1"]), "map@r": float(m["map@r"])}


def one_run(run_dir: Path, checkpoint: str, device: str) -> dict:
    import torch

    from deepmetric.evaluate.postprocess_choice import choose_postprocess
    from deepmetric.run.builders import build_split
    from deepmetric.run.device import resolve_device
    from deepmetric.run.embed import compute_embeddings, dataset_domains, load_model_from_checkpoint
    from deepmetric.workflows.tune_postprocess import validation_embeddings

    t0 = time.perf_counter()
    ckpt = pick_checkpoint(run_dir, checkpoint)
    dev = resolve_device(device, name="--device")
    model, _, cfg, _ = load_model_from_checkpoint(ckpt, dev)
    cfg.eval.cross_domain = True  # domains when the data has them (the emoji vendors)
    val = validation_embeddings(model, cfg, device=dev)
    test_ds = build_split(cfg, "test", train=False)
    with torch.no_grad():
        t = compute_embeddings(model, test_ds, batch_size=cfg.eval.batch_size, device=dev)
    dom = dataset_domains(test_ds)
    metric = "cross_domain_map@r" if val["domains"] is not None else "map@r"
    choice = choose_postprocess(val["embeddings"], val["labels"], domains=val["domains"], metric=metric, ks=(1,))
    x, y, d = np.asarray(t["embeddings"], np.float32), np.asarray(t["labels"]), None if dom is None else dom[0]
    return {"run": _rel(run_dir), "checkpoint": ckpt.name, "seed": cfg.train.seed, "cross_domain": d is not None,
            "chosen": choice["spelled"], "steps": choice["steps"],
            "val_without": choice["baseline"], "val_with": choice["value"],
            "test_without": metrics(x, y, d, []), "test_with": metrics(x, y, d, choice["steps"]),
            "seconds": round(time.perf_counter() - t0, 1)}


def _rel(path) -> str:
    """``path`` relative to the repository when inside it (committed results carry no absolute paths)."""
    p = Path(path).resolve()
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else Path(path).name


def summarise(runs: list[dict]) -> dict:
    from deepmetric.report.study_tables import mean_ci

    out = {}
    for m in ("recall@1", "map@r"):
        without = [r["test_without"][m] for r in runs]
        with_ = [r["test_with"][m] for r in runs]
        out[m] = {"without": mean_ci(without), "with": mean_ci(with_),
                  "paired_difference": mean_ci([b - a for a, b in zip(without, with_)])}
    return out


def pct(v: float) -> str:
    return "n/a" if v != v else f"{100 * v:.2f}"


def markdown(runs: list[dict], summary: dict, command: str) -> str:
    xv = "cross-vendor " if all(r["cross_domain"] for r in runs) else ""
    lines = ["# Post-processing chosen on validation: test with and without, paired over seeds", "",
             f"`{command}`", "",
             f"Test {xv}Recall@1 / MAP@R in %; the post-processing of each seed chosen on its validation "
             f"{xv}MAP@R (the test chose nothing).", "",
             "| run | seed | chosen on validation | val MAP@R without -> with | test R@1 without | test R@1 with "
             "| test MAP@R without | test MAP@R with |", "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        lines.append(f"| {Path(r['run']).name}/{r['checkpoint']} | {r['seed']} | {r['chosen']} | "
                     f"{pct(r['val_without'])} -> {pct(r['val_with'])} | {pct(r['test_without']['recall@1'])} | "
                     f"{pct(r['test_with']['recall@1'])} | {pct(r['test_without']['map@r'])} | "
                     f"{pct(r['test_with']['map@r'])} |")
    lines += ["", "| test metric | without (mean) | with (mean) | paired difference, mean [95 % CI] | seeds |",
              "|---|---|---|---|---|"]
    for m, s in summary.items():
        d = s["paired_difference"]
        lines.append(f"| {xv}{m} | {pct(s['without']['mean'])} | {pct(s['with']['mean'])} | "
                     f"{pct(d['mean'])} [{pct(d['ci_low'])}, {pct(d['ci_high'])}] | {d['n']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="run directories, one per seed")
    ap.add_argument("--checkpoint", default="auto", help="auto (wise.pt, best.pt, last.pt) or a file name")
    ap.add_argument("--device", default="auto", help="where the models embed (auto, cpu, cuda[:i])")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "postprocess_seeds.md"))
    args = ap.parse_args(argv)
    runs = []
    for r in args.runs:
        runs.append(one_run(Path(r), args.checkpoint, args.device))
        print(json.dumps({k: v for k, v in runs[-1].items() if k != "steps"}), flush=True)
    summary = summarise(runs)
    command = "python bench/postprocess_seeds.py " + " ".join(_rel(r) for r in args.runs)
    text = markdown(runs, summary, command)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    out.with_suffix(".json").write_text(json.dumps({"runs": runs, "summary": summary}, indent=1) + "\n")
    print(text)
    print(f"wrote {out} and {out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
