"""Fashion-MNIST from IDX files written here in the exact IDX format (struct-packed big-endian
header), plus the real files of the Debian package dataset-fashion-mnist when installed,
cross-checked with the package's own reader (utils/mnist_reader.py)."""
import gzip
import importlib.util
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from deepmetric.data import build_dataset
from deepmetric.data.fashion_mnist import FASHION_MNIST_CLASSES, build_fashion_mnist, read_idx

DEBIAN_DIR = Path("/usr/share/datasets/fashion-mnist")


def write_idx(path, arr, gz=True):
    """IDX: 0x0000, dtype code 0x08 (ubyte), ndim, then ndim big-endian uint32 sizes, then data."""
    arr = np.asarray(arr, dtype=np.uint8)
    blob = struct.pack(">HBB", 0, 0x08, arr.ndim) + struct.pack(f">{arr.ndim}I", *arr.shape) + arr.tobytes()
    path = Path(str(path) + (".gz" if gz else ""))
    path.write_bytes(gzip.compress(blob) if gz else blob)
    return path


def make_tree(root, rng, n_train=40, n_test=20, gz=True):
    root.mkdir(parents=True, exist_ok=True)
    data = {}
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        images = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        labels = np.arange(n) % 10
        rng.shuffle(labels)
        write_idx(root / f"{prefix}-images-idx3-ubyte", images, gz)
        write_idx(root / f"{prefix}-labels-idx1-ubyte", labels, gz)
        data[prefix] = (images, labels)
    return data


@pytest.mark.parametrize("gz", [True, False])
def test_classification_split(tmp_path, rng, gz):
    data = make_tree(tmp_path, rng, gz=gz)
    for split, prefix in (("train", "train"), ("test", "t10k")):
        ds = build_fashion_mnist(split, root=tmp_path)
        images, labels = data[prefix]
        assert len(ds) == len(labels) and ds.num_classes == 10
        assert ds.class_names == FASHION_MNIST_CLASSES
        assert ds.labels.dtype == np.int64
        np.testing.assert_array_equal(ds.labels, labels)
        np.testing.assert_array_equal(ds.images, images)
        x, y = ds[3]
        assert x.shape == (1, 28, 28) and x.dtype == torch.float32 and y == labels[3]
        np.testing.assert_allclose(x[0].numpy(), images[3] / 255.0, atol=1e-7)


def test_zero_shot_split(tmp_path, rng):
    data = make_tree(tmp_path, rng)
    tr = build_fashion_mnist("train", root=tmp_path, protocol="zero_shot")
    te = build_fashion_mnist("test", root=tmp_path, protocol="zero_shot")
    train_images, train_labels = data["train"]
    test_images, test_labels = data["t10k"]
    keep = train_labels < 5
    np.testing.assert_array_equal(tr.images, train_images[keep])
    np.testing.assert_array_equal(tr.labels, train_labels[keep])
    keep = test_labels >= 5
    np.testing.assert_array_equal(te.images, test_images[keep])
    np.testing.assert_array_equal(te.labels, test_labels[keep] - 5)  # remapped to 0..4
    assert tr.num_classes == te.num_classes == 5
    assert tr.class_names == FASHION_MNIST_CLASSES[:5] and te.class_names == FASHION_MNIST_CLASSES[5:]
    assert not set(tr.class_names) & set(te.class_names)
    # "all": both official files pooled
    te_all = build_fashion_mnist("test", root=tmp_path, protocol="zero_shot", zero_shot_images="all")
    pooled = np.concatenate([train_labels, test_labels])
    assert len(te_all) == int((pooled >= 5).sum())
    np.testing.assert_array_equal(te_all.images, np.concatenate([train_images, test_images])[pooled >= 5])


def test_registry_and_transform(tmp_path, rng):
    make_tree(tmp_path, rng)
    calls = []

    def t(x):
        calls.append((x.dtype, tuple(x.shape)))
        return x.float()

    ds = build_dataset("fashion-mnist", root=tmp_path, split="test", transform=t, protocol="zero_shot")
    ds[0]
    assert calls == [(torch.uint8, (1, 28, 28))]


def test_torchvision_layout(tmp_path, rng):
    make_tree(tmp_path / "FashionMNIST" / "raw", rng)
    assert len(build_fashion_mnist("train", root=tmp_path)) == 40


def test_errors(tmp_path, rng):
    with pytest.raises(FileNotFoundError, match=r"train-images-idx3-ubyte.*dataset-fashion-mnist"):
        build_fashion_mnist("train", root=tmp_path)
    data = make_tree(tmp_path, rng)
    with pytest.raises(ValueError, match="split"):
        build_fashion_mnist("val", root=tmp_path)
    with pytest.raises(ValueError, match="protocol"):
        build_fashion_mnist("train", root=tmp_path, protocol="open_set")
    with pytest.raises(ValueError, match="zero_shot_images"):
        build_fashion_mnist("train", root=tmp_path, protocol="zero_shot", zero_shot_images="some")
    with pytest.raises(TypeError, match="unknown option"):
        build_fashion_mnist("train", root=tmp_path, sizee=3)
    # label count mismatch
    write_idx(tmp_path / "train-labels-idx1-ubyte", data["train"][1][:-1])
    with pytest.raises(ValueError, match="40 images but .*train-labels.* 39 labels"):
        build_fashion_mnist("train", root=tmp_path)
    # the label file where the images should be
    write_idx(tmp_path / "train-images-idx3-ubyte", data["train"][1])
    with pytest.raises(ValueError, match=r"train-images-idx3-ubyte.gz: expected a uint8 image array"):
        build_fashion_mnist("train", root=tmp_path)
    # truncated file
    bad = tmp_path / "t10k-images-idx3-ubyte.gz"
    blob = gzip.decompress(bad.read_bytes())
    bad.write_bytes(gzip.compress(blob[:-100]))
    with pytest.raises(ValueError, match="t10k-images-idx3-ubyte.gz: IDX header says shape"):
        build_fashion_mnist("test", root=tmp_path)
    # not gzip at all / not IDX
    bad.write_bytes(b"<html>not found</html>")
    with pytest.raises(ValueError, match="t10k-images-idx3-ubyte.gz: cannot read"):
        build_fashion_mnist("test", root=tmp_path)
    raw = tmp_path / "x-idx1-ubyte"
    raw.write_bytes(b"\x12\x34\x08\x01")
    with pytest.raises(ValueError, match="not an IDX file"):
        read_idx(raw)


@pytest.mark.skipif(not DEBIAN_DIR.is_dir(), reason="dataset-fashion-mnist not installed")
def test_real_debian_files():
    spec = importlib.util.spec_from_file_location(
        "mnist_reader", "/usr/share/doc/dataset-fashion-mnist/utils/mnist_reader.py")
    if spec is None or not Path(spec.origin).is_file():
        pytest.skip("package reader not installed")
    reader = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reader)
    ref_images, ref_labels = reader.load_mnist(str(DEBIAN_DIR), kind="t10k")
    te = build_fashion_mnist("test")  # default location
    assert len(te) == 10000
    np.testing.assert_array_equal(te.images.reshape(len(te), -1), ref_images)
    np.testing.assert_array_equal(te.labels, ref_labels)
    assert np.bincount(te.labels).tolist() == [1000] * 10
    tr = build_fashion_mnist("train", protocol="zero_shot")
    assert len(tr) == 30000 and np.bincount(tr.labels).tolist() == [6000] * 5
