"""Loading weights from a local file the user names (nothing is ever downloaded).

Supported files:

* a PyTorch state dict saved with ``torch.save`` (``.pth`` / ``.pt`` / ``.bin`` / anything
  not ending in ``.safetensors``), read with ``torch.load(..., weights_only=True)`` so that
  no pickled code is executed.  A checkpoint dict that wraps the weights under
  ``"state_dict"``, ``"model"`` or ``"model_state_dict"`` is unwrapped.
* a ``.safetensors`` file (``safetensors.torch.load_file``).

Key names follow torchvision / timm: ``module.`` (DataParallel / DDP) and ``_orig_mod.``
(``torch.compile``) prefixes are stripped, the old DenseNet key style
(``norm.1.weight`` instead of ``norm1.weight``) is renamed, and keys of the original
ImageNet classifier that our models replace (``fc.``, ``classifier.``, ...) can be ignored.
Missing / unexpected keys and shape mismatches raise a ``ValueError`` that names the file
and the offending keys.
"""
from __future__ import annotations

import argparse
import os
import re
import warnings
from dataclasses import dataclass, field
from typing import Iterable, Mapping

import torch
from torch import nn

from deepmetric.files import HEAD_BYTES, text_start

__all__ = [
    "LoadReport",
    "no_weights_hint",
    "read_state_dict",
    "read_weights_file",
    "check_not_a_folder",
    "tensor_mapping",
    "weights_only_reason",
    "clean_state_dict",
    "load_pretrained",
]

_WRAPPER_KEYS = ("state_dict", "model", "model_state_dict")
_STRIP_PREFIXES = ("module.", "_orig_mod.")
# torchvision's own fix-up for DenseNet files saved before PyTorch 0.4 renamed the layers.
_DENSENET_OLD_KEY = re.compile(
    r"^(.*denselayer\d+\.(?:norm|relu|conv))\.((?:[12])\.(?:weight|bias|running_mean|running_var|num_batches_tracked))$"
)


@dataclass
class LoadReport:
    """What :func:`load_pretrained` did: keys loaded, and keys it ignored on purpose."""

    path: str
    loaded: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        return (
            f"{self.path}: loaded {len(self.loaded)} tensors, ignored {len(self.ignored)} "
            f"(replaced classifier), missing {len(self.missing)}, unexpected {len(self.unexpected)}"
        )


def _fmt_keys(keys: list[str], limit: int = 10) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f", ... ({len(keys) - limit} more)" if len(keys) > limit else "")


def read_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Read a state dict from a local ``.pth``/``.pt`` or ``.safetensors`` file (CPU tensors).

    Raises ``FileNotFoundError`` naming the path if it does not exist and ``ValueError`` if
    the file holds something other than a mapping of names to tensors.
    """
    path = os.fspath(path)
    check_not_a_folder(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"pretrained weights file not found: {path!r} (deepmetric never downloads weights; "
            "pass the path of a local .pth/.pt state dict or .safetensors file)" + no_weights_hint(path)
        )
    return tensor_mapping(path, read_weights_file(path), _WRAPPER_KEYS)


def no_weights_hint(path: str) -> str:
    """For a missing weights file named like "no weights" (``none``, ``None``, ``false``, ``""``;
    YAML's null is ``null`` or ``~``, and the string 'none' was looked for as a file): how to say it."""
    if str(path).strip().lower() in ("none", "false", "no", "off", ""):
        return "; for no pretrained weights write model.options.pretrained: null (YAML's null; 'none' is a string)"
    return ""


def check_not_a_folder(path: str) -> None:
    """A folder given as the weights file (a hub download's folder, a run directory) is said to
    be one, not reported as a file that is not found."""
    if os.path.isdir(path):
        raise IsADirectoryError(f"pretrained weights {path!r} is a folder; pass the weights file inside it "
                                "(.safetensors, .pth, .bin)")


def read_weights_file(path: str) -> object:
    """What the existing file ``path`` holds: ``safetensors``' tensors, or ``torch.load`` with
    ``weights_only=True`` (nothing pickled runs).  ``ValueError`` in one line naming the file
    when it cannot be read (empty, text, truncated, pickled code)."""
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        try:
            return load_file(path, device="cpu")
        except Exception as exc:  # safetensors raises its own error types
            raise ValueError(f"could not read safetensors file {path!r}: {unreadable_reason(path, exc)}") from None
    try:
        # argparse.Namespace: timm's training checkpoints keep their arguments in one (timm
        # allows it too); a plain attribute holder, no more able to run code than a dict
        with torch.serialization.safe_globals([argparse.Namespace]), warnings.catch_warnings():
            # a plain pickle (not torch.save) draws a warning about its protocol before the
            # refusal below: a second line above the one error line
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ValueError(
            f"could not read {path!r} with torch.load(weights_only=True): {unreadable_reason(path, exc)}. "
            "Save plain state dicts (model.state_dict()) or use .safetensors."
        ) from None


def tensor_mapping(path: str, obj: object, wrapper_keys: Iterable[str] = _WRAPPER_KEYS) -> dict[str, torch.Tensor]:
    """``obj`` (read from ``path``) as a state dict: unwrapped from the first of
    ``wrapper_keys`` that holds a mapping, every value a tensor, else ``ValueError`` naming the
    file and the entries that are not tensors."""
    if isinstance(obj, Mapping):
        for key in wrapper_keys:
            inner = obj.get(key)
            if isinstance(inner, Mapping):
                obj = inner
                break
    if not isinstance(obj, Mapping):
        raise ValueError(f"{path!r} does not contain a state dict (got {type(obj).__name__})")
    bad = [k for k, v in obj.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise ValueError(
            f"{path!r} is not a plain state dict: entries {_fmt_keys([str(b) for b in bad])} are not tensors"
        )
    return dict(obj)


def unreadable_reason(path: str, exc: Exception) -> str:
    """Why the weights file ``path`` could not be read, in one line: empty, a text file (a
    config or a note saved under a weights name; torch.load would say ``KeyError: 101``), or
    the reader's own reason (:func:`weights_only_reason`)."""
    try:
        with open(path, "rb") as f:
            head = f.read(HEAD_BYTES)
    except OSError:
        head = None
    if head == b"":
        return "the file is empty (0 bytes)"
    first = text_start(head) if head else None
    if first:
        return f"it is a text file (it starts with {first[:40]!r}), not a weights file"
    return weights_only_reason(exc)


def clean_state_dict(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Strip ``module.`` / ``_orig_mod.`` prefixes and rename old-style DenseNet keys."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        changed = True
        while changed:
            changed = False
            for prefix in _STRIP_PREFIXES:
                if key.startswith(prefix):
                    key = key[len(prefix):]
                    changed = True
            # DDP wrapping a compiled model: prefixes may also appear after "backbone." etc.
            for prefix in _STRIP_PREFIXES:
                key = key.replace("." + prefix, ".")
        m = _DENSENET_OLD_KEY.match(key)
        if m:
            key = m.group(1) + m.group(2)
        out[key] = value
    return out


def load_pretrained(
    module: nn.Module,
    path: str | os.PathLike,
    *,
    ignore_prefixes: Iterable[str] = (),
    strict: bool = True,
    state_dict: Mapping[str, torch.Tensor] | None = None,
) -> LoadReport:
    """Copy weights from the local file ``path`` into ``module`` (in place).

    Args:
        module: the module to fill.
        path: local ``.pth``/``.pt`` or ``.safetensors`` file.
        ignore_prefixes: keys in the file starting with one of these are skipped when the
            module has no such key (e.g. ``"fc."`` for the ImageNet classifier we replace).
        strict: if True (default), keys of the module that the file lacks, and keys of the
            file that the module lacks (other than ignored ones), raise ``ValueError``.
            If False they are only reported in the returned :class:`LoadReport`.
        state_dict: already-read contents of ``path`` (to avoid reading it twice).

    Shape mismatches always raise ``ValueError`` listing every offending key with both shapes.
    """
    path = os.fspath(path)
    sd = clean_state_dict(read_state_dict(path) if state_dict is None else state_dict)
    own = module.state_dict()
    prefixes = tuple(ignore_prefixes)
    report = LoadReport(path=path)

    mismatched = []
    to_load: dict[str, torch.Tensor] = {}
    for key, value in sd.items():
        if key in own:
            if tuple(own[key].shape) != tuple(value.shape):
                mismatched.append(
                    f"{key}: file {tuple(value.shape)} vs model {tuple(own[key].shape)}"
                )
            else:
                to_load[key] = value
        elif prefixes and key.startswith(prefixes):
            report.ignored.append(key)
        else:
            report.unexpected.append(key)
    # num_batches_tracked is absent from some old files and carries no learned information.
    report.missing = [
        k for k in own if k not in sd and not k.endswith("num_batches_tracked")
    ]
    if mismatched:
        raise ValueError(
            f"shape mismatch loading {path!r} into {type(module).__name__}: "
            + "; ".join(mismatched[:10])
            + (f"; ... ({len(mismatched) - 10} more)" if len(mismatched) > 10 else "")
        )
    if strict and (report.missing or report.unexpected):
        parts = []
        if report.missing:
            parts.append(f"missing keys (in model, not in file): {_fmt_keys(report.missing)}")
        if report.unexpected:
            parts.append(f"unexpected keys (in file, not in model): {_fmt_keys(report.unexpected)}")
        raise ValueError(
            f"weights in {path!r} do not match {type(module).__name__}: " + "; ".join(parts)
        )
    module.load_state_dict(to_load, strict=False)
    report.loaded = sorted(to_load)
    return report


def weights_only_reason(exc: Exception) -> str:
    """``torch.load(weights_only=True)``'s reason for refusing a file, in one line and without
    its advice to retry with ``weights_only=False`` (which would run any code the file holds)."""
    text = str(exc)
    if "WeightsUnpickler error:" in text:
        parts = [t.strip() for t in text.split("WeightsUnpickler error:", 1)[1].split("\n\n")]
        detail = next((t for t in parts if t and not t.startswith("Check the documentation")), "")
        detail = detail.split(" Please use `torch.serialization")[0].strip()[:200]
        # "Unsupported global": a class or function; "Unsupported operand": a plain pickle (not a
        # torch.save file) whose operations the safe loader refuses: either may run code
        if detail.startswith(("Unsupported global", "Unsupported operand")):
            return f"it holds Python objects other than tensors and plain values ({detail})"
        return f"not a file written by torch.save, or a damaged one ({detail or type(exc).__name__})"
    first = text.split("This is an internal")[0].strip().split("\n")[0].strip().rstrip(".")
    return f"{type(exc).__name__}: {first[:200]}"
