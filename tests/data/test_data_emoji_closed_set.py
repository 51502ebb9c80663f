"""The closed-set vendor split of the emoji benchmark (protocol ``closed_set_vendor``, the two-head
accuracy claim): every class in every split, the vendors split into train / val / test; on the
miniature package tree of test_data_emoji and on the installed packages (the real counts)."""
import numpy as np
import pytest

from deepmetric.data import build_dataset
from deepmetric.data import emoji as em
from deepmetric.data.emoji import build_emoji_dataset

CLOSED = {"protocol": "closed_set_vendor", "test_vendor": "twitter"}


@pytest.fixture
def tree(tmp_path):
    from test_data_emoji import make_tree

    make_tree(tmp_path)
    return tmp_path


def _pairs(ds):
    """(class name, vendor) of every image."""
    return {(ds.class_names[y], ds.vendors[v]) for y, v in zip(ds.labels, ds.vendor_ids)}


def test_vendors_split_and_labels_shared(tree):
    from test_data_emoji import MINI

    tr = build_emoji_dataset("train", root=tree, val_vendor="facebook", **CLOSED)
    va = build_emoji_dataset("val", root=tree, val_vendor="facebook", **CLOSED)
    te = build_emoji_dataset("test", root=tree, val_vendor="facebook", **CLOSED)
    every = [m[0] for m in MINI]
    # every class in every split, one label space
    assert tr.class_names == va.class_names == te.class_names == every
    assert tr.num_classes == va.num_classes == te.num_classes == len(MINI)
    # the vendors: train has neither held-out vendor, val / test only theirs
    assert {tr.vendors[v] for v in tr.vendor_ids} == {"apple", "google", "emojione", "openmoji"}
    assert {va.vendors[v] for v in va.vendor_ids} == {"facebook"}
    assert {te.vendors[v] for v in te.vendor_ids} == {"twitter"}
    # brute force from the tree's has_img flags: which (class, vendor) images exist
    drawn = {(u, v) for u, _, _, _, missing, ef in MINI for v in em.VENDORS
             if (v in em.DATASOURCE_VENDORS and v not in missing) or (v == "emojione" and ef)
             or v == "openmoji"}
    assert _pairs(tr) == {p for p in drawn if p[1] in ("apple", "google", "emojione", "openmoji")}
    assert _pairs(va) == {p for p in drawn if p[1] == "facebook"}  # 1F469-200D-1F4BB: facebook lacks it
    assert "1F469-200D-1F4BB" not in {va.class_names[y] for y in va.labels}
    assert len(te) == len(MINI) and sorted(te.labels) == list(range(len(MINI)))
    # the same image under the same label in train and in "all"
    al = build_emoji_dataset("all", root=tree, **CLOSED)
    assert al.class_names == every and len(al) == len(drawn)
    # without a validation vendor, facebook trains
    tr5 = build_emoji_dataset("train", root=tree, **CLOSED)
    assert _pairs(tr5) == {p for p in drawn if p[1] != "twitter"}
    assert tr5.test_vendor == "twitter" and tr5.val_vendor is None


def test_held_out_images_of_untrained_classes_are_left_out(tree):
    # apple alone trains: apple lacks the France flag, so twitter's flag is not tested
    te = build_emoji_dataset("test", root=tree, vendors="apple,twitter", **CLOSED)
    tr = build_emoji_dataset("train", root=tree, vendors="apple,twitter", **CLOSED)
    assert set(te.labels) == set(tr.labels)
    assert "1F1EB-1F1F7" not in {te.class_names[y] for y in te.labels}
    assert "1F1EB-1F1F7" in te.class_names  # still a class (the classifier's label space)
    # max_classes keeps the first classes in every split, min_vendors drops classes
    small = build_emoji_dataset("test", root=tree, max_classes=3, **CLOSED)
    assert small.class_names == [c for c in tr.class_names][:3] and len(small) == 3
    six = build_emoji_dataset("train", root=tree, min_vendors=6, **CLOSED)
    assert "1FAE8" not in six.class_names and "1F1EB-1F1F7" not in six.class_names


def test_bad_options_are_named(tree):
    with pytest.raises(ValueError, match="test_vendor"):
        build_emoji_dataset("train", root=tree, protocol="closed_set_vendor")
    with pytest.raises(ValueError, match="test_vendor"):
        build_emoji_dataset("train", root=tree, protocol="closed_set_vendor", test_vendor="samsung")
    with pytest.raises(ValueError, match="val_vendor"):
        build_emoji_dataset("train", root=tree, val_vendor="twitter", **CLOSED)
    with pytest.raises(ValueError, match="val_vendor"):
        build_emoji_dataset("val", root=tree, **CLOSED)
    with pytest.raises(ValueError, match="no training vendor"):
        build_emoji_dataset("train", root=tree, vendors="twitter,facebook", val_vendor="facebook", **CLOSED)
    with pytest.raises(ValueError, match="closed_set_vendor"):
        build_emoji_dataset("train", root=tree, test_vendor="twitter")
    with pytest.raises(ValueError, match="closed_set_vendor"):
        build_emoji_dataset("val", root=tree)
    # the registry passes the options through
    ds = build_dataset("emoji", root=str(tree), split="val", val_vendor="facebook", **CLOSED)
    assert {ds.vendors[v] for v in ds.vendor_ids} == {"facebook"}


_INSTALLED = em.emoji_packages_dir() / "emoji-datasource-google@16.0.0" / "emoji.json"


@pytest.mark.skipif(not _INSTALLED.is_file(), reason="emoji packages not installed (bash install.sh)")
def test_installed_closed_set_counts():
    """The real packages: 1,911 classes in every split; twitter draws all 1,911, facebook 1,860;
    no test-vendor image trains and every test class has training images."""
    phases = {}
    for val in ("facebook", None):
        splits = ("train", "val", "test") if val else ("train", "test")
        phases[val] = {s: build_emoji_dataset(s, val_vendor=val, **CLOSED) for s in splits}
    per_vendor = {"apple": 1908, "google": 1911, "twitter": 1911, "facebook": 1860, "emojione": 1645,
                  "openmoji": 1911}
    lr, final = phases["facebook"], phases[None]
    for sets in phases.values():
        assert {ds.num_classes for ds in sets.values()} == {1911}
        train_vendors = {sets["train"].vendors[v] for v in np.unique(sets["train"].vendor_ids)}
        assert "twitter" not in train_vendors
        assert set(np.unique(sets["test"].labels)) <= set(np.unique(sets["train"].labels))
        assert len(sets["test"]) == 1911 == len(np.unique(sets["test"].labels))
    assert len(lr["train"]) == sum(per_vendor[v] for v in ("apple", "google", "emojione", "openmoji")) == 7375
    assert len(lr["val"]) == 1860 and set(np.unique(lr["val"].labels)) <= set(np.unique(lr["train"].labels))
    assert len(final["train"]) == 7375 + 1860 == 9235
    assert {final["train"].vendors[v] for v in np.unique(final["train"].vendor_ids)} == set(per_vendor) - {"twitter"}
