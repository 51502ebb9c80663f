"""Evaluation extras of the training loop: ``eval.cross_domain`` (emoji vendors, on a miniature
package tree) and ``eval.train_neighbours`` (the two-head paper's share of misclassified test
images whose nearest training image carries the predicted label), each checked against a
brute-force recomputation from the saved checkpoint."""
import json

import numpy as np
import pytest
import torch

from deepmetric.evaluate import misclassified_neighbour_agreement
from deepmetric.train import train
from deepmetric.run.builders import build_split
from deepmetric.run.config import ConfigError
from deepmetric.run.config_io import config_from_dict
from deepmetric.run.embed import compute_embeddings, dataset_domains, load_model_from_checkpoint
from events_data import synthetic_events_config


def _brute_force_agreement(pred, y, test_emb, train_emb, train_y):
    """Loops: the nearest training image by cosine similarity (ties: the smaller index)."""
    t = train_emb / np.linalg.norm(train_emb, axis=1, keepdims=True)
    agree, wrong, nn_right = 0, 0, 0
    for i in range(len(y)):
        q = test_emb[i] / np.linalg.norm(test_emb[i])
        best, best_j = -np.inf, -1
        for j in range(len(t)):
            s = float(q @ t[j])
            if s > best:
                best, best_j = s, j
        nn_right += int(train_y[best_j] == y[i])
        if pred[i] != y[i]:
            wrong += 1
            agree += int(train_y[best_j] == pred[i])
    return agree / wrong if wrong else float("nan"), wrong, nn_right / len(y)


def test_misclassified_neighbour_agreement_against_brute_force():
    rng = np.random.default_rng(0)
    train_y = rng.integers(0, 4, 60)
    centres = rng.normal(size=(4, 8))
    train_emb = centres[train_y] + 0.8 * rng.normal(size=(60, 8))
    y = rng.integers(0, 4, 40)
    test_emb = centres[y] + 0.8 * rng.normal(size=(40, 8))
    logits = rng.normal(size=(40, 4))
    logits[np.arange(25), y[:25]] += 4  # 25 right by construction, the rest at chance
    res = misclassified_neighbour_agreement(logits, y, test_emb.astype(np.float32), train_emb.astype(np.float32),
                                            train_y)
    share, wrong, nn_top1 = _brute_force_agreement(logits.argmax(1), y, test_emb, train_emb, train_y)
    assert wrong >= 5 and res["misclassified"] == wrong
    assert res["misclassified_nn_agrees"] == pytest.approx(share)
    assert res["train_1nn_top1"] == pytest.approx(nn_top1)
    # no mistake: the share is undefined (NaN), not 0 or 1
    perfect = misclassified_neighbour_agreement(y, y, test_emb, train_emb, train_y)
    assert np.isnan(perfect["misclassified_nn_agrees"]) and perfect["misclassified"] == 0
    with pytest.raises(ValueError, match="3 training labels for 60"):
        misclassified_neighbour_agreement(logits, y, test_emb, train_emb, train_y[:3])


def _events_config(tmp_path, **eval_extra):
    return synthetic_events_config(tmp_path, baselines=False, **eval_extra)


@pytest.mark.filterwarnings("ignore:.*no same-label reference")
def test_train_neighbours_in_the_final_metrics_match_a_recomputation(tmp_path):
    res = train(config_from_dict(_events_config(tmp_path, train_neighbours=True)))
    got = json.loads((tmp_path / "metrics.json").read_text())["final"]["test"]
    assert got == pytest.approx(res.metrics, nan_ok=True)
    for key in ("misclassified_nn_agrees", "misclassified", "train_1nn_top1", "top1"):
        assert key in got
    # recompute from the checkpoint: the test split and the training split (test transform;
    # the centre window of each event: evaluation sets are deterministic)
    model, losses, cfg, _ = load_model_from_checkpoint(tmp_path / "last.pt")
    test = compute_embeddings(model, build_split(cfg, "val", train=False), with_logits=True)
    tr = compute_embeddings(model, build_split(cfg, cfg.data.train_split, train=False))
    share, wrong, nn_top1 = _brute_force_agreement(test["logits"].argmax(1), test["labels"], test["embeddings"],
                                                   tr["embeddings"], tr["labels"])
    assert got["misclassified"] == wrong
    assert got["train_1nn_top1"] == pytest.approx(nn_top1, abs=1e-6)
    if wrong:
        assert got["misclassified_nn_agrees"] == pytest.approx(share, abs=1e-6)
    assert got["top1"] == pytest.approx(1 - wrong / len(test["labels"]), abs=1e-6)


def test_extras_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="eval.train_neighbours.*needs eval.classification"):
        config_from_dict(_events_config(tmp_path, train_neighbours=True, classification=False))
    raw = _events_config(tmp_path, cross_domain=True)
    raw["eval"]["gallery_split"] = "val"
    with pytest.raises(ConfigError, match="'eval.cross_domain' and 'eval.gallery_split'"):
        config_from_dict(raw)
    # a split without domains is named in the error, before training
    raw = _events_config(tmp_path / "r", cross_domain=True)
    with pytest.raises(ValueError, match="eval.cross_domain.*has no domains"):
        train(config_from_dict(raw))


@pytest.mark.filterwarnings("ignore:.*no same-label reference")
def test_cross_domain_metrics_of_an_emoji_run_match_cross_vendor_metrics(tmp_path):
    from test_data_emoji import make_tree

    from deepmetric.evaluate import evaluate_cross_domain

    make_tree(tmp_path / "tree")
    raw = {
        "data": {"name": "emoji", "root": str(tmp_path / "tree"), "options": {"size": 32}, "transform": "emoji",
                 "transform_options": {"normalize": "minus_one_one"}},
        "model": {"name": "glyph_resnet", "options": {"in_chans": 3, "embedding_dim": 8, "widths": [8], "depths": [1],
                                                      "norm": "l2"}},
        "loss": [{"name": "heated_softmax", "options": {"alpha": 16.0}}],
        "train": {"iterations": 2, "batch_size": 8, "seed": 0, "out_dir": str(tmp_path / "run"), "progress": False},
        "eval": {"every": 0, "ks": [1, 2], "metrics": ["recall", "map@r"], "cross_domain": True, "baselines": False},
    }
    train(config_from_dict(raw))
    got = json.loads((tmp_path / "run" / "metrics.json").read_text())["final"]["test"]
    model, _, cfg, _ = load_model_from_checkpoint(tmp_path / "run" / "last.pt")
    test_set = build_split(cfg, "test", train=False)
    ids, names = dataset_domains(test_set)
    assert names == list(test_set.vendors) and np.array_equal(ids, test_set.vendor_ids)
    emb = compute_embeddings(model, test_set)
    ref = evaluate_cross_domain(emb["embeddings"], emb["labels"], test_set.vendor_ids,
                                domain_names=test_set.vendors, ks=(1, 2), metrics=("recall", "map@r"))["mean"]
    for k in ("recall@1", "recall@2", "map@r"):
        assert got[f"cross_domain_{k}"] == pytest.approx(ref[k], abs=1e-6)
    assert "recall@1" in got  # the all-vs-all metrics stay


@pytest.mark.filterwarnings("ignore:.*no same-label reference")
def test_validation_is_searched_cross_vendor_and_selects_best_pt(tmp_path):
    """Issue 21 item 1: with eval.cross_domain the validation emoji are searched like the test
    (each vendor's images against the other vendors'), and that metric selects best.pt."""
    from test_data_emoji import make_tree

    from deepmetric.evaluate import evaluate_cross_domain
    from deepmetric.run.builders import VAL_SPLIT
    from deepmetric.run.rundir import read_log

    make_tree(tmp_path / "tree")
    raw = {
        "data": {"name": "emoji", "root": str(tmp_path / "tree"), "split": "all", "options": {"size": 32},
                 "transform": "emoji", "transform_options": {"normalize": "minus_one_one"}, "val_classes": 3},
        "model": {"name": "glyph_resnet", "options": {"in_chans": 3, "embedding_dim": 8, "widths": [8], "depths": [1],
                                                      "norm": "l2"}},
        "loss": [{"name": "heated_softmax", "options": {"alpha": 16.0}}],
        "train": {"epochs": 2, "batch_size": 4, "seed": 0, "out_dir": str(tmp_path / "run"), "progress": False},
        "eval": {"every": 1, "test_every": 0, "ks": [1, 2], "metrics": ["recall", "map@r"], "cross_domain": True,
                 "best_metric": "cross_domain_map@r", "baselines": False},
    }
    del raw["data"]["split"]
    train(config_from_dict(raw))
    evals = read_log(tmp_path / "run", type="eval")
    assert [(r["split"], r["epoch"]) for r in evals] == [("val", 1), ("val", 2), ("test", 2)]  # test only at the end
    summary = json.loads((tmp_path / "run" / "metrics.json").read_text())
    best = summary["selected"]
    assert best["metric"] == "cross_domain_map@r"
    assert best["value"] == max(r["cross_domain_map@r"] for r in evals if r["split"] == "val")
    # the logged validation value is the cross-vendor search of best.pt's embeddings, by brute force
    model, _, cfg, _ = load_model_from_checkpoint(tmp_path / "run" / "best.pt")
    val = build_split(cfg, VAL_SPLIT, train=False)
    emb = compute_embeddings(model, val)
    ref = evaluate_cross_domain(emb["embeddings"], emb["labels"], val.vendor_ids, ks=(1, 2),
                                metrics=("recall", "map@r"))["mean"]
    assert best["value"] == pytest.approx(ref["map@r"], abs=1e-6)


def test_class_subset_keeps_each_samples_domain():
    from deepmetric.run.builders import ClassSubset

    class Vendored(torch.utils.data.Dataset):
        labels = np.array([0, 1, 2, 1, 0, 2])
        vendor_ids = np.array([0, 0, 1, 1, 2, 2])
        vendors = ["a", "b", "c"]

        def __len__(self):
            return 6

        def __getitem__(self, i):
            return torch.zeros(1), int(self.labels[i])

    sub = ClassSubset(Vendored(), [1, 2])
    ids, names = dataset_domains(sub)
    assert sub.indices.tolist() == [1, 2, 3, 5] and ids.tolist() == [0, 1, 1, 2] and names == ["a", "b", "c"]


def test_compute_embeddings_progress_bar_changes_nothing_but_stderr(capsys):
    from torch.utils.data import TensorDataset

    from deepmetric.data.synthetic import SyntheticMLP

    torch.manual_seed(0)
    model = SyntheticMLP(in_dim=5, hidden=8, embedding_dim=3, normalization="l2")
    ds = TensorDataset(torch.randn(10, 5), torch.arange(10) % 3)
    quiet = compute_embeddings(model, ds, batch_size=4)
    assert capsys.readouterr().err == ""
    shown = compute_embeddings(model, ds, batch_size=4, progress="embedding test")
    err = capsys.readouterr().err
    assert "embedding test" in err and "/3 " in err  # a bar over 3 batches (10 samples by 4)
    np.testing.assert_array_equal(quiet["embeddings"], shown["embeddings"])
    np.testing.assert_array_equal(quiet["labels"], shown["labels"])


@pytest.mark.parametrize("name", ["glyph_resnet", "two_head"])
def test_compute_embeddings_outputs_are_the_models_forward_outputs(name):
    """output="embedding" / "features" (forward_head, with and without pre_logits) give, batch by
    batch, what forward's dict holds in eval mode; with_logits adds the classifier's logits."""
    from torch.utils.data import TensorDataset

    from deepmetric.models import create_model

    torch.manual_seed(0)
    options = dict(backbone="glyph_resnet", input_size=32) if name == "two_head" else {}
    model = create_model(name, embedding_dim=6, norm="bn", num_classes=3, **options)
    with torch.no_grad():  # trained-looking BN statistics, so eval mode is not the identity
        for m in model.modules():
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 1.5)
    x = torch.randn(10, 1, 32, 32)
    ds = TensorDataset(x, torch.arange(10) % 3)
    with torch.no_grad():
        ref = model.eval()(x)
    model.train()
    emb = compute_embeddings(model, ds, batch_size=4)
    feats = compute_embeddings(model, ds, batch_size=4, output="features", with_logits=True)
    assert model.training  # mode restored
    np.testing.assert_allclose(emb["embeddings"], ref["embedding"].numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(feats["embeddings"], ref["features"].numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(feats["logits"], ref["logits"].numpy(), rtol=1e-5, atol=1e-6)
    assert emb["embeddings"].shape == (10, 6) and feats["embeddings"].shape == (10, model.num_features)
    assert "logits" not in emb and emb["labels"].tolist() == (torch.arange(10) % 3).tolist()
    with pytest.raises(ValueError, match=r"output must be one of \('embedding', 'features', 'projection'\), got 'logits'"):
        compute_embeddings(model, ds, output="logits")


@pytest.mark.filterwarnings("ignore:.*no same-label reference")
def test_best_pt_is_evaluated_on_test_when_its_epoch_was_not(tmp_path):
    """With ``eval.test_every: 0`` the test split is evaluated at the end only; when validation
    chose an earlier epoch, ``best.pt`` is evaluated on test after training (``eval.test_selected``),
    and metrics.json's ``selected.test`` is that model's cross-vendor search, by brute force."""
    from test_data_emoji import make_tree

    from deepmetric.evaluate import evaluate_cross_domain
    from deepmetric.run.rundir import read_log

    make_tree(tmp_path / "tree")
    raw = {
        "data": {"name": "emoji", "root": str(tmp_path / "tree"), "options": {"size": 32},
                 "transform": "emoji", "transform_options": {"normalize": "minus_one_one"}, "val_classes": 3},
        "model": {"name": "glyph_resnet", "options": {"in_chans": 3, "embedding_dim": 8, "widths": [8], "depths": [1],
                                                      "norm": "l2"}},
        "loss": [{"name": "heated_softmax", "options": {"alpha": 16.0}}],
        # an lr this small leaves the weights as they are: the validation metric ties, and a tie
        # keeps the first epoch, so best.pt is epoch 1 of 3 and its test split was never evaluated
        "optim": {"lr": 1e-12, "weight_decay": 0.0},
        "train": {"epochs": 3, "batch_size": 4, "seed": 0, "out_dir": str(tmp_path / "run"), "progress": False},
        "eval": {"every": 1, "test_every": 0, "ks": [1, 2], "metrics": ["recall", "map@r"], "cross_domain": True,
                 "best_metric": "cross_domain_map@r", "baselines": False},
    }
    train(config_from_dict(raw))
    summary = json.loads((tmp_path / "run" / "metrics.json").read_text())
    selected = summary["selected"]
    assert selected["epoch"] == 1
    assert [(r["split"], r["epoch"]) for r in read_log(tmp_path / "run", type="eval")] == [
        ("val", 1), ("val", 2), ("val", 3), ("test", 3)]
    [record] = read_log(tmp_path / "run", type="selected_eval")
    assert record["epoch"] == 1 and record["split"] == "test"
    model, _, cfg, _ = load_model_from_checkpoint(tmp_path / "run" / "best.pt")
    test_set = build_split(cfg, "test", train=False)
    emb = compute_embeddings(model, test_set)
    ref = evaluate_cross_domain(emb["embeddings"], emb["labels"], test_set.vendor_ids, ks=(1, 2),
                                metrics=("recall", "map@r"))["mean"]
    for k in ("recall@1", "recall@2", "map@r"):
        assert selected["test"][f"cross_domain_{k}"] == pytest.approx(ref[k], abs=1e-6)
        assert record[f"cross_domain_{k}"] == selected["test"][f"cross_domain_{k}"]
    assert summary["final"]["test"]  # the final model's own test evaluation stays

    # off: nothing evaluated after training, selected.test stays unknown
    raw["train"]["out_dir"] = str(tmp_path / "off")
    raw["eval"]["test_selected"] = False
    train(config_from_dict(raw))
    off = json.loads((tmp_path / "off" / "metrics.json").read_text())["selected"]
    assert off["epoch"] == 1 and off["test"] is None
    assert read_log(tmp_path / "off", type="selected_eval") == []

    # bench/study_selected.py fills it in afterwards (runs made before eval.test_selected) with
    # what the loop would have written: the same seed trains the same best.pt
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("study_selected",
                                                  Path(__file__).resolve().parents[2] / "bench" / "study_selected.py")
    filler = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(filler)
    assert filler.pending_runs(tmp_path) == [tmp_path / "off"]
    filler.main([str(tmp_path)])
    filled = json.loads((tmp_path / "off" / "metrics.json").read_text())["selected"]
    assert filled["test_filled_by"] == "bench/study_selected.py" and filled["epoch"] == 1
    for k, v in selected["test"].items():
        assert filled["test"][k] == pytest.approx(v, abs=1e-6), k
    assert filler.pending_runs(tmp_path) == []  # a rerun has nothing left to do
