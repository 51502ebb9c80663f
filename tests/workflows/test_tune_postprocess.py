"""deepmetric tune CHECKPOINT --postprocess: the choice is made on the validation split only."""
import json

import pytest
import yaml

from conftest import synthetic_config
from deepmetric import cli
from deepmetric.evaluate import evaluate
from deepmetric.run.config_io import config_from_dict
from deepmetric.train.loop import train


@pytest.fixture(scope="module")
def run_with_val(tmp_path_factory):
    out = tmp_path_factory.mktemp("pp_run")
    cfg = config_from_dict(synthetic_config(out, classes=10, per_class=12, data={"val_classes": 4},
                                            train={"epochs": 2}))
    train(cfg)
    return out


def test_tune_postprocess_chooses_on_validation(run_with_val, tmp_path, capsys, monkeypatch):
    import deepmetric.run.builders as builders

    seen = []
    real = builders.build_split
    monkeypatch.setattr(builders, "build_split", lambda cfg, split, **kw: seen.append(split) or real(cfg, split, **kw))
    ckpt = run_with_val / "last.pt"
    assert cli.main(["tune", str(ckpt), "--postprocess", "--out", str(tmp_path / "pp")]) == 0
    text = capsys.readouterr().out
    assert "[tune] chosen:" in text and "map@r" in text
    assert seen == ["val"]  # nothing else, the test split least of all
    res = json.loads((tmp_path / "pp" / "postprocess_trials.json").read_text())
    chosen = yaml.safe_load((tmp_path / "pp" / "postprocess.yaml").read_text())["search"]["postprocess"]
    assert chosen == res["steps"] and res["value"] >= res["baseline"]
    assert res["split"] == "val" and not any("test" in k for k in res)  # validation numbers only
    # the chosen steps load as a config block and reproduce the reported validation value
    cfg = config_from_dict({"train": {"epochs": 1}, "search": {"postprocess": chosen}})
    from deepmetric.run.embed import load_model_from_checkpoint
    from deepmetric.workflows.tune_postprocess import validation_embeddings

    model, _, run_cfg, _ = load_model_from_checkpoint(ckpt, "cpu")
    v = validation_embeddings(model, run_cfg)
    got = evaluate(v["embeddings"], v["labels"], ks=(1,), metrics=["map@r"], postprocess=cfg.search.postprocess)
    assert got["map@r"] == pytest.approx(res["value"])
    # the baseline is the same validation embeddings without post-processing
    assert res["baseline"] == pytest.approx(evaluate(v["embeddings"], v["labels"], ks=(1,), metrics=["map@r"])["map@r"])


def test_tune_postprocess_refuses_test_and_runs_without_validation(run_with_val, tmp_path, capsys):
    from deepmetric.run.embed import load_model_from_checkpoint
    from deepmetric.workflows.tune_postprocess import validation_embeddings

    model, _, cfg, _ = load_model_from_checkpoint(run_with_val / "last.pt", "cpu")
    with pytest.raises(ValueError, match="never on the test split"):
        validation_embeddings(model, cfg, split="test")
    cfg.data.val_classes = None
    with pytest.raises(ValueError, match="no validation split"):
        validation_embeddings(model, cfg)
    assert cli.main(["tune", str(run_with_val / "last.pt")]) == 2
    assert "required: --space, --trials" in capsys.readouterr().err
    # the other mode's options were ignored silently (an override did not change the validation)
    ckpt = str(run_with_val / "last.pt")
    assert cli.main(["tune", ckpt, "--postprocess", "--trials", "3", "--workers", "2", "data.val_classes=0.5"]) == 2
    assert ("--trials, --workers, KEY=VALUE overrides: not taken here (--postprocess tunes the post-processing"
            in capsys.readouterr().err)
    assert cli.main(["tune", ckpt, "--space", "s.yaml", "--trials", "1", "--kreciprocal", "--device", "cpu"]) == 2
    assert "--kreciprocal, --device: not taken here (they apply to --postprocess)" in capsys.readouterr().err
