"""Validation split carved from the training classes (``data.val_classes``): class-disjoint
from training and test, seeded, used to choose ``best.pt``, early stopping and
``auto_plateau``; the test split is never used to choose anything."""
import json

import numpy as np
import pytest
import torch
from PIL import Image

from deepmetric.train import evaluator as loop
from deepmetric.run.builders import VAL_SPLIT, ClassSubset, build_split, carve_val_classes
from deepmetric.run.config import ConfigError
from deepmetric.run.config_io import config_from_dict
from deepmetric.train.loop import train
from conftest import synthetic_config
from deepmetric.run.rundir import read_log


def _raw(out_dir, val_classes=0.25, **train_extra):
    return synthetic_config(out_dir, classes=8, per_class=12, data={"val_classes": val_classes},
                            train={"epochs": 5, "batch_size": 12, **train_extra})


def _records(path, kind):
    return read_log(path, type=kind)


# --------------------------------------------------------------------------- carving
def test_fraction_count_and_list_choose_the_classes():
    labels = np.repeat(np.arange(10), 3)
    keep, val = carve_val_classes(labels, 0.2, seed=0)
    assert len(val) == 2 and len(keep) == 8 and set(keep) | set(val) == set(range(10))
    assert not set(keep) & set(val)
    assert len(carve_val_classes(labels, 3, seed=0)[1]) == 3
    assert len(carve_val_classes(labels, 0.01, seed=0)[1]) == 1  # at least one class
    keep, val = carve_val_classes(labels, [7, 2], seed=0)
    assert val.tolist() == [2, 7] and 7 not in keep
    names = [f"c{i}" for i in range(10)]
    assert carve_val_classes(labels, ["c4", 9], class_names=names)[1].tolist() == [4, 9]


def test_pick_last_takes_the_end_of_the_label_order_like_the_zero_shot_split():
    labels = np.repeat(np.arange(20), 2)[::-1]  # the order of the samples does not matter
    keep, val = carve_val_classes(labels, 0.25, seed=3, pick="last")
    assert val.tolist() == [15, 16, 17, 18, 19] and keep.tolist() == list(range(15))
    assert carve_val_classes(labels, 2, pick="last")[1].tolist() == [18, 19]
    with pytest.raises(ValueError, match="val_pick"):
        carve_val_classes(labels, 2, pick="first")


def test_val_pick_last_in_a_run_carves_the_last_training_classes(tmp_path):
    from deepmetric.run.config_io import config_from_dict

    raw = _raw(tmp_path, val_classes=2)
    raw["data"]["val_pick"] = "last"
    cfg = config_from_dict(raw)
    train_set, val_set = build_split(cfg, "train", train=False), build_split(cfg, VAL_SPLIT, train=False)
    assert val_set.original_classes.tolist() == [6, 7]  # the synthetic training split has classes 0..7
    assert train_set.original_classes.tolist() == list(range(6))


def test_seeded_choice_is_deterministic_and_depends_on_the_seed():
    labels = np.repeat(np.arange(40), 2)
    a = carve_val_classes(labels, 0.25, seed=3)[1]
    assert np.array_equal(a, carve_val_classes(labels, 0.25, seed=3)[1])
    expected = np.sort(np.random.default_rng(3).permutation(np.arange(40))[:10])
    assert np.array_equal(a, expected)
    assert not np.array_equal(a, carve_val_classes(labels, 0.25, seed=4)[1])


def test_carving_errors_name_the_key_and_the_classes():
    labels = np.repeat(np.arange(4), 2)
    with pytest.raises(ValueError, match=r"data.val_classes.*asks for 4 validation classes.*4 classes"):
        carve_val_classes(labels, 4)
    with pytest.raises(ValueError, match=r"data.val_classes.*\['zebra'\] are not classes"):
        carve_val_classes(labels, ["zebra"], class_names=["a", "b", "c", "d"])
    with pytest.raises(ValueError, match=r"\[9\] are not classes.*label ids in \[0, 3\]"):
        carve_val_classes(labels, [9])
    with pytest.raises(ValueError, match="every training class"):
        carve_val_classes(labels, [0, 1, 2, 3])


def _png(path):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((4, 4, 3), 80, dtype=np.uint8)).save(path)


def test_val_train_and_test_are_class_disjoint_on_a_folder_dataset(tmp_path):
    classes = [f"class{i:02d}" for i in range(12)]
    for c in classes:
        for i in range(2 + len(c) % 3):
            _png(tmp_path / "data" / c / f"{i}.png")
    raw = {"data": {"name": "folder", "root": str(tmp_path / "data"), "options": {"class_split": "half"},
                    "val_classes": 2, "val_seed": 1},
           "train": {"epochs": 1}}
    cfg = config_from_dict(raw)
    tr = build_split(cfg, "train", train=True)
    va = build_split(cfg, VAL_SPLIT, train=False)
    te = build_split(cfg, "test", train=False)
    names = lambda ds: {ds.class_names[l] for l in ds.labels}  # noqa: E731
    assert len(names(va)) == 2 and len(names(tr)) == 4 and len(names(te)) == 6
    assert not names(tr) & names(va) and not names(tr) & names(te) and not names(va) & names(te)
    assert sorted(tr.paths + va.paths) == sorted(build_split(config_from_dict(
        {**raw, "data": {**raw["data"], "val_classes": None}}), "train", train=True).paths)
    assert set(tr.labels.tolist()) == set(range(4)) and tr.num_classes == 4  # renumbered for the classifier
    for ds in (tr, va):  # labels follow the images
        for i in (0, len(ds) - 1):
            assert ds.class_names[ds[i][1]] == ds.paths[i].split("/")[-2]
    # an explicit list of names picks exactly those classes
    cfg.data.val_classes = ["class01", "class03"]
    assert names(build_split(cfg, VAL_SPLIT, train=False)) <= {"class01", "class03"}


def test_synthetic_val_split_holds_the_removed_training_images():
    cfg = config_from_dict(_raw("unused", val_classes=3))
    full = build_split(config_from_dict(_raw("unused", val_classes=None)), "train", train=True)
    tr, va = build_split(cfg, "train", train=True), build_split(cfg, "val", train=False)
    assert isinstance(tr, ClassSubset) and len(tr) + len(va) == len(full)
    rows = lambda ds: {tuple(ds[i][0].tolist()) for i in range(len(ds))}  # noqa: E731
    assert rows(tr) | rows(va) == rows(full) and not rows(tr) & rows(va)


def test_config_errors_before_training():
    base = _raw("x", val_classes=None)
    with pytest.raises(ConfigError, match=r"'eval.best_metric'.*no validation split.*data.val_classes"):
        config_from_dict({**base, "eval": {"best_metric": "recall@1"}})
    with pytest.raises(ConfigError, match=r"'eval.early_stop_patience'.*no validation split"):
        config_from_dict({**base, "eval": {"early_stop_patience": 3}})
    with pytest.raises(ConfigError, match=r"'schedule.temperature.monitor'.*no validation split"):
        config_from_dict({**base, "schedule": {"temperature": {"name": "auto_plateau", "monitor": "recall@1"}}})
    with pytest.raises(ConfigError, match=r"'data.val_classes': a fraction must be in \(0, 1\)"):
        config_from_dict(_raw("x", val_classes=1.5))
    with pytest.raises(ConfigError, match=r"'data.val_classes'"):
        config_from_dict(_raw("x", val_classes={"a": 1}))
    config_from_dict({**base, "schedule": {"temperature": {"name": "auto_plateau", "monitor": "train_loss"}}})
    with pytest.raises(ConfigError, match=r"'eval.kmeans_restarts': must be >= 1, got 0"):
        config_from_dict({**base, "eval": {"kmeans_restarts": 0}})


class _FamilyImages(torch.utils.data.Dataset):
    """In-memory images with a per-image family, like the glyph benchmark: image i is filled
    with the value i, so a row identifies its sample."""

    def __init__(self, labels, families):
        self.labels = np.asarray(labels, dtype=np.int64)
        self.families = np.asarray(families)
        self.images = np.arange(len(labels), dtype=np.float32)[:, None, None] * np.ones((1, 2, 2), np.float32)
        self.faces = ["a font list, not per sample"]

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return torch.from_numpy(self.images[i]), int(self.labels[i])


def test_class_subset_gives_per_sample_arrays_of_its_own_samples():
    labels = [0, 1, 2, 0, 1, 2, 0, 1, 2]
    fams = np.array(list("xxxyyyzzz"))
    ds = _FamilyImages(labels, fams)
    sub = ClassSubset(ds, [2, 0])
    assert sub.indices.tolist() == [0, 2, 3, 5, 6, 8] and sub.labels.tolist() == [1, 0, 1, 0, 1, 0]
    # images[i] is the image of sub[i] (an index build writes these as thumbnails)
    for i in range(len(sub)):
        assert np.array_equal(sub.images[i], sub[i][0].numpy())
    assert sub.families.tolist() == list("xxyyzz")
    assert sub.faces == ds.faces  # not per sample: passed through
    masked = ClassSubset(ds, [2, 0], samples=fams != "y")
    assert masked.indices.tolist() == [0, 2, 6, 8] and masked.families.tolist() == list("xxzz")
    with pytest.raises(ValueError, match="boolean mask of 9 entries"):
        ClassSubset(ds, [0], samples=[True, False])


def test_class_subset_loads_the_stored_image_of_its_own_sample(tmp_path):
    """A validation ClassSubset of a folder: load_image(i) is the file of subset[i] (it read the
    parent's i-th file before), and an in-memory parent keeps load_image None."""
    from PIL import Image

    from deepmetric.data import build_dataset as build_data

    for c in range(3):
        (tmp_path / f"c{c}").mkdir()
        for k in range(2):
            Image.new("L", (4, 4), color=40 * c + k).save(tmp_path / f"c{c}" / f"{k}.png")
    ds = build_data("folder", tmp_path, split="all", mode="L")
    sub = ClassSubset(ds, [2, 1])
    for i in range(len(sub)):
        assert sub.load_image(i).getpixel((0, 0)) == Image.open(sub.paths[i]).getpixel((0, 0))
    assert ClassSubset(_FamilyImages([0, 1, 0, 1], np.array(list("xxyy"))), [1]).load_image is None


def test_val_query_families_hold_a_family_out_of_training_and_query_with_it(monkeypatch):
    from deepmetric.run import builders

    labels = np.repeat(np.arange(6), 3)  # class c drawn in families x, y, z
    fams = np.tile(np.array(["x", "y", "z"]), 6)
    monkeypatch.setattr(builders, "_build_named_split", lambda cfg, split, train: _FamilyImages(labels, fams))
    raw = _raw("unused", val_classes=2)
    raw["data"]["val_query_families"] = ["z"]
    cfg = config_from_dict(raw)
    tr, va = build_split(cfg, "train", train=True), build_split(cfg, "val", train=False)
    keep, val = carve_val_classes(labels, 2, seed=0)
    # training: the training classes, never an image of family z
    assert sorted(set(tr.original_classes.tolist())) == keep.tolist()
    assert set(tr.families.tolist()) == {"x", "y"} and len(tr) == 2 * len(keep)
    # validation: every image of the validation classes; queries = family z, gallery = x and y
    assert len(va) == 3 * len(val)
    assert set(labels[va.indices].tolist()) == set(val.tolist())
    np.testing.assert_array_equal(va.is_query, fams[va.indices] == "z")
    np.testing.assert_array_equal(va.is_gallery, ~va.is_query)
    from deepmetric.run.embed import dataset_query_gallery_masks

    assert set(dataset_query_gallery_masks(va)) == {"is_query", "is_gallery"}
    # errors name the key, the unknown family and the families there are
    raw["data"]["val_query_families"] = ["w"]
    with pytest.raises(ValueError, match=r"'data.val_query_families': \['w'\] are not families.*\['x', 'y', 'z'\]"):
        build_split(config_from_dict(raw), "train", train=True)
    raw["data"]["val_query_families"] = ["x", "y", "z"]
    with pytest.raises(ValueError, match="at least one must stay for training"):
        build_split(config_from_dict(raw), "val", train=False)
    monkeypatch.undo()  # the synthetic dataset itself: no families
    raw["data"]["val_query_families"] = ["z"]
    with pytest.raises(ValueError, match="has no per-image typeface families"):
        build_split(config_from_dict(raw), "train", train=True)


def test_val_query_families_config_errors():
    raw = _raw("x", val_classes=None)
    raw["data"]["val_query_families"] = ["z"]
    with pytest.raises(ConfigError, match=r"'data.val_query_families': needs validation classes"):
        config_from_dict(raw)
    raw["data"].update(val_classes=2, val_query_families=[])
    with pytest.raises(ConfigError, match=r"'data.val_query_families': expected a non-empty list"):
        config_from_dict(raw)


# --------------------------------------------------------------------------- selection
def _scripted_evaluation(monkeypatch, val, test):
    """Replace the evaluation by scripted metrics per split and epoch (index = call number):
    the selection logic is what is under test, not the metric computation."""
    calls = {"val": 0, "test": 0}

    def fake(model, sets, cfg, *, device, losses=()):
        split = "val" if isinstance(sets["query"], ClassSubset) else "test"
        value = (val if split == "val" else test)[calls[split]]
        calls[split] += 1
        return {"recall@1": value, "nmi": 0.5}, {}

    monkeypatch.setattr(loop, "evaluate_split", fake)


def test_best_checkpoint_is_chosen_by_validation_not_test(tmp_path, monkeypatch):
    # validation peaks at epoch 2, the test split at epoch 5 (it would pick the last model)
    _scripted_evaluation(monkeypatch, val=[0.5, 0.9, 0.6, 0.4, 0.3], test=[0.1, 0.2, 0.3, 0.4, 0.5])
    res = train(config_from_dict(_raw(tmp_path / "run")))
    best = torch.load(tmp_path / "run" / "best.pt", weights_only=True)
    assert best["epoch"] == 2
    assert res.selected == {"epoch": 2, "metric": "recall@1", "value": 0.9,
                            "test": {"recall@1": 0.2, "nmi": 0.5}}
    assert res.metrics == res.final["test"] == {"recall@1": 0.5, "nmi": 0.5}
    assert res.final["val"] == {"recall@1": 0.3, "nmi": 0.5}
    summary = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert summary["selected"] == res.selected and summary["final"] == res.final
    assert summary["metrics"] == res.metrics and summary["epochs"] == 5
    evals = _records(tmp_path / "run" / "log.jsonl", "eval")
    assert [(r["split"], r["epoch"]) for r in evals] == [(s, e) for e in range(1, 6) for s in ("val", "test")]

    # best.pt holds the weights after epoch 2: the same as a run stopped after 2 epochs
    _scripted_evaluation(monkeypatch, val=[0.5, 0.9], test=[0.1, 0.2])
    train(config_from_dict(_raw(tmp_path / "two", epochs=2)))
    two = torch.load(tmp_path / "two" / "last.pt", weights_only=True)
    assert all(torch.equal(best["model"][k], two["model"][k]) for k in two["model"])


def test_early_stopping_stops_after_patience_epochs_without_improvement(tmp_path, monkeypatch):
    _scripted_evaluation(monkeypatch, val=[0.5, 0.9, 0.6, 0.9, 0.95, 0.99], test=[0.1] * 6)
    raw = _raw(tmp_path / "run", epochs=6)
    raw["eval"]["early_stop_patience"] = 2
    res = train(config_from_dict(raw))
    assert res.epochs_completed == 4 and res.iteration == 4 * (72 // 12)  # 0.9 at 4 is no improvement
    (stop,) = _records(tmp_path / "run" / "log.jsonl", "early_stop")
    assert (stop["epoch"], stop["best_epoch"]) == (4, 2)
    assert torch.load(tmp_path / "run" / "last.pt", weights_only=True)["epoch"] == 4
    assert torch.load(tmp_path / "run" / "best.pt", weights_only=True)["epoch"] == 2
    # resuming a run that stopped early does not train further
    again = train(config_from_dict(raw), resume=tmp_path / "run" / "last.pt")
    assert again.iteration == res.iteration


def test_auto_plateau_watches_the_validation_metric(tmp_path, monkeypatch):
    # validation stalls after epoch 2; the test metric keeps improving (it would never heat up)
    _scripted_evaluation(monkeypatch, val=[0.5, 0.9, 0.6, 0.6, 0.6], test=[0.1, 0.2, 0.3, 0.4, 0.5])
    raw = _raw(tmp_path / "run")
    raw["schedule"] = {"temperature": {"name": "auto_plateau", "monitor": "recall@1", "patience": 1}}
    train(config_from_dict(raw))
    heats = _records(tmp_path / "run" / "log.jsonl", "heat_up")
    assert [h["epoch"] for h in heats] == [3]


def test_real_run_with_validation_logs_both_splits(tmp_path):
    raw = _raw(tmp_path / "run", epochs=3)
    raw["eval"]["best_metric"] = "map@r"
    res = train(config_from_dict(raw))
    evals = _records(tmp_path / "run" / "log.jsonl", "eval")
    assert {r["split"] for r in evals} == {"val", "test"} and len(evals) == 6
    sel = res.selected
    val_at = {r["epoch"]: r for r in evals if r["split"] == "val"}
    test_at = {r["epoch"]: r for r in evals if r["split"] == "test"}
    assert sel["value"] == max(r["map@r"] for r in val_at.values()) == val_at[sel["epoch"]]["map@r"]
    assert sel["test"]["recall@1"] == test_at[sel["epoch"]]["recall@1"]
    state = torch.load(tmp_path / "run" / "last.pt", weights_only=True)
    assert state["model_args"]["num_classes"] == 6  # 8 training classes - 2 validation classes
    assert tuple(state["loss"][0]["weight"].shape) == (6, 8)


def test_k_folds_partition_the_training_classes():
    from deepmetric.run.builders import class_fold

    labels = np.repeat(np.arange(10), 2)
    vals = [class_fold(labels, 4, k, seed=2)[1] for k in range(4)]
    assert sorted(np.concatenate(vals).tolist()) == list(range(10))  # disjoint, cover every class
    assert sorted(len(v) for v in vals) == [2, 2, 3, 3]
    keep, val = class_fold(labels, 4, 1, seed=2)
    assert not set(keep) & set(val) and len(keep) + len(val) == 10
    cfg = config_from_dict({**_raw("x", val_classes=None), "data": {**_raw("x")["data"], "val_classes": None,
                                                                   "val_folds": 4, "val_fold": 3}})
    va = build_split(cfg, "val", train=False)
    assert va.original_classes.tolist() == class_fold(np.repeat(np.arange(8), 12), 4, 3, seed=0)[1].tolist()
    with pytest.raises(ConfigError, match="'data.val_fold': must be in \\[0, 4\\)"):
        config_from_dict({"train": {"epochs": 1}, "data": {"val_folds": 4, "val_fold": 4}})
    with pytest.raises(ConfigError, match="give one of them"):
        config_from_dict({"train": {"epochs": 1}, "data": {"val_folds": 4, "val_classes": 0.2}})


def test_embed_cli_embeds_the_validation_split(tmp_path):
    from deepmetric import cli

    cfg = config_from_dict(_raw(tmp_path / "run", val_classes=[1, 6], epochs=1))
    train(cfg)
    out = tmp_path / "val.npz"
    assert cli.main(["embed", str(tmp_path / "run" / "last.pt"), "--split", "val", "--out", str(out)]) == 0
    z = np.load(out)
    assert z["embeddings"].shape == (24, 8) and sorted(set(z["labels"].tolist())) == [0, 1]


def test_run_killed_between_the_final_evaluations_reevaluates_on_resume(tmp_path, monkeypatch):
    """The last checkpoint is written before the final evaluation; a run that dies after the
    validation records but before the test records must not report the previous
    evaluation's test metrics when resumed."""
    straight = train(config_from_dict(_raw(tmp_path / "straight", epochs=3)))
    real = loop.evaluate_split
    calls = {"n": 0}

    def dies_at_the_last_test_split(model, sets, cfg, **kw):
        calls["n"] += 1
        if calls["n"] == 6:  # epochs 1-3 x (val, test): the 6th is epoch 3's test split
            raise RuntimeError("killed")
        return real(model, sets, cfg, **kw)

    monkeypatch.setattr(loop, "evaluate_split", dies_at_the_last_test_split)
    with pytest.raises(RuntimeError, match="killed"):
        train(config_from_dict(_raw(tmp_path / "run", epochs=3)))
    evals = _records(tmp_path / "run" / "log.jsonl", "eval")
    assert [(r["split"], r["epoch"]) for r in evals][-1] == ("val", 3)  # the partial evaluation
    monkeypatch.setattr(loop, "evaluate_split", real)
    res = train(config_from_dict(_raw(tmp_path / "run", epochs=3)), resume=tmp_path / "run" / "last.pt")
    for split in ("test", "val"):
        assert res.final[split] == pytest.approx(straight.final[split])
    assert res.selected["epoch"] == straight.selected["epoch"]
    assert res.selected["test"] == pytest.approx(straight.selected["test"])
    evals = _records(tmp_path / "run" / "log.jsonl", "eval")
    assert [(r["split"], r["epoch"]) for r in evals] == [(s, e) for e in range(1, 4) for s in ("val", "test")]
    # resuming the finished run again changes nothing and evaluates nothing
    monkeypatch.setattr(loop, "evaluate_split", lambda *a, **k: pytest.fail("evaluated again"))
    again = train(config_from_dict(_raw(tmp_path / "run", epochs=3)), resume=tmp_path / "run" / "last.pt")
    assert again.final == res.final
