"""Shared test set-up: small thread counts so the suite behaves on 2 cores; the one config
builder (:func:`synthetic_config`) and the one served-app fixture.

tests/ mirrors src/deepmetric/: tests/<package>/ holds the tests of deepmetric.<package>, and
tests/ itself the project-wide checks and the helper modules (serving.py, search_data.py, ...).
A test may reuse another folder's data builders (``from test_data_emoji import make_tree``):
every test folder is importable."""
import os
import sys
from pathlib import Path

sys.path[:0] = [str(d) for d in sorted(Path(__file__).parent.iterdir())
                if d.is_dir() and any(d.glob("test_*.py"))]

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture
def rng():
    return np.random.default_rng(0)


# --------------------------------------------------------------------------- shared configs
def _deep_update(base: dict, extra: dict) -> dict:
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _deep_update(base[key], value)
        else:
            base[key] = value
    return base


def free_port() -> int:
    """A loopback port free a moment ago (bound, then closed): for a server or rendezvous that a
    test starts itself, on 127.0.0.1 only."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def synthetic_config(out_dir=None, *, classes: int = 6, per_class: int = 16, data_seed: int = 5,
                     hidden: int = 32, **sections) -> dict:
    """The small synthetic run most training tests use (well under a second): ``classes``
    Gaussian clusters x ``per_class`` points in 16-d, an MLP (``hidden`` units) to an 8-d
    embedding, heated softmax alpha 16, SGD lr 0.05 with momentum, 3 epochs of batch 16,
    evaluation after every epoch.  ``sections`` (``data=``, ``loss=``, ``train=``, ...) update
    the defaults key by key (mappings merge, other values replace); ``out_dir`` sets
    ``train.out_dir``.  Returns the raw mapping (``config_from_dict`` validates it)."""
    raw = {
        "data": {"name": "synthetic", "options": {"num_classes": classes, "per_class": per_class, "dim": 16,
                                                  "seed": data_seed}},
        "model": {"name": "synthetic_mlp", "options": {"in_dim": 16, "hidden": hidden, "embedding_dim": 8}},
        "loss": [{"name": "heated_softmax", "options": {"alpha": 16.0}}],
        "optim": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
        "train": {"epochs": 3, "batch_size": 16, "seed": 0, "progress": False},
        "eval": {"every": 1},
    }
    if out_dir is not None:
        raw["train"]["out_dir"] = str(out_dir)
    return _deep_update(raw, sections)


@pytest.fixture
def synthetic_raw(tmp_path):
    """:func:`synthetic_config` writing into ``tmp_path / "run"`` unless ``out_dir`` is given."""
    def make(out_dir=None, **kw):
        return synthetic_config(out_dir if out_dir is not None else tmp_path / "run", **kw)
    return make


# --------------------------------------------------------------------------- served search app
@pytest.fixture(scope="module")
def serve_shapes(tmp_path_factory):
    """deepmetric serve's app over the shapes index (tests/search_data.py), in a thread on a free
    loopback port: ``serve_shapes(**create_app_options)`` starts one and returns ``(url, shapes,
    index)``; the servers stop after the module's tests."""
    import contextlib

    from deepmetric.search import Index
    from deepmetric.search.serve import create_app
    from search_data import shapes_setup
    from serving import serve_in_thread

    with contextlib.ExitStack() as servers:
        def start(**options):
            shapes = shapes_setup(tmp_path_factory)
            index = Index.load(shapes["index_dir"])
            return servers.enter_context(serve_in_thread(create_app(index, **options))), shapes, index
        yield start
