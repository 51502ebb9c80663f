"""A tiny model for tests and smoke runs: the model of the ``synthetic`` dataset
(:mod:`deepmetric.data.synthetic`), registered as ``model.name: synthetic_mlp``.

``SyntheticMLP`` is a two-layer MLP with the model contract (``forward`` returns a dict with
``embedding``, ``features`` and, with ``num_classes``, ``logits``; ``forward_features`` /
``forward_head`` / ``num_features`` as in timm), a ``backbone`` and a ``head``, so optimiser
groups and new-layer multipliers behave as with the real models.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepmetric.options import int_option
from .registry import register_model

__all__ = ["SyntheticMLP"]


@register_model("synthetic_mlp")
class SyntheticMLP(nn.Module):
    """``backbone`` (Linear + ReLU) -> ``head`` (Linear to ``embedding_dim``) -> normalisation
    (``none`` or ``l2``); with ``num_classes`` also a ``classifier`` on the backbone features
    (the two-head layout).  Outputs ``embedding``, ``features`` (the backbone's) and
    ``logits`` (with a classifier).

    Having no conv map, ``forward_features(x)`` gives the hidden features [B, hidden] that the
    head reads; ``forward_head(h)`` the embedding, ``forward_head(h, pre_logits=True)`` h itself.
    """

    def __init__(self, in_dim: int = 16, hidden: int = 32, embedding_dim: int = 8,
                 normalization: str = "l2", num_classes: int | None = None, two_head: bool = False):
        super().__init__()
        if normalization not in ("none", "l2"):
            raise ValueError(f"synthetic_mlp: normalization must be 'none' or 'l2', got {normalization!r}")
        in_dim, hidden, embedding_dim = (int_option(f"synthetic_mlp: {key}", value) for key, value in
                                         (("in_dim", in_dim), ("hidden", hidden), ("embedding_dim", embedding_dim)))
        self.backbone = nn.Sequential(nn.Linear(in_dim, hidden), nn.ReLU())
        self.head = nn.Linear(hidden, embedding_dim)
        self.normalization = normalization
        self.embedding_dim = embedding_dim
        self.num_features = hidden
        self.classifier = nn.Linear(hidden, num_classes) if (two_head and num_classes) else None
        # the model contract's parts this model has none of (models/contract.py)
        self.pool = self.projection = self.projection_dim = self.head_init = None

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return self.backbone(x.flatten(1))

    def forward_head(self, h: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        if pre_logits:
            return h
        e = self.head(h)
        return F.normalize(e, dim=1) if self.normalization == "l2" else e

    def forward(self, x: torch.Tensor) -> dict:
        h = self.forward_features(x)
        out = {"embedding": self.forward_head(h), "features": self.forward_head(h, pre_logits=True)}
        if self.classifier is not None:
            out["logits"] = self.classifier(h)
        return out
