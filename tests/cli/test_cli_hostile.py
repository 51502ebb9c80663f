"""Hostile command lines (issue 32, item 12), each one clear line on stderr with exit code 2 and
no traceback: tune spaces with ``step: 0``, a dict choice or an infinite bound (refused before
any trial); ``export --opset 7 / 99`` and a checkpoint with NaN weights (nothing written); a
pickled ``model.options.pretrained`` file (torch's advice to load with weights_only=False is not
repeated); ``report --queries -5`` (before any figure); ``embed --out EXISTING_DIR`` (no
``DIR.npz`` beside it). ``evaluate`` shows its progress on large files."""
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from deepmetric import cli
from deepmetric.cli import evaluate as evaluate_io
from conftest import synthetic_config
from search_data import shapes_setup, tiny_config


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    return shapes_setup(tmp_path_factory)


def _one_clear_line(capsys, *needles):
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err
    for n in needles:
        assert n in err, (n, err)
    return err


# --------------------------------------------------------------------------- tune spaces
@pytest.mark.parametrize("param, needle", [
    ("{type: float, low: 0.001, high: 0.1, step: 0}", "params.p.step: expected a number > 0, got 0"),
    ("{type: int, low: 1, high: 8, step: 0}", "params.p.step: expected a whole number > 0, got 0"),
    ("{type: int, low: 1, high: 8, step: 1.5}", "params.p.step: expected a whole number > 0, got 1.5"),
    ("{type: float, low: 0.001, high: .inf}", "params.p.high: expected a finite number, got inf"),
    ("{type: int, low: -.inf, high: 3}", "params.p.low: expected a finite number, got -inf"),
    ("{type: float, low: .nan, high: 1}", "params.p.low: expected a finite number, got nan"),
    ("{type: categorical, choices: [0.1, {lr: 0.2}]}", "params.p.choices: {'lr': 0.2} is not a plain value"),
    ("{type: categorical, choices: [[1, {a: 2}], [3, 4]]}", "is not a plain value"),
])
def test_a_bad_space_is_refused_up_front(tmp_path, capsys, param, needle):
    raw = synthetic_config(classes=12, data={"val_classes": 0.3}, train={"epochs": 1})
    recipe, space = tmp_path / "recipe.yaml", tmp_path / "space.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    key = "optim.lr" if "categorical" in param or "float" in param else "train.epochs"
    space.write_text(f"objective: {{metric: recall@1}}\nparams:\n  p: {{keys: [{key}], {param[1:-1]}}}\n")
    out = tmp_path / "out"
    assert cli.main(["tune", str(recipe), "--space", str(space), "--trials", "2", "--out", str(out)]) == 2
    _one_clear_line(capsys, str(space), needle)
    assert not out.exists()  # no study, no trial 0


def test_list_choices_still_work_for_one_key(tmp_path):
    from deepmetric.workflows.tune_space import load_space

    space = tmp_path / "space.yaml"
    space.write_text("objective: {metric: recall@1}\nparams:\n"
                     "  w: {keys: [model.options.widths], type: categorical, choices: [[8, 16], [16, 32]]}\n"
                     "  s: {keys: [optim.lr], type: float, low: 0.01, high: 0.1, step: 0.01}\n"
                     "  n: {keys: [model.options.channels, model.options.depths], type: categorical,\n"
                     "      choices: [[[8, 16], [1, 1]], [[16, 32], [2, 2]]]}\n")
    params = load_space(space).params
    assert params[0].choices == [[8, 16], [16, 32]] and params[1].step == 0.01
    assert params[2].overrides(params[2].choices[1]) == ["model.options.channels=[16, 32]", "model.options.depths=[2, 2]"]


# --------------------------------------------------------------------------- export
@pytest.mark.parametrize("opset", ["7", "99"])
def test_export_with_an_opset_torch_cannot_write_is_one_line(shapes, tmp_path, capsys, opset):
    out = tmp_path / "m.onnx"
    capsys.readouterr()
    assert cli.main(["export", str(shapes["checkpoint"]), "--out", str(out), "--opset", opset]) == 2
    _one_clear_line(capsys, f"--opset {opset}: torch", "cannot export this model to ONNX", "default 17")
    assert list(tmp_path.iterdir()) == []  # neither half a model nor a temporary file
    assert capsys.readouterr().out == ""  # torch's graph dump is not shown


def test_export_refuses_nan_weights(shapes, tmp_path, capsys):
    state = torch.load(shapes["checkpoint"], weights_only=True)
    name = next(k for k, v in state["model"].items() if v.is_floating_point() and v.ndim > 1)
    state["model"][name].view(-1)[3] = float("nan")
    bad = tmp_path / "diverged.pt"
    torch.save(state, bad)
    out = tmp_path / "m.onnx"
    for fmt in ("onnx", "torchscript"):
        assert cli.main(["export", str(bad), "--format", fmt, "--out", str(out)]) == 2
        _one_clear_line(capsys, f"checkpoint {bad}: weight {name!r} holds 1 NaN or infinite value(s)")
    assert not out.exists()
    # embed wrote an .npz of NaN rows that every metric then refused: now refused, nothing written
    npz = tmp_path / "e.npz"
    assert cli.main(["embed", str(bad), "--split", "all", "--out", str(npz)]) == 2
    _one_clear_line(capsys, f"checkpoint {bad} embeds ", "image(s) as NaN / inf, the first ", "nothing was written")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["diverged.pt"]


# --------------------------------------------------------------------------- weights_only
class Payload:  # a pickled object: torch.load(weights_only=False) would run its class's code
    pass


def test_a_pickled_pretrained_file_is_refused_without_torch_s_advice(shapes, tmp_path, capsys):
    evil = tmp_path / "evil.pt"
    torch.save({"weight": Payload()}, evil)
    raw = tiny_config(shapes["folder"], tmp_path / "run", epochs=1)
    raw["model"]["options"]["pretrained"] = str(evil)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    capsys.readouterr()
    assert cli.main(["train", str(cfg)]) == 2
    captured = capsys.readouterr()
    err = captured.err
    assert str(evil) in err and "Python objects other than tensors" in err and "Traceback" not in err
    assert "weights_only=False" not in err and "set to `False" not in err and "trusted source" not in err
    assert err.rstrip().endswith("or use .safetensors.")


# --------------------------------------------------------------------------- report / embed
@pytest.mark.parametrize("flag, value", [("--queries", "-5"), ("--queries", "0"), ("--top-k", "0")])
def test_report_refuses_bad_counts_before_drawing(shapes, tmp_path, capsys, flag, value):
    out = tmp_path / "report"
    capsys.readouterr()
    assert cli.main(["report", str(Path(shapes["base"]) / "run"), "--out", str(out), flag, value]) == 2
    _one_clear_line(capsys, f"{flag} must be a whole number >= 1, got {value}")
    assert not out.exists()


def test_embed_out_an_existing_folder_is_refused(shapes, tmp_path, capsys):
    logs = tmp_path / "logs"
    logs.mkdir()
    assert cli.main(["embed", str(shapes["checkpoint"]), "--split", "all", "--out", str(logs)]) == 2
    _one_clear_line(capsys, f"--out {logs} is a folder", str(logs / "embeddings.npz"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logs"] and list(logs.iterdir()) == []
    # a name without .npz gets it, and the message names the file written
    assert cli.main(["embed", str(shapes["checkpoint"]), "--split", "all", "--out", str(tmp_path / "e")]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {tmp_path / 'e.npz'}"
    assert len(np.load(tmp_path / "e.npz")["labels"]) == 32
    assert not [p for p in tmp_path.iterdir() if ".tmp" in p.name]


# --------------------------------------------------------------------------- evaluate
def test_evaluate_shows_progress_on_large_files(tmp_path, capsys, monkeypatch):
    rng = np.random.default_rng(0)
    f = tmp_path / "e.npz"
    np.savez(f, embeddings=rng.normal(size=(60, 8)).astype(np.float32), labels=np.repeat(np.arange(6), 10))
    assert cli.main(["evaluate", str(f), "--metrics", "recall"]) == 0
    assert capsys.readouterr().err == ""  # small: quiet
    monkeypatch.setattr(evaluate_io, "PROGRESS_ROWS", 50)
    assert cli.main(["evaluate", str(f), "--metrics", "recall", "--out", str(tmp_path / "m.json")]) == 0
    err = capsys.readouterr().err
    assert "evaluating 60 embeddings" in err and "k-NN" in err
    from deepmetric.evaluate import evaluate

    with np.load(f) as z:  # the progress lines change nothing in the result
        want = evaluate(z["embeddings"], z["labels"], metrics=["recall"])["recall@1"]
    assert json.loads((tmp_path / "m.json").read_text())["recall@1"] == pytest.approx(want)


def _tree(folder):
    return {p: p.read_bytes() for p in Path(folder).rglob("*") if p.is_file()}


def test_an_output_over_an_input_is_refused_before_any_work(shapes, tmp_path, capsys):
    """The hostile trial's data-loss cases: an output path equal to an input, or inside the index
    a command reads, is one line (exit 2) and every input stays as it was."""
    import shutil

    index = tmp_path / "index"
    shutil.copytree(shapes["index_dir"], index)
    query = tmp_path / "q.png"
    shutil.copy(sorted(Path(shapes["queries"]).rglob("*.png"))[0], query)
    ckpt = tmp_path / "last.pt"
    shutil.copy(shapes["checkpoint"], ckpt)
    npz = tmp_path / "e.npz"
    np.savez(npz, embeddings=np.random.default_rng(0).normal(size=(20, 4)).astype(np.float32),
             labels=np.repeat(np.arange(4), 5))
    before = {**_tree(index), **_tree(tmp_path)}
    cases = [
        (["search", str(index), str(query), "--html", str(query)], "--html", "that is the input"),
        (["search", str(index), str(query), "--html", str(index / "manifest.json")], "--html", "inside"),
        (["index", "export", str(index), "--to", f"parquet:{index / 'manifest.json'}"], "--to", "inside"),
        (["index", "export", str(index), "--to", f"qdrant:{index}"], "--to", "inside"),
        (["export", str(ckpt), "--out", str(ckpt)], "--out", "that is the input"),
        (["evaluate", str(npz), "--out", str(npz)], "--out", "that is the input"),
        # an output whose folder cannot be made (below a file) or that is a folder: refused before
        # the work (evaluate printed its whole table, then failed naming only the folder)
        (["evaluate", str(npz), "--out", str(npz / "m.json")], "--out", "cannot be created"),
        (["evaluate", str(npz), "--out", str(tmp_path)], "--out", f"is a folder; give a file name inside it, such as "
                                                                   f"{tmp_path / 'metrics.json'}"),
        (["export", str(ckpt), "--out", str(tmp_path)], "--out", f"such as {tmp_path / 'model.onnx'}"),
        (["search", str(index), str(query), "--html", str(tmp_path)], "--html", f"such as {tmp_path / 'results.html'}"),
        (["search", str(index), str(query), "--html", str(query / "r.html")], "--html", "cannot be created"),
        (["export", str(ckpt), "--out", str(npz / "m.onnx")], "--out", "cannot be created"),
        (["index", "export", str(index), "--to", f"parquet:{npz / 'a.parquet'}"], "--to", "cannot be created"),
    ]
    for argv, flag, needle in cases:
        capsys.readouterr()
        assert cli.main(argv) == 2, argv
        out = capsys.readouterr()
        assert "Traceback" not in out.err and out.err.count("\n") == 1 and flag in out.err and needle in out.err, out.err
        assert out.out == "", (argv, out.out)  # nothing done first
        assert {**_tree(index), **_tree(tmp_path)} == before, argv
    # a fine path still works, and evaluate writes its metrics atomically there
    assert cli.main(["evaluate", str(npz), "--out", str(tmp_path / "m.json")]) == 0
    assert "recall@1" in json.loads((tmp_path / "m.json").read_text())


def test_broken_files_and_bad_devices_are_one_line_not_a_traceback(shapes, tmp_path, capsys):
    """The hostile trial's tracebacks: an empty or truncated .npz for index / report, a device that
    is not one (or absent) for search, an infinite --memory-mb."""
    good = tmp_path / "good.npz"
    np.savez(good, embeddings=np.ones((8, 4), np.float32), labels=np.arange(8) % 2)
    empty, truncated = tmp_path / "empty.npz", tmp_path / "trunc.npz"
    empty.write_bytes(b"")
    truncated.write_bytes(good.read_bytes()[: len(good.read_bytes()) // 2])
    query = sorted(Path(shapes["queries"]).rglob("*.png"))[0]
    text = tmp_path / "notes.npz"
    text.write_text("hello world\n")  # numpy's reason for text was "pickled (object) data"
    cases = [(["index", "--embeddings", str(bad), "--out", str(tmp_path / "idx")], str(bad))
             for bad in (empty, truncated)]
    cases += [(["index", "--embeddings", str(text), "--out", str(tmp_path / "idx")],
               f"--embeddings {text}: this is a text file (it starts with 'hello world')"),
              (["report", str(Path(shapes["checkpoint"]).parent), "--embeddings", str(text)],
               f"{text}: this is a text file (it starts with 'hello world'); expected an .npz")]
    cases += [(["search", str(shapes["index_dir"]), str(query), "--device", "bogus"], "--device 'bogus'"),
              (["serve", str(shapes["index_dir"]), "--device", "bogus", "--port", "0"], "--device 'bogus'")]
    if not torch.cuda.is_available():
        cases += [(["search", str(shapes["index_dir"]), str(query), "--device", "cuda"], "CUDA is not available")]
    for argv, needle in cases:
        capsys.readouterr()
        assert cli.main(argv) == 2, argv
        _one_clear_line(capsys, needle)
    with pytest.raises(SystemExit) as exc:
        cli.main(["evaluate", str(good), "--memory-mb", "inf"])
    assert exc.value.code == 2 and "expected a finite number > 0, got 'inf'" in capsys.readouterr().err


def test_export_to_a_qdrant_server_that_is_not_there_is_one_line(shapes, capsys):
    import socket

    pytest.importorskip("qdrant_client")
    with socket.socket() as s:  # a loopback port nothing listens on (bound, never listening)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        assert cli.main(["index", "export", str(shapes["index_dir"]), "--to", f"qdrant:http://127.0.0.1:{port}"]) == 2
    _one_clear_line(capsys, f"--to qdrant:http://127.0.0.1:{port}: cannot reach a Qdrant server there")


def test_a_qdrant_url_of_another_scheme_is_refused_not_made_a_folder(shapes, tmp_path, capsys, monkeypatch):
    """The CLI took any 'x://' for a server while the client took all but http(s) for a local
    folder: qdrant:grpc://host made a folder named 'grpc:'. Both read one rule now."""
    from deepmetric.search.interchange import is_server_url, parse_target

    monkeypatch.chdir(tmp_path)
    for target in ("qdrant:grpc://127.0.0.1:6334", "qdrant:ftp://host/x"):
        assert cli.main(["index", "export", str(shapes["index_dir"]), "--to", target]) == 2
        _one_clear_line(capsys, f"--to '{target}': a Qdrant server is reached at http://HOST:PORT")
    assert list(tmp_path.iterdir()) == []
    assert parse_target("qdrant:https://db.example:6333") == ("qdrant", "https://db.example:6333")
    assert is_server_url("http://127.0.0.1:6333") and not is_server_url("exports/qdrant")
    assert parse_target("qdrant:exports/qdrant") == ("qdrant", "exports/qdrant")


def test_the_wrong_dataset_for_a_root_is_advised_in_command_line_terms(shapes, tmp_path, capsys):
    """'index --data csv --root FOLDER' advised name='folder' (Python; new-user trial): the
    advice names the option the command line takes, and the config's and Python's words."""
    out = tmp_path / "index"
    assert cli.main(["index", str(shapes["checkpoint"]), "--data", "csv", "--root", str(shapes["folder"]),
                     "--out", str(out), "--no-progress"]) == 2
    _one_clear_line(capsys, f"csv: '{shapes['folder']}' is a folder, not a CSV file. For a folder with one "
                            "sub-folder per class use the folder dataset: --data folder on the command line")
    listing = tmp_path / "list.csv"
    listing.write_text("path,label\n")
    assert cli.main(["index", str(shapes["checkpoint"]), "--data", "folder", "--root", str(listing),
                     "--out", str(out), "--no-progress"]) == 2
    _one_clear_line(capsys, "is a file list; read it with the csv dataset: --data csv on the command line")
    assert not out.exists()
