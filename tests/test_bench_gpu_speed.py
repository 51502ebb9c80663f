"""bench/gpu_speed.py: its training-step measurement runs the model the way deepmetric.train
does (checked on the CPU, where CI runs), and it refuses to run without CUDA."""
import importlib.util
import math
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
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
