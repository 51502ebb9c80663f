"""bench/postprocess_seeds.py on two tiny seeds and bench/postprocess_speed.py's table."""
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from conftest import synthetic_config
from deepmetric.run.config_io import config_from_dict
from deepmetric.train.loop import train

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_postprocess_seeds_pairs_the_seeds(tmp_path):
    seeds = _load("postprocess_seeds")
    runs = []
    for s in (0, 1):
        out = tmp_path / f"s{s}"
        train(config_from_dict(synthetic_config(out, classes=10, per_class=12, data={"val_classes": 4},
                                                train={"epochs": 2, "seed": s})))
        runs.append(str(out))
    assert seeds.main([*runs, "--out", str(tmp_path / "r.md"), "--device", "cpu"]) == 0
    res = json.loads((tmp_path / "r.json").read_text())
    assert [r["checkpoint"] for r in res["runs"]] == ["best.pt", "best.pt"]
    for r in res["runs"]:
        assert r["val_with"] >= r["val_without"]  # chosen on validation: never below no post-processing there
    diffs = [r["test_with"]["map@r"] - r["test_without"]["map@r"] for r in res["runs"]]
    d = res["summary"]["map@r"]["paired_difference"]
    half = stats.t.ppf(0.975, 1) * np.std(diffs, ddof=1) / np.sqrt(2)
    assert d["mean"] == pytest.approx(np.mean(diffs)) and d["ci_low"] == pytest.approx(np.mean(diffs) - half)
    # the "with" numbers are the test metrics after the chosen steps, recomputed here
    from deepmetric.evaluate import evaluate
    from deepmetric.run.builders import build_split
    from deepmetric.run.embed import compute_embeddings, load_model_from_checkpoint

    model, _, cfg, _ = load_model_from_checkpoint(Path(runs[0]) / "best.pt", "cpu")
    t = compute_embeddings(model, build_split(cfg, "test", train=False))
    got = evaluate(t["embeddings"], t["labels"], ks=(1,), metrics=["recall", "map@r"], postprocess=res["runs"][0]["steps"])
    assert got["map@r"] == pytest.approx(res["runs"][0]["test_with"]["map@r"])
    assert "paired difference" in (tmp_path / "r.md").read_text()


def test_speed_table_has_every_step():
    speed = _load("postprocess_speed")
    row = {"n": 5000, "whiten_fit_s": 0.1, "whiten_apply_s": 0.01, "dba_s": 1, "aqe_s": 0.5, "kreciprocal_graph_s": 2,
           "kreciprocal_rerank_s": 1, "graph_mb": 3, "graph_nnz_vqe_per_row": 40, "rss_peak_mb": 900, "input_mb": 2}
    text = speed.table([row])
    assert "| 5,000 | 0.1 | 0.01 | 1 | 0.5 | 2 | 1 | 3 | 40 | 900 | 2 |" in text
