"""What the run report reads from a run directory besides the log.

* :func:`check_run_dir` - refuses a folder that is not a training run (clear message
  instead of an empty report).
* :func:`find_checkpoint` / :func:`embed_run` - rebuild the model of ``best.pt`` (else
  ``last.pt``) and embed the evaluation split(s), as ``deepmetric embed`` does, plus the
  training split when the model has a classifier (two-head Fig. 10, heated-up Fig. 1).
* :class:`ImageSource` - the evaluation images behind the embedding rows (the split(s)
  rebuilt through the training builders without their transform), for the retrieval
  grids; ``thumbnail(row)`` returns a data URI.
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from deepmetric.run import rundir

from .page import image_data_uri

__all__ = ["check_run_dir", "find_checkpoint", "embed_run", "ImageSource", "image_source_for"]

def check_run_dir(run_dir: Path) -> None:
    if not run_dir.exists():
        raise FileNotFoundError(f"run directory not found: {run_dir}")
    if not run_dir.is_dir():
        raise NotADirectoryError(f"not a run directory: {run_dir} is a file; pass the folder "
                                 f"'deepmetric train' wrote (train.out_dir, e.g. runs/demo)")
    if not rundir.looks_like_run_dir(run_dir):
        inside = sorted(p.name for p in run_dir.iterdir())[:8]
        names = list(dict.fromkeys((*rundir.RUN_FILES, *rundir.CONFIG_NAMES)))
        raise ValueError(
            f"{run_dir} is not a training run: it holds none of {', '.join(names)} "
            f"(found: {', '.join(inside) if inside else 'an empty folder'}). Pass the folder "
            f"'deepmetric train' wrote (its train.out_dir, e.g. runs/demo).")


def find_checkpoint(run_dir: Path) -> Path | None:
    """``best.pt`` (the selected model) if present, else ``last.pt``, else None."""
    for name in (rundir.BEST, rundir.LAST):
        if (run_dir / name).is_file():
            return run_dir / name
    return None


def _eval_splits(cfg, split: str | None) -> tuple[str, str | None]:
    """(query split, gallery split or None) to show: ``split`` if given, else the test split
    of the run's data (In-shop style ``eval.gallery_split`` runs: query + gallery)."""
    if split is not None:
        if split == "query+gallery":
            return "query", "gallery"
        return split, None
    if cfg.eval.gallery_split:
        return cfg.eval.split, cfg.eval.gallery_split
    return "test", None


def _display_cfg(cfg):
    """The run's config with the data transform removed: images as stored, not augmented
    or normalised."""
    c = copy.deepcopy(cfg)
    c.data.transform = None
    c.data.transform_options = {}
    return c


def embed_run(checkpoint: Path, *, split: str | None = None, device: str = "auto",
              batch_size: int = 256, embed_train: bool | None = None) -> tuple[dict, Any]:
    """Embed the evaluation split(s) with the checkpoint's model (``deepmetric embed``-style).

    Returns ``(arrays, cfg)``: ``arrays`` has ``embeddings``, ``labels`` (and ``is_query``
    / ``is_gallery`` for query+gallery data), ``logits`` when the run evaluates a
    classifier (``eval.classification``), and - when ``embed_train`` (default: the model or
    a loss term has a classifier) - ``train_embeddings`` / ``train_labels`` and, for a
    heated-softmax loss, its ``class_weights``.
    """
    from deepmetric.run.device import resolve_device
    from deepmetric.run.embed import compute_embeddings, load_model_from_checkpoint
    from deepmetric.run.builders import build_split as build_dataset_split

    dev = resolve_device(device, name="--device")
    model, losses, cfg, _ = load_model_from_checkpoint(checkpoint, dev)
    q_split, g_split = _eval_splits(cfg, split)
    clf_loss = next((l for l in losses if hasattr(l, "logits")), None)
    # the output the run was evaluated (and best.pt chosen) on
    kw = dict(batch_size=batch_size, device=dev, amp=cfg.train.amp, output=cfg.eval.embedding,
              channels_last=cfg.train.channels_last, num_workers=0)
    # the report's slow part on a CPU (minutes for thousands of images): show it
    q = compute_embeddings(model, build_dataset_split(cfg, q_split, train=False), **kw,
                           with_logits=bool(cfg.eval.classification), loss_with_logits=clf_loss,
                           progress=f"embedding {q_split}")
    arrays: dict[str, np.ndarray] = {"embeddings": q["embeddings"], "labels": q["labels"]}
    if g_split is not None:
        g = compute_embeddings(model, build_dataset_split(cfg, g_split, train=False), **kw,
                               progress=f"embedding {g_split}")
        is_query = np.r_[np.ones(len(q["labels"]), bool), np.zeros(len(g["labels"]), bool)]
        arrays = {"embeddings": np.concatenate([q["embeddings"], g["embeddings"]]),
                  "labels": np.concatenate([q["labels"], g["labels"]]),
                  "is_query": is_query, "is_gallery": ~is_query}
    elif "logits" in q:
        arrays["logits"] = q["logits"]
    heated = next((l for l in losses if type(l).__name__ == "HeatedSoftmaxLoss"), None)
    if embed_train is None:
        embed_train = bool(cfg.eval.classification) or heated is not None
    if embed_train:
        tr = compute_embeddings(model, build_dataset_split(cfg, cfg.data.train_split, train=False), **kw,
                                progress=f"embedding {cfg.data.train_split}")
        arrays["train_embeddings"], arrays["train_labels"] = tr["embeddings"], tr["labels"]
        w = getattr(heated, "weight", None)
        if w is not None and w.ndim == 2 and w.shape[1] == tr["embeddings"].shape[1]:
            arrays["class_weights"] = w.detach().float().cpu().numpy()
    return arrays, cfg


class ImageSource:
    """Rows of the embedding arrays mapped to dataset items: ``parts`` is a list of datasets
    whose items, concatenated, are the rows (query then gallery)."""

    def __init__(self, parts: Sequence[Any], class_names: Sequence[str] | None = None,
                 size: int = 96):
        self.parts = list(parts)
        self.offsets = np.cumsum([0] + [len(p) for p in self.parts])
        self.class_names = list(class_names) if class_names is not None else None
        self.size = size
        self._cache: dict[int, str | None] = {}

    def __len__(self) -> int:
        return int(self.offsets[-1])

    @property
    def labels(self) -> np.ndarray:
        return np.concatenate([np.asarray(p.labels) for p in self.parts])

    def pil(self, row: int):
        from PIL import Image

        j = int(np.searchsorted(self.offsets, row, side="right") - 1)
        ds, i = self.parts[j], int(row - self.offsets[j])
        if ds.load_image is not None:  # file-based datasets: the stored image itself
            return ds.load_image(i)
        arr = ds.images
        if isinstance(arr, np.ndarray) and arr.dtype == np.uint8 and arr.ndim in (3, 4):
            return Image.fromarray(arr[i])
        item = ds[i][0]
        a = np.asarray(item.detach().cpu() if hasattr(item, "detach") else item, dtype=float)
        if a.ndim == 3 and a.shape[0] in (1, 3):
            a = np.moveaxis(a, 0, -1)
        if a.ndim == 3 and a.shape[-1] == 1:
            a = a[..., 0]
        if a.ndim not in (2, 3) or min(a.shape[:2]) < 2:
            return None  # vectors (synthetic data): nothing to draw
        lo, hi = float(a.min()), float(a.max())
        a = (a - lo) / (hi - lo) if hi > lo else np.zeros_like(a)
        return Image.fromarray((a * 255).round().astype(np.uint8))

    def thumbnail(self, row: int) -> str | None:
        if row not in self._cache:
            img = self.pil(int(row))
            self._cache[row] = None if img is None else image_data_uri(img, self.size)
        return self._cache[row]


def _dataset_class_names(ds) -> list[str] | None:
    names = ds.class_names
    return [str(n) for n in names] if names is not None else None


def image_source_for(cfg, labels: np.ndarray, *, has_gallery: bool, split: str | None = None,
                     train: bool = False) -> tuple[ImageSource | None, str]:
    """The evaluation (or, with ``train``, the training) images behind the rows of an
    embeddings array, rebuilt from the run's config. Returns ``(source, note)``; ``source``
    is None (and ``note`` says why) when the dataset cannot be built or its labels do not
    match ``labels`` row for row (an ``.npz`` of another split or order)."""
    from deepmetric.run.builders import build_split as build_dataset_split

    c = _display_cfg(cfg)
    if train:
        splits: tuple = (cfg.data.train_split,)
    else:
        q, g = _eval_splits(cfg, "query+gallery" if has_gallery and split is None else split)
        splits = (q, g) if has_gallery and g is not None else (q,)
    try:
        parts = [build_dataset_split(c, s, train=False) for s in splits]
    except Exception as exc:  # noqa: BLE001 - any failure only drops the images
        return None, f"images not shown: the dataset could not be rebuilt ({type(exc).__name__}: {exc})"
    src = ImageSource(parts, _dataset_class_names(parts[0]))
    try:
        ok = len(src) == len(labels) and np.array_equal(src.labels, np.asarray(labels))
    except AttributeError:
        ok = False
    if not ok:
        return None, (f"images not shown: the rebuilt {'+'.join(splits)} split ({len(src)} images) "
                      f"does not match the embeddings row for row ({len(labels)} rows)")
    return src, f"images: {cfg.data.name} {'+'.join(splits)} split"
