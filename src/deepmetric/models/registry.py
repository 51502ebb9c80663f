"""The model registry: every backbone is a model of its own name
(:func:`~deepmetric.models.backbones.register_backbone`); any other network registers its
factory, or its class, with :func:`register_model` where it is defined (timm's
``register_model``), and :func:`deepmetric.models.create_model` builds it by name.
"""
from __future__ import annotations

from deepmetric.registry import Registry, did_you_mean

from .backbones import list_backbones

__all__ = ["MODELS", "register_model", "list_models"]

#: the registered model factories (info ``needs_num_classes``); the backbones are models too
MODELS = Registry("model")


def register_model(name: str, *, needs_num_classes: bool = False):
    """Decorator adding a model factory ``fn(**kwargs) -> nn.Module`` (or a model class)
    under ``name``.  :func:`~deepmetric.models.create_model` passes it the common arguments
    that are not None (``embedding_dim``, ``norm``, ``num_classes``, ``pretrained``,
    ``in_chans``, ``dropout``) and the model's own options; its keyword parameters are the
    options :func:`~deepmetric.models.model_options` reports.  ``needs_num_classes``: the
    model has a classifier and must be built with ``num_classes``
    (:func:`~deepmetric.models.model_needs_num_classes`).  A second model of the same name
    (or a backbone's name) is an error."""
    if name in list_backbones():
        raise ValueError(f"model {name!r} is already registered (a backbone)")
    return MODELS.register(name, needs_num_classes=needs_num_classes)


def list_models() -> list[str]:
    """All names :func:`~deepmetric.models.create_model` accepts: every backbone, plus
    ``"two_head"`` etc."""
    return sorted(set(list_backbones()) | set(MODELS.names()))


def _unknown_model(name) -> ValueError:
    """The error of a name that is neither a backbone nor a registered model, with the closest."""
    return ValueError(f"unknown model {name!r}.{did_you_mean(name, list_models(), sentence=True)} "
                      f"Available: {', '.join(list_models())}")
