"""One factory for every dataset: ``build_dataset(name, root, split, transform, **options)``.

Every dataset registers its builder with :func:`register_dataset` where the builder is
defined: the official benchmarks cub, cars196, sop, inshop, flowers102, aircraft, dogs and
nabirds (see :mod:`deepmetric.data.benchmarks`), folder and csv (your own data, see
:mod:`deepmetric.data.folder`) and the video events of a CSV (events) or of per-frame label
arrays (hdd) here; fashion-mnist, glyphs and emoji (offline benchmarks) in
:mod:`deepmetric.data.fashion_mnist`, :mod:`deepmetric.data.glyphs` and
:mod:`deepmetric.data.emoji`; synthetic_events (rendered ego-motion clips) in
:mod:`deepmetric.data.synthetic_events` and synthetic (Gaussian clusters for tests) in
:mod:`deepmetric.data.synthetic`.  ``deepmetric.data`` imports them all, so every name is
registered once the package is imported.  See docs/events.md for the video events.

Names are matched ignoring case, with ``_`` and spaces read as ``-`` (``synthetic_events``
is ``synthetic-events``), and through aliases (``cub200`` is ``cub``).
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

from deepmetric.options import option_hints
from deepmetric.registry import Registry, signature_options

from .benchmarks import BENCHMARKS, load_benchmark
from .folder import load_csv, load_folder
from .image_list import ImageListDataset

__all__ = ["DATASETS", "build_dataset", "register_dataset", "list_datasets", "canonical_dataset_name",
           "dataset_options", "dataset_option_hints", "is_event_dataset"]

#: builder parameters that are not options: build_dataset passes them itself
_BUILD_ARGUMENTS = ("split", "transform", "root")


def _key(name: str) -> str:
    return name.strip().lower().replace("_", "-").replace(" ", "-")


#: name -> builder(split=..., transform=..., root=..., **options); info: ``options`` (what
#: data.options accepts, None: the builder checks its own) and ``event`` (a video-event dataset,
#: a random window per access on its "train" split)
DATASETS = Registry("dataset", normalize=_key, unknown="unknown {kind} {name!r}. Known: {available}.{Hint}")


def register_dataset(name: str, *, aliases: Iterable[str] = (), options: Iterable[str] | None = None,
                     event: bool = False, hints_from: Iterable[Callable] = ()):
    """Decorator registering ``builder(split=..., transform=..., root=..., **options)`` as
    dataset ``name`` (:func:`build_dataset`; a config's ``data.name``).

    Args:
        name: the dataset's name, lower case with ``-`` between words.
        aliases: other names that mean this dataset (``"cub200"`` for ``"cub"``).
        options: the names ``data.options`` accepts; by default the builder's keyword
            parameters besides split, transform and root (none known when the builder takes
            ``**options``: it then checks them itself).
        event: a video-event dataset, which draws a random window per access on its "train"
            split (see :func:`is_event_dataset`).
        hints_from: the functions / classes whose type hints type the options (default: the
            builder), for :func:`dataset_option_hints`.

    A second dataset or alias of the same name is an error.
    """
    key = _key(name)
    if key != name:
        raise ValueError(f"register_dataset: name {name!r} must be lower case with '-' between words ({key!r})")

    def deco(builder: Callable) -> Callable:
        accepted = signature_options(builder, skip=_BUILD_ARGUMENTS) if options is None else options
        taken = sorted({_key(n) for n in (name, *aliases) if n in DATASETS})
        if taken:
            raise ValueError(f"dataset name(s) {taken} already registered")
        DATASETS.add(name, builder, aliases=aliases, event=bool(event),
                     options=None if accepted is None else frozenset(accepted),
                     hints_from=tuple(hints_from) or (builder,))
        return builder

    return deco


def list_datasets() -> list[str]:
    """Every name :func:`build_dataset` accepts, sorted (aliases such as 'cub200' are also
    accepted)."""
    return DATASETS.names()


def canonical_dataset_name(name: str) -> str:
    """The registered name ``name`` means (``"CUB_200_2011"`` -> ``"cub"``); an unknown name
    raises ``ValueError`` with the closest name, a non-string ``TypeError``."""
    if not isinstance(name, str):
        raise TypeError(f"dataset name must be a string, got {type(name).__name__}")
    return DATASETS.canonical(name)


def dataset_options(name: str) -> set[str] | None:
    """The options (``data.options``) dataset ``name`` accepts, or None when its builder
    takes ``**options`` and checks them itself (fashion-mnist, events, hdd).  Raises as
    :func:`canonical_dataset_name` for an unknown name."""
    options = DATASETS.info(canonical_dataset_name(name))["options"]
    return None if options is None else set(options)


def dataset_option_hints(name: str) -> dict:
    """The type hints of dataset ``name``'s options (those of its builder, or of the loader and
    the ImageListDataset wrapper a file-based dataset passes them to), for the config's value
    check; an option without a hint is not in it.  Raises as :func:`canonical_dataset_name`."""
    hints: dict = {}
    for fn in DATASETS.info(canonical_dataset_name(name))["hints_from"]:
        hints.update(option_hints(fn))
    return hints


def is_event_dataset(name: str) -> bool:
    """Whether ``name`` (or an alias) is a video-event dataset; unknown names are not."""
    return name in DATASETS and DATASETS.info(name)["event"]


def build_dataset(name: str, root=None, split: str = "train", transform: Callable | None = None, **options):
    """Build a dataset by name; ``ds[i] -> (image_tensor, label)``.

    Args:
        name: one of :func:`list_datasets`.
        root: the extracted dataset folder (benchmarks, ``folder``), the CSV file (``csv``),
            or an optional data directory (``fashion-mnist``, ``glyphs``, ``emoji``: the
            deepmetric cache root).
        split: "train"/"test" (zero-shot), "train"/"val"/"test" (classification where
            defined), "train"/"query"/"gallery" (inshop); "all" for folder/csv.
        transform: callable applied to each PIL image.
        **options: benchmarks: ``protocol`` ("zero_shot" | "classification"),
            ``check_counts``; folder: ``class_split``, ``split_file``, ``seed``,
            ``extensions``, ``allow_empty_classes``; csv: ``image_root``, ``label_map``,
            ``delimiter``; all file-based datasets: ``skip_missing``, ``verify``
            ("exists" | "open" | "none"), ``mode`` ("RGB" | "L"), ``max_decode_mb`` (largest
            decoded image in MiB, checked before decoding). fashion-mnist, glyphs and
            emoji take their own options (emoji: ``protocol``, ``size``, ``vendors``,
            ``min_vendors``, ``max_classes``; see docs/offline-data.md); see
            :func:`dataset_options`.

    Returns: a Dataset with ``labels`` (int64, 0..C-1), ``num_classes``, ``class_names``.
    """
    return DATASETS.get(canonical_dataset_name(name))(split=split, transform=transform, root=root, **options)


# --------------------------------------------------------------------------- file-based datasets
#: options of the ImageListDataset wrapper, accepted by every file-based dataset
_WRAPPER_OPTIONS = ("skip_missing", "verify", "mode", "max_decode_mb")
_BENCHMARK_OPTIONS = ("protocol", "check_counts")
_FOLDER_OPTIONS = ("class_split", "split_file", "seed", "extensions", "allow_empty_classes")
_CSV_OPTIONS = ("image_root", "label_map", "delimiter")
_BENCHMARK_ALIASES = {
    "cub": ("cub200", "cub-200", "cub-200-2011", "cub200-2011"),
    "cars196": ("cars", "cars-196", "stanford-cars"),
    "sop": ("stanford-online-products", "online-products"),
    "inshop": ("in-shop", "deepfashion-inshop"),
    "flowers102": ("flowers", "flowers-102", "oxford-flowers102"),
    "aircraft": ("fgvc-aircraft", "fgvcaircraft"),
    "dogs": ("stanford-dogs",),
}


def _split_options(name: str, allowed: tuple[str, ...], options: dict) -> tuple[dict, dict]:
    """(loader options, wrapper options) of ``options``; anything else is an error."""
    unknown = sorted(set(options) - set(allowed) - set(_WRAPPER_OPTIONS))
    if unknown:
        raise TypeError(
            f"build_dataset({name!r}): unknown option(s) {unknown}; accepted: "
            f"{', '.join(allowed + _WRAPPER_OPTIONS)}"
        )
    load = {k: v for k, v in options.items() if k in allowed}
    wrap = {k: v for k, v in options.items() if k in _WRAPPER_OPTIONS}
    return load, wrap


def _build_benchmark(name: str, split: str = "train", transform=None, root=None, **options):
    load, wrap = _split_options(name, _BENCHMARK_OPTIONS, options)
    return ImageListDataset(load_benchmark(name, root, split=split, **load), transform, **wrap)


for _name in BENCHMARKS:
    register_dataset(_name, aliases=_BENCHMARK_ALIASES.get(_name, ()), options=_BENCHMARK_OPTIONS + _WRAPPER_OPTIONS,
                     hints_from=(load_benchmark, ImageListDataset))(functools.partial(_build_benchmark, _name))


@register_dataset("folder", options=_FOLDER_OPTIONS + _WRAPPER_OPTIONS, hints_from=(load_folder, ImageListDataset))
def _build_folder(split: str = "train", transform=None, root=None, **options):
    load, wrap = _split_options("folder", _FOLDER_OPTIONS, options)
    return ImageListDataset(load_folder(root, split=split, **load), transform, **wrap)


@register_dataset("csv", options=_CSV_OPTIONS + _WRAPPER_OPTIONS, hints_from=(load_csv, ImageListDataset))
def _build_csv(split: str = "train", transform=None, root=None, **options):
    load, wrap = _split_options("csv", _CSV_OPTIONS, options)
    return ImageListDataset(load_csv(root, split=split, **load), transform, **wrap)


# --------------------------------------------------------------------------- video events
#: options of EventDataset (frame sampling and windows), accepted by every event dataset
_EVENT_OPTIONS = ("rate", "window", "min_seconds", "random_window", "test_windows")


def _build_events(key: str, loader_options: tuple[str, ...], root, split: str, transform, options: dict):
    """An :class:`~deepmetric.data.events.EventDataset` of the events of ``events``
    (a CSV: video_root, default_fps, delimiter) or ``hdd`` (label_fps, frames, classes,
    sessions); both take the EventDataset options rate, window, min_seconds, random_window,
    test_windows."""
    from .events import EventDataset, load_event_csv, load_hdd_events

    unknown = sorted(set(options) - set(loader_options) - set(_EVENT_OPTIONS))
    if unknown:
        raise TypeError(f"build_dataset({key!r}): unknown option(s) {unknown}; accepted: "
                        f"{', '.join(loader_options + _EVENT_OPTIONS)}")
    load = {k: v for k, v in options.items() if k in loader_options}
    wrap = {k: v for k, v in options.items() if k in _EVENT_OPTIONS}
    events = load_event_csv(root, split, **load) if key == "events" else load_hdd_events(root, split, **load)
    return EventDataset(events, transform, **wrap)


@register_dataset("events", event=True)
def _build_event_csv(split: str = "train", transform=None, root=None, **options):
    return _build_events("events", ("video_root", "default_fps", "delimiter"), root, split, transform, options)


@register_dataset("hdd", aliases=("honda",), event=True)
def _build_hdd(split: str = "train", transform=None, root=None, **options):
    return _build_events("hdd", ("label_fps", "frames", "classes", "sessions", "frame_fps"), root, split, transform, options)
