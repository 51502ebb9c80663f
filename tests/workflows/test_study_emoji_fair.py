"""The fair emoji comparison (studies/emoji_fair.py, bench/emoji_fair.py): the committed spaces
and study are what the generator writes, every space passes the tune's checks, and every loss of
the comparison trains and is evaluated cross-vendor through the tune's own trial config (tiny
emoji: 32 px, 40 classes), so a user's GPU run cannot stop at a loss that does not build."""
import importlib.util
import math
import os
from pathlib import Path

import pytest

from deepmetric.run.rundir import read_log

pytest.importorskip("optuna")
ROOT = Path(__file__).resolve().parents[2]
SPEC = importlib.util.spec_from_file_location("emoji_fair_spec", ROOT / "studies" / "emoji_fair.py")
fair = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(fair)
TINY = ["data.options={size: 32, max_classes: 40}", "train.epochs=1", "eval.test_every=0"]


def _emoji_installed() -> bool:
    from deepmetric.data.emoji import PACKAGES, _is_installed

    ok = all(_is_installed(p, None) for p in PACKAGES.values())
    if not ok and os.environ.get("CI"):
        pytest.fail("emoji packages not installed: bash install.sh installs them")
    return ok


def test_committed_spaces_and_study_are_the_generators(tmp_path, monkeypatch):
    import yaml

    for name in fair.LOSSES:
        committed = yaml.safe_load((ROOT / "spaces" / "emoji_fair" / f"{name}.yaml").read_text())
        assert committed == fair.space(name), name
        assert {"optim.lr", "optim.weight_decay"} <= set(committed["params"])  # the same budget ...
        # ... and its own option; SM has none, nor has N-pair on unit vectors (its l2 regulariser
        # would be a constant there)
        assert len(committed["params"]) >= 3 or name in ("SM", "npair"), name
    study = yaml.safe_load((ROOT / "studies" / "emoji_fair.yaml").read_text())
    assert list(study["variants"]) == list(fair.LOSSES) and study["seeds"] == [0, 1, 2]


def _own_loss_options(name):
    return {k: v for k, v in fair.space(name)["params"].items() if k.startswith("loss.0.options.")}


@pytest.mark.parametrize("name", [n for n in fair.LOSSES if _own_loss_options(n)])
def test_every_tuned_loss_option_changes_the_loss(tmp_path, name):
    """A tuned loss option must matter to training: the gradient that reaches the projection's
    weights from one batch differs between the two ends of its range (the first N-pair space
    tuned an l2 regulariser on unit vectors: a constant, which shifts the loss and not its
    gradient).  Same network, same batch, same initial loss parameters at both ends."""
    import torch

    from deepmetric.run.builders import build_losses, build_model
    from deepmetric.workflows.tune import prepare_tune

    setup = prepare_tune(ROOT / "recipes" / "emoji_fair.yaml", ROOT / "spaces" / "emoji_fair" / f"{name}.yaml",
                         trials=1, out=tmp_path / "tune", overrides=["model.options.pretrained=null"])
    base = {}
    for key, spec in fair.space(name)["params"].items():
        base[key] = spec["choices"][0] if spec["type"] == "categorical" else spec["low"]
    torch.manual_seed(0)
    x, y = torch.randn(16, 3, 32, 32), torch.arange(16) % 4
    for key, spec in _own_loss_options(name).items():
        ends = spec["choices"][:2] if spec["type"] == "categorical" else [spec["low"], spec["high"]]
        values = []
        for end in ends:
            cfg = setup.trial_config({**base, key: end}, tmp_path / "run", threads=1)
            torch.manual_seed(0)
            model = build_model(cfg)
            torch.manual_seed(1)
            loss = build_losses(cfg, num_classes=4, projection_dim=model.projection_dim)[0]
            loss(model(x)["projection"], y).backward()
            values.append(model.projection.out.proj.weight.grad.clone())
        assert all(torch.isfinite(v).all() for v in values), (name, key)
        change = (values[0] - values[1]).norm() / values[0].norm().clamp_min(1e-12)
        assert change > 1e-3, (name, key, ends, float(change))


@pytest.mark.parametrize("name", list(fair.LOSSES))
def test_every_loss_of_the_comparison_trains_as_its_tune_would(tmp_path, name):
    if not _emoji_installed():
        pytest.skip("emoji packages not installed (bash install.sh installs them)")
    from deepmetric.train.loop import train
    from deepmetric.workflows.tune import prepare_tune

    setup = prepare_tune(ROOT / "recipes" / "emoji_fair.yaml", ROOT / "spaces" / "emoji_fair" / f"{name}.yaml",
                         trials=1, out=tmp_path / "tune", overrides=TINY)
    values = {}
    for p in setup.space.params:  # the geometric middle of each range, the first choice
        spec = fair.space(name)["params"][p.name]
        if spec["type"] == "categorical":
            values[p.name] = spec["choices"][0]
        else:
            values[p.name] = math.sqrt(spec["low"] * spec["high"]) if spec.get("log") else (spec["low"] + spec["high"]) / 2
    result = train(setup.trial_config(values, tmp_path / "run", threads=1))
    val = [r for r in read_log(tmp_path / "run", type="eval") if r["split"] == "val"]
    assert val and 0.0 <= val[-1]["cross_domain_recall@1"] <= 1.0, name
    assert math.isfinite(read_log(tmp_path / "run", type="step")[-1]["loss"])
    assert "cross_domain_map@r" in result.final["val"] and result.metrics == {}  # a trial never sees test


def test_the_driver_writes_the_baseline_rows_into_the_summary(tmp_path, monkeypatch):
    """bench/emoji_fair.py appends raw pixels and the ImageNet features (baselines.json) to the
    copied summary.md, the rows the issue asks every table to carry."""
    import json

    spec = importlib.util.spec_from_file_location("emoji_fair_driver", ROOT / "bench" / "emoji_fair.py")
    driver = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(driver)
    record = {"command": "python bench/study_baselines.py studies/emoji_fair.yaml",
              "raw_pixels": {"label": "raw pixels (64x64x3 = 12288-d)",
                             "metrics": {"recall@1": 0.27, "map@r": 0.13, "cross_domain_recall@1": 0.4946,
                                         "cross_domain_map@r": 0.2139}},
              "pretrained_features": {"label": "efficientnet_lite0 imagenet features (1280-d)",
                                      "metrics": {"recall@1": 0.28, "map@r": 0.1366}}}  # no cross-domain keys
    (tmp_path / "baselines.json").write_text(json.dumps(record))
    (tmp_path / "summary.md").write_text("# Study emoji_fair\n")
    monkeypatch.setattr(driver, "COPY", tmp_path)
    monkeypatch.setattr(driver, "write_results", lambda s: {})
    driver.copy_study(None)
    text = (tmp_path / "summary.md").read_text()
    assert text.startswith("# Study emoji_fair\n") and "## Baselines" in text
    assert "| raw pixels (64x64x3 = 12288-d) | 0.4946 | 0.2139 | 0.2700 | 0.1300 |" in text
    assert "| efficientnet_lite0 imagenet features (1280-d) | - | - | 0.2800 | 0.1366 |" in text


def test_the_proxy_lr_diagnostic_differs_from_the_fair_proxy_anchor_tune_only_in_its_third_option(tmp_path):
    """spaces/emoji_proxy_lr/pml_proxy_anchor.yaml (bench/studies/README.md) asks one question of
    the fair ProxyAnchor tune: the same objective, sampler, pruner, lr and weight-decay ranges and
    loss, with the proxies' lr multiplier in place of the margin; and the multiplier reaches the
    optimiser as the proxies' learning rate."""
    import yaml

    from deepmetric.run.builders import build_losses, build_model
    from deepmetric.train.optim import build_optimizer
    from deepmetric.workflows.tune import prepare_tune

    diag = yaml.safe_load((ROOT / "spaces" / "emoji_proxy_lr" / "pml_proxy_anchor.yaml").read_text())
    fair_space = fair.space("pml_proxy_anchor")
    assert {k: v for k, v in diag.items() if k != "params"} == {k: v for k, v in fair_space.items() if k != "params"}
    own = {"optim.lr", "optim.weight_decay"}
    assert {k: diag["params"][k] for k in own} == {k: fair_space["params"][k] for k in own}
    assert set(diag["params"]) - own == {"optim.loss_lr_mult"}
    assert set(fair_space["params"]) - own == {"loss.0.options.margin"}

    setup = prepare_tune(ROOT / "recipes" / "emoji_fair.yaml", ROOT / "spaces" / "emoji_proxy_lr" / "pml_proxy_anchor.yaml",
                         trials=1, out=tmp_path / "tune", overrides=TINY)
    cfg = setup.trial_config({"optim.lr": 0.002, "optim.weight_decay": 1e-5, "optim.loss_lr_mult": 100.0},
                             tmp_path / "run", threads=1)
    model = build_model(cfg, num_classes=40)
    losses = build_losses(cfg, num_classes=40, embedding_dim=1280, projection_dim=128)
    opt = build_optimizer(model, losses, cfg.optim)
    proxies = [g for g in opt.param_groups if any("proxies" in n for n in g["param_names"])]
    assert len(proxies) == 1 and proxies[0]["lr_mult"] == 100.0
    assert all(g["lr_mult"] != 100.0 for g in opt.param_groups if g is not proxies[0])


def test_the_driver_runs_the_seeds_at_the_committed_tuned_settings(tmp_path, monkeypatch):
    """``bench/emoji_fair.py --tunes bench/studies/emoji_fair/tunes`` (a fresh clone has no
    runs/tune): every seeded run carries its loss's committed best_overrides.json values, the
    loss's own option included (the defect of the first seeded set), and nothing is tuned."""
    import json

    spec = importlib.util.spec_from_file_location("emoji_fair_driver2", ROOT / "bench" / "emoji_fair.py")
    driver = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(driver)
    monkeypatch.setattr(driver, "RUNS", tmp_path)
    committed = ROOT / "bench" / "studies" / "emoji_fair" / "tunes"
    s = driver.study(list(fair.LOSSES), committed)
    assert {r.variant for r in s.runs} == set(fair.LOSSES) and len(s.runs) == 3 * len(fair.LOSSES)
    checked = 0
    for run in s.runs:
        tuned = json.loads((committed / run.variant / "best_overrides.json").read_text())["overrides"]
        for item in tuned:
            key, value = item.split("=", 1)
            node = run.raw
            for part in key.split("."):
                node = node[int(part)] if isinstance(node, list) else node[part]
            assert node == pytest.approx(float(value)), (run.key, key)
            checked += 1
    assert checked >= 3 * 2 * len(fair.LOSSES)  # at least lr and weight decay of every run
    assert s.out_dir == tmp_path / "studies" / "emoji_fair"

    def no_tuning(*args, **kwargs):
        raise AssertionError("--tunes must not tune")

    monkeypatch.setattr(driver, "tune", no_tuning)
    with pytest.raises(SystemExit, match=r"--tunes .*no tuned settings for 1 loss\(es\): .*BN/best_overrides.json"):
        driver.main(["--tunes", str(tmp_path / "empty"), "--only", "BN"])
