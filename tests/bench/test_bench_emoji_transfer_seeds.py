"""bench/emoji_transfer_seeds.py: the paired differences and the issue's bar, on made-up runs
checked by hand (the t quantile for 2 degrees of freedom is 4.3027)."""
import importlib.util
import math
from pathlib import Path

import pytest

SPEC = importlib.util.spec_from_file_location(
    "emoji_transfer_seeds", Path(__file__).resolve().parents[2] / "bench" / "emoji_transfer_seeds.py")
seeds = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(seeds)


def _run(seed, r1, mapr, own_r1=0.5, own_map=0.3):
    xv = {"cross_domain_recall@1": r1, "cross_domain_map@r": mapr}
    return {"seed": seed, "checkpoint": "wise.pt", "wise_alpha": 0.75, "recipe": xv,
            "own_backbone_features": {"cross_domain_recall@1": own_r1, "cross_domain_map@r": own_map},
            "selected": None, "final": xv}


def test_paired_differences_and_the_bar():
    runs = [_run(0, 0.62, 0.33), _run(1, 0.63, 0.34), _run(2, 0.61, 0.32)]
    base = {"raw pixels (96 px)": {"cross_domain_recall@1": 0.50, "cross_domain_map@r": 0.22},
            "ImageNet features (96 px, 1280-d)": {"cross_domain_recall@1": 0.52, "cross_domain_map@r": 0.25},
            "ImageNet features (128 px, 1280-d), reference": {"cross_domain_recall@1": 0.58,
                                                             "cross_domain_map@r": 0.29}}
    cmp = seeds.compare(runs, base)
    px = cmp["differences"]["raw pixels (96 px)"]["cross_domain_recall@1"]
    assert px["per_seed"] == pytest.approx([0.12, 0.13, 0.11])
    half = 4.302652729911275 * 0.01 / math.sqrt(3)  # sd of (0.12, 0.13, 0.11) is 0.01
    assert px["mean"] == pytest.approx(0.12) and px["ci_low"] == pytest.approx(0.12 - half)
    assert px["holds"]  # +12 >= +10 and the interval is above 0
    im = cmp["differences"]["ImageNet features (96 px, 1280-d)"]["cross_domain_recall@1"]
    assert im["mean"] == pytest.approx(0.10) and im["holds"]
    imap = cmp["differences"]["ImageNet features (96 px, 1280-d)"]["cross_domain_map@r"]
    assert imap["mean"] == pytest.approx(0.08) and imap["holds"]
    ref = cmp["differences"]["ImageNet features (128 px, 1280-d), reference"]["cross_domain_recall@1"]
    assert ref["margin"] == 0.0 and ref["holds"]  # a reference row is held to > 0 only
    own = cmp["differences"]["its own backbone's pooled features"]["cross_domain_recall@1"]
    assert own["mean"] == pytest.approx(0.12) and own["margin"] == 0.0
    # a mean above the bar with an interval reaching below 0 does not hold
    wide = seeds.compare([_run(0, 0.90, 0.5), _run(1, 0.45, 0.2), _run(2, 0.46, 0.2)], base)
    w = wide["differences"]["raw pixels (96 px)"]["cross_domain_recall@1"]
    assert w["mean"] > 0.10 and w["ci_low"] < 0 and not w["holds"]
    text = seeds.markdown(runs, base, cmp, 1.0)
    assert "| raw pixels (96 px) | xv R@1 | +10.00 | +12.00 |" in text and "**no**" not in text


def test_average_pooled_own_features_when_the_recipe_pools_otherwise():
    """A GeM recipe: its own (GeM-)pooled features and, separately, the same checkpoint's
    average-pooled ones (the issue's baseline) are each paired by seed; a recipe pooling by the
    average has no such row."""
    runs = []
    for seed, (r1, avg_r1) in enumerate([(0.62, 0.59), (0.63, 0.59), (0.61, 0.58)]):
        run = _run(seed, r1, 0.33, own_r1=r1, own_map=0.33)
        run["own_backbone_avg_features"] = {"cross_domain_recall@1": avg_r1, "cross_domain_map@r": 0.32}
        runs.append(run)
    base = {"raw pixels (96 px)": {"cross_domain_recall@1": 0.50, "cross_domain_map@r": 0.22}}
    cmp = seeds.compare(runs, base)
    avg = cmp["differences"]["its own backbone's average-pooled features"]["cross_domain_recall@1"]
    assert avg["per_seed"] == pytest.approx([0.03, 0.04, 0.03]) and avg["margin"] == 0.0
    half = 4.302652729911275 * (0.01 / math.sqrt(3)) / math.sqrt(3)  # sd of (3, 4, 3) points is 1 / sqrt(3)
    assert avg["mean"] == pytest.approx(0.1 / 3) and avg["ci_low"] == pytest.approx(0.1 / 3 - half) and avg["holds"]
    same = cmp["differences"]["its own backbone's pooled features"]["cross_domain_recall@1"]
    assert same["per_seed"] == pytest.approx([0, 0, 0]) and not same["holds"]
    text = seeds.markdown(runs, base, cmp, 1.0)
    assert "| its own backbone's average-pooled features (same checkpoint) | 58.67 ± 0.58 | 32.00 ± 0.00 |" in text
    assert "xv R@1 62.00 / 62.00 / 59.00" in text
    plain = seeds.compare([_run(0, 0.62, 0.33), _run(1, 0.63, 0.34)], base)
    assert "its own backbone's average-pooled features" not in plain["differences"]
    assert "average-pooled" not in seeds.markdown([_run(0, 0.62, 0.33), _run(1, 0.63, 0.34)], base, plain, 1.0)


def test_ablation_rows_read_validation_only(tmp_path):
    """bench/emoji_transfer_ablations.py: best epoch = highest validation cross-vendor Recall@1
    (the earliest on ties, as best.pt), test records ignored, the WiSE row is the chosen a."""
    import json

    spec = importlib.util.spec_from_file_location(
        "emoji_transfer_ablations", Path(__file__).resolve().parents[2] / "bench" / "emoji_transfer_ablations.py")
    abl = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(abl)
    R1, MAP = "cross_domain_recall@1", "cross_domain_map@r"
    recs = [{"type": "step", "step": 1, "loss": 1.0},
            {"type": "eval", "split": "val", "epoch": 1, R1: 0.5, MAP: 0.2},
            {"type": "eval", "split": "val", "epoch": 2, R1: 0.6, MAP: 0.3},
            {"type": "eval", "split": "val", "epoch": 3, R1: 0.6, MAP: 0.35},
            {"type": "eval", "split": "test", "epoch": 3, R1: 0.9, MAP: 0.9}]
    (tmp_path / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (tmp_path / "metrics.json").write_text(json.dumps({
        "epochs": 3, "wall_time_s": 120.0,
        "wise_ft": {"alpha": 0.5, "val": [{"alpha": 0.5, R1: 0.65, MAP: 0.31}, {"alpha": 1.0, R1: 0.6, MAP: 0.3}]}}))
    r = abl.row("x", tmp_path)
    assert (r["best_epoch"], r["best_r1"], r["best_map"]) == (2, 0.6, 0.3)
    assert (r["last_epoch"], r["last_r1"]) == (3, 0.6)
    assert (r["wise_alpha"], r["wise_r1"], r["wise_map"], r["wall_min"]) == (0.5, 0.65, 0.31, 2.0)
    assert "| x | 2 | 60.00 | 30.00 | 60.00 | 0.5 | 65.00 | 31.00 | 3 | 2.0 |" in abl.markdown([r])
