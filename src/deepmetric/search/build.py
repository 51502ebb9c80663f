"""Embedding a dataset split for an index: the checkpoint's model and test transform, the
split's labels, class names and image paths (PNG copies for in-memory benchmarks), with a
progress bar. Used by :meth:`deepmetric.search.index.Index.build`."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from .query import load_image, preprocessing_from_config
from .store import check_utf8

_FILE_DATASETS_ALL = ("folder", "csv")


def _dataset_builder():
    """The training package's split builder (``build_split(cfg, split, *, train)``)."""
    from deepmetric.run.builders import build_split

    return build_split


class _ImageFiles(torch.utils.data.Dataset):
    """Image files read with :func:`load_image` (errors name the file) and ``preprocessing``."""

    def __init__(self, paths, labels, preprocessing):
        self.paths, self.labels, self.preprocessing = paths, labels, preprocessing
        self.max_bytes = preprocessing.decode_limit()

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        img = load_image(self.paths[i], mode=self.preprocessing.mode, max_bytes=self.max_bytes)
        return self.preprocessing(img), int(self.labels[i])


def class_names_of(ds) -> list[str] | None:
    names = ds.class_names
    if names:
        return [str(c) for c in names]
    ids = ds.class_ids
    return [str(c) for c in ids] if ids else None


def indexed_path(path) -> str:
    """The path an index stores for an image file: absolute, its folders resolved (a root given
    through a link or as ``../x`` is one root: ``--add`` skips what is indexed), the file's own
    name kept.  Resolving the file too stored a symbolic link under its target's path: a link
    in one class folder to an image of another was shown as a hit in the other class's folder,
    and two rows had one path."""
    p = Path(path).expanduser().absolute()
    return str(p.parent.resolve() / p.name)


def _point_at_data(cfg, *, data, options, root, split) -> str:
    """Point the checkpoint's config at the data to index (another dataset, more options,
    another root); the split to read (default: every image of a folder or csv, else "test")."""
    if data is not None and data != cfg.data.name:
        cfg.data.name = data
        cfg.data.options = {k: v for k, v in (cfg.data.options or {}).items() if k == "mode"}
    if options:
        cfg.data.options.update(options)
    if root is not None:
        cfg.data.root = str(root)
    if split is None:
        split = "all" if cfg.data.name in _FILE_DATASETS_ALL else "test"
    return split


def _embed_in_chunks(model, ds, keep, labels, dev, *, batch_size, num_workers, progress):
    """``(embeddings, labels)`` of the rows ``keep`` of ``ds``, in chunks under one progress bar
    (``labels``, when None, are those the embedding pass reads)."""
    from tqdm.auto import tqdm

    from deepmetric.run.embed import compute_embeddings

    embs = []
    chunk = max(batch_size, 1024)
    with tqdm(total=len(keep), desc="embedding", unit="img", disable=not progress, leave=False) as bar:
        for a in range(0, len(keep), chunk):
            part = torch.utils.data.Subset(ds, keep[a:a + chunk])
            r = compute_embeddings(model, part, batch_size=batch_size, device=dev, amp="none",
                                   num_workers=num_workers)
            embs.append(r["embeddings"])
            if labels is None:
                labels = r["labels"]
            bar.update(len(part))
    return (np.concatenate(embs) if embs else np.zeros((0, 0), np.float32)), labels


def _indexed_paths(ds, keep, paths, in_memory: bool, images_dir, first_image_number: int, progress) -> list[str]:
    """The image file of every indexed row: its own, a PNG copy written into ``images_dir`` for
    an in-memory benchmark, or "" (no file)."""
    from tqdm.auto import tqdm
    from PIL import Image

    if paths is not None:
        return [paths[i] for i in keep]
    if not (in_memory and images_dir is not None):
        return [""] * len(keep)
    images_dir = Path(images_dir)
    images_dir.mkdir(parents=True, exist_ok=True)
    out_paths = []
    for j, i in enumerate(tqdm(keep, desc="writing images", unit="img", disable=not progress, leave=False)):
        p = images_dir / f"{first_image_number + j:06d}.png"
        Image.fromarray(np.asarray(ds.images[i])).save(p)  # [H, W] grey or [H, W, 3] RGB
        out_paths.append(str(p.resolve()))
    return out_paths


def stored_output(meta: dict | None) -> str | None:
    """The model output the rows of an index with ``meta`` were embedded with, which its queries
    and added rows must use too: ``embedding_output``; for an index built from a checkpoint
    before that key existed, the head's output (``"embedding"``); ``None`` (the checkpoint's own
    ``eval.embedding``) for no index yet or one built from vectors (``--embeddings``)."""
    if not meta:
        return None
    return meta.get("embedding_output") or ("embedding" if meta.get("checkpoint") else None)


def load_query_network(meta: dict, checkpoint, device):
    """:func:`~deepmetric.run.embed.load_search_network` for the queries of an index with ``meta``
    (the output :func:`stored_output` names)."""
    from deepmetric.run.embed import load_search_network

    return load_search_network(checkpoint, device, output=stored_output(meta))


def _index_input(emb, labels, out_paths, names, cfg, state, preprocessing, split, n, keep, output) -> dict:
    """What :meth:`Index.build` writes: the embeddings with their rows and where they came from."""
    return {"embeddings": emb, "labels": labels, "paths": out_paths, "class_names": names,
            "config": state["config"], "preprocessing": preprocessing.to_dict(), "embedding_output": output,
            # the root as an absolute path: a relative one says nothing once the command's folder is gone
            "data": {"name": cfg.data.name, "root": cfg.data.root and str(Path(cfg.data.root).expanduser().absolute()),
                     "split": split,
                     "options": dict(cfg.data.options), "images": len(keep)},
            "skipped": n - len(keep)}


def embed_dataset_for_index(checkpoint, *, data=None, root=None, split=None, options=None,
                            batch_size: int = 256, device: str = "auto", num_workers: int = 0,
                            progress: bool = True, skip_paths=frozenset(), images_dir=None,
                            first_image_number: int = 0, shards=None, index_meta: dict | None = None) -> dict | None:
    """Embed a split for an index: ``{"embeddings", "labels", "paths", "class_names", ...}``.
    ``shards`` (a :class:`deepmetric.search.shards.ShardPlan`, under torchrun): this process
    embeds only its contiguous run of shards into the shard folder (skipping finished ones);
    rank 0 returns the whole split read back from the shards, other ranks ``None``.  The model
    output embedded is the checkpoint's ``eval.embedding`` (what its validation chose it on), or
    for rows added to an index (``index_meta``, its manifest), the output already in it."""
    from deepmetric.run.device import resolve_device
    from deepmetric.run.embed import check_finite_embeddings, load_search_network

    if not Path(checkpoint).is_file():
        raise FileNotFoundError(f"checkpoint {checkpoint} not found (expected last.pt / best.pt of 'deepmetric train')")
    dev = resolve_device(device, name="--device")
    # the output the checkpoint's validation chose it on (eval.embedding), not always the head's
    model, cfg, state, output = load_search_network(checkpoint, dev, output=stored_output(index_meta))
    preprocessing = preprocessing_from_config(cfg)  # before the data is overridden: the model's input
    split = _point_at_data(cfg, data=data, options=options, root=root, split=split)
    ds = _dataset_builder()(cfg, split, train=False)
    n = len(ds)
    if n == 0:
        raise ValueError(f"dataset {cfg.data.name!r} (root {cfg.data.root}, split {split!r}) has no images")
    paths = ds.paths
    in_memory = paths is None and ds.images is not None
    if paths is not None:
        paths = [indexed_path(p) for p in paths]
        keep = [i for i in range(n) if paths[i] not in skip_paths]
    else:
        keep = list(range(n))
    labels = np.asarray(ds.labels, dtype=np.int64)[keep] if ds.labels is not None else None

    names = class_names_of(ds)
    for name in names or []:  # before any work: index files store names and paths as UTF-8
        check_utf8(name, "class name")
    for i in keep if paths is not None else []:
        check_utf8(paths[i], "image file")
    if paths is not None:  # image files: exactly the preprocessing queries get (query.py)
        ds = _ImageFiles(paths, np.asarray(ds.labels, dtype=np.int64), preprocessing)
    if shards is not None:
        return _embed_shards(shards, model, ds, keep, paths, names, dev, cfg, state, preprocessing, split, n,
                             checkpoint=checkpoint, batch_size=batch_size, num_workers=num_workers, progress=progress, output=output)
    emb, labels = _embed_in_chunks(model, ds, keep, labels, dev, batch_size=batch_size, num_workers=num_workers,
                                   progress=progress)
    check_finite_embeddings(emb, checkpoint,
                            lambda i: paths[keep[i]] if paths is not None else f"image {keep[i]} of the split",
                            nothing="nothing was indexed", verb="index")
    out_paths = _indexed_paths(ds, keep, paths, in_memory, images_dir, first_image_number, progress)
    return _index_input(emb, labels, out_paths, names, cfg, state, preprocessing, split, n, keep, output)


def _embed_shards(shards, model, ds, keep, paths, names, dev, cfg, state, preprocessing, split, n, *,
                  checkpoint, batch_size, num_workers, progress, output) -> dict | None:
    """The torchrun branch of :func:`embed_dataset_for_index` (see its ``shards``)."""
    from deepmetric.run.embed import check_finite_embeddings, compute_embeddings

    if paths is None:
        raise ValueError(f"embedding over torchrun needs a dataset of image files (folder, csv), not "
                         f"{cfg.data.name!r}; run 'deepmetric index' as one process")

    def embed(rows):
        return compute_embeddings(model, torch.utils.data.Subset(ds, rows), batch_size=batch_size, device=dev,
                                  amp="none", num_workers=num_workers)["embeddings"]

    emb = shards.run(keep, [paths[i] for i in keep], embed, progress=progress)
    if emb is None:
        return None
    # as one process does: name the first image a diverged checkpoint embeds as NaN / inf
    check_finite_embeddings(emb, checkpoint, lambda i: paths[keep[i]], nothing="nothing was indexed", verb="index")
    return {**_index_input(emb, np.asarray(ds.labels, dtype=np.int64)[keep], [paths[i] for i in keep], names, cfg,
                           state, preprocessing, split, n, keep, output),
            "shards": shards.summary()}
