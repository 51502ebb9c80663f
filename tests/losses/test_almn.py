"""ALMNLoss against the ALMN paper (Chen & Deng 2018): Eq. 2, 3, 6-8, 9-11, 12.

Every reference below is written from the paper's formulas in numpy (float64), in the
paper's own form (M of Eq. 7, the sums of Eq. 2 and 8), independently of the module.
"""
import math

import numpy as np
import pytest
import torch
from degenerate import NUM_CLASSES, degenerate_batches

from conftest import synthetic_config

from deepmetric.losses.almn import ALMNLoss, virtual_points
from deepmetric.run.rundir import read_log


# ----------------------------------------------------------------------------- references
def ang(a, b):
    return math.acos(max(-1.0, min(1.0, a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))))


def ref_angles(x, y, centres):
    """theta_i = angle(x_i, c_{y_i}); theta_nn = smallest angle between c_{y_i} and an x_j
    with y_j != y_i (None when there is none)."""
    th_i, th_nn = [], []
    for i in range(len(y)):
        c = centres[y[i]]
        th_i.append(ang(x[i], c))
        negs = [ang(c, x[j]) for j in range(len(y)) if y[j] != y[i]]
        th_nn.append(min(negs) if negs else None)
    return th_i, th_nn


def ref_margin_factor(x, y, centres, hard_case="paper"):
    th_i, th_nn = ref_angles(x, y, centres)
    s = []
    for a, b in zip(th_i, th_nn):
        if b is None or (hard_case == "author_code" and a >= b):
            s.append(0.0)
        else:
            s.append(math.sqrt(2 - 2 * math.cos(b - a)))
    return np.array(s)


def ref_xg_one(x, c, beta, s):
    """Eq. 7 in the paper's M form."""
    M = beta * np.linalg.norm(x) * s / np.linalg.norm(x - c)
    v = (M + 1) * x - M * c
    return v / np.linalg.norm(v) * np.linalg.norm(x)


def ref_xg(x, y, centres, beta, hard_case="paper"):
    s = ref_margin_factor(x, y, centres, hard_case)
    return np.stack([ref_xg_one(x[i], centres[y[i]], beta, s[i]) for i in range(len(y))])


def ref_loss(x, y, centres, pos_logits, lam):
    """Eq. 8 (Eq. 3 when pos_logits = x_i . c_{y_i})."""
    n = len(y)
    total = 0.0
    for i in range(n):
        c = centres[y[i]]
        terms = [pos_logits[i]] + [x[j] @ c for j in range(n) if y[j] != y[i]]
        m = max(terms)
        total += -(pos_logits[i] - m - math.log(sum(math.exp(t - m) for t in terms)))
    return total / n + lam / (2 * n) * (x ** 2).sum()


def eq11(x, c, M, s, beta, printed=False):
    """d(x_g . c)/dx_i of Eq. 11 with theta_nn, theta_i held constant.  The paper prints the
    last term as -(u.c)(M (x-c).x + ||x||^2) u / (||u||^3 ||x||); the derivative of ||u||
    (u = (M+1)x - Mc, M = beta ||x|| s / ||x-c||) gives instead
    -(u.c) ||x|| ((M+1) u + ((x-c).u) dM/dx) / ||u||^3."""
    nx, dxc = np.linalg.norm(x), np.linalg.norm(x - c)
    u = (M + 1) * x - M * c
    nu = np.linalg.norm(u)
    t1 = ((M + 1) * (x @ c) - M * (c @ c)) / (nu * nx) * x
    t2 = ((M + 1 + M * ((x - c) @ c) / dxc ** 2) * nx * c
          + M * (dxc ** 2 - nx ** 2) * ((x - c) @ c) / (nx * dxc ** 2) * x) / nu
    if printed:
        t3 = -(u @ c) * (M * ((x - c) @ x) + nx ** 2) * u / (nu ** 3 * nx)
    else:
        dM = M * (x / nx ** 2 - (x - c) / dxc ** 2)
        t3 = -(u @ c) * nx * ((M + 1) * u + ((x - c) @ u) * dM) / nu ** 3
    return t1 + t2 + t3


def setup(rng, n_cls=4, per=2, k=5, beta=3.0, **kw):
    y = np.repeat(np.arange(n_cls), per)
    x = rng.normal(size=(n_cls * per, k))
    centres = rng.normal(size=(n_cls, k))
    loss = ALMNLoss(n_cls, k, beta, centre_init="zeros", **kw).double()
    with torch.no_grad():
        loss.centers.copy_(torch.from_numpy(centres))
    loss.eval()
    return loss, x, y, centres


def t(a):
    return torch.from_numpy(np.asarray(a))


# ----------------------------------------------------------------------------- Eq. 6-7
@pytest.mark.parametrize("beta", [0.5, 1.0, 3.0])
def test_virtual_point_equals_eq7(rng, beta):
    loss, x, y, centres = setup(rng, n_cls=5, per=3, k=6, beta=beta)
    got = loss.virtual_point(t(x), t(y)).numpy()
    np.testing.assert_allclose(got, ref_xg(x, y, centres, beta), rtol=1e-10, atol=1e-12)


def test_angles_match_reference(rng):
    loss, x, y, centres = setup(rng, n_cls=3, per=3, k=4)
    th_i, th_nn, has = loss.angles(t(x), t(y))
    r_i, r_nn = ref_angles(x, y, centres)
    np.testing.assert_allclose(th_i.numpy(), r_i, atol=1e-6)
    np.testing.assert_allclose(th_nn.numpy(), r_nn, atol=1e-6)
    assert has.all()


@pytest.mark.parametrize("hard_case", ["paper", "author_code"])
def test_virtual_point_keeps_norm_and_moves_away_from_centre(rng, hard_case):
    for beta in (0.3, 1.0, 3.0):
        loss, x, y, centres = setup(rng, n_cls=6, per=4, k=8, beta=beta, hard_case=hard_case)
        xg = loss.virtual_point(t(x), t(y)).numpy()
        np.testing.assert_allclose(np.linalg.norm(xg, axis=1), np.linalg.norm(x, axis=1),
                                   rtol=1e-12)
        for i in range(len(y)):
            assert ang(xg[i], centres[y[i]]) >= ang(x[i], centres[y[i]]) - 1e-9
        # x_i . c >= x_g . c (Sec. 3.3: the virtual point is harder)
        dots_x = (x * centres[y]).sum(1)
        dots_g = (xg * centres[y]).sum(1)
        assert (dots_x >= dots_g - 1e-9 * np.abs(dots_x).max()).all()


def test_beta_zero_gives_xg_equal_x(rng):
    loss, x, y, _ = setup(rng, beta=0.0)
    np.testing.assert_array_equal(loss.virtual_point(t(x), t(y)).numpy(), x)


def test_author_code_hard_case_uses_plain_x(rng):
    loss_a, x, y, centres = setup(rng, n_cls=6, per=4, k=3, beta=2.0, hard_case="author_code")
    th_i, th_nn = ref_angles(x, y, centres)
    hard = np.array([a >= b for a, b in zip(th_i, th_nn)])
    assert hard.any() and (~hard).any()          # the random batch has both kinds
    xg = loss_a.virtual_point(t(x), t(y)).numpy()
    np.testing.assert_allclose(xg[hard], x[hard], rtol=1e-12)
    paper = ref_xg(x, y, centres, 2.0, "paper")
    np.testing.assert_allclose(xg[~hard], paper[~hard], rtol=1e-10)
    assert not np.allclose(paper[hard], x[hard])  # "paper" mode still moves hard samples


def test_hard_case_margin_grows_with_hardness_in_paper_mode_only():
    """The text promises hard patterns a weaker constraint, but sqrt(2 - 2 cos(theta_nn -
    theta_i)) is symmetric: beyond the nearest negative (theta_i > theta_nn) the virtual
    point moves *further* the harder the sample ("paper"); "author_code" adds no margin."""
    def rot(a):
        return [math.cos(a), math.sin(a)]

    theta_nn = 0.5
    extra = {}
    for mode in ("paper", "author_code"):
        loss = ALMNLoss(2, 2, beta=1.0, centre_init="zeros", hard_case=mode).double().eval()
        with torch.no_grad():
            loss.centers.copy_(t(np.array([[1.0, 0.0], [0.0, 1.0]])))
        extra[mode] = []
        for theta_i in (0.2, 0.6, 0.9):                   # easy, hard, harder
            x = t(np.array([rot(theta_i), rot(-theta_nn)]))  # row 1: the nearest negative of row 0
            xg = loss.virtual_point(x, t(np.array([0, 1])))[0].numpy()
            extra[mode].append(math.atan2(abs(xg[1]), xg[0]) - theta_i)   # margin added
    easy, hard, harder = extra["paper"]
    assert easy > 0 and 0 < hard < harder       # grows with hardness beyond the negative
    assert extra["author_code"][0] == pytest.approx(easy)
    assert extra["author_code"][1:] == [pytest.approx(0.0, abs=1e-12)] * 2


# ----------------------------------------------------------------------------- Eq. 3 / 8 / 12
def test_beta_zero_and_margin_none_equal_eq3(rng):
    for kw in (dict(beta=0.0), dict(beta=3.0, margin_mode="none")):
        loss, x, y, centres = setup(rng, n_cls=4, per=3, **kw)
        ref = ref_loss(x, y, centres, (x * centres[y]).sum(1), 0.0005)
        assert loss(t(x), t(y)).item() == pytest.approx(ref, rel=1e-12)


@pytest.mark.parametrize("beta,lam", [(1.0, 0.0005), (3.0, 0.01)])
def test_loss_equals_eq8(rng, beta, lam):
    loss, x, y, centres = setup(rng, n_cls=4, per=3, beta=beta, lam=lam)
    xg = ref_xg(x, y, centres, beta)
    ref = ref_loss(x, y, centres, (xg * centres[y]).sum(1), lam)
    assert loss(t(x), t(y)).item() == pytest.approx(ref, rel=1e-12)


def test_fixed_margin_equals_eq12(rng):
    for m in (2, 3):
        loss, x, y, centres = setup(rng, n_cls=4, per=3, margin_mode="fixed", margin_m=m)
        pos = []
        for i in range(len(y)):
            c = centres[y[i]]
            th = ang(x[i], c)
            k = min(math.floor(th * m / math.pi), m - 1)
            psi = (-1) ** k * math.cos(m * th) - 2 * k
            pos.append(np.linalg.norm(x[i]) * np.linalg.norm(c) * psi)
        ref = ref_loss(x, y, centres, np.array(pos), 0.0005)
        assert loss(t(x), t(y)).item() == pytest.approx(ref, rel=1e-10)
        xt = t(x).requires_grad_(True)
        assert torch.autograd.gradcheck(lambda v, loss=loss, y=y: loss(v, t(y)), (xt,))


def test_rows_without_negatives_contribute_zero(rng):
    loss, x, y, centres = setup(rng)
    y1 = np.zeros(len(y), dtype=np.int64)
    ref = 0.0005 / (2 * len(y)) * (x ** 2).sum()
    assert loss(t(x), t(y1)).item() == pytest.approx(ref, rel=1e-12)


# ----------------------------------------------------------------------------- Eq. 9-11
def test_corrected_eq11_is_the_derivative_of_eq7_and_printed_one_is_not(rng):
    """Finite differences of x_g(x) . c (Eq. 7, margin factor s held fixed) against Eq. 11."""
    beta, s = 2.0, 0.7
    x, c = rng.normal(size=6), rng.normal(size=6)

    def f(v):
        return ref_xg_one(v, c, beta, s) @ c

    h = 1e-6
    fd = np.array([(f(x + h * e) - f(x - h * e)) / (2 * h) for e in np.eye(6)])
    M = beta * np.linalg.norm(x) * s / np.linalg.norm(x - c)
    np.testing.assert_allclose(eq11(x, c, M, s, beta), fd, rtol=1e-6, atol=1e-8)
    assert not np.allclose(eq11(x, c, M, s, beta, printed=True), fd, rtol=1e-3)


@pytest.mark.parametrize("beta", [1.0, 3.0])
def test_autograd_equals_eq9_eq10_eq11(rng, beta):
    """Total gradient of Eq. 8 w.r.t. every x_k: its own row (Eq. 9 with Eq. 11), its role
    as a negative x_j of the other rows (Eq. 10), and lambda/N x_k."""
    lam = 0.01
    loss, x, y, centres = setup(rng, n_cls=4, per=3, k=5, beta=beta, lam=lam)
    n = len(y)
    s = ref_margin_factor(x, y, centres)
    xg = ref_xg(x, y, centres, beta)
    pos = (xg * centres[y]).sum(1)
    P = np.zeros((n, n + 1))                     # row i: [positive, x_j . c_{y_i} for j]
    for i in range(n):
        c = centres[y[i]]
        terms = np.array([pos[i]] + [x[j] @ c if y[j] != y[i] else -np.inf for j in range(n)])
        e = np.exp(terms - terms.max())
        P[i] = e / e.sum()
    ref = np.zeros_like(x)
    for k in range(n):
        c = centres[y[k]]
        M = beta * np.linalg.norm(x[k]) * s[k] / np.linalg.norm(x[k] - c)
        ref[k] += (P[k, 0] - 1) / n * eq11(x[k], c, M, s[k], beta) + lam / n * x[k]   # Eq. 9
        for i in range(n):
            if y[i] != y[k]:
                ref[k] += P[i, k + 1] / n * centres[y[i]]                                # Eq. 10
    xt = t(x).requires_grad_(True)
    (g,) = torch.autograd.grad(loss(xt, t(y)), xt)
    np.testing.assert_allclose(g.numpy(), ref, rtol=1e-9, atol=1e-12)


def test_detach_margin_false_differentiates_through_the_angles(rng):
    loss, x, y, _ = setup(rng, n_cls=3, per=3, k=4, detach_margin=False)
    xt = t(x).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda v: loss(v, t(y)), (xt,))
    loss.detach_margin = True
    (g_det,) = torch.autograd.grad(loss(xt, t(y)), xt)
    loss.detach_margin = False
    (g_full,) = torch.autograd.grad(loss(xt, t(y)), xt)
    assert not torch.allclose(g_det, g_full)


def test_centres_receive_no_gradient(rng):
    loss, x, y, _ = setup(rng)
    assert list(loss.parameters()) == []
    assert {"centers", "center_initialized"} <= set(loss.state_dict())


# ----------------------------------------------------------------------------- Eq. 2
def test_centre_update_equals_eq2_after_loss_with_old_centres(rng):
    rate = 0.3
    loss, x, y, centres = setup(rng, n_cls=5, per=3, k=4, centre_rate=rate)
    y = np.array([0, 0, 0, 1, 3, 3, 1, 0, 3, 1, 1, 0, 3, 3, 0])    # class 2 and 4 absent
    eval_value = loss(t(x), t(y)).item()
    np.testing.assert_array_equal(loss.centers.numpy(), centres)     # eval: no update
    loss.train()
    train_value = loss(t(x), t(y)).item()
    assert train_value == pytest.approx(eval_value, rel=1e-12)       # pre-update centres
    expected = centres.copy()
    for z in range(5):
        idx = [i for i in range(len(y)) if y[i] == z]
        diff = sum((centres[z] - x[i] for i in idx), np.zeros(4))
        expected[z] = centres[z] - rate * diff / (1 + len(idx))
    np.testing.assert_allclose(loss.centers.numpy(), expected, rtol=1e-12)
    np.testing.assert_array_equal(loss.centers.numpy()[[2, 4]], centres[[2, 4]])


def test_centre_rate_lr_follows_the_learning_rate(rng):
    """centre_rate="lr": Eq. 2 with the rate the training loop last pushed (paper Sec. 5.1:
    "alpha is the learning rate", 1e-5 x 0.8 at 20k); same centres as that constant rate."""
    x = t(rng.normal(size=(8, 4)))
    y = t(np.array([0, 0, 1, 1, 2, 2, 3, 0]))
    follow = ALMNLoss(4, 4, centre_init="normal", centre_rate="lr").double().train()
    with pytest.raises(RuntimeError, match="set_learning_rate"):
        follow(x, y)  # no learning rate pushed yet: a clear error, not a silent default
    for lr in (0.3, 0.3 * 0.8):
        const = ALMNLoss(4, 4, centre_init="normal", centre_rate=lr).double().train()
        follow = ALMNLoss(4, 4, centre_init="normal", centre_rate="lr").double().train()
        follow.load_state_dict(const.state_dict())
        follow.set_learning_rate(lr)
        assert follow.centre_rate == lr
        before = const.centers.clone()
        assert follow(x, y).item() == pytest.approx(const(x, y).item(), rel=1e-12)
        torch.testing.assert_close(follow.centers, const.centers, rtol=0, atol=0)
        assert not torch.equal(const.centers, before)
    fixed = ALMNLoss(4, 4, centre_rate=0.5)
    fixed.set_learning_rate(1e-5)  # a constant rate ignores the learning rate
    assert fixed.centre_rate == 0.5
    with pytest.raises(ValueError, match="centre_rate"):
        ALMNLoss(4, 4, centre_rate="learning_rate")
    with pytest.raises(ValueError, match="lr must be"):
        ALMNLoss(4, 4, centre_rate="lr").set_learning_rate(float("nan"))


def test_centre_rate_lr_in_the_training_loop_follows_the_schedule(tmp_path, monkeypatch):
    """deepmetric train pushes the scheduled base lr (multistep x 0.8, as the paper's
    schedule) into the loss before every step; every centre update uses that step's lr."""

    from deepmetric.run.config_io import config_from_dict
    from deepmetric.train.loop import train

    rates = []
    orig = ALMNLoss._update_centres

    def spy(self, x, labels):
        rates.append(self.centre_rate)
        return orig(self, x, labels)

    monkeypatch.setattr(ALMNLoss, "_update_centres", spy)
    raw = synthetic_config(tmp_path, per_class=8, hidden=16,
                           loss=[{"name": "almn", "options": {"beta": 1.0, "centre_rate": "lr"}}], optim={"lr": 0.01},
                           schedule={"lr": {"name": "multistep", "unit": "iteration", "milestones": [4], "gamma": 0.8}},
                           train={"iterations": 8, "batch_size": 12, "sampler": "class_balanced", "m": 3, "n": 4},
                           eval={"every": 0, "metrics": ["recall"]})
    del raw["train"]["epochs"]
    train(config_from_dict(raw))
    logged = [r["lr"] for r in read_log(tmp_path, type="step")]
    assert logged == pytest.approx([0.01] * 4 + [0.008] * 4)
    assert rates == pytest.approx(logged)


def test_first_batch_centre_init_then_eq2(rng):
    loss = ALMNLoss(4, 3, centre_init="first_batch").double()
    x1 = rng.normal(size=(6, 3))
    y1 = np.array([0, 0, 1, 1, 1, 2])
    loss(t(x1), t(y1))
    c = loss.centers.numpy().copy()
    for z in (0, 1, 2):
        np.testing.assert_allclose(c[z], x1[y1 == z].mean(0), rtol=1e-12)
    np.testing.assert_array_equal(c[3], 0.0)
    assert loss.center_initialized.tolist() == [True, True, True, False]
    x2 = rng.normal(size=(2, 3))
    y2 = np.array([0, 3])
    loss(t(x2), t(y2))
    np.testing.assert_allclose(loss.centers.numpy()[0], c[0] - 0.5 * (c[0] - x2[0]) / 2, rtol=1e-12)
    np.testing.assert_allclose(loss.centers.numpy()[3], x2[1], rtol=1e-12)


# ----------------------------------------------------------------------------- robustness
def _degenerate_batches():
    return degenerate_batches(dim=6)


@pytest.mark.parametrize("name,x,y", _degenerate_batches(), ids=lambda v: v if isinstance(v, str) else "")
@pytest.mark.parametrize("opts", [dict(), dict(margin_mode="fixed"), dict(margin_mode="none"),
                                  dict(detach_margin=False), dict(hard_case="author_code"),
                                  dict(centre_init="zeros"), dict(centre_mode="solver"),
                                  dict(centre_mode="solver", centre_init="first_batch")],
                         ids=["virtual", "fixed", "none", "full_grad", "author_code", "zeros", "solver",
                              "solver_first_batch"])
def test_degenerate_batches_give_finite_loss_and_grads(name, x, y, opts):
    torch.manual_seed(0)
    loss = ALMNLoss(NUM_CLASSES, 6, **opts)
    for _ in range(2):       # first call initialises centres (x == c), second uses them
        xx = x.clone().requires_grad_(True)
        out = loss(xx, y)
        out.backward()
        assert torch.isfinite(out)
        assert torch.isfinite(xx.grad).all()
        assert torch.isfinite(loss.centers).all()
        if loss.centers.grad is not None:
            assert torch.isfinite(loss.centers.grad).all()
        assert all(math.isfinite(v) for v in loss.step_stats().values())


def test_x_equal_to_its_centre_is_guarded(rng):
    loss, x, y, centres = setup(rng, detach_margin=False)
    x[0] = centres[y[0]]
    xt = t(x).requires_grad_(True)
    xg = loss.virtual_point(xt, t(y))
    np.testing.assert_allclose(xg[0].detach().numpy(), x[0], rtol=1e-12)
    loss(xt, t(y)).backward()
    assert torch.isfinite(xt.grad).all()


def test_autocast_bf16_cpu_no_nan(rng):
    loss = ALMNLoss(6, 16)
    x = torch.from_numpy(rng.normal(size=(18, 16)).astype(np.float32)).requires_grad_(True)
    y = torch.arange(6).repeat_interleave(3)
    loss.train()
    loss(x.detach(), y)                      # initialise centres
    loss.eval()
    ref = loss(x, y).item()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = loss((x * 1.0).bfloat16(), y)
    out.backward()
    assert out.dtype == torch.float32 and torch.isfinite(out)
    assert out.item() == pytest.approx(ref, rel=0.05)
    assert torch.isfinite(x.grad).all()


def test_bad_options_and_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="margin_mode"):
        ALMNLoss(3, 4, margin_mode="big")
    with pytest.raises(ValueError, match="hard_case"):
        ALMNLoss(3, 4, hard_case="x")
    with pytest.raises(ValueError, match="beta"):
        ALMNLoss(3, 4, beta=-1.0)
    with pytest.raises(ValueError, match="centre_init"):
        ALMNLoss(3, 4, centre_init="random")
    loss = ALMNLoss(3, 4)
    with pytest.raises(ValueError, match=r"\[batch, 4\]"):
        loss(torch.randn(2, 3), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 2\]"):
        loss(torch.randn(2, 4), torch.tensor([0, 5]))


# ----------------------------------------------------------------------------- geometry: rho
def plane_batch(theta_i, theta_nn, rho):
    """Row 0: a unit x_0 at ``theta_i`` from its centre c_0 = (rho, 0); row 1 (label 1): its
    nearest (only) negative, a unit vector at ``theta_nn`` from c_0, with a zero centre (its
    own term of the loss is the constant log 2, so the loss measures row 0)."""
    x = np.array([[math.cos(theta_i), math.sin(theta_i)], [math.cos(theta_nn), math.sin(theta_nn)]])
    centres = np.array([[rho, 0.0], [0.0, 0.0]])
    return x, np.array([0, 1]), centres


def plane_loss(beta, centres, **kw):
    loss = ALMNLoss(2, 2, beta, centre_init="zeros", **kw).double().eval()
    with torch.no_grad():
        loss.centers.copy_(t(centres))
    return loss


# REFERENCE section 9: theta_i = 20 deg, theta_nn = 60 deg; the virtual point's angle from
# the centre for rho 0.7 / 1.0 / 1.3 (and 0.15, the solver mode's short centres: 21 / 22 deg)
WORKED_RHO = (0.15, 0.7, 1.0, 1.3)
WORKED = {1.0: (21, 34, 51, 61), 3.0: (22, 44, 76, 107)}


@pytest.mark.parametrize("beta", sorted(WORKED))
def test_virtual_point_angle_depends_on_rho_as_worked_out(beta):
    """The virtual point's angle against the worked numbers (whole degrees) and against Eq. 7
    in the paper's M form, computed in the plane (``ref_xg_one``)."""
    ti, tnn = math.radians(20), math.radians(60)
    for rho, expected_deg in zip(WORKED_RHO, WORKED[beta]):
        x, y, centres = plane_batch(ti, tnn, rho)
        g = plane_loss(beta, centres).geometry(t(x), t(y))
        assert g["rho"][0].item() == pytest.approx(rho, rel=1e-12)
        assert g["theta_nn"][0].item() == pytest.approx(tnn, abs=1e-6)
        got = math.degrees(g["theta_g"][0].item())
        assert got == pytest.approx(expected_deg, abs=0.5)
        xg = ref_xg_one(x[0], centres[0], beta, math.sqrt(2 - 2 * math.cos(tnn - ti)))
        assert got == pytest.approx(math.degrees(ang(xg, centres[0])), abs=1e-6)
        assert bool(g["valid"][0])


def test_proposition_1_fails_at_large_rho_only():
    """Proposition 1 (the virtual point stays short of the nearest negative) fails once the
    centre is as long as the sample: at theta 20 / 60 deg, beta 3 passes the negative from
    rho 1.0, beta 1 from rho 1.3 (at rho 1.0 it is still 9 deg short).  With short centres
    (rho 0.15-0.3, the solver mode's regime) no configuration passes it, at any beta up to 3."""
    ti, tnn = math.radians(20), math.radians(60)
    for beta, rho, past in [(3.0, 1.0, True), (3.0, 1.3, True), (1.0, 1.3, True),
                            (1.0, 1.0, False), (3.0, 0.7, False), (1.0, 0.7, False)]:
        x, y, centres = plane_batch(ti, tnn, rho)
        g = plane_loss(beta, centres).geometry(t(x), t(y))
        assert bool(g["theta_g"][0] > g["theta_nn"][0]) is past, (beta, rho)
    # a grid of (theta_i < theta_nn) in the plane, through virtual_points itself
    tnn_g, ti_g = np.meshgrid(np.radians(np.arange(5, 180, 5)), np.radians(np.arange(1, 180, 2)))
    keep = ti_g < tnn_g
    tnn_g, ti_g = tnn_g[keep], ti_g[keep]
    x = t(np.stack([np.cos(ti_g), np.sin(ti_g)], 1))
    s = t(2 * np.abs(np.sin((tnn_g - ti_g) / 2)))
    for beta in (1.0, 2.0, 3.0):
        for rho, some_past in ((0.15, False), (0.3, False), (1.3, True)):
            c = t(np.tile([rho, 0.0], (len(ti_g), 1)))
            xg = virtual_points(x, c, s, beta).numpy()
            theta_g = np.arccos(np.clip(xg[:, 0] / np.linalg.norm(xg, axis=1), -1, 1))
            assert (theta_g > tnn_g + 1e-9).any() == some_past, (beta, rho)


@pytest.mark.parametrize("beta,rho,past", [(3.0, 1.0, True), (3.0, 1.3, True), (1.0, 1.3, True),
                                          (1.0, 1.0, False), (3.0, 0.15, False), (0.0, 1.3, False)])
def test_past_the_nearest_negative_shrinking_the_embedding_lowers_the_loss(beta, rho, past):
    """Running-mean centres are means of the embeddings, so they shrink with them and rho stays
    put.  Scaling embeddings and centres together, the loss falls as they shrink exactly when
    the virtual point lies past the nearest negative (its logit is then below the negative's),
    towards log 2 at zero (a uniform softmax): the collapse.  Otherwise it rises.  No norm
    penalty (lam 0)."""
    x, y, centres = plane_batch(math.radians(20), math.radians(60), rho)
    values = []
    for scale in (1.0, 0.5, 1e-3):
        loss = plane_loss(beta, scale * centres, lam=0.0)
        values.append(loss(t(scale * x), t(y)).item())
    assert (values[1] < values[0]) is past
    assert values[2] == pytest.approx(math.log(2), abs=1e-5)
    g = plane_loss(beta, centres).geometry(t(x), t(y))
    assert bool(g["theta_g"][0] > g["theta_nn"][0]) is past


def test_step_stats_equal_a_brute_force_computation(rng):
    """rho, the virtual point's angle and the nearest negative's, from the reference
    functions above (numpy, the paper's M form), over a training batch."""
    n_cls, per, k, beta = 5, 3, 6, 3.0
    y = np.repeat(np.arange(n_cls), per)
    # samples around their centres' directions, centres from much shorter to longer than them
    directions = rng.normal(size=(n_cls, k))
    directions /= np.linalg.norm(directions, axis=1, keepdims=True)
    x = (directions[y] + 0.5 * rng.normal(size=(n_cls * per, k))) * rng.uniform(0.5, 2.0, size=(n_cls * per, 1))
    centres = directions * rng.uniform(0.1, 2.5, size=(n_cls, 1))
    loss = ALMNLoss(n_cls, k, beta, centre_init="zeros", centre_rate=0.0).double()
    with torch.no_grad():
        loss.centers.copy_(t(centres))
    assert loss.step_stats() == {}                      # no training batch yet
    loss.train()
    loss(t(x), t(y))
    loss.eval()
    loss(t(rng.normal(size=(4, k))), t(np.array([0, 1, 2, 3])))   # evaluation: not recorded
    stats = loss.step_stats()
    rho = np.linalg.norm(centres[y], axis=1) / np.linalg.norm(x, axis=1)
    _, th_nn = ref_angles(x, y, centres)
    xg = ref_xg(x, y, centres, beta)
    th_g = np.array([ang(xg[i], centres[y[i]]) for i in range(len(y))])
    diff = np.degrees(th_g - np.array(th_nn))
    assert stats["rho_median"] == pytest.approx(np.median(rho), rel=1e-12)
    assert stats["virtual_minus_nn_deg_median"] == pytest.approx(np.median(diff), abs=1e-6)
    assert stats["virtual_past_nn_frac"] == pytest.approx((diff > 0).mean(), abs=1e-12)
    assert 0 < stats["virtual_past_nn_frac"] < 1
    th_i, _ = ref_angles(x, y, centres)
    assert stats["sample_past_nn_frac"] == pytest.approx((np.array(th_i) > np.array(th_nn)).mean(), abs=1e-12)
    assert 0 < stats["sample_past_nn_frac"] < stats["virtual_past_nn_frac"]  # the margin pushed some past


def test_step_stats_skip_rows_without_angles():
    """Zero centres (the solver mode's start) have no angle: rho is 0 and the angle
    statistics are absent rather than made up."""
    loss = ALMNLoss(3, 4, centre_mode="solver").train()
    loss(torch.randn(6, 4), torch.tensor([0, 0, 1, 1, 2, 2]))
    assert loss.step_stats() == {"rho_median": 0.0}


def test_loss_step_stats_name_the_term():
    from deepmetric.losses import TripletLoss
    from deepmetric.train.loss_stats import loss_step_stats

    almn = ALMNLoss(3, 4, centre_init="normal").train()
    almn(torch.randn(6, 4), torch.tensor([0, 0, 1, 1, 2, 2]))
    got = loss_step_stats(["triplet", "almn"], [TripletLoss(), almn])
    assert got == {f"loss/1_almn/{k}": v for k, v in almn.step_stats().items()}
    assert set(got) == {"loss/1_almn/rho_median", "loss/1_almn/virtual_minus_nn_deg_median",
                        "loss/1_almn/virtual_past_nn_frac", "loss/1_almn/sample_past_nn_frac"}


# ----------------------------------------------------------------------------- centre_mode: solver
def eq2_step(x, y, centres):
    """sum_{i: y_i = z} (c_z - x_i) / (1 + n_z) per class (0 for classes not in the batch)."""
    out = np.zeros_like(centres)
    for z in range(len(centres)):
        idx = [i for i in range(len(y)) if y[i] == z]
        out[z] = sum((centres[z] - x[i] for i in idx), np.zeros(centres.shape[1])) / (1 + len(idx))
    return out


def test_solver_centres_get_the_eq2_step_as_gradient(rng):
    """The authors' layer: centres are a parameter, the loss value and the embeddings'
    gradient are those of the running-mean mode, and the centres' gradient is the Eq. 2 step
    (times the weight of the term), not the derivative of Eq. 8."""
    n_cls, k = 5, 4
    y = np.array([0, 0, 0, 1, 3, 3, 1, 0, 3, 1])            # classes 2 and 4 absent
    x = rng.normal(size=(len(y), k))
    centres = rng.normal(size=(n_cls, k))
    solver = ALMNLoss(n_cls, k, centre_mode="solver").double()
    running = ALMNLoss(n_cls, k, centre_init="zeros", centre_rate=0.0).double()
    assert [n for n, _ in solver.named_parameters()] == ["centers"]
    assert torch.equal(solver.centers, torch.zeros(n_cls, k, dtype=torch.float64))  # zero start
    assert set(solver.state_dict()) == set(running.state_dict())  # same checkpoint keys
    with torch.no_grad():
        solver.centers.copy_(t(centres))
        running.centers.copy_(t(centres))
    xs, xr = t(x).requires_grad_(), t(x).requires_grad_()
    vs = solver.train()(xs, t(y))
    vr = running.train()(xr, t(y))
    assert vs.item() == vr.item()
    (2.5 * vs).backward()
    (2.5 * vr).backward()
    torch.testing.assert_close(xs.grad, xr.grad, rtol=0, atol=0)
    np.testing.assert_allclose(solver.centers.grad.numpy(), 2.5 * eq2_step(x, y, centres), rtol=1e-12)
    np.testing.assert_array_equal(solver.centers.grad.numpy()[[2, 4]], 0.0)
    np.testing.assert_array_equal(solver.centers.detach().numpy(), centres)   # only the optimiser moves them
    solver.centers.grad = None
    solver.eval()(xs, t(y)).backward()                       # evaluation: no centre gradient
    assert solver.centers.grad is None


def test_solver_centres_move_by_sgd_with_momentum_at_the_loss_lr(rng):
    """build_optimizer puts the centres in the loss group (optim.lr x optim.loss_lr_mult, the
    new-layer multiplier by default); two SGD steps with momentum and weight decay equal the
    solver's recurrence on the Eq. 2 steps, as Caffe applies it to the layer's blob."""
    from deepmetric.run.config_io import config_from_dict
    from deepmetric.train.optim import build_optimizer

    n_cls, k = 4, 3
    raw = {"data": {"name": "synthetic"}, "model": {"name": "synthetic_mlp"},
           "loss": [{"name": "almn", "options": {"centre_mode": "solver"}}],
           "optim": {"name": "sgd", "lr": 0.01, "momentum": 0.9, "weight_decay": 0.0002,
                     "new_layer_lr_mult": 10.0},
           "train": {"epochs": 1}}
    model = torch.nn.Linear(2, 2)
    for mult, expected in ((None, 10.0), (3.0, 3.0)):
        optim_cfg = config_from_dict({**raw, "optim": {**raw["optim"], "loss_lr_mult": mult}}).optim
        loss = ALMNLoss(n_cls, k, centre_mode="solver", centre_init="normal").double().train()
        opt = build_optimizer(model, torch.nn.ModuleList([loss]), optim_cfg)
        (group,) = [g for g in opt.param_groups if "loss.0.centers" in g["param_names"]]
        assert group["lr_mult"] == expected and group["lr"] == pytest.approx(0.01 * expected)
        c = loss.centers.detach().numpy().copy()
        v = np.zeros_like(c)
        lr = 0.01 * expected
        for _ in range(2):
            y = rng.integers(0, n_cls, size=8)
            x = rng.normal(size=(8, k))
            opt.zero_grad()
            loss(t(x), t(y)).backward()
            opt.step()
            v = 0.9 * v + eq2_step(x, y, c) + 0.0002 * c
            c = c - lr * v
            np.testing.assert_allclose(loss.centers.detach().numpy(), c, rtol=1e-10, atol=1e-14)


def test_solver_options_and_errors():
    with pytest.raises(ValueError, match="centre_rate=0.5 does not apply with centre_mode='solver'"):
        ALMNLoss(3, 4, centre_mode="solver", centre_rate=0.5)
    with pytest.raises(ValueError, match="centre_mode must be one of"):
        ALMNLoss(3, 4, centre_mode="sgd")
    with pytest.raises(ValueError, match="centre_std"):
        ALMNLoss(3, 4, centre_init="normal", centre_std=-1.0)
    torch.manual_seed(0)
    filled = ALMNLoss(50, 40, centre_mode="solver", centre_init="normal", centre_std=0.01)
    assert filled.centers.std().item() == pytest.approx(0.01, rel=0.1)
    assert ALMNLoss(3, 4).centre_rate == 0.5 and ALMNLoss(3, 4).centre_init == "first_batch"
    assert "centre_mode='solver'" in repr(filled) and "centre_rate" not in repr(filled)
    filled.set_learning_rate(0.1)                   # the optimiser's rate applies: ignored
    assert filled.centre_rate is None


def _solver_run(out, loss_lr_mult=0.1, **train_extra):
    from deepmetric.run.config_io import config_from_dict

    return config_from_dict(synthetic_config(
        out, per_class=12, hidden=16, loss=[{"name": "almn", "options": {"beta": 3.0, "centre_mode": "solver"}}],
        optim={"loss_lr_mult": loss_lr_mult},
        train={"batch_size": 12, "sampler": "class_balanced", "m": 3, "n": 4, **train_extra},
        eval={"every": 0, "metrics": ["recall"], "ks": [1]}))


def test_solver_mode_trains_logs_its_geometry_and_resumes_exactly(tmp_path):
    """In the training loop: the centres start at 0 and move (frozen at loss lr 0), every step
    record carries the geometry, and a run stopped after 2 epochs and resumed ends with the
    same centres, optimiser state and losses as one uninterrupted run."""

    from deepmetric.train.loop import train

    train(_solver_run(tmp_path / "ref"))
    ref = torch.load(tmp_path / "ref" / "last.pt", weights_only=True)
    centres = ref["loss"][0]["centers"]
    assert centres.abs().sum() > 0
    train(_solver_run(tmp_path / "frozen", epochs=1, loss_lr_mult=0.0))
    frozen = torch.load(tmp_path / "frozen" / "last.pt", weights_only=True)
    assert torch.equal(frozen["loss"][0]["centers"], torch.zeros_like(centres))
    steps = read_log(tmp_path / "ref", type="step")
    assert steps[0]["loss/0_almn/rho_median"] == 0.0       # zero-initialised centres
    assert all("loss/0_almn/rho_median" in r for r in steps)
    later = [r for r in steps[1:] if "loss/0_almn/virtual_past_nn_frac" in r]
    assert later and all(0 <= r["loss/0_almn/virtual_past_nn_frac"] <= 1 for r in later)
    assert 0 < steps[-1]["loss/0_almn/rho_median"] < 0.5   # slow centres (lr 0.005): still short

    train(_solver_run(tmp_path / "resumed", epochs=2))
    train(_solver_run(tmp_path / "resumed"), resume=tmp_path / "resumed" / "last.pt")
    res = torch.load(tmp_path / "resumed" / "last.pt", weights_only=True)
    assert torch.equal(res["loss"][0]["centers"], centres)
    assert torch.equal(res["loss"][0]["center_initialized"], ref["loss"][0]["center_initialized"])
    assert all(torch.equal(res["model"][k], ref["model"][k]) for k in ref["model"])
    momentum = [s["momentum_buffer"] for s in ref["optimizer"]["state"].values()]
    assert any(m.shape == centres.shape for m in momentum)  # the centres' momentum is saved
    resumed = read_log(tmp_path / "resumed", type="step")
    assert [r["loss"] for r in resumed] == [r["loss"] for r in steps]
