"""Fashion-MNIST read from the original IDX files (offline benchmark).

Xiao, Rasul and Vollgraf, "Fashion-MNIST: a Novel Image Dataset for Benchmarking Machine
Learning Algorithms" (2017). The Debian package ``dataset-fashion-mnist`` installs the four
original gzip'ed IDX files under ``/usr/share/datasets/fashion-mnist``; a user directory holding
the same files (gzip'ed or not, also torchvision's ``FashionMNIST/raw`` layout) works too.

IDX format (http://yann.lecun.com/exdb/mnist/): a big-endian header ``0x00 0x00 <dtype> <ndim>``
followed by ``ndim`` big-endian uint32 sizes, then the raw data. Images are dtype 0x08 (ubyte)
with 3 dims (N, 28, 28); labels are ubyte with 1 dim (N,).

Two protocols:

* ``"classification"``: the official split, train 60,000 / test 10,000 images, 10 classes.
* ``"zero_shot"``: class-disjoint split for metric learning, classes 0-4 (T-shirt/top, Trouser,
  Pullover, Dress, Coat) are training classes and 5-9 (Sandal, Shirt, Sneaker, Bag, Ankle boot)
  test classes. By default (``zero_shot_images="official"``) train = the official training
  images of classes 0-4 (30,000) and test = the official test images of classes 5-9 (5,000), so no
  image of the official test file is ever trained on. ``zero_shot_images="all"`` pools both
  files: train 35,000 images of classes 0-4, test 35,000 images of classes 5-9.
"""
from __future__ import annotations

import gzip
import os
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
from .contract import MetricDatasetBase

from .registry import register_dataset

__all__ = [
    "ArrayImageDataset",
    "FASHION_MNIST_CLASSES",
    "DEFAULT_FASHION_MNIST_DIRS",
    "build_fashion_mnist",
    "read_idx",
    "find_fashion_mnist_files",
]

FASHION_MNIST_CLASSES = [
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
    "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
]

# Where the Debian package puts the files; $DEEPMETRIC_FASHION_MNIST overrides.
DEFAULT_FASHION_MNIST_DIRS = ["/usr/share/datasets/fashion-mnist"]

_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
_IDX_DTYPES = {
    0x08: np.dtype(">u1"), 0x09: np.dtype(">i1"), 0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"), 0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8"),
}


class ArrayImageDataset(MetricDatasetBase):
    """Images kept in memory as one uint8 array ``[N, H, W]`` (grayscale), converted per item.

    ``ds[i]`` returns ``(image, label)``. The transform receives a ``uint8`` tensor
    ``[1, H, W]`` (torchvision.transforms.v2 accepts plain tensors as images); without a
    transform the image is returned as ``float32`` in [0, 1]. Keeping uint8 (not float) makes
    the whole of Fashion-MNIST 47 MB and lets forked DataLoader workers share it.
    """

    def __init__(self, images: np.ndarray, labels: np.ndarray, *, transform: Callable | None = None,
                 class_names: Sequence[str] | None = None, num_classes: int | None = None):
        images = np.asarray(images)
        labels = np.asarray(labels, dtype=np.int64)
        if images.ndim != 3 or images.dtype != np.uint8:
            raise ValueError(f"images must be a uint8 array [N, H, W], got {images.dtype} {images.shape}")
        if labels.shape != (images.shape[0],):
            raise ValueError(f"labels must have shape ({images.shape[0]},), got {labels.shape}")
        self.images = np.ascontiguousarray(images)
        self.labels = labels
        self.transform = transform
        self.num_classes = int(num_classes if num_classes is not None
                               else (labels.max() + 1 if len(labels) else 0))
        self.class_names = list(class_names) if class_names is not None else None

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        img = torch.from_numpy(self.images[i]).unsqueeze(0)  # [1, H, W] uint8, no copy
        if self.transform is None:
            img = img.float().div_(255.0)
        else:
            img = self.transform(img)
        return img, int(self.labels[i])

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(n={len(self)}, num_classes={self.num_classes}, "
                f"image_size={tuple(self.images.shape[1:])})")


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """Read one IDX file (gzip'ed when the name ends with .gz) and check its header.

    Raises ValueError naming the file when the magic number, dtype code or size is wrong
    (a truncated download, an HTML error page saved as .gz, a wrong file, ...).
    """
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            data = f.read()
    except (OSError, EOFError) as e:  # gzip.BadGzipFile is an OSError
        raise ValueError(f"{path}: cannot read IDX file ({e})") from e
    if len(data) < 4 or data[0] != 0 or data[1] != 0:
        raise ValueError(f"{path}: not an IDX file (first bytes {data[:4].hex() or 'empty'}, "
                         "expected 0000 <dtype> <ndim>)")
    code, ndim = data[2], data[3]
    if code not in _IDX_DTYPES:
        raise ValueError(f"{path}: unknown IDX dtype code 0x{code:02x}")
    header = 4 + 4 * ndim
    if len(data) < header:
        raise ValueError(f"{path}: truncated IDX header ({len(data)} bytes)")
    shape = tuple(int(s) for s in np.frombuffer(data, ">u4", count=ndim, offset=4))
    dtype = _IDX_DTYPES[code]
    expected = int(np.prod(shape)) * dtype.itemsize
    if len(data) - header != expected:
        raise ValueError(f"{path}: IDX header says shape {shape} ({expected} bytes of data) "
                         f"but the file holds {len(data) - header} bytes (truncated or corrupt?)")
    arr = np.frombuffer(data, dtype, offset=header).reshape(shape)
    return arr.astype(dtype.newbyteorder("="), copy=True)


def _candidate_dirs(root) -> list[Path]:
    if root is not None:
        root = Path(root).expanduser()
        return [root, root / "fashion-mnist", root / "FashionMNIST" / "raw", root / "raw"]
    env = os.environ.get("DEEPMETRIC_FASHION_MNIST")
    dirs = [Path(env)] if env else []
    return dirs + [Path(d) for d in DEFAULT_FASHION_MNIST_DIRS]


def find_fashion_mnist_files(root=None, official_split: str = "train") -> tuple[Path, Path]:
    """Locate ``(images, labels)`` IDX files of the official ``train`` or ``test`` ("t10k") split.

    Accepts ``name``, ``name.gz`` and the ``name.idx3-ubyte`` spelling of some mirrors.
    """
    names = _FILES[official_split]
    dirs = _candidate_dirs(root)
    for d in dirs:
        found = []
        for name in names:
            alts = [name, name + ".gz", name.replace("-idx", ".idx"), name.replace("-idx", ".idx") + ".gz"]
            hit = next((d / a for a in alts if (d / a).is_file()), None)
            found.append(hit)
        if all(found):
            return found[0], found[1]
    searched = ", ".join(str(d) for d in dirs)
    hint = ("install the Debian/Ubuntu package 'dataset-fashion-mnist' (apt-get install dataset-fashion-mnist) "
            "or pass root=<dir> holding the original files")
    raise FileNotFoundError(
        f"Fashion-MNIST {official_split} files not found: expected {names[0]}[.gz] and {names[1]}[.gz] "
        f"in one of: {searched}; {hint}")


def _load_official(root, official_split: str) -> tuple[np.ndarray, np.ndarray]:
    img_path, lbl_path = find_fashion_mnist_files(root, official_split)
    images = read_idx(img_path)
    labels = read_idx(lbl_path)
    if images.ndim != 3 or images.dtype != np.uint8:
        raise ValueError(f"{img_path}: expected a uint8 image array [N, H, W], got {images.dtype} {images.shape}")
    if labels.ndim != 1:
        raise ValueError(f"{lbl_path}: expected a 1-d label array, got shape {labels.shape}")
    if len(labels) != len(images):
        raise ValueError(f"{img_path} holds {len(images)} images but {lbl_path} holds {len(labels)} labels")
    if len(labels) and (labels.min() < 0 or labels.max() > 9):
        raise ValueError(f"{lbl_path}: labels must be in 0..9, found {labels.min()}..{labels.max()}")
    return images, labels.astype(np.int64)


@register_dataset("fashion-mnist", aliases=("fashionmnist",))
def build_fashion_mnist(split: str = "train", transform: Callable | None = None, root=None,
                        protocol: str = "classification", zero_shot_images: str = "official",
                        **options) -> ArrayImageDataset:
    """Fashion-MNIST as an in-memory dataset.

    Args:
        split: "train" or "test".
        transform: applied to the ``uint8`` tensor ``[1, 28, 28]`` (see ``build_transform("mnist")``).
        root: directory with the IDX files; default ``$DEEPMETRIC_FASHION_MNIST`` then
            ``/usr/share/datasets/fashion-mnist`` (Debian ``dataset-fashion-mnist``).
        protocol: "classification" (official split, 10 classes) or "zero_shot" (classes 0-4
            train, 5-9 test, labels remapped to 0..4 in each split).
        zero_shot_images: "official" (train images of the train file, test images of the t10k
            file) or "all" (both files pooled).
    """
    if options:
        raise TypeError(f"build_fashion_mnist: unknown option(s) {sorted(options)}")
    if split not in ("train", "test"):
        raise ValueError(f"fashion-mnist: split must be 'train' or 'test', got {split!r}")
    if protocol == "classification":
        images, labels = _load_official(root, split)
        return ArrayImageDataset(images, labels, transform=transform,
                                 class_names=FASHION_MNIST_CLASSES, num_classes=10)
    if protocol != "zero_shot":
        raise ValueError(f"fashion-mnist: protocol must be 'classification' or 'zero_shot', got {protocol!r}")
    if zero_shot_images not in ("official", "all"):
        raise ValueError(f"fashion-mnist: zero_shot_images must be 'official' or 'all', got {zero_shot_images!r}")
    classes = np.arange(0, 5) if split == "train" else np.arange(5, 10)
    sources = [split] if zero_shot_images == "official" else ["train", "test"]
    parts = [_load_official(root, s) for s in sources]
    images = np.concatenate([p[0] for p in parts])
    labels = np.concatenate([p[1] for p in parts])
    keep = np.isin(labels, classes)
    return ArrayImageDataset(images[keep], labels[keep] - classes[0], transform=transform,
                             class_names=[FASHION_MNIST_CLASSES[c] for c in classes], num_classes=5)
