"""A run trained with ``eval.embedding: projection`` is indexed, searched, extended and exported
with the projection head's output, the one its validation chose best.pt on (before, index /
search / export always took the head's output and so served another embedding than the one
measured).  The reference is the model's own ``forward`` dict, computed here, and
``deepmetric embed`` (which already honoured eval.embedding)."""
import json

import numpy as np
import pytest
import torch

from deepmetric import cli
from deepmetric.run.config_io import config_from_dict
from deepmetric.run.embed import load_model_from_checkpoint, load_search_network
from deepmetric.search import Index
from deepmetric.search.build import embed_dataset_for_index, stored_output
from deepmetric.search.export import preprocessing_path
from deepmetric.search.query import load_image, preprocessing_from_config
from deepmetric.train.loop import train
from search_data import make_shapes_folder, tiny_config

EMBEDDING_DIM, PROJECTION_DIM = 16, 6


@pytest.fixture(scope="module")
def projected(tmp_path_factory):
    base = tmp_path_factory.mktemp("projected")
    folder = make_shapes_folder(base / "gallery", per_class=4)
    raw = tiny_config(folder, base / "run", epochs=3)
    raw["model"]["options"]["projection"] = {"dim": PROJECTION_DIM, "norm": "none"}
    raw["loss"][0]["input"] = "projection"  # the head trains through the projection
    raw["eval"]["embedding"] = "projection"
    train(config_from_dict(raw))
    return {"folder": folder, "checkpoint": base / "run" / "last.pt", "base": base}


def _outputs(checkpoint, paths):
    """The model's own forward dict on the images, as the index preprocesses them."""
    model, _, cfg, _ = load_model_from_checkpoint(checkpoint, "cpu")
    pre = preprocessing_from_config(cfg)
    x = torch.stack([pre(load_image(p, mode=pre.mode)) for p in paths])
    with torch.no_grad():
        out = model(x)
    return {k: torch.nn.functional.normalize(v, dim=1).numpy() for k, v in out.items() if v.dim() == 2}, x


def test_index_holds_and_queries_with_the_projection(projected, tmp_path):
    index = Index.build(projected["checkpoint"], out=tmp_path / "index", progress=False)
    manifest = json.loads((tmp_path / "index" / "manifest.json").read_text())
    assert manifest["embedding_output"] == "projection" and manifest["dim"] == PROJECTION_DIM
    ref, _ = _outputs(projected["checkpoint"], index.paths)
    assert ref["embedding"].shape[1] == EMBEDDING_DIM  # the head's output differs in size: not what is indexed
    assert np.abs(index.embeddings - ref["projection"]).max() < 1e-5
    # `deepmetric embed` (eval.embedding honoured there already) gives the same rows
    npz = tmp_path / "e.npz"
    assert cli.main(["embed", str(projected["checkpoint"]), "--split", "all", "--out", str(npz)]) == 0
    z = np.load(npz, allow_pickle=False)
    e = z["embeddings"] / np.linalg.norm(z["embeddings"], axis=1, keepdims=True)
    assert list(z["paths"]) == index.paths and np.abs(e - index.embeddings).max() < 1e-5
    # an image query is embedded with the same output: an indexed image finds itself at cosine 1
    loaded = Index.load(tmp_path / "index")
    sims, idx = loaded.search(loaded.paths[5], k=1)
    assert idx[0, 0] == 5 and sims[0, 0] == pytest.approx(1.0, abs=1e-5)
    assert np.abs(loaded.embed([loaded.paths[2]]) - ref["projection"][2]).max() < 1e-5


def test_added_rows_and_old_indexes_keep_the_output_already_indexed(projected, tmp_path):
    new = make_shapes_folder(tmp_path / "more", per_class=1, seed=11)
    base = Index.build(projected["checkpoint"], out=tmp_path / "index", progress=False)
    grown = Index.build(projected["checkpoint"], out=tmp_path / "index", root=str(new), add=True, progress=False)
    assert len(grown) == len(base) + 4 and grown.dim == PROJECTION_DIM
    ref, _ = _outputs(projected["checkpoint"], grown.paths[len(base):])
    assert np.abs(grown.embeddings[len(base):] - ref["projection"]).max() < 1e-5
    # an index written before `embedding_output` existed holds the head's output: its queries and
    # added rows keep it; a vectors index (no checkpoint) takes the checkpoint's eval.embedding
    old_meta = {"checkpoint": {"path": str(projected["checkpoint"])}}
    assert (stored_output(old_meta), stored_output({}), stored_output(None)) == ("embedding", None, None)
    assert stored_output({"embedding_output": "projection", "checkpoint": {}}) == "projection"
    got = embed_dataset_for_index(projected["checkpoint"], root=str(new), split="all", progress=False,
                                  index_meta=old_meta)
    ref_new, _ = _outputs(projected["checkpoint"], got["paths"])
    assert got["embedding_output"] == "embedding"
    assert np.abs(got["embeddings"] / np.linalg.norm(got["embeddings"], axis=1, keepdims=True)
                  - ref_new["embedding"]).max() < 1e-5


def test_index_command_says_which_output_it_embedded(projected, tmp_path, capsys):
    assert cli.main(["index", str(projected["checkpoint"]), "--out", str(tmp_path / "ix"), "--no-progress"]) == 0
    assert "embedded with the model's projection output" in capsys.readouterr().out


def test_export_writes_the_projection(projected, tmp_path):
    out = tmp_path / "model.pt"
    assert cli.main(["export", str(projected["checkpoint"]), "--format", "torchscript", "--out", str(out)]) == 0
    info = json.loads(preprocessing_path(out).read_text())
    assert info["output"]["model_output"] == "projection" and info["output"]["shape"] == ["batch", PROJECTION_DIM]
    paths = sorted(str(p) for p in projected["folder"].glob("*/*.png"))[:6]
    ref, x = _outputs(projected["checkpoint"], paths)
    with torch.no_grad():
        got = torch.jit.load(str(out))(x).numpy()
    assert np.abs(got - ref["projection"]).max() < 1e-4


def test_search_network_refuses_an_output_it_cannot_search(projected):
    net, cfg, _, output = load_search_network(projected["checkpoint"], output="embedding")
    assert output == "embedding" and net.embedding_dim == EMBEDDING_DIM
    with pytest.raises(ValueError, match="eval.embedding"):
        load_search_network(projected["checkpoint"], output="features")


def test_post_processing_is_chosen_on_the_output_the_index_holds(projected):
    from deepmetric.workflows.tune_postprocess import validation_embeddings

    model, _, cfg, _ = load_model_from_checkpoint(projected["checkpoint"], "cpu")
    cfg.data.val_classes = 0.5
    assert validation_embeddings(model, cfg)["embeddings"].shape[1] == PROJECTION_DIM
    assert validation_embeddings(model, cfg, output="embedding")["embeddings"].shape[1] == EMBEDDING_DIM
