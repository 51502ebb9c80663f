"""The written contracts (deepmetric.data.contract, deepmetric.models.contract): every registered
dataset builder's small instance and every registered model has each attribute the rest of the
package reads; datasets and models from elsewhere get the defaults where they enter a run."""
import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

from deepmetric.data import build_dataset, list_datasets
from deepmetric.data.contract import DATASET_DEFAULTS, MetricDataset, MetricDatasetBase, with_dataset_defaults
from deepmetric.models import create_model, list_models
from deepmetric.models.contract import MODEL_DEFAULTS, EmbeddingNetwork, with_model_defaults
from deepmetric.run.builders import ClassSubset

DATASET_ATTRIBUTES = tuple(MetricDataset.__annotations__)
MODEL_ATTRIBUTES = tuple(EmbeddingNetwork.__annotations__)


def _missing(obj, names) -> list[str]:
    # hasattr, not isinstance: from Python 3.12 a runtime protocol looks attributes up statically,
    # and a ClassSubset forwards its parent's through __getattr__
    return [n for n in names if not hasattr(obj, n)]


# ----------------------------------------------------------------------------- small instances
def _png_folder(root, classes=("ant", "bee", "cat"), n=2):
    for c, name in enumerate(classes):
        (root / name).mkdir(parents=True)
        for i in range(n):
            Image.fromarray(np.full((6, 5, 3), 40 * c + i, np.uint8)).save(root / name / f"{i}.png")
    return root


def _folder(tmp_path):
    return build_dataset("folder", _png_folder(tmp_path / "f"), split="all")


def _csv(tmp_path):
    root = _png_folder(tmp_path / "c")
    rows = [f"{p.relative_to(root)},{p.parent.name}" for p in sorted(root.rglob("*.png"))]
    (root / "list.csv").write_text("path,label\n" + "\n".join(rows) + "\n")
    return build_dataset("csv", root / "list.csv", split="all")


def _benchmark(name):
    def build(tmp_path):
        import test_data_benchmarks as tb

        make = {"cub": tb.make_cub, "nabirds": lambda r: tb.make_cub(r, nabirds=True), "cars196": tb.make_cars,
                "sop": tb.make_sop, "inshop": tb.make_inshop, "flowers102": tb.make_flowers,
                "aircraft": tb.make_aircraft, "dogs": tb.make_dogs}[name]
        root = tmp_path / name
        make(root)
        return build_dataset(name, root, split="train")
    return build


def _fashion_mnist(tmp_path):
    from test_data_fashion_mnist import make_tree

    make_tree(tmp_path, np.random.default_rng(0))
    return build_dataset("fashion-mnist", tmp_path, split="train")


def _emoji(tmp_path):
    from test_data_emoji import make_tree

    make_tree(tmp_path)
    return build_dataset("emoji", tmp_path, split="train")


def _glyphs(tmp_path):
    from deepmetric.data.glyphs import find_cjk_faces

    faces = find_cjk_faces()
    if not faces:
        pytest.skip("no CJK fonts installed (see docs/offline-data.md)")
    return build_dataset("glyphs", tmp_path, split="train", fonts=[f"{faces[0].path}#{faces[0].index}"],
                         max_classes=2, size=16)


def _frame_folder(folder, n):
    folder.mkdir(parents=True)
    for k in range(n):
        Image.fromarray(np.full((8, 8), 10 * k % 256, np.uint8)).save(folder / f"{k:05d}.png")


def _events(tmp_path):
    _frame_folder(tmp_path / "clips" / "a", 24)
    (tmp_path / "events.csv").write_text("path,label,split,start,end,fps\nclips/a,turn,train,,,6\n")
    return build_dataset("events", str(tmp_path / "events.csv"), split="train")


def _hdd(tmp_path):
    labels = np.array([0] * 9 + [2] * 6, dtype=np.int64)
    (tmp_path / "target").mkdir()
    np.save(tmp_path / "target" / "201704101118.npy", labels)
    _frame_folder(tmp_path / "camera" / "201704101118", len(labels))
    (tmp_path / "train_sessions.txt").write_text("201704101118\n")
    return build_dataset("hdd", str(tmp_path), split="train")


SMALL_DATASETS = {
    "synthetic": lambda tmp_path: build_dataset("synthetic", split="train", num_classes=3, per_class=2),
    "synthetic-events": lambda tmp_path: build_dataset("synthetic-events", split="train", num_train=12,
                                                       num_test=6, size=16),
    "folder": _folder, "csv": _csv, "fashion-mnist": _fashion_mnist, "emoji": _emoji, "glyphs": _glyphs,
    "events": _events, "hdd": _hdd,
    **{name: _benchmark(name) for name in ("cub", "nabirds", "cars196", "sop", "inshop", "flowers102",
                                           "aircraft", "dogs")},
}


def test_every_registered_dataset_has_a_small_instance_here():
    assert sorted(SMALL_DATASETS) == list_datasets()


@pytest.mark.parametrize("name", sorted(SMALL_DATASETS))
def test_every_registered_dataset_keeps_the_contract(name, tmp_path):
    ds = SMALL_DATASETS[name](tmp_path)
    assert isinstance(ds, MetricDatasetBase) and isinstance(ds, MetricDataset)
    assert _missing(ds, DATASET_ATTRIBUTES) == []
    labels = np.asarray(ds.labels)
    assert labels.dtype == np.int64 and labels.shape == (len(ds),) and isinstance(ds.num_classes, int)
    assert ds.class_names is None or len(ds.class_names) == ds.num_classes
    assert ds.paths is None or len(ds.paths) == len(ds)
    assert (ds.paths is None) == (ds.load_image is None)  # the stored image: file-based datasets only
    # a validation subset keeps it too, through its parent
    sub = ClassSubset(ds, np.unique(labels)[:1])
    assert _missing(sub, DATASET_ATTRIBUTES) == []


def test_a_dataset_from_elsewhere_gets_the_defaults_it_lacks():
    ds = torch.utils.data.TensorDataset(torch.zeros(4, 2), torch.arange(4))
    assert with_dataset_defaults(ds) is ds
    assert _missing(ds, DATASET_ATTRIBUTES) == [] and isinstance(ds, MetricDataset)
    assert all(getattr(ds, n) is DATASET_DEFAULTS[n] for n in DATASET_ATTRIBUTES)
    own = with_dataset_defaults(build_dataset("synthetic", split="train", num_classes=3, per_class=2))
    assert own.num_classes == 3 and own.labels is not None  # what a dataset has stays


# ----------------------------------------------------------------------------- models
def _small_model(name):
    if name == "two_head":
        return create_model(name, backbone="glyph_resnet", input_size=32, num_classes=3, embedding_dim=4)
    return create_model(name, embedding_dim=4)


@pytest.mark.parametrize("name", list_models())
def test_every_registered_model_keeps_the_contract(name):
    model = _small_model(name)
    assert _missing(model, MODEL_ATTRIBUTES) == [] and isinstance(model, EmbeddingNetwork)
    assert isinstance(model.num_features, int) and model.embedding_dim == 4
    assert model.backbone is None or isinstance(model.backbone, nn.Module)
    assert model.projection is None and model.projection_dim is None and model.head_init is None


def test_an_embedding_model_with_every_optional_part():
    model = create_model("glyph_resnet", embedding_dim=4, widths=(8,), depths=(1,), pool="gem", head_init="pca",
                         projection={"dim": 3})
    assert model.pool == "gem" and model.head_init == "pca" and model.projection_dim == 3
    assert isinstance(model.projection, nn.Module) and isinstance(model.head, nn.Module)


def test_a_model_from_elsewhere_gets_the_defaults_it_lacks():
    class Plain(nn.Module):
        def __init__(self):
            super().__init__()
            self.head = nn.Linear(3, 2)

    model = Plain()
    assert with_model_defaults(model) is model
    assert _missing(model, MODEL_DEFAULTS) == []
    assert isinstance(model.head, nn.Linear) and "head.weight" in model.state_dict()  # what it has stays
    assert model.backbone is None and model.pool is None and model.embedding_dim is None
    assert set(model.state_dict()) == {"head.weight", "head.bias"}  # the defaults are not weights
