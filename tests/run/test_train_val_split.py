"""A validation split the dataset provides (``data.val_split``: the emoji closed-set vendor split's
``val``), runs without a test split (``eval.split: null``) and classification-only evaluation
(``eval.metrics: []``): what the two-head accuracy claim's lr runs use so that the test vendor is
never evaluated while anything is chosen."""
import json

import numpy as np
import pytest

from deepmetric.train import train
from deepmetric.run.config import ConfigError
from deepmetric.run.config_io import config_from_dict


def _raw(tree, out, **eval_keys):
    return {
        "data": {"name": "emoji", "root": str(tree),
                 "options": {"size": 32, "protocol": "closed_set_vendor", "test_vendor": "twitter",
                             "val_vendor": "facebook"},
                 "transform": "emoji", "transform_options": {"normalize": "minus_one_one"}, "val_split": "val"},
        "model": {"name": "two_head", "options": {"backbone": "glyph_resnet", "in_chans": 3, "widths": [8],
                                                  "depths": [1], "input_size": 32, "embedding_dim": 8}},
        "loss": [{"name": "cross_entropy", "input": "logits"},
                 {"name": "triplet", "options": {"mining": "semihard", "margin": 0.2}}],
        "train": {"epochs": 2, "batch_size": 8, "sampler": "class_balanced", "m": 4, "n": 2, "seed": 0,
                  "out_dir": str(out), "progress": False},
        "eval": {"every": 1, "split": None, "classification": True, "metrics": [], "best_metric": "top1",
                 "baselines": False, **eval_keys},
    }


@pytest.fixture
def tree(tmp_path):
    from test_data_emoji import make_tree

    make_tree(tmp_path / "tree")
    return tmp_path / "tree"


def test_dataset_validation_split_without_test_split(tmp_path, tree):
    from deepmetric.evaluate import classification_accuracy
    from deepmetric.run.builders import build_split
    from deepmetric.run.embed import compute_embeddings, load_model_from_checkpoint
    from deepmetric.run.rundir import read_log

    out = tmp_path / "run"
    res = train(config_from_dict(_raw(tree, out)))
    metrics = json.loads((out / "metrics.json").read_text())
    # no test split anywhere: not in metrics.json, not in the log, not built
    assert set(metrics["final"]) == {"val"} and metrics["metrics"] == {}
    assert "test" not in metrics["selected"] and metrics["selected"]["metric"] == "top1"
    records = read_log(out)
    assert {r["split"] for r in records if "split" in r} == {"val"}
    assert [r["epoch"] for r in records if r.get("type") == "eval"] == [1, 2]
    assert set(res.final["val"]) == {"top1", "mean_per_class"}  # classification only
    # the validation split is facebook's images of the training classes, scored by the classifier
    model, _, cfg, _ = load_model_from_checkpoint(out / "last.pt")
    val = build_split(cfg, "val", train=False)
    assert {val.vendors[v] for v in val.vendor_ids} == {"facebook"}
    out_val = compute_embeddings(model, val, with_logits=True)
    ref = classification_accuracy(out_val["logits"], out_val["labels"])
    assert res.final["val"]["top1"] == pytest.approx(ref["top1"])
    assert res.final["val"]["mean_per_class"] == pytest.approx(ref["mean_per_class"])
    assert (out / "best.pt").is_file()
    # a finished run resumed does not evaluate again (its validation record is the final one)
    n_eval = len([r for r in read_log(out) if r.get("type") == "eval"])
    train(config_from_dict(_raw(tree, out)), resume=str(out / "last.pt"))
    assert len([r for r in read_log(out) if r.get("type") == "eval"]) == n_eval
    # the train split holds neither held-out vendor
    tr = build_split(cfg, "train", train=False)
    assert not np.isin([tr.vendors[v] for v in tr.vendor_ids], ["facebook", "twitter"]).any()


def test_config_errors_name_the_keys(tmp_path, tree):
    raw = _raw(tree, tmp_path / "r")
    raw["data"]["val_classes"] = 2
    with pytest.raises(ConfigError, match="data.val_split"):
        config_from_dict(raw)
    raw = _raw(tree, tmp_path / "r", classification=False)
    with pytest.raises(ConfigError, match=r"eval.metrics.*classification"):
        config_from_dict(raw)
    for bad in ({"wise_ft": [0.5]}, {"train_neighbours": True}, {"gallery_split": "test"}):
        with pytest.raises(ConfigError, match="eval.split"):
            config_from_dict(_raw(tree, tmp_path / "r", **bad))
    # validation classes carved from training still refuse classification (class-disjoint)
    raw = _raw(tree, tmp_path / "r")
    raw["data"]["val_split"] = None
    raw["data"]["val_classes"] = 2
    with pytest.raises(ConfigError, match="classification"):
        config_from_dict(raw)
