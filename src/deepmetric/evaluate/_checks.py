"""Input validation shared by all metrics: clear errors before anything reaches faiss/torch."""
from __future__ import annotations

import numpy as np
import torch


def to_numpy_labels(labels, n: int | None = None, name: str = "labels") -> np.ndarray:
    """Return ``labels`` as a 1-D int64 array, rejecting floats, strings and wrong lengths."""
    if isinstance(labels, torch.Tensor):
        labels = labels.detach().cpu().numpy()
    arr = np.asarray(labels)
    if arr.dtype == bool or not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{name} must be integers, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(arr.shape)}")
    if n is not None and arr.shape[0] != n:
        raise ValueError(f"{name} has length {arr.shape[0]} but embeddings have {n} rows")
    if arr.shape[0] == 0:
        raise ValueError(f"{name} is empty: nothing to evaluate")
    return arr.astype(np.int64, copy=False)


def check_embeddings(embeddings, name: str = "embeddings"):
    """Validate an N x d float matrix (numpy or torch; any device) and l2-normalise it.

    Returns a float32 torch tensor on the input's device (CUDA stays on CUDA) or a float32
    C-contiguous numpy array for CPU input. Rejects empty input, NaN/inf and all-zero rows
    (which have no direction, so cosine ranking is undefined for them).
    """
    is_torch = isinstance(embeddings, torch.Tensor)
    x = embeddings.detach() if is_torch else torch.from_numpy(np.asarray(embeddings))
    if x.dtype == torch.bool or not (x.is_floating_point() or x.dtype in
                                     (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)):
        raise TypeError(f"{name} must be a float matrix, got dtype {x.dtype}")
    if x.ndim != 2:
        raise ValueError(f"{name} must be 2-D (N x d), got shape {tuple(x.shape)}")
    if x.shape[0] == 0 or x.shape[1] == 0:
        raise ValueError(f"{name} is empty (shape {tuple(x.shape)}): nothing to evaluate")
    # float64 stays float64 until the checks are done: a finite float64 value above float32's
    # range (1e200) must not be reported as infinite, nor a tiny one (1e-300) as zero
    x = x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)
    finite = torch.isfinite(x).all(dim=1)
    if not bool(finite.all()):
        bad = torch.nonzero(~finite).flatten()
        raise ValueError(f"{name} contain NaN or infinite values in {bad.numel()} row(s), "
                         f"first at row {int(bad[0])}")
    peak = x.abs().amax(dim=1)
    zero = peak == 0
    if bool(zero.any()):
        bad = torch.nonzero(zero).flatten()
        raise ValueError(f"{name} contain {bad.numel()} all-zero row(s) (first at row "
                         f"{int(bad[0])}); they cannot be l2-normalised")
    # The squares of a float32 norm overflow above about 1e19 and underflow below 1e-19: such a
    # row (a float32 row of 1e30s) would get an infinite or zero norm and come out all zero.
    # Those rows alone are first divided by their largest |value| (the direction is unchanged);
    # every other row is normalised exactly as before (same float32 rounding).
    extreme = (peak > 1e18) | (peak < 1e-18)
    if bool(extreme.any()):
        x = torch.where(extreme[:, None], x / peak[:, None], x)
    x = x.to(torch.float32)
    norms = torch.linalg.vector_norm(x, dim=1)
    x = x / norms[:, None]
    if x.device.type == "cpu":
        return np.ascontiguousarray(x.numpy())
    return x


def to_mask(mask, n: int, name: str) -> np.ndarray:
    """Validate a boolean selection mask of length ``n`` (None means all True)."""
    if mask is None:
        return np.ones(n, dtype=bool)
    if isinstance(mask, torch.Tensor):
        mask = mask.detach().cpu().numpy()
    arr = np.asarray(mask)
    if arr.dtype != bool:
        raise TypeError(f"{name} must be a boolean array, got dtype {arr.dtype}")
    if arr.shape != (n,):
        raise ValueError(f"{name} must have shape ({n},) like the labels, got {tuple(arr.shape)}")
    if not arr.any():
        raise ValueError(f"{name} selects no sample: the {name.replace('is_', '')} set is empty")
    return arr
