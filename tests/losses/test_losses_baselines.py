"""Baseline losses, centre loss, CE and the registry against plain-loop references.

Each reference below is the paper's formula written with python loops over samples/pairs;
pytorch-metric-learning 2.9 is used as extra evidence where its definition coincides.
Also: finite values and gradients on degenerate batches, and bf16 autocast without NaN.
"""
import math

import numpy as np
import pytest
import torch
from degenerate import NUM_CLASSES, degenerate_batches

from deepmetric.losses import (
    CenterLoss,
    ContrastiveLoss,
    CrossEntropyLoss,
    LiftedStructureLoss,
    NPairLoss,
    ProxyNCALoss,
    TripletLoss,
    build_loss,
    list_losses,
    loss_class,
)


def normed(x):
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def dist(u, v):
    return math.sqrt(sum((a - b) ** 2 for a, b in zip(u, v)))


def pk(p, k, rng):
    return rng.permutation(np.repeat(np.arange(p), k))


# ---------------------------------------------------------------- contrastive


@pytest.mark.parametrize("reduction", ["mean", "sum", "mean_nonzero"])
def test_contrastive_matches_hadsell_formula(rng, reduction):
    y = rng.integers(0, 3, size=10)
    x = rng.normal(size=(10, 4))
    xn = normed(x)
    vals = []
    for i in range(10):
        for j in range(i + 1, 10):
            d = dist(xn[i], xn[j])
            vals.append(0.5 * d * d if y[i] == y[j] else 0.5 * max(0.0, 1.2 - d) ** 2)
    ref = {"mean": np.mean(vals), "sum": np.sum(vals), "mean_nonzero": np.sum(vals) / sum(v > 0 for v in vals)}
    loss = ContrastiveLoss(margin=1.2, reduction=reduction)(torch.tensor(x), torch.tensor(y))
    assert loss.item() == pytest.approx(ref[reduction], rel=1e-6)


# ---------------------------------------------------------------- N-pair


def npair_reference(x, y, l2_reg):
    pairs = []
    for c in sorted(set(y.tolist())):
        idx = [i for i in range(len(y)) if y[i] == c]
        if len(idx) >= 2:
            pairs.append((idx[0], idx[1]))
    a = [x[i] for i, _ in pairs]
    p = [x[j] for _, j in pairs]
    n = len(pairs)
    total = 0.0
    for i in range(n):
        s = sum(math.exp(np.dot(a[i], p[j]) - np.dot(a[i], p[i])) for j in range(n) if j != i)
        total += math.log1p(s)
    reg = np.mean([np.dot(v, v) for v in a]) + np.mean([np.dot(v, v) for v in p])
    return total / n + 0.25 * l2_reg * reg


def test_npair_matches_sohn_formula_with_regulariser(rng):
    y = rng.integers(0, 6, size=20)  # uneven class sizes, some singletons possible
    x = rng.normal(size=(20, 5)) * 0.7
    for l2 in (0.002, 0.0, 0.5):
        loss = NPairLoss(l2_reg=l2)(torch.tensor(x), torch.tensor(y))
        assert loss.item() == pytest.approx(npair_reference(x, y, l2), rel=1e-6)


def test_npair_agrees_with_pml(rng):
    pml = pytest.importorskip("pytorch_metric_learning.losses")
    from pytorch_metric_learning.distances import DotProductSimilarity

    y = torch.tensor(pk(8, 4, rng))
    x = torch.tensor(rng.normal(size=(32, 8)))
    ref = pml.NPairsLoss(distance=DotProductSimilarity(normalize_embeddings=False))(x, y)
    assert NPairLoss(l2_reg=0.0)(x, y).item() == pytest.approx(ref.item(), rel=1e-6)


# ---------------------------------------------------------------- lifted structure


def lifted_reference(x, y, margin):
    n = len(y)
    total, count = 0.0, 0
    for i in range(n):
        for j in range(i + 1, n):
            if y[i] != y[j]:
                continue
            s = sum(math.exp(margin - dist(x[i], x[k])) for k in range(n) if y[k] != y[i])
            s += sum(math.exp(margin - dist(x[j], x[l])) for l in range(n) if y[l] != y[j])
            jij = math.log(s) + dist(x[i], x[j])
            total += max(0.0, jij) ** 2
            count += 1
    return total / (2 * count)


def test_lifted_matches_song_formula(rng):
    y = rng.integers(0, 4, size=12)
    x = rng.normal(size=(12, 3))
    loss = LiftedStructureLoss(margin=1.0)(torch.tensor(x), torch.tensor(y))
    assert loss.item() == pytest.approx(lifted_reference(x, y, 1.0), rel=1e-6)
    loss_n = LiftedStructureLoss(margin=0.5, normalize=True)(torch.tensor(x), torch.tensor(y))
    assert loss_n.item() == pytest.approx(lifted_reference(normed(x), y, 0.5), rel=1e-6)


def test_lifted_large_distances_do_not_overflow():
    x = torch.tensor([[0.0, 0.0], [0.0, 1.0], [500.0, 0.0], [500.0, 1.0]], requires_grad=True)
    y = torch.tensor([0, 0, 1, 1])
    loss = LiftedStructureLoss()(x, y)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(x.grad).all()


def test_lifted_agrees_with_pml(rng):
    pml = pytest.importorskip("pytorch_metric_learning.losses")
    y = torch.tensor(pk(6, 4, rng))
    x = torch.tensor(rng.normal(size=(24, 8)))
    ref = pml.LiftedStructureLoss(neg_margin=1.0, pos_margin=0.0)(x, y)
    assert LiftedStructureLoss(margin=1.0, normalize=True)(x, y).item() == pytest.approx(ref.item(), rel=1e-6)


# ---------------------------------------------------------------- ProxyNCA


def proxy_nca_reference(x, y, proxies, sx, sp, exclude_positive):
    xs, ps = sx * normed(x), sp * normed(proxies)
    total = 0.0
    for i in range(len(y)):
        d = [dist(xs[i], ps[c]) ** 2 for c in range(len(ps))]
        denom = sum(math.exp(-d[c]) for c in range(len(ps)) if not (exclude_positive and c == y[i]))
        total += -math.log(math.exp(-d[y[i]]) / denom)
    return total / len(y)


@pytest.mark.parametrize("exclude_positive", [True, False])
def test_proxy_nca_matches_formula(rng, exclude_positive):
    y = rng.integers(0, 5, size=9)
    x = rng.normal(size=(9, 4))
    loss = ProxyNCALoss(5, 4, scale_x=3.0, scale_p=2.0, exclude_positive=exclude_positive).double()
    proxies = loss.proxies.detach().numpy()
    ref = proxy_nca_reference(x, y, proxies, 3.0, 2.0, exclude_positive)
    assert loss(torch.tensor(x), torch.tensor(y)).item() == pytest.approx(ref, rel=1e-6)
    logits = loss.logits(torch.tensor(x)).detach().numpy()
    xs, ps = 3.0 * normed(x), 2.0 * normed(proxies)
    np.testing.assert_allclose(logits[2, 1], -dist(xs[2], ps[1]) ** 2, rtol=1e-6)


def test_proxy_nca_agrees_with_pml_and_trains_proxies(rng):
    pml = pytest.importorskip("pytorch_metric_learning.losses")
    y = torch.tensor(rng.integers(0, 6, size=16))
    x = torch.tensor(rng.normal(size=(16, 8)))
    ours = ProxyNCALoss(6, 8, exclude_positive=False).double()
    ref = pml.ProxyNCALoss(num_classes=6, embedding_size=8).double()
    with torch.no_grad():
        ref.proxies.copy_(ours.proxies)
    assert ours(x, y).item() == pytest.approx(ref(x, y).item(), rel=1e-6)
    ours(x, y).backward()
    assert ours.proxies.grad is not None and ours.proxies.grad.abs().sum() > 0
    assert "proxies" in ours.state_dict()


# ---------------------------------------------------------------- centre loss


def test_center_loss_value_and_wen_update(rng):
    torch.manual_seed(0)
    loss = CenterLoss(num_classes=4, embedding_dim=3, rate=0.5).double()
    c0 = loss.centers.clone().numpy()
    y = np.array([0, 0, 2, 2, 2, 1])
    x = rng.normal(size=(6, 3))
    value = loss(torch.tensor(x), torch.tensor(y))
    ref = sum(0.5 * np.sum((x[i] - c0[y[i]]) ** 2) for i in range(6)) / 6
    assert value.item() == pytest.approx(ref, rel=1e-10)
    expected = c0.copy()
    for j in range(4):
        members = [i for i in range(6) if y[i] == j]
        delta = sum((c0[j] - x[i] for i in members), np.zeros(3)) / (1 + len(members))
        expected[j] = c0[j] - 0.5 * delta
    np.testing.assert_allclose(loss.centers.numpy(), expected, rtol=1e-12)
    np.testing.assert_array_equal(loss.centers.numpy()[3], c0[3])  # absent class does not move
    # gradient w.r.t. x is (x - c_y)/B with the centres used for the value (before the update)
    xt = torch.tensor(x, requires_grad=True)
    loss.eval()
    before = loss.centers.clone()
    loss(xt, torch.tensor(y)).backward()
    np.testing.assert_allclose(xt.grad.numpy(), (x - before.numpy()[y]) / 6, rtol=1e-10)
    assert torch.equal(loss.centers, before)  # eval: no update
    assert "centers" in loss.state_dict() and not list(loss.parameters())


def test_center_loss_sum_reduction_and_errors(rng):
    loss = CenterLoss(3, 2, reduction="sum").eval()
    x = torch.randn(4, 2)
    y = torch.tensor([0, 1, 2, 0])
    ref = 0.5 * ((x - loss.centers[y]) ** 2).sum()
    assert loss(x, y).item() == pytest.approx(ref.item(), rel=1e-6)
    with pytest.raises(ValueError, match="labels must lie in"):
        loss(x, torch.tensor([0, 1, 3, 0]))
    with pytest.raises(ValueError, match="embedding_dim"):
        loss(torch.randn(4, 5), y)


# ---------------------------------------------------------------- cross-entropy


def test_cross_entropy_matches_log_softmax_formula(rng):
    logits = rng.normal(size=(5, 4))
    y = np.array([0, 3, 1, 1, 2])
    ref = np.mean([-(logits[i, y[i]] - math.log(np.exp(logits[i]).sum())) for i in range(5)])
    out = CrossEntropyLoss()(torch.tensor(logits), torch.tensor(y))
    assert out.item() == pytest.approx(ref, rel=1e-6)
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        CrossEntropyLoss()(torch.tensor(logits), torch.tensor([0, 4, 1, 1, 2]))


# ---------------------------------------------------------------- registry


def test_registry_names_and_errors():
    assert list_losses() == [
        "almn", "center", "contrastive", "cross_entropy", "heated_softmax", "lifted", "npair", "pml", "proxy_nca",
        "similarity_distillation", "triplet",
    ]
    assert loss_class("lifted") is LiftedStructureLoss
    assert loss_class("heated_softmax").__name__ == "HeatedSoftmaxLoss"
    assert loss_class("almn").__name__ == "ALMNLoss"
    built = build_loss("triplet", mining="hard", soft_margin=True)
    assert isinstance(built, TripletLoss) and built.mining == "hard" and built.soft_margin
    with pytest.raises(ValueError, match="unknown loss 'arcface'"):
        build_loss("arcface")
    # only the unknown option is named, with the closest valid one
    with pytest.raises(TypeError, match=r"build_loss\('contrastive'\): unknown option 'margn' \(did you mean 'margin'\?\)$"):
        build_loss("contrastive", margn=1.0)
    with pytest.raises(TypeError, match=r"unknown option 'zzz'; accepted: .*margin"):
        build_loss("contrastive", margin=1.0, zzz=1)


# ---------------------------------------------------------------- degenerate batches, autocast

FACTORIES = {
    "triplet_semihard": lambda c, d: TripletLoss(mining="semihard"),
    "triplet_hard_soft": lambda c, d: TripletLoss(mining="hard", soft_margin=True),
    "triplet_all": lambda c, d: TripletLoss(mining="all"),
    "center": lambda c, d: CenterLoss(c, d),
    "contrastive": lambda c, d: ContrastiveLoss(),
    "npair": lambda c, d: NPairLoss(),
    "npair_normalized": lambda c, d: NPairLoss(normalize=True),
    "lifted": lambda c, d: LiftedStructureLoss(),
    "lifted_normalized": lambda c, d: LiftedStructureLoss(normalize=True),
    "proxy_nca": lambda c, d: ProxyNCALoss(c, d),
    "proxy_nca_incl": lambda c, d: ProxyNCALoss(c, d, exclude_positive=False),
}

DEGENERATE = {name: (x, y) for name, x, y in degenerate_batches(dim=4)}


@pytest.mark.parametrize("case", list(DEGENERATE))
@pytest.mark.parametrize("name", list(FACTORIES))
def test_degenerate_batches_give_finite_values_and_grads(name, case):
    x0, y = DEGENERATE[case]
    loss = FACTORIES[name](NUM_CLASSES, 4)
    x = x0.clone().requires_grad_(True)
    value = loss(x, y)
    assert value.dim() == 0 and torch.isfinite(value), value
    value.backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    for p in loss.parameters():
        assert p.grad is None or torch.isfinite(p.grad).all()
    for b in loss.buffers():
        assert torch.isfinite(b).all()


def test_no_valid_pairs_give_exact_zero():
    x = torch.randn(5, 3, requires_grad=True)
    one_per_class = torch.arange(5)
    for loss in (TripletLoss(mining="semihard"), TripletLoss(mining="hard"), LiftedStructureLoss(), NPairLoss()):
        v = loss(x, one_per_class)
        assert v.item() == 0.0
        v.backward()
    assert torch.equal(x.grad, torch.zeros_like(x))


@pytest.mark.parametrize("name", list(FACTORIES))
def test_bf16_autocast_no_nan_and_float32_result(name):
    g = torch.Generator().manual_seed(0)
    layer = torch.nn.Linear(16, 8)
    inputs = torch.randn(24, 16, generator=g)
    y = torch.arange(6).repeat_interleave(4)
    loss = FACTORIES[name](6, 8)
    if name == "center":
        loss.eval()  # compare two evaluations on the same centres
    with torch.autocast("cpu", dtype=torch.bfloat16):
        emb = layer(inputs)
        assert emb.dtype == torch.bfloat16
        value = loss(emb, y)
    assert value.dtype == torch.float32 and torch.isfinite(value)
    value.backward()
    assert all(torch.isfinite(p.grad).all() for p in layer.parameters())
    # internals in float32: equals the float32 loss on the same bf16-rounded embeddings
    ref = loss(emb.detach().float(), y)
    assert value.item() == pytest.approx(ref.item(), rel=1e-5, abs=1e-6)
