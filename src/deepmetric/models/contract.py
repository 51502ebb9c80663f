"""The model contract: what the rest of deepmetric reads from a model.

:class:`EmbeddingNetwork` writes it down as a ``typing.Protocol``.  Every registered model
(:class:`~deepmetric.models.EmbeddingModel` for the backbones and ``timm/`` names,
:class:`~deepmetric.models.TwoHeadModel`, :class:`~deepmetric.models.SyntheticMLP`) sets each
attribute in its ``__init__``, ``None`` for a part it does not have, so the training loop, the
checks and the evaluation read them plainly.  A model registered from elsewhere gets the
optional ones it lacks from :func:`with_model_defaults` where it enters a run
(``deepmetric.run.builders.build_model``).  The defaults are instance attributes, not class
attributes: a class attribute would hide a submodule of the same name registered later
(``nn.Module`` keeps submodules out of the instance ``__dict__``).
"""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

__all__ = ["EmbeddingNetwork", "MODEL_DEFAULTS", "with_model_defaults"]


@runtime_checkable
class EmbeddingNetwork(Protocol):
    """A model as deepmetric reads it (timm's model contract, plus the parts around the head).

    * ``forward_features(x)``: the backbone's map (or tokens, or hidden features);
      ``forward_head(f)`` the embedding, ``forward_head(f, pre_logits=True)`` the pooled
      features (what ``eval.embedding: features``, the ImageNet-features baseline and
      ``head_init`` read: ``run.embed.compute_embeddings``);
    * ``forward(x)``: ``{"embedding", "features"}`` plus ``"logits"`` with a classifier and
      ``"projection"`` with a projection head (the loop's loss terms read them by name);
    * ``num_features``: the pooled features' size; ``embedding_dim``: the embedding's (the loss
      terms' input size: ``run.builders.embedding_dim_of``);

    and, ``None`` where the model has no such part:

    * ``backbone``: the pretrained part (``optim.layer_decay``, the linear probe of LP-FT,
      the optimiser's new-layer groups: ``train.optim``, ``train.finetune``);
    * ``head``: the layer from the pooled features to the embedding; when it is an
      :class:`~deepmetric.models.EmbeddingHead`, ``train.checks`` reads its normalisation and
      ``head_init`` sets it from a PCA (``train.module.init_head_from_pca``);
    * ``pool``: the global pooling (the run summary names one other than ``"avg"``);
    * ``projection`` / ``projection_dim``: the SimCLR projection head and its size (the loss
      terms reading ``"projection"``: ``train.setup``, ``run.embed``, ``train.checks``);
    * ``head_init``: ``"pca"`` / ``"pca_whiten"`` when the trainer initialises ``head`` from a
      PCA before the first step (``train.setup``).
    """

    num_features: int
    embedding_dim: int | None
    backbone: nn.Module | None
    head: nn.Module | None
    pool: str | None
    projection: nn.Module | None
    projection_dim: int | None
    head_init: str | None

    def forward_features(self, x: torch.Tensor) -> torch.Tensor: ...

    def forward_head(self, features: torch.Tensor, pre_logits: bool = False) -> torch.Tensor: ...

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]: ...


#: the optional attributes of :class:`EmbeddingNetwork` and what a model that lacks one reads as
#: (``embedding_dim`` None: measured by a forward pass)
MODEL_DEFAULTS: dict[str, Any] = {"embedding_dim": None, "backbone": None, "head": None, "pool": None,
                                  "projection": None, "projection_dim": None, "head_init": None}


def with_model_defaults(model: nn.Module) -> nn.Module:
    """``model`` with every optional attribute of :class:`EmbeddingNetwork` it lacks set to its
    default (:data:`MODEL_DEFAULTS`; in place, plain instance attributes outside the state
    dict; returns it).  The registered models have them all already; this is for models from
    elsewhere, where they enter a run."""
    for name, default in MODEL_DEFAULTS.items():
        if not hasattr(model, name):
            setattr(model, name, default)
    return model
