"""The loss registry: every loss class registers itself where it is defined.

>>> @register_loss("my_loss")
... class MyLoss(nn.Module): ...

registers ``MyLoss`` under ``"my_loss"`` (as timm's ``register_model``), so that
``build_loss("my_loss", **options)`` and a config's ``loss: [{name: my_loss}]`` build it.
The loss's options are its constructor's keyword parameters (:func:`loss_options`).
"""
from __future__ import annotations

import difflib
import inspect

import torch.nn as nn

__all__ = ["register_loss", "list_losses", "loss_class", "loss_options", "build_loss"]

_LOSSES: dict[str, type[nn.Module]] = {}


def register_loss(name: str):
    """Class decorator registering a loss under ``name``; a second loss of the same name is
    an error."""

    def deco(cls: type[nn.Module]) -> type[nn.Module]:
        if not isinstance(name, str) or not name:
            raise ValueError(f"register_loss: the name must be a non-empty string, got {name!r}")
        if name in _LOSSES:
            raise ValueError(f"loss {name!r} is already registered (by {_LOSSES[name].__qualname__})")
        _LOSSES[name] = cls
        return cls

    return deco


def list_losses() -> list[str]:
    """Names accepted by :func:`build_loss`, sorted."""
    return sorted(_LOSSES)


def loss_class(name: str) -> type[nn.Module]:
    """The loss class registered under ``name``."""
    if not isinstance(name, str) or name not in _LOSSES:
        raise ValueError(f"unknown loss {name!r}; expected one of {list_losses()}")
    return _LOSSES[name]


def loss_options(name: str) -> set[str] | None:
    """The options (constructor keywords) loss ``name`` accepts; None when it takes
    ``**options`` and checks them itself (``pml``).  An unknown name raises as
    :func:`loss_class`."""
    params = inspect.signature(loss_class(name)).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return None
    return {n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def build_loss(name: str, **kwargs) -> nn.Module:
    """Build the loss registered under ``name`` with keyword options.

    Example: ``build_loss("triplet", mining="hard", soft_margin=True)``;
    ``build_loss("proxy_nca", num_classes=100, embedding_dim=512)``.
    Unknown names or options raise ValueError / TypeError naming the loss and the option.
    """
    cls = loss_class(name)
    accepted = loss_options(name)
    if accepted is not None:
        accepted = sorted(accepted)
        for key in kwargs:
            if key not in accepted:
                close = difflib.get_close_matches(key, accepted, n=1, cutoff=0.6)
                hint = f" (did you mean {close[0]!r}?)" if close else f"; accepted: {', '.join(accepted)}"
                raise TypeError(f"build_loss({name!r}): unknown option {key!r}{hint}")
    try:
        return cls(**kwargs)
    except TypeError as err:
        raise TypeError(f"build_loss({name!r}): bad options {sorted(kwargs)} for {cls.__name__}: {err}") from err
