"""WiSE-FT: weight-space ensembles of the pretrained and the fine-tuned model (Wortsman et al.,
"Robust fine-tuning of zero-shot models", CVPR 2022, Eq. 1):

    theta(a) = (1 - a) * theta_pretrained + a * theta_finetuned,   a in [0, 1].

``eval.wise_ft: [0.25, 0.5, 0.75]`` evaluates these mixtures and a = 1 (the fine-tuned model,
``best.pt``) on the validation split after training, chooses the a with the best validation
``eval.best_metric`` (never the test split), writes that model as ``wise.pt`` and reports the
test metrics of the chosen model only (docs/training.md).

What is mixed (``eval.wise_ft_params``):

* ``backbone`` (default): every tensor of the backbone, its parameters and its batch-norm
  running statistics; the embedding head, the projection and a classifier stay the fine-tuned
  ones (a new head has no pretrained value to mix with);
* ``all``: every tensor of the model; the head's "pretrained" value is its value before the
  first step (its PCA initialisation with ``model.options.head_init``, a pretrained deepmetric
  model's head, or else its random initialisation).

BN running means and variances are mixed with the same a as the weights (they are not
re-estimated for the mixed network); ``num_batches_tracked`` counters are the fine-tuned ones.
At a = 0 and a = 1 every mixed tensor is exactly the pretrained / fine-tuned one.
"""
from __future__ import annotations

import copy
from collections.abc import Callable, Mapping

import torch
from torch import nn

__all__ = ["WISE_FT_PARAMS", "choose_alpha", "interpolate_state", "mixed_keys", "snapshot_state", "wise_ft_alphas"]

WISE_FT_PARAMS = ("backbone", "all")


def snapshot_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """A CPU copy of ``model.state_dict()`` (the pretrained weights, taken before the first step)."""
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


def mixed_keys(state: Mapping[str, torch.Tensor], params: str = "backbone") -> list[str]:
    """The state-dict keys WiSE-FT mixes: floating-point tensors under ``backbone.`` (or all of
    them with ``params="all"``); integer counters (``num_batches_tracked``) are never mixed."""
    if params not in WISE_FT_PARAMS:
        raise ValueError(f"config key 'eval.wise_ft_params': expected one of {WISE_FT_PARAMS}, got {params!r}")
    return [k for k, v in state.items()
            if v.is_floating_point() and (params == "all" or k.startswith("backbone."))]


def interpolate_state(pretrained: Mapping[str, torch.Tensor], finetuned: Mapping[str, torch.Tensor],
                      alpha: float, keys) -> dict[str, torch.Tensor]:
    """theta(a): ``(1 - a) * pretrained[k] + a * finetuned[k]`` for ``k`` in ``keys``, the
    fine-tuned tensor for every other key.  a = 0 and a = 1 return the end points exactly."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"WiSE-FT mixing coefficient must be in [0, 1], got {alpha}")
    keys = set(keys)
    out = {}
    for k, ft in finetuned.items():
        if k not in keys:
            out[k] = ft.clone()
            continue
        if k not in pretrained or pretrained[k].shape != ft.shape:
            raise ValueError(f"WiSE-FT: the pretrained model has no tensor {k!r} of shape {tuple(ft.shape)}")
        pre = pretrained[k].to(ft.device, ft.dtype)
        if alpha == 0.0:
            out[k] = pre.clone()
        elif alpha == 1.0:
            out[k] = ft.clone()
        else:
            out[k] = torch.lerp(pre, ft, alpha)  # pre + a (ft - pre)
    return out


def wise_ft_alphas(values) -> list[float]:
    """The coefficients to evaluate: the configured ones and 1 (the fine-tuned model), sorted,
    without repeats."""
    return sorted({float(a) for a in values} | {1.0})


def choose_alpha(val_metrics: Mapping[float, Mapping[str, float]], key: str) -> float:
    """The a whose validation ``key`` is highest; ties go to the largest a (closest to the
    fine-tuned model: a mixture is chosen only when it is strictly better)."""
    return max(val_metrics, key=lambda a: (val_metrics[a][key], a))


def run_wise_ft(model: nn.Module, pretrained: Mapping[str, torch.Tensor], finetuned: Mapping[str, torch.Tensor],
                alphas, params: str, key: str, evaluate: Callable[[nn.Module, str], dict], *,
                with_test: bool = True, known: Mapping[str, dict] | None = None) -> dict:
    """Evaluate theta(a) for every a of ``alphas`` (and 1) on ``"val"`` with ``evaluate(model,
    split) -> metrics``, choose a on validation ``key`` and (``with_test``) evaluate the chosen
    model on ``"test"``.  ``known``: ``{"val": metrics, "test": metrics}`` of the fine-tuned model
    (a = 1, theta(1) is ``finetuned`` exactly) already evaluated during training: used instead of
    evaluating it again (the evaluation is deterministic, so the numbers are the same).
    ``model`` is not changed (a copy is loaded).  Returns the ``wise_ft`` section
    of metrics.json plus ``"state"`` (the chosen model's state dict)."""
    keys = mixed_keys(finetuned, params)
    net = copy.deepcopy(model)
    val: dict[float, dict] = {}
    known = known or {}
    for a in wise_ft_alphas(alphas):
        if a == 1.0 and known.get("val"):
            val[a] = dict(known["val"])
            continue
        net.load_state_dict(interpolate_state(pretrained, finetuned, a, keys))
        val[a] = evaluate(net, "val")
        if key not in val[a]:
            raise ValueError(f"config key 'eval.best_metric': {key!r} is not among the evaluated metrics "
                             f"{sorted(val[a])}")
    chosen = choose_alpha(val, key)
    state = interpolate_state(pretrained, finetuned, chosen, keys)
    net.load_state_dict(state)
    out = {"params": params, "metric": key, "mixed_tensors": len(keys),
           "val": [{"alpha": a, **m} for a, m in val.items()], "alpha": chosen, "value": val[chosen][key]}
    if with_test and chosen == 1.0 and known.get("test"):
        out["test"] = dict(known["test"])
    elif with_test:  # eval.test false: the chosen mixture is not evaluated on the test split here
        out["test"] = evaluate(net, "test")
    return {**out, "state": state}
