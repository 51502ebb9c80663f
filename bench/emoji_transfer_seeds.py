"""The emoji transfer recipe over seeds against its baselines, cross-vendor on the test emoji
(issue 21's bar: the recipe's embedding beats raw pixels and the ImageNet features at the same
input size by >= 10 Recall@1 and >= 5 MAP@R points, over 3 seeds, with the 95 % CI of the paired
difference above 0; and beats its own backbone's pooled features).

    python bench/emoji_transfer_seeds.py RUN_DIR [RUN_DIR ...] --out bench/studies/emoji_transfer

Each RUN_DIR is a finished ``deepmetric train recipes/emoji_transfer.yaml train.seed=S`` run.
Per run:

* **the recipe's embedding**: the model the recipe hands the user, chosen on validation only:
  ``wise.pt`` (the WiSE-FT mixture chosen on cross-vendor validation; a = 1 is the fine-tuned
  ``best.pt``), its test metrics as the run recorded them (``metrics.json`` ``wise_ft.test``);
* **its own backbone's pooled features**: the same checkpoint's pooled 1,280-d features before
  the embedding head (``output="features"``), computed here; when the model pools by other than
  the average (``model.options.pool: gem``), also the same checkpoint's **average**-pooled
  features, the issue's "pooled backbone features before the head";
* the fine-tuned model at the last epoch (``final``), for reading only.

Once (they do not depend on the seed): **raw pixels** and the **untouched ImageNet network's
pooled features** at the run's input size, and the ImageNet features at 128 px as a reference
(what a user who indexes ImageNet features at a larger size gets).  When the model pools by
other than the average, the ImageNet features are computed with both poolings, and the bar must
hold against each (a pooling that helps the untouched network too earns the recipe nothing). Every number is the
cross-vendor search (each vendor's images as queries against the other vendors' images, the mean
over vendors), as in the runs.

The paired difference of a seed is its recipe metric minus the baseline's (the baselines are
deterministic, so pairing is by seed); mean, sample sd and the Student-t 95 % interval over seeds
come from :func:`deepmetric.report.study_tables.mean_ci`.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

METRICS = ("cross_domain_recall@1", "cross_domain_map@r")
SHORT = {"cross_domain_recall@1": "xv R@1", "cross_domain_map@r": "xv MAP@R"}
MARGINS = {"cross_domain_recall@1": 0.10, "cross_domain_map@r": 0.05}   # issue 21's bar


def _xv(metrics: dict) -> dict:
    return {k: float(metrics[k]) for k in METRICS}


def _test_set(cfg):
    from deepmetric.run.builders import build_split

    return build_split(cfg, cfg.eval.split, train=False)


def _pools(cfg) -> list[str]:
    """The average (the issue's baseline) and, if different, the recipe's own pooling."""
    pool = cfg.model.options.get("pool", "avg")
    return ["avg"] if pool == "avg" else ["avg", pool]


def _pool_name(pool: str) -> str:
    return "" if pool == "avg" else f", {'GeM' if pool == 'gem' else pool} pooling"


def baselines(cfg, threads: int) -> dict:
    """Raw pixels and ImageNet features at the run's size, ImageNet features at 128 px; the
    ImageNet features with average pooling and, if the recipe pools otherwise, with its pooling."""
    import torch

    from deepmetric.run.config import config_to_dict
    from deepmetric.run.config_io import apply_overrides, config_from_dict
    from deepmetric.run.evaluation import cross_domain_metrics
    from deepmetric.run.baselines import backbone_features_baseline, pixel_rows

    def changed(*overrides):
        raw = config_to_dict(cfg)
        apply_overrides(raw, list(overrides))
        return config_from_dict(raw)

    torch.set_num_threads(threads)
    out = {}
    test = _test_set(cfg)
    size = cfg.data.options.get("size")
    x, _ = pixel_rows(test, max_side=10**9)
    out[f"raw pixels ({size} px)"] = _xv(cross_domain_metrics({"embeddings": x, "labels": np.asarray(test.labels)},
                                                              test, cfg))
    for pool in _pools(cfg):
        c = changed(f"model.options.pool={pool}")
        _, label, f = backbone_features_baseline(c, test)
        out[f"ImageNet features ({size} px, {f['embeddings'].shape[1]}-d{_pool_name(pool)})"] = _xv(
            cross_domain_metrics(f, test, c))
    if size != 128:
        t128 = _test_set(changed("data.options.size=128"))
        for pool in _pools(cfg):
            c = changed("data.options.size=128", f"model.options.pool={pool}")
            _, _, f = backbone_features_baseline(c, t128)
            out[f"ImageNet features (128 px, {f['embeddings'].shape[1]}-d{_pool_name(pool)}), reference"] = _xv(
                cross_domain_metrics(f, t128, c))
    return out


def run_numbers(run: Path, threads: int) -> dict:
    """The recipe's embedding and its own backbone's pooled features, cross-vendor on test."""
    import torch

    from deepmetric.run.embed import compute_embeddings, load_model_from_checkpoint
    from deepmetric.run.evaluation import cross_domain_metrics

    m = json.loads((run / "metrics.json").read_text())
    ckpt = run / ("wise.pt" if (run / "wise.pt").is_file() else "best.pt" if (run / "best.pt").is_file()
                  else "last.pt")
    recipe = m.get("wise_ft", {}).get("test") if ckpt.name == "wise.pt" else (m.get("selected") or m["final"])["test"]
    torch.set_num_threads(threads)
    model, _, cfg, state = load_model_from_checkpoint(ckpt)
    test = _test_set(cfg)
    with torch.no_grad():
        f = compute_embeddings(model, test, batch_size=cfg.eval.batch_size, output="features")
    own = _xv(cross_domain_metrics(f, test, cfg))
    own_avg = None
    if model.pool != "avg":  # the same checkpoint's average-pooled features: the baseline
        model.pool = "avg"
        with torch.no_grad():
            f = compute_embeddings(model, test, batch_size=cfg.eval.batch_size, output="features")
        own_avg = _xv(cross_domain_metrics(f, test, cfg))
    return {"run": str(run), "seed": int(cfg.train.seed), "checkpoint": ckpt.name,
            "wise_alpha": m.get("wise_ft", {}).get("alpha"),
            "recipe": _xv(recipe), "own_backbone_features": own, "own_backbone_avg_features": own_avg,
            # best.pt's own test metrics exist only when it is the last epoch (tests run at the end);
            # with WiSE a = 1 chosen, the recipe row is best.pt's
            "selected": _xv(m["selected"]["test"]) if (m.get("selected") or {}).get("test") else None,
            "final": _xv(m["final"]["test"])}


def compare(runs: list[dict], base: dict) -> dict:
    from deepmetric.report.study_tables import mean_ci

    own_avg = all(r.get("own_backbone_avg_features") for r in runs)
    rows = {}
    for name in ("recipe", "own_backbone_features") + (("own_backbone_avg_features",) if own_avg else ()) + ("final",):
        rows[name] = {k: mean_ci([r[name][k] for r in runs if r.get(name)]) for k in METRICS}
    diffs = {}
    # per-seed references: (name, the run's key)
    own = {"its own backbone's pooled features": "own_backbone_features"}
    if own_avg:
        own["its own backbone's average-pooled features"] = "own_backbone_avg_features"
    refs = {**base, **{name: None for name in own}}
    for ref, vals in refs.items():
        diffs[ref] = {}
        for k in METRICS:
            d = [r["recipe"][k] - (vals[k] if vals is not None else r[own[ref]][k]) for r in runs]
            ci = mean_ci(d)
            margin = MARGINS[k] if vals is not None and not ref.endswith("reference") else 0.0
            diffs[ref][k] = {**ci, "per_seed": d, "margin": margin,
                             "holds": bool(ci["ci_low"] > 0 and ci["mean"] >= margin - 1e-9)}
    return {"rows": rows, "differences": diffs}


def markdown(runs: list[dict], base: dict, cmp: dict, seconds: float) -> str:
    pct = lambda v: f"{100 * v:.2f}"  # noqa: E731
    lines = ["| embedding (test emoji, cross-vendor) | " + " | ".join(SHORT[k] for k in METRICS) + " |",
             "|---|" + "---|" * len(METRICS)]
    for name, vals in base.items():
        lines.append(f"| {name} | " + " | ".join(pct(vals[k]) for k in METRICS) + " |")
    label = {"recipe": f"**the recipe's embedding** (wise.pt), mean ± sd over {len(runs)} seeds",
             "own_backbone_features": "its own backbone's pooled features (same checkpoint)",
             "own_backbone_avg_features": "its own backbone's average-pooled features (same checkpoint)",
             "final": "fine-tuned, last epoch (for reading: not what validation chose)"}
    for name, text in label.items():
        if name not in cmp["rows"]:
            continue
        r = cmp["rows"][name]
        lines.append(f"| {text} | " + " | ".join(f"{pct(r[k]['mean'])} ± {pct(r[k]['std'])}" for k in METRICS) + " |")
    avg = "own_backbone_avg_features" in cmp["rows"]
    lines += ["", "Per seed (recipe's embedding / own backbone features"
              + (" / own backbone features, average-pooled" if avg else "") + "):", ""]
    for r in runs:
        lines.append(f"- seed {r['seed']} ({r['checkpoint']}, WiSE a = {r['wise_alpha']}): "
                     + ", ".join(f"{SHORT[k]} {pct(r['recipe'][k])} / {pct(r['own_backbone_features'][k])}"
                                 + (f" / {pct(r['own_backbone_avg_features'][k])}" if avg else "")
                                 for k in METRICS))
    lines += ["", "| the recipe minus ... | metric | bar | mean | 95 % CI | per seed | holds |", "|---|---|---|---|---|---|---|"]
    for ref, d in cmp["differences"].items():
        for k in METRICS:
            x = d[k]
            lines.append(f"| {ref} | {SHORT[k]} | {'+' + pct(x['margin']) if x['margin'] else '> 0'} | "
                         f"{x['mean'] * 100:+.2f} | [{x['ci_low'] * 100:+.2f}, {x['ci_high'] * 100:+.2f}] | "
                         + ", ".join(f"{v * 100:+.2f}" for v in x["per_seed"]) + f" | {'yes' if x['holds'] else '**no**'} |")
    lines += ["", f"Computed by `python bench/emoji_transfer_seeds.py` in {seconds:.0f} s."]
    return "\n".join(lines) + "\n"


def main() -> None:
    from deepmetric.run.config_io import load_config

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="finished runs of recipes/emoji_transfer.yaml")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "studies" / "emoji_transfer")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    t0 = time.perf_counter()
    runs = [run_numbers(r, args.threads) for r in args.runs]
    base = baselines(load_config(args.runs[0] / "config.yaml"), args.threads)
    cmp = compare(runs, base)
    seconds = time.perf_counter() - t0
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({"runs": runs, "baselines": base, **cmp}, indent=1) + "\n")
    (args.out / "results.md").write_text(markdown(runs, base, cmp, seconds))
    for r in args.runs:  # each run's record (not its checkpoints) beside the results
        dst = args.out / "runs" / r.name
        dst.mkdir(parents=True, exist_ok=True)
        for name in ("config.yaml", "metrics.json", "log.jsonl"):
            shutil.copy2(r / name, dst / name)
    print((args.out / "results.md").read_text())


if __name__ == "__main__":
    main()
