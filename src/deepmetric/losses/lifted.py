"""Lifted structured embedding loss, smooth version (Song et al., CVPR 2016)."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .distances import (
    upcast_normalized,
    check_embeddings_labels,
    label_masks,
    masked_logsumexp,
    no_autocast,
    pairwise_euclidean,
    zero_loss,
)
from .registry import register_loss

__all__ = ["LiftedStructureLoss"]


@register_loss("lifted")
class LiftedStructureLoss(nn.Module):
    """Smooth lifted structured loss, Song et al. 2016 Eq. 4 (the smooth upper bound of Eq. 3).

    With Euclidean distances ``D``, positive pairs P (unordered, same label) and negatives
    N(i) of sample i (different label):

    ``J_ij = log( sum_{k in N(i)} exp(m - D_ik) + sum_{l in N(j)} exp(m - D_jl) ) + D_ij``
    ``L = 1 / (2|P|) sum_{(i,j) in P} max(0, J_ij)^2``

    Args:
        margin: m (default 1.0, as in the paper).
        normalize: l2-normalise embeddings first (default False: Eq. 4 is written on the
            raw network output; pytorch-metric-learning's LiftedStructureLoss normalises,
            which ``normalize=True`` reproduces).

    Computed densely (one B x B matrix) with a masked, max-shifted log-sum-exp. Pairs whose
    samples have no negative in the batch contribute nothing; a batch without positive pairs
    or without negatives returns a zero connected to the graph.
    """

    #: the loss of a sample depends on the other samples of the batch: under DDP it sees every
    #: rank's embeddings (``deepmetric.train.module.TrainingModule``)
    pair_based = True

    def __init__(self, margin: float = 1.0, normalize: bool = False) -> None:
        super().__init__()
        self.margin = float(margin)
        self.normalize = bool(normalize)

    def extra_repr(self) -> str:
        return f"margin={self.margin}, normalize={self.normalize}"

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        check_embeddings_labels(embeddings, labels, "LiftedStructureLoss")
        pos, neg = label_masks(labels)
        pos = torch.triu(pos, diagonal=1)
        num_pos = int(pos.sum())
        if num_pos == 0 or not bool(neg.any()):
            return zero_loss(embeddings)
        with no_autocast(embeddings.device):
            x = upcast_normalized(embeddings, self.normalize)
            d = pairwise_euclidean(x)
            neg_lse = masked_logsumexp(self.margin - d, neg, dim=1)  # [B], -inf without negatives
            has_neg = neg.any(dim=1)
            safe = torch.where(has_neg, neg_lse, torch.zeros_like(neg_lse))
            j = torch.logaddexp(safe.unsqueeze(1), safe.unsqueeze(0)) + d
            # samples of one class share their negatives: has_neg[i] == has_neg[j] on P
            keep = pos & has_neg.unsqueeze(1)
            per_pair = F.relu(j[keep]).pow(2)
            return per_pair.sum() / (2.0 * num_pos)
