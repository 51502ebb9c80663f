"""Contrastive loss (Hadsell, Chopra & LeCun, CVPR 2006)."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .distances import (
    upcast_normalized,
    check_embeddings_labels,
    no_autocast,
    pairwise_squared_euclidean,
    safe_sqrt,
    zero_loss,
)
from .registry import register_loss

__all__ = ["ContrastiveLoss"]


@register_loss("contrastive")
class ContrastiveLoss(nn.Module):
    """Contrastive loss, Hadsell et al. 2006 Eq. 4, over every pair of the batch.

    For each unordered pair (i, j), i < j, with Euclidean distance ``D_ij``:
    ``L_ij = 1/2 D_ij^2`` if ``y_i == y_j`` else ``1/2 max(0, m - D_ij)^2``.

    Args:
        margin: m, the distance beyond which negatives stop contributing (default 1.0;
            embeddings are l2-normalised by default, so distances lie in [0, 2]).
        normalize: l2-normalise embeddings first (default True).
        reduction: ``"mean"`` over all B(B-1)/2 pairs (default), ``"mean_nonzero"`` over
            pairs with a non-zero loss, or ``"sum"``.
    """

    #: the loss of a sample depends on the other samples of the batch: under DDP it sees every
    #: rank's embeddings (``deepmetric.train.module.TrainingModule``)
    pair_based = True

    def __init__(self, margin: float = 1.0, normalize: bool = True, reduction: str = "mean") -> None:
        super().__init__()
        if margin < 0:
            raise ValueError(f"ContrastiveLoss: margin must be >= 0, got {margin}")
        if reduction not in ("mean", "mean_nonzero", "sum"):
            raise ValueError(
                f"ContrastiveLoss: reduction must be 'mean', 'mean_nonzero' or 'sum', got {reduction!r}"
            )
        self.margin = float(margin)
        self.normalize = bool(normalize)
        self.reduction = reduction

    def extra_repr(self) -> str:
        return f"margin={self.margin}, normalize={self.normalize}, reduction={self.reduction!r}"

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        check_embeddings_labels(embeddings, labels, "ContrastiveLoss")
        b = embeddings.shape[0]
        if b < 2:
            return zero_loss(embeddings)
        with no_autocast(embeddings.device):
            x = upcast_normalized(embeddings, self.normalize)
            sq = pairwise_squared_euclidean(x)
            same = labels.unsqueeze(0) == labels.unsqueeze(1)
            # positives use D^2 directly (no sqrt needed); negatives need D itself
            neg_term = F.relu(self.margin - safe_sqrt(sq)).pow(2)
            per_pair = 0.5 * torch.where(same, sq, neg_term)
            # the matrix is symmetric with a zero diagonal: the sum over i < j is half the
            # full sum (a multiply-free reduction, faster than boolean indexing)
            total = 0.5 * per_pair.sum()
            if self.reduction == "sum":
                return total
            if self.reduction == "mean":
                return total / (b * (b - 1) // 2)
            nonzero = 0.5 * (per_pair > 0).sum()
            return total / nonzero.clamp_min(1).to(total.dtype)
