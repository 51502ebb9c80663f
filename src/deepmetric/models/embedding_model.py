"""Backbone + global pooling + :class:`EmbeddingHead` (heated-up softmax, ALMN, baselines).

Heated-up softmax embedding (Zhang et al., 2018), Sec. 5.1: GoogLeNet, global average pool,
a linear layer to k = 64 dims, then the feature normalisation (none / l2 / bn, Eq. 13).
ALMN (Sec. 4.2): GoogLeNet, 512-d embedding, dropout 0.2, no normalisation layer.
"""
from __future__ import annotations

import torch
from torch import nn

from .heads import EmbeddingHead

__all__ = ["EmbeddingModel", "global_pool", "POOLS"]

POOLS = ("avg", "max")


def global_pool(fmap: torch.Tensor, pool: str) -> torch.Tensor:
    """[B, C, H, W] -> [B, C] by global average or max pooling."""
    if pool == "avg":
        return fmap.mean(dim=(2, 3))
    if pool == "max":
        return fmap.amax(dim=(2, 3))
    raise ValueError(f"pool must be one of {POOLS}, got {pool!r}")


class EmbeddingModel(nn.Module):
    """forward(x) -> {"embedding": [B, k], "features": [B, C]} (+ "logits" with num_classes).

    timm's model contract, which ``forward`` is written in:

    * ``forward_features(x)`` -> the backbone's conv map [B, C, H, W] (before pooling);
    * ``forward_head(fmap)`` -> global pool -> :class:`EmbeddingHead` -> ``"embedding"`` [B, k];
    * ``forward_head(fmap, pre_logits=True)`` -> the pooled features ``"features"`` [B, C]
      (``num_features`` = C).

    Args:
        backbone: module returning a conv map [B, C, H, W], with ``num_features`` = C.
        embedding_dim, norm, dropout, **head_options: see :class:`EmbeddingHead`.
        num_classes: if given, a plain linear classifier on the embedding adds ``"logits"``
            (softmax baseline trained with plain cross-entropy on the model's own logits).
            The heated-up / NormFace classifier with its temperature lives in the loss instead.
        pool: ``"avg"`` (all three papers) or ``"max"``.
    """

    def __init__(
        self,
        backbone: nn.Module,
        embedding_dim: int = 64,
        norm: str = "bn",
        dropout: float = 0.0,
        num_classes: int | None = None,
        pool: str = "avg",
        **head_options,
    ):
        super().__init__()
        if pool not in POOLS:
            raise ValueError(f"pool must be one of {POOLS}, got {pool!r}")
        if num_classes is not None and (not isinstance(num_classes, int) or num_classes < 2):
            raise ValueError(f"num_classes must be None or an int >= 2, got {num_classes!r}")
        self.backbone = backbone
        self.pool = pool
        self.num_features = int(backbone.num_features)
        self.embedding_dim = int(embedding_dim)
        self.head = EmbeddingHead(self.num_features, embedding_dim, norm=norm, dropout=dropout, **head_options)
        self.classifier = nn.Linear(embedding_dim, num_classes) if num_classes is not None else None
        self.num_classes = num_classes

    @property
    def norm(self) -> str:
        return self.head.norm

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """The backbone's last conv map [B, num_features, H, W]."""
        return self.backbone(x)

    def forward_head(self, fmap: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """Embedding [B, k] of a conv map; ``pre_logits=True``: the pooled features [B, C]."""
        features = global_pool(fmap, self.pool)
        return features if pre_logits else self.head(features)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        features = self.forward_head(self.forward_features(x), pre_logits=True)
        # self.head(features) is forward_head(fmap) without pooling the map a second time
        out = {"embedding": self.head(features), "features": features}
        if self.classifier is not None:
            out["logits"] = self.classifier(out["embedding"])
        return out
