"""``deepmetric export``: the embedding network of a checkpoint as ONNX or TorchScript.

The model is rebuilt with :func:`deepmetric.run.embed.load_search_network` and exported
as ``forward_head(forward_features(x))`` (timm's model contract), the embedding alone, of the
output the checkpoint's ``eval.embedding`` names, as ``deepmetric index`` embeds (the JSON's
``output.model_output``: ``embedding`` or ``projection``): input
``image`` float32 ``[batch, C, H, W]`` (already preprocessed), output ``embedding`` float32
``[batch, d]``, l2-normalised unless ``normalize=False`` (cosine = dot product, as the index
uses). The preprocessing that makes the input from an image file is written beside the
exported file as ``<file name>.preprocessing.json`` (``model.onnx.preprocessing.json``: the
whole name, so an ONNX and a TorchScript export to one stem keep one each; see
:meth:`Preprocessing.describe`).
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import warnings
from pathlib import Path

import torch
from torch import nn

from .query import model_input_error, preprocessing_from_config

__all__ = ["EmbeddingOnly", "export_model", "check_finite_weights", "FORMATS", "preprocessing_path"]

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


def check_finite_weights(model: nn.Module, checkpoint) -> None:
    """ValueError naming the first parameter or buffer with NaN / infinite values: such a
    network embeds every image as NaN, so it is never exported."""
    for name, t in model.state_dict().items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise ValueError(f"checkpoint {checkpoint}: weight {name!r} holds {bad} NaN or infinite value(s); "
                             "the network would embed every image as NaN. Export an earlier checkpoint "
                             "(best.pt) or retrain (a diverged run: lower optim.lr)")


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


def _opset_error(opset: int, exc: Exception) -> ValueError:
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return ValueError(f"--opset {opset}: torch {torch.__version__} cannot export this model to ONNX at opset "
                      f"{opset} ({reason[:200]}); use the default 17 or another opset the installed torch "
                      "supports (its TorchScript exporter: about 9 to 20)")


@contextlib.contextmanager
def _quiet_stdout():
    """File descriptor 1 goes to the null device for the duration (C++ output included)."""
    sys.stdout.flush()
    saved, null = os.dup(1), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    try:
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(null)


def _write(net: nn.Module, example: torch.Tensor, path: Path, fmt: str, opset: int) -> int:
    """Trace / export ``net`` to ``path``; returns the embedding size."""
    with torch.no_grad(), warnings.catch_warnings():
        # tracing warns about shape checks (constant for a fixed input size) and jit's deprecation
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        warnings.simplefilter("ignore", FutureWarning)  # torch.jit.trace
        warnings.simplefilter("ignore", DeprecationWarning)  # the TorchScript-based ONNX exporter
        warnings.simplefilter("ignore", UserWarning)  # an opset newer than the exporter's tested ones
        try:
            dim = int(net(example).shape[1])
        except RuntimeError as exc:  # a model of vectors given an image-shaped example: a traceback otherwise
            raise model_input_error("the checkpoint's model", tuple(example.shape[1:]), exc) from None
        if fmt == "torchscript":
            traced = torch.jit.trace(net, example, check_trace=False)
            traced.save(str(path))
            return dim
        try:  # torch's C++ prints the whole graph to stdout when an op fails: the error says enough
            with _quiet_stdout():
                torch.onnx.export(net, (example,), str(path), input_names=["image"], output_names=["embedding"],
                                  dynamic_axes={"image": {0: "batch"}, "embedding": {0: "batch"}},
                                  opset_version=opset, dynamo=False)
        except (torch.onnx.OnnxExporterError, RuntimeError, ValueError) as exc:
            raise _opset_error(opset, exc) from None
    return dim


def export_model(checkpoint: str | Path, out: str | Path, fmt: str = "onnx", *,
                 normalize: bool = True, opset: int = 17) -> tuple[Path, Path]:
    """Write the embedding network of ``checkpoint`` to ``out`` and its preprocessing JSON
    beside it; returns both paths. A checkpoint with NaN / infinite weights and an opset the
    installed torch cannot export to are ValueErrors; ``out`` is written whole or not at all."""
    from deepmetric.run.embed import load_search_network

    if fmt not in FORMATS:
        raise ValueError(f"export format must be one of {FORMATS}, got {fmt!r}")
    if isinstance(opset, bool) or not isinstance(opset, int) or opset < 1:
        raise ValueError(f"--opset must be a positive whole number (an ONNX opset version), got {opset!r}")
    if not Path(checkpoint).is_file():
        raise FileNotFoundError(f"checkpoint {checkpoint} not found (expected last.pt / best.pt of 'deepmetric train')")
    out = Path(out)
    if out.is_dir():
        raise IsADirectoryError(f"--out {out} is a folder; give a file name such as {out / 'model.onnx'}")
    # the output the checkpoint's validation chose it on (eval.embedding), as 'deepmetric index' embeds
    model, cfg, _, output = load_search_network(checkpoint, "cpu")
    check_finite_weights(model, checkpoint)
    pre = preprocessing_from_config(cfg)
    desc = pre.describe()
    net = EmbeddingOnly(model, normalize).eval()
    example = torch.zeros(2, *desc["input_shape"])
    out.parent.mkdir(parents=True, exist_ok=True)
    part = out.with_name(f".{out.name}.tmp{os.getpid()}")  # written whole, then renamed
    try:
        dim = _write(net, example, part, fmt, opset)
        os.replace(part, out)
    finally:
        part.unlink(missing_ok=True)
    info = {"format": fmt, "file": out.name, "input": {"name": "image", "shape": ["batch", *desc["input_shape"]],
                                                        "dtype": "float32"},
            "output": {"name": "embedding", "shape": ["batch", dim], "dtype": "float32",
                       "l2_normalized": bool(normalize), "model_output": output},
            "preprocessing": desc, "checkpoint": str(Path(checkpoint).resolve()),
            "model": cfg.model.name, "postprocess": postprocess_entry(cfg)}
    side = preprocessing_path(out)
    tmp = side.with_name(f".{side.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(info, indent=1))
    os.replace(tmp, side)
    return out, side
