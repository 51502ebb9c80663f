"""``deepmetric export``: the embedding network of a checkpoint as ONNX or TorchScript.

The model is rebuilt with :func:`deepmetric.train.embed.load_model_from_checkpoint` and exported
as ``forward_head(forward_features(x))`` (timm's model contract), the embedding alone: input
``image`` float32 ``[batch, C, H, W]`` (already preprocessed), output ``embedding`` float32
``[batch, d]``, l2-normalised unless ``normalize=False`` (cosine = dot product, as the index
uses). The preprocessing that makes the input from an image file is written beside the
exported file as ``<file name>.preprocessing.json`` (``model.onnx.preprocessing.json``: the
whole name, so an ONNX and a TorchScript export to one stem keep one each; see
:meth:`Preprocessing.describe`).
"""
from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import torch
from torch import nn

from .query import preprocessing_from_config

__all__ = ["EmbeddingOnly", "export_model", "FORMATS", "preprocessing_path"]

FORMATS = ("onnx", "torchscript")


class EmbeddingOnly(nn.Module):
    """``model.forward_head(model.forward_features(x))``, optionally l2-normalised: the embedding
    network with one tensor output (the classifier and the pooled features of the model's
    ``forward`` dict are not part of it)."""

    def __init__(self, model: nn.Module, normalize: bool = True):
        super().__init__()
        self.model = model
        self.normalize = bool(normalize)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = self.model.forward_head(self.model.forward_features(x))
        if self.normalize:
            e = nn.functional.normalize(e, dim=1)
        return e


def preprocessing_path(out: str | Path) -> Path:
    """``model.onnx`` -> ``model.onnx.preprocessing.json`` (the whole file name, so ``model.onnx``
    and ``model.pt`` do not share one)."""
    out = Path(out)
    return out.with_name(out.name + ".preprocessing.json")


def postprocess_entry(cfg) -> dict:
    """The export JSON's ``postprocess``: the config's ``search.postprocess`` steps and how other
    engines reproduce them (docs/search.md, "Post-processing")."""
    steps = list(getattr(getattr(cfg, "search", None), "postprocess", None) or [])
    return {"steps": steps, "order": "whiten -> dba -> aqe -> kreciprocal, after the l2-normalised embedding",
            "how": ("whiten: y = l2normalise((x - whiten_mean) @ whiten_projection), fitted on the gallery when it is "
                    "indexed (INDEX_DIR/postprocess.npz); dba: each gallery vector replaced by "
                    "l2normalise(sum over itself and its k-1 nearest gallery vectors of max(cos, 0)^alpha * vector); "
                    "aqe: each query replaced by l2normalise(query + sum over its k nearest gallery vectors of "
                    "max(cos, 0)^alpha * vector); kreciprocal: re-rank the first `candidates` neighbours by "
                    "Zhong et al. (CVPR 2017) eq. 12 (deepmetric.search.postprocess)")}


def export_model(checkpoint: str | Path, out: str | Path, fmt: str = "onnx", *,
                 normalize: bool = True, opset: int = 17) -> tuple[Path, Path]:
    """Write the embedding network of ``checkpoint`` to ``out`` and its preprocessing JSON
    beside it; returns both paths."""
    from deepmetric.train.embed import load_model_from_checkpoint

    if fmt not in FORMATS:
        raise ValueError(f"export format must be one of {FORMATS}, got {fmt!r}")
    if not Path(checkpoint).is_file():
        raise FileNotFoundError(f"checkpoint {checkpoint} not found (expected last.pt / best.pt of 'deepmetric train')")
    model, _, cfg, _ = load_model_from_checkpoint(checkpoint, "cpu")
    pre = preprocessing_from_config(cfg)
    desc = pre.describe()
    net = EmbeddingOnly(model, normalize).eval()
    example = torch.zeros(2, *desc["input_shape"])
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with torch.no_grad(), warnings.catch_warnings():
        # tracing warns about shape checks (constant for a fixed input size) and jit's deprecation
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        warnings.simplefilter("ignore", FutureWarning)  # torch.jit.trace
        warnings.simplefilter("ignore", DeprecationWarning)  # the TorchScript-based ONNX exporter
        dim = int(net(example).shape[1])
        if fmt == "torchscript":
            traced = torch.jit.trace(net, example, check_trace=False)
            traced.save(str(out))
        else:
            torch.onnx.export(net, (example,), str(out), input_names=["image"], output_names=["embedding"],
                              dynamic_axes={"image": {0: "batch"}, "embedding": {0: "batch"}},
                              opset_version=opset, dynamo=False)
    info = {"format": fmt, "file": out.name, "input": {"name": "image", "shape": ["batch", *desc["input_shape"]],
                                                        "dtype": "float32"},
            "output": {"name": "embedding", "shape": ["batch", dim], "dtype": "float32",
                       "l2_normalized": bool(normalize)},
            "preprocessing": desc, "checkpoint": str(Path(checkpoint).resolve()),
            "model": cfg.model.name, "postprocess": postprocess_entry(cfg)}
    side = preprocessing_path(out)
    tmp = side.with_name(f".{side.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(info, indent=1))
    os.replace(tmp, side)
    return out, side
