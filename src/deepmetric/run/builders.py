"""What a run is built from: dataset splits, the batch sampler, the model and the loss terms.

Shared by the training loop, ``deepmetric embed`` (rebuilding a checkpoint's model), the
demo and other commands, so every one of them builds exactly what training built.  This
module imports only the config, ``deepmetric.data``, ``deepmetric.models`` and
``deepmetric.losses``; the loop, ``embed`` and ``demo`` import it, never the reverse.

* ``build_split(cfg, split, *, train)``: one split of ``cfg.data`` with the train (augmenting)
  or test transform.  With ``data.val_classes`` the training split loses the validation
  classes, and ``split="val"`` is those classes' training images (``carve_val_classes``);
* ``build_sampler(cfg, labels, rank, world)``: random or m x n class-balanced batches,
  sharded over ranks;
* ``build_model(cfg, num_classes)``: ``create_model(cfg.model.name, **cfg.model.options)``;
* ``build_losses(cfg, num_classes, embedding_dim)``: one module per loss term;
* ``embedding_dim_of(model, dataset)`` and ``seed_everything(seed)``.
"""
from __future__ import annotations

import functools
import random
from typing import Callable

import numpy as np
import torch
from torch import nn

from .config import Config, ConfigError
from .config_checks import loss_term_options

__all__ = ["VAL_SPLIT", "seed_everything", "build_split", "build_sampler", "build_model", "build_losses",
           "resolve_model_preprocessing", "MODEL_PREPROCESSING_KEYS", "fill_model_input_size",
           "embedding_dim_of", "carve_val_classes", "class_fold", "ClassSubset"]

#: The name of the validation split carved by ``data.val_classes``.
VAL_SPLIT = "val"


def seed_everything(seed: int) -> None:
    """Seed Python's ``random``, NumPy's global generator and torch (CPU and CUDA)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _call_filling(fn: Callable, name: str, options: dict, auto: dict, accepted: set[str] | None = None):
    """``fn(name, **options, **auto)`` where ``auto`` holds values the loop knows
    (``num_classes``, ``embedding_dim``): each is passed only when the user did not set it
    and it is among the ``accepted`` options (the registry's; None: pass them all)."""
    extra = {k: v for k, v in auto.items() if v is not None and k not in options}
    if accepted is not None:
        extra = {k: v for k, v in extra.items() if k in accepted}
    return fn(name, **extra, **options)


def _build_named_split(cfg: Config, split: str, *, train: bool):
    d = cfg.data
    from deepmetric.data import build_dataset as build_named_dataset
    from deepmetric.data import build_transform, is_event_dataset

    transform = None
    if d.transform is not None:
        transform = build_transform(d.transform, train=train, **d.transform_options)
    options = dict(d.options)
    if not train and "random_window" not in options and is_event_dataset(d.name):
        # an event dataset draws a random window per access on its "train" split; evaluated
        # (validation classes, eval.train_neighbours) it must give the same centre window
        options["random_window"] = False
    return build_named_dataset(d.name, root=d.root, split=split, transform=transform, **options)


def build_split(cfg: Config, split: str, *, train: bool):
    """Split ``split`` of ``cfg.data`` with the train (``train=True``) or test transform.

    With ``data.val_classes`` set, ``data.train_split`` comes without the validation classes
    and ``split="val"`` is the validation classes' images (both ``ClassSubset``s of the
    training split, labels renumbered 0..C-1).  With ``data.val_split``, ``split="val"`` is that
    split of the dataset (test transform).  Every split keeps the dataset contract
    (:class:`deepmetric.data.contract.MetricDataset`): one from a builder registered elsewhere
    gets the defaults of the attributes it lacks."""
    from deepmetric.data import with_dataset_defaults

    d = cfg.data
    if d.val_split is not None and split == VAL_SPLIT:  # the dataset's own validation split
        return with_dataset_defaults(_build_named_split(cfg, d.val_split, train=False))
    if not d.carves_validation or split not in (d.train_split, VAL_SPLIT):
        return with_dataset_defaults(_build_named_split(cfg, split, train=train))
    full = with_dataset_defaults(_build_named_split(cfg, d.train_split, train=train))
    if d.val_folds is not None:
        keep, val = class_fold(full.labels, d.val_folds, d.val_fold, seed=_val_seed(cfg))
    else:
        keep, val = carve_val_classes(full.labels, d.val_classes, seed=_val_seed(cfg),
                                      class_names=full.class_names, pick=d.val_pick)
    if not d.val_query_families:
        return ClassSubset(full, val if split == VAL_SPLIT else keep)
    held = held_out_family_mask(full, d.val_query_families, d.name)
    if split != VAL_SPLIT:  # the validation families are unseen in training, like the test's
        return ClassSubset(full, keep, samples=~held)
    sub = ClassSubset(full, val)
    sub.is_query = held[sub.indices]
    sub.is_gallery = ~sub.is_query
    return sub


def build_test_sets(cfg: Config) -> dict:
    """The sets a test evaluation searches: ``query`` (``eval.split``) and, with
    ``eval.gallery_split`` (In-shop), ``gallery``; the test transform.  None without a test
    split (``eval.split: null``)."""
    if cfg.eval.split is None:
        return None
    sets = {"query": build_split(cfg, cfg.eval.split, train=False)}
    if cfg.eval.gallery_split is not None:
        sets["gallery"] = build_split(cfg, cfg.eval.gallery_split, train=False)
    return sets


def held_out_family_mask(dataset, families, name: str = "dataset") -> np.ndarray:
    """Boolean mask of the images of ``dataset`` drawn in one of ``families``
    (``data.val_query_families``; the dataset needs a per-image ``families`` array, as the
    glyph benchmark has)."""
    key = "config key 'data.val_query_families'"
    fams = dataset.families
    if fams is None or len(fams) != len(dataset):
        raise ValueError(f"{key}: dataset {name!r} has no per-image typeface families (the glyphs "
                         f"benchmark has them); remove the key")
    fams = np.asarray(fams).astype(str)
    present = sorted(set(fams.tolist()))
    unknown = [f for f in families if f not in present]
    if unknown:
        raise ValueError(f"{key}: {unknown} are not families of the training split; its families "
                         f"are {present}")
    if set(present) <= set(families):
        raise ValueError(f"{key}: {list(families)} are every family of the training split ({present}); "
                         f"at least one must stay for training")
    return np.isin(fams, list(families))


def _val_seed(cfg: Config) -> int:
    return cfg.train.seed if cfg.data.val_seed is None else cfg.data.val_seed


def carve_val_classes(labels, spec, *, seed: int = 0, class_names=None,
                      pick: str = "random") -> tuple[np.ndarray, np.ndarray]:
    """Split the classes of ``labels`` into (training classes, validation classes), sorted.

    ``spec`` is a fraction in (0, 1) of the classes (rounded, at least 1), a count, or a
    list of class names (looked up in ``class_names``) or label ids.  Fractions and counts
    draw the classes with ``numpy.random.default_rng(seed)`` (``pick="random"``: the same seed
    gives the same classes) or take the last ones in label order (``pick="last"``: as the
    zero-shot test takes the second half of the classes, so validation classes differ from the
    training classes the way the test classes do, e.g. in category on the emoji benchmark).
    At least one class is left for training."""
    classes = np.unique(np.asarray(labels, dtype=np.int64))
    n = len(classes)
    key = "config key 'data.val_classes'"
    if isinstance(spec, (list, tuple)):
        names = list(class_names) if class_names is not None else []
        chosen, unknown = [], []
        for item in spec:
            if isinstance(item, str) and item in names:
                chosen.append(names.index(item))
            elif isinstance(item, (int, np.integer)) and not isinstance(item, bool) and item in classes:
                chosen.append(int(item))
            else:
                unknown.append(item)
        if unknown:
            known = f"names such as {names[:5]}" if names else f"label ids in [{classes.min()}, {classes.max()}]"
            raise ValueError(f"{key}: {unknown[:10]} are not classes of the training split (expected {known})")
        val = np.unique(np.asarray(chosen, dtype=np.int64))
    else:
        if isinstance(spec, float):
            if not 0.0 < spec < 1.0:
                raise ValueError(f"{key}: a fraction must be in (0, 1), got {spec}")
            k = max(1, int(round(spec * n)))
        elif isinstance(spec, (int, np.integer)) and not isinstance(spec, bool):
            k = int(spec)
        else:
            raise ValueError(f"{key}: expected a fraction, a count or a list of classes, got {spec!r}")
        if not 1 <= k < n:
            raise ValueError(f"{key}: asks for {k} validation classes, but the training split has "
                             f"{n} classes (at least one must stay for training)")
        if pick == "last":
            val = np.sort(classes)[n - k:]
        elif pick == "random":
            val = np.sort(np.random.default_rng(seed).permutation(classes)[:k])
        else:
            raise ValueError(f"config key 'data.val_pick': expected 'random' or 'last', got {pick!r}")
    if len(val) >= n:
        raise ValueError(f"{key}: every training class would be a validation class")
    return np.setdiff1d(classes, val), val


def class_fold(labels, folds: int, fold: int, *, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(training classes, validation classes) of fold ``fold`` of ``folds`` class-disjoint
    folds: the classes are permuted with ``numpy.random.default_rng(seed)`` and cut into
    ``folds`` near-equal parts (``numpy.array_split``), so the folds of one seed partition the
    classes (the Reality Check's 4-fold cross-validation)."""
    classes = np.unique(np.asarray(labels, dtype=np.int64))
    if not 2 <= folds <= len(classes):
        raise ValueError(f"config key 'data.val_folds': {folds} folds need 2 to {len(classes)} "
                         f"(the training classes)")
    if not 0 <= fold < folds:
        raise ValueError(f"config key 'data.val_fold': must be in [0, {folds}), got {fold}")
    parts = np.array_split(np.random.default_rng(seed).permutation(classes), folds)
    val = np.sort(parts[fold])
    return np.setdiff1d(classes, val), val


class ClassSubset(torch.utils.data.Dataset):
    """The samples of ``dataset`` whose label is in ``classes`` (and, given ``samples``, a
    boolean mask over ``dataset``, whose mask is true), labels renumbered 0..C-1 in the order
    of ``classes`` (``original_classes[new] = old``).

    Other attributes come from ``dataset``; its per-sample NumPy arrays (``images``,
    ``families``, ``vendor_ids``, ...: first dimension ``len(dataset)``) are returned for the
    subset's samples only, so ``subset.images[i]`` is the image of ``subset[i]``.  It keeps the
    dataset contract (:class:`deepmetric.data.contract.MetricDataset`) through ``dataset``,
    which is given the defaults of the attributes it lacks."""

    def __init__(self, dataset, classes, samples=None):
        from deepmetric.data import with_dataset_defaults

        self.dataset = with_dataset_defaults(dataset)
        self.original_classes = np.asarray(classes, dtype=np.int64)
        old = np.asarray(dataset.labels, dtype=np.int64)
        new_of_old = np.full(int(old.max()) + 1, -1, dtype=np.int64)
        new_of_old[self.original_classes] = np.arange(len(self.original_classes))
        chosen = new_of_old[old] >= 0
        if samples is not None:
            samples = np.asarray(samples, dtype=bool)
            if samples.shape != old.shape:
                raise ValueError(f"ClassSubset: samples must be a boolean mask of {len(old)} entries, "
                                 f"got shape {samples.shape}")
            chosen &= samples
        self.indices = np.flatnonzero(chosen)
        self._parent_len = len(old)
        self._per_sample: dict[str, np.ndarray] = {}
        self.labels = new_of_old[old[self.indices]]
        self.num_classes = len(self.original_classes)
        names = dataset.class_names
        self.class_names = [names[c] for c in self.original_classes] if names is not None else None
        if dataset.paths is not None:
            self.paths = [dataset.paths[i] for i in self.indices]
        # the stored image of this subset's sample i (the parent's method reads the parent's i)
        self.load_image = (functools.partial(_parent_image, dataset.load_image, self.indices)
                           if dataset.load_image is not None else None)
        # domains (eval.cross_domain) follow the samples
        for per_sample, ids in (("vendor_ids", dataset.vendor_ids), ("domain_ids", dataset.domain_ids)):
            if ids is not None and len(ids) == len(old):
                setattr(self, per_sample, np.asarray(ids)[self.indices])

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int):
        x, _ = self.dataset[int(self.indices[i])]
        return x, int(self.labels[i])

    def __getattr__(self, name):  # faces, from_cache, images, families, ... of the wrapped dataset
        if name in ("dataset", "indices", "_parent_len", "_per_sample"):
            raise AttributeError(name)
        value = getattr(self.dataset, name)
        if isinstance(value, np.ndarray) and value.ndim >= 1 and value.shape[0] == self._parent_len:
            # per-sample: this subset's samples only (copied once: thumbnails index it per image)
            if name not in self._per_sample:
                self._per_sample[name] = value[self.indices]
            return self._per_sample[name]
        return value


def _parent_image(load_image, indices: np.ndarray, i: int):
    return load_image(int(indices[i]))


def build_sampler(cfg: Config, labels: np.ndarray, rank: int = 0, world: int = 1):
    """``train.sampler``: ``class_balanced`` (m classes x n images) or ``random`` batches of
    ``batch_size`` (last incomplete batch dropped), this rank's shard of each epoch."""
    from deepmetric.data import ClassBalancedBatchSampler, RandomBatchSampler

    t = cfg.train
    if t.sampler == "class_balanced":
        return ClassBalancedBatchSampler(labels, t.m, t.n, seed=t.seed, rank=rank, world_size=world,
                                         class_sampling=t.class_sampling)
    return RandomBatchSampler(len(labels), t.batch_size, seed=t.seed, rank=rank, world_size=world,
                              drop_last=True)


def build_model(cfg: Config, num_classes: int | None = None, *, pretrained: bool = True) -> nn.Module:
    """``create_model(cfg.model.name, **cfg.model.options)``.  ``num_classes`` is passed only
    when the model needs a classifier: one that cannot be built without (the two-head model,
    :func:`~deepmetric.models.model_needs_num_classes`), or a loss term reading ``logits``.

    ``pretrained=False`` leaves ``model.options.pretrained`` out: the model whose weights a
    checkpoint holds in full (embed, index, export, serve, resume never read the pretrained
    file, or the hub, again)."""
    from deepmetric.models import create_model, model_needs_num_classes, with_model_defaults

    m = cfg.model
    if not (model_needs_num_classes(m.name) or any(t.input == "logits" for t in cfg.loss)):
        num_classes = None
    options = dict(m.options)
    if not pretrained:
        options.pop("pretrained", None)
    # create_model accepts num_classes for every model: nothing to filter; a model registered
    # elsewhere gets the defaults of the model contract's parts it lacks
    try:
        model = _call_filling(create_model, m.name, options, {"num_classes": num_classes})
    except RuntimeError as exc:
        # torch refuses a layer of impossible size with a RuntimeError, which the CLI treats as
        # a bug (traceback); here it is the user's options that a model registered elsewhere
        # did not check
        raise ConfigError(f"config key 'model.options': model {m.name!r} cannot be built with options "
                          f"{options}: {exc}") from exc
    return with_model_defaults(model)


def fill_model_input_size(cfg: Config, dataset) -> None:
    """A ``timm/`` model built for one input size (a ViT: ``img_size``) without
    ``model.options.img_size`` gets the size of the dataset's first image (its transform's
    output), in place: the position embedding is resampled to that grid once, when the weights
    are loaded, and the saved config rebuilds the same model."""
    from deepmetric.models import is_timm_name, takes_img_size

    m = cfg.model
    if not is_timm_name(m.name) or "img_size" in m.options or not takes_img_size(m.name) or len(dataset) == 0:
        return
    x = dataset[0][0]
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        return
    m.options = {**m.options, "img_size": [int(x.shape[-2]), int(x.shape[-1])]}


#: the ``timm`` transform's options that come from the model's pretrained configuration
MODEL_PREPROCESSING_KEYS = ("input_size", "interpolation", "crop_pct", "crop_mode", "mean", "std")


def resolve_model_preprocessing(cfg: Config) -> None:
    """``data.transform: timm`` (the default for ``model.name: timm/...``): every one of
    :data:`MODEL_PREPROCESSING_KEYS` the recipe leaves out of ``data.transform_options`` is
    filled in from the model's pretrained configuration
    (:func:`~deepmetric.models.model_data_config`: timm's ``resolve_model_data_config``), in
    place, so that the run's saved config, its checkpoints and an export's preprocessing JSON
    hold the numbers themselves."""
    from deepmetric.models import is_timm_name, model_data_config

    d = cfg.data
    if d.transform is None and is_timm_name(cfg.model.name):
        d.transform = "timm"
    if d.transform != "timm":
        return
    missing = [k for k in MODEL_PREPROCESSING_KEYS if k not in d.transform_options]
    if not missing:
        return
    data_cfg = model_data_config(cfg.model.name, cfg.model.options)
    if data_cfg is None:
        raise ValueError(f"config key 'data.transform': 'timm' takes its {', '.join(missing)} from the model's "
                         f"pretrained configuration, and model {cfg.model.name!r} has none; set them in "
                         f"data.transform_options")
    options = dict(d.transform_options)
    for key in missing:
        value = data_cfg.get(key)
        if value is None:
            continue
        if key == "input_size":
            value = [int(v) for v in value[-2:]]
        elif key in ("mean", "std"):
            value = [float(v) for v in value]
        options[key] = value
    d.transform_options = options


def build_losses(cfg: Config, num_classes: int | None = None, embedding_dim: int | None = None,
                 projection_dim: int | None = None) -> nn.ModuleList:
    """One loss module per ``cfg.loss`` term; ``num_classes`` / ``embedding_dim`` are passed
    to the losses that accept them (classifier losses) unless the options set them.  A term
    reading ``input: projection`` gets ``projection_dim`` (the model's ``projection_dim``) as
    its ``embedding_dim``."""
    from deepmetric.losses import build_loss

    terms = []
    for i, term in enumerate(cfg.loss):
        accepted = loss_term_options(cfg, i)  # an unknown name: a ConfigError naming loss.i.name
        dim = projection_dim if term.input == "projection" else embedding_dim
        terms.append(_call_filling(build_loss, term.name, dict(term.options),
                                   {"num_classes": num_classes, "embedding_dim": dim}, accepted))
    return nn.ModuleList(terms)


def embedding_dim_of(model: nn.Module, dataset) -> int:
    """The model's embedding size: ``model.embedding_dim`` or one probe forward pass."""
    k = model.embedding_dim
    if isinstance(k, int):
        return k
    x = torch.stack([torch.as_tensor(dataset[i][0]) for i in range(min(2, len(dataset)))])
    was = model.training
    model.eval()
    with torch.no_grad():
        k = int(model(x)["embedding"].shape[1])
    model.train(was)
    return k
