"""Glyph benchmark: the GB2312 level-1 character list, rendering determinism, cache hits,
duplicate-face removal, within-class duplicate-image removal, class disjointness. Builds use a few classes and a few faces only."""
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from deepmetric.data import build_dataset
from deepmetric.data.glyphs import build_glyph_dataset, find_cjk_faces, gb2312_level1_chars
from deepmetric.run.rundir import read_log

FACES = find_cjk_faces()
needs_fonts = pytest.mark.skipif(not FACES, reason="no CJK fonts installed (see docs/offline-data.md)")


def test_gb2312_level1():
    chars = gb2312_level1_chars()
    assert len(chars) == 3755 and len(set(chars)) == 3755
    assert chars[0] == "啊" and chars[-1] == "座"  # GB2312 0xB0A1 and 0xD7F9
    codes = [c.encode("gb2312") for c in chars]
    # increasing EUC-CN code points, all in rows 16-55 (lead bytes 0xB0-0xD7)
    assert codes == sorted(codes)
    assert all(0xB0 <= b[0] <= 0xD7 and 0xA1 <= b[1] <= 0xFE for b in codes)
    assert all(0x4E00 <= ord(c) <= 0x9FFF for c in chars)  # CJK unified ideographs
    # row 55 stops at 0xD7F9: the five cells after it are not level-1 characters
    for trail in range(0xFA, 0xFF):
        with pytest.raises(UnicodeDecodeError):
            bytes([0xD7, trail]).decode("gb2312")


def _small_fonts():
    """Two real faces of different families (one file each), as "path#index" specs."""
    by_file = {}
    for f in FACES:
        by_file.setdefault(f.path, f)
    picks = sorted(by_file.values(), key=lambda f: Path(f.path).stat().st_size)[:2]
    return [f"{f.path}#{f.index}" for f in picks]


@needs_fonts
def test_render_determinism_cache_and_splits(tmp_path):
    fonts = _small_fonts()
    kw = dict(max_classes=5, fonts=fonts, size=24, margin=2)
    a = build_glyph_dataset("train", root=tmp_path / "a", **kw)
    assert not a.from_cache
    cache_files = list((tmp_path / "a" / "glyphs").glob("*.npz"))
    assert len(cache_files) == 1 and a.cache_path == cache_files[0]
    assert not list((tmp_path / "a" / "glyphs").glob("*.tmp"))  # atomic write left nothing behind
    b = build_glyph_dataset("train", root=tmp_path / "b", **kw)  # independent re-render
    np.testing.assert_array_equal(a.images, b.images)
    np.testing.assert_array_equal(a.labels, b.labels)
    c = build_glyph_dataset("train", root=tmp_path / "a", **kw)  # cache hit
    assert c.from_cache
    np.testing.assert_array_equal(a.images, c.images)
    # any parameter change is a different cache entry
    d = build_glyph_dataset("train", root=tmp_path / "a", **{**kw, "margin": 3})
    assert not d.from_cache and len(list((tmp_path / "a" / "glyphs").glob("*.npz"))) == 2

    te = build_glyph_dataset("test", root=tmp_path / "a", **kw)
    assert te.from_cache  # both splits come from one rendering
    chars = gb2312_level1_chars()
    assert a.class_names == list(chars[:5]) and te.class_names == list(chars[1878:1883])
    assert not set(a.class_names) & set(te.class_names)
    for ds in (a, te):
        assert ds.num_classes == 5 and ds.labels.dtype == np.int64
        assert sorted(set(ds.labels.tolist())) == list(range(5))
        # one image per (class, face) at most, each face id valid
        pairs = set(zip(ds.labels.tolist(), ds.face_ids.tolist()))
        assert len(pairs) == len(ds)
        assert set(ds.face_ids.tolist()) <= set(range(len(ds.faces)))
        x, y = ds[0]
        assert x.shape == (1, 24, 24) and x.dtype == torch.float32 and 0 <= x.min() and x.max() <= 1


@needs_fonts
def test_images_centred_with_margin(tmp_path):
    fonts = _small_fonts()
    size, margin = 32, 3
    for fit in ("em", "box"):
        ds = build_glyph_dataset("test", root=tmp_path, fonts=fonts, max_classes=6, size=size,
                                 margin=margin, fit=fit)
        for img in ds.images:
            ys, xs = np.nonzero(img)
            assert len(ys) > 10  # real ink, not an empty image
            # nothing drawn inside the margin
            assert ys.min() >= margin and xs.min() >= margin
            assert ys.max() < size - margin and xs.max() < size - margin
            # the ink bounding box is centred (to a pixel)
            assert abs((ys.min() + ys.max()) / 2 - (size - 1) / 2) <= 1
            assert abs((xs.min() + xs.max()) / 2 - (size - 1) / 2) <= 1
            if fit == "box":  # the longer side fills the inner box
                assert max(ys.max() - ys.min(), xs.max() - xs.min()) + 1 == size - 2 * margin


@needs_fonts
def test_duplicate_and_non_cjk_faces_dropped(tmp_path):
    fonts = _small_fonts()[:1]
    src = fonts[0].split("#")[0]
    copy = tmp_path / "fonts" / ("copy-" + Path(src).name)
    copy.parent.mkdir()
    shutil.copy(src, copy)
    specs = fonts + [f"{copy}#{fonts[0].split('#')[1]}"]
    latin = Path("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf")
    if latin.is_file():
        specs.append(str(latin))  # has no hanzi: FreeType would draw .notdef boxes
    ds = build_glyph_dataset("train", root=tmp_path / "cache", fonts=specs, max_classes=4)
    assert len(ds.faces) == 1 and len(ds) == 4
    reasons = [r for _, r in ds.dropped_faces]
    assert any(r.startswith("pixel-identical to") for r in reasons)
    if latin.is_file():
        assert "maps none of the characters" in reasons


@needs_fonts
def test_registry_transform_and_errors(tmp_path):
    fonts = _small_fonts()
    seen = []

    def t(x):
        seen.append((x.dtype, tuple(x.shape)))
        return x

    ds = build_dataset("glyphs", root=tmp_path, split="train", transform=t, fonts=fonts, max_classes=2, size=16)
    ds[0]
    assert seen == [(torch.uint8, (1, 16, 16))]
    # max_train_classes: fewer training characters, the test split unchanged
    tr = build_glyph_dataset("train", root=tmp_path, fonts=fonts, max_classes=4, max_train_classes=2, size=16)
    te = build_glyph_dataset("test", root=tmp_path, fonts=fonts, max_classes=4, max_train_classes=2, size=16)
    chars = gb2312_level1_chars()
    assert tr.class_names == list(chars[:2]) and te.class_names == list(chars[1878:1882])
    assert sorted(set(te.labels.tolist())) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="max_train_classes"):
        build_glyph_dataset("train", root=tmp_path, fonts=fonts, max_train_classes=0)
    with pytest.raises(ValueError, match="split"):
        build_glyph_dataset("val", root=tmp_path, fonts=fonts)
    with pytest.raises(ValueError, match="margin"):
        build_glyph_dataset("train", root=tmp_path, fonts=fonts, size=8, margin=4)
    with pytest.raises(ValueError, match="fit"):
        build_glyph_dataset("train", root=tmp_path, fonts=fonts, fit="stretch")
    with pytest.raises(ValueError, match="max_classes"):
        build_glyph_dataset("train", root=tmp_path, fonts=fonts, max_classes=0)
    with pytest.raises(FileNotFoundError, match="nowhere.ttf"):
        build_glyph_dataset("train", root=tmp_path, fonts=[str(tmp_path / "nowhere.ttf")])
    with pytest.raises(ValueError, match="index 99"):
        build_glyph_dataset("train", root=tmp_path, fonts=[fonts[0].split("#")[0] + "#99"])


def test_no_fonts_message(tmp_path):
    with pytest.raises(FileNotFoundError, match="apt-get install fonts-noto-cjk"):
        build_glyph_dataset("train", root=tmp_path, fonts=[str(tmp_path)])  # an empty directory


def _regional_variants(n_faces=5):
    """Regional variants (JP/KR/SC/TC/HK) of one Noto weight: they draw most hanzi identically."""
    faces = [f for f in FACES if Path(f.path).name.startswith("NotoSansCJK-Regular")]
    return [f"{f.path}#{f.index}" for f in faces[:n_faces]]


@pytest.mark.skipif(not _regional_variants(), reason="fonts-noto-cjk (NotoSansCJK-Regular.ttc) not installed")
def test_within_class_dedup_against_brute_force(tmp_path):
    fonts = _regional_variants()
    kw = dict(fonts=fonts, max_classes=12, size=24)
    raw = build_glyph_dataset("test", root=tmp_path, dedup="none", **kw)
    assert raw.dedup == "none"
    # reference: brute force over (class, face-order) pairs, keep the first of identical images
    ref = []
    for c in range(raw.num_classes):
        idx = np.flatnonzero(raw.labels == c)
        idx = idx[np.argsort(raw.face_ids[idx], kind="stable")]
        kept = []
        for i in idx:
            if not any(np.array_equal(raw.images[i], raw.images[j]) for j in kept):
                kept.append(i)
        ref += [(c, int(raw.face_ids[i])) for i in kept]
    assert len(ref) < len(raw)  # these faces do share identical images (the reason for dedup)

    ex = build_glyph_dataset("test", root=tmp_path, **kw)  # default dedup="exact"
    assert ex.dedup == "exact" and not ex.from_cache  # the mode is part of the cache key
    assert sorted(zip(ex.labels.tolist(), ex.face_ids.tolist())) == sorted(ref)
    assert ex.faces == raw.faces and ex.images_before_dedup == raw.images_before_dedup
    for c in range(ex.num_classes):
        block = ex.images[ex.labels == c].reshape(-1, 24 * 24)
        assert len(np.unique(block, axis=0)) == len(block)  # no two identical images in a class
    for i in range(len(ex)):  # each kept image is the one its face rendered
        j = np.flatnonzero((raw.labels == ex.labels[i]) & (raw.face_ids == ex.face_ids[i]))
        np.testing.assert_array_equal(ex.images[i], raw.images[j[0]])

    again = build_glyph_dataset("test", root=tmp_path / "other", **kw)  # deterministic re-render
    np.testing.assert_array_equal(again.images, ex.images)
    np.testing.assert_array_equal(again.face_ids, ex.face_ids)
    assert build_glyph_dataset("test", root=tmp_path, **kw).from_cache

    # near: greedy in face order, mean |difference| (grey levels) to every kept image >= threshold
    thr = 3.0
    near = build_glyph_dataset("test", root=tmp_path, dedup="near", near_threshold=thr, **kw)
    assert not near.from_cache and len(near) <= len(ex)
    ref_near = []
    for c in range(ex.num_classes):
        kept = []
        for i in np.flatnonzero(ex.labels == c):
            if all(np.abs(ex.images[i].astype(float) - ex.images[j]).mean() >= thr for j in kept):
                kept.append(i)
        ref_near += [(c, int(ex.face_ids[i])) for i in kept]
    assert sorted(zip(near.labels.tolist(), near.face_ids.tolist())) == sorted(ref_near)
    other = build_glyph_dataset("test", root=tmp_path, dedup="near", near_threshold=1.0, **kw)
    assert not other.from_cache  # the threshold is part of the cache key
    assert len(list((tmp_path / "glyphs").glob("*.npz"))) == 4

    with pytest.raises(ValueError, match="dedup"):
        build_glyph_dataset("test", root=tmp_path, dedup="fuzzy", **kw)
    with pytest.raises(ValueError, match="near_threshold"):
        build_glyph_dataset("test", root=tmp_path, dedup="near", near_threshold=-1, **kw)


# --------------------------------------------------------------------------- cross_family
def test_face_family_grouping():
    from deepmetric.data.glyphs import FACE_FAMILIES, face_family

    cases = {
        "Noto Sans CJK JP": "Noto Sans CJK", "Noto Sans CJK SC Black": "Noto Sans CJK",
        "Noto Sans Mono CJK KR Bold": "Noto Sans CJK", "Noto Serif CJK TC ExtraLight": "Noto Serif CJK",
        "AR PL UKai CN": "AR PL UKai", "AR PL UKai TW MBE": "AR PL UKai", "AR PL UMing HK": "AR PL UMing",
        "WenQuanYi Zen Hei Sharp": "WenQuanYi Zen Hei", "WenQuanYi Micro Hei Mono": "WenQuanYi Micro Hei",
        "LXGW WenKai Mono Light": "LXGW WenKai", "LXGW WenKai": "LXGW WenKai",
        "BabelStone Han": "BabelStone Han",
        # a face of no listed family is its own family; a prefix must end at a word boundary
        "My Brush Font": "My Brush Font", "AR PL UKaiX": "AR PL UKaiX",
    }
    for name, family in cases.items():
        assert face_family(name) == family, name
    assert len({f for f, _ in FACE_FAMILIES}) == 8
    # every installed face falls into one of the eight families
    assert {face_family(f.name) for f in FACES} <= {f for f, _ in FACE_FAMILIES}


def _three_families():
    """One face each of WenQuanYi Micro Hei, WenQuanYi Zen Hei and AR PL UKai."""
    want = {"wqy-microhei.ttc": 0, "wqy-zenhei.ttc": 0, "ukai.ttc": 0}
    picks = [f for f in FACES if want.get(Path(f.path).name) == f.index]
    return [f"{f.path}#{f.index}" for f in picks] if len(picks) == 3 else None


@pytest.mark.skipif(_three_families() is None, reason="fonts-wqy-* and fonts-arphic-ukai not installed")
def test_cross_family_splits_and_masks(tmp_path):
    fonts = _three_families()
    kw = dict(root=tmp_path, fonts=fonts, max_classes=6, size=16, protocol="cross_family",
              test_families=["AR PL UKai"])
    zs = build_glyph_dataset("test", root=tmp_path, fonts=fonts, max_classes=6, size=16)
    tr = build_glyph_dataset("train", **kw)
    q = build_glyph_dataset("query", **kw)
    g = build_glyph_dataset("gallery", **kw)
    te = build_glyph_dataset("test", **kw)
    assert te.from_cache and q.from_cache  # one rendering serves both protocols
    assert sorted(tr.train_families) == ["WenQuanYi Micro Hei", "WenQuanYi Zen Hei"]
    assert tr.test_families == ["AR PL UKai"]
    # training: training characters, never a held-out face
    train_faces = {tr.faces[i] for i in tr.face_ids.tolist()}
    assert train_faces and all(not n.startswith("AR PL UKai") for n in train_faces)
    assert set(tr.families.tolist()) == {"WenQuanYi Micro Hei", "WenQuanYi Zen Hei"}
    chars = gb2312_level1_chars()
    assert tr.class_names == list(chars[:6])
    # queries: test characters by the held-out family only; gallery: the same characters by
    # the training families; test = both, in the order of the zero-shot test split
    assert {q.faces[i] for i in q.face_ids.tolist()} == {"AR PL UKai CN"}
    assert set(g.families.tolist()) == {"WenQuanYi Micro Hei", "WenQuanYi Zen Hei"}
    assert q.class_names == g.class_names == te.class_names == list(chars[1878:1884])
    assert len(te) == len(zs) == len(q) + len(g)
    np.testing.assert_array_equal(te.images, zs.images)
    np.testing.assert_array_equal(te.labels, zs.labels)
    assert te.is_query.dtype == bool and te.is_query.shape == (len(te),)
    np.testing.assert_array_equal(te.is_gallery, ~te.is_query)
    np.testing.assert_array_equal(te.is_query, te.families == "AR PL UKai")
    np.testing.assert_array_equal(te.images[te.is_query], q.images)
    np.testing.assert_array_equal(te.labels[te.is_gallery], g.labels)
    np.testing.assert_array_equal(te.face_ids[te.is_gallery], g.face_ids)
    # every test character has a query and gallery images (all three faces map them)
    assert sorted(set(q.labels.tolist())) == sorted(set(g.labels.tolist())) == list(range(6))
    assert zs.is_query is None  # the zero-shot protocol has no query/gallery marking
    with pytest.raises(ValueError, match="test_families"):
        build_glyph_dataset("test", root=tmp_path, fonts=fonts, max_classes=6, size=16, test_families=["AR PL UKai"])
    with pytest.raises(ValueError, match="no face among the fonts used"):
        build_glyph_dataset("query", **{**kw, "test_families": ["Noto Serif CJK"]})
    with pytest.raises(ValueError, match="nothing is left to train on"):
        build_glyph_dataset("train", **{**kw, "test_families": ["AR PL UKai", "WenQuanYi Micro Hei",
                                                                "WenQuanYi Zen Hei"]})
    with pytest.raises(ValueError, match="split must be one of"):
        build_glyph_dataset("query", root=tmp_path, fonts=fonts, max_classes=6, size=16)
    with pytest.raises(ValueError, match="protocol"):
        build_glyph_dataset("train", root=tmp_path, fonts=fonts, protocol="cross_style")


@pytest.mark.skipif(_three_families() is None, reason="fonts-wqy-* and fonts-arphic-ukai not installed")
def test_cross_family_end_to_end_train_and_embed(tmp_path):
    """`deepmetric train` with protocol=cross_family evaluates held-out-family queries against
    the training families' gallery; `deepmetric embed` writes the same masks."""
    import json

    from deepmetric import cli

    fonts = _three_families()
    run = tmp_path / "run"
    opts = {"fonts": fonts, "max_classes": 6, "size": 16, "protocol": "cross_family",
            "test_families": ["AR PL UKai"]}
    cfg = tmp_path / "c.yaml"
    cfg.write_text(json.dumps({
        "data": {"name": "glyphs", "root": str(tmp_path / "cache"), "options": opts},
        "model": {"name": "glyph_resnet", "options": {"embedding_dim": 8, "norm": "bn", "widths": [4, 8],
                                                     "depths": [1, 1]}},
        "loss": [{"name": "heated_softmax", "options": {"alpha": 16.0}}],
        "optim": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
        "train": {"epochs": 1, "batch_size": 4, "seed": 0, "out_dir": str(run), "progress": False},
        "eval": {"every": 1, "ks": [1, 2], "metrics": ["recall", "map@r"]},
    }))
    assert cli.main(["train", str(cfg)]) == 0
    metrics = json.loads((run / "metrics.json").read_text())["metrics"]
    npz = tmp_path / "emb.npz"
    assert cli.main(["embed", str(run / "last.pt"), "--split", "test", "--out", str(npz)]) == 0
    z = np.load(npz)
    te = build_glyph_dataset("test", root=tmp_path / "cache", **opts)
    np.testing.assert_array_equal(z["is_query"], te.is_query)
    np.testing.assert_array_equal(z["is_gallery"], te.is_gallery)
    # Recall@1 by brute force: each held-out-family query against the training-family gallery
    x = z["embeddings"] / np.linalg.norm(z["embeddings"], axis=1, keepdims=True)
    q, g = np.flatnonzero(z["is_query"]), np.flatnonzero(z["is_gallery"])
    nearest = g[np.argmax(x[q] @ x[g].T, axis=1)]
    r1 = float(np.mean(z["labels"][nearest] == z["labels"][q]))
    assert metrics["recall@1"] == pytest.approx(r1, abs=1e-6)


@pytest.mark.skipif(_three_families() is None, reason="fonts-wqy-* and fonts-arphic-ukai not installed")
def test_validation_families_mirror_the_cross_family_test(tmp_path):
    """data.val_query_families: a training family leaves training, and the validation
    characters are searched with that family's images as queries against the other training
    family, as the test searches the held-out families against the training families."""

    from deepmetric.train import train
    from deepmetric.run.builders import build_split
    from deepmetric.run.config_io import config_from_dict
    from deepmetric.run.embed import compute_embeddings, load_model_from_checkpoint

    fonts = _three_families()
    run = tmp_path / "run"
    opts = {"fonts": fonts, "max_classes": 8, "size": 16, "protocol": "cross_family",
            "test_families": ["AR PL UKai"]}
    raw = {
        "data": {"name": "glyphs", "root": str(tmp_path / "cache"), "options": opts, "val_classes": 3,
                 "val_query_families": ["WenQuanYi Zen Hei"]},
        "model": {"name": "glyph_resnet", "options": {"embedding_dim": 8, "norm": "bn", "widths": [4, 8],
                                                     "depths": [1, 1]}},
        "loss": [{"name": "heated_softmax", "options": {"alpha": 16.0}}],
        "optim": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
        "train": {"epochs": 1, "batch_size": 4, "seed": 0, "out_dir": str(run), "progress": False},
        "eval": {"every": 1, "ks": [1], "metrics": ["recall"], "best_metric": "recall@1", "baselines": False},
    }
    cfg = config_from_dict(raw)
    tr, va = build_split(cfg, "train", train=False), build_split(cfg, "val", train=False)
    assert set(tr.families.tolist()) == {"WenQuanYi Micro Hei"} and tr.num_classes == 5
    assert va.num_classes == 3 and set(va.families.tolist()) == {"WenQuanYi Micro Hei", "WenQuanYi Zen Hei"}
    np.testing.assert_array_equal(va.is_query, va.families == "WenQuanYi Zen Hei")
    train(cfg)
    rec = [r for r in read_log(run, type="eval") if r["split"] == "val"][-1]
    # validation Recall@1 by brute force: each Zen Hei query against the Micro Hei gallery
    model, *_ = load_model_from_checkpoint(run / "last.pt")
    z = compute_embeddings(model, va, batch_size=8)
    x = z["embeddings"] / np.linalg.norm(z["embeddings"], axis=1, keepdims=True)
    q, g = np.flatnonzero(va.is_query), np.flatnonzero(va.is_gallery)
    nearest = g[np.argmax(x[q] @ x[g].T, axis=1)]
    assert rec["recall@1"] == pytest.approx(float(np.mean(va.labels[nearest] == va.labels[q])), abs=1e-6)
