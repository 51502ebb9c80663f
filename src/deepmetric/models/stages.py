"""The stages of a backbone, bottom (input) to top (features), for layer-wise learning rates.

A stage is a group of consecutive layers that work at one resolution (or, for the small nets,
one layer): layer-wise learning-rate decay (``optim.layer_decay``, BEiT / ELECTRA style) gives
stage ``s`` counted from the top the multiplier ``decay ** s``, so the layers nearest the
input, whose ImageNet features are the most generic, move least.

* ``efficientnet_lite0/1/2``: :meth:`EfficientNetLiteBackbone.stages`, the 9 stages
  ``[stem, blocks.0, ..., blocks.6, head]`` that ``freeze_stages`` counts too;
* ``resnet18`` / ``resnet50``: stem (``conv1`` + ``bn1``), ``layer1`` ... ``layer4``;
* ``googlenet``, ``inception_v3``, ``inception_v4``, ``densenet161``: the blocks between two
  resolution reductions (the stride-2 layer starts the stage it feeds, as timm's
  ``feature_info`` cuts them);
* ``timm/<name>``: timm's ``group_matcher(coarse=False)`` groups (a ViT: stem, then each
  block, the final norm with the last; :class:`~deepmetric.models.timm_backbone.TimmBackbone`), which
  ``freeze_stages`` counts too;
* ``glyph_resnet``: stem, then each of its ``stages``; ``lenet``: ``conv1``, ``conv2``, ``ip1``.

Any other module has no known stage structure and :func:`backbone_stages` refuses it by name.
Every parameter of a listed backbone lies in exactly one stage (tested for every registered
backbone).
"""
from __future__ import annotations

from torch import nn

from .backbones import FeatureBackbone, list_backbones
from .efficientnet_lite import EfficientNetLiteBackbone
from .small import GlyphResNet, LeNet
from .timm_backbone import TimmBackbone

__all__ = ["backbone_stages", "STAGE_LAYOUTS"]

#: FeatureBackbone name -> its stages, each a list of sub-module paths (bottom to top).
STAGE_LAYOUTS: dict[str, list[list[str]]] = {
    "resnet18": [["conv1", "bn1"], ["layer1"], ["layer2"], ["layer3"], ["layer4"]],
    "resnet50": [["conv1", "bn1"], ["layer1"], ["layer2"], ["layer3"], ["layer4"]],
    "googlenet": [["conv1"], ["conv2", "conv3"], ["inception3a", "inception3b"],
                  ["inception4a", "inception4b", "inception4c", "inception4d", "inception4e"],
                  ["inception5a", "inception5b"]],
    "inception_v3": [["Conv2d_1a_3x3", "Conv2d_2a_3x3", "Conv2d_2b_3x3"], ["Conv2d_3b_1x1", "Conv2d_4a_3x3"],
                     ["Mixed_5b", "Mixed_5c", "Mixed_5d"],
                     ["Mixed_6a", "Mixed_6b", "Mixed_6c", "Mixed_6d", "Mixed_6e"],
                     ["Mixed_7a", "Mixed_7b", "Mixed_7c"]],
    # timm's feature_info for inception_v4: reductions 2, 4, 8, 16, 32 after features.2/3/9/17/21
    "inception_v4": [[f"features.{i}" for i in range(a, b)] for a, b in ((0, 3), (3, 4), (4, 10), (10, 18), (18, 22))],
    "densenet161": [["features.conv0", "features.norm0"]]
                   + [[f"features.denseblock{i}", f"features.transition{i}"] for i in (1, 2, 3)]
                   + [["features.denseblock4", "features.norm5"]],
}


def _grouped(backbone: nn.Module, paths: list[str]) -> nn.ModuleList:
    return nn.ModuleList([backbone.get_submodule(p) for p in paths])


def backbone_stages(backbone: nn.Module) -> list[nn.Module]:
    """The stages of ``backbone`` from the input to the top (see the module docstring).

    Raises ``ValueError`` naming the module when its stage structure is unknown."""
    if isinstance(backbone, (EfficientNetLiteBackbone, TimmBackbone)):
        return list(backbone.stages())
    if isinstance(backbone, GlyphResNet):
        return [backbone.stem, *backbone.stages]
    if isinstance(backbone, LeNet):
        return [backbone.conv1, backbone.conv2, backbone.ip1]
    if isinstance(backbone, FeatureBackbone) and backbone.name in STAGE_LAYOUTS:
        return [_grouped(backbone, paths) for paths in STAGE_LAYOUTS[backbone.name]]
    name = getattr(backbone, "name", "") or type(backbone).__name__
    known = [n for n in list_backbones() if n in STAGE_LAYOUTS or n.startswith("efficientnet_lite")
             or n in ("glyph_resnet", "lenet")]
    raise ValueError(f"backbone {name!r} has no known stages (layer-wise learning rates need them); "
                     f"backbones with stages: {', '.join(known)}")
