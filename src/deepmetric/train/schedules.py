"""Learning-rate and temperature (alpha) schedules.

The learning rate of every parameter group is

    lr = optim.lr * group.lr_mult * LrSchedule.factor(epoch, iteration) * TemperatureSchedule.lr_factor

so the base schedule (constant / step / multistep / poly / cosine, times the linear warm-up)
and the heating-up events compose.
Both objects have ``state_dict`` / ``load_state_dict`` so a resumed run continues exactly.

Heating-up (heated-up softmax paper, Sec. 3.4): train with an intermediate alpha (16), then
multiply alpha by 1/4 (16 -> 4) and the learning rate by 1/10 for the rest of training.
The official code switches after epoch 60 of 80; its gradual variant multiplies lr by
0.562 and divides alpha by 1.41 every 10 epochs.  Without ``until`` the gradual schedule
stops after the event that brings the cumulative alpha factor closest to the paper's 1/4
(:func:`gradual_default_events`: 4 events with the default factors, ending at alpha
16 / 1.41^4 = 4.04 and lr x 0.562^4 = 0.0998, i.e. the paper's alpha 4 and lr / 10).  With a
learnable alpha (paper Table 5) the factor multiplies the *learned* value, which the loss
then freezes (``HeatedSoftmaxLoss(freeze_heated_alpha=True)``, paper Appendix E).  ``auto_plateau`` is our addition: it heats up
once the monitored quantity stops improving.
"""
from __future__ import annotations

import math
from typing import Any, Iterable

from torch import nn

from deepmetric.losses.temperature import get_alpha, has_alpha, scale_alpha, set_alpha

from deepmetric.run.config import HEATING_DEFAULTS, LrScheduleConfig, heating_factors, TemperatureScheduleConfig

__all__ = ["LrSchedule", "TemperatureSchedule", "get_alpha", "set_alpha", "scale_alpha", "has_alpha",
           "gradual_default_events"]

# the paper's heating, alpha 16 -> 4 and lr -> lr / 10 (the schedule defaults live in config.py)
HEAT_UP_TOTAL_ALPHA_FACTOR, HEAT_UP_TOTAL_LR_FACTOR = HEATING_DEFAULTS["heat_up"]


# --------------------------------------------------------------------------- lr
class LrSchedule:
    """Multiplier of the base learning rate as a function of progress.

    ``total`` is the run length in the schedule's unit (epochs or iterations); it is needed
    by ``poly`` and ``cosine`` only.  ``factor(epoch, iteration)`` takes the 0-based epoch and the 0-based
    global iteration of the step about to be taken.
    """

    def __init__(self, cfg: LrScheduleConfig, *, total_epochs: int, total_iterations: int):
        self.cfg = cfg
        self.total_epochs = int(total_epochs)
        self.total_iterations = int(total_iterations)

    def factor(self, epoch: int, iteration: int) -> float:
        c = self.cfg
        t = epoch if c.unit == "epoch" else iteration
        total = self.total_epochs if c.unit == "epoch" else self.total_iterations
        if c.name == "constant":
            f = 1.0
        elif c.name == "step":
            f = c.gamma ** (t // c.step_size)
        elif c.name == "multistep":
            f = c.gamma ** sum(1 for m in c.milestones if t >= m)
        elif c.name == "poly":
            frac = min(max(t / max(total, 1), 0.0), 1.0)
            f = c.end_factor + (1.0 - c.end_factor) * (1.0 - frac) ** c.power
        elif c.name == "cosine":  # half a cosine from 1 (t = 0) to end_factor (t = T)
            frac = min(max(t / max(total, 1), 0.0), 1.0)
            f = c.end_factor + (1.0 - c.end_factor) * 0.5 * (1.0 + math.cos(math.pi * frac))
        else:  # validated by the config already
            raise ValueError(f"unknown lr schedule {c.name!r}")
        if c.warmup > 0 and iteration < c.warmup:
            f *= (iteration + 1) / c.warmup
        return f

    def state_dict(self) -> dict:
        return {}  # stateless: a pure function of (epoch, iteration)

    def load_state_dict(self, state: dict) -> None:
        del state


# --------------------------------------------------------------------------- temperature
def gradual_default_events(alpha_factor: float, lr_factor: float) -> int:
    """Number of gradual heating events when ``until`` is not given: the count whose
    cumulative alpha factor ``alpha_factor ** n`` is closest (in log scale) to the paper's
    1/4 (alpha 16 -> 4); if alpha is not scaled (factor 1), the count whose lr factor is
    closest to 1/10.  At least 1.  Defaults (1/1.41, 0.562): 4 events."""
    for f, total in ((alpha_factor, HEAT_UP_TOTAL_ALPHA_FACTOR), (lr_factor, HEAT_UP_TOTAL_LR_FACTOR)):
        if 0 < f < 1:
            return max(1, round(math.log(total) / math.log(f)))
    return 1


class TemperatureSchedule:
    """Heating-up events that scale alpha (of the target losses) and the learning rate.

    Call ``step(epoch, iteration)`` before every optimisation step (events due at an epoch
    fire at the start of that epoch: ``heat_up`` with ``at: 60`` trains epochs 0-59 at the
    initial alpha and epochs 60+ heated up), and ``observe(value)`` after every evaluation
    (``auto_plateau`` only).  ``lr_factor`` is the cumulative lr multiplier of the events
    fired so far.  Both return True when an event fired.
    """

    def __init__(self, cfg: TemperatureScheduleConfig, losses: Iterable[nn.Module]):
        self.cfg = cfg
        losses = list(losses)
        idx = cfg.losses if cfg.losses is not None else range(len(losses))
        self.targets = [losses[i] for i in idx if has_alpha(losses[i])]
        if cfg.name != "none" and not self.targets:
            raise ValueError(
                f"temperature schedule {cfg.name!r} needs a loss with an 'alpha' (e.g. "
                f"heated_softmax), but none of the selected loss terms has one"
            )
        default_alpha, default_lr = heating_factors(cfg.name)
        self.alpha_factor = float(cfg.alpha_factor if cfg.alpha_factor is not None else default_alpha)
        self.lr_mult = float(cfg.lr_factor if cfg.lr_factor is not None else default_lr)
        self.events = 0  # number of heat-up events applied
        self.lr_factor = 1.0
        # gradual without 'until': stop where the paper's heating ends (alpha / 4, lr / 10)
        self.max_events = (gradual_default_events(self.alpha_factor, self.lr_mult)
                           if cfg.name == "gradual" and cfg.until is None else None)
        # auto_plateau bookkeeping
        mode = cfg.mode
        if mode == "auto":
            mode = "min" if "loss" in cfg.monitor else "max"
        self.mode = mode
        self.best: float | None = None
        self.bad = 0
        self.history: list[dict[str, Any]] = []

    # -- events
    def _due(self, epoch: int, iteration: int) -> int:
        c = self.cfg
        t = epoch if c.unit == "epoch" else iteration
        if c.name == "heat_up":
            return 1 if t >= c.at else 0
        if c.name == "gradual":
            if c.until is None:
                return min(max(t // c.every, 0), self.max_events)
            return max(min(t, c.until) // c.every, 0)
        return self.events  # none / auto_plateau: nothing time-driven

    def _fire(self, reason: str, epoch: int | None = None, iteration: int | None = None) -> None:
        for loss in self.targets:
            scale_alpha(loss, self.alpha_factor)
        self.events += 1
        self.lr_factor *= self.lr_mult
        self.history.append(
            {"event": self.events, "reason": reason, "epoch": epoch, "iteration": iteration,
             "alpha": self.alphas(), "lr_factor": self.lr_factor}
        )

    def step(self, epoch: int, iteration: int) -> bool:
        fired = False
        while self.events < self._due(epoch, iteration):
            self._fire(self.cfg.name, epoch, iteration)
            fired = True
        return fired

    def observe(self, value: float, epoch: int | None = None, iteration: int | None = None) -> bool:
        """Feed one observation of the monitored quantity (auto_plateau); True if it heated up."""
        c = self.cfg
        if c.name != "auto_plateau" or value is None or not math.isfinite(value):
            return False
        better = (
            self.best is None
            or (self.mode == "min" and value < self.best - c.min_delta)
            or (self.mode == "max" and value > self.best + c.min_delta)
        )
        if better:
            self.best, self.bad = float(value), 0
            return False
        self.bad += 1
        if self.bad >= c.patience and self.events < c.max_heatups:
            self._fire(f"plateau of {c.monitor}", epoch, iteration)
            # The heated model is a new regime: its metric/loss scale changes, so restart.
            self.best, self.bad = None, 0
            return True
        return False

    def alphas(self) -> list[float]:
        return [get_alpha(t) for t in self.targets]

    # -- state
    def state_dict(self) -> dict:
        return {
            "events": self.events,
            "lr_factor": self.lr_factor,
            "best": self.best,
            "bad": self.bad,
            "history": [dict(h) for h in self.history],
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore the bookkeeping.  The alphas themselves live in the loss state (the
        checkpoint restores them), so nothing is re-applied here."""
        self.events = int(state["events"])
        self.lr_factor = float(state["lr_factor"])
        self.best = None if state.get("best") is None else float(state["best"])
        self.bad = int(state.get("bad", 0))
        self.history = [dict(h) for h in state.get("history", [])]
