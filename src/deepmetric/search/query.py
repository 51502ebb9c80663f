"""Query side of search: the checkpoint's test preprocessing, reading images with clear errors,
embedding images, and plain search functions returning ``(sims, idx)`` like
:func:`deepmetric.evaluate.knn.knn`.

Preprocessing is exactly what ``deepmetric embed`` / evaluation apply to a test image: the
checkpoint's ``data.transform`` built with ``train=False`` (``resize_crop``: resize to a square
and centre crop; ``short_side``: resize the short side and centre crop; ``glyph`` /
``mnist``: grey levels only), fed the way the dataset feeds it: a PIL image in the dataset's
mode for image files; for the in-memory benchmarks (glyphs, Fashion-MNIST: grey; emoji: RGB)
a ``uint8`` tensor, after resizing the query to the benchmark's square size (``input_size``),
since their pipelines do not resize.

Images are read with :func:`deepmetric.data.decode.decode_image`, the decoder training uses:
EXIF orientation, 16-bit / float scaled to 8 bits, transparent pixels made white (as the emoji
benchmark draws its images), and a decoded-size limit derived from the model's input
(:meth:`Preprocessing.decode_limit`) checked before decoding.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import torch
from PIL import Image

from deepmetric.data.decode import decode_image as _decode, decode_limit, prepare_image

__all__ = ["Preprocessing", "preprocessing_from_config", "load_image",
           "embed_images", "exact_search", "approximate_search"]

# in-memory benchmarks: PIL mode, the option naming their square side, its default, and the
# background transparent pixels are composited onto (emoji are drawn on white; the decoder
# makes every transparent pixel white, so the entry is kept for the manifests' record)
_IN_MEMORY = {"glyphs": ("L", "size", 32, None), "fashion-mnist": ("L", None, 28, None),
              "emoji": ("RGB", "size", 64, "white")}


@dataclass
class Preprocessing:
    """What turns one image into the network's input (the test transform of a checkpoint).

    ``transform`` / ``transform_options``: a :func:`deepmetric.data.build_transform` pipeline
    (``None``: the dataset default, pixels scaled to [0, 1]); ``mode``: the PIL mode images are
    converted to first (:func:`deepmetric.data.decode.prepare_image`: EXIF orientation, 8 bits,
    transparency onto white); ``input_size``: for in-memory benchmarks, the square side queries
    are resized to (bilinear, antialiased) before the transform, which then gets a ``uint8``
    tensor. ``background``: recorded for old manifests; every transparent pixel becomes white.
    """

    transform: str | None = None
    transform_options: dict = field(default_factory=dict)
    mode: str = "RGB"
    input_size: int | None = None
    background: str | None = None

    def __post_init__(self):
        self._pipeline = None
        self._input_shape = None

    def pipeline(self):
        if self._pipeline is None:
            from deepmetric.data import build_transform

            self._pipeline = (build_transform(self.transform, train=False, **self.transform_options)
                              if self.transform is not None else None)
        return self._pipeline

    def __call__(self, img: Image.Image) -> torch.Tensor:
        from torchvision.transforms.v2 import functional as TF

        img = prepare_image(img, self.mode, getattr(img, "filename", "") or "image", copy=False)
        if self.input_size is not None:
            if img.size != (self.input_size, self.input_size):
                img = img.resize((self.input_size, self.input_size), Image.BILINEAR, reducing_gap=None)
            x = TF.pil_to_tensor(img)  # uint8 [C, H, W], as the in-memory datasets give it
        else:
            x = img
        pipe = self.pipeline()
        if pipe is None:
            return TF.to_dtype(TF.to_image(x), torch.float32, scale=True)
        return pipe(x)

    def input_shape(self) -> list[int]:
        """``[C, H, W]`` of the network input made from a square image."""
        if self._input_shape is None:
            side = self.input_size or 256
            self._input_shape = list(self(Image.new(self.mode, (side, side), 128)).shape)
        return self._input_shape

    def decode_limit(self, cap_mb: float | None = None) -> int:
        """Largest decoded query image in bytes: :func:`deepmetric.data.decode.decode_limit`
        of this network input's pixels, capped at ``cap_mb``."""
        shape = self.input_shape()
        return decode_limit(int(shape[-1]) * int(shape[-2]), cap_mb)

    def to_dict(self) -> dict:
        return {"transform": self.transform, "transform_options": dict(self.transform_options),
                "mode": self.mode, "input_size": self.input_size, "background": self.background}

    @classmethod
    def from_dict(cls, d: dict) -> "Preprocessing":
        return cls(transform=d.get("transform"), transform_options=dict(d.get("transform_options") or {}),
                   mode=d.get("mode", "RGB"), input_size=d.get("input_size"), background=d.get("background"))

    def describe(self) -> dict:
        """The resolved steps with their numbers (for export users re-implementing them):
        ``steps`` in order, ``mean`` / ``std`` of the normalisation, ``input_shape`` [C, H, W]
        of the network input (for a square image) and the build recipe."""
        from torchvision.transforms import v2

        steps: list[dict] = [
            {"op": "exif_transpose", "note": "apply the EXIF Orientation tag"},
            {"op": "to_8bit", "note": "16-bit: divide by 257; 32-bit int in 0..65535: divide by 257, "
                                      "else min..max -> 0..255; float in [0, 1]: times 255, else min..max"},
            {"op": "composite_alpha", "background": "white"},
            {"op": "convert", "mode": self.mode}]
        if self.input_size is not None:
            steps.append({"op": "resize", "size": [self.input_size, self.input_size],
                          "interpolation": "bilinear"})
        mean = std = None
        pipe = self.pipeline()
        for t in (pipe.transforms if pipe is not None else []):
            name = type(t).__name__
            if isinstance(t, v2.Resize):
                size = list(t.size) if len(t.size) > 1 else int(t.size[0])
                steps.append({"op": "resize" if len(t.size) > 1 else "resize_shorter_side", "size": size,
                              "interpolation": str(getattr(t.interpolation, "value", t.interpolation)),
                              "antialias": bool(t.antialias)})
            elif isinstance(t, v2.CenterCrop):
                steps.append({"op": "center_crop", "size": list(t.size)})
            elif isinstance(t, v2.Normalize):
                mean, std = list(map(float, t.mean)), list(map(float, t.std))
                steps.append({"op": "normalize", "mean": mean, "std": std})
            elif isinstance(t, v2.ToDtype):
                steps.append({"op": "to_float", "scale": "divide by 255 (values in [0, 1])"})
            elif isinstance(t, v2.Grayscale):
                steps.append({"op": "grayscale", "channels": int(t.num_output_channels)})
            elif isinstance(t, v2.RGB) or name == "RGBImage":
                steps.append({"op": "rgb", "channels": 3})
            elif name == "RepeatChannels":
                steps.append({"op": "repeat_channels", "channels": int(t.channels)})
            elif name != "ToImage":
                steps.append({"op": name})
        if pipe is None:
            steps.append({"op": "to_float", "scale": "divide by 255 (values in [0, 1])"})
        shape = self.input_shape()
        return {"recipe": self.to_dict(), "steps": steps, "mean": mean, "std": std,
                "input_shape": shape, "channels": shape[0], "layout": "NCHW float32"}


def preprocessing_from_config(cfg) -> Preprocessing:
    """The test preprocessing of a training config (``cfg.data``)."""
    d = cfg.data
    name = str(d.name).strip().lower().replace("_", "-")
    name = "fashion-mnist" if name == "fashionmnist" else name
    if name in _IN_MEMORY:
        mode, key, default, background = _IN_MEMORY[name]
        size = int(d.options.get(key, default)) if key else default
        return Preprocessing(d.transform, dict(d.transform_options), mode=mode, input_size=size,
                             background=background)
    return Preprocessing(d.transform, dict(d.transform_options), mode=d.options.get("mode", "RGB"))


def load_image(path: str | Path, *, mode: str | None = "RGB", max_bytes: int | None = None) -> Image.Image:
    """Read an image file with the decoder; FileNotFoundError / ValueError name the path."""
    return _decode(Path(path).expanduser(), mode=mode, max_bytes=max_bytes)


def model_input_error(model: str, shape: tuple[int, ...], exc: Exception) -> ValueError:
    """The error of a network that cannot take the images its checkpoint's preprocessing makes,
    typically one trained on vectors (``data.name: synthetic``) asked to embed image files."""
    reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
    return ValueError(f"{model} cannot embed images: after the checkpoint's preprocessing an image is a tensor of "
                      f"shape {list(shape)}, and the network's forward pass failed on it ({reason}). A model trained "
                      "on vectors (data 'synthetic', an .npz) cannot embed image files: train one on images")


@torch.no_grad()
def embed_images(model: torch.nn.Module, preprocess: Preprocessing,
                 images: Iterable[str | Path | Image.Image], *, batch_size: int = 64,
                 device: str | torch.device = "cpu") -> np.ndarray:
    """l2-normalised float32 embeddings ``[N, d]`` of image files or PIL images."""
    device = torch.device(device)
    model.eval()
    out, batch = [], []

    def flush():
        x = torch.stack(batch).to(device)
        try:
            e = model.forward_head(model.forward_features(x)).float()
        except torch.OutOfMemoryError:
            raise
        except RuntimeError as exc:  # torch's shape error is a traceback in the CLI, and says nothing of why
            raise model_input_error("the checkpoint's model", tuple(x.shape[1:]), exc) from None
        out.append(torch.nn.functional.normalize(e, dim=1).cpu().numpy())
        batch.clear()

    limit = preprocess.decode_limit()
    for im in images:
        batch.append(preprocess(im if isinstance(im, Image.Image)
                                else load_image(im, mode=preprocess.mode, max_bytes=limit)))
        if len(batch) == batch_size:
            flush()
    if batch:
        flush()
    if not out:
        raise ValueError("no images given to embed")
    return np.concatenate(out).astype(np.float32)


def exact_search(gallery: np.ndarray, query: np.ndarray, k: int, memory_mb: float | None = None, *,
                 device: str | torch.device = "cpu", backend: str | None = None):
    """Exact top-``k`` by cosine of l2-normalised ``query`` rows in ``gallery`` (brute force in
    memory-bounded chunks, ties by the smaller index): ``(sims, idx)``, numpy.  On the CPU
    faiss searches; on a CUDA ``device`` both go to the GPU and the torch backend of
    :mod:`deepmetric.evaluate.knn` searches there (same results).  ``backend`` overrides the
    choice (``torch`` on the CPU runs the GPU's code path there)."""
    from deepmetric.evaluate.knn import iter_knn

    device = torch.device(device)
    backend = backend or ("faiss" if device.type == "cpu" else "torch")
    if backend == "torch":
        gallery = torch.as_tensor(np.ascontiguousarray(gallery)).to(device)
        query = torch.as_tensor(np.ascontiguousarray(query)).to(device)
    parts = list(iter_knn(query, gallery, k, backend=backend, memory_mb=memory_mb))
    return np.concatenate([p[1] for p in parts]), np.concatenate([p[2] for p in parts])


def approximate_search(faiss_index, query: np.ndarray, k: int):
    """Top-``k`` from a kept IVF / HNSW faiss index: ``(sims, idx)`` (approximate)."""
    from deepmetric.evaluate.knn import search_approximate_index

    return search_approximate_index(faiss_index, query, k)


def recall_against_exact(gallery: np.ndarray, faiss_index, *, k: int = 10, n_queries: int = 1000,
                         seed: int = 0, device: str | torch.device = "cpu") -> float:
    """Mean share of the exact top-``k`` found by the approximate index, over a seeded sample of
    ``n_queries`` indexed vectors used as queries (each finds itself in both); the exact search
    runs on ``device`` (:func:`exact_search`)."""
    n = gallery.shape[0]
    rows = np.sort(np.random.default_rng(seed).choice(n, size=min(n_queries, n), replace=False))
    q = np.ascontiguousarray(gallery[rows])
    kk = min(k, n)
    _, exact = exact_search(gallery, q, kk, device=device)
    _, approx = approximate_search(faiss_index, q, kk)
    hits = [len(set(a[a >= 0]) & set(e[e >= 0])) / max(1, (e >= 0).sum()) for a, e in zip(approx, exact)]
    return float(np.mean(hits))


def as_query_list(images: str | Path | Image.Image | Sequence) -> list:
    """One image (path or PIL) or a sequence of them -> a list."""
    if isinstance(images, (str, Path, Image.Image)):
        return [images]
    return list(images)
