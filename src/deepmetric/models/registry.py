"""The model registry: every backbone is a model of its own name
(:func:`~deepmetric.models.backbones.register_backbone`); any other network registers its
factory, or its class, with :func:`register_model` where it is defined (timm's
``register_model``), and :func:`deepmetric.models.create_model` builds it by name.
"""
from __future__ import annotations

import difflib
from collections.abc import Callable

from torch import nn

from .backbones import list_backbones

__all__ = ["register_model", "list_models"]

_MODELS: dict[str, Callable[..., nn.Module]] = {}
_NEEDS_NUM_CLASSES: set[str] = set()  # registered models that cannot be built without num_classes


def register_model(name: str, *, needs_num_classes: bool = False):
    """Decorator adding a model factory ``fn(**kwargs) -> nn.Module`` (or a model class)
    under ``name``.  :func:`~deepmetric.models.create_model` passes it the common arguments
    that are not None (``embedding_dim``, ``norm``, ``num_classes``, ``pretrained``,
    ``in_chans``, ``dropout``) and the model's own options; its keyword parameters are the
    options :func:`~deepmetric.models.model_options` reports.  ``needs_num_classes``: the
    model has a classifier and must be built with ``num_classes``
    (:func:`~deepmetric.models.model_needs_num_classes`).  A second model of the same name
    (or a backbone's name) is an error."""

    def deco(fn):
        if name in _MODELS or name in list_backbones():
            raise ValueError(f"model {name!r} is already registered")
        _MODELS[name] = fn
        if needs_num_classes:
            _NEEDS_NUM_CLASSES.add(name)
        return fn

    return deco


def list_models() -> list[str]:
    """All names :func:`~deepmetric.models.create_model` accepts: every backbone, plus
    ``"two_head"`` etc."""
    return sorted(set(list_backbones()) | set(_MODELS))


def _unknown_model(name) -> ValueError:
    close = difflib.get_close_matches(str(name), list_models(), n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return ValueError(f"unknown model {name!r}.{hint} Available: {', '.join(list_models())}")
