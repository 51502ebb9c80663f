"""LP-FT: a linear probe first, then fine-tuning (Kumar et al., ICLR 2022, "Fine-Tuning can
Distort Pretrained Features and Underperform Out-of-Distribution").

Fine-tuning a pretrained backbone under a randomly initialised head sends large, poorly aimed
gradients into the backbone during the first steps and distorts its features; training the
head alone first (the linear probe), then everything, keeps them.  ``train.warmup_mode:
linear_probe`` with ``train.warmup_epochs: N`` makes the first N epochs that probe: the
backbone is a fixed feature extractor, only the parameters outside ``model.backbone`` (the
embedding head, a classifier) and the loss parameters train.  Unlike ``warmup_mode:
new_layers`` (backbone lr 0), the backbone

* runs in eval mode: its batch-norm layers normalise with their running statistics and do not
  update them, and dropout / drop-path are off, so its features are those of the pretrained
  network;
* records no autograd graph: its trainable parameters stop requiring gradients for the
  phase, so no backward pass runs through it (a probe step costs the forward pass of the
  backbone and the head's step) and the optimiser skips its parameters (no gradient, no
  weight decay, no momentum), which stay bit-identical.

Whether an epoch probes is a function of the epoch alone, so a run resumed in the middle of
the probe continues exactly.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

from torch import nn

from deepmetric.run.config import TrainConfig

__all__ = ["linear_probe_epoch", "linear_probe", "probed_backbone"]


def linear_probe_epoch(tc: TrainConfig, epoch: int) -> bool:
    """Whether 0-based ``epoch`` belongs to the linear-probe phase of LP-FT."""
    return tc.warmup_mode == "linear_probe" and epoch < tc.warmup_epochs


def probed_backbone(model: nn.Module) -> nn.Module:
    """``model.backbone``, the part a linear probe keeps fixed; a clear error without one."""
    from deepmetric.models import with_model_defaults

    backbone = with_model_defaults(model).backbone  # any module (one from elsewhere may have none)
    if not isinstance(backbone, nn.Module):
        raise ValueError(f"config key 'train.warmup_mode': linear_probe keeps model.backbone fixed, but "
                         f"{type(model).__name__} has no .backbone module")
    return backbone


def _stay_in_eval(module: nn.Module, args) -> None:
    # A forward pre-hook: the loop puts the whole module in training mode at every epoch
    # start; the probed backbone runs in eval mode whatever that did.
    if module.training:
        module.eval()


@contextlib.contextmanager
def linear_probe(model: nn.Module, active: bool = True) -> Iterator[None]:
    """Inside, ``model.backbone`` is a fixed feature extractor (see the module docstring): its
    trainable parameters do not require gradients and every forward pass runs it in eval
    mode.  On exit the parameters require gradients again (those frozen before, such as
    ``freeze_stages``, stay frozen) and the next ``model.train()`` restores its mode."""
    if not active:
        yield
        return
    backbone = probed_backbone(model)
    trainable = [p for p in backbone.parameters() if p.requires_grad]
    hook = backbone.register_forward_pre_hook(_stay_in_eval)
    backbone.eval()
    for p in trainable:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in trainable:
            p.requires_grad_(True)
        hook.remove()
