"""Triplet loss with batch-hard, semi-hard (FaceNet / TensorFlow) and batch-all mining.

Paper: Taha et al., "Boosting Standard Classification Architectures Through a Ranking
Regularizer" (two-head paper), Eq. 5 (triplet loss) and Eq. 7 (semi-hard condition);
mining from Hermans et al. 2017 ("In defense of the triplet loss": batch-hard, batch-all)
and Schroff et al. 2015 (FaceNet semi-hard, as implemented in
``tf.contrib.losses.metric_learning.triplet_semihard_loss``).

The miners are plain functions on a distance matrix so that tests and other code can
inspect exactly which triplets are selected. Ties are broken towards the smallest index
(``torch.argmin``/``argmax`` return the first extreme value).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .distances import (
    upcast_normalized,
    check_embeddings_labels,
    label_masks,
    no_autocast,
    pairwise_squared_euclidean,
    zero_loss,
)
from .registry import register_loss

__all__ = ["TripletLoss", "mine_batch_hard", "mine_semihard", "mine_all", "MINING_MODES"]

MINING_MODES = ("hard", "semihard", "all")
_REDUCTIONS = ("mean", "mean_nonzero", "sum")


@torch.no_grad()
def mine_batch_hard(dist: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Batch-hard mining (Hermans et al. 2017): per anchor the farthest positive and nearest negative.

    Args:
        dist: [B, B] distance matrix (any monotone distance; squared Euclidean in the loss).
        labels: [B] integer labels.

    Returns:
        ``(anchors, positives, negatives)`` int64 index tensors, one triplet per anchor that
        has at least one positive (same label, other index) and one negative.
    """
    pos, neg = label_masks(labels)
    valid = pos.any(dim=1) & neg.any(dim=1)
    neg_inf = torch.finfo(dist.dtype).min
    pos_inf = torch.finfo(dist.dtype).max
    hardest_pos = torch.where(pos, dist, torch.full_like(dist, neg_inf)).argmax(dim=1)
    hardest_neg = torch.where(neg, dist, torch.full_like(dist, pos_inf)).argmin(dim=1)
    anchors = torch.nonzero(valid, as_tuple=False).squeeze(1)
    return anchors, hardest_pos[anchors], hardest_neg[anchors]


@torch.no_grad()
def mine_semihard(dist: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """FaceNet / TensorFlow semi-hard mining (REFERENCE.md section 3, two-head paper Eq. 7).

    For every ordered anchor-positive pair (a, p) (same label, a != p) whose anchor has at
    least one negative, the chosen negative is, in this priority order:

    1. the negative with the smallest ``d_an`` among those with ``d_an > d_ap`` (a semi-hard
       negative if one lies within the margin, else the nearest easy one);
    2. if no negative is farther than the positive, the negative with the largest ``d_an``.

    This is exactly ``triplet_semihard_loss`` of TensorFlow, except that anchors without any
    negative are dropped (TensorFlow would compare against a zero distance there).

    Returns:
        ``(anchors, positives, negatives)`` int64 index tensors, pairs in row-major order.
    """
    pos, neg = label_masks(labels)
    pos = pos & neg.any(dim=1, keepdim=True)
    a, p = torch.nonzero(pos, as_tuple=True)
    if a.numel() == 0:
        return a, p, a.clone()
    d_ap = dist[a, p].unsqueeze(1)  # [P, 1]
    rows = dist[a]  # [P, B]
    neg_rows = neg[a]
    outside = neg_rows & (rows > d_ap)
    pos_inf = torch.finfo(dist.dtype).max
    neg_inf = torch.finfo(dist.dtype).min
    nearest_outside = torch.where(outside, rows, torch.full_like(rows, pos_inf)).argmin(dim=1)
    # the fallback depends on the anchor only: compute it once per row of dist
    farthest_neg = torch.where(neg, dist, torch.full_like(dist, neg_inf)).argmax(dim=1)
    n = torch.where(outside.any(dim=1), nearest_outside, farthest_neg[a])
    return a, p, n


@torch.no_grad()
def mine_all(labels: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Every valid triplet (a, p, n): ``y_a == y_p``, ``a != p``, ``y_n != y_a`` (batch-all)."""
    pos, neg = label_masks(labels)
    return torch.nonzero(pos.unsqueeze(2) & neg.unsqueeze(1), as_tuple=True)


@register_loss("triplet")
class TripletLoss(nn.Module):
    """Triplet loss (two-head paper Eq. 5) on squared Euclidean distances.

    ``L = reduce_t [D(a_t, p_t) - D(a_t, n_t) + m]_+`` over mined triplets t, or with
    ``soft_margin=True`` ``softplus(D(a, p) - D(a, n))`` (Hermans et al. soft margin, used by
    the two-head paper with hard mining). ``D`` is the squared Euclidean distance, computed on
    l2-normalised embeddings when ``normalize=True``.

    Args:
        margin: hinge margin m (default 0.2, FaceNet / two-head paper); ignored when
            ``soft_margin`` is True.
        mining: ``"semihard"`` (default; FaceNet/TF rule, see :func:`mine_semihard`),
            ``"hard"`` (batch-hard, :func:`mine_batch_hard`) or ``"all"`` (every valid triplet).
        soft_margin: use ``softplus(d_ap - d_an)`` instead of the hinge (default False; the
            two-head paper uses True with ``mining="hard"``).
        normalize: l2-normalise embeddings before the distances (default True).
        reduction: ``"mean"`` (over mined triplets, including zero-loss ones),
            ``"mean_nonzero"`` (over triplets with loss > 0, Hermans et al. "batch all" and
            pytorch-metric-learning's default) or ``"sum"``. Default None means ``"mean"`` for
            hard / semihard (as in the paper and TensorFlow) and ``"mean_nonzero"`` for all.

    Batches without any valid triplet (one class only, one sample per class) return a zero
    that is still connected to the graph.
    """

    #: the loss of a sample depends on the other samples of the batch: under DDP it sees every
    #: rank's embeddings (``deepmetric.train.module.TrainingModule``)
    pair_based = True

    def __init__(
        self,
        margin: float = 0.2,
        mining: str = "semihard",
        soft_margin: bool = False,
        normalize: bool = True,
        reduction: str | None = None,
    ) -> None:
        super().__init__()
        if mining not in MINING_MODES:
            raise ValueError(f"TripletLoss: mining must be one of {MINING_MODES}, got {mining!r}")
        if reduction is None:
            reduction = "mean_nonzero" if mining == "all" else "mean"
        if reduction not in _REDUCTIONS:
            raise ValueError(f"TripletLoss: reduction must be one of {_REDUCTIONS}, got {reduction!r}")
        if margin < 0:
            raise ValueError(f"TripletLoss: margin must be >= 0, got {margin}")
        self.margin = float(margin)
        self.mining = mining
        self.soft_margin = bool(soft_margin)
        self.normalize = bool(normalize)
        self.reduction = reduction

    def extra_repr(self) -> str:
        return (
            f"margin={self.margin}, mining={self.mining!r}, soft_margin={self.soft_margin}, "
            f"normalize={self.normalize}, reduction={self.reduction!r}"
        )

    def distances(self, embeddings: torch.Tensor) -> torch.Tensor:
        """The [B, B] squared Euclidean distance matrix the loss mines on (float32)."""
        x = upcast_normalized(embeddings, self.normalize)
        return pairwise_squared_euclidean(x)

    def _per_triplet(self, d_ap: torch.Tensor, d_an: torch.Tensor) -> torch.Tensor:
        if self.soft_margin:
            return F.softplus(d_ap - d_an)
        return F.relu(d_ap - d_an + self.margin)

    def _reduce(self, losses: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
        if losses.numel() == 0:
            return zero_loss(embeddings)
        if self.reduction == "sum":
            return losses.sum()
        if self.reduction == "mean":
            return losses.mean()
        count = (losses > 0).sum()
        # all-zero losses: sum is 0 and still carries the graph
        return losses.sum() / count.clamp_min(1).to(losses.dtype)

    def _batch_all(self, dist: torch.Tensor, labels: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
        # one row per positive pair (a, p) against every sample: O(P * B) memory instead of
        # a dense B^3 cube; non-negative columns are masked out by a multiplication
        pos, neg = label_masks(labels)
        a, p = torch.nonzero(pos, as_tuple=True)
        if a.numel() == 0:
            return zero_loss(embeddings)
        mask = neg[a]
        num_triplets = int(mask.sum())
        if num_triplets == 0:
            return zero_loss(embeddings)
        losses = self._per_triplet(dist[a, p].unsqueeze(1), dist[a]) * mask.to(dist.dtype)
        total = losses.sum()
        if self.reduction == "sum":
            return total
        if self.reduction == "mean":
            return total / num_triplets
        return total / (losses > 0).sum().clamp_min(1).to(dist.dtype)

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        check_embeddings_labels(embeddings, labels, "TripletLoss")
        with no_autocast(embeddings.device):
            dist = self.distances(embeddings)
            if self.mining == "all":
                return self._batch_all(dist, labels, embeddings)
            else:
                miner = mine_batch_hard if self.mining == "hard" else mine_semihard
                a, p, n = miner(dist.detach(), labels)
                losses = self._per_triplet(dist[a, p], dist[a, n])
            return self._reduce(losses, embeddings)
