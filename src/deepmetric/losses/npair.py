"""Multi-class N-pair loss (Sohn, NeurIPS 2016)."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .distances import upcast_normalized, check_embeddings_labels, no_autocast, zero_loss
from .registry import register_loss

__all__ = ["NPairLoss", "select_npairs"]


@torch.no_grad()
def select_npairs(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One (anchor, positive) pair per class: the class's first two samples in batch order.

    Classes with a single sample are skipped. Pairs are ordered by label value (the same
    pairs, in the same order, as pytorch-metric-learning's ``NPairsLoss``).
    """
    n = labels.shape[0]
    if n < 2:
        empty = torch.zeros(0, dtype=torch.long, device=labels.device)
        return empty, empty.clone()
    sorted_labels, order = torch.sort(labels, stable=True)
    starts = torch.ones(n, dtype=torch.bool, device=labels.device)
    starts[1:] = sorted_labels[1:] != sorted_labels[:-1]
    first = torch.nonzero(starts, as_tuple=False).squeeze(1)
    first = first[first + 1 < n]
    first = first[sorted_labels[first + 1] == sorted_labels[first]]
    return order[first], order[first + 1]


@register_loss("npair")
class NPairLoss(nn.Module):
    """Multi-class N-pair loss, Sohn 2016 Eq. 3 (the (N+1)-tuplet form), with its L2 regulariser.

    From the batch one pair (anchor f_i, positive f_i^+) is taken per class
    (:func:`select_npairs`), giving N pairs of N distinct classes, and

    ``L = 1/N sum_i log(1 + sum_{j != i} exp(f_i . f_j^+ - f_i . f_i^+))``
    ``    + l2_reg / 4 * (mean_i ||f_i||^2 + mean_i ||f_i^+||^2)``

    The first term equals softmax cross-entropy of the similarity matrix ``F F+^T`` with
    target i for row i. The regulariser (Sohn Sec. 3.2.2: the embedding norm must be kept
    small because the loss is not scale invariant) follows the TensorFlow reference
    ``tf.contrib.losses.metric_learning.npairs_loss`` (weight 0.25 * reg_lambda).

    Args:
        l2_reg: lambda of the embedding-norm regulariser (default 0.002, TensorFlow/Sohn).
        normalize: l2-normalise embeddings first (default False: the paper uses raw
            embeddings, which is why it needs the regulariser).

    Batches without any class holding two samples return a zero connected to the graph.
    """

    #: the loss of a sample depends on the other samples of the batch: under DDP it sees every
    #: rank's embeddings (``deepmetric.train.module.TrainingModule``)
    pair_based = True

    def __init__(self, l2_reg: float = 0.002, normalize: bool = False) -> None:
        super().__init__()
        if l2_reg < 0:
            raise ValueError(f"NPairLoss: l2_reg must be >= 0, got {l2_reg}")
        self.l2_reg = float(l2_reg)
        self.normalize = bool(normalize)

    def extra_repr(self) -> str:
        return f"l2_reg={self.l2_reg}, normalize={self.normalize}"

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        check_embeddings_labels(embeddings, labels, "NPairLoss")
        a_idx, p_idx = select_npairs(labels)
        if a_idx.numel() == 0:
            return zero_loss(embeddings)
        with no_autocast(embeddings.device):
            x = upcast_normalized(embeddings, self.normalize)
            anchors, positives = x[a_idx], x[p_idx]
            logits = anchors @ positives.t()
            targets = torch.arange(a_idx.numel(), device=x.device)
            loss = F.cross_entropy(logits, targets)
            if self.l2_reg > 0:
                reg = anchors.pow(2).sum(1).mean() + positives.pow(2).sum(1).mean()
                loss = loss + 0.25 * self.l2_reg * reg
            return loss
