"""A tiny model for tests and smoke runs: the model of the ``synthetic`` dataset
(:mod:`deepmetric.data.synthetic`), registered as ``model.name: synthetic_mlp``.

``SyntheticMLP`` is a two-layer MLP with the model contract (``forward`` returns a dict with
``embedding`` and, with ``num_classes``, ``logits``), a ``backbone`` and a ``head``, so
optimiser groups and new-layer multipliers behave as with the real models.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .registry import register_model

__all__ = ["SyntheticMLP"]


@register_model("synthetic_mlp")
class SyntheticMLP(nn.Module):
    """``backbone`` (Linear + ReLU) -> ``head`` (Linear to ``embedding_dim``) -> normalisation
    (``none`` or ``l2``); with ``num_classes`` also a ``classifier`` on the backbone features
    (the two-head layout).  Outputs ``embedding``, ``features`` (the backbone's) and
    ``logits`` (with a classifier)."""

    def __init__(self, in_dim: int = 16, hidden: int = 32, embedding_dim: int = 8,
                 normalization: str = "l2", num_classes: int | None = None, two_head: bool = False):
        super().__init__()
        if normalization not in ("none", "l2"):
            raise ValueError(f"synthetic_mlp: normalization must be 'none' or 'l2', got {normalization!r}")
        self.backbone = nn.Sequential(nn.Linear(in_dim, hidden), nn.ReLU())
        self.head = nn.Linear(hidden, embedding_dim)
        self.normalization = normalization
        self.embedding_dim = embedding_dim
        self.classifier = nn.Linear(hidden, num_classes) if (two_head and num_classes) else None

    def forward(self, x: torch.Tensor) -> dict:
        h = self.backbone(x.flatten(1))
        e = self.head(h)
        if self.normalization == "l2":
            e = F.normalize(e, dim=1)
        out = {"embedding": e, "features": h}
        if self.classifier is not None:
            out["logits"] = self.classifier(h)
        return out
