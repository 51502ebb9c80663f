"""Synthetic ego-motion events: an offline, CPU-cheap stand-in for HDD (docs/events.md).

Each clip is a camera flying over a random static ground texture (smooth noise plus random
rectangles), rendered as 64x64 grayscale frames at ``fps`` (6) frames per second.  The class
is the camera's motion pattern:

========================  =====================================================
``straight``              constant forward speed
``turn_left/right``       forward speed plus a constant yaw rate (+/-)
``lane_change_left/right`` forward speed plus a lateral sine bump (one lane over)
``stop``                  forward speed decelerating to zero by mid-event, then still
========================  =====================================================

Nuisances drawn per clip: texture, start position and heading, speed (x0.7..1.3), yaw rate,
lane-change amplitude, sensor noise.  Durations are uniform in [1.5, 5] s, so some events are
shorter than the paper's 2 s minimum and are dropped by :class:`EventDataset`.  The class
frequencies are long-tailed like HDD's (``CLASS_FREQUENCIES``).  Everything is a function of
``(seed, clip index)``: the same options always render identical frames.

Splits: ``train`` and ``val`` are disjoint parts of one training pool (``val_fraction`` of
it, stratified by class, for choosing hyper-parameters); ``test`` is a separate pool.
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from .events import Event, EventDataset, EventList
from .registry import register_dataset

__all__ = ["EVENT_CLASSES", "CLASS_FREQUENCIES", "render_clip", "clip_spec", "synthetic_event_list",
           "build_synthetic_events"]

EVENT_CLASSES = ("straight", "turn_left", "turn_right", "lane_change_left", "lane_change_right", "stop")
#: long-tailed class frequencies (HDD-like: one dominant class, rare manoeuvres)
CLASS_FREQUENCIES = (0.50, 0.16, 0.14, 0.08, 0.07, 0.05)

_SPLIT_IDS = {"train": 1, "test": 2}


def _class_sequence(n: int, rng: np.random.Generator) -> np.ndarray:
    """Exactly round(n * frequency) clips per class (at least 1), shuffled."""
    counts = np.maximum(1, np.round(np.asarray(CLASS_FREQUENCIES) * n).astype(int))
    counts[0] += n - counts.sum()
    labels = np.repeat(np.arange(len(EVENT_CLASSES)), counts)
    rng.shuffle(labels)
    return labels


def clip_spec(seed: int, pool: str, index: int, label: int) -> dict:
    """All random choices of one clip (deterministic in its arguments)."""
    rng = np.random.default_rng([seed, _SPLIT_IDS[pool], index])
    return {
        "label": int(label),
        "duration": float(rng.uniform(1.5, 5.0)),
        "speed": float(rng.uniform(0.7, 1.3)) * 0.10,      # texture units per second
        "yaw": float(rng.uniform(0.35, 0.6)),              # rad per second
        "lateral": float(rng.uniform(0.10, 0.16)),         # lane width, texture units
        "start": rng.uniform(-0.3, 0.3, size=2).tolist(),
        "heading": float(rng.uniform(0, 2 * math.pi)),
        "texture_seed": int(rng.integers(0, 2**31 - 1)),
        "noise": float(rng.uniform(1.0, 3.0)),
    }


def _texture(seed: int, size: int = 256) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    base = torch.rand(1, 1, 24, 24, generator=g)
    tex = F.interpolate(base, size=(size, size), mode="bicubic", align_corners=False)[0, 0] * 0.6
    for _ in range(40):  # random bright / dark rectangles ("shapes" on the ground)
        h, w = torch.randint(6, 28, (2,), generator=g).tolist()
        y, x = torch.randint(0, size - 28, (2,), generator=g).tolist()
        tex[y:y + h, x:x + w] = float(torch.rand((), generator=g))
    return tex.clamp(0, 1)


def _poses(spec: dict, times: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Camera centre [T, 2] and heading [T] at ``times`` (closed form per class)."""
    name = EVENT_CLASSES[spec["label"]]
    v, D = spec["speed"], spec["duration"]
    th0 = spec["heading"]
    t = times
    if name == "straight":
        dist, th, lat = v * t, np.full_like(t, th0), np.zeros_like(t)
    elif name in ("turn_left", "turn_right"):
        w = spec["yaw"] * (1 if name == "turn_left" else -1)
        dist, th, lat = v * t, th0 + w * t, np.zeros_like(t)
    elif name in ("lane_change_left", "lane_change_right"):
        s = -1 if name == "lane_change_left" else 1
        dist, th = v * t, np.full_like(t, th0)
        lat = s * spec["lateral"] * (1 - np.cos(np.pi * np.clip(t / D, 0, 1))) / 2
    else:  # stop: linear deceleration to zero at D/2, then still
        tb = D / 2
        tc = np.minimum(t, tb)
        dist, th, lat = v * (tc - tc ** 2 / (2 * tb)), np.full_like(t, th0), np.zeros_like(t)
    if name in ("turn_left", "turn_right"):
        w = spec["yaw"] * (1 if name == "turn_left" else -1)
        # integrate the forward motion along the turning heading (closed form of a circle arc)
        x = spec["start"][0] + v / w * (np.sin(th) - math.sin(th0))
        y = spec["start"][1] - v / w * (np.cos(th) - math.cos(th0))
    else:
        fwd = np.array([math.cos(th0), math.sin(th0)])
        side = np.array([-math.sin(th0), math.cos(th0)])
        c = np.asarray(spec["start"])[None] + dist[:, None] * fwd + lat[:, None] * side
        x, y = c[:, 0], c[:, 1]
    return np.stack([x, y], 1), th


def render_clip(spec: dict, indices, *, fps: float = 6.0, size: int = 64, view: float = 0.28) -> np.ndarray:
    """Frames ``indices`` (at ``fps``) of the clip ``spec`` as uint8 ``[len(indices), size, size]``."""
    idx = np.asarray(list(indices), dtype=np.int64)
    times = idx / fps
    centre, heading = _poses(spec, times)
    tex = _texture(spec["texture_seed"])[None, None]
    lin = torch.linspace(-view, view, size)
    gy, gx = torch.meshgrid(lin, lin, indexing="ij")
    # image "up" is the direction of travel: pixel (gx, gy) -> centre + R(th) [-gy, gx]
    c = torch.as_tensor(np.cos(heading), dtype=torch.float32)[:, None, None]
    s = torch.as_tensor(np.sin(heading), dtype=torch.float32)[:, None, None]
    cx = torch.as_tensor(centre[:, 0], dtype=torch.float32)[:, None, None]
    cy = torch.as_tensor(centre[:, 1], dtype=torch.float32)[:, None, None]
    wx = cx + (-gy) * c - gx * s
    wy = cy + (-gy) * s + gx * c
    grid = torch.stack([wx, wy], -1)
    frames = F.grid_sample(tex.expand(len(idx), -1, -1, -1), grid, mode="bilinear", padding_mode="reflection",
                           align_corners=False)[:, 0]
    img = frames * 200 + 28
    # sensor noise seeded by (clip, frame index): a frame does not depend on which others are asked for
    noise = torch.stack([torch.randn((size, size), generator=torch.Generator().manual_seed(
        spec["texture_seed"] * 1009 + int(i))) for i in idx]) * spec["noise"]
    return (img + noise).round().clamp(0, 255).to(torch.uint8).numpy()


def synthetic_event_list(split: str = "train", *, num_train: int = 900, num_test: int = 600, fps: float = 6.0,
                         seed: int = 0, val_fraction: float = 0.2) -> tuple[EventList, dict]:
    """The events of ``split`` (train / val / test) and the clip specs keyed by source id."""
    if split not in ("train", "val", "test"):
        raise ValueError(f"synthetic_events: unknown split {split!r}; choose train, val or test")
    if not 0 <= val_fraction < 1:
        raise ValueError(f"synthetic_events: val_fraction must be in [0, 1), got {val_fraction}")
    pool = "test" if split == "test" else "train"
    n = num_test if pool == "test" else num_train
    labels = _class_sequence(n, np.random.default_rng([seed, _SPLIT_IDS[pool], 0xC1A55]))
    keep = np.ones(n, bool)
    if pool == "train":
        is_val = np.zeros(n, bool)
        for c in range(len(EVENT_CLASSES)):
            members = np.flatnonzero(labels == c)
            is_val[members[: int(round(len(members) * val_fraction))]] = True
        keep = is_val if split == "val" else ~is_val
    events, specs = [], {}
    for i in np.flatnonzero(keep):
        spec = clip_spec(seed, pool, int(i), int(labels[i]))
        src = f"synthetic://{pool}/{seed}/{i}"
        specs[src] = spec
        nframes = int(math.floor(spec["duration"] * fps))
        events.append(Event(src, int(labels[i]), 0.0, nframes / fps, fps, f"clip {pool}/{i}", nframes))
    return EventList(events, list(EVENT_CLASSES), name="synthetic_events", split=split), specs


@register_dataset("synthetic-events", aliases=("syntheticevents",), event=True)
def build_synthetic_events(split: str = "train", transform=None, root=None, *, num_train: int = 900,
                           num_test: int = 600, fps: float = 6.0, size: int = 64, seed: int = 0,
                           val_fraction: float = 0.2, rate: float = 3.0, window: int = 6,
                           min_seconds: float = 2.0, random_window: bool | None = None,
                           test_windows: int = 1, cache: bool = False) -> EventDataset:
    """``build_dataset("synthetic_events", split=...)``: rendered clips through the same
    :class:`EventDataset` path as real videos (sampling at ``rate``, short events dropped,
    random / centre six-frame windows, default SOD transform).  ``root`` is unused.
    ``cache`` keeps every clip's frames in memory once rendered (``size=32``: 1 KB a frame)."""
    events, specs = synthetic_event_list(split, num_train=num_train, num_test=num_test, fps=fps, seed=seed,
                                         val_fraction=val_fraction)

    store: dict[str, np.ndarray] = {}

    def reader(source, indices):
        if not cache:
            return list(render_clip(specs[source], indices, fps=fps, size=size))
        if source not in store:
            e = next(ev for ev in events.events if ev.source == source)
            store[source] = render_clip(specs[source], range(e.num_frames), fps=fps, size=size)
        return list(store[source][np.asarray(indices)])

    return EventDataset(events, transform, rate=rate, window=window, min_seconds=min_seconds,
                        random_window=random_window, test_windows=test_windows, reader=reader)
