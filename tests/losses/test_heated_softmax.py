"""HeatedSoftmaxLoss against the heated-up softmax paper (Eq. 1-4, Properties 1-3).

References are written independently in numpy: softmax of alpha * z (Eq. 1), the
cross-entropy gradients of Eq. 3 and 4, and the Jacobian of the l2 normalisation (Eq. 11).
"""
import math

import numpy as np
import pytest
import torch
from degenerate import NUM_CLASSES, degenerate_batches
import torch.nn.functional as F

from deepmetric.losses.heated_softmax import HeatedSoftmaxLoss


def unit_rows(a):
    return a / np.linalg.norm(a, axis=1, keepdims=True)


def softmax(z):
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def one_hot(y, c):
    q = np.zeros((len(y), c))
    q[np.arange(len(y)), y] = 1.0
    return q


def make_loss(c, k, w, b=None, **kw):
    loss = HeatedSoftmaxLoss(c, k, bias=b is not None, **kw).double()
    with torch.no_grad():
        loss.weight.copy_(torch.from_numpy(w))
        if b is not None:
            loss.bias.copy_(torch.from_numpy(b))
    return loss


def grads(loss, f, y):
    """Gradients of the *summed* cross-entropy w.r.t. the embeddings and the raw weight."""
    ft = torch.from_numpy(f).requires_grad_(True)
    out = loss(ft, torch.from_numpy(y)) * len(y)   # the module averages over the batch
    gf, gw = torch.autograd.grad(out, [ft, loss.weight])
    return gf.numpy(), gw.numpy()


# ----------------------------------------------------------------------------- Eq. 1 / 2
@pytest.mark.parametrize("alpha_scales_bias", [True, False])
def test_logits_and_loss_match_eq1_eq2(rng, alpha_scales_bias):
    c, k, n, alpha = 7, 5, 9, 16.0
    w, b = rng.normal(size=(c, k)), rng.normal(size=c)
    f = unit_rows(rng.normal(size=(n, k)))
    y = rng.integers(0, c, n)
    loss = make_loss(c, k, w, b, alpha=alpha, alpha_scales_bias=alpha_scales_bias)
    z = f @ unit_rows(w).T
    ref_logits = alpha * (z + b) if alpha_scales_bias else alpha * z + b  # paper / TF code
    got = loss.logits(torch.from_numpy(f)).detach().numpy()
    np.testing.assert_allclose(got, ref_logits, rtol=1e-12, atol=1e-12)
    p = softmax(ref_logits)
    ref_loss = -np.log(p[np.arange(n), y]).mean()
    assert loss(torch.from_numpy(f), torch.from_numpy(y)).item() == pytest.approx(ref_loss, rel=1e-12)


def test_normalize_features_option_l2_normalises(rng):
    c, k = 4, 6
    w = rng.normal(size=(c, k))
    f = rng.normal(size=(5, k)) * 3.0
    loss = make_loss(c, k, w, None, alpha=8.0, normalize_features=True)
    got = loss.logits(torch.from_numpy(f)).detach().numpy()
    np.testing.assert_allclose(got, 8.0 * unit_rows(f) @ unit_rows(w).T, rtol=1e-12)


# ----------------------------------------------------------------------------- Eq. 3 / 4
@pytest.mark.parametrize("alpha", [0.5, 4.0, 16.0, 64.0])
def test_autograd_equals_eq3_and_eq4_on_normalised_inputs(rng, alpha):
    """Unit-norm features and weights (features passed normalised, weights stored
    normalised with normalize_weights=False) so that autograd differentiates w.r.t. f_hat
    and w_hat directly."""
    c, k, n = 6, 8, 10
    w_hat = unit_rows(rng.normal(size=(c, k)))
    b = rng.normal(size=c) * 0.1
    f_hat = unit_rows(rng.normal(size=(n, k)))
    y = rng.integers(0, c, n)
    loss = make_loss(c, k, w_hat, b, alpha=alpha, normalize_weights=False)
    gf, gw = grads(loss, f_hat, y)
    d = alpha * (softmax(alpha * (f_hat @ w_hat.T + b)) - one_hot(y, c))   # Eq. 2: dl/dz_m
    np.testing.assert_allclose(gf, d @ w_hat, rtol=1e-10, atol=1e-12)       # Eq. 3
    np.testing.assert_allclose(gw, d.T @ f_hat, rtol=1e-10, atol=1e-12)     # Eq. 4 summed


def test_autograd_through_both_normalisations_equals_eq3_eq4_with_jacobian(rng):
    """Raw f and W, normalised inside: dl/df = J(f)^T Eq.3 with J = (I - f_hat f_hat^T)/||f||
    (Eq. 11-12); the same chain rule for the weights."""
    c, k, n, alpha = 5, 7, 6, 16.0
    w = rng.normal(size=(c, k)) * 2.0
    f = rng.normal(size=(n, k)) * 3.0
    y = rng.integers(0, c, n)
    loss = make_loss(c, k, w, None, alpha=alpha, normalize_features=True)
    gf, gw = grads(loss, f, y)
    fh, wh = unit_rows(f), unit_rows(w)
    d = alpha * (softmax(alpha * fh @ wh.T) - one_hot(y, c))
    g_fhat, g_what = d @ wh, d.T @ fh
    ref_f = np.stack([(np.eye(k) - np.outer(fh[i], fh[i])) @ g_fhat[i] / np.linalg.norm(f[i])
                      for i in range(n)])
    ref_w = np.stack([(np.eye(k) - np.outer(wh[m], wh[m])) @ g_what[m] / np.linalg.norm(w[m])
                      for m in range(c)])
    np.testing.assert_allclose(gf, ref_f, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(gw, ref_w, rtol=1e-10, atol=1e-12)


# ----------------------------------------------------------------------------- Properties
def _eq3_eq4_norms(loss, f_hat, y, alpha):
    loss.alpha = alpha
    gf, _ = grads(loss, f_hat[None], np.array([y]))
    # per-class weight gradients (Eq. 4 for a single sample): rows of d^T f
    ft = torch.from_numpy(f_hat[None]).requires_grad_(True)
    out = loss(ft, torch.tensor([y]))
    (gw,) = torch.autograd.grad(out, [loss.weight])
    return np.linalg.norm(gf), np.linalg.norm(gw.numpy(), axis=1)


def _setup_properties(rng):
    c, k = 5, 6
    w_hat = unit_rows(rng.normal(size=(c, k)))
    loss = make_loss(c, k, w_hat, None, alpha=1.0, normalize_weights=False)
    y = 0
    correct = unit_rows((w_hat[0] + 0.3 * rng.normal(size=k))[None])[0]
    incorrect = unit_rows((w_hat[2] + 0.1 * rng.normal(size=k))[None])[0]
    z_c, z_i = w_hat @ correct, w_hat @ incorrect
    assert z_c.argmax() == y and z_i.argmax() != y   # a "correct" and an "incorrect" sample
    return loss, y, correct, incorrect, int(z_i.argmax())


def test_property1_gradients_vanish_as_alpha_to_zero(rng):
    loss, y, correct, incorrect, _ = _setup_properties(rng)
    for f in (correct, incorrect):
        norms = [_eq3_eq4_norms(loss, f, y, a) for a in (1e-1, 1e-2, 1e-3, 1e-4)]
        gf = [g for g, _ in norms]
        gw = [g.max() for _, g in norms]
        assert all(a > b for a, b in zip(gf, gf[1:])) and gf[-1] < 1e-3
        assert all(a > b for a, b in zip(gw, gw[1:])) and gw[-1] < 1e-3
        # bounded by alpha * sum_m |p_m - q_m| <= 2 alpha (Eq. 6 argument)
        assert gf[-1] <= 2e-4 + 1e-15


def test_property2_feature_gradient_large_alpha(rng):
    loss, y, correct, incorrect, _ = _setup_properties(rng)
    alphas = [50.0, 100.0, 200.0, 400.0, 800.0]
    g_cor = [_eq3_eq4_norms(loss, correct, y, a)[0] for a in alphas]
    g_inc = [_eq3_eq4_norms(loss, incorrect, y, a)[0] for a in alphas]
    assert all(a > b for a, b in zip(g_cor, g_cor[1:])) and g_cor[-1] < 1e-6      # Eq. 7
    assert all(b > a for a, b in zip(g_inc, g_inc[1:])) and g_inc[-1] > 100.0      # Eq. 8


def test_property3_weight_gradient_large_alpha(rng):
    loss, y, correct, incorrect, top = _setup_properties(rng)
    alphas = [50.0, 200.0, 800.0]
    gw_cor = [_eq3_eq4_norms(loss, correct, y, a)[1] for a in alphas]
    assert gw_cor[-1].max() < 1e-6 and gw_cor[0].max() > gw_cor[-1].max()          # Eq. 9
    gw_inc = [_eq3_eq4_norms(loss, incorrect, y, a)[1] for a in alphas]
    hard = [y, top]                                                                  # Eq. 10
    others = [m for m in range(5) if m not in hard]
    for m in hard:
        assert gw_inc[0][m] < gw_inc[1][m] < gw_inc[2][m] and gw_inc[2][m] > 100.0
    assert max(gw_inc[2][m] for m in others) < 1e-6


# ----------------------------------------------------------------------------- alpha
def test_learnable_alpha_gets_the_analytic_gradient(rng):
    c, k, n = 4, 5, 7
    w, b = rng.normal(size=(c, k)), rng.normal(size=c) * 0.2
    f = unit_rows(rng.normal(size=(n, k)))
    y = rng.integers(0, c, n)
    loss = make_loss(c, k, w, b, alpha=8.0, learnable_alpha=True)
    assert isinstance(loss._alpha, torch.nn.Parameter)
    assert any(p is loss._alpha for p in loss.parameters())
    out = loss(torch.from_numpy(f), torch.from_numpy(y))
    out.backward()
    z = f @ unit_rows(w).T + b                   # alpha multiplies the whole z (Eq. 1)
    d_alpha = ((softmax(8.0 * z) - one_hot(y, c)) * z).sum(1).mean()
    assert loss._alpha.grad.item() == pytest.approx(d_alpha, rel=1e-10)


def test_fixed_alpha_is_not_a_parameter():
    loss = HeatedSoftmaxLoss(3, 4)
    names = {n for n, _ in loss.named_parameters()}
    assert names == {"weight", "bias"}
    assert "_alpha" in loss.state_dict()


@pytest.mark.parametrize("learnable", [False, True])
def test_alpha_setter_scale_alpha_and_state_dict(learnable):
    loss = HeatedSoftmaxLoss(3, 4, alpha=16.0, learnable_alpha=learnable)
    with torch.no_grad():
        loss._alpha.add_(5.0)                    # e.g. a learned value
    loss.scale_alpha(0.25)                       # heating-up multiplies the current value
    assert loss.alpha == pytest.approx(21.0 / 4)
    loss.alpha = 4
    assert loss.alpha == 4.0 and isinstance(loss.alpha, float)
    x = F.normalize(torch.randn(2, 4), dim=1)
    np.testing.assert_allclose(loss.logits(x).detach().numpy(),
                               4.0 * (x @ F.normalize(loss.weight.detach(), dim=1).t()).numpy(),
                               rtol=1e-6)
    fresh = HeatedSoftmaxLoss(3, 4, alpha=16.0, learnable_alpha=learnable)
    fresh.load_state_dict(loss.state_dict())
    assert fresh.alpha == 4.0
    with pytest.raises(ValueError, match="alpha"):
        loss.alpha = -1.0
    with pytest.raises(ValueError, match="alpha"):
        loss.alpha = float("nan")


# ----------------------------------------------------------------------------- init
def test_weight_init_variance_scaling_fan_in_truncated_normal():
    torch.manual_seed(0)
    k = 64
    loss = HeatedSoftmaxLoss(2000, k)
    w = loss.weight.detach().numpy().ravel()
    sigma = math.sqrt(1.3 * 2.0 / k)
    assert np.abs(w).max() <= 2 * sigma + 1e-6                  # truncated at 2 std
    # a normal truncated at +-2 sigma has std 0.8796 sigma; with TF's 1.3 factor this is
    # ~sqrt(2 / fan_in)
    assert w.std() == pytest.approx(0.87962566 * sigma, rel=0.02)
    assert abs(w.mean()) < 0.01
    assert torch.count_nonzero(loss.bias) == 0


def test_init_from_class_means(rng):
    c, k = 5, 4
    loss = HeatedSoftmaxLoss(c, k)
    before = loss.weight.detach().clone()
    emb = rng.normal(size=(30, k)).astype(np.float32)
    lab = rng.choice([0, 1, 3, 4], size=30)                   # class 2 absent
    lab[:4] = [0, 1, 3, 4]
    seen = loss.init_from_class_means(emb, lab)
    assert seen.tolist() == [True, True, False, True, True]
    for m in (0, 1, 3, 4):
        mean = emb[lab == m].mean(0)
        np.testing.assert_allclose(loss.weight[m].detach().numpy(), mean / np.linalg.norm(mean),
                                   rtol=1e-5, atol=1e-6)
    assert torch.equal(loss.weight[2], before[2])
    # with normalize_features the embeddings are normalised before averaging
    loss2 = HeatedSoftmaxLoss(c, k, normalize_features=True)
    loss2.init_from_class_means(torch.from_numpy(emb), torch.from_numpy(lab))
    mean = unit_rows(emb[lab == 0].astype(np.float64)).mean(0)
    np.testing.assert_allclose(loss2.weight[0].detach().numpy(), mean / np.linalg.norm(mean),
                               rtol=1e-5, atol=1e-6)


def test_sm_baseline_is_a_plain_linear_softmax(rng):
    loss = HeatedSoftmaxLoss.sm(6, 5)
    assert loss.alpha == 1.0 and not loss.normalize_weights and not loss.normalize_features
    x = torch.from_numpy(rng.normal(size=(8, 5)).astype(np.float32)) * 4
    y = torch.from_numpy(rng.integers(0, 6, 8))
    with torch.no_grad():
        loss.bias.normal_()
    ref = F.linear(x, loss.weight, loss.bias)
    torch.testing.assert_close(loss.logits(x), ref)
    torch.testing.assert_close(loss(x, y), F.cross_entropy(ref, y))


# ----------------------------------------------------------------------------- robustness
def _degenerate_batches():
    return degenerate_batches(dim=6)


@pytest.mark.parametrize("name,x,y", _degenerate_batches(), ids=lambda v: v if isinstance(v, str) else "")
@pytest.mark.parametrize("variant", ["ln", "sm", "learnable"])
def test_degenerate_batches_give_finite_loss_and_grads(name, x, y, variant):
    torch.manual_seed(0)
    if variant == "sm":
        loss = HeatedSoftmaxLoss.sm(NUM_CLASSES, 6)
    else:
        loss = HeatedSoftmaxLoss(NUM_CLASSES, 6, normalize_features=True, learnable_alpha=variant == "learnable")
    x = x.clone().requires_grad_(True)
    out = loss(x, y)
    out.backward()
    assert torch.isfinite(out)
    assert torch.isfinite(x.grad).all()
    for p in loss.parameters():
        assert p.grad is None or torch.isfinite(p.grad).all()


def test_autocast_bf16_cpu_no_nan(rng):
    loss = HeatedSoftmaxLoss(10, 16, normalize_features=True, learnable_alpha=True)
    x = torch.from_numpy(rng.normal(size=(12, 16)).astype(np.float32)).requires_grad_(True)
    y = torch.from_numpy(rng.integers(0, 10, 12))
    ref = loss(x, y).item()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = x * 1.0
        out = loss(h.bfloat16(), y)
        assert loss.logits(h.bfloat16()).dtype == torch.float32
    out.backward()
    assert out.dtype == torch.float32 and torch.isfinite(out)
    assert out.item() == pytest.approx(ref, rel=0.05)
    assert torch.isfinite(x.grad).all() and torch.isfinite(loss._alpha.grad)


def test_bad_inputs_raise_clear_errors():
    loss = HeatedSoftmaxLoss(3, 4)
    with pytest.raises(ValueError, match=r"\[batch, 4\]"):
        loss(torch.randn(2, 5), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 2\]"):
        loss(torch.randn(2, 4), torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="one per embedding"):
        loss(torch.randn(2, 4), torch.tensor([0, 1, 2]))
    with pytest.raises(TypeError, match="integer"):
        loss(torch.randn(2, 4), torch.tensor([0.0, 1.0]))
    with pytest.raises(TypeError, match="torch.Tensor"):
        loss([[0.0] * 4], torch.tensor([0]))
    with pytest.raises(ValueError, match="num_classes"):
        HeatedSoftmaxLoss(0, 4)
    with pytest.raises(ValueError, match="alpha"):
        HeatedSoftmaxLoss(3, 4, alpha=-2.0)
