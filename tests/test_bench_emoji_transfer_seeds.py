"""bench/emoji_transfer_seeds.py: the paired differences and the issue's bar, on made-up runs
checked by hand (the t quantile for 2 degrees of freedom is 4.3027)."""
import importlib.util
import math
from pathlib import Path

import pytest

SPEC = importlib.util.spec_from_file_location(
    "emoji_transfer_seeds", Path(__file__).resolve().parents[1] / "bench" / "emoji_transfer_seeds.py")
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
