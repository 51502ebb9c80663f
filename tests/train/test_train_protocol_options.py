"""The training options protocol v2 (issue 30) relies on: ``eval.test: false`` (the test split
out of sight during training), ``eval.embedding: projection`` (the loss's own output is what is
indexed and selected on) and ``optim.decay_exclude`` (no weight decay on biases, normalisation
layers and loss parameters), each checked against an independent computation."""
import json

import numpy as np
import pytest
import torch
from torch import nn

from test_data_emoji import make_tree

from deepmetric.evaluate import evaluate_cross_domain
from deepmetric.run.builders import VAL_SPLIT, build_split, build_losses, build_model
from deepmetric.run.config import ConfigError
from deepmetric.run.config_io import config_from_dict
from deepmetric.run.embed import compute_embeddings, load_model_from_checkpoint
from deepmetric.train.loop import train
from deepmetric.train.optim import build_optimizer, build_param_groups
from deepmetric.run.rundir import read_log


def _emoji_run(tmp_path, **eval_options) -> dict:
    if not (tmp_path / "tree").is_dir():
        make_tree(tmp_path / "tree")
    return {
        "data": {"name": "emoji", "root": str(tmp_path / "tree"), "options": {"size": 32},
                 "transform": "emoji", "transform_options": {"normalize": "minus_one_one"}, "val_classes": 3},
        "model": {"name": "glyph_resnet", "options": {"in_chans": 3, "embedding_dim": 8, "widths": [8], "depths": [1],
                                                      "norm": "l2", "projection": {"dim": 4, "norm": "none"}}},
        "loss": [{"name": "heated_softmax", "input": "projection", "options": {"alpha": 16.0}}],
        "train": {"epochs": 2, "batch_size": 4, "seed": 0, "out_dir": str(tmp_path / "run"), "progress": False},
        "eval": {"every": 1, "ks": [1, 2], "metrics": ["recall", "map@r"], "cross_domain": True,
                 "best_metric": "cross_domain_recall@1", "baselines": False, **eval_options},
    }


@pytest.mark.filterwarnings("ignore:.*no same-label reference")
def test_eval_test_false_never_builds_nor_evaluates_the_test_split(tmp_path, monkeypatch):
    import deepmetric.train.setup as loop

    def refuse(cfg):
        raise AssertionError("eval.test false built the test split")

    monkeypatch.setattr(loop, "build_test_sets", refuse)
    raw = _emoji_run(tmp_path, test=False, wise_ft=[0.5])
    result = train(config_from_dict(raw))
    assert not [r for r in read_log(tmp_path / "run") if r.get("split") == "test"]
    summary = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert summary["metrics"] == {} and set(summary["final"]) == {"val"}
    assert "test" not in summary["selected"] and "test" not in summary["wise_ft"]
    assert summary["selected"]["value"] == max(r["cross_domain_recall@1"] for r in read_log(tmp_path / "run", type="eval"))
    assert result.metrics == {}
    # a resumed finished run does not evaluate again (its validation is its final evaluation)
    before = len(read_log(tmp_path / "run", type="eval"))
    train(config_from_dict(raw), resume=tmp_path / "run" / "last.pt")
    assert len(read_log(tmp_path / "run", type="eval")) == before


def test_eval_test_false_needs_validation_and_projection_needs_a_head(tmp_path):
    raw = _emoji_run(tmp_path, test=False)
    del raw["data"]["val_classes"]
    del raw["eval"]["best_metric"]
    with pytest.raises(ConfigError, match="eval.test.*evaluates no split"):
        config_from_dict(raw)
    raw = _emoji_run(tmp_path, embedding="projection")
    del raw["model"]["options"]["projection"]
    raw["loss"][0]["input"] = "embedding"
    with pytest.raises(ConfigError, match="eval.embedding.*has none"):
        config_from_dict(raw)


@pytest.mark.filterwarnings("ignore:.*no same-label reference")
def test_eval_embedding_projection_indexes_the_projection_for_validation_best_pt_and_test(tmp_path):
    raw = _emoji_run(tmp_path, embedding="projection", test_every=0)
    train(config_from_dict(raw))
    evals = read_log(tmp_path / "run", type="eval")
    summary = json.loads((tmp_path / "run" / "metrics.json").read_text())
    model, _, cfg, _ = load_model_from_checkpoint(tmp_path / "run" / "best.pt")
    assert cfg.eval.embedding == "projection"

    def cross_vendor_r1(ds, net) -> tuple[float, float]:
        """Brute force: each vendor's images against the other vendors', on model(x)["projection"]
        and, for contrast, on the embedding."""
        loader = torch.utils.data.DataLoader(ds, batch_size=64)
        with torch.no_grad():
            outs = [net.eval()(x) for x, _ in loader]
        proj = torch.cat([o["projection"] for o in outs]).numpy()
        emb = torch.cat([o["embedding"] for o in outs]).numpy()
        assert proj.shape[1] == 4 and emb.shape[1] == 8
        return tuple(evaluate_cross_domain(x, np.asarray(ds.labels), ds.vendor_ids, ks=(1,), metrics=("recall",))
                     ["mean"]["recall@1"] for x in (proj, emb))

    val = build_split(cfg, VAL_SPLIT, train=False)
    best = summary["selected"]
    assert best["value"] == pytest.approx(cross_vendor_r1(val, model)[0], abs=1e-6)  # best.pt chosen on it
    assert compute_embeddings(model, val, output="projection")["embeddings"].shape[1] == 4
    last, _, _, _ = load_model_from_checkpoint(tmp_path / "run" / "last.pt")
    test_proj, test_emb = cross_vendor_r1(build_split(cfg, "test", train=False), last)
    assert summary["final"]["test"]["cross_domain_recall@1"] == pytest.approx(test_proj, abs=1e-6)
    assert [r["split"] for r in evals][-1] == "test"


def test_decay_exclude_takes_weight_decay_off_bias_norm_and_loss_parameters_only():
    """The real groups of the protocol's network (EfficientNet-Lite0, shift-only BN embedding, BN
    projection, ProxyAnchor proxies): every bias, every parameter of a normalisation layer and
    every loss parameter gets no decay, every other weight the configured one; one AdamW step
    with zero gradients (pure decoupled decay) moves exactly the decayed ones."""
    raw = {"data": {"name": "emoji"},
           "model": {"name": "efficientnet_lite0", "options": {"pretrained": None, "embedding_dim": 0, "norm": "bn",
                                                               "freeze_stages": 5, "projection": {"dim": 16, "norm": "bn"}}},
           "loss": [{"name": "pml", "input": "projection", "options": {"loss": "ProxyAnchorLoss"}}],
           "optim": {"name": "adamw", "lr": 0.1, "weight_decay": 0.5, "new_layer_lr_mult": 10.0,
                     "decay_exclude": ["bias", "norm", "loss"]},
           "train": {"epochs": 1}}
    cfg = config_from_dict(raw)
    torch.manual_seed(0)
    model = build_model(cfg, num_classes=5)
    losses = build_losses(cfg, num_classes=5, projection_dim=16)
    norm_ids = {id(p) for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
                for p in m.parameters(recurse=False)}
    expected = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            expected[f"model.{name}"] = 0.0 if name.endswith(".bias") or id(p) in norm_ids else 0.5
    for name, _ in losses[0].named_parameters():
        expected[f"loss.0.{name}"] = 0.0
    got = {n: g["weight_decay"] for g in build_param_groups(model, losses, cfg.optim) for n in g["names"]}
    assert got == expected
    assert "loss.0.loss.proxies" in got and any("head.bn" in n for n in got) and 0.5 in got.values()
    params = dict((f"model.{n}", p) for n, p in model.named_parameters())
    params.update((f"loss.0.{n}", p) for n, p in losses[0].named_parameters())
    before = {n: params[n].detach().clone() for n in expected}
    opt = build_optimizer(model, losses, cfg.optim)
    for n in expected:
        params[n].grad = torch.zeros_like(params[n])
    opt.step()
    for n, wd in expected.items():
        moved = not torch.equal(before[n], params[n].detach())
        assert moved == (wd > 0 and bool(before[n].abs().sum() > 0)), n
    # without the option every parameter decays, as before
    cfg.optim.decay_exclude = []
    assert {g["weight_decay"] for g in build_param_groups(model, losses, cfg.optim)} == {0.5}


@pytest.mark.filterwarnings("ignore:.*no same-label reference")
def test_wise_ft_reuses_the_logged_evaluations_of_best_pt_with_the_same_result(tmp_path, monkeypatch):
    """WiSE-FT's a = 1 is best.pt exactly: its validation metrics (and, when a = 1 is chosen, its
    test metrics) come from the run's log instead of being evaluated again (bench/RESULTS.md, the
    profile of an emoji run); the wise_ft section is what evaluating them again gives."""
    import deepmetric.train.evaluator as loop
    import deepmetric.train.wise_ft as wise

    calls = []
    real = loop.evaluate_split

    def counting(model, sets, cfg, **kw):
        calls.append(len(sets["query"]))
        return real(model, sets, cfg, **kw)

    monkeypatch.setattr(loop, "evaluate_split", counting)
    raw = _emoji_run(tmp_path, wise_ft=[0.0, 0.5], test_every=0)
    train(config_from_dict(raw))
    reused = json.loads((tmp_path / "run" / "metrics.json").read_text())["wise_ft"]
    n_reused = len(calls)
    monkeypatch.setattr(loop, "_best_metrics", lambda run, source: {})  # evaluate everything again
    calls.clear()
    raw["train"]["out_dir"] = str(tmp_path / "again")
    train(config_from_dict(raw))
    again = json.loads((tmp_path / "again" / "metrics.json").read_text())["wise_ft"]
    assert reused == again
    # one validation evaluation fewer (a = 1), and one test evaluation fewer when a = 1 is chosen
    assert len(calls) - n_reused == 1 + (again["alpha"] == 1.0)
    assert wise.wise_ft_alphas([0.0, 0.5]) == [0.0, 0.5, 1.0]
