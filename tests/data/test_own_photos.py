"""A new user's own colour photos (issue 32, items 13-14): recipes/own_folder.yaml trains the
ImageNet EfficientNet-Lite0 on colour input; the run's verdict against its baselines is kept in
metrics.json and shown by the report; the report's Recall@K table lists each baseline once."""
import json
import re
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from conftest import synthetic_config

from deepmetric.cli import main
from deepmetric.run.config_io import load_config
from deepmetric.train.summary import baseline_verdict

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "own_folder.yaml"
COLOURS = [(220, 30, 30), (30, 160, 30), (30, 30, 220), (230, 200, 20), (200, 30, 200), (20, 200, 200)]


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    """6 classes x 4 colour JPEGs of 48 x 48: a square of the class's colour on white."""
    root = tmp_path_factory.mktemp("own") / "my_photos"
    rng = np.random.default_rng(0)
    for c, colour in enumerate(COLOURS):
        d = root / f"class{c}"
        d.mkdir(parents=True)
        for i in range(4):
            a = np.full((48, 48, 3), 255.0)
            x, y = rng.integers(4, 20, 2)
            a[y:y + 24, x:x + 24] = np.array(colour) * rng.uniform(0.7, 1.0)
            Image.fromarray(np.clip(a + rng.normal(0, 6, a.shape), 0, 255).astype(np.uint8), "RGB").save(
                d / f"{i:03d}.jpg", quality=90)
    return root


def _tiny(root, out, *extra):
    """recipes/own_folder.yaml shrunk to seconds: 64 px crops, one step, no loader workers."""
    return ["train", str(RECIPE), f"data.root={root}", f"train.out_dir={out}", "train.epochs=1",
            "train.batch_size=12", "data.num_workers=0", "train.num_threads=1", "train.progress=false",
            "data.transform_options={resize: 72, crop: 64, normalize: minus_one_one}", *extra]


def test_the_own_folder_recipe_is_an_imagenet_network_on_colour_input():
    cfg = load_config(RECIPE)
    assert cfg.data.name == "folder" and cfg.data.options["mode"] == "RGB"
    assert cfg.model.name == "efficientnet_lite0" and cfg.model.options["pretrained"] == "imagenet"
    assert cfg.data.transform == "resize_crop" and cfg.data.transform_options["normalize"] == "minus_one_one"
    # the small grayscale template keeps its own name
    small = load_config(ROOT / "recipes" / "own_folder_small_grey.yaml")
    assert small.name == "own_folder_small_grey" and small.data.options["mode"] == "L"
    assert small.model.name == "glyph_resnet"


def test_colour_photos_train_the_imagenet_backbone_in_colour(photos, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(_tiny(photos, out)) == 0
    printed = capsys.readouterr().out
    assert "model    efficientnet_lite0:" in printed and "input [3, 64, 64], pretrained 'imagenet'" in printed
    assert "[deepmetric] baseline epoch 0 (pretrained network): recall@1 " in printed
    assert "read as grayscale" not in printed
    saved = json.loads((out / "metrics.json").read_text())
    assert "recall@1" in saved["metrics"] and saved["epochs"] == 1
    cfg = yaml.safe_load((out / "config.yaml").read_text())
    assert cfg["data"]["options"]["mode"] == "RGB" and cfg["model"]["options"]["pretrained"] == "imagenet"


def test_colour_photos_read_as_grey_warn(photos, tmp_path, capsys):
    """The issue's case: the digit template on colour photos dropped the colour without a word."""
    out = tmp_path / "run"
    small = ROOT / "recipes" / "own_folder_small_grey.yaml"
    args = ["train", str(small), f"data.root={photos}", f"train.out_dir={out}", "train.epochs=1",
            "train.batch_size=12", "eval.every=0", "eval.baselines=false", "train.num_threads=1",
            "model.options={embedding_dim: 8, norm: bn, in_chans: 1, widths: [8], depths: [1]}",
            "schedule.temperature.name=none", "train.progress=false"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert ("[deepmetric] warning: data.options.mode is 'L': images are read as grayscale, but 8 of 8 sampled "
            "images are colour") in printed  # 8 of the 12 training images, evenly spread
    saved = json.loads((out / "metrics.json").read_text())
    assert any("read as grayscale" in w and "recipes/own_folder.yaml" in w for w in saved["warnings"])


# --------------------------------------------------------------------------- the verdict
def test_baseline_verdict_names_every_baseline_above_the_trained_embedding():
    base = {"epoch0": {"label": "epoch 0 (pretrained network)", "metrics": {"recall@1": 0.60}},
            "raw_pixels": {"label": "raw pixels (8x8x3 = 192-d)", "metrics": {"recall@1": 0.40}},
            "skipped": {"label": "raw pixels", "skipped": "too large"}}
    v = baseline_verdict({"recall@1": 0.50}, base, "recall@1")
    assert v.startswith("the trained embedding (recall@1 50.0%) is below the baseline of epoch 0 (pretrained network):")
    assert "raw pixels" not in v
    assert baseline_verdict({"recall@1": 0.61}, base, "recall@1") is None
    assert baseline_verdict({"recall@1": 0.1}, base, "map@r") is None  # no baseline computed it


def _run_below_its_baseline(tmp_path, monkeypatch):
    """A synthetic run whose epoch-0 baseline is made to score above anything training reaches
    (recall@1 of 1.5): the verdict must land in metrics.json, not only on the console."""
    from deepmetric.run import baselines as preflight

    real = preflight.compute_baselines

    def inflated(*a, **kw):
        out = real(*a, **kw)
        out["epoch0"]["metrics"] = {k: 1.5 for k in out["epoch0"]["metrics"]}
        return out

    monkeypatch.setattr(preflight, "compute_baselines", inflated)
    raw = synthetic_config(tmp_path / "run", eval={"baselines": True}, train={"epochs": 2})
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump(raw))
    return cfg_path


def test_the_verdict_is_kept_in_metrics_json_and_shown_in_the_report(tmp_path, monkeypatch, capsys):
    cfg_path = _run_below_its_baseline(tmp_path, monkeypatch)
    run = tmp_path / "run"
    assert main(["train", str(cfg_path)]) == 0
    printed = capsys.readouterr().out
    line = next(ln for ln in printed.splitlines() if "is below the baseline" in ln)
    verdict = line.split("warning: ", 1)[1]
    saved = json.loads((run / "metrics.json").read_text())
    assert verdict in saved["warnings"]
    assert verdict.startswith("the trained embedding (recall@1 ") and "epoch 0 (untrained network)" in verdict
    assert main(["report", str(run), "--device", "cpu", "--queries", "2", "--top-k", "3"]) == 0
    html = (run / "report" / "report.html").read_text()
    md = (run / "report" / "report.md").read_text()
    assert f"- {verdict}" in md
    assert "is below the baseline of epoch 0 (untrained network)" in html
    # the Recall@K table: this run and each baseline once, labelled as the run printed them
    table = re.search(r'<table class="metrics" id="recall-table">.*?</table>', html, re.S).group(0)
    labels = re.findall(r"<th>([^<]*)</th><td>", table)
    assert labels[0] == "this run" and len(labels) == len(set(labels)), labels
    baselines = [x for x in labels if x.startswith("baseline")]
    assert baselines == ["baseline: epoch 0 (untrained network)"], labels  # raw pixels: synthetic, not images
    assert not any("label" in x or ": metrics" in x for x in labels)


# --------------------------------------------------------------------------- item 17
def test_a_validation_split_at_100_percent_from_the_first_evaluation_warns(tmp_path, capsys):
    """2 well-separated validation classes: recall@1 is 1.0 at epoch 1 and cannot choose best.pt."""
    from deepmetric.train import train
    from deepmetric.run.config_io import config_from_dict

    raw = synthetic_config(tmp_path / "run", classes=8, data={"val_classes": 2, "options": {"noise": 0.02}},
                           eval={"baselines": False}, train={"epochs": 2})
    train(config_from_dict(raw))
    printed = capsys.readouterr().out
    log = [json.loads(ln) for ln in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    first_val = next(r for r in log if r["type"] == "eval" and r["split"] == "val")
    assert first_val["recall@1"] == 1.0  # the case itself, measured by the run
    want = ("validation recall@1 is already 100% at the first evaluation (epoch 1, 2 validation classes): it "
            "cannot improve, so it cannot choose best.pt")
    assert printed.count(want) == 1  # once, not at every evaluation
    saved = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert any(w.startswith(want) for w in saved["warnings"])
    # not saturated: no warning
    raw = synthetic_config(tmp_path / "run2", classes=8, data={"val_classes": 2}, eval={"baselines": False},
                           train={"epochs": 1})
    train(config_from_dict(raw))
    log = [json.loads(ln) for ln in (tmp_path / "run2" / "log.jsonl").read_text().splitlines()]
    assert next(r for r in log if r["type"] == "eval" and r["split"] == "val")["recall@1"] < 1.0
    assert "already 100%" not in capsys.readouterr().out
