"""``deepmetric evaluate`` round trip through main([...]) and its bad-file errors."""
import json

import numpy as np
import pytest

from deepmetric.cli import main
from deepmetric.evaluate import evaluate


@pytest.fixture
def npz(tmp_path, rng):
    y = rng.integers(0, 6, 60)
    x = (rng.standard_normal((6, 8))[y] + 0.5 * rng.standard_normal((60, 8))).astype(np.float32)
    path = tmp_path / "emb.npz"
    np.savez(path, embeddings=x, labels=y)
    return path, x, y


def test_round_trip_matches_api(npz, tmp_path, capsys):
    path, x, y = npz
    out = tmp_path / "sub" / "metrics.json"
    assert main(["evaluate", str(path), "--k", "1", "5", "--out", str(out), "--backend", "torch",
                 "--chunk-size", "7"]) == 0
    printed = capsys.readouterr().out
    assert "recall@5" in printed and "map@r" in printed and "nmi" in printed
    got = json.loads(out.read_text())
    assert got == pytest.approx(evaluate(x, y, ks=(1, 5)))


def test_kmeans_restarts_option(tmp_path):
    from deepmetric.evaluate import kmeans
    from deepmetric.evaluate.clustering import nmi_from_clusters

    # overlapping classes, where 4 restarts and 1 give different clusterings (asserted below),
    # so the NMI shows whether the option reached k-means
    rng = np.random.default_rng(0)
    y = rng.integers(0, 6, 120)
    x = (rng.standard_normal((6, 8))[y] + rng.standard_normal((120, 8))).astype(np.float32)
    path, out = tmp_path / "emb.npz", tmp_path / "m.json"
    np.savez(path, embeddings=x, labels=y)
    assert main(["evaluate", str(path), "--metrics", "nmi", "f1", "--kmeans-restarts", "4", "--seed", "2",
                 "--out", str(out)]) == 0
    four, one = (nmi_from_clusters(y, kmeans(x, 6, seed=2, restarts=r)) for r in (4, 1))
    assert abs(four - one) > 0.05
    assert json.loads(out.read_text())["nmi"] == pytest.approx(four)


def test_query_gallery_masks_and_metric_subset(tmp_path, npz, capsys):
    _, x, y = npz
    is_q = np.arange(60) % 2 == 0
    path = tmp_path / "inshop.npz"
    np.savez(path, embeddings=x, labels=y, is_query=is_q, is_gallery=~is_q)
    out = tmp_path / "m.json"
    assert main(["evaluate", str(path), "--metrics", "recall", "map@r", "--out", str(out)]) == 0
    got = json.loads(out.read_text())
    want = evaluate(x, y, is_query=is_q, is_gallery=~is_q, metrics=["recall", "map@r"])
    assert got == pytest.approx(want)
    assert "nmi" not in got


@pytest.mark.parametrize("arrays,message", [
    ({"embeddings": np.ones((4, 2), np.float32)}, "missing array 'labels'"),
    ({"labels": np.arange(4)}, "missing array 'embeddings'"),
    ({"embeddings": np.ones(4, np.float32), "labels": np.arange(4)}, "'embeddings' must be a 2-D float"),
    ({"embeddings": np.ones((4, 2), np.float32), "labels": np.arange(3)}, "'labels' has 3 entries"),
    ({"embeddings": np.ones((4, 2), np.float32), "labels": np.arange(4.0)}, "'labels' must be a 1-D integer"),
    ({"embeddings": np.ones((4, 2), np.float32), "labels": np.arange(4), "is_query": np.ones(4)},
     "'is_query' must be a boolean"),
    ({"embeddings": np.full((4, 2), np.nan, np.float32), "labels": np.arange(4)}, "NaN"),
    ({"embeddings": np.ones((4, 2), bool), "labels": np.arange(4)}, "'embeddings' must be a 2-D float"),
])
def test_bad_npz_clear_error_no_traceback(tmp_path, capsys, arrays, message):
    path = tmp_path / "bad.npz"
    np.savez(path, **arrays)
    assert main(["evaluate", str(path)]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and message in err
    assert "Traceback" not in err


def test_missing_and_corrupt_file(tmp_path, capsys):
    assert main(["evaluate", str(tmp_path / "nope.npz")]) == 2
    assert "no such file" in capsys.readouterr().err
    bad = tmp_path / "junk.npz"
    bad.write_bytes(b"\xfe\xfa\x00 not a zip")
    assert main(["evaluate", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}: this is a binary file of another kind (it starts with bytes fe fa 00 20 6e 6f 74 20), not an " \
           ".npz archive" in err and "allow_pickle" not in err, err
    cut = tmp_path / "cut.npz"  # a damaged archive
    np.savez(cut, embeddings=np.zeros((4, 2)), labels=np.arange(4))
    cut.write_bytes(cut.read_bytes()[:30])
    assert main(["evaluate", str(cut)]) == 2
    assert "not a readable .npz" in capsys.readouterr().err


def test_wrong_kind_of_file_is_named(tmp_path, capsys):
    """An .npy, an image, a checkpoint, an ONNX model, a text file or any other binary file given to
    evaluate says what it is and what was expected (before: numpy's 'Failed to interpret file ...
    as a pickle'; an ONNX model or other binary file got numpy's advice to load it with allow_pickle=)."""
    import torch
    from PIL import Image

    npy = tmp_path / "emb.npy"
    np.save(npy, np.zeros((5, 3), np.float32))
    png = tmp_path / "digit.png"
    Image.new("L", (8, 8)).save(png)
    ckpt = tmp_path / "last.pt"
    torch.save({"model": {"w": torch.zeros(2)}}, ckpt)
    txt = tmp_path / "config.yaml"
    txt.write_text("data: {name: folder}\n")
    onnx = tmp_path / "model.onnx"  # a ModelProto's first fields (ir_version, producer_name) and more
    onnx.write_bytes(b"\x08\x08\x12\x07pytorch\x1a\x052.5.0:\x9b\x01\n\xff\xfe" + bytes(range(256)))
    renamed = tmp_path / "model.bin"
    renamed.write_bytes(onnx.read_bytes())
    other = tmp_path / "vectors.bin"
    other.write_bytes(b"\x00\xff\x10\x80" * 64)
    cases = {npy: "a single .npy array of shape (5, 3) and dtype float32, not an .npz archive",
             png: "a PNG image; to embed images, train a model and run 'deepmetric embed'",
             ckpt: "a PyTorch checkpoint (torch.save), not embeddings",
             txt: "a text file (it starts with 'data: {name: folder}')",
             onnx: "an ONNX model ('deepmetric export'), not embeddings; write the embeddings of a split with "
                   "'deepmetric embed CHECKPOINT --out EMB.npz'",
             renamed: "an ONNX model ('deepmetric export'), not embeddings",
             other: "a binary file of another kind (it starts with bytes 00 ff 10 80 00 ff 10 80), not an .npz"}
    for path, what in cases.items():
        assert main(["evaluate", str(path)]) == 2
        err = capsys.readouterr().err
        assert f"{path}: this is {what}" in err, err
        assert "expects an .npz file with arrays 'embeddings' (N x d float) and 'labels'" in err
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1
        assert "allow_pickle" not in err  # numpy's advice to load a pickle unsafely (ONNX files got it)
    assert main(["evaluate", str(tmp_path)]) == 2
    assert "is a folder; expected an .npz" in capsys.readouterr().err


def test_debug_env_reraises_user_errors(tmp_path, monkeypatch):
    """DEEPMETRIC_DEBUG=1 turns the one-line error into the real exception (for bug reports)."""
    from deepmetric.cli import main

    bad = tmp_path / "bad.npz"
    np.savez(bad, embeddings=np.zeros((3, 2), dtype=np.float32))
    assert main(["evaluate", str(bad)]) == 2
    monkeypatch.setenv("DEEPMETRIC_DEBUG", "1")
    with pytest.raises(ValueError, match="labels"):
        main(["evaluate", str(bad)])


def test_version_flag(capsys):
    from deepmetric import __version__
    from deepmetric.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert __version__ in capsys.readouterr().out


def test_integer_embeddings_are_evaluated_as_their_float_values(tmp_path):
    """Quantised (int8) vectors are numbers: the same metrics as their float32 copy (they were
    refused, while report, index --embeddings and the Python API read them)."""
    x = np.random.default_rng(0).integers(-100, 100, (40, 8))
    y = np.arange(40) % 4
    got = {}
    for dtype in (np.int8, np.float32):
        np.savez(tmp_path / "e.npz", embeddings=x.astype(dtype), labels=y)
        assert main(["evaluate", str(tmp_path / "e.npz"), "--metrics", "recall", "map@r", "--out",
                     str(tmp_path / f"{np.dtype(dtype).name}.json")]) == 0
        got[dtype] = json.loads((tmp_path / f"{np.dtype(dtype).name}.json").read_text())
    assert got[np.int8] == got[np.float32] and got[np.int8] == pytest.approx(
        evaluate(x.astype(np.float32), y, metrics=["recall", "map@r"]))
