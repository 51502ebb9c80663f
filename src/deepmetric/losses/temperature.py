"""Reading and setting a loss's temperature ``alpha`` (heated-up softmax, NormFace-style
losses): the one place that knows how, whether alpha is a float or a learnable parameter.

A loss has a temperature when it exposes a settable ``alpha``.  The heating-up schedule
(:mod:`deepmetric.train.schedules`), checkpoints and the gradient-norm diagnostic of the
heated-up paper's Fig. 1 (:mod:`deepmetric.report.gradient_norm`) all go through these four
functions.
"""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["has_alpha", "get_alpha", "set_alpha", "scale_alpha"]


def get_alpha(loss: nn.Module) -> float | None:
    """The loss's alpha as a float (None when it has none)."""
    a = getattr(loss, "alpha", None)
    if a is None:
        return None
    try:
        return float(a.detach()) if hasattr(a, "detach") else float(a)
    except (TypeError, ValueError):
        return None


def has_alpha(loss: nn.Module) -> bool:
    """Whether a loss has a temperature that a schedule can heat (a settable ``alpha``)."""
    return hasattr(loss, "alpha") and get_alpha(loss) is not None


def set_alpha(loss: nn.Module, value: float) -> None:
    """Set alpha; a learnable alpha (a tensor / Parameter) is written in place without
    recording the operation for autograd."""
    a = getattr(loss, "alpha", None)
    if isinstance(a, torch.Tensor):
        with torch.no_grad():
            a.fill_(float(value))
    else:
        loss.alpha = float(value)


def scale_alpha(loss: nn.Module, factor: float) -> None:
    """Multiply the loss's current (possibly learned) alpha by ``factor`` (the loss's own
    ``scale_alpha`` when it has one: the heated softmax also freezes a learned alpha there)."""
    if hasattr(loss, "scale_alpha"):
        loss.scale_alpha(factor)
    else:
        set_alpha(loss, get_alpha(loss) * factor)
