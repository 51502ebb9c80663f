"""Any timm model as a backbone: ``model.name: timm/<timm model name>`` (a ``.tag`` picks the
pretrained weights' config, e.g. ``timm/vit_small_patch16_224.dino``).

The backbone is ``timm.create_model(name, pretrained=False, num_classes=0)`` and its
``forward_features`` (timm's model contract): a conv map ``[B, C, H, W]`` for CNNs (ConvNeXt,
ResNet, ...; an ``NHWC`` map, as Swin gives, is permuted to ``NCHW``) or tokens ``[B, N, C]``
for transformers (ViT, DeiT, DINO, DINOv2, EVA), whose first ``num_prefix_tokens`` are the
class / register tokens.  :class:`~deepmetric.models.EmbeddingModel` pools either
(:func:`~deepmetric.models.embedding_model.pool_features`: ``cls``, or avg / max / GeM over the
patch tokens).  Parameters that ``forward_features`` never reaches (ConvNeXt's head norm, a
ViT's ``fc_norm``: timm applies them after its own pooling) are found by one backward pass on
the ``meta`` device (no memory, no arithmetic) and frozen, so optimisers and DDP never wait
for their gradients; they stay in the state dict, so timm's files load as they are.

Weights (``pretrained``):

* a local file (``.safetensors``, ``.pth``, ``.bin``) with timm's key names, read as timm's
  ``load_state_dict`` reads it (safetensors, or ``torch.load(weights_only=True)``), passed through the
  model module's ``checkpoint_filter_fn`` (timm's own conversion: e.g. a ViT's position
  embedding resampled to ``img_size``), the ImageNet classifier dropped, then loaded strictly
  (:func:`~deepmetric.models.load_pretrained`: missing / unexpected keys name the file);
* ``"hub"``: ``timm.create_model(..., pretrained=True)``, timm's own loading from the Hugging
  Face hub (or its local cache).  Only when a model is built, never at import time; a failure
  (offline, no cached copy) raises ``RuntimeError`` naming the model and the hub id.

Stages (``freeze_stages``, layer-wise lr decay): timm's ``group_matcher(coarse=False)`` groups,
bottom to top -- for a ViT: stem (patch embedding, class token, position embedding), then
each block (the final norm in the last block's group); for a ConvNeXt: stem, then each block
(downsampling layers in the group of the block they feed) -- timm's own layer-decay grouping
(``timm.optim.param_groups_layer_decay``).
"""
from __future__ import annotations

import functools
import inspect
import os
import sys

import torch
from torch import nn

from deepmetric.registry import did_you_mean

from deepmetric.options import bool_option, float_option, int_option
from .pretrained import (LoadReport, check_not_a_folder, clean_state_dict, load_pretrained, no_weights_hint,
                         read_weights_file, tensor_mapping)

__all__ = ["TIMM_PREFIX", "HUB", "is_timm_name", "timm_model_name", "TimmBackbone", "create_timm_backbone",
           "timm_data_config", "TIMM_OPTIONS", "read_timm_file", "load_timm_weights", "takes_img_size",
           "img_size_option"]

TIMM_PREFIX = "timm/"
HUB = "hub"  # pretrained= value: timm's own loading from the Hugging Face hub / its cache
#: the backbone options a ``timm/`` model accepts (besides in_chans)
TIMM_OPTIONS = ("freeze_stages", "drop_path_rate", "img_size", "dynamic_img_size", "grad_checkpointing")


def is_timm_name(name) -> bool:
    return isinstance(name, str) and name.startswith(TIMM_PREFIX)


def timm_model_name(name: str) -> str:
    """``"timm/vit_small_patch16_224.dino"`` -> ``"vit_small_patch16_224.dino"``, checked
    against timm's registry (``ValueError`` with the closest names otherwise)."""
    import timm

    arch = name[len(TIMM_PREFIX):] if is_timm_name(name) else str(name)
    base, _, tag = arch.partition(".")
    if not timm.is_model(base):
        hint = did_you_mean(base, timm.list_models(), prefix=TIMM_PREFIX, sentence=True)
        raise ValueError(f"unknown timm model {arch!r} (model.name {name!r}).{hint} "
                         f"timm.list_models() lists the names")
    if tag:  # timm itself refuses an unknown tag with a RuntimeError, which the CLI shows as a bug
        tags = [n.partition(".")[2] for n in timm.list_pretrained(f"{base}.*")]
        if tag not in tags:
            hint = did_you_mean(tag, tags, prefix=f"{TIMM_PREFIX}{base}.", sentence=True)
            raise ValueError(f"timm model {base!r} has no weights tag {tag!r} (model.name {name!r}).{hint} "
                             f"Its tags: {', '.join(tags) or 'none'} (without a tag timm picks its default).")
    return arch


def _probe_model(arch: str, **kwargs) -> nn.Module:
    """timm's model ``arch`` built on the ``meta`` device (no memory, no initialisation)."""
    import timm

    with torch.device("meta"):
        return timm.create_model(arch, pretrained=False, **kwargs)


@functools.lru_cache(maxsize=64)
def _init_parameters(arch: str) -> frozenset[str]:
    """The constructor parameters of timm model ``arch``'s class (cached: one meta build)."""
    return frozenset(inspect.signature(type(_probe_model(arch, num_classes=0)).__init__).parameters)


def takes_img_size(name: str) -> bool:
    """Whether timm model ``name`` (``timm/<model>``) is built for one input size (``img_size``:
    ViTs, whose position embedding has one grid); the trainer then builds it for the data's."""
    return "img_size" in _init_parameters(timm_model_name(name))


def _timm_kwargs(arch: str, in_chans: int, drop_path_rate: float, img_size, dynamic_img_size) -> dict:
    """Keyword arguments of ``timm.create_model``.  ``img_size``: the input size of a ViT (its
    position embedding is resampled to that grid once, when weights are loaded: timm's filter);
    ``dynamic_img_size``: any input size, the position embedding resampled at every forward
    pass (ONNX cannot export that resampling; prefer ``img_size``)."""
    kwargs: dict = {"num_classes": 0, "in_chans": int(in_chans), "drop_path_rate": float(drop_path_rate)}
    dynamic_img_size = bool_option("dynamic_img_size", dynamic_img_size)
    if img_size is not None:
        img_size = img_size_option(img_size)
    takes = _init_parameters(arch) if (img_size is not None or dynamic_img_size) else set()
    for key, value in (("img_size", img_size), ("dynamic_img_size", dynamic_img_size or None)):
        if value is None:
            continue
        if key not in takes:
            raise ValueError(f"timm model {arch!r} has no {key} option (it is not built for one input size)")
        kwargs[key] = value
    return kwargs


def img_size_option(value) -> int | list[int]:
    """The ``img_size`` option: a positive int or ``[H, W]`` (``int("x")``'s error would not name it)."""
    if isinstance(value, (list, tuple)):
        if len(value) != 2:
            raise ValueError(f"img_size must be a positive int or [H, W], got {value!r}")
        return [int_option("img_size", v) for v in value]
    return int_option("img_size", value, expected="a positive int or [H, W]")


def _probe(net: nn.Module, input_size) -> tuple[int, set[str]]:
    """(dimensions of ``forward_features``' output, names of the parameters it does not reach):
    one forward and backward pass in eval mode on the ``meta`` device (shapes only)."""
    from torch.func import functional_call

    params = {n: torch.empty_like(p, device="meta").requires_grad_(True) for n, p in net.named_parameters()}
    buffers = {n: torch.empty_like(b, device="meta") for n, b in net.named_buffers()}
    x = torch.empty(2, *input_size, device="meta")
    was = net.training
    net.eval()
    try:
        out = functional_call(_ForwardFeatures(net), {f"net.{k}": v for k, v in {**params, **buffers}.items()}, (x,))
        out.float().sum().backward()
    finally:
        net.train(was)
    return out.dim(), {n for n, p in params.items() if p.grad is None}


_PROBED: dict[tuple, tuple[int, set[str]]] = {}


class _ForwardFeatures(nn.Module):
    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x):
        return self.net.forward_features(x)


class TimmBackbone(nn.Module):
    """A timm model's ``forward_features``: ``[B, C, H, W]`` (``output == "map"``) or tokens
    ``[B, N, C]`` (``output == "tokens"``, the first ``num_prefix_tokens`` being class /
    register tokens).  The timm model is ``self.net`` (state-dict keys ``net.<timm key>``).

    ``freeze_stages = N``: the first N of :meth:`stages` get ``requires_grad = False`` and their
    batch norms stay in eval mode.  ``grad_checkpointing``: timm's ``set_grad_checkpointing``
    (activations recomputed in the backward pass: less GPU memory for large models, ~30 % more
    compute)."""

    def __init__(self, name: str, in_chans: int = 3, freeze_stages: int = 0, drop_path_rate: float = 0.0,
                 img_size=None, dynamic_img_size: bool = False, grad_checkpointing: bool = False, *,
                 hub: bool = False):
        super().__init__()
        import timm

        arch = timm_model_name(name)
        drop_path_rate = float_option(f"{name}: drop_path_rate", drop_path_rate, 0.0, 1.0)
        grad_checkpointing = bool_option("grad_checkpointing", grad_checkpointing)
        kwargs = _timm_kwargs(arch, in_chans, drop_path_rate, img_size, dynamic_img_size)
        if hub:
            self.net = _create_from_hub(arch, kwargs)
        else:
            self.net = timm.create_model(arch, pretrained=False, **kwargs)
        self.name = TIMM_PREFIX + arch
        self.num_features = int(self.net.num_features)
        self.num_prefix_tokens = int(getattr(self.net, "num_prefix_tokens", 0) or 0)
        self.nhwc = getattr(self.net, "output_fmt", "NCHW") in ("NHWC",) or str(
            getattr(self.net, "output_fmt", "")).endswith("NHWC")
        self.pretrained_cfg = timm_data_config(self.net, img_size)
        size = self.pretrained_cfg["input_size"]
        key = (arch, repr(sorted(kwargs.items())), tuple(size))
        if key not in _PROBED:  # one meta pass per architecture and size in a process
            try:
                _PROBED[key] = _probe(self.net, size)
            except (RuntimeError, AssertionError) as exc:  # e.g. img_size smaller than a ViT's patch
                reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
                raise ValueError(f"{self.name} cannot take {size[1]}x{size[2]} inputs (model.options.img_size or "
                                 f"the size of the training images): {reason}") from None
        ndim, unused = _PROBED[key]
        if ndim not in (3, 4):
            raise ValueError(f"{self.name}: forward_features gives a {ndim}-d output; a backbone needs a map "
                             "[B, C, H, W] or tokens [B, N, C]")
        self.output = "tokens" if ndim == 3 else "map"
        self.unused = sorted(unused)  # frozen: see the module docstring
        for n, p in self.net.named_parameters():
            if n in self.unused:
                p.requires_grad_(False)
        self._groups = self._parameter_groups()
        valid = isinstance(freeze_stages, int) and not isinstance(freeze_stages, bool)
        if not valid or not 0 <= freeze_stages <= len(self._groups):
            raise ValueError(f"{name}: freeze_stages must be an int in [0, {len(self._groups)}] (timm's "
                             f"parameter groups: stem, then blocks), got {freeze_stages!r}")
        self.freeze_stages = int(freeze_stages)
        for group in self._groups[: self.freeze_stages]:
            for p in group:
                p.requires_grad_(False)
        if grad_checkpointing:
            self.net.set_grad_checkpointing(True)

    def _parameter_groups(self) -> list[list[nn.Parameter]]:
        from timm.models import group_parameters

        params = dict(self.net.named_parameters())
        matcher = getattr(self.net, "group_matcher", None)
        if matcher is None:  # a model without timm's grouping: one stage
            return [list(params.values())]
        groups = group_parameters(self.net, matcher(coarse=False))
        return [[params[n] for n in groups[k]] for k in sorted(groups)]

    def stages(self) -> list[nn.Module]:
        """The parameter groups bottom to top, each as a ``ParameterList`` holding the very
        parameters of the model (for layer-wise lr decay)."""
        return [nn.ParameterList(group) for group in self._groups]

    def train(self, mode: bool = True):
        super().train(mode)
        if mode and self.freeze_stages:
            for m in self.net.modules():  # frozen batch norms keep their running statistics
                if isinstance(m, nn.modules.batchnorm._BatchNorm) and not any(
                        p.requires_grad for p in m.parameters(recurse=False)):
                    m.eval()
        return self

    def fixed_input_size(self) -> tuple[int, int] | None:
        """(H, W) a ViT built for one input size takes (its patch embedding's ``img_size``), or
        None when any size goes (CNNs, ``dynamic_img_size``)."""
        pe = getattr(self.net, "patch_embed", None)
        size = getattr(pe, "img_size", None)
        if size is None or not getattr(pe, "strict_img_size", False) or getattr(self.net, "dynamic_img_size", False):
            return None
        return int(size[0]), int(size[1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4:
            raise ValueError(f"backbone {self.name!r} expects images [B, C, H, W], got shape {tuple(x.shape)}")
        # timm refuses another size with an AssertionError, which the CLI shows as a bug
        # (embedding a folder of other-sized images with a transform that does not resize)
        size = self.fixed_input_size()
        if size is not None and tuple(x.shape[-2:]) != size:
            raise ValueError(f"backbone {self.name!r} was built for {size[0]}x{size[1]} images (model.options.img_size, "
                             f"saved with the run), got {x.shape[-2]}x{x.shape[-1]}: resize the images to that size "
                             f"(data.transform_options), or train with model.options.dynamic_img_size: true")
        out = self.net.forward_features(x)
        if self.nhwc and out.dim() == 4:
            out = out.permute(0, 3, 1, 2)
        return out


def timm_data_config(net: nn.Module, img_size=None) -> dict:
    """The preprocessing ``net``'s pretrained weights expect: timm's
    ``resolve_model_data_config`` (input_size, interpolation, mean, std, crop_pct, crop_mode)
    plus the pretrained config's ``architecture`` / ``tag`` / ``hf_hub_id``; ``img_size`` (the
    model option) replaces the input size."""
    from timm.data import resolve_model_data_config

    cfg = dict(resolve_model_data_config(net))
    if img_size is not None:
        h, w = (img_size, img_size) if isinstance(img_size, int) else tuple(img_size)
        cfg["input_size"] = (cfg["input_size"][0], int(h), int(w))
    cfg["input_size"] = tuple(int(v) for v in cfg["input_size"])
    cfg["mean"], cfg["std"] = tuple(float(v) for v in cfg["mean"]), tuple(float(v) for v in cfg["std"])
    pcfg = getattr(net, "pretrained_cfg", None) or {}
    for key in ("architecture", "tag", "hf_hub_id"):
        if pcfg.get(key):
            cfg[key] = pcfg[key]
    return cfg


def _create_from_hub(arch: str, kwargs: dict) -> nn.Module:
    """``timm.create_model(arch, pretrained=True)``: timm downloads the weights from the Hugging
    Face hub (or finds them in its cache).  Any failure is one ``RuntimeError`` naming the model."""
    import timm

    try:
        return timm.create_model(arch, pretrained=True, **kwargs)
    except Exception as exc:  # huggingface_hub / urllib / timm raise many types when offline
        cfg = _probe_model(arch, **kwargs).pretrained_cfg or {}
        where = cfg.get("hf_hub_id") or cfg.get("url") or "no published weights"
        reason = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise RuntimeError(
            f"could not load the pretrained weights of timm model {arch!r} from the Hugging Face hub ({where}): "
            f"{type(exc).__name__}: {reason}. Offline? Run once with network access (timm caches the file "
            f"under ~/.cache/huggingface), or download it and pass its path: model.options.pretrained=FILE"
        ) from None


def _checkpoint_filter(net: nn.Module):
    """timm's own conversion of weight files for this model (``checkpoint_filter_fn`` of the
    model's module: key renames, position embeddings resampled to the model's grid), or None."""
    return getattr(sys.modules.get(type(net).__module__), "checkpoint_filter_fn", None)


#: the keys timm's ``load_state_dict`` unwraps a checkpoint from, in its order (EMA weights first)
_TIMM_WRAPPER_KEYS = ("state_dict_ema", "model_ema", "state_dict", "model")


def read_timm_file(path) -> dict:
    """A weights file read as timm's ``load_state_dict`` reads it (safetensors, or ``torch.load``
    with ``weights_only=True``; the EMA weights of a training checkpoint first, else its
    ``state_dict`` / ``model``), every value checked to be a tensor: errors name the file in one
    line (:func:`~deepmetric.models.pretrained.read_weights_file`), never torch's advice to
    retry with ``weights_only=False`` nor a filter's error about a value that is no tensor."""
    path = os.fspath(path)
    check_not_a_folder(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"pretrained weights file not found: {path!r} (model.options.pretrained: a "
                                f"local .safetensors / .pth / .bin file with timm's keys, or 'hub')" + no_weights_hint(path))
    # module. / _orig_mod. prefixes stripped (timm strips module.) before the caller looks for backbone.*
    return clean_state_dict(tensor_mapping(path, read_weights_file(path), _TIMM_WRAPPER_KEYS))


def load_timm_weights(backbone: TimmBackbone, path, state: dict | None = None) -> LoadReport:
    """Load timm weights file ``path`` (or its contents ``state``) into ``backbone.net``:
    timm's ``checkpoint_filter_fn`` of the model first, the classifier ignored, every other key
    strict (:func:`~deepmetric.models.load_pretrained`: mismatches name the file and keys)."""
    state = read_timm_file(path) if state is None else dict(state)
    filt = _checkpoint_filter(backbone.net)
    if filt is not None:
        try:
            state = filt(state, backbone.net)
        except Exception as exc:
            raise ValueError(f"weights file {os.fspath(path)!r} does not fit timm model {backbone.name!r}: "
                             f"timm's checkpoint filter failed ({type(exc).__name__}: {exc})") from None
    classifier = (getattr(backbone.net, "pretrained_cfg", None) or {}).get("classifier") or ()
    classifier = (classifier,) if isinstance(classifier, str) else tuple(classifier)
    own = backbone.net.state_dict()
    ignore = tuple(f"{c}." for c in classifier if f"{c}.weight" not in own)
    return load_pretrained(backbone.net, path, ignore_prefixes=ignore, state_dict=state)


def create_timm_backbone(name: str, in_chans: int | None = None, pretrained=None, **options) -> TimmBackbone:
    """:class:`TimmBackbone` ``name`` (``timm/<model>``) with ``pretrained`` None, ``"hub"`` or a
    local file; ``options``: :data:`TIMM_OPTIONS`.  Sets ``pretrained_report``."""
    unknown = sorted(set(options) - set(TIMM_OPTIONS))
    if unknown:
        raise TypeError(f"backbone {name!r} got unknown option(s) {unknown}; its options are {list(TIMM_OPTIONS)}")
    in_chans = 3 if in_chans is None else in_chans
    if not isinstance(in_chans, int) or in_chans < 1:
        raise ValueError(f"in_chans must be a positive int, got {in_chans!r}")
    hub = isinstance(pretrained, str) and pretrained == HUB
    backbone = TimmBackbone(name, in_chans=in_chans, hub=hub, **options)
    backbone.pretrained_report = None
    if hub:  # timm loaded every tensor but the classifier it dropped
        backbone.pretrained_report = LoadReport(path=f"hub:{backbone.pretrained_cfg.get('hf_hub_id', name)}",
                                                loaded=sorted(backbone.net.state_dict()))
    if pretrained is not None and not hub:
        backbone.pretrained_report = load_timm_weights(backbone, pretrained)
    return backbone
