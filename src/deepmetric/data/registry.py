"""One factory for every dataset: ``build_dataset(name, root, split, transform, **options)``.

Names: cub, cars196, sop, inshop, flowers102, aircraft, dogs, nabirds (official archives,
see :mod:`deepmetric.data.benchmarks`), folder and csv (your own data, see
:mod:`deepmetric.data.folder`), fashion-mnist, glyphs and emoji (offline benchmarks, built by
:mod:`deepmetric.data.fashion_mnist`, :mod:`deepmetric.data.glyphs` and :mod:`deepmetric.data.emoji`);
video events: events (a CSV of clips), hdd (per-frame label arrays) and synthetic_events
(rendered ego-motion clips), see :mod:`deepmetric.data.events` and docs/events.md.
"""
from __future__ import annotations

import difflib
from typing import Callable

from .benchmarks import BENCHMARKS, load_benchmark
from .folder import load_csv, load_folder
from .image_list import ImageListDataset

__all__ = ["build_dataset", "list_datasets", "DATASET_NAMES"]

DATASET_NAMES = (
    "cub", "cars196", "sop", "inshop", "flowers102", "aircraft", "dogs", "nabirds",
    "folder", "csv", "fashion-mnist", "glyphs", "emoji",
    "events", "hdd", "synthetic-events",
)

_ALIASES = {
    "cub200": "cub", "cub-200": "cub", "cub-200-2011": "cub", "cub_200_2011": "cub", "cub200-2011": "cub",
    "cars": "cars196", "cars-196": "cars196", "stanford-cars": "cars196",
    "stanford-online-products": "sop", "online-products": "sop",
    "in-shop": "inshop", "deepfashion-inshop": "inshop",
    "flowers": "flowers102", "flowers-102": "flowers102", "oxford-flowers102": "flowers102",
    "fgvc-aircraft": "aircraft", "fgvcaircraft": "aircraft",
    "stanford-dogs": "dogs",
    "fashionmnist": "fashion-mnist",
    "honda": "hdd", "syntheticevents": "synthetic-events",
}
#: options of EventDataset (frame sampling and windows), accepted by every event dataset
_EVENT_OPTIONS = ("rate", "window", "min_seconds", "random_window", "test_windows")

# options the ImageListDataset wrapper takes (every file-based dataset accepts them)
_DATASET_OPTIONS = ("skip_missing", "verify", "mode", "max_decode_mb")
_OPTIONS = {
    "benchmark": ("protocol", "check_counts"),
    "folder": ("class_split", "split_file", "seed", "extensions", "allow_empty_classes"),
    "csv": ("image_root", "label_map", "delimiter"),
}


def list_datasets() -> list[str]:
    """Every name :func:`build_dataset` accepts (aliases such as 'cub200' are also accepted)."""
    return list(DATASET_NAMES)


#: the video-event datasets (a random window per access on their "train" split)
EVENT_DATASETS = ("events", "hdd", "synthetic-events")


def is_event_dataset(name: str) -> bool:
    """Whether ``name`` (or an alias) is one of :data:`EVENT_DATASETS`; unknown names are not."""
    try:
        return _canonical(name) in EVENT_DATASETS
    except (TypeError, ValueError):
        return False


def _canonical(name: str) -> str:
    if not isinstance(name, str):
        raise TypeError(f"dataset name must be a string, got {type(name).__name__}")
    key = name.strip().lower().replace("_", "-").replace(" ", "-")
    key = _ALIASES.get(key, key)
    if key not in DATASET_NAMES:
        close = difflib.get_close_matches(key, list(DATASET_NAMES) + list(_ALIASES), n=3, cutoff=0.6)
        hint = f" Did you mean {', '.join(repr(_ALIASES.get(c, c)) for c in close)}?" if close else ""
        raise ValueError(f"unknown dataset {name!r}. Known: {', '.join(DATASET_NAMES)}.{hint}")
    return key


def _split_options(name: str, kind: str, options: dict) -> tuple[dict, dict]:
    allowed = _OPTIONS[kind]
    unknown = sorted(set(options) - set(allowed) - set(_DATASET_OPTIONS))
    if unknown:
        raise TypeError(
            f"build_dataset({name!r}): unknown option(s) {unknown}; accepted: "
            f"{', '.join(allowed + _DATASET_OPTIONS)}"
        )
    load = {k: v for k, v in options.items() if k in allowed}
    wrap = {k: v for k, v in options.items() if k in _DATASET_OPTIONS}
    return load, wrap


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
            ``min_vendors``, ``max_classes``; see docs/offline-data.md).

    Returns: a Dataset with ``labels`` (int64, 0..C-1), ``num_classes``, ``class_names``.
    """
    key = _canonical(name)
    if key in EVENT_DATASETS:
        return _build_events(key, root, split, transform, options)
    if key == "glyphs":
        from .glyphs import build_glyph_dataset

        return build_glyph_dataset(split=split, transform=transform, root=root, **options)
    if key == "emoji":
        from .emoji import build_emoji_dataset

        return build_emoji_dataset(split=split, transform=transform, root=root, **options)
    if key == "fashion-mnist":
        from .fashion_mnist import build_fashion_mnist

        return build_fashion_mnist(split=split, transform=transform, root=root, **options)
    if key in BENCHMARKS:
        load, wrap = _split_options(key, "benchmark", options)
        image_list = load_benchmark(key, root, split=split, **load)
    elif key == "folder":
        load, wrap = _split_options(key, "folder", options)
        image_list = load_folder(root, split=split, **load)
    else:
        load, wrap = _split_options(key, "csv", options)
        image_list = load_csv(root, split=split, **load)
    return ImageListDataset(image_list, transform, **wrap)


def _build_events(key: str, root, split: str, transform, options: dict):
    """Video-event datasets: ``events`` (CSV: video_root, default_fps, delimiter), ``hdd``
    (label_fps, frames, classes, sessions, frame_fps) and ``synthetic-events`` (num_train, num_test, fps,
    size, seed, val_fraction); all take the EventDataset options rate, window, min_seconds,
    random_window, test_windows."""
    from .events import EventDataset, load_event_csv, load_hdd_events

    if key == "synthetic-events":
        from .synthetic_events import build_synthetic_events

        return build_synthetic_events(split=split, transform=transform, root=root, **options)
    loader_options = {"events": ("video_root", "default_fps", "delimiter"),
                      "hdd": ("label_fps", "frames", "classes", "sessions", "frame_fps")}[key]
    unknown = sorted(set(options) - set(loader_options) - set(_EVENT_OPTIONS))
    if unknown:
        raise TypeError(f"build_dataset({key!r}): unknown option(s) {unknown}; accepted: "
                        f"{', '.join(loader_options + _EVENT_OPTIONS)}")
    load = {k: v for k, v in options.items() if k in loader_options}
    wrap = {k: v for k, v in options.items() if k in _EVENT_OPTIONS}
    events = load_event_csv(root, split, **load) if key == "events" else load_hdd_events(root, split, **load)
    return EventDataset(events, transform, **wrap)
