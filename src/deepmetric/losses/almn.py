"""Adaptive Large Margin N-pair loss (Chen & Deng, "ALMN: Deep Embedding Learning with
Geometrical Virtual Point Generating", ECCV 2018, ``papers/almn-virtual-point-generating.txt``).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from deepmetric.options import int_option

from .heated_softmax import check_class_batch, compute_dtype
from .registry import register_loss

__all__ = ["ALMNLoss", "virtual_points"]

_MARGIN_MODES = ("virtual", "none", "fixed")
_HARD_CASES = ("paper", "author_code")
_CENTRE_INITS = ("first_batch", "zeros", "normal")
_CENTRE_MODES = ("running_mean", "solver")


def _norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Row norms that are finite (and have a finite gradient, 0) at the zero vector."""
    return (x * x).sum(dim=1).clamp_min(eps * eps).sqrt()


def virtual_points(x: torch.Tensor, c: torch.Tensor, sin_term: torch.Tensor, beta: float,
                   eps: float = 1e-12) -> torch.Tensor:
    r"""Virtual point generating (ALMN Eq. 6-7).

    ``x`` [B, k] samples, ``c`` [B, k] their anchors (centres ``c_{y_i}``),
    ``sin_term`` [B] = ``sqrt(2 - 2 cos(theta_nn - theta_i))``.  Returns

        b_L = ||x|| * sin_term * (x - c) / ||x - c||                       (Eq. 6)
        x_g = ||x|| * (x + beta b_L) / ||x + beta b_L||
            = ||x|| * ((M+1) x - M c) / ||(M+1) x - M c||,
              M = beta ||x|| sin_term / ||x - c||                          (Eq. 7)

    computed in the first form, which needs no division by ``||x - c||`` when ``x == c``
    (then ``b_L = 0`` and ``x_g = x``).  ``beta = 0`` gives ``x_g = x`` (Eq. 3 baseline).
    """
    nx = _norm(x, eps).unsqueeze(1)
    d = x - c
    direction = d / _norm(d, eps).unsqueeze(1)           # 0 when x == c
    b_l = nx * sin_term.unsqueeze(1) * direction
    u = x + beta * b_l
    return nx * (u / _norm(u, eps).unsqueeze(1))


class _CentreGradient(torch.autograd.Function):
    """A zero added to the loss whose gradient w.r.t. the centres is ``step`` (times the
    incoming gradient: the term weight, gradient accumulation, the fp16 loss scale and DDP's
    averaging apply to it as to any other gradient).

    The authors' Caffe layer (``kcenterV3.cpp~``, Backward_cpu) does not differentiate the
    loss w.r.t. the centres: it writes the centre-loss step of Eq. 2,
    ``sum_{i: y_i = z} (c_z - x_i) / (1 + n_z)``, into the centres' diff and lets the solver
    apply it (lr x the layer's multiplier, momentum, weight decay).
    """

    @staticmethod
    def forward(ctx, centres: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(step)
        return centres.new_zeros(())

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (step,) = ctx.saved_tensors
        return grad_out * step, None


def _chebyshev_cos(cos_t: torch.Tensor, m: int) -> torch.Tensor:
    """cos(m theta) as the Chebyshev polynomial T_m(cos theta) (differentiable in cos)."""
    t_prev, t_cur = torch.ones_like(cos_t), cos_t
    if m == 0:
        return t_prev
    for _ in range(m - 1):
        t_prev, t_cur = t_cur, 2 * cos_t * t_cur - t_prev
    return t_cur


@register_loss("almn")
class ALMNLoss(nn.Module):
    r"""Adaptive Large Margin N-pair loss with class-centre anchors and virtual point
    generating (ALMN, Chen & Deng 2018).

    For a batch ``x_1..x_N`` with labels ``y_i`` and class centres ``c_z`` (never trained by
    the gradient of this loss; see ``centre_mode``):

    * ``theta_i`` = angle(x_i, c_{y_i}); ``theta_nn`` = angle between ``c_{y_i}`` and its
      nearest negative in the batch (the ``x_j``, ``y_j != y_i``, with the smallest angle).
    * virtual point ``x_g`` by Eq. 7 (:func:`virtual_points`), with
      ``M = beta ||x_i|| sqrt(2 - 2 cos(theta_nn - theta_i)) / ||x_i - c_{y_i}||``.
    * loss (Eq. 8)::

        L = -1/N sum_i log( e^{x_g.c_{y_i}} / (e^{x_g.c_{y_i}} + sum_{y_j != y_i} e^{x_j.c_{y_i}}) )
            + lambda/(2N) sum_i ||x_i||^2

    * after the loss is computed with the pre-update centres, and only when
      ``self.training``, the centres of the classes in the batch move by Eq. 2:
      ``c_z <- c_z - rate * sum_{i: y_i = z} (c_z - x_i) / (1 + n_z)`` (``centre_mode``).

    Options (defaults in brackets):

    * ``num_classes``, ``embedding_dim``: shape of the ``centers`` (C, k).
    * ``centre_mode`` ["running_mean"]: how the centres move.

      - "running_mean": a buffer, updated in the forward pass by Eq. 2 at ``centre_rate``.
      - "solver": as the authors' Caffe layer (``kcenterV3.cpp~``) runs it: the centres are
        an ``nn.Parameter`` whose gradient is the Eq. 2 step
        ``sum_{i: y_i = z} (c_z - x_i) / (1 + n_z)`` (not the derivative of Eq. 8), so the
        optimiser moves them at the loss learning rate (``optim.lr`` x
        ``optim.loss_lr_mult``), with its momentum and weight decay.  They start at 0
        (``centre_init`` default "zeros") and stay short next to the embeddings while they
        move, which keeps ``rho = |c_y| / |x_i|`` small (docs/losses-heated-almn.md: at
        ``rho >= 1`` the virtual point can pass the nearest negative).  ``centre_rate`` does
        not apply.
    * ``beta`` [3.0]: strength of the virtual point (paper's best; Tables 2-4 use 0-3).
      ``beta = 0`` is the baseline of Eq. 3 (``x_g = x_i``).
    * ``centre_rate`` [0.5]: the rate ``alpha`` of Eq. 2 ("running_mean"), a number or ``"lr"``.  The paper
      says "alpha is the learning rate" and uses the same symbol for the network's learning
      rate (Sec. 5.1: "The initial learning rate alpha is 0.00001 and multiplied by 0.8 at
      20k iteration"), so read literally the centres move at the current base learning rate:
      ``"lr"`` follows it (the training loop calls :meth:`set_learning_rate` before every
      step with ``optim.lr`` x the schedule's factors, without per-group multipliers).  A
      number is a constant rate; 0.5 is the value of the centre loss the paper follows (Wen
      et al. 2016, ref. [35]).  Which one works better is an empirical question (the study
      compares both).
    * ``lam`` [0.0005]: ``lambda`` of the l2 regulariser (paper Sec. 5.1).
    * ``margin_mode`` ["virtual"]: "virtual" = Eq. 7-8; "none" = Eq. 3 (same as beta = 0);
      "fixed" = the L-Softmax-like ablation of Eq. 12, positive logit
      ``||x_i|| ||c|| psi(theta_i)``, ``psi = (-1)^k cos(m theta) - 2k`` on
      ``theta in [k pi/m, (k+1) pi/m]``.
    * ``margin_m`` [2]: the integer ``m`` of Eq. 12.
    * ``hard_case`` ["paper"]: "paper" applies Eq. 7 to every sample (the factor
      ``sqrt(2 - 2 cos(.))`` is symmetric, so a sample already beyond its nearest negative
      still gets a margin of ``theta_i - theta_nn``); "author_code" uses the plain
      ``x_i . c`` (``M = 0``) when ``theta_i >= theta_nn``, as the author's Caffe layer does.
    * ``detach_margin`` [True]: treat ``sqrt(2 - 2 cos(theta_nn - theta_i))`` as a constant
      in back-propagation.  This is what the paper's gradients do: Eq. 10 has no term through
      ``theta_nn`` (the nearest negative), and the terms of Eq. 11 involving ``dM/dx_i``
      differentiate ``||x_i||`` and ``||x_i - c||`` only, never the angles.  False
      differentiates through the angles as well (acos clamped away from +-1).
    * ``centre_init`` ["first_batch"; "zeros" with ``centre_mode="solver"``]: "first_batch"
      = a class's centre is set to the mean of its embeddings in the first training batch
      that contains it (before that batch's loss; Eq. 2 then leaves it unchanged for that
      batch); unseen classes stay 0.  "zeros" = all centres start at 0 (the first batch of a
      class then gives a constant loss); "normal" = N(0, ``centre_std``^2) entries (a
      Gaussian filler, as Caffe's ``center_filler``).
    * ``centre_std`` [1.0]: standard deviation of the "normal" initialisation.
    * ``eps`` [1e-12]: floor of every norm (zero vectors, ``x == c``).

    Notes on the paper's Eq. 11: its first two terms are the derivative of ``x_g . c`` with
    ``theta_nn, theta_i`` held constant, but its last term, ``-(u.c)(x.u) u / (||u||^3
    ||x||)`` with ``u = (M+1) x - M c``, is not the derivative of ``||u||`` (it should be
    ``-(u.c) ||x|| ((M+1) u + ((x-c).u) dM/dx) / ||u||^3``); this module relies on autograd
    of Eq. 7, which the tests check against Eq. 9-10 with that corrected Eq. 11 and against
    finite differences.  The author's Caffe code clips probabilities at 1e-20; here the
    log-softmax is computed exactly (log-sum-exp).  Rows without negatives in the batch
    contribute 0 (their softmax has a single term) but still count in ``N``.  Internals run
    in float32 with autocast disabled.

    :meth:`step_stats` summarises the geometry of the last training batch (``rho``, the
    virtual point against the nearest negative); the training loop logs it every step.
    """

    #: the loss of a sample depends on the other samples of the batch: under DDP it sees every
    #: rank's embeddings (``deepmetric.train.module.TrainingModule``)
    pair_based = True

    def __init__(self, num_classes: int, embedding_dim: int, beta: float = 3.0, *,
                 centre_rate: float | str | None = None, lam: float = 0.0005, margin_mode: str = "virtual",
                 margin_m: int = 2, hard_case: str = "paper", detach_margin: bool = True,
                 centre_init: str | None = None, centre_mode: str = "running_mean",
                 centre_std: float = 1.0, eps: float = 1e-12) -> None:
        super().__init__()
        self.num_classes = int_option("num_classes", num_classes)
        self.embedding_dim = int_option("embedding_dim", embedding_dim)
        if centre_mode not in _CENTRE_MODES:
            raise ValueError(f"ALMNLoss: centre_mode must be one of {_CENTRE_MODES}, got {centre_mode!r}")
        self.centre_mode = centre_mode
        solver = centre_mode == "solver"
        if solver and centre_rate is not None:
            raise ValueError(f"ALMNLoss: centre_rate={centre_rate!r} does not apply with "
                             f"centre_mode='solver' (the optimiser moves the centres at the loss "
                             f"learning rate, optim.loss_lr_mult); remove it")
        if centre_rate is None:
            centre_rate = 0.5
        if centre_init is None:
            centre_init = "zeros" if solver else "first_batch"
        self.centre_rate_follows_lr = centre_rate == "lr" and not solver
        if isinstance(centre_rate, str) and not self.centre_rate_follows_lr:
            raise ValueError(f"ALMNLoss: centre_rate must be a number >= 0 or 'lr', got {centre_rate!r}")
        checked = [("beta", beta), ("lam", lam), ("centre_std", centre_std)]
        if not self.centre_rate_follows_lr:
            checked.append(("centre_rate", centre_rate))
        for name, val in checked:
            if isinstance(val, bool) or not isinstance(val, (int, float)) \
                    or not math.isfinite(val) or val < 0:
                raise ValueError(f"ALMNLoss: {name} must be a finite number >= 0, got {val!r}")
        if margin_mode not in _MARGIN_MODES:
            raise ValueError(f"ALMNLoss: margin_mode must be one of {_MARGIN_MODES}, "
                             f"got {margin_mode!r}")
        if hard_case not in _HARD_CASES:
            raise ValueError(f"ALMNLoss: hard_case must be one of {_HARD_CASES}, got {hard_case!r}")
        if centre_init not in _CENTRE_INITS:
            raise ValueError(f"ALMNLoss: centre_init must be one of {_CENTRE_INITS}, "
                             f"got {centre_init!r}")
        self.margin_m = int_option("margin_m", margin_m)
        self.beta = float(beta)
        # "lr": the current learning rate, pushed by the training loop (set_learning_rate);
        # None with centre_mode="solver" (the optimiser's rate applies)
        self.centre_rate: float | None = (None if self.centre_rate_follows_lr or solver
                                          else float(centre_rate))
        self.lam = float(lam)
        self.margin_mode = margin_mode
        self.hard_case = hard_case
        self.detach_margin = bool(detach_margin)
        self.centre_init = centre_init
        self.eps = float(eps)
        self.centre_std = float(centre_std)
        if centre_init == "normal":
            centres = torch.randn(self.num_classes, self.embedding_dim) * self.centre_std
        else:
            centres = torch.zeros(self.num_classes, self.embedding_dim)
        if solver:   # same state_dict key in both modes
            self.centers = nn.Parameter(centres)
        else:
            self.register_buffer("centers", centres)
        self.register_buffer("center_initialized",
                             torch.full((self.num_classes,), centre_init != "first_batch"))
        self._last_batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def set_learning_rate(self, lr: float) -> None:
        """The training loop's current base learning rate; with ``centre_rate="lr"`` it is the
        rate of the next centre updates (Eq. 2), otherwise ignored (``centre_mode="solver"``:
        the optimiser applies the learning rate to the centres itself)."""
        if self.centre_rate_follows_lr:
            lr = float(lr)
            if not math.isfinite(lr) or lr < 0:
                raise ValueError(f"ALMNLoss.set_learning_rate: lr must be a finite number >= 0, got {lr!r}")
            self.centre_rate = lr

    @property
    def centres(self) -> torch.Tensor:
        """Alias of ``centers`` (C, k): a buffer, or a parameter with ``centre_mode="solver"``."""
        return self.centers

    # ------------------------------------------------------------------ pieces
    def angles(self, x: torch.Tensor, labels: torch.Tensor, c: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(theta_i, theta_nn, has_negative)`` per sample, in radians (float32).

        ``theta_nn`` is the smallest angle between ``c_{y_i}`` and any ``x_j`` with
        ``y_j != y_i``; it is set to ``theta_i`` (no margin) where the batch has none.
        """
        if c is None:
            c = self.centers[labels]
        xn = x / _norm(x, self.eps).unsqueeze(1)
        cn = c / _norm(c, self.eps).unsqueeze(1)
        lim = 1.0 - 1e-7   # acos has an infinite slope at +-1
        cos_i = (xn * cn).sum(1).clamp(-lim, lim)
        neg = labels.unsqueeze(0) != labels.unsqueeze(1)          # [i, j]: y_j != y_i
        cos_cx = (cn @ xn.t()).masked_fill(~neg, -2.0)           # cos(c_{y_i}, x_j)
        cos_nn = cos_cx.max(dim=1).values.clamp(-lim, lim)
        has_neg = neg.any(dim=1)
        theta_i = torch.acos(cos_i)
        theta_nn = torch.where(has_neg, torch.acos(cos_nn), theta_i)
        return theta_i, theta_nn, has_neg

    def virtual_point(self, x: torch.Tensor, labels: torch.Tensor,
                      c: torch.Tensor | None = None) -> torch.Tensor:
        """``x_g`` of Eq. 7 for every sample (``x`` itself for beta = 0, for rows without a
        negative, and for ``hard_case="author_code"`` hard samples)."""
        if c is None:
            c = self.centers[labels]
        if self.beta == 0.0:
            return x
        theta_i, theta_nn, has_neg = self.angles(x, labels, c)
        # sqrt(2 - 2 cos(d)) == 2 |sin(d / 2)|: the same value with a finite slope at d = 0
        s = 2.0 * torch.sin((theta_nn - theta_i) / 2).abs()
        s = torch.where(has_neg, s, torch.zeros_like(s))
        if self.hard_case == "author_code":
            s = torch.where(theta_i >= theta_nn, torch.zeros_like(s), s)
        if self.detach_margin:
            s = s.detach()
        return virtual_points(x, c, s, self.beta, self.eps)

    def _fixed_margin_logit(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        """``||x|| ||c|| psi(theta)`` of Eq. 12 (L-Softmax, margin ``m``)."""
        nx, nc = _norm(x, self.eps), _norm(c, self.eps)
        cos_t = ((x * c).sum(1) / (nx * nc)).clamp(-1.0, 1.0)
        m = self.margin_m
        with torch.no_grad():
            k = torch.floor(torch.acos(cos_t) * m / math.pi).clamp(0, m - 1)
        sign = 1.0 - 2.0 * torch.remainder(k, 2)                 # (-1)^k
        psi = sign * _chebyshev_cos(cos_t, m) - 2.0 * k
        return nx * nc * psi

    # ------------------------------------------------------------------ loss
    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        embeddings, labels = check_class_batch(
            embeddings, labels, self.embedding_dim, self.num_classes, "ALMNLoss")
        if embeddings.shape[0] == 0:
            raise ValueError("ALMNLoss: empty batch")
        with torch.autocast(embeddings.device.type, enabled=False):
            x = embeddings.to(compute_dtype(embeddings, self.centers))
            solver = self.centre_mode == "solver"
            if self.training:
                self._init_new_centres(x.detach(), labels)
            # a copy (advanced indexing): the in-place centre update below cannot disturb
            # the tensors autograd saved for backward.  Detached: the loss never trains the
            # centres by its own gradient (the solver mode adds the Eq. 2 step below).
            c = self.centers.detach()[labels].to(x.dtype)
            if self.training:
                self._last_batch = (x.detach(), labels, c)
            if self.margin_mode == "fixed":
                pos = self._fixed_margin_logit(x, c)
            else:
                xg = x if self.margin_mode == "none" else self.virtual_point(x, labels, c)
                pos = (xg * c).sum(1)
            neg_mask = labels.unsqueeze(0) != labels.unsqueeze(1)   # [i, j]: y_j != y_i
            neg = (c @ x.t()).masked_fill(~neg_mask, float("-inf"))  # x_j . c_{y_i}
            logits = torch.cat([pos.unsqueeze(1), neg], dim=1)
            ce = torch.logsumexp(logits, dim=1) - pos
            reg = 0.5 * self.lam * (x * x).sum(1).mean()
            loss = ce.mean() + reg
            if self.training and solver:
                step = self._centre_step(x.detach(), labels)
                loss = loss + _CentreGradient.apply(self.centers, step).to(loss.dtype)
            elif self.training:
                self._update_centres(x.detach(), labels)
        return loss

    # ------------------------------------------------------------------ geometry
    @torch.no_grad()
    def geometry(self, x: torch.Tensor, labels: torch.Tensor, c: torch.Tensor | None = None
                 ) -> dict[str, torch.Tensor]:
        """Per-sample geometry of the virtual point (radians; rows of ``x``):

        * ``rho`` = ``||c_{y_i}|| / ||x_i||``;
        * ``theta_i``, ``theta_nn`` (:meth:`angles`) and ``theta_g`` = angle(x_g, c_{y_i}),
          the virtual point's angle from its centre (``x_g`` = x_i for beta 0, "none", hard
          samples of "author_code"; with "fixed" there is no virtual point and ``theta_g``
          is ``theta_i``);
        * ``valid``: the row has a negative in the batch and a non-zero centre (otherwise
          the angles mean nothing).

        Proposition 1 of the paper (the virtual point stays between the sample and its
        nearest negative) holds for a row when ``theta_g <= theta_nn``.
        """
        if c is None:
            c = self.centers[labels]
        x, c = x.detach(), c.detach().to(x.dtype)
        nx, nc = _norm(x, self.eps), _norm(c, self.eps)
        theta_i, theta_nn, has_neg = self.angles(x, labels, c)
        xg = x if self.margin_mode in ("fixed", "none") else self.virtual_point(x, labels, c)
        cos_g = ((xg * c).sum(1) / (_norm(xg, self.eps) * nc)).clamp(-1.0, 1.0)
        length_c = torch.linalg.vector_norm(c, dim=1)            # exactly 0 for a zero centre
        return {"rho": length_c / nx, "theta_i": theta_i, "theta_nn": theta_nn,
                "theta_g": torch.acos(cos_g), "valid": has_neg & (length_c > self.eps)}

    @torch.no_grad()
    def step_stats(self) -> dict[str, float]:
        """The geometry of the last training batch (empty before the first one):

        * ``rho_median``: median of ``||c_{y_i}|| / ||x_i||``;
        * ``virtual_minus_nn_deg_median``: median of ``theta_g - theta_nn`` in degrees (the
          virtual point's angle from the centre minus the nearest negative's; > 0 = past it);
        * ``virtual_past_nn_frac``: the fraction of rows with ``theta_g > theta_nn``, where
          Proposition 1 fails;
        * ``sample_past_nn_frac``: the fraction with ``theta_i > theta_nn``, samples already
          past their nearest negative (hard ones); the margin put the difference past it.

        The last three count rows with a negative and a non-zero centre, and are absent when
        there is none (e.g. the first batch with zero-initialised centres).
        """
        if self._last_batch is None:
            return {}
        g = self.geometry(*self._last_batch)
        out = {"rho_median": float(torch.quantile(g["rho"].double(), 0.5))}
        valid = g["valid"]
        if bool(valid.any()):
            diff = torch.rad2deg(g["theta_g"][valid] - g["theta_nn"][valid]).double()
            out["virtual_minus_nn_deg_median"] = float(torch.quantile(diff, 0.5))
            out["virtual_past_nn_frac"] = float((diff > 0).double().mean())
            out["sample_past_nn_frac"] = float((g["theta_i"][valid] > g["theta_nn"][valid]).double().mean())
        return out

    @torch.no_grad()
    def _init_new_centres(self, x: torch.Tensor, labels: torch.Tensor) -> None:
        if self.centre_init != "first_batch":
            return
        present = torch.zeros(self.num_classes, dtype=torch.bool, device=labels.device)
        present[labels] = True
        new = present & ~self.center_initialized
        if not bool(new.any()):
            return
        sums = torch.zeros_like(self.centers).index_add_(0, labels, x.to(self.centers.dtype))
        counts = torch.bincount(labels, minlength=self.num_classes).to(self.centers.dtype)
        self.centers[new] = sums[new] / counts[new].unsqueeze(1)
        self.center_initialized |= new

    @torch.no_grad()
    def _centre_step(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """``sum_{i: y_i = z} (c_z - x_i) / (1 + n_z)`` for every class z (0 for absent ones):
        the Eq. 2 step, which the Caffe layer hands its solver as the centres' gradient."""
        x = x.to(self.centers.dtype)
        counts = torch.bincount(labels, minlength=self.num_classes).to(self.centers.dtype)
        # sum_{i: y_i = z} (c_z - x_i) = n_z c_z - sum_{i: y_i = z} x_i
        diff = counts.unsqueeze(1) * self.centers.detach() - torch.zeros_like(self.centers).index_add_(
            0, labels, x)
        return diff / (1.0 + counts).unsqueeze(1)

    @torch.no_grad()
    def _update_centres(self, x: torch.Tensor, labels: torch.Tensor) -> None:
        """Eq. 2: ``c_z <- c_z - rate * sum_{y_i = z} (c_z - x_i) / (1 + n_z)``."""
        if self.centre_rate is None:
            raise RuntimeError("ALMNLoss: centre_rate='lr' follows the learning rate, but none was set: "
                               "call set_learning_rate(lr) before a training step (deepmetric train does)")
        self.centers.sub_(self.centre_rate * self._centre_step(x, labels))
        self.center_initialized[labels] = True

    def extra_repr(self) -> str:
        rate = ("" if self.centre_mode == "solver" else
                f"centre_rate={'lr' if self.centre_rate_follows_lr else format(self.centre_rate, 'g')}, ")
        return (f"num_classes={self.num_classes}, embedding_dim={self.embedding_dim}, "
                f"beta={self.beta:g}, centre_mode={self.centre_mode!r}, {rate}lam={self.lam:g}, "
                f"margin_mode={self.margin_mode!r}, hard_case={self.hard_case!r}, "
                f"detach_margin={self.detach_margin}, centre_init={self.centre_init!r}")
