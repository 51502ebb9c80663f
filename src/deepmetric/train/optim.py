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

Each group stores ``lr_mult`` and ``is_backbone`` so the loop can apply schedules and the
``new_layers`` warm-up (backbone lr 0) without re-deriving names.
"""
from __future__ import annotations

import re
from typing import Iterable

import torch
from torch import nn

from .config import OptimConfig

__all__ = ["named_trainable_parameters", "build_param_groups", "build_optimizer"]


def named_trainable_parameters(model: nn.Module, losses: Iterable[nn.Module]):
    for name, p in model.named_parameters():
        if p.requires_grad:
            yield f"model.{name}", p
    for i, loss in enumerate(losses):
        for name, p in loss.named_parameters():
            if p.requires_grad:
                yield f"loss.{i}.{name}", p


def _classify(name: str, cfg: OptimConfig, compiled) -> tuple[float, float, bool]:
    """(lr_mult, weight_decay, is_backbone) for one qualified parameter name."""
    wd = cfg.weight_decay
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
        mult = 1.0
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
    groups: dict[tuple, dict] = {}
    for name, p in named_trainable_parameters(model, losses):
        key = _classify(name, cfg, compiled)
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
