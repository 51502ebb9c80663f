"""Test data for the search tests: a folder of small PIL-drawn images (four classes of coloured
shapes, each image with its own position, size and background noise) and a tiny checkpoint
trained on it through the normal ``train`` code path, so that neighbours are predictable:
a new red disc has red discs as its nearest neighbours.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

#: class name -> (RGB colour, shape)
SHAPES = {
    "blue_square": ((40, 80, 230), "square"),
    "green_triangle": ((40, 190, 60), "triangle"),
    "red_disc": ((225, 40, 40), "disc"),
    "yellow_cross": ((235, 210, 30), "cross"),
}


def draw_shape(name: str, seed: int, size: int = 40) -> Image.Image:
    """One image of class ``name``: the class's shape and colour on a noisy grey background."""
    colour, shape = SHAPES[name]
    rng = np.random.default_rng(seed)
    bg = rng.integers(90, 140, size=(size, size, 3), dtype=np.uint8)
    img = Image.fromarray(bg, "RGB")
    d = ImageDraw.Draw(img)
    r = int(rng.integers(size // 4, size // 3 + 1))
    cx, cy = (int(v) for v in rng.integers(r + 1, size - r - 1, size=2))
    jitter = tuple(int(np.clip(c + rng.integers(-20, 21), 0, 255)) for c in colour)
    box = (cx - r, cy - r, cx + r, cy + r)
    if shape == "square":
        d.rectangle(box, fill=jitter)
    elif shape == "disc":
        d.ellipse(box, fill=jitter)
    elif shape == "triangle":
        d.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=jitter)
    else:
        w = max(2, r // 2)
        d.rectangle((cx - r, cy - w, cx + r, cy + w), fill=jitter)
        d.rectangle((cx - w, cy - r, cx + w, cy + r), fill=jitter)
    return img


def make_shapes_folder(root: Path, per_class: int = 8, seed: int = 0, classes=None) -> Path:
    """``root/<class>/<class>_NN.png``: ``per_class`` images of every class (or of ``classes``)."""
    root = Path(root)
    for ci, name in enumerate(classes or SHAPES):
        (root / name).mkdir(parents=True, exist_ok=True)
        for j in range(per_class):
            draw_shape(name, seed * 100_000 + ci * 1000 + j).save(root / name / f"{name}_{j:02d}.png")
    return root


def tiny_config(folder: Path, out_dir: Path, epochs: int = 20) -> dict:
    """A seconds-long run on the shapes folder: 3-channel compact ResNet, 16-d embedding; 20 epochs
    (40 steps) separate the classes by a wide margin (same class cosine > 0.9, others < 0.2)."""
    return {
        "data": {"name": "folder", "root": str(folder), "transform": "resize_crop",
                 "transform_options": {"resize": 36, "crop": 32}, "num_workers": 0},
        "model": {"name": "glyph_resnet",
                  "options": {"embedding_dim": 16, "in_chans": 3, "widths": [8, 16], "depths": [1, 1]}},
        "loss": [{"name": "heated_softmax", "options": {"alpha": 16.0}}],
        "optim": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
        "train": {"epochs": epochs, "batch_size": 16, "seed": 0, "out_dir": str(out_dir),
                  "progress": False},
        "eval": {"every": 0, "split": "train"},
    }


def train_tiny_checkpoint(folder: Path, out_dir: Path) -> Path:
    """Train :func:`tiny_config` and return the path of its ``last.pt``."""
    from deepmetric.run.config_io import config_from_dict
    from deepmetric.train.loop import train

    train(config_from_dict(tiny_config(folder, out_dir)))
    return Path(out_dir) / "last.pt"


_CACHE: dict = {}


def shapes_setup(tmp_path_factory) -> dict:
    """Once per test session: the shapes folder, its tiny checkpoint and an exact index of it
    (``{"folder", "checkpoint", "index_dir", "queries"}``; ``queries`` are new images, one
    folder per class, not in the index)."""
    if "setup" not in _CACHE:
        from deepmetric.search import Index

        base = tmp_path_factory.mktemp("shapes")
        folder = make_shapes_folder(base / "gallery")
        queries = make_shapes_folder(base / "queries", per_class=2, seed=7)
        ckpt = train_tiny_checkpoint(folder, base / "run")
        Index.build(ckpt, out=base / "index", progress=False)
        _CACHE["setup"] = {"folder": folder, "checkpoint": ckpt, "index_dir": base / "index",
                           "queries": queries, "base": base}
    return _CACHE["setup"]
