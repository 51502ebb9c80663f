"""Self-contained checkpoints (issue 35 item 2, issue 32 item 11): a checkpoint trained with
``model.options.pretrained=FILE`` embeds, indexes and exports after FILE is gone, and a WiSE-FT
run resumes without it (the model as it started is in the checkpoint); a checkpoint of the
format the code wrote before ``start_model`` existed still loads."""
import json

import numpy as np
import pytest
import torch

from deepmetric.data.synthetic import write_digit_folder
from deepmetric.models import create_model
from deepmetric.run.checkpoint import load_checkpoint, save_checkpoint
from deepmetric.run.config_io import config_from_dict
from deepmetric.run.embed import embed_checkpoint, load_model_from_checkpoint
from deepmetric.run.rundir import read_log
from deepmetric.train.loop import train

GLYPH = {"in_chans": 1, "widths": [8, 16], "depths": [1, 1]}


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    return write_digit_folder(tmp_path_factory.mktemp("sc") / "digits", per_class=8, seed=0)


def _weights(path):
    torch.manual_seed(7)
    state = create_model("glyph_resnet", embedding_dim=8, **GLYPH).backbone.state_dict()
    torch.save(state, path)
    return {k: v.clone() for k, v in state.items()}


def _raw(digits, weights, out, **eval_options):
    return {
        "data": {"name": "folder", "root": str(digits), "options": {"class_split": "half", "mode": "L"},
                 "transform": "mnist", "transform_options": {"size": 28}, "val_classes": 2},
        "model": {"name": "glyph_resnet", "options": {"embedding_dim": 8, "pretrained": str(weights), **GLYPH}},
        "loss": [{"name": "heated_softmax", "options": {"alpha": 16.0}}],
        "optim": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
        "train": {"epochs": 1, "batch_size": 20, "seed": 0, "out_dir": str(out), "progress": False,
                  "num_threads": 1},
        "eval": {"every": 1, "ks": [1], "metrics": ["recall"], "baselines": False, **eval_options},
    }


def test_checkpoint_embeds_indexes_and_exports_after_the_weights_file_is_gone(digits, tmp_path):
    from deepmetric.search import Index
    from deepmetric.search.export import export_model

    weights = tmp_path / "w.pt"
    _weights(weights)
    train(config_from_dict(_raw(digits, weights, tmp_path / "run")))
    ckpt = tmp_path / "run" / "last.pt"
    state = load_checkpoint(ckpt)
    assert "start_model" not in state  # no WiSE-FT, no teacher: nothing kept beside the model
    weights.unlink()
    model, _, cfg, _ = load_model_from_checkpoint(ckpt)
    assert cfg.model.options["pretrained"] == str(weights)  # the config still names it
    for k, v in state["model"].items():
        assert torch.equal(model.state_dict()[k], v), k
    emb = np.load(embed_checkpoint(ckpt, tmp_path / "e.npz"))["embeddings"]
    assert emb.shape[1] == 8 and np.isfinite(emb).all()
    out, side = export_model(ckpt, tmp_path / "m.onnx")
    assert out.is_file() and json.loads(side.read_text())["model"] == "glyph_resnet"
    index = Index.build(ckpt, out=tmp_path / "index", progress=False)
    assert len(index) > 0


def test_wise_ft_run_resumes_without_the_weights_file(digits, tmp_path):
    weights = tmp_path / "w.pt"
    original = _weights(weights)
    run = tmp_path / "run"
    raw = _raw(digits, weights, run, wise_ft=[0.5], best_metric="recall@1")
    train(config_from_dict(raw))
    first = load_checkpoint(run / "last.pt")
    start = first["start_model"]  # the model as it started: the file's backbone, the fresh head
    for k, v in original.items():
        assert torch.equal(start[f"backbone.{k}"], v), k
    weights.unlink()
    raw["train"]["epochs"] = 2
    train(config_from_dict(raw), resume=run / "last.pt")
    assert load_checkpoint(run / "last.pt")["epoch"] == 2
    steps = [r["step"] for r in read_log(run, type="step")]
    assert steps == list(range(1, 2 * first["iteration"] + 1))  # continued, no step twice
    # WiSE-FT after the resume mixed best.pt with the start state read from the checkpoint
    wise, best = load_checkpoint(run / "wise.pt"), load_checkpoint(run / "best.pt")
    a = json.loads((run / "metrics.json").read_text())["wise_ft"]["alpha"]
    for k, v in original.items():
        if v.is_floating_point():
            torch.testing.assert_close(wise["model"][f"backbone.{k}"], torch.lerp(v, best["model"][f"backbone.{k}"], a),
                                       rtol=0, atol=1e-6)


def test_checkpoint_of_the_previous_format_loads_and_its_wise_ft_resume_names_the_file(digits, tmp_path):
    """Before this change checkpoints had no ``start_model`` (same format version): such a file,
    made here from the current code's output by dropping the key, embeds without the weights
    file; resuming its WiSE-FT run needs the pretrained weights again, and says which file."""
    weights = tmp_path / "w.pt"
    _weights(weights)
    run = tmp_path / "run"
    raw = _raw(digits, weights, run, wise_ft=[0.5], best_metric="recall@1")
    train(config_from_dict(raw))
    old = load_checkpoint(run / "last.pt")
    old.pop("start_model")
    save_checkpoint(old, run / "last.pt")
    weights.unlink()
    assert np.load(embed_checkpoint(run / "last.pt", tmp_path / "e.npz"))["embeddings"].shape[1] == 8
    raw["train"]["epochs"] = 2
    with pytest.raises(FileNotFoundError, match=f"pretrained weights file not found: '{weights}'"):
        train(config_from_dict(raw), resume=run / "last.pt")
