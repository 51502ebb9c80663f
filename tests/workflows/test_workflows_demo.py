"""The offline demos end to end in --quick mode: emoji (installed npm artwork, ImageNet
EfficientNet-Lite0 from its PyPI package) and glyphs (a few classes rendered into tmp)."""
import json
import os

import pytest
import torch

from deepmetric import cli
from deepmetric.run.rundir import read_log


def _check_summary(out, printed, pictures, *, heated):
    summary = json.loads((out / "demo_metrics.json").read_text())
    phases = ("before_heat_up", "after_heat_up", "final") if heated else ("final",)
    for phase in phases:
        for k in ("recall@1", "recall@2", "recall@4", "recall@8", "nmi", "map@r"):
            assert 0.0 <= summary[phase][k] <= 1.0
        r = [summary[phase][f"recall@{k}"] for k in (1, 2, 4, 8)]
        assert r == sorted(r)  # Recall@K is monotone in K
    assert summary["final"]["epoch"] == 2
    for name in ("last.pt", "config.yaml", "log.jsonl", *pictures):
        assert (out / name).is_file(), name
        assert str(out / name) in printed or name in ("config.yaml", "log.jsonl")
    heat = read_log(out, type="heat_up")
    trained = [r for r in summary["rows"] if "of" not in r]  # the rows without post-processing
    names = [r["name"] for r in trained]
    assert names[0].startswith("raw pixels")
    if heated:
        assert summary["before_heat_up"]["alpha"] == 16.0 and summary["after_heat_up"]["alpha"] == 4.0
        assert len(heat) == 1 and heat[0]["alpha"] == [4.0]
        assert names[-1] == "epoch 2, alpha 4"
    else:
        assert not heat and "before_heat_up" not in summary and names[-1] == "trained embedding (epoch 2)"
    # the printed table has one line per row, with the same numbers as the JSON
    for r in summary["rows"]:
        line = next(l for l in printed.splitlines() if l.strip().startswith(r["name"].strip())
                    and f"{100 * r['recall@1']:.2f}" in l)
        assert f"{100 * r['recall@1']:.2f}" in line
    # every row ends where the heading does, however long its name (numbers under their column)
    lines = printed.splitlines()
    header = next(l for l in lines if l.split()[:2] == ["recall@1", "recall@2"])
    rows = [next(l for l in lines if l.strip().startswith(r["name"].strip())) for r in summary["rows"]]
    assert {len(l) for l in rows} == {len(header)}
    # the last row is the final evaluation of the run's own log
    test = [r for r in read_log(out, type="eval") if r["split"] == "test"]
    assert trained[-1]["recall@1"] == pytest.approx(test[-1]["recall@1"])
    return summary


def test_demo_glyphs_quick(tmp_path, capsys):
    out = tmp_path / "demo"
    assert cli.main(["demo", "--data", "glyphs", "--quick", "--out", str(out), f"data.root={tmp_path / 'cache'}",
                     "train.progress=false"]) == 0
    summary = _check_summary(out, capsys.readouterr().out,
                             ("retrieval_grid.png", "training_curves.png", "cosine_histograms.png", "recall_curve.png"),
                             heated=True)
    assert [r["name"] for r in summary["rows"]][:2] == ["raw pixels (32x32)", "epoch 0 (untrained)"]


def test_demo_emoji_quick(tmp_path, capsys):
    from deepmetric.data.emoji import PACKAGES, _is_installed

    if not all(_is_installed(p, None) for p in PACKAGES.values()):
        if os.environ.get("CI"):  # install.sh installs them: in CI their absence is a failure
            pytest.fail("emoji packages not installed: bash install.sh installs them")
        pytest.skip("emoji packages not installed (bash install.sh installs them)")
    out = tmp_path / "demo"
    assert cli.main(["demo", "--quick", "--out", str(out), "train.progress=false"]) == 0
    printed = capsys.readouterr().out
    summary = _check_summary(out, printed, ("retrieval_grid.png", "training_curves.png"), heated=False)
    names = [r["name"] for r in summary["rows"]]
    assert names[:2] == ["raw pixels (32x32)", "ImageNet features (1280-d, gem)"]  # pooled as the recipe pools
    # each learned embedding is followed by its post-processed row, chosen on validation
    post = [r for r in summary["rows"] if "of" in r]
    assert [r["of"] for r in post] == [names[1], "trained embedding (epoch 2)"]
    assert names[2] == names[-1] == "  + post-processing (chosen on validation)"
    assert "[demo] post-processing of trained embedding (epoch 2):" in printed
    assert summary["seconds"]["postprocess"] > 0
    # the fine-tuned embedding is measured on the same test images as the baselines
    assert summary["rows"][1]["nmi"] is not None and summary["rows"][0]["nmi"] is None
    # cross-vendor columns for every row, the baselines' computed here independently
    assert "xv R@1" in printed
    for r in summary["rows"]:
        assert 0.0 <= r["cross_domain_recall@1"] <= 1.0 and 0.0 <= r["cross_domain_map@r"] <= 1.0
    from deepmetric.evaluate import evaluate_cross_domain
    from deepmetric.run.builders import build_split
    from deepmetric.workflows.demo import demo_config

    cfg = demo_config(out, quick=True)
    test = build_split(cfg, "test", train=False)
    # the rows every run's baseline uses: the test transform's values ([-1, 1] here), by hand
    pixels = torch.stack([test[i][0] for i in range(len(test))]).reshape(len(test), -1).numpy()
    assert pixels.min() < -0.5 and pixels.max() <= 1.0
    ref = evaluate_cross_domain(pixels, test.labels, test.vendor_ids, ks=(1,), metrics=("recall", "map@r"))
    assert summary["rows"][0]["cross_domain_recall@1"] == pytest.approx(ref["mean"]["recall@1"])
    assert summary["rows"][0]["cross_domain_map@r"] == pytest.approx(ref["mean"]["map@r"])
    assert summary["train_classes"] == 20 and summary["test_classes"] == 24  # 4 training emoji held out: validation
    # running the demo again replaces its own earlier run instead of refusing the folder
    assert cli.main(["demo", "--quick", "--out", str(out), "train.progress=false"]) == 0
