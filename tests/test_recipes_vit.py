"""recipes/vit/: the Hyp-ViT-protocol recipes (ViT-S/16 DINO, DINOv2 ViT-S/14 on CUB-200-2011,
Cars196, SOP) parse, resolve their preprocessing from the model's pretrained_cfg, and build
with random weights on miniature dataset trees (no network: ``pretrained: hub`` is replaced by
random weights); one of them trains a step end to end."""
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("timm")
from deepmetric.run.config_io import load_config  # noqa: E402
from deepmetric.run.builders import build_split, build_model, resolve_model_preprocessing  # noqa: E402
from test_data_benchmarks import make_cars, make_cub, make_sop  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "recipes" / "vit").glob("*.yaml"))
TREES = {"cub": make_cub, "cars196": make_cars, "sop": make_sop}


@pytest.fixture(scope="module")
def trees(tmp_path_factory):
    base = tmp_path_factory.mktemp("mini")
    return {name: (base / name, make(base / name)) for name, make in TREES.items()}


def test_the_six_recipes_exist():
    assert [p.stem for p in RECIPES] == [f"vit_{m}_{d}" for m in ("dino_vits16", "dinov2_vits14")
                                         for d in ("cars196", "cub", "sop")]


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_recipe_builds_with_random_weights_on_a_miniature_tree(path, trees):
    cfg = load_config(path, [f"data.root={trees[load_config(path).data.name][0]}"])
    m = cfg.model.options
    # the official code's values (github.com/htdt/hyp_metric, README "Configs" and train.py, the
    # sphere variant: --hyp_c 0 --t 0.1, emb 128, dino_vits16 lr 1e-5; epochs x batches per epoch)
    assert (m["pretrained"], m["embedding_dim"], m["img_size"], m["pool"]) == ("hub", 128, 224, "cls")
    assert (cfg.optim.name, cfg.optim.lr, cfg.train.batch_size) == ("adamw", 1e-5, cfg.train.m * cfg.train.n)
    assert cfg.loss[0].options["temperature"] == 0.1 and cfg.train.grad_clip == 3.0
    dataset = cfg.data.name
    assert (cfg.train.batch_size, cfg.train.n, cfg.train.iterations) == {
        "cub": (900, 9, 50), "cars196": (882, 9, 300), "sop": (900, 2, 5000)}[dataset]
    assert cfg.data.transform_options["crop_pct"] == (0.875 if dataset == "cub" else 1.0)  # --resize 256 on CUB
    resolve_model_preprocessing(cfg)
    opts = cfg.data.transform_options
    assert opts["input_size"] == [224, 224] and opts["interpolation"] == "bicubic"
    assert opts["mean"] == pytest.approx([0.485, 0.456, 0.406]) and opts["std"] == pytest.approx([0.229, 0.224, 0.225])
    ds = build_split(cfg, "test", train=False)
    x = torch.stack([ds[i][0] for i in range(2)])
    assert x.shape == (2, 3, 224, 224)
    cfg.model.options = {k: v for k, v in m.items() if k != "pretrained"}  # random weights: no hub here
    with torch.device("meta"):
        model = build_model(cfg)
    model = model.to_empty(device="cpu")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        out = model.eval()(x)["embedding"]
    assert out.shape == (2, 128) and torch.allclose(out.norm(dim=1), torch.ones(2), atol=1e-5)
    assert model.backbone.pretrained_cfg["input_size"] == (3, 224, 224)


def test_dino_cub_recipe_trains_a_step(trees, tmp_path):
    pytest.importorskip("pytorch_metric_learning")
    from deepmetric.train import train
    from deepmetric.run.checkpoint import load_checkpoint

    cfg = load_config(ROOT / "recipes" / "vit" / "vit_dino_vits16_cub.yaml", [
        f"data.root={trees['cub'][0]}", "data.num_workers=0", "data.transform_options.input_size=[32, 32]",
        "model.options.pretrained=null", "model.options.img_size=32", "train.iterations=1", "train.m=2",
        "train.n=2", "train.batch_size=4", "train.amp=none", "train.progress=false", "train.device=cpu",
        f"train.out_dir={tmp_path}", "eval.ks=[1]"])
    res = train(cfg)
    assert "recall@1" in res.metrics and np.isfinite(res.metrics["recall@1"])
    saved = load_checkpoint(tmp_path / "last.pt")["config"]
    assert saved["data"]["transform_options"]["scale"] == [0.2, 1.0]
    assert saved["data"]["transform_options"]["mean"] == pytest.approx([0.485, 0.456, 0.406])
