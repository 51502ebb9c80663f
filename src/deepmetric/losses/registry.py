"""The loss registry: every loss class registers itself where it is defined.

>>> @register_loss("my_loss")
... class MyLoss(nn.Module): ...

registers ``MyLoss`` under ``"my_loss"`` (as timm's ``register_model``), so that
``build_loss("my_loss", **options)`` and a config's ``loss: [{name: my_loss}]`` build it.
The loss's options are its constructor's keyword parameters (:func:`loss_options`).
"""
from __future__ import annotations

import torch.nn as nn

from deepmetric.registry import Registry

__all__ = ["LOSSES", "register_loss", "list_losses", "loss_class", "loss_options", "build_loss"]

LOSSES = Registry("loss", unknown="unknown {kind} {name!r}; expected one of {names}")


def register_loss(name: str):
    """Class decorator registering a loss under ``name``; a second loss of the same name is
    an error."""
    return LOSSES.register(name)


def list_losses() -> list[str]:
    """Names accepted by :func:`build_loss`, sorted."""
    return LOSSES.names()


def loss_class(name: str) -> type[nn.Module]:
    """The loss class registered under ``name``."""
    return LOSSES.get(name)


def loss_options(name: str) -> set[str] | None:
    """The options (constructor keywords) loss ``name`` accepts; None when it takes
    ``**options`` and checks them itself (``pml``).  An unknown name raises as
    :func:`loss_class`."""
    return LOSSES.options(name)


def build_loss(name: str, **kwargs) -> nn.Module:
    """Build the loss registered under ``name`` with keyword options.

    Example: ``build_loss("triplet", mining="hard", soft_margin=True)``;
    ``build_loss("proxy_nca", num_classes=100, embedding_dim=512)``.
    Unknown names or options raise ValueError / TypeError naming the loss and the option.
    """
    cls = loss_class(name)
    LOSSES.check_options(name, kwargs, where=f"build_loss({name!r})")
    try:
        return cls(**kwargs)
    except TypeError as err:
        raise TypeError(f"build_loss({name!r}): bad options {sorted(kwargs)} for {cls.__name__}: {err}") from err
