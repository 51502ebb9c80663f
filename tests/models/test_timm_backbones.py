"""timm backbones (``model.name: timm/<name>``): a small ViT and a ConvNeXt with random weights
saved to a temporary safetensors file, trained for a step on a miniature image folder, then
embedded, exported (ONNX and TorchScript equal to torch within 1e-4), indexed and served
through the code paths EfficientNet-Lite uses -- after the weights file is deleted (the
checkpoint stands alone).  Preprocessing against timm's ``resolve_data_config`` and its own eval
transform; token pooling against hand-written numpy; hub loading mocked at the network boundary
(``huggingface_hub``'s download), never the network itself."""
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

timm = pytest.importorskip("timm")
from safetensors.torch import save_file  # noqa: E402

from deepmetric.models import create_model, takes_img_size  # noqa: E402
from deepmetric.run.builders import resolve_model_preprocessing  # noqa: E402
from deepmetric.run.config_io import config_from_dict  # noqa: E402
from search_data import make_shapes_folder  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
ARCHS = {"vit": ("vit_tiny_patch16_224", "cls"), "convnext": ("convnext_atto", "gem")}


def _weights_file(path: Path, arch: str, seed: int = 0) -> Path:
    """timm's model with its 1000-class head (as the hub's files hold it), random weights."""
    torch.manual_seed(seed)
    save_file(timm.create_model(arch, pretrained=False).state_dict(), str(path))
    return path


def _config(folder: Path, out: Path, arch: str, pool: str, weights: Path) -> dict:
    return {
        "data": {"name": "folder", "root": str(folder), "transform": "timm",
                 "transform_options": {"input_size": [32, 32]}, "num_workers": 0},
        "model": {"name": f"timm/{arch}", "options": {"pretrained": str(weights), "embedding_dim": 16,
                                                       "pool": pool, "freeze_stages": 2}},
        "loss": [{"name": "heated_softmax", "options": {"alpha": 16.0}}],
        "optim": {"name": "sgd", "lr": 0.01, "momentum": 0.9, "layer_decay": 0.75},
        "train": {"iterations": 1, "batch_size": 8, "seed": 0, "out_dir": str(out), "progress": False},
        "eval": {"every": 0, "split": "train"},
    }


@pytest.fixture(scope="module", params=sorted(ARCHS))
def trained(request, tmp_path_factory):
    """One training step from a weights file, then the file is deleted."""
    from deepmetric.train.loop import train

    arch, pool = ARCHS[request.param]
    base = tmp_path_factory.mktemp(request.param)
    folder = make_shapes_folder(base / "gallery", per_class=4)
    weights = _weights_file(base / f"{arch}.safetensors", arch)
    reference = timm.create_model(arch, pretrained=False, num_classes=0)
    reference.load_state_dict(_without_head(weights, reference))
    train(config_from_dict(_config(folder, base / "run", arch, pool, weights)))
    weights.unlink()  # every later step must do without it
    return {"arch": arch, "pool": pool, "base": base, "folder": folder, "ckpt": base / "run" / "last.pt",
            "reference": reference}


def _without_head(weights: Path, net) -> dict:
    from safetensors.torch import load_file

    own = net.state_dict()
    return {k: v for k, v in load_file(str(weights)).items() if k in own}


def test_checkpoint_stands_alone_and_holds_the_preprocessing(trained):
    from deepmetric.run.checkpoint import load_checkpoint
    from deepmetric.run.embed import load_model_from_checkpoint

    state = load_checkpoint(trained["ckpt"])
    opts = state["config"]["data"]["transform_options"]
    data_cfg = timm.data.resolve_data_config({}, model=trained["reference"])
    assert opts["mean"] == pytest.approx(list(data_cfg["mean"])) and opts["std"] == pytest.approx(list(data_cfg["std"]))
    assert opts["interpolation"] == data_cfg["interpolation"] and opts["crop_pct"] == pytest.approx(data_cfg["crop_pct"])
    assert opts["input_size"] == [32, 32]  # the recipe's override wins
    model, _, _, _ = load_model_from_checkpoint(trained["ckpt"])  # the weights file is gone
    for k, v in state["model"].items():
        assert torch.equal(model.state_dict()[k], v), k
    # frozen stages kept the file's weights; the step moved the rest
    net = model.backbone.net
    first = next(n for n, _ in net.named_parameters())
    assert torch.equal(net.state_dict()[first], trained["reference"].state_dict()[first])


def _images(folder: Path) -> list[Path]:
    return sorted(folder.glob("*/*.png"))


# torch.jit.load warns that TorchScript is deprecated (the user's side)
@pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::DeprecationWarning")
def test_embed_export_index_and_serve_without_the_weights_file(trained, tmp_path):
    ort = pytest.importorskip("onnxruntime")
    from deepmetric import cli
    from deepmetric.search import Index
    from deepmetric.search.export import EmbeddingOnly, preprocessing_path
    from deepmetric.search.query import Preprocessing
    from deepmetric.run.embed import load_model_from_checkpoint

    ckpt = trained["ckpt"]
    assert cli.main(["embed", str(ckpt), "--out", str(tmp_path / "e.npz"), "--split", "train"]) == 0
    emb = np.load(tmp_path / "e.npz")["embeddings"]
    assert emb.shape == (16, 16) and np.isfinite(emb).all()
    onnx_out, ts_out = tmp_path / "m.onnx", tmp_path / "m.pt"
    assert cli.main(["export", str(ckpt), "--format", "onnx", "--out", str(onnx_out)]) == 0
    assert cli.main(["export", str(ckpt), "--format", "torchscript", "--out", str(ts_out)]) == 0
    info = json.loads(preprocessing_path(onnx_out).read_text())
    pre = Preprocessing.from_dict(info["preprocessing"]["recipe"])
    ops = [s["op"] for s in info["preprocessing"]["steps"]]
    assert ops[-5:] == ["rgb", "resize_shorter_side", "center_crop", "to_float", "normalize"], ops
    x = torch.stack([pre(Image.open(p)) for p in _images(trained["folder"])[:6]])
    model, _, _, _ = load_model_from_checkpoint(ckpt)
    with torch.no_grad():
        ref = EmbeddingOnly(model).eval()(x).numpy()
    got = ort.InferenceSession(str(onnx_out), providers=["CPUExecutionProvider"]).run(
        ["embedding"], {"image": x.numpy()})[0]
    assert np.abs(got - ref).max() < 1e-4
    with torch.no_grad():
        assert np.abs(torch.jit.load(str(ts_out))(x).numpy() - ref).max() < 1e-4
    assert info["preprocessing"]["mean"] == pytest.approx(
        list(timm.data.resolve_data_config({}, model=trained["reference"])["mean"]))

    index = Index.build(ckpt, out=tmp_path / "index", progress=False)
    assert len(index) == 16 and np.abs(index.embeddings[:6] - ref).max() < 1e-4
    _serve_and_query(Index.load(tmp_path / "index"), _images(trained["folder"])[0])


def _serve_and_query(index, query: Path):
    pytest.importorskip("uvicorn")
    import uuid

    from deepmetric.search.serve import create_app
    from serving import request, serve_in_thread

    with serve_in_thread(create_app(index, default_k=3)) as url:
        status, _, body = request(url, "GET", "/api/info")
        assert status == 200 and json.loads(body)["count"] == 16
        boundary = uuid.uuid4().hex
        data = (f'--{boundary}\r\nContent-Disposition: form-data; name="image"; filename="{query.name}"\r\n'
                f'Content-Type: application/octet-stream\r\n\r\n').encode() + query.read_bytes() + \
            f"\r\n--{boundary}--\r\n".encode()
        status, _, body = request(url, "POST", "/search", data,
                                  {"Content-Type": f"multipart/form-data; boundary={boundary}"})
    assert status == 200, body
    sims, idx = index.search(str(query), k=3)
    assert [n["id"] for n in json.loads(body)["neighbours"]] == list(idx[0])
    assert idx[0][0] == index.paths.index(str(query.resolve()))


def test_preprocessing_equals_timms_own_eval_transform(tmp_path):
    """The ``timm`` transform filled from the model's pretrained_cfg gives exactly what timm's
    ``create_transform(**resolve_data_config(...))`` gives for a PIL image."""
    from deepmetric.data import build_transform

    img = Image.fromarray(np.random.default_rng(0).integers(0, 255, (70, 90, 3), dtype=np.uint8))
    for arch in ("vit_small_patch16_224.dino", "convnext_atto", "vit_small_patch14_dinov2.lvd142m"):
        cfg = config_from_dict({"data": {"name": "folder", "root": str(tmp_path)},
                                "model": {"name": f"timm/{arch}"}, "loss": [{"name": "contrastive"}], "train": {"epochs": 1}})
        resolve_model_preprocessing(cfg)  # data.transform unset: 'timm', every number from the model
        assert cfg.data.transform == "timm"
        with torch.device("meta"):
            net = timm.create_model(arch, pretrained=False)
        data_cfg = timm.data.resolve_data_config({}, model=net)
        opts = cfg.data.transform_options
        assert opts["input_size"] == list(data_cfg["input_size"][1:])
        assert (opts["interpolation"], opts["crop_pct"]) == (data_cfg["interpolation"], data_cfg["crop_pct"])
        ours = build_transform("timm", train=False, **opts)(img)
        theirs = timm.data.create_transform(**data_cfg, is_training=False)(img)
        assert ours.shape == theirs.shape and (ours - theirs).abs().max() < 1e-5
    # img_size replaces the input size (DINOv2 at 224 px); the recipe's own values win
    cfg = config_from_dict({"data": {"name": "folder", "root": str(tmp_path), "transform": "timm",
                                     "transform_options": {"crop_pct": 1.0}},
                            "model": {"name": "timm/vit_small_patch14_dinov2.lvd142m", "options": {"img_size": 224}},
                            "loss": [{"name": "contrastive"}], "train": {"epochs": 1}})
    resolve_model_preprocessing(cfg)
    assert cfg.data.transform_options["input_size"] == [224, 224] and cfg.data.transform_options["crop_pct"] == 1.0


def test_token_pooling_against_numpy():
    from deepmetric.models import TimmBackbone

    model = create_model("timm/vit_tiny_patch16_224", embedding_dim=8, pool="cls", img_size=48).eval()
    backbone = model.backbone
    assert isinstance(backbone, TimmBackbone) and backbone.output == "tokens" and backbone.num_prefix_tokens == 1
    x = torch.randn(2, 3, 48, 48)
    with torch.no_grad():
        tokens = backbone(x).numpy()
        assert tokens.shape == (2, 1 + 9, 192)
        for pool, want in (("cls", tokens[:, 0]), ("avg", tokens[:, 1:].mean(1)), ("max", tokens[:, 1:].max(1)),
                           ("gem", np.power(np.power(np.maximum(tokens[:, 1:], 1e-6), 3).mean(1), 1 / 3))):
            model.pool = pool
            got = model.forward_head(model.forward_features(x), pre_logits=True).numpy()
            assert np.abs(got - want).max() < 1e-5, pool
    with pytest.raises(ValueError, match="pool 'cls' needs a token backbone|one of"):
        create_model("timm/convnext_atto", pool="cls")


def test_stages_freeze_layer_decay_and_unused_head_parameters():
    from deepmetric.models import backbone_stages
    from deepmetric.run.config import OptimConfig
    from deepmetric.train.optim import layer_depths

    model = create_model("timm/vit_tiny_patch16_224", embedding_dim=8, freeze_stages=3)
    stages = backbone_stages(model.backbone)
    assert len(stages) == 1 + 12  # stem, 12 blocks (the final norm with the last: timm's layer-decay groups)
    net = model.backbone.net
    assert {id(p) for p in stages[0].parameters()} == {id(net.cls_token), id(net.pos_embed),
                                                      *map(id, net.patch_embed.parameters())}
    assert all(not p.requires_grad for s in stages[:3] for p in s.parameters())
    assert all(p.requires_grad for p in net.blocks[2].parameters())
    depth = layer_depths(model)
    assert depth[id(net.blocks[11].attn.qkv.weight)] == depth[id(net.norm.weight)] == 0
    assert depth[id(net.blocks[10].attn.qkv.weight)] == 1 and depth[id(net.cls_token)] == 12
    from deepmetric.train.optim import build_param_groups

    groups = build_param_groups(model, [], OptimConfig(lr=1.0, layer_decay=0.5))
    mult = {n: g["lr_mult"] for g in groups for n in g["names"]}
    assert mult["model.backbone.net.blocks.11.mlp.fc1.weight"] == 1.0
    assert mult["model.backbone.net.blocks.5.mlp.fc1.weight"] == 0.5 ** 6
    assert "model.backbone.net.cls_token" not in mult  # frozen: no group
    conv = create_model("timm/convnext_atto", embedding_dim=8)
    assert conv.backbone.unused == ["head.norm.bias", "head.norm.weight"]
    assert not conv.backbone.net.head.norm.weight.requires_grad
    x = torch.randn(2, 3, 64, 64)
    conv(x)["embedding"].sum().backward()
    assert all(p.grad is not None for p in conv.parameters() if p.requires_grad)
    with pytest.raises(ValueError, match="freeze_stages must be an int in \\[0, 13\\]"):
        create_model("timm/vit_tiny_patch16_224", freeze_stages=14)
    with pytest.raises(ValueError, match="unknown timm model 'vit_tinny_patch16_224'.*timm/vit_tiny_patch16_224"):
        create_model("timm/vit_tinny_patch16_224")
    gc = create_model("timm/vit_tiny_patch16_224", embedding_dim=8, grad_checkpointing=True)
    assert gc.backbone.net.grad_checkpointing


def test_weights_file_errors_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="pretrained weights file not found: '.*nope.safetensors'"):
        create_model("timm/convnext_atto", pretrained=str(tmp_path / "nope.safetensors"))
    other = _weights_file(tmp_path / "vit.safetensors", "vit_tiny_patch16_224")
    with pytest.raises(ValueError, match=r"vit.safetensors.*(do not match|shape mismatch|does not fit)"):
        create_model("timm/convnext_atto", pretrained=str(other))
    with pytest.raises(ValueError, match="pretrained='hub'.*timm/<name> models, not 'resnet18'"):
        create_model("resnet18", pretrained="hub")


def test_hub_loading_through_timm_and_offline_error(tmp_path, monkeypatch):
    """Only the download function huggingface_hub gives timm is replaced: timm's own loading
    (safetensors, its filter, the classifier dropped) runs; offline is one clear error."""
    import timm.models._hub as hub

    weights = _weights_file(tmp_path / "model.safetensors", "convnext_atto", seed=3)
    calls = []

    def fake_download(repo_id, filename, **kwargs):
        calls.append((repo_id, filename))
        return str(weights)

    monkeypatch.setattr(hub, "hf_hub_download", fake_download)
    model = create_model("timm/convnext_atto", pretrained="hub", embedding_dim=8)
    assert calls and calls[0][0] == "timm/convnext_atto.d2_in1k"
    from safetensors.torch import load_file

    want = load_file(str(weights))["stem.0.weight"]
    assert torch.equal(model.backbone.net.stem[0].weight, want)
    assert model.pretrained_report.path == "hub:timm/convnext_atto.d2_in1k" and model.pretrained_report.loaded

    def offline(repo_id, filename, **kwargs):
        from huggingface_hub.errors import LocalEntryNotFoundError

        raise LocalEntryNotFoundError("Cannot find the requested files in the disk cache and outgoing traffic "
                                      "has been disabled.")

    monkeypatch.setattr(hub, "hf_hub_download", offline)
    with pytest.raises(RuntimeError, match=r"timm model 'convnext_atto' from the Hugging Face hub "
                                           r"\(timm/convnext_atto.d2_in1k\).*Offline\?.*pretrained=FILE"):
        create_model("timm/convnext_atto", pretrained="hub")


def _supported_names() -> list[str]:
    text = (ROOT / "docs" / "models.md").read_text()
    block = text.split("<!-- timm-supported:start -->")[1].split("<!-- timm-supported:end -->")[0]
    return re.findall(r"^\| `timm/([^`]+)`", block, flags=re.M)


def _random_weights(model: torch.nn.Module) -> torch.nn.Module:
    """A model built on the meta device, materialised with random weights (N(0, 0.02); BN
    statistics 0 / 1): the build path of every name without timm's slow CPU initialisation."""
    model = model.to_empty(device="cpu")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        for n, b in model.named_buffers():
            b.copy_(torch.ones_like(b) if n.endswith("running_var") else torch.zeros_like(b))
    return model


def test_every_timm_name_in_the_docs_builds():
    names = _supported_names()
    assert len(names) >= 8 and "vit_small_patch16_224.dino" in names and "convnext_atto.d2_in1k" in names
    for name in names:
        patch = int(m.group(1)) if (m := re.search(r"patch(\d+)", name)) else 32
        side = 2 * patch if patch < 32 else 64
        size = {"img_size": side} if takes_img_size(f"timm/{name}") else {}
        with torch.device("meta"):
            model = create_model(f"timm/{name}", embedding_dim=8, pool="avg", **size)
        model = _random_weights(model).eval()
        with torch.no_grad():
            out = model(torch.randn(2, 3, side, side))
        assert out["embedding"].shape == (2, 8) and torch.isfinite(out["embedding"]).all(), name
        assert model.backbone.pretrained_cfg["input_size"][1:] == ((side, side) if size else (224, 224)), name


def test_onnx_export_of_token_pooling_into_a_bn_head_without_projection(tmp_path):
    """embedding_dim 0 puts the BN head straight on a ViT's pooled tokens (emoji_transfer's
    head): ONNX's batch_norm needs a channel count that its shape inference loses in the ViT
    trunk, so the exported BN is written out; equal to torch within 1e-4."""
    ort = pytest.importorskip("onnxruntime")
    from deepmetric.search.export import EmbeddingOnly

    model = create_model("timm/vit_tiny_patch16_224", embedding_dim=0, norm="bn", pool="gem", img_size=32).eval()
    with torch.no_grad():
        model.head.bn.running_mean.uniform_(-1, 1)
        model.head.bn.running_var.uniform_(0.5, 2)
        model.head.bn.bias.uniform_(-1, 1)
    x = torch.randn(3, 3, 32, 32)
    net = EmbeddingOnly(model).eval()
    torch.onnx.export(net, (x[:2],), str(tmp_path / "m.onnx"), input_names=["image"], output_names=["embedding"],
                      dynamic_axes={"image": {0: "batch"}, "embedding": {0: "batch"}}, opset_version=17, dynamo=False)
    got = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"]).run(
        ["embedding"], {"image": x.numpy()})[0]
    with torch.no_grad():
        assert np.abs(got - net(x).numpy()).max() < 1e-4


def test_bf16_autocast_and_channels_last():
    """bf16 autocast (ViT) stays close to float32; channels_last (ConvNeXt) gives the same
    embedding as the contiguous layout."""
    torch.manual_seed(0)
    vit = create_model("timm/vit_tiny_patch16_224", embedding_dim=16, norm="l2", pool="cls", img_size=32).eval()
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        ref = vit(x)["embedding"]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = vit(x)["embedding"]
    assert low.dtype == torch.float32 and torch.nn.functional.cosine_similarity(ref, low).min() > 0.98
    conv = create_model("timm/convnext_atto", embedding_dim=16, norm="l2").eval()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        ref = conv(x)["embedding"]
        conv.to(memory_format=torch.channels_last)
        got = conv(x.contiguous(memory_format=torch.channels_last))["embedding"]
    assert (ref - got).abs().max() < 1e-5
