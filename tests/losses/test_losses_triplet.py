"""TripletLoss and its miners against brute-force references written with python loops.

References used here:
- distances: sum of squared coordinate differences, loop over pairs;
- batch-hard (Hermans et al. 2017): per anchor, loop over the batch for the farthest
  positive / nearest negative (first index wins a tie);
- semi-hard: the FaceNet / TF rule of REFERENCE.md section 3, loop per (anchor, positive);
- the loss of TensorFlow's ``triplet_semihard_loss`` ported line by line to numpy
  (masked_minimum / masked_maximum) as a second, independent formulation;
- pytorch-metric-learning 2.9 where its definition coincides (extra evidence only).
"""
import itertools
import math

import numpy as np
import pytest
import torch

from deepmetric.losses import TripletLoss, mine_all, mine_batch_hard, mine_semihard
from deepmetric.losses.distances import (
    pairwise_euclidean,
    pairwise_squared_euclidean,
    safe_sqrt,
)

# ---------------------------------------------------------------- references


def brute_sq_dist(x):
    x = np.asarray(x, dtype=np.float64)
    n = len(x)
    d = np.zeros((n, n))
    for i in range(n):
        for j in range(n):
            d[i, j] = sum((x[i, k] - x[j, k]) ** 2 for k in range(x.shape[1]))
    return d


def brute_batch_hard(d, y):
    out = []
    n = len(y)
    for a in range(n):
        best_p, best_n = None, None
        for j in range(n):
            if j != a and y[j] == y[a] and (best_p is None or d[a][j] > d[a][best_p]):
                best_p = j
            if y[j] != y[a] and (best_n is None or d[a][j] < d[a][best_n]):
                best_n = j
        if best_p is not None and best_n is not None:
            out.append((a, best_p, best_n))
    return out


def brute_semihard(d, y):
    out = []
    n = len(y)
    for a in range(n):
        negs = [k for k in range(n) if y[k] != y[a]]
        if not negs:
            continue
        for p in range(n):
            if p == a or y[p] != y[a]:
                continue
            farther = [k for k in negs if d[a][k] > d[a][p]]
            if farther:
                chosen = farther[0]
                for k in farther:
                    if d[a][k] < d[a][chosen]:
                        chosen = k
            else:
                chosen = negs[0]
                for k in negs:
                    if d[a][k] > d[a][chosen]:
                        chosen = k
            out.append((a, p, chosen))
    return out


def tf_semihard_loss_numpy(y, x, margin):
    """Line-by-line numpy port of tf.contrib triplet_semihard_loss (normalised inputs)."""
    x = x / np.linalg.norm(x, axis=1, keepdims=True)
    sq = (x * x).sum(1)
    pdist = np.maximum(sq[:, None] + sq[None, :] - 2 * x @ x.T, 0.0)
    pdist = pdist * (1 - np.eye(len(y)))
    adjacency = y[:, None] == y[None, :]
    adjacency_not = ~adjacency
    b = len(y)

    def masked_maximum(data, mask):
        axis_minimums = data.min(1, keepdims=True)
        return ((data - axis_minimums) * mask).max(1, keepdims=True) + axis_minimums

    def masked_minimum(data, mask):
        axis_maximums = data.max(1, keepdims=True)
        return ((data - axis_maximums) * mask).min(1, keepdims=True) + axis_maximums

    pdist_tile = np.tile(pdist, (b, 1))
    mask = np.tile(adjacency_not, (b, 1)) & (pdist_tile > pdist.T.reshape(-1, 1))
    mask_final = (mask.sum(1, keepdims=True) > 0).reshape(b, b).T
    neg_outside = masked_minimum(pdist_tile, mask).reshape(b, b).T
    neg_inside = np.tile(masked_maximum(pdist, adjacency_not), (1, b))
    semi_hard = np.where(mask_final, neg_outside, neg_inside)
    loss_mat = margin + pdist - semi_hard
    mask_pos = adjacency.astype(float) - np.eye(b)
    return np.maximum(loss_mat * mask_pos, 0).sum() / mask_pos.sum()


def pk_labels(p, k, rng):
    y = np.repeat(np.arange(p), k)
    return rng.permutation(y)


def as_triplets(t):
    return sorted(zip(*(v.tolist() for v in t)))


# ---------------------------------------------------------------- distances


def test_pairwise_distances_match_brute_force(rng):
    x = rng.normal(size=(9, 5))
    d = pairwise_squared_euclidean(torch.tensor(x, dtype=torch.float64)).numpy()
    np.testing.assert_allclose(d, brute_sq_dist(x), rtol=1e-10, atol=1e-10)
    y = rng.normal(size=(4, 5))
    dxy = pairwise_squared_euclidean(torch.tensor(x), torch.tensor(y)).numpy()
    ref = np.array([[((a - b) ** 2).sum() for b in y] for a in x])
    np.testing.assert_allclose(dxy, ref, rtol=1e-10)
    e = pairwise_euclidean(torch.tensor(x)).numpy()
    np.testing.assert_allclose(e, np.sqrt(brute_sq_dist(x)), rtol=1e-7, atol=1e-7)


def test_distances_nonnegative_zero_diagonal_and_safe_sqrt_grad():
    x = torch.full((5, 3), 0.7, requires_grad=True)  # identical rows: rounding would go < 0
    d = pairwise_squared_euclidean(x)
    assert torch.all(d >= 0) and torch.all(torch.diagonal(d) == 0)
    e = pairwise_euclidean(x)
    e.sum().backward()
    assert torch.isfinite(x.grad).all()
    z = torch.zeros(3, requires_grad=True)
    safe_sqrt(z).sum().backward()
    assert torch.equal(z.grad, torch.zeros(3))


# ---------------------------------------------------------------- miners


@pytest.mark.parametrize("seed", range(6))
def test_batch_hard_selection_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 5, size=14) if seed % 2 else pk_labels(4, 3, rng)
    x = rng.normal(size=(len(y), 4))
    d = pairwise_squared_euclidean(torch.tensor(x))
    got = as_triplets(mine_batch_hard(d, torch.tensor(y)))
    assert got == sorted(brute_batch_hard(d.tolist(), y.tolist()))


@pytest.mark.parametrize("seed", range(6))
def test_semihard_selection_matches_brute_force(seed):
    rng = np.random.default_rng(100 + seed)
    y = rng.integers(0, 4, size=15) if seed % 2 else pk_labels(5, 3, rng)
    x = rng.normal(size=(len(y), 3))
    d = pairwise_squared_euclidean(torch.tensor(x))
    got = as_triplets(mine_semihard(d, torch.tensor(y)))
    assert got == sorted(brute_semihard(d.tolist(), y.tolist()))


@pytest.mark.parametrize("seed", range(4))
def test_miners_break_ties_like_brute_force(seed):
    # integer distances in {0..3}: many exact ties, d_an == d_ap included
    rng = np.random.default_rng(200 + seed)
    n = 12
    m = rng.integers(0, 4, size=(n, n)).astype(np.float64)
    d = np.triu(m, 1)
    d = d + d.T
    y = pk_labels(4, 3, rng)
    dt = torch.tensor(d)
    assert as_triplets(mine_semihard(dt, torch.tensor(y))) == sorted(brute_semihard(d.tolist(), y.tolist()))
    assert as_triplets(mine_batch_hard(dt, torch.tensor(y))) == sorted(brute_batch_hard(d.tolist(), y.tolist()))


def test_semihard_fallback_when_no_negative_is_farther():
    # class 0 spread far apart, class 1 sits between: every negative is closer than the positive
    x = torch.tensor([[-1.0, 0.0], [1.0, 0.0], [0.0, 0.1], [0.0, -0.3]], dtype=torch.float64)
    y = torch.tensor([0, 0, 1, 1])
    d = pairwise_squared_euclidean(x)
    a, p, n = mine_semihard(d, y)
    trip = as_triplets((a, p, n))
    assert trip == sorted(brute_semihard(d.tolist(), y.tolist()))
    # anchor 0, positive 1 (d=4): no negative beyond, so the farthest negative (index 3)
    assert (0, 1, 3) in trip
    # anchor 2 (class 1), positive 3 (d=0.16): negatives 0,1 are farther, nearest of those is 0
    assert (2, 3, 0) in trip


def test_semihard_prefers_semihard_then_easy():
    # anchor 0 at origin, positive at distance^2 1; negatives at 1.1 (semi-hard), 5 (easy), 0.5 (hard)
    d = torch.tensor(
        [
            [0.0, 1.0, 1.1, 5.0, 0.5],
            [1.0, 0.0, 3.0, 3.0, 3.0],
            [1.1, 3.0, 0.0, 9.0, 9.0],
            [5.0, 3.0, 9.0, 0.0, 9.0],
            [0.5, 3.0, 9.0, 9.0, 0.0],
        ],
        dtype=torch.float64,
    )
    y = torch.tensor([0, 0, 1, 2, 3])
    trip = as_triplets(mine_semihard(d, y))
    assert (0, 1, 2) in trip  # semi-hard 1.1 beats easy 5 and hard 0.5
    d2 = d.clone()
    d2[0, 2] = d2[2, 0] = 0.2  # no semi-hard any more: nearest easy one (index 3)
    assert (0, 1, 3) in as_triplets(mine_semihard(d2, y))


def test_mine_all_counts_every_valid_triplet(rng):
    y = rng.integers(0, 3, size=10)
    got = as_triplets(mine_all(torch.tensor(y)))
    ref = [
        (a, p, n)
        for a, p, n in itertools.product(range(10), repeat=3)
        if a != p and y[a] == y[p] and y[n] != y[a]
    ]
    assert got == sorted(ref)


# ---------------------------------------------------------------- loss values


def _normed_sq_dist(x):
    xn = x / np.linalg.norm(x, axis=1, keepdims=True)
    return brute_sq_dist(xn)


@pytest.mark.parametrize("soft", [False, True])
def test_batch_hard_loss_value(rng, soft):
    y = pk_labels(4, 4, rng)
    x = rng.normal(size=(16, 6))
    d = _normed_sq_dist(x)
    terms = []
    for a, p, n in brute_batch_hard(d.tolist(), y.tolist()):
        v = d[a, p] - d[a, n]
        terms.append(math.log1p(math.exp(v)) if soft else max(0.0, v + 0.3))
    loss = TripletLoss(margin=0.3, mining="hard", soft_margin=soft)(torch.tensor(x), torch.tensor(y))
    assert loss.item() == pytest.approx(sum(terms) / len(terms), rel=1e-6)


def test_semihard_loss_value_matches_loops_and_tensorflow_port(rng):
    for _ in range(3):
        y = pk_labels(6, 3, rng)
        x = rng.normal(size=(18, 4))
        d = _normed_sq_dist(x)
        trip = brute_semihard(d.tolist(), y.tolist())
        ref = sum(max(0.0, d[a, p] - d[a, n] + 0.2) for a, p, n in trip) / len(trip)
        loss = TripletLoss(margin=0.2, mining="semihard")(torch.tensor(x), torch.tensor(y)).item()
        assert loss == pytest.approx(ref, rel=1e-6)
        assert loss == pytest.approx(tf_semihard_loss_numpy(y, x, 0.2), rel=1e-6)


@pytest.mark.parametrize("reduction", ["mean", "mean_nonzero", "sum"])
def test_batch_all_loss_value(rng, reduction):
    y = rng.integers(0, 3, size=9)
    x = rng.normal(size=(9, 3))
    d = _normed_sq_dist(x)
    vals = [
        max(0.0, d[a, p] - d[a, n] + 0.5)
        for a, p, n in itertools.product(range(9), repeat=3)
        if a != p and y[a] == y[p] and y[n] != y[a]
    ]
    ref = {
        "mean": sum(vals) / len(vals),
        "mean_nonzero": sum(vals) / max(1, sum(v > 0 for v in vals)),
        "sum": sum(vals),
    }[reduction]
    loss = TripletLoss(margin=0.5, mining="all", reduction=reduction)(torch.tensor(x), torch.tensor(y))
    assert loss.item() == pytest.approx(ref, rel=1e-6)


def test_unnormalized_option_uses_raw_distances(rng):
    y = pk_labels(3, 3, rng)
    x = rng.normal(size=(9, 4)) * 3
    d = brute_sq_dist(x)
    trip = brute_batch_hard(d.tolist(), y.tolist())
    ref = sum(max(0.0, d[a, p] - d[a, n] + 0.2) for a, p, n in trip) / len(trip)
    loss = TripletLoss(mining="hard", normalize=False)(torch.tensor(x), torch.tensor(y))
    assert loss.item() == pytest.approx(ref, rel=1e-6)


def test_gradient_flows_only_through_selected_triplet():
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.2], [-1.0, 0.0]], requires_grad=True)
    y = torch.tensor([0, 0, 1, 2])
    TripletLoss(mining="hard", margin=1.0)(x, y).backward()
    # negative 3 is never the nearest negative of anything with a positive
    assert torch.equal(x.grad[3], torch.zeros(2))
    assert x.grad[0].abs().sum() > 0


# ---------------------------------------------------------------- pytorch-metric-learning


def test_agrees_with_pml_batch_hard_and_batch_all(rng):
    pml_losses = pytest.importorskip("pytorch_metric_learning.losses")
    from pytorch_metric_learning.distances import LpDistance
    from pytorch_metric_learning.miners import BatchHardMiner
    from pytorch_metric_learning.reducers import MeanReducer

    y = torch.tensor(pk_labels(8, 4, rng))
    x = torch.tensor(rng.normal(size=(32, 16)), dtype=torch.float64)
    dist = LpDistance(power=2)
    for soft in (False, True):
        margin = 0.0 if soft else 0.2
        ref = pml_losses.TripletMarginLoss(margin=margin, distance=dist, reducer=MeanReducer(), smooth_loss=soft)
        ref_val = ref(x, y, BatchHardMiner(distance=dist)(x, y))
        ours = TripletLoss(margin=margin, mining="hard", soft_margin=soft)(x, y)
        assert ours.item() == pytest.approx(ref_val.item(), rel=1e-6)
    ref_all = pml_losses.TripletMarginLoss(margin=0.2, distance=dist)(x, y)  # all triplets, avg non-zero
    assert TripletLoss(margin=0.2, mining="all")(x, y).item() == pytest.approx(ref_all.item(), rel=1e-6)


# ---------------------------------------------------------------- options and errors


def test_bad_options_and_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="mining"):
        TripletLoss(mining="hardest")
    with pytest.raises(ValueError, match="reduction"):
        TripletLoss(reduction="avg")
    loss = TripletLoss()
    with pytest.raises(ValueError, match="shape"):
        loss(torch.randn(4, 3), torch.tensor([0, 1, 0]))
    with pytest.raises(TypeError, match="integer"):
        loss(torch.randn(4, 3), torch.tensor([0.0, 1.0, 0.0, 1.0]))
    with pytest.raises(ValueError, match=r"\[batch, dim\]"):
        loss(torch.randn(4), torch.tensor([0, 1, 0, 1]))


def test_distance_gradients_match_finite_differences():
    # the self-distance path uses a custom Gram backward; check it (and double backward)
    x = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(pairwise_squared_euclidean, (x,))
    assert torch.autograd.gradgradcheck(pairwise_squared_euclidean, (x,))
    loss = TripletLoss(mining="all", margin=1.0).double()
    y = torch.tensor([0, 0, 1, 1, 2, 2])
    assert torch.autograd.gradcheck(lambda e: loss(e, y), (x,))
