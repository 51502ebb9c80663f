"""A regulariser towards the pretrained network's similarities (issue 21: keep what the backbone
learnt while fine-tuning).

The batch's cosine-similarity matrix of the trained embeddings is pulled towards the one of
the *pretrained* backbone's pooled features of the same images (a frozen copy of the network
as it was before the first step; the trainer computes them, see docs/training.md):

    L = 1 / (B (B - 1)) * sum_{i != j} (cos(z_i, z_j) - cos(t_i, t_j))^2

the mean squared difference of the off-diagonal entries (the diagonal is 1 on both sides).  It
is the similarity-preserving distillation of Tung & Mori (ICCV 2019) with row-normalised
cosine matrices, and it only asks the embedding to rank the batch's images as the pretrained
features do: its scale and dimension are free (k need not equal C).
"""
from __future__ import annotations

import torch
from torch import nn

from .distances import (
    check_embeddings_labels,
    gram,
    l2_normalize,
    no_autocast,
    zero_loss,
)
from .registry import register_loss

__all__ = ["SimilarityDistillationLoss", "cosine_matrix"]


def cosine_matrix(x: torch.Tensor, centre: bool = False) -> torch.Tensor:
    """``[B, B]`` cosine similarities of the rows of ``x`` (after subtracting the batch mean
    with ``centre``)."""
    if centre:
        x = x - x.mean(0, keepdim=True)
    x = l2_normalize(x)
    return gram(x)


@register_loss("similarity_distillation")
class SimilarityDistillationLoss(nn.Module):
    """``loss(embeddings [B, k], labels [B], pretrained_features [B, C])``: the mean squared
    difference between the off-diagonal cosine similarities of the embeddings and of the
    pretrained features (module docstring).  Labels are not used.

    The trainer passes ``pretrained_features``, the pooled features of a frozen copy of the
    pretrained model (no gradient flows into them): a loss lists the extra model outputs it
    reads in ``extra_inputs``.

    Args:
        centre: subtract each side's batch mean before the cosines (compare the correlation
            structure: the pretrained ReLU features share a large common direction that a
            centred embedding, e.g. the BN head's, has not).  Default False: plain cosines.
    """

    #: what the trainer passes besides (embeddings, labels), by keyword
    extra_inputs = ("pretrained_features",)

    def __init__(self, centre: bool = False) -> None:
        super().__init__()
        self.centre = bool(centre)

    def extra_repr(self) -> str:
        return f"centre={self.centre}"

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor,
                pretrained_features: torch.Tensor) -> torch.Tensor:
        check_embeddings_labels(embeddings, labels, "SimilarityDistillationLoss")
        t = pretrained_features
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.shape[0] != embeddings.shape[0]:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"SimilarityDistillationLoss: pretrained_features must have shape "
                             f"[{embeddings.shape[0]}, C] to match the embeddings, got {shape}")
        b = embeddings.shape[0]
        if b < 2:
            return zero_loss(embeddings)
        with no_autocast(embeddings.device):
            dtype = torch.float64 if embeddings.dtype == torch.float64 else torch.float32
            s = cosine_matrix(embeddings.to(dtype), self.centre)
            with torch.no_grad():
                target = cosine_matrix(t.detach().to(dtype), self.centre)
            off = ~torch.eye(b, dtype=torch.bool, device=embeddings.device)
            return ((s - target)[off] ** 2).mean()
