"""deepmetric export: ONNX (onnxruntime) and TorchScript outputs equal PyTorch's on real images,
and the preprocessing JSON written beside them re-implemented by hand gives the same input."""
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from deepmetric import cli
from deepmetric.search import Index
from deepmetric.search.export import EmbeddingOnly, preprocessing_path
from deepmetric.search.query import Preprocessing
from deepmetric.run.embed import load_model_from_checkpoint
from search_data import shapes_setup


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    return shapes_setup(tmp_path_factory)


def _batch(shapes):
    index = Index.load(shapes["index_dir"])
    paths = index.paths[::3] + [str(p) for p in sorted(Path(shapes["queries"]).glob("*/*.png"))]
    pre = Preprocessing.from_dict(index.meta["preprocessing"])
    return paths, torch.stack([pre(Image.open(p)) for p in paths]), index


def _reference(shapes, x):
    model, _, _, _ = load_model_from_checkpoint(shapes["checkpoint"])
    with torch.no_grad():
        return EmbeddingOnly(model).eval()(x).numpy(), model


def test_onnx_matches_pytorch_on_real_images(shapes, tmp_path):
    ort = pytest.importorskip("onnxruntime")
    out = tmp_path / "shapes.onnx"
    assert cli.main(["export", str(shapes["checkpoint"]), "--format", "onnx", "--out", str(out)]) == 0
    paths, x, index = _batch(shapes)
    ref, model = _reference(shapes, x)
    sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    got = sess.run(["embedding"], {"image": x.numpy()})[0]
    assert got.shape == (len(paths), 16)
    assert np.abs(got - ref).max() < 1e-4
    # the wrapper is the model's embedding, l2-normalised, i.e. what the index holds
    with torch.no_grad():
        raw = model(x)["embedding"].numpy()
    assert np.abs(ref - raw / np.linalg.norm(raw, axis=1, keepdims=True)).max() < 1e-6
    assert np.abs(got[:11] - index.embeddings[::3]).max() < 1e-4


# torch.jit.load itself warns that TorchScript is deprecated (the user's side, not ours); the
# format stays offered for deployments that still load TorchScript, ONNX is the default
@pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::DeprecationWarning")
def test_torchscript_matches_pytorch_and_raw_output(shapes, tmp_path):
    out = tmp_path / "shapes.pt"
    assert cli.main(["export", str(shapes["checkpoint"]), "--format", "torchscript", "--raw", "--out", str(out)]) == 0
    _, x, _ = _batch(shapes)
    _, model = _reference(shapes, x)
    loaded = torch.jit.load(str(out))
    with torch.no_grad():
        assert (loaded(x) - model(x)["embedding"]).abs().max() < 1e-4
    info = json.loads(preprocessing_path(out).read_text())
    assert info["output"]["l2_normalized"] is False and info["input"]["shape"] == ["batch", 3, 32, 32]
    assert info["postprocess"]["steps"] == [] and "whiten_projection" in info["postprocess"]["how"]


def test_export_json_names_the_configs_postprocessing(shapes):
    from deepmetric.search.export import postprocess_entry
    from deepmetric.run.config_io import config_from_dict

    cfg = config_from_dict({"train": {"epochs": 1}, "search": {"postprocess": [{"name": "whiten", "dim": 4},
                                                                               {"name": "aqe"}]}})
    entry = postprocess_entry(cfg)
    assert entry["steps"] == [{"name": "whiten", "dim": 4, "shrinkage": 0.0, "fit": "gallery"},
                              {"name": "aqe", "k": 2, "alpha": 3.0}]
    assert json.loads(json.dumps(entry)) == entry


def test_preprocessing_json_reimplemented_by_hand(shapes, tmp_path):
    out = tmp_path / "m.onnx"
    cli.main(["export", str(shapes["checkpoint"]), "--out", str(out)])
    info = json.loads(preprocessing_path(out).read_text())
    pre = info["preprocessing"]
    ops = [s["op"] for s in pre["steps"]]
    assert ops == ["exif_transpose", "to_8bit", "composite_alpha", "convert", "rgb", "resize", "center_crop",
                   "to_float", "normalize"]
    steps = {s["op"]: s for s in pre["steps"]}
    assert steps["resize"]["size"] == [36, 36] and steps["center_crop"]["size"] == [32, 32]
    assert pre["mean"] == pytest.approx([0.485, 0.456, 0.406]) and pre["std"] == pytest.approx([0.229, 0.224, 0.225])
    # numpy + PIL from the JSON alone
    paths, x, _ = _batch(shapes)
    for p, xi in zip(paths[:4], x[:4]):
        im = Image.open(p).convert("RGB").resize(tuple(steps["resize"]["size"][::-1]), Image.BILINEAR)
        a = np.asarray(im, np.float32) / 255.0
        h, w = steps["center_crop"]["size"]
        top, left = (a.shape[0] - h) // 2, (a.shape[1] - w) // 2
        a = (a[top:top + h, left:left + w] - np.array(pre["mean"])) / np.array(pre["std"])
        diff = np.abs(a.transpose(2, 0, 1) - xi.numpy()) * np.array(pre["std"])[:, None, None] * 255
        # PIL's bilinear resize and torch's antialiased one differ by at most a few grey levels
        assert diff.max() < 4 and diff.mean() < 0.5, (diff.max(), diff.mean())


@pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::DeprecationWarning")
def test_both_formats_to_one_stem_keep_their_own_preprocessing_json(shapes, tmp_path):
    ckpt = str(shapes["checkpoint"])
    assert cli.main(["export", ckpt, "--format", "onnx", "--out", str(tmp_path / "model.onnx")]) == 0
    assert cli.main(["export", ckpt, "--format", "torchscript", "--raw", "--out", str(tmp_path / "model.pt")]) == 0
    onnx = json.loads((tmp_path / "model.onnx.preprocessing.json").read_text())
    ts = json.loads((tmp_path / "model.pt.preprocessing.json").read_text())
    assert (onnx["format"], onnx["file"], onnx["output"]["l2_normalized"]) == ("onnx", "model.onnx", True)
    assert (ts["format"], ts["file"], ts["output"]["l2_normalized"]) == ("torchscript", "model.pt", False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx", "model.onnx.preprocessing.json",
                                                          "model.pt", "model.pt.preprocessing.json"]


def test_export_errors(shapes, tmp_path, capsys):
    assert cli.main(["export", str(tmp_path / "none.pt"), "--out", str(tmp_path / "m.onnx")]) == 2
    assert "none.pt not found" in capsys.readouterr().err


def test_export_refuses_an_existing_output_without_overwrite(shapes, tmp_path, capsys):
    """export replaced an existing --out silently, while index and train refuse theirs."""
    out = tmp_path / "m.pt"
    cmd = ["export", str(shapes["checkpoint"]), "--format", "torchscript", "--out", str(out)]
    assert cli.main(cmd) == 0
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert cli.main(cmd) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"{out} and {out}.preprocessing.json already exist(s); replace with --overwrite" \
        in err, err
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    (tmp_path / "m.pt").unlink()  # the side file alone is refused too: it would be replaced
    assert cli.main(cmd) == 2 and "m.pt.preprocessing.json already exist(s)" in capsys.readouterr().err
    assert cli.main([*cmd, "--overwrite"]) == 0 and out.is_file()


def test_transparent_queries_are_composited_onto_white_everywhere():
    """Emoji are drawn on white, and the decoder makes every transparent pixel white: a
    transparent query pixel becomes white, not black, with or without the recorded background."""
    import numpy as np
    from PIL import Image

    rgba = np.zeros((8, 8, 4), np.uint8)
    rgba[2:6, 2:6] = (200, 30, 30, 255)  # an opaque red square, the rest fully transparent
    img = Image.fromarray(rgba, "RGBA")
    white = Preprocessing(None, mode="RGB", input_size=8, background="white")(img)
    plain = Preprocessing(None, mode="RGB", input_size=8)(img)
    assert torch.allclose(white[:, 0, 0], torch.ones(3)) and torch.equal(plain, white)
    assert torch.allclose(white[:, 3, 3], torch.tensor([200, 30, 30]) / 255.0)
    grey = Preprocessing(None, mode="L", input_size=8)(img)
    assert grey[0, 0, 0] == 1.0 and grey[0, 3, 3] == pytest.approx(round(0.299 * 200 + 0.587 * 30 + 0.114 * 30) / 255, abs=1 / 255)
    desc = Preprocessing(None, mode="RGB", input_size=8).describe()
    assert {"op": "composite_alpha", "background": "white"} in desc["steps"]


def test_embed_images_is_the_models_normalised_embedding(shapes):
    """Queries are embedded with forward_head(forward_features(x)): the same vectors as the
    model's forward dict, l2-normalised, whatever the batch size."""
    from deepmetric.search.query import embed_images

    paths, x, index = _batch(shapes)
    model, _, _, _ = load_model_from_checkpoint(shapes["checkpoint"])
    pre = Preprocessing.from_dict(index.meta["preprocessing"])
    got = embed_images(model, pre, paths, batch_size=4)
    with torch.no_grad():
        raw = model(x)["embedding"].numpy()
    np.testing.assert_allclose(got, raw / np.linalg.norm(raw, axis=1, keepdims=True), rtol=1e-5, atol=1e-6)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the TorchScript-based exporter, as export_model
@pytest.mark.parametrize("embedding_head", [True, False])
def test_two_head_model_exports_its_embedding(tmp_path, embedding_head):
    """The two-head network exports its embedding (Eq. 9 head, or the pooled features of the
    single-head baseline), not its logits: onnxruntime gives forward(x)["embedding"]."""
    ort = pytest.importorskip("onnxruntime")
    from deepmetric.models import create_model

    torch.manual_seed(0)
    model = create_model("two_head", backbone="glyph_resnet", num_classes=3, input_size=32, norm="bn",
                         embedding_dim=8, embedding_head=embedding_head)
    with torch.no_grad():
        for m in model.modules():  # trained-looking BN statistics
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 1.5)
    model.eval()
    x = torch.randn(3, 1, 32, 32)
    out = tmp_path / "two.onnx"
    with torch.no_grad():
        torch.onnx.export(EmbeddingOnly(model, normalize=False).eval(), (torch.zeros(2, 1, 32, 32),), str(out),
                          input_names=["image"], output_names=["embedding"],
                          dynamic_axes={"image": {0: "batch"}, "embedding": {0: "batch"}}, dynamo=False)
        ref = model(x)["embedding"].numpy()
    got = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(["embedding"], {"image": x.numpy()})[0]
    assert got.shape == (3, 8 if embedding_head else model.num_features)
    assert np.abs(got - ref).max() < 1e-4


def test_a_model_of_vectors_refuses_images_in_one_line(tmp_path, capsys):
    """A checkpoint trained on vectors (the synthetic data) can build an index of its vectors,
    but an image query, an export (an image-shaped example) or a served page cannot use it: each
    says so in one line (torch's shape error was a traceback) and writes nothing."""
    from conftest import synthetic_config
    from deepmetric.run.config_io import config_from_dict
    from deepmetric.train.loop import train

    train(config_from_dict(synthetic_config(tmp_path / "run", train={"epochs": 1})))
    ckpt = tmp_path / "run" / "last.pt"
    assert cli.main(["index", str(ckpt), "--out", str(tmp_path / "idx"), "--no-progress"]) == 0
    Image.new("RGB", (20, 20), (200, 10, 10)).save(tmp_path / "q.png")
    capsys.readouterr()
    said = r"cannot embed images: after the checkpoint's preprocessing an image is a tensor of shape \[3, \d+, \d+\]"
    assert cli.main(["search", str(tmp_path / "idx"), str(tmp_path / "q.png"),
                     "--html", str(tmp_path / "r.html")]) == 2
    err = capsys.readouterr().err
    assert re.search(said, err) and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "r.html").exists()
    assert cli.main(["export", str(ckpt), "--out", str(tmp_path / "m.onnx")]) == 2
    err = capsys.readouterr().err
    assert re.search(said, err) and "trained on vectors" in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["idx", "q.png", "run"]  # no partial export
    from deepmetric.search.served import prepare  # serve's start-up check, before it listens

    with pytest.raises(ValueError, match=said):
        prepare(Index.load(tmp_path / "idx"), generation=0, max_decode_mb=None)
