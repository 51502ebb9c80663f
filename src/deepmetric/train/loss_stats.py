"""Per-step statistics that loss terms report about their last training batch, for the
``{"type": "step"}`` records of ``log.jsonl``.

A loss term opts in with a ``step_stats() -> dict[str, float]`` method (ALMN: the median
``rho = |c_y| / |x_i|`` and where its virtual points lie against the nearest negatives).
"""
from __future__ import annotations

from typing import Iterable

from torch import nn

__all__ = ["loss_step_stats"]


def loss_step_stats(names: Iterable[str], losses: Iterable[nn.Module]) -> dict[str, float]:
    """``{"loss/<i>_<name>/<stat>": value}`` over the loss terms that have ``step_stats``
    (the same ``<i>_<name>`` prefix as the per-term loss values of the step record)."""
    out: dict[str, float] = {}
    for i, (name, loss) in enumerate(zip(names, losses)):
        stats = getattr(loss, "step_stats", None)
        if callable(stats):
            out.update({f"loss/{i}_{name}/{key}": float(value) for key, value in stats().items()})
    return out
