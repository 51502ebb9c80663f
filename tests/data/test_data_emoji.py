"""Emoji benchmark on miniature package trees in the exact npm layouts (emoji-datasource's
emoji.json with its real fields incl. skin_variations, img/<vendor>/64 PNGs, emojione's png/64,
openmoji's color/svg): counts, splits, compositing, SVG rasterisation, cache, error messages,
the installer, and the cross-vendor evaluation against a brute-force computation."""
import io
import json
import tarfile

import numpy as np
import pytest
import torch
from PIL import Image

from deepmetric.data import build_dataset, build_transform
from deepmetric.data import emoji as em
from deepmetric.data.emoji import build_emoji_dataset
from deepmetric.evaluate import evaluate_cross_domain

# (unified, name, category, sort_order, has_img flags missing, emojione file name or None)
MINI = [
    ("1F600", "GRINNING FACE", "Smileys & Emotion", 1, (), "1f600"),
    ("2764-FE0F", "HEAVY BLACK HEART", "Smileys & Emotion", 2, (), "2764"),
    ("1F385", "FATHER CHRISTMAS", "People & Body", 3, (), "1f385"),  # has skin_variations
    ("1F469-200D-1F4BB", "WOMAN TECHNOLOGIST", "People & Body", 4, ("facebook",), "1f469-1f4bb"),
    ("1F436", "DOG FACE", "Animals & Nature", 5, (), "1f436"),
    ("1FAE8", "SHAKING FACE", "Smileys & Emotion", 6, (), None),  # newer than emojione 4.5
    ("1F1EB-1F1F7", "France Flag", "Flags", 7, ("apple",), "1f1eb-1f1f7"),
    ("1F34E", "RED APPLE", "Food & Drink", 8, (), "1f34e"),
    ("0023-FE0F-20E3", "HASH KEY", "Symbols", 9, (), "0023-20e3"),
]
SKIN = ("1F3FB", "1F3FC")


def _colour(cls: int, vendor: int):
    """A distinct opaque colour per (class, vendor)."""
    return (20 + 25 * cls, 40 + 30 * vendor, 200 - 15 * cls)


def _png(path, cls, vendor, size=64):
    """RGBA: transparent background, an opaque square, and a half-transparent black band."""
    a = np.zeros((size, size, 4), np.uint8)
    a[16:48, 16:48, :3] = _colour(cls, vendor)
    a[16:48, 16:48, 3] = 255
    a[0:4, :, 3] = 128  # black at alpha 128 on white -> 127
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(a, "RGBA").save(path)


def _svg(path, cls):
    r, g, b = _colour(cls, 5)
    path.parent.mkdir(parents=True, exist_ok=True)
    # openmoji's canvas: a 72x72 viewBox; the left half is filled, the right half transparent
    path.write_text(f'<svg id="emoji" viewBox="0 0 72 72" xmlns="http://www.w3.org/2000/svg">'
                    f'<g id="color"><rect x="0" y="0" width="36" height="72" fill="rgb({r},{g},{b})"/></g></svg>')


def _record(unified, name, category, sort_order, missing):
    rec = {"name": name, "unified": unified, "non_qualified": None, "docomo": None, "au": None,
           "softbank": None, "google": None, "image": unified.lower() + ".png", "sheet_x": 0, "sheet_y": 0,
           "short_name": name.lower().replace(" ", "_"), "short_names": [name.lower()], "text": None,
           "texts": None, "category": category, "subcategory": "x", "sort_order": sort_order,
           "added_in": "1.0"}
    rec.update({f"has_img_{v}": v not in missing for v in em.DATASOURCE_VENDORS})
    return rec


def make_tree(root, versions=None):
    """The installed layout <root>/emoji/packages/<name>@<version>/ of all six packages."""
    pkgs = em.emoji_packages_dir(root)
    records = []
    for unified, name, cat, order, missing, _ in MINI:
        rec = _record(unified, name, cat, order, missing)
        if unified == "1F385":
            rec["skin_variations"] = {t: {"unified": f"{unified}-{t}", "non_qualified": None,
                                          "image": f"{unified}-{t}".lower() + ".png", "sheet_x": 0,
                                          "sheet_y": 0, "added_in": "1.0",
                                          **{f"has_img_{v}": True for v in em.DATASOURCE_VENDORS}} for t in SKIN}
        records.append(rec)
    records = records[::-1]  # the file is not in sort_order; the loader sorts
    for vi, v in enumerate(em.DATASOURCE_VENDORS):
        pkg = em.PACKAGES[em.VENDOR_PACKAGE[v]]
        d = pkgs / pkg.spec
        d.mkdir(parents=True)
        (d / "package.json").write_text(json.dumps({"name": pkg.name, "version": (versions or {}).get(pkg.name, pkg.version)}))
        (d / "emoji.json").write_text(json.dumps(records))
        for ci, (unified, _, _, _, missing, _) in enumerate(MINI):
            if v not in missing:
                _png(d / "img" / v / "64" / (unified.lower() + ".png"), ci, vi)
        for t in SKIN:  # skin-tone variants lie in the same folder and must not become samples
            _png(d / "img" / v / "64" / f"1f385-{t.lower()}.png", 9, vi)
    d = pkgs / "emojione-assets@4.5.0"
    (d / "png" / "64" / "_alt").mkdir(parents=True)
    (d / "package.json").write_text(json.dumps({"name": "emojione-assets", "version": "4.5.0"}))
    for ci, (*_, fname) in enumerate(MINI):
        if fname:
            _png(d / "png" / "64" / f"{fname}.png", ci, 4)
    _png(d / "png" / "64" / "1f385-1f3fb.png", 9, 4)
    d = pkgs / "openmoji@17.0.0"
    d.mkdir()
    (d / "package.json").write_text(json.dumps({"name": "openmoji", "version": "17.0.0"}))
    for ci, (unified, *_) in enumerate(MINI):
        _svg(d / "color" / "svg" / f"{unified}.svg", ci)
    return pkgs


@pytest.fixture
def tree(tmp_path):
    make_tree(tmp_path)
    return tmp_path


def test_counts_vendors_and_missing_images(tree):
    ds = build_emoji_dataset("all", root=tree)
    assert ds.num_classes == len(MINI) and ds.class_names == [m[0] for m in MINI]  # sort_order
    assert ds.vendors == list(em.VENDORS)
    expected = []  # (class, vendor) pairs from the table above, independently of the loader
    for ci, (_, _, _, _, missing, one) in enumerate(MINI):
        for vi, v in enumerate(em.VENDORS):
            drawn = (v not in missing) if v in em.DATASOURCE_VENDORS else (one is not None if v == "emojione" else True)
            if drawn:
                expected.append((ci, vi))
    got = sorted(zip(ds.labels.tolist(), ds.vendor_ids.tolist()))
    assert got == sorted(expected)  # one image per vendor that draws it, no skin-tone variant
    c = ds.counts()
    assert c["images"] == len(expected) == 9 * 6 - 3
    assert c["per_vendor"] == {"apple": 8, "google": 9, "twitter": 9, "facebook": 8, "emojione": 8, "openmoji": 9}
    assert c["images_per_class"] == {5: 3, 6: 6}
    assert c["classes_per_category"]["Smileys & Emotion"] == 3 and c["images_per_category"]["Smileys & Emotion"] == 17
    # each sample's image is its own (class, vendor) artwork: the square's colour
    for i in range(len(ds)):
        cls, v = int(ds.labels[i]), int(ds.vendor_ids[i])
        if ds.vendor_of(i) != "openmoji":
            np.testing.assert_array_equal(ds.images[i, 32, 32], _colour(cls, v))
    assert ds.vendor_of(int(np.flatnonzero(ds.vendor_ids == 5)[0])) == "openmoji"
    assert ds.names[3] == "WOMAN TECHNOLOGIST" and ds.categories[6] == "Flags"


def test_compositing_on_white_and_svg(tree):
    ds = build_emoji_dataset("all", root=tree, vendors=["google", "openmoji"])
    g = ds.images[(ds.vendor_ids == 0) & (ds.labels == 0)][0]
    assert g.shape == (64, 64, 3) and g.dtype == np.uint8
    np.testing.assert_array_equal(g[40, 60], [255, 255, 255])  # transparent -> white
    # black at alpha 128/255 over white: 255 * (1 - 128/255) = 127
    np.testing.assert_allclose(g[1, 10], [127, 127, 127], atol=1)
    o = ds.images[(ds.vendor_ids == 1) & (ds.labels == 2)][0]
    np.testing.assert_array_equal(o[10, 5], _colour(2, 5))  # filled left half of the SVG
    np.testing.assert_array_equal(o[10, 60], [255, 255, 255])  # transparent right half
    # deterministic rasterisation
    again = np.asarray(em.rasterize_svg(em.emoji_packages_dir(tree) / "openmoji@17.0.0/color/svg/1F385.svg"))
    np.testing.assert_array_equal(again, np.asarray(em.rasterize_svg(em.emoji_packages_dir(tree) / "openmoji@17.0.0/color/svg/1F385.svg")))


def test_size_resizes_every_vendor(tree):
    big = build_emoji_dataset("test", root=tree, size=64)
    small = build_emoji_dataset("test", root=tree, size=32)
    assert small.images.shape[1:] == (32, 32, 3) and len(small) == len(big)
    # Lanczos keeps the mean colour of these flat images (to a grey level or two)
    np.testing.assert_allclose(small.images.mean(axis=(1, 2)), big.images.mean(axis=(1, 2)), atol=2.0)
    for bad in (31, 129, 64.0):
        with pytest.raises(ValueError, match="size"):
            build_emoji_dataset("test", root=tree, size=bad)


def test_zero_shot_split_is_disjoint_and_in_sort_order(tree):
    tr = build_emoji_dataset("train", root=tree)
    te = build_emoji_dataset("test", root=tree, protocol="cross_vendor")
    assert tr.num_classes == len(MINI) // 2 == 4 and te.num_classes == len(MINI) - 4
    assert not set(tr.class_names) & set(te.class_names)
    assert tr.class_names + te.class_names == [m[0] for m in MINI]
    assert tr.sort_order.max() < te.sort_order.min()
    assert tr.labels.max() == tr.num_classes - 1 and te.labels.min() == 0
    assert te.protocol == "cross_vendor"
    # the split does not move with the vendors
    assert build_emoji_dataset("train", root=tree, vendors="emojione").class_names == tr.class_names
    assert build_emoji_dataset("test", root=tree, vendors="emojione").class_names == [
        c for c in te.class_names if c != "1FAE8"]  # emojione 4.5 lacks it: class dropped
    # min_vendors drops classes, not the split point
    te6 = build_emoji_dataset("test", root=tree, min_vendors=6)
    assert te6.class_names == [c for c in te.class_names if c not in ("1FAE8", "1F1EB-1F1F7")]
    with pytest.raises(ValueError, match="protocol"):
        build_emoji_dataset("test", root=tree, protocol="classification")
    with pytest.raises(ValueError, match="vendor"):
        build_emoji_dataset("test", root=tree, vendors=["apple", "samsung"])


def test_cache_hit_and_key(tree):
    a = build_emoji_dataset("train", root=tree, vendors="apple,google")
    assert not a.from_cache
    cache = em.emoji_cache_dir(tree)
    files = list(cache.glob("*.npz"))
    assert files == [a.cache_path] and not list(cache.glob("*.tmp"))
    b = build_emoji_dataset("test", root=tree, vendors=["google", "apple"])  # same build, other split
    assert b.from_cache and b.cache_path == a.cache_path
    c = build_emoji_dataset("train", root=tree, vendors="apple,google")
    assert c.from_cache
    np.testing.assert_array_equal(a.images, c.images)
    np.testing.assert_array_equal(a.vendor_ids, c.vendor_ids)
    build_emoji_dataset("train", root=tree, vendors="apple,google", size=48)  # other parameters
    build_emoji_dataset("train", root=tree, vendors="apple")
    assert len(list(cache.glob("*.npz"))) == 3
    # a damaged cache file is rebuilt
    a.cache_path.write_bytes(b"not a zip")
    d = build_emoji_dataset("train", root=tree, vendors="apple,google")
    assert not d.from_cache
    np.testing.assert_array_equal(a.images, d.images)


def test_corrupt_png_is_named(tree):
    bad = em.emoji_packages_dir(tree) / "emoji-datasource-twitter@16.0.0/img/twitter/64/1f436.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n garbage")
    with pytest.raises(ValueError, match="1f436.png"):
        build_emoji_dataset("train", root=tree, vendors="twitter")
    bad.unlink()  # has_img_twitter is true but the file is gone: an incomplete extraction
    with pytest.raises(FileNotFoundError, match=r"1f436\.png.*has_img_twitter"):
        build_emoji_dataset("train", root=tree, vendors="twitter")


def test_corrupt_svg_is_named(tree):
    bad = em.emoji_packages_dir(tree) / "openmoji@17.0.0/color/svg/1F436.svg"
    bad.write_text("<svg this is not xml")
    with pytest.raises(ValueError, match="1F436.svg"):
        build_emoji_dataset("train", root=tree, vendors="openmoji")


def test_missing_or_wrong_version_package_names_the_install_command(tmp_path):
    make_tree(tmp_path, versions={"emoji-datasource-facebook": "15.1.0"})
    with pytest.raises(ValueError, match=r"(?s)version '15\.1\.0'.*16\.0\.0.*install\.sh.*--packages emoji-datasource-facebook"):
        build_emoji_dataset("train", root=tmp_path)
    build_emoji_dataset("train", root=tmp_path, vendors="apple,openmoji")  # facebook not needed
    pkgs = em.emoji_packages_dir(tmp_path)
    (pkgs / "openmoji@17.0.0").rename(pkgs / "openmoji@16.0.0")
    with pytest.raises(FileNotFoundError, match=r"(?s)openmoji@17\.0\.0 is not extracted.*found openmoji@16\.0\.0.*"
                                                r"deepmetric emoji install --root .* --packages openmoji"):
        build_emoji_dataset("train", root=tmp_path, vendors="openmoji")


def test_registry_and_transform(tree):
    tf = build_transform("emoji", train=False, normalize="minus_one_one")
    ds = build_dataset("emoji", root=tree, split="test", vendors="google,twitter", transform=tf)
    x, y = ds[0]
    assert x.shape == (3, 64, 64) and x.dtype == torch.float32 and y == int(ds.labels[0])
    ref = torch.from_numpy(ds.images[0]).permute(2, 0, 1).float() / 255 * 2 - 1
    torch.testing.assert_close(x, ref)
    ds.transform = None
    torch.testing.assert_close(ds[0][0], ref / 2 + 0.5)
    tf = build_transform("emoji", train=True, size=96, mean=(0.5, 0.4, 0.3), std=(0.2, 0.2, 0.2))
    torch.manual_seed(0)
    out = tf(torch.from_numpy(ds.images[0]).permute(2, 0, 1).contiguous())
    assert out.shape == (3, 96, 96)
    with pytest.raises(ValueError, match="mean and std"):
        build_transform("emoji", train=False, mean=(0.5, 0.5, 0.5))
    # no flip by default: with the jitter switched off, training leaves an asymmetric image as is
    img = torch.zeros(3, 8, 8, dtype=torch.uint8)
    img[:, :, :2] = 255
    still = dict(degrees=0.0, translate=0.0, scale=(1.0, 1.0), brightness=0, contrast=0, saturation=0,
                 normalize="none")
    for seed in range(8):
        torch.manual_seed(seed)
        torch.testing.assert_close(build_transform("emoji", train=True, **still)(img), img.float() / 255)
    flipped = {bool(build_transform("emoji", train=True, flip=True, **still)(img)[0, 0, -1] == 1.0)
               for _ in range(30)}
    assert flipped == {True, False}


def _npm_tarball(path, files):
    with tarfile.open(path, "w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo("package/" + name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_installer_extracts_only_what_is_used(tmp_path, monkeypatch):
    tgz_dir = tmp_path / "tgz"
    tgz_dir.mkdir()
    tgz = tgz_dir / "openmoji-17.0.0.tgz"
    _npm_tarball(tgz, {"package.json": b'{"name": "openmoji", "version": "17.0.0"}',
                       "color/svg/1F600.svg": b"<svg/>", "black/svg/1F600.svg": b"<svg/>",
                       "color/72x72/1F600.png": b"png", "../evil": b"x"})
    pinned = em.PACKAGES["openmoji"]
    with pytest.raises(ValueError, match="expected the pinned"):  # the real pinned hash does not match
        em.install_emoji_packages(tmp_path, packages=["openmoji"], tarball_dir=tgz_dir, verbose=False)
    fake = em.EmojiPackage(pinned.name, pinned.version, em._sha512_integrity(tgz), pinned.members)
    monkeypatch.setitem(em.PACKAGES, "openmoji", fake)
    (d,) = em.install_emoji_packages(tmp_path, packages=["openmoji"], tarball_dir=tgz_dir, verbose=False)
    files = sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file())
    assert files == [em.MARKER, "color/svg/1F600.svg", "package.json"]
    assert not list(d.parent.glob(".openmoji.*"))  # no staging folder left
    marker = json.loads((d / em.MARKER).read_text())
    assert marker["version"] == "17.0.0" and marker["integrity"] == fake.integrity
    (d / "color/svg/1F600.svg").write_text("changed")
    em.install_emoji_packages(tmp_path, packages=["openmoji"], tarball_dir=tgz_dir, verbose=False)
    assert (d / "color/svg/1F600.svg").read_text() == "changed"  # installed: skipped
    em.install_emoji_packages(tmp_path, packages=["openmoji"], tarball_dir=tgz_dir, verbose=False, force=True)
    assert (d / "color/svg/1F600.svg").read_text() == "<svg/>"
    with pytest.raises(ValueError, match="unknown package"):
        em.install_emoji_packages(tmp_path, packages=["emoji-datasource-samsung"], verbose=False)
    # without a tarball, npm is needed (never reached here: a missing or failing npm is reported)
    with pytest.raises(FileNotFoundError, match="no-such-npm.*not found"):
        em.install_emoji_packages(tmp_path / "x", packages=["openmoji"], npm="no-such-npm", verbose=False)
    # a --from folder that does not exist is a typo, not a reason to go to npm (offline: it cannot)
    with pytest.raises(FileNotFoundError, match=r"--from .*tgs: no such folder .*openmoji-17.0.0.tgz"):
        em.install_emoji_packages(tmp_path / "y", packages=["openmoji"], tarball_dir=tmp_path / "tgs",
                                  npm="no-such-npm", verbose=False)
    assert not (tmp_path / "y").exists()
    with pytest.raises(OSError, match=r"pack --silent .*openmoji@17\.0\.0.*failed \(exit 1\)"):
        em.install_emoji_packages(tmp_path / "x", packages=["openmoji"], npm="false", verbose=False)
    assert not (em.emoji_packages_dir(tmp_path / "x") / "openmoji@17.0.0").exists()


def _brute_force(x, y, dom, d):
    """R@1 and MAP@R of the queries of domain d against the other domains (cosine)."""
    x = x / np.linalg.norm(x, axis=1, keepdims=True)
    q, g = np.flatnonzero(dom == d), np.flatnonzero(dom != d)
    r1, maps, skipped = [], [], 0
    for i in q:
        s = x[g] @ x[i]
        order = g[np.argsort(-s, kind="stable")]
        rel = y[order] == y[i]
        r = int(rel.sum())
        if r == 0:
            skipped += 1
            continue
        r1.append(rel[0])
        prec = np.cumsum(rel[:r]) / np.arange(1, r + 1)
        maps.append(float((prec * rel[:r]).sum() / r))
    return float(np.mean(r1)), float(np.mean(maps)), skipped


def test_cross_domain_matches_brute_force(rng):
    n_cls, n_dom = 12, 3
    y = np.repeat(np.arange(n_cls), n_dom)
    dom = np.tile(np.arange(n_dom), n_cls)
    keep = np.ones(len(y), bool)
    keep[(y == 0) & (dom != 1)] = False  # class 0 only in domain 1: its query has no positive
    keep[(y == 5) & (dom == 2)] = False
    y, dom = y[keep], dom[keep]
    x = rng.normal(size=(len(y), 8)) + 1.5 * rng.normal(size=(n_cls, 8))[y]
    res = evaluate_cross_domain(x, y, dom, domain_names=["a", "b", "c"], ks=(1,), metrics=("recall", "map@r"))
    assert set(res) == {"a", "b", "c", "mean"}
    for d, name in enumerate("abc"):
        r1, mapr, skipped = _brute_force(x, y, dom, d)
        assert res[name]["recall@1"] == pytest.approx(r1)
        assert res[name]["map@r"] == pytest.approx(mapr)
        assert res[name]["queries"] == int((dom == d).sum())
        assert res[name]["queries_without_positive"] == skipped
    assert res["b"]["queries_without_positive"] == 1
    assert res["mean"]["map@r"] == pytest.approx(np.mean([res[k]["map@r"] for k in "abc"]))
    with pytest.raises(ValueError, match="clustering"):
        evaluate_cross_domain(x, y, dom, metrics=("nmi",))
    with pytest.raises(ValueError, match="2 domains"):
        evaluate_cross_domain(x, y, np.zeros(len(y), int))


@pytest.mark.filterwarnings("ignore:1 query has no same-label")  # France has no apple image
def test_cli_counts_pixels_and_errors(tree, capsys):
    from deepmetric.cli import main

    assert main(["emoji", "counts", "--root", str(tree), "--vendors", "google,openmoji", "--size", "32"]) == 0
    counts = json.loads(capsys.readouterr().out)
    assert counts["all"]["per_vendor"] == {"google": 9, "openmoji": 9}
    assert counts["train"]["classes"] + counts["test"]["classes"] == counts["all"]["classes"] == 9
    assert main(["emoji", "pixels", "--root", str(tree), "--split", "all", "--vendors", "apple,google"]) == 0
    out = capsys.readouterr().out
    assert "all-vs-all:" in out and "cross-vendor mean:" in out
    from deepmetric.run.baselines import emoji_pixel_baseline

    res = emoji_pixel_baseline("all", tree, vendors="apple,google", ks=(1,))
    # apple and google draw every mini class in the same colour family: each query's nearest
    # other-vendor image is its own class (colours differ by class far more than by vendor)
    assert res["cross_vendor"]["mean"]["recall@1"] == 1.0
    assert main(["emoji", "counts", "--root", str(tree / "nowhere")]) == 2
    assert "deepmetric emoji install" in capsys.readouterr().err


_INSTALLED = em.emoji_packages_dir() / "emoji-datasource-google@16.0.0" / "emoji.json"


@pytest.mark.skipif(not _INSTALLED.is_file(), reason="emoji packages not installed (bash install.sh)")
def test_installed_index_counts():
    """The real emoji.json of emoji-datasource 16.0.0 (documented counts)."""
    entries = em.load_emoji_index(_INSTALLED)
    assert len(entries) == 1911
    assert sum(len(e.get("skin_variations") or {}) for e in entries) == 1875
    assert sum(all(e[f"has_img_{v}"] for v in em.DATASOURCE_VENDORS) for e in entries) == 1857
    cats = {}
    for e in entries:
        cats[e["category"]] = cats.get(e["category"], 0) + 1
    assert cats["People & Body"] == 386 and cats["Flags"] == 270 and cats["Component"] == 5
    assert [e["sort_order"] for e in entries] == list(range(1, 1912))


@pytest.mark.skipif(not _INSTALLED.is_file(), reason="emoji packages not installed (bash install.sh)")
def test_installed_artwork_of_one_emoji():
    """GRINNING FACE (1F600) from every installed vendor: found under its package's file name,
    64 x 64 RGB on white, a yellow face in the middle."""
    entries = em.load_emoji_index(_INSTALLED)
    grin = [e for e in entries if e["unified"] == "1F600"]
    checked = []
    for v in em.VENDORS:
        d = em.emoji_packages_dir() / em.PACKAGES[em.VENDOR_PACKAGE[v]].spec
        if not (d / em.MARKER).is_file():
            continue
        checked.append(v)
        (f,) = em._vendor_files(v, d, grin)
        rgb = em._composite_white(em.rasterize_svg(f)) if v == "openmoji" else em._read_png(f)
        assert rgb.shape == (64, 64, 3), v
        assert (rgb[0, 0] >= 250).all(), v  # transparent corner -> white
        r, g, b = rgb[24:40, 12:20].reshape(-1, 3).mean(0)  # left cheek
        assert r > 180 and g > 120 and b < 120, (v, r, g, b)  # yellow-orange skin
    assert checked, "no vendor's package has its install marker (bash install.sh)"
