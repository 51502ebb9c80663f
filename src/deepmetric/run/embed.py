"""Embedding a dataset with a model, loading a trained model back, and ``deepmetric embed``.

``compute_embeddings`` runs the model in eval mode over a dataset (sequential batches, no
augmentation, pinned host memory when the model is on CUDA) and returns float32 numpy arrays
(or a tensor left on the model's device).  ``load_model_from_checkpoint`` rebuilds a
checkpoint's model and loss terms from its stored config.  ``embed_checkpoint`` does that and
writes the ``.npz`` that ``deepmetric evaluate`` reads (``embeddings``, ``labels`` and, for
query/gallery data, ``is_query`` and ``is_gallery``).  Evaluating the embeddings is
:mod:`deepmetric.run.evaluation`.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset

from .builders import build_split, build_losses, build_model
from .checkpoint import load_checkpoint, state_dict_mismatch
from .config_io import config_from_dict
from .device import autocast_context, resolve_device
from .shards import torchrun_world

__all__ = ["compute_embeddings", "embed_checkpoint", "load_model_from_checkpoint", "load_search_network",
           "ProjectionAsEmbedding", "dataset_query_gallery_masks",
           "dataset_paths_and_class_names", "dataset_domains", "EMBEDDING_OUTPUTS", "make_eval_loader",
           "npz_out_path", "check_finite_embeddings"]

# compute_embeddings(output=...): forward_head(fmap), forward_head(fmap, pre_logits=True) and the
# projection head's output (forward's "projection", eval.embedding: projection)
EMBEDDING_OUTPUTS = ("embedding", "features", "projection")


def make_eval_loader(dataset: Dataset, *, batch_size: int, device: torch.device | str,
                     num_workers: int = 0) -> DataLoader:
    """The sequential loader :func:`compute_embeddings` reads: page-locked (pinned) batches
    exactly when the model runs on CUDA, so that the host-to-GPU copies are asynchronous
    (``non_blocking``); no ``persistent_workers``: the loader is made for one pass (one
    evaluation) and its workers end with it."""
    return DataLoader(dataset, batch_size=batch_size, shuffle=False, num_workers=num_workers,
                      pin_memory=torch.device(device).type == "cuda")


@torch.no_grad()
def compute_embeddings(model: nn.Module, dataset: Dataset, *, batch_size: int = 256,
                       device: torch.device | str = "cpu", amp: str = "none",
                       channels_last: bool = False, num_workers: int = 0,
                       with_logits: bool = False, loss_with_logits: nn.Module | None = None,
                       output: str = "embedding", with_paths: bool = False,
                       progress: str | None = None, as_tensor: bool = False) -> dict:
    """Embed every sample of ``dataset`` in order.

    ``output`` names the model output kept as ``"embeddings"``: ``"embedding"`` (the trained
    head, ``model.forward_head(model.forward_features(x))``) or ``"features"`` (the backbone's
    pooled features, ``forward_head(..., pre_logits=True)``, e.g. ImageNet features before any
    training) or ``"projection"`` (the SimCLR projection head's output, ``forward(x)["projection"]``:
    what a ``loss.N.input: projection`` term reads; ``eval.embedding: projection``).

    Returns ``{"embeddings": float32 [N, k], "labels": int64 [N]}`` plus ``"logits"`` when
    ``with_logits`` and the model outputs them (or ``loss_with_logits.logits(emb)`` exists).
    ``as_tensor``: ``"embeddings"`` is a float32 torch tensor left on ``device`` (on a GPU:
    no copy to the host per batch, ready for a search on the GPU) instead of a numpy array.
    The model's train/eval mode is restored afterwards. ``progress``: a label for a tqdm bar
    over the batches (none when None).
    """
    if output not in EMBEDDING_OUTPUTS:
        raise ValueError(f"compute_embeddings: output must be one of {EMBEDDING_OUTPUTS}, got {output!r}")
    device = torch.device(device)
    was_training = model.training
    model.eval()
    loader = make_eval_loader(dataset, batch_size=batch_size, device=device, num_workers=num_workers)
    embs, labels, logits = [], [], []
    try:
        if progress is not None:
            from tqdm.auto import tqdm

            loader = tqdm(loader, desc=progress, unit="batch", leave=False)
        for x, y in loader:
            x = x.to(device, non_blocking=True)
            if channels_last and x.dim() == 4:
                x = x.contiguous(memory_format=torch.channels_last)
            with autocast_context(device, amp):
                if with_logits or output == "projection":  # logits, projection: only in forward's dict
                    out = model(x)
                    if output not in out:
                        raise ValueError(f"config key 'eval.embedding': {output!r}, but the model has no "
                                         f"projection head (set model.options.projection)")
                else:
                    out = {output: model.forward_head(model.forward_features(x),
                                                      pre_logits=output == "features")}
            e = out[output].float()
            embs.append(e if as_tensor else e.cpu())
            labels.append(torch.as_tensor(y).cpu())
            if with_logits:
                if "logits" in out:
                    logits.append(out["logits"].float().cpu())
                elif loss_with_logits is not None and hasattr(loss_with_logits, "logits"):
                    logits.append(loss_with_logits.logits(e).float().cpu())
    finally:
        model.train(was_training)
    if as_tensor:
        emb = torch.cat(embs) if embs else torch.zeros((0, 0), dtype=torch.float32, device=device)
    else:
        emb = torch.cat(embs).numpy().astype(np.float32) if embs else np.zeros((0, 0), np.float32)
    result = {
        "embeddings": emb,
        "labels": torch.cat(labels).numpy().astype(np.int64) if labels else np.zeros(0, np.int64),
    }
    if logits:
        result["logits"] = torch.cat(logits).numpy()
    if with_paths:
        result.update(dataset_paths_and_class_names(dataset))
    return result


def dataset_paths_and_class_names(dataset) -> dict[str, np.ndarray]:
    """``{"paths": str [N], "class_names": str [C]}`` for the datasets that have them (image files,
    named classes); string arrays, so ``np.load(..., allow_pickle=False)`` reads them."""
    out = {}
    paths = dataset.paths
    if paths is not None:
        out["paths"] = np.asarray([str(Path(p).resolve()) for p in paths], dtype=str)
    names = dataset.class_names or dataset.class_ids
    if names:
        out["class_names"] = np.asarray([str(c) for c in names], dtype=str)
    return out


def dataset_query_gallery_masks(dataset) -> dict[str, np.ndarray]:
    """``{"is_query": ..., "is_gallery": ...}`` when ``dataset`` carries both boolean masks
    (one entry per sample; e.g. the ``test`` split of the glyphs ``cross_family`` protocol),
    else ``{}`` (every sample is a query against all the others)."""
    q, g = dataset.is_query, dataset.is_gallery
    if q is None or g is None:
        return {}
    q, g = np.asarray(q, dtype=bool), np.asarray(g, dtype=bool)
    if q.shape != (len(dataset),) or g.shape != (len(dataset),):
        raise ValueError(f"{type(dataset).__name__}: is_query / is_gallery must have one entry per "
                         f"sample ({len(dataset)}), got shapes {q.shape} / {g.shape}")
    return {"is_query": q, "is_gallery": g}


def dataset_domains(dataset) -> tuple[np.ndarray, list[str]] | None:
    """``(domain id per sample, domain names)`` of a dataset that has domains: ``domain_ids`` /
    ``domain_names``, or the emoji benchmark's ``vendor_ids`` / ``vendors``; else ``None``."""
    for ids, names in ((dataset.domain_ids, dataset.domain_names), (dataset.vendor_ids, dataset.vendors)):
        if ids is None:
            continue
        ids = np.asarray(ids)
        if ids.shape != (len(dataset),):  # e.g. a class subset forwarding its parent's array
            return None
        return ids.astype(np.int64), ([str(n) for n in names] if names is not None
                                       else [str(i) for i in range(int(ids.max()) + 1)])
    return None


def load_model_from_checkpoint(path: str | Path, device: str | torch.device = "cpu"):
    """Rebuild the model (and loss terms) of a training checkpoint.

    The checkpoint holds every weight of the model, so the model is built without
    ``model.options.pretrained`` (the file may have moved, the hub may be out of reach) and
    filled from the checkpoint alone.  Returns ``(model, losses, cfg, state)``; the model is in
    eval mode on ``device``.  A checkpoint whose config, model or loss terms cannot be rebuilt
    (a model that no longer exists, weights of another shape, an edited file) is one
    ``ValueError`` naming the file.
    """
    state = load_checkpoint(path)
    model_args = state.get("model_args", {})
    if not isinstance(model_args, dict):  # an edited file; .get() below would be an AttributeError
        raise ValueError(f"checkpoint {path}: 'model_args' is of type {type(model_args).__name__}, expected a "
                         "mapping (num_classes, embedding_dim); the file was edited or damaged")
    num_classes = model_args.get("num_classes")
    with _rebuilding(path, "its config"):
        cfg = config_from_dict(state["config"])
    with _rebuilding(path, f"its model {cfg.model.name!r}"):
        model = build_model(cfg, num_classes=num_classes, pretrained=False)
    _load_weights(path, "model", model, state["model"])
    with _rebuilding(path, "its loss terms"):
        losses = build_losses(cfg, num_classes=num_classes, embedding_dim=model_args.get("embedding_dim"),
                              projection_dim=model.projection_dim)
    for i, (loss, ls) in enumerate(zip(losses, state.get("loss", []))):
        _load_weights(path, f"loss term {i} ({cfg.loss[i].name})", loss, ls)
    device = torch.device(device)
    model.to(device).eval()
    losses.to(device).eval()
    return model, losses, cfg, state


@contextlib.contextmanager
def _rebuilding(path, what: str):
    """A config error met while rebuilding ``what`` of checkpoint ``path`` names the checkpoint
    (the user gave a checkpoint, not a config: 'unknown model' alone would not say which file)."""
    try:
        yield
    except (ValueError, TypeError, KeyError) as exc:
        reason = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        raise ValueError(f"checkpoint {path}: cannot rebuild {what} from the config it holds: {reason}") from None


def _load_weights(path, what: str, module: nn.Module, saved) -> None:
    """``module.load_state_dict(saved)``; a mismatch is one line naming the checkpoint and the
    first offending tensors (torch's own message spans several lines, and for a loss term it
    was a RuntimeError, which the CLI shows as a traceback)."""
    if not isinstance(saved, dict):
        raise ValueError(f"checkpoint {path}: its saved {what} weights are of type {type(saved).__name__}, "
                         "expected a mapping (name -> tensor); the file was edited or damaged")
    try:
        module.load_state_dict(saved)
    except (RuntimeError, TypeError, ValueError) as exc:
        detail = state_dict_mismatch(saved, module) or " ".join(str(exc).split())[:300]
        raise ValueError(f"checkpoint {path}: its saved {what} weights do not fit the {what} its config "
                         f"builds: {detail}") from None


class ProjectionAsEmbedding(nn.Module):
    """``model`` whose ``forward_head`` gives its SimCLR projection head's output
    (``projection(forward_head(fmap))``, as :class:`~deepmetric.models.EmbeddingModel`'s
    ``forward`` computes ``"projection"``): the network that index, search, serve and export
    read from a checkpoint trained with ``eval.embedding: projection``, so that they embed with
    the output its validation chose best.pt on.  ``forward``'s dict has that output as
    ``"embedding"`` too; ``pre_logits=True`` still gives the pooled features."""

    def __init__(self, model: nn.Module):
        super().__init__()
        if getattr(model, "projection", None) is None:
            raise ValueError("eval.embedding 'projection': the checkpoint's model has no projection head")
        self.model = model
        self.num_features = model.num_features
        self.embedding_dim = model.projection_dim

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.forward_features(x)

    def forward_head(self, fmap: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        if pre_logits:
            return self.model.forward_head(fmap, pre_logits=True)
        return self.model.projection(self.model.forward_head(fmap))

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        out = dict(self.model(x))
        out["embedding"] = out["projection"]
        return out


def load_search_network(path: str | Path, device: str | torch.device = "cpu", output: str | None = None):
    """``(network, cfg, state, output)`` of a checkpoint as search reads it: ``network``'s
    ``forward_head`` gives ``output`` (default: the checkpoint's ``eval.embedding``, the output
    its validation chose best.pt on; ``"embedding"``: the model itself; ``"projection"``:
    :class:`ProjectionAsEmbedding`)."""
    model, _, cfg, state = load_model_from_checkpoint(path, device)
    output = output or str(cfg.eval.embedding)
    if output not in ("embedding", "projection"):
        raise ValueError(f"checkpoint {path}: cannot search its {output!r} output (expected 'embedding' or "
                         "'projection', config key eval.embedding)")
    network = model if output == "embedding" else ProjectionAsEmbedding(model).to(device).eval()
    return network, cfg, state, output


def _embed_sharded(model, ds, out, checkpoint, kw: dict, shard_size: int | None) -> dict | None:
    """``compute_embeddings`` of ``ds`` over torchrun ranks (:mod:`deepmetric.run.shards`):
    rank 0 gets the whole result, the others ``None``."""
    import hashlib

    from .shards import DEFAULT_SHARD_SIZE, ShardPlan, torchrun_group

    with torchrun_group() as (rank, world):
        h = hashlib.sha256(Path(checkpoint).read_bytes()).hexdigest()
        plan = ShardPlan(out, rank=rank, world_size=world, shard_size=shard_size or DEFAULT_SHARD_SIZE,
                         checkpoint_sha256=h)
        paths = ds.paths
        names = [str(p) for p in (paths if paths is not None else range(len(ds)))]
        if ds.labels is None:
            raise ValueError(f"embedding over torchrun needs a dataset with labels; {type(ds).__name__} has none")

        def embed(rows):
            return compute_embeddings(model, Subset(ds, rows), **{**kw, "with_paths": False})["embeddings"]

        emb = plan.run(range(len(ds)), names, embed)
        if emb is None:
            return None
        plan.finish()
    return {"embeddings": emb, "labels": np.asarray(ds.labels, dtype=np.int64), **dataset_paths_and_class_names(ds)}


def embed_checkpoint(checkpoint: str | Path, out: str | Path, *, data: str | None = None,
                     root: str | None = None, split: str = "test", batch_size: int = 256,
                     device: str = "auto", num_workers: int = 0, options: dict | None = None,
                     shard_size: int | None = None) -> Path | None:
    """Embed ``split`` of a dataset with the model of ``checkpoint`` and write ``out`` (.npz).

    The embedding is the model output the checkpoint's ``eval.embedding`` names (the one its
    validation chose best.pt on).  ``data`` / ``root`` default to the checkpoint's training config.  ``split="query+gallery"``
    (and ``"test"`` for In-shop) embeds the query and gallery splits and stores ``is_query``
    / ``is_gallery``; naming one of them embeds only that split. Datasets of image files add
    ``paths`` (absolute, one per row) and named classes ``class_names`` (one per label).
    Under torchrun (one split) every rank embeds its shards and rank 0 writes ``out``
    (:mod:`deepmetric.run.shards`); the other ranks return ``None``.
    """
    out = npz_out_path(out)  # before any work
    dev = resolve_device(device)
    model, losses, cfg, _ = load_model_from_checkpoint(checkpoint, dev)
    if data is not None:
        cfg.data.name = data
        cfg.data.options = dict(options or {})
    elif options:
        cfg.data.options.update(options)
    if root is not None:
        cfg.data.root = root
    kw = dict(batch_size=batch_size, device=dev, amp=cfg.train.amp, output=cfg.eval.embedding,
              channels_last=cfg.train.channels_last, num_workers=num_workers, with_paths=True)
    arrays: dict[str, np.ndarray]
    if split == "query+gallery" or (split == "test" and cfg.data.name == "inshop"):
        q = compute_embeddings(model, build_split(cfg, "query", train=False), **kw)
        g = compute_embeddings(model, build_split(cfg, "gallery", train=False), **kw)
        is_query = np.r_[np.ones(len(q["labels"]), bool), np.zeros(len(g["labels"]), bool)]
        arrays = {"embeddings": np.concatenate([q["embeddings"], g["embeddings"]]),
                  "labels": np.concatenate([q["labels"], g["labels"]]),
                  "is_query": is_query, "is_gallery": ~is_query}
        parts = [q, g]
    else:
        ds = build_split(cfg, split, train=False)
        r = (compute_embeddings(model, ds, **kw) if torchrun_world() is None
             else _embed_sharded(model, ds, out, checkpoint, kw, shard_size))
        if r is None:
            return None  # a torchrun rank other than 0: its shards are written
        arrays = {"embeddings": r["embeddings"], "labels": r["labels"],
                  **dataset_query_gallery_masks(ds)}
        parts = [r]
    # image paths and class names, when known
    if all("paths" in p for p in parts):
        arrays["paths"] = np.concatenate([p["paths"] for p in parts])
    # an .npz of NaN would be refused by every metric later: refuse it now, naming the image
    check_finite_embeddings(arrays["embeddings"], checkpoint,
                            lambda i: arrays["paths"][i] if "paths" in arrays else f"row {i} of split {split!r}",
                            nothing=f"nothing was written to {out}", verb="embed")
    out.parent.mkdir(parents=True, exist_ok=True)
    if "class_names" in parts[0]:
        arrays["class_names"] = parts[0]["class_names"]
    part = out.with_name(f".{out.name}.{os.getpid()}.tmp.npz")  # whole or not at all
    try:
        np.savez(part, **arrays)
        os.replace(part, out)
    finally:
        part.unlink(missing_ok=True)
    return out


def check_finite_embeddings(emb: np.ndarray, checkpoint, row_name, *, nothing: str, verb: str) -> None:
    """ValueError when ``checkpoint`` embedded any row of ``emb`` as NaN / inf: a diverged run,
    or an image that drives the model there. The message names how many rows, the first one's
    image (``row_name(i)``), what was therefore not written (``nothing``) and the command to
    rerun with an earlier checkpoint (``verb``). ``deepmetric embed`` and ``deepmetric index``
    share it, so both refuse alike."""
    bad = ~np.isfinite(emb).all(axis=1)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(f"checkpoint {checkpoint} embeds {int(bad.sum())} of {len(bad)} image(s) as NaN / inf, the "
                         f"first {row_name(i)}; {nothing} (a diverged run? {verb} with an earlier checkpoint, "
                         "best.pt)")


def npz_out_path(out: str | Path) -> Path:
    """The ``.npz`` file ``embed`` writes for ``--out``: a folder is refused (numpy would
    write ``FOLDER.npz`` beside it), a name without the suffix gets it (as numpy adds it)."""
    out = Path(out)
    if out.is_dir():
        raise IsADirectoryError(f"--out {out} is a folder; give the .npz file to write, e.g. {out / 'embeddings.npz'}")
    if out.suffix != ".npz":
        out = out.with_name(out.name + ".npz")
        if out.is_dir():
            raise IsADirectoryError(f"--out {out} is a folder; give the .npz file to write")
    return out
