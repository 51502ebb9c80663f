"""Optimiser with parameter groups: backbone lr, new-layer multiplier, loss parameters.

Parameter names are qualified as ``model.<name>`` and ``loss.<i>.<name>``.  The group of a
parameter is decided in this order:

1. the first ``optim.param_groups`` entry whose regular expression ``pattern`` matches
   (``re.search``) sets ``lr_mult`` and/or ``weight_decay``;
2. loss parameters (heated-softmax ``W`` and bias, Proxy-NCA proxies, learnable alpha) are
   new layers with ``loss_lr_mult`` (default ``new_layer_lr_mult``);
3. model parameters whose name starts with one of ``optim.new_layers`` -- by default every
   parameter outside ``backbone.`` (the embedding head, the two-head classifier) -- get
   ``new_layer_lr_mult`` (ALMN: 10x on the embedding layer);
4. the rest (the pretrained backbone) trains at ``optim.lr``.

With ``optim.layer_decay`` (layer-wise learning-rate decay, as BEiT and ELECTRA fine-tune) a
backbone parameter of stage ``s`` counted from the top (``deepmetric.models.backbone_stages``:
the top stage is ``s = 0``) has its multiplier of step 4 (or of a ``param_groups`` entry that
sets only ``weight_decay``) multiplied by ``layer_decay ** s``; an entry that sets ``lr_mult``
keeps it, the new layers and the loss keep theirs.  Frozen stages (``freeze_stages``) have no
trainable parameters and so no group.

``optim.decay_exclude`` then sets the weight decay of the kinds it names to 0: ``bias``
(``*.bias``), ``norm`` (parameters of normalisation layers: ``torch.nn`` batch, layer, group,
instance norm and any module whose class name ends in ``Norm``/``Norm2d``...) and ``loss``
(proxies, class weights, centres, temperatures); an explicit ``param_groups`` weight decay wins.

Each group stores ``lr_mult`` and ``is_backbone`` so the loop can apply schedules and the
``new_layers`` warm-up (backbone lr 0) without re-deriving names.
"""
from __future__ import annotations

import re
from typing import Iterable

import torch
from torch import nn

from deepmetric.run.config import OptimConfig

__all__ = ["named_trainable_parameters", "build_param_groups", "build_optimizer", "layer_depths",
           "norm_parameter_names"]


def named_trainable_parameters(model: nn.Module, losses: Iterable[nn.Module]):
    for name, p in model.named_parameters():
        if p.requires_grad:
            yield f"model.{name}", p
    for i, loss in enumerate(losses):
        for name, p in loss.named_parameters():
            if p.requires_grad:
                yield f"loss.{i}.{name}", p


def layer_depths(model: nn.Module) -> dict[int, int]:
    """``{id(parameter): s}`` for every parameter of ``model.backbone``, ``s`` its stage
    counted from the top (the stage nearest the head is 0).  Raises ``ValueError`` naming
    ``optim.layer_decay`` when the model has no backbone with known stages."""
    from deepmetric.models import backbone_stages, with_model_defaults

    backbone = with_model_defaults(model).backbone  # any module (one from elsewhere may have none)
    if not isinstance(backbone, nn.Module):
        raise ValueError(f"config key 'optim.layer_decay': model {type(model).__name__} has no .backbone "
                         f"whose stages could get decayed learning rates")
    try:
        stages = backbone_stages(backbone)
    except ValueError as exc:
        raise ValueError(f"config key 'optim.layer_decay': {exc}") from None
    depth = {id(p): len(stages) - 1 - s for s, stage in enumerate(stages) for p in stage.parameters()}
    missing = [n for n, p in backbone.named_parameters() if id(p) not in depth]
    if missing:  # a stage table that forgot a layer: say so rather than train it at full rate
        raise ValueError(f"config key 'optim.layer_decay': backbone parameters {missing[:5]} lie in no stage")
    return depth


_NORM_TYPES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm, nn.InstanceNorm1d,
               nn.InstanceNorm2d, nn.InstanceNorm3d, nn.LayerNorm, nn.GroupNorm)


def norm_parameter_names(model: nn.Module, losses: Iterable[nn.Module] = ()) -> set[str]:
    """Qualified names (``model.<name>``, ``loss.<i>.<name>``) of the parameters that belong
    directly to a normalisation layer (batch / instance norm, layer norm, group norm, or a
    module whose class name ends in ``Norm``: timm's ``LayerNorm2d``, RMS norms)."""
    out = set()
    for prefix, module in [("model", model)] + [(f"loss.{i}", l) for i, l in enumerate(losses)]:
        for mname, m in module.named_modules():
            if isinstance(m, _NORM_TYPES) or type(m).__name__.rstrip("0123456789d").endswith("Norm"):
                for pname, _ in m.named_parameters(recurse=False):
                    out.add(".".join(p for p in (prefix, mname, pname) if p))
    return out


def _no_decay(name: str, cfg: OptimConfig, norms: set[str]) -> bool:
    """Whether ``optim.decay_exclude`` takes the weight decay off this parameter."""
    kinds = cfg.decay_exclude
    return (("bias" in kinds and name.endswith(".bias")) or ("norm" in kinds and name in norms)
            or ("loss" in kinds and name.startswith("loss.")))


def _classify(name: str, cfg: OptimConfig, compiled, decay: float = 1.0,
              norms: set[str] = frozenset()) -> tuple[float, float, bool]:
    """(lr_mult, weight_decay, is_backbone) for one qualified parameter name; ``decay`` is the
    layer-wise factor of a backbone parameter (``layer_decay ** s``); ``norms``: the names of
    normalisation-layer parameters (:func:`norm_parameter_names`)."""
    wd = 0.0 if _no_decay(name, cfg, norms) else cfg.weight_decay
    is_loss = name.startswith("loss.")
    local = name[len("model."):] if name.startswith("model.") else name
    if cfg.new_layers is None:
        is_new = not local.startswith("backbone.")
    else:
        is_new = any(local.startswith(prefix) for prefix in cfg.new_layers)
    if is_loss:
        mult = cfg.loss_lr_mult if cfg.loss_lr_mult is not None else cfg.new_layer_lr_mult
    elif is_new:
        mult = cfg.new_layer_lr_mult
    else:
        mult = decay
    for regex, group in compiled:
        if regex.search(name):
            if group.lr_mult is not None:
                mult = group.lr_mult
            if group.weight_decay is not None:
                wd = group.weight_decay
            break
    return float(mult), float(wd), not (is_loss or is_new)


def build_param_groups(model: nn.Module, losses: Iterable[nn.Module], cfg: OptimConfig) -> list[dict]:
    """Parameter groups (``params``, ``names``, ``lr_mult``, ``weight_decay``, ``is_backbone``)."""
    compiled = []
    for i, g in enumerate(cfg.param_groups):
        try:
            compiled.append((re.compile(g.pattern), g))
        except re.error as exc:
            raise ValueError(f"config key 'optim.param_groups.{i}.pattern': invalid regular "
                             f"expression {g.pattern!r} ({exc})") from None
    depth = layer_depths(model) if cfg.layer_decay is not None else {}
    losses = list(losses)
    norms = norm_parameter_names(model, losses) if "norm" in cfg.decay_exclude else set()
    groups: dict[tuple, dict] = {}
    for name, p in named_trainable_parameters(model, losses):
        decay = cfg.layer_decay ** depth[id(p)] if id(p) in depth else 1.0
        key = _classify(name, cfg, compiled, decay, norms)
        g = groups.setdefault(key, {"params": [], "names": [], "lr_mult": key[0],
                                    "weight_decay": key[1], "is_backbone": key[2]})
        g["params"].append(p)
        g["names"].append(name)
    if not groups:
        raise ValueError("nothing to train: the model and the losses have no trainable parameters")
    return list(groups.values())


def build_optimizer(model: nn.Module, losses: Iterable[nn.Module], cfg: OptimConfig) -> torch.optim.Optimizer:
    """SGD (momentum, Nesterov), Adam or AdamW over ``build_param_groups``.

    The group lr starts at ``cfg.lr * lr_mult``; the training loop rewrites it every step
    from the schedules.  The ``names`` lists are dropped before they reach the optimiser
    (its state_dict must stay tensors and primitives) but kept as ``param_names``.
    """
    groups = build_param_groups(model, losses, cfg)
    torch_groups = []
    for g in groups:
        torch_groups.append({
            "params": g["params"],
            "lr": cfg.lr * g["lr_mult"],
            "weight_decay": g["weight_decay"],
            "lr_mult": g["lr_mult"],
            "is_backbone": g["is_backbone"],
            "param_names": list(g["names"]),
        })
    if cfg.name == "sgd":
        return torch.optim.SGD(torch_groups, lr=cfg.lr, momentum=cfg.momentum,
                               nesterov=cfg.nesterov and cfg.momentum > 0)
    if cfg.name == "adam":
        return torch.optim.Adam(torch_groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)
    if cfg.name == "adamw":
        return torch.optim.AdamW(torch_groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)
    raise ValueError(f"config key 'optim.name': unknown optimiser {cfg.name!r}; expected sgd, adam or adamw")
