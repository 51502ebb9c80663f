"""deepmetric.losses: metric-learning losses, each an ``nn.Module`` called ``loss(embeddings, labels)``.

``build_loss(name, **kwargs)`` builds one by name; ``list_losses()`` lists the names.
See docs/losses.md for the table of losses, papers and options.
"""
from __future__ import annotations

import importlib

import torch.nn as nn

from .almn import ALMNLoss
from .center import CenterLoss
from .contrastive import ContrastiveLoss
from .cross_entropy import CrossEntropyLoss
from .heated_softmax import HeatedSoftmaxLoss
from .lifted import LiftedStructureLoss
from .npair import NPairLoss, select_npairs
from .proxy_nca import ProxyNCALoss
from .triplet import TripletLoss, mine_all, mine_batch_hard, mine_semihard

# name -> (module, class) of every loss build_loss knows
_REGISTRY: dict[str, tuple[str, str]] = {
    "heated_softmax": ("heated_softmax", "HeatedSoftmaxLoss"),
    "almn": ("almn", "ALMNLoss"),
    "triplet": ("triplet", "TripletLoss"),
    "center": ("center", "CenterLoss"),
    "contrastive": ("contrastive", "ContrastiveLoss"),
    "npair": ("npair", "NPairLoss"),
    "lifted": ("lifted", "LiftedStructureLoss"),
    "proxy_nca": ("proxy_nca", "ProxyNCALoss"),
    "cross_entropy": ("cross_entropy", "CrossEntropyLoss"),
    # optional dependency pytorch-metric-learning; imported only when used
    "pml": ("pml", "PMLLoss"),
}

__all__ = [
    "ALMNLoss",
    "CenterLoss",
    "ContrastiveLoss",
    "CrossEntropyLoss",
    "HeatedSoftmaxLoss",
    "LiftedStructureLoss",
    "NPairLoss",
    "ProxyNCALoss",
    "TripletLoss",
    "build_loss",
    "list_losses",
    "loss_class",
    "mine_all",
    "mine_batch_hard",
    "mine_semihard",
    "select_npairs",
]


def list_losses() -> list[str]:
    """Names accepted by :func:`build_loss`."""
    return list(_REGISTRY)


def loss_class(name: str) -> type[nn.Module]:
    """The loss class registered under ``name``."""
    if not isinstance(name, str) or name not in _REGISTRY:
        raise ValueError(f"unknown loss {name!r}; expected one of {list_losses()}")
    module_name, class_name = _REGISTRY[name]
    module = importlib.import_module(f"{__name__}.{module_name}")
    return getattr(module, class_name)


def build_loss(name: str, **kwargs) -> nn.Module:
    """Build the loss registered under ``name`` with keyword options.

    Example: ``build_loss("triplet", mining="hard", soft_margin=True)``;
    ``build_loss("proxy_nca", num_classes=100, embedding_dim=512)``.
    Unknown names or options raise ValueError / TypeError naming the loss and the option.
    """
    import difflib
    import inspect

    cls = loss_class(name)
    params = inspect.signature(cls).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        accepted = sorted(n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
        for key in kwargs:
            if key not in accepted:
                close = difflib.get_close_matches(key, accepted, n=1, cutoff=0.6)
                hint = f" (did you mean {close[0]!r}?)" if close else f"; accepted: {', '.join(accepted)}"
                raise TypeError(f"build_loss({name!r}): unknown option {key!r}{hint}")
    try:
        return cls(**kwargs)
    except TypeError as err:
        raise TypeError(f"build_loss({name!r}): bad options {sorted(kwargs)} for {cls.__name__}: {err}") from err

