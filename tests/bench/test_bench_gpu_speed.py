"""bench/gpu_speed.py: its training-step measurement runs the model the way deepmetric.train
does (checked on the CPU, where CI runs), and it refuses to run without CUDA."""
import importlib.util
import math
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("gpu_speed", ROOT / "bench" / "gpu_speed.py")
gs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gs)


def test_first_step_loss_is_the_models_cross_entropy_and_layouts_agree():
    cpu = torch.device("cpu")
    rows = [gs.train_speed("efficientnet_lite0", amp, cl, steps=1, warmup=1, device=cpu, batch=2)
            for amp, cl in (("none", False), ("none", True), ("bf16", True))]
    # Independent reference: the same seed-0 model and batch, one forward in fp32.
    options, size, _ = gs.MODELS["efficientnet_lite0"]
    torch.manual_seed(0)
    model = gs.create_model("efficientnet_lite0", num_classes=gs.NUM_CLASSES, **options).train()
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(2, 3, size, size, generator=g)
    y = torch.randint(0, gs.NUM_CLASSES, (2,), generator=g)
    with torch.no_grad():
        ref = torch.nn.functional.cross_entropy(model(x)["logits"], y).item()
    assert rows[0]["first_loss"] == pytest.approx(ref, rel=1e-5)
    assert rows[1]["first_loss"] == pytest.approx(ref, rel=1e-4)  # channels_last: same maths
    assert rows[2]["first_loss"] == pytest.approx(ref, abs=0.05)  # bf16 autocast: close, not equal
    for r in rows:
        assert r["batch"] == 2 and r["size"] == size and r["images_per_s"] > 0
        assert math.isnan(r["peak_mem_mib"])  # GPU memory is only read on CUDA
    table = gs._train_table(rows).splitlines()
    assert len(table) == 2 + len(rows)
    assert table[2].split("|")[8].strip() == "1.00"  # the fp32 row is its own reference


def test_main_without_cuda_says_so(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="no CUDA device"):
        gs.main(["--parts", "knn"])


def test_eval_part_trains_once_per_eval_device_and_compares_the_metrics(tmp_path):
    """``--parts eval`` on the CPU (where both runs search with faiss): one run per
    ``eval.device``, the same evaluations with the same metrics, and a table that says so."""
    import yaml

    from conftest import synthetic_config
    from deepmetric.run import rundir

    recipe = tmp_path / "run.yaml"
    recipe.write_text(yaml.safe_dump(synthetic_config(tmp_path / "unused")))
    rows = gs.eval_device_runs(str(recipe), ["eval.at_start=true", "train.epochs=2"], tmp_path / "out")
    assert [r["eval_device"] for r in rows] == ["auto", "cpu"]
    for r in rows:
        run = tmp_path / "out" / f"eval_{r['eval_device']}"
        assert rundir.read_metrics(run) is not None  # each a finished run of its own
        assert "device: " + r["eval_device"] in (run / "config.yaml").read_text()
        assert r["evaluations"] == 3 and set(r["evals"]) == {("test", 0), ("test", 1), ("test", 2)}
        assert r["eval_s"] == pytest.approx(sum(x["eval_seconds"] for x in rundir.read_log(run, type="eval")))
        assert r["eval_s_each"] == pytest.approx(r["eval_s"] / 3) and r["wall_s"] > r["eval_s"]
    assert rows[0]["evals"] == rows[1]["evals"] and "recall@1" in rows[0]["evals"][("test", 0)]
    assert gs.metric_differences(rows[0], rows[1]) == (0.0, 0.0)
    changed = {**rows[0], "evals": {k: {**v, "recall@1": v["recall@1"] + (0.25 if k[1] == 2 else 0.0)}
                                    for k, v in rows[0]["evals"].items()}}
    assert gs.metric_differences(changed, rows[1]) == (0.0, pytest.approx(0.25))
    table = gs._eval_table(rows).splitlines()
    assert len(table) == 4 and table[2].startswith("| auto | 3 |") and table[3].endswith("| 0.0e+00 | 0.0e+00 |")
    assert gs.EVAL_RECIPE == "recipes/demo_emoji.yaml" and "eval.at_start=true" in gs.EVAL_OVERRIDES


def test_eval_part_default_run_is_a_valid_config():
    from deepmetric.run.config_io import load_config
    from deepmetric.run.config_checks import check_config

    for device in ("auto", "cpu"):
        cfg = load_config(ROOT / gs.EVAL_RECIPE, gs.EVAL_OVERRIDES + [f"eval.device={device}"])
        check_config(cfg)
        assert cfg.eval.device == device and cfg.eval.cross_domain and cfg.data.options["size"] == 64
