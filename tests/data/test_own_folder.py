"""A new user's own folder, end to end through the command line and recipes/own_folder_small_grey.yaml:
ten classes of small digit images, train on five, test zero-shot on the other five.  The run
must show the split, the baselines and the few-classes warning; mistakes must stop the run
before training, in the words of the YAML config; a failing evaluation must not lose training."""
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from deepmetric.cli import main
from deepmetric.data.synthetic import DIGIT_NAMES, write_digit_folder
from deepmetric.evaluate import evaluate
from deepmetric.run.rundir import read_log

RECIPE = str(Path(__file__).resolve().parents[2] / "recipes" / "own_folder_small_grey.yaml")
TRAIN = ["eight", "five", "four", "nine", "one"]   # first half of the sorted names
TEST = ["seven", "six", "three", "two", "zero"]
PER_CLASS = 12


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    return write_digit_folder(tmp_path_factory.mktemp("own") / "my_digits", per_class=PER_CLASS, seed=0)


def _fast(root, out, *extra):
    """The recipe, shrunk to seconds: a tiny network, two epochs."""
    return [RECIPE, f"data.root={root}", f"train.out_dir={out}", "train.epochs=2", "train.batch_size=20",
            "model.options={embedding_dim: 16, norm: bn, in_chans: 1, widths: [8, 16], depths: [1, 1]}",
            "schedule.temperature.name=none", "eval.every=0", "train.num_threads=1", "train.progress=false",
            *extra]


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_write_digit_folder_layout(digits):
    assert sorted(p.name for p in digits.iterdir()) == sorted(DIGIT_NAMES)
    files = sorted((digits / "seven").glob("*.png"))
    assert len(files) == PER_CLASS
    with Image.open(files[0]) as im:
        assert im.size == (28, 28) and im.mode == "L"


def test_digit_folder_run_shows_split_baselines_and_warning(digits, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", *_fast(digits, out)]) == 0
    printed = capsys.readouterr().out
    n = 5 * PER_CLASS
    # the split, in the summary
    assert "class_split 'half' (first half of the sorted class names = train)" in printed
    assert f"train  5 classes, {n} images: {', '.join(TRAIN)}" in printed
    assert f"test   5 classes, {n} images: {', '.join(TEST)}" in printed
    assert "model    glyph_resnet:" in printed and "input [1, 28, 28]" in printed
    assert "loss     1 x heated_softmax(alpha=16.0)" in printed
    # the warning and the baselines, before training
    assert "[deepmetric] warning: only 5 training classes" in printed
    assert "[deepmetric] baseline epoch 0 (untrained network): recall@1 " in printed
    assert "[deepmetric] baseline raw pixels (28x28x1 = 784-d): recall@1 " in printed
    assert printed.index("baseline raw pixels") < printed.index("[deepmetric] epoch 2 step")
    # the end: metrics, time, paths
    end = printed[printed.index("[deepmetric] done: 2 epochs"):]
    assert "final    recall@1" in end and f"checkpoint {out / 'last.pt'}" in end
    assert f"log       {out / 'log.jsonl'}" in end and f"metrics   {out / 'metrics.json'}" in end

    # metrics.json and log.jsonl hold the baselines; raw pixels equal an independent computation
    saved = json.loads((out / "metrics.json").read_text())
    raw = saved["baselines"]["raw_pixels"]
    paths = [p for c in TEST for p in sorted((digits / c).glob("*.png"))]
    x = np.stack([np.asarray(Image.open(p), dtype=np.float32).reshape(-1) / 255 for p in paths])
    y = np.repeat(np.arange(5), PER_CLASS)
    assert raw["label"] == "raw pixels (28x28x1 = 784-d)"
    assert raw["metrics"] == pytest.approx(evaluate(x, y, ks=(1, 2, 4, 8)))
    assert set(saved["baselines"]["epoch0"]["metrics"]) == set(saved["metrics"])
    assert any("only 5 training classes" in w for w in saved["warnings"])
    records = read_log(out)
    base = {r["name"]: r for r in records if r["type"] == "baseline"}
    assert set(base) == {"epoch0", "raw_pixels"}
    assert base["raw_pixels"]["recall@1"] == pytest.approx(raw["metrics"]["recall@1"])
    assert base["epoch0"]["label"] == "epoch 0 (untrained network)"


def test_explicit_class_lists_from_yaml(digits, tmp_path, capsys):
    split = "{class_split: {train: [zero, one, two, three, four, five], test: [six, seven, eight, nine]}, mode: L}"
    assert main(["train", *_fast(digits, tmp_path / "r", f"data.options={split}", "eval.baselines=false")]) == 0
    printed = capsys.readouterr().out
    assert "class_split with explicit class lists" in printed
    assert f"train  6 classes, {6 * PER_CLASS} images: five, four, one, three, two, zero" in printed
    assert f"test   4 classes, {4 * PER_CLASS} images: eight, nine, seven, six" in printed
    assert "[deepmetric] baseline" not in printed


# ----------------------------------------------------------------------------- fail before training
@pytest.mark.parametrize("override,message", [
    ("eval.best_metric=recal@1 data.val_classes=1",
     "config key 'eval.best_metric': 'recal@1' is not a metric this run computes (did you mean 'recall@1'?)"),
    ("loss.0.options.alpah=4",
     "config key 'loss.0.options.alpah': unknown option 'alpah' for loss 'heated_softmax' (did you mean 'alpha'?)"),
    ("data.val_classes=1",
     "data split 'val' has 1 class(es): retrieval and clustering metrics need at least 2 classes; "
     "give data.val_classes at least 2 classes (training has not started)"),
    ("data.transform_options.channels=3",
     "model 'glyph_resnet' takes 1-channel images (its first convolution 'backbone.stem.0' has in_channels=1) "
     "but data.transform 'mnist' gives 3-channel images of shape [3, 28, 28]. Set model.options.in_chans: 3, "
     "or use data.transform_options.channels: 1."),
])
def test_mistakes_stop_the_run_before_training(digits, tmp_path, capsys, override, message):
    out = tmp_path / "run"
    assert main(["train", *_fast(digits, out, *override.split(" "))]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"deepmetric train: error: {message}") and len(err.splitlines()) == 1
    assert not (out / "last.pt").exists() and not (out / "log.jsonl").exists()


def test_unreadable_test_image_stops_the_run_before_training(digits, tmp_path, capsys):
    root = _copy(digits, tmp_path / "d")
    bad = root / "six" / "0003.png"
    bad.write_bytes(b"GIF89a but not really")
    out = tmp_path / "run"
    assert main(["train", *_fast(root, out)]) == 2
    err = capsys.readouterr().err
    assert "data split 'test': 1 of 60 images cannot be read" in err and str(bad) in err
    assert "data.options.skip_missing: true" in err
    assert not (out / "last.pt").exists()


def test_root_that_is_the_parent_folder(digits, tmp_path, capsys):
    parent = tmp_path / "downloads"
    _copy(digits, parent / "my_digits")
    assert main(["train", *_fast(parent, tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert f"root '{parent}' looks like the parent of the dataset folder" in err
    assert f"data.root: {parent / 'my_digits'}" in err


def _truncate(path):
    rng = np.random.default_rng(1)
    Image.fromarray(rng.integers(0, 255, (28, 28), dtype=np.uint8), mode="L").save(path.with_suffix(".jpg"), quality=95)
    data = path.with_suffix(".jpg").read_bytes()
    path.with_suffix(".jpg").write_bytes(data[: len(data) // 2])  # header intact, pixels cut off
    return path.with_suffix(".jpg")


def test_failing_evaluation_keeps_the_training_and_resume_evaluates(digits, tmp_path, capsys):
    root = _copy(digits, tmp_path / "d")
    bad = _truncate(root / "two" / "extra")  # passes the header check, fails when decoded
    out = tmp_path / "run"
    args = _fast(root, out, "eval.baselines=false")
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err
    assert f"cannot read image {bad}" in err
    import torch

    state = torch.load(out / "last.pt", weights_only=True)
    assert state["epoch"] == 2 and state["iteration"] == 2 * 3  # the whole training was kept
    assert not (out / "metrics.json").exists()
    bad.unlink()  # the user fixes the data and resumes: only the evaluation runs
    assert main(["train", *args, "--resume", str(out / "last.pt")]) == 0
    records = read_log(out)
    assert sum(r["type"] == "step" for r in records) == 6
    assert [r["epoch"] for r in records if r["type"] == "eval"] == [2]
    saved = json.loads((out / "metrics.json").read_text())
    assert saved["epochs"] == 2 and "recall@1" in saved["final"]["test"]
    assert saved["metrics"] == saved["final"]["test"]


def test_error_in_a_loader_worker_is_one_line(digits, tmp_path, capsys):
    root = _copy(digits, tmp_path / "d")
    bad = _truncate(root / "one" / "extra")  # a training image; not among the first two
    out = tmp_path / "run"
    assert main(["train", *_fast(root, out, "data.num_workers=1", "eval.baselines=false")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"deepmetric train: error: folder: cannot read image {bad}: not an image that can be "
                          "decoded (image file is truncated")
    assert len(err.splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize("inside", ["runs/first", ".", "zero/run"])
def test_a_run_directory_inside_the_data_folder_is_refused_before_anything_is_made(digits, tmp_path, capsys, inside):
    """train.out_dir=ROOT/runs made the folder, then refused it as an empty class; with
    allow_empty_classes, the report's figures in it became a class 'runs' of the test split
    and of an index of the folder.  Now refused first, naming both keys; nothing is written."""
    root = _copy(digits, tmp_path / "data")
    before = sorted(p.relative_to(root) for p in root.rglob("*"))
    assert main(["train", *_fast(root, root / inside)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    what = "the data folder itself" if inside == "." else f"a class folder '{inside.split('/')[0]}'"
    assert f"config key 'train.out_dir' ({root / inside}) is inside data.root ({root})" in err, err
    assert what in err and "put the run outside the data folder" in err, err
    assert sorted(p.relative_to(root) for p in root.rglob("*")) == before
    # beside the data folder (a name that only starts like it) is fine
    assert main(["train", *_fast(root, tmp_path / "data_runs")]) == 0
