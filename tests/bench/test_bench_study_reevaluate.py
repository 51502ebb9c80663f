"""bench/study_reevaluate.py: a finished study's final checkpoints evaluated again with other
eval settings; with none changed it reproduces the runs' own final metrics."""
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from conftest import synthetic_config

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("study_reevaluate", ROOT / "bench" / "study_reevaluate.py")
sr = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sr)

BASE = synthetic_config(train={"epochs": 1, "num_threads": 1},
                        eval={"every": 0, "metrics": ["recall", "nmi", "f1"], "ks": [1], "baselines": False})


def test_reevaluation_reproduces_then_changes_the_clustering(tmp_path, monkeypatch):
    from deepmetric.evaluate import kmeans
    from deepmetric.evaluate.clustering import nmi_from_clusters
    from deepmetric.run.builders import build_split
    from deepmetric.run.embed import compute_embeddings, load_model_from_checkpoint
    from deepmetric.workflows.study import run_study
    from deepmetric.workflows.study_file import load_study

    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump({"name": "tiny", "base": BASE, "seeds": [0, 1],
                                    "variants": {"a16": [], "a4": ["loss.0.options.alpha=4"]},
                                    "out_dir": str(tmp_path / "runs"), "compare": [["a16", "a4"]]}))
    study = load_study(path)
    run_study(study, workers=1)
    out = tmp_path / "bench"
    # nothing changed: the final metrics of every run, exactly
    monkeypatch.setattr(sys, "argv", ["x", str(path), "--metrics", "recall", "nmi", "f1", "--name", "same",
                                      "--out-dir", str(out)])
    sr.main()
    rec = json.loads((out / "reevaluated_same.json").read_text())
    assert len(rec["rows"]) == 4
    for row in rec["rows"]:
        final = json.loads((tmp_path / "runs" / row["variant"] / f"seed{row['seed']}" / "metrics.json").read_text())
        for m in ("recall@1", "nmi", "f1"):
            assert row[f"final/{m}"] == pytest.approx(final["final"]["test"][m], abs=1e-12)
    assert rec["paired"][0]["a"] == "a16" and rec["paired"][0]["stats"]["final/nmi"]["n"] == 2
    # 5 k-means restarts: the NMI of the lowest-inertia of 5 initialisations of the same embedding
    monkeypatch.setattr(sys, "argv", ["x", str(path), "--set", "eval.kmeans_restarts=5", "--metrics", "nmi",
                                      "--name", "k5", "--out-dir", str(out)])
    sr.main()
    rows = json.loads((out / "reevaluated_k5.json").read_text())["rows"]
    run = tmp_path / "runs" / "a4" / "seed1"
    model, *_ = load_model_from_checkpoint(run / "last.pt")
    from deepmetric.run.config_io import load_config

    cfg = load_config(run / "config.yaml")
    e = compute_embeddings(model, build_split(cfg, "test", train=False))
    x = e["embeddings"] / np.linalg.norm(e["embeddings"], axis=1, keepdims=True)
    want = nmi_from_clusters(e["labels"], kmeans(x, 6, seed=1, restarts=5))
    got = next(r for r in rows if r["variant"] == "a4" and r["seed"] == 1)
    assert set(got) == {"benchmark", "variant", "seed", "final/nmi"}
    assert got["final/nmi"] == pytest.approx(want, abs=1e-12)
    assert (out / "reevaluated_k5.md").read_text().count("| a16 |") == 1
    # only eval keys may change after training
    monkeypatch.setattr(sys, "argv", ["x", str(path), "--set", "train.seed=3", "--metrics", "nmi", "--name", "bad",
                                      "--out-dir", str(out)])
    with pytest.raises(SystemExit, match="only eval"):
        sr.main()
