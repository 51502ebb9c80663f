"""bench/study_baselines.py: the raw-pixel and pretrained-feature baselines of a study's test
split, checked against brute-force searches."""
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("study_baselines", ROOT / "bench" / "study_baselines.py")
sb = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sb)


def _recall_at_1(x, labels):
    x = x / np.linalg.norm(x, axis=1, keepdims=True)
    s = x @ x.T
    np.fill_diagonal(s, -np.inf)
    return float(np.mean(labels[np.argmax(s, axis=1)] == labels))


def test_raw_pixels_and_features_of_a_study(tmp_path, monkeypatch):
    """A folder of digit images (zero-shot on half the classes): raw pixels read by hand from
    the PNG files and the untrained network's features, each against a brute-force Recall@1."""
    import torch
    from PIL import Image

    from deepmetric.data.synthetic import write_digit_folder
    from deepmetric.run.builders import build_split, build_model, seed_everything
    from deepmetric.run.config_io import config_from_dict

    root = write_digit_folder(tmp_path / "digits", per_class=6, seed=0)
    base = yaml.safe_load((ROOT / "recipes" / "own_folder_small_grey.yaml").read_text())
    base["data"]["root"] = str(root)
    base["model"]["options"] = {"embedding_dim": 8, "norm": "bn", "in_chans": 1, "widths": [4, 8], "depths": [1, 1]}
    base["eval"].update(ks=[1], metrics=["recall"])
    study = tmp_path / "s.yaml"
    study.write_text(yaml.safe_dump({"name": "tiny", "base": base, "variants": {"a": []}, "seeds": [0]}))
    out = tmp_path / "baselines.json"
    # not pretrained: --features asks for the untrained network's features
    monkeypatch.setattr(sys, "argv", ["study_baselines.py", str(study), "--out", str(out), "--features"])
    sb.main()
    rec = json.loads(out.read_text())
    cfg = config_from_dict(base)
    test = build_split(cfg, "test", train=False)
    labels = np.asarray(test.labels)
    assert rec["study"] == "tiny" and rec["images"] == len(test) == 30
    pixels = np.stack([np.asarray(Image.open(p), dtype=np.float64).ravel() / 255 for p in test.paths])
    assert rec["raw_pixels"]["metrics"]["recall@1"] == pytest.approx(_recall_at_1(pixels, labels))
    seed_everything(cfg.train.seed)
    model = build_model(cfg, num_classes=2).eval()
    with torch.no_grad():
        f = torch.cat([model(test[i][0][None])["features"] for i in range(len(test))]).numpy()
    assert rec["pretrained_features"]["label"].startswith("glyph_resnet untrained features")
    assert rec["pretrained_features"]["metrics"]["recall@1"] == pytest.approx(_recall_at_1(f, labels))
