"""Pre-flight checks (before the first step), the raw-pixel baseline and the run summary."""
import re

import numpy as np
import pytest
import torch
from PIL import Image

from deepmetric.data import build_dataset, build_transform
from deepmetric.evaluate import evaluate
from deepmetric.run import baselines as P
from deepmetric.train.checks import short_input_warnings
from deepmetric.run.config import ConfigError
from deepmetric.run.config_io import config_from_dict
from deepmetric.run.baselines import raw_pixel_baseline
from deepmetric.run.config_checks import check_config_options, check_monitored_metrics
from deepmetric.run.evaluation import expected_metrics
from deepmetric.train.checks import check_images_readable, check_model_input, few_classes_warning
from deepmetric.train.image_warnings import patch_grid_warning, size_warnings
from deepmetric.train.summary import describe_split, format_run_end, format_run_summary


def _cfg(**sections):
    raw = {"train": {"epochs": 1}}
    for key, value in sections.items():
        if isinstance(value, dict):
            raw.setdefault(key, {}).update(value)
        else:
            raw[key] = value
    return config_from_dict(raw)


# ----------------------------------------------------------------------------- metric names
def test_expected_metrics_follow_the_eval_config():
    assert expected_metrics(_cfg()) == ["recall@1", "recall@2", "recall@4", "recall@8", "map@r",
                                        "r_precision", "nmi", "f1"]
    cfg = _cfg(eval={"ks": [10, 1], "metrics": ["recall", "nmi"], "classification": True})
    assert expected_metrics(cfg) == ["recall@1", "recall@10", "nmi", "top1", "mean_per_class"]


def test_expected_metrics_equal_what_evaluate_returns(rng):
    """The list is checked against the real evaluation, not a copy of it."""
    y = np.repeat(np.arange(4), 5)
    x = rng.standard_normal((20, 3)).astype(np.float32)
    for ev in ({}, {"ks": [1, 3], "metrics": ["recall", "map@r", "f1"]}):
        cfg = _cfg(eval=ev)
        got = evaluate(x, y, ks=tuple(cfg.eval.ks), metrics=cfg.eval.metrics)
        assert sorted(got) == sorted(expected_metrics(cfg))


def test_best_metric_typo_fails_before_training():
    val = {"val_classes": 0.2}  # best.pt is chosen on a validation split
    with pytest.raises(ConfigError, match=r"config key 'eval.best_metric': 'recal@1' is not a metric this run "
                                          r"computes \(did you mean 'recall@1'\?\); the evaluation gives recall@1"):
        check_monitored_metrics(_cfg(data=val, eval={"best_metric": "recal@1"}))
    with pytest.raises(ConfigError, match=r"'recall@16' is not a metric"):
        check_monitored_metrics(_cfg(data=val, eval={"best_metric": "recall@16"}))  # K not in eval.ks
    with pytest.raises(ConfigError, match=r"'eval.best_metric': 'recall@1' is not a metric"):
        check_monitored_metrics(_cfg(data=val, eval={"ks": [2, 4]}))  # the default selection metric
    check_monitored_metrics(_cfg(eval={"ks": [2, 4]}))  # without a validation split nothing is selected
    with pytest.raises(ConfigError, match=r"config key 'schedule.temperature.monitor': 'map@R'.*did you mean 'map@r'"):
        check_monitored_metrics(_cfg(data=val, schedule={"temperature": {"name": "auto_plateau", "monitor": "map@R"}}))
    assert "top1" in check_monitored_metrics(_cfg(eval={"metrics": ["recall"], "classification": True}))


# ----------------------------------------------------------------------------- options
def test_unknown_options_name_the_yaml_key_and_the_closest_option():
    with pytest.raises(ConfigError, match=r"^config key 'loss.0.options.alpah': unknown option 'alpah' for loss "
                                          r"'heated_softmax' \(did you mean 'alpha'\?\)$"):
        check_config_options(_cfg(loss=[{"name": "heated_softmax", "options": {"alpha": 16, "alpah": 4}}]))
    with pytest.raises(ConfigError, match=r"'model.options.embeding_dim': .*model 'glyph_resnet' \(did you mean 'embedding_dim'"):
        check_config_options(_cfg(model={"name": "glyph_resnet", "options": {"embeding_dim": 8}}))
    with pytest.raises(ConfigError, match=r"'data.options.class_splt': .*dataset 'folder' \(did you mean 'class_split'"):
        check_config_options(_cfg(data={"name": "folder", "options": {"class_splt": "half"}}))
    with pytest.raises(ConfigError, match=r"'data.transform_options.chanels': .*transform 'mnist' \(did you mean 'channels'"):
        check_config_options(_cfg(data={"name": "folder", "transform": "mnist", "transform_options": {"chanels": 3}}))
    with pytest.raises(ConfigError, match=r"'data.transform': unknown transform 'mnsit' \(did you mean 'mnist'"):
        check_config_options(_cfg(data={"transform": "mnsit"}))
    with pytest.raises(ConfigError, match=r"'loss.1.name': unknown loss 'triplett' \(did you mean 'triplet'"):
        check_config_options(_cfg(loss=[{"name": "heated_softmax"}, {"name": "triplett"}]))
    with pytest.raises(ConfigError, match=r"'model.options.wdiths'.*model 'two_head' \(did you mean 'widths'"):
        check_config_options(_cfg(model={"name": "two_head", "options": {"backbone": "glyph_resnet", "wdiths": [8]}}))
    with pytest.raises(ConfigError, match=r"unknown option 'qqq' for model 'synthetic_mlp'; accepted: .*embedding_dim"):
        check_config_options(_cfg(model={"name": "synthetic_mlp", "options": {"qqq": 1}}))
    # valid options pass (including the backbone's own and the dataset wrapper's)
    check_config_options(_cfg(data={"name": "folder", "options": {"class_split": "half", "skip_missing": True},
                                    "transform": "glyph", "transform_options": {"channels": 1}},
                              model={"name": "glyph_resnet", "options": {"widths": [8, 16], "depths": [1, 1],
                                                                         "in_chans": 1}},
                              loss=[{"name": "triplet", "options": {"margin": 0.2, "mining": "hard"}}]))
    check_config_options(_cfg(data={"name": "synthetic", "options": {"num_classes": 4}}))


@pytest.mark.parametrize("loss, options, said", [
    ("heated_softmax", {"learnable_alpha": "false"}, "'loss.0.options.learnable_alpha': expected bool (true/false), got str 'false'"),
    ("triplet", {"normalize": "no"}, "'loss.0.options.normalize': expected bool (true/false), got str 'no'"),
    ("almn", {"margin_m": 2.5}, "'loss.0.options.margin_m': expected int, got float 2.5"),
    ("almn", {"detach_margin": 1}, "'loss.0.options.detach_margin': expected bool (true/false), got int 1"),
    ("proxy_nca", {"scale_x": "big"}, "'loss.0.options.scale_x': expected float, got str 'big'"),
    ("contrastive", {"margin": True}, "'loss.0.options.margin': expected float, got bool True"),
])
def test_loss_option_values_are_checked_against_the_losses_type_hints(loss, options, said):
    """Loss options were passed on as given: a quoted "false" counted as true inside the loss,
    margin_m 2.5 reached the margin as 2.5 (ALMN's m x n block), a bool margin was 1.0."""
    with pytest.raises(ConfigError, match="^config key " + re.escape(said) + "$"):
        check_config_options(_cfg(loss=[{"name": loss, "options": options}]))


def test_loss_option_values_are_converted_as_the_configs_own_keys_are():
    """A numeric string (YAML 1.1 reads 1e-3 as one) is a float option's number, an integral
    float an int option's int, a union takes the first of its types that fits (almn's
    centre_rate: a float or 'auto'); pytorch-metric-learning's own options are left to it."""
    cfg = _cfg(loss=[{"name": "almn", "options": {"beta": "1e-3", "margin_m": 2.0, "centre_rate": "auto"}},
                     {"name": "pml", "options": {"loss": "ArcFaceLoss", "margin": "28.6"}}])
    check_config_options(cfg)
    assert cfg.loss[0].options == {"beta": 0.001, "margin_m": 2, "centre_rate": "auto"}
    assert type(cfg.loss[0].options["margin_m"]) is int
    assert cfg.loss[1].options == {"loss": "ArcFaceLoss", "margin": "28.6"}


@pytest.mark.parametrize("data, said", [
    ({"name": "folder", "options": {"skip_missing": "false"}},
     "'data.options.skip_missing': expected bool (true/false), got str 'false'"),
    ({"name": "folder", "options": {"seed": 1.5}}, "'data.options.seed': expected int, got float 1.5"),
    ({"name": "emoji", "options": {"size": "96px"}}, "'data.options.size': expected int, got str '96px'"),
    ({"name": "synthetic", "options": {"augment": "yes"}}, "'data.options.augment': expected float, got str 'yes'"),
    ({"name": "cub", "options": {"max_decode_mb": [1]}}, "'data.options.max_decode_mb': expected float, got list [1]"),
    ({"name": "folder", "transform": "resize_crop", "transform_options": {"flip": "false"}},
     "'data.transform_options.flip': expected bool (true/false), got str 'false'"),
    ({"name": "folder", "transform": "mnist", "transform_options": {"size": 64.5}},
     "'data.transform_options.size': expected int, got float 64.5"),
    ({"name": "folder", "transform": "timm", "transform_options": {"hflip": True}},
     "'data.transform_options.hflip': expected float, got bool True"),
])
def test_dataset_option_values_are_checked_against_the_loaders_type_hints(data, said):
    """skip_missing: "false" (quoted) counted as true: unreadable images were skipped and
    counted instead of refused; a seed of 1.5 reached the class split; a transform's flip:
    "false" flipped, the mnist transform's size 64.5 became 64, a timm hflip of true was 1.0."""
    with pytest.raises(ConfigError, match="^config key " + re.escape(said) + "$"):
        check_config_options(_cfg(data=data))
    cfg = _cfg(data={"name": "folder", "options": {"seed": 3.0, "max_decode_mb": "1e3", "skip_missing": True}})
    check_config_options(cfg)
    assert cfg.data.options == {"seed": 3, "max_decode_mb": 1000.0, "skip_missing": True}


# ----------------------------------------------------------------------------- images
def _digits(root, classes=("a", "b", "c"), n=3, size=(12, 10), mode="L"):
    rng = np.random.default_rng(0)
    for c in classes:
        (root / c).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            shape = (size[1], size[0]) if mode == "L" else (size[1], size[0], 3)
            Image.fromarray(rng.integers(0, 255, shape, dtype=np.uint8), mode=mode).save(root / c / f"{i}.png")
    return root


def test_unreadable_image_is_found_before_training(tmp_path):
    root = _digits(tmp_path / "d")
    ds = build_dataset("folder", root, split="all")
    assert check_images_readable(ds, "all")[0] == 9
    (root / "b" / "1.png").write_bytes(b"this is not a png")
    (root / "c" / "2.png").write_bytes((root / "a" / "0.png").read_bytes()[:40])  # truncated
    ds = build_dataset("folder", root, split="all")  # files exist: the build passes
    with pytest.raises(OSError) as exc:
        check_images_readable(ds, "test")
    msg = str(exc.value)
    assert "data split 'test': 2 of 9 images cannot be read" in msg
    assert f"{root / 'b' / '1.png'}: not an image PIL can identify" in msg
    assert f"{root / 'c' / '2.png'}:" in msg and "data.options.skip_missing: true" in msg
    assert check_images_readable(torch.utils.data.TensorDataset(torch.zeros(2)), "x") == (0, 0.0)


# ----------------------------------------------------------------------------- model input
def test_channel_mismatch_is_one_sentence_in_config_terms(tmp_path):
    from deepmetric.models import create_model

    root = _digits(tmp_path / "d", size=(28, 28))
    cfg = _cfg(data={"name": "folder", "root": str(root), "transform": "mnist",
                     "transform_options": {"channels": 3}},
               model={"name": "glyph_resnet"})
    ds = build_dataset("folder", root, split="all", transform=build_transform("mnist", train=True, channels=3))
    model = create_model("glyph_resnet", widths=(8,), depths=(1,))
    with pytest.raises(ValueError) as exc:
        check_model_input(model, ds, cfg)
    msg = str(exc.value)
    assert msg == ("model 'glyph_resnet' takes 1-channel images (its first convolution 'backbone.stem.0' has "
                   "in_channels=1) but data.transform 'mnist' gives 3-channel images of shape [3, 28, 28]. "
                   "Set model.options.in_chans: 3, or use data.transform_options.channels: 1.")
    model3 = create_model("glyph_resnet", widths=(8,), depths=(1,), in_chans=3)
    assert check_model_input(model3, ds, cfg) == (3, 28, 28)
    # any other failure of the dry forward pass is one line too
    lenet = create_model("lenet", in_chans=3)
    small = build_dataset("folder", root, split="all", transform=build_transform(
        "resize_crop", train=False, resize=20, crop=16))
    with pytest.raises(ValueError, match=r"^model 'glyph_resnet' cannot process the training images \(a test forward "
                                         r"pass on 2 images of shape \[3, 16, 16\] failed: LeNet needs inputs of at "
                                         r"least 28x28 pixels"):
        check_model_input(lenet, small, cfg)


def test_model_input_check_applies_the_batched_augmentation(tmp_path):
    """With ``transform_options.batched`` the dataset yields uint8 images and the loader's
    collate finishes them (float, augmentation, channels); the dry forward pass must see
    what the loader gives the model, also through a validation ClassSubset."""
    from deepmetric.models import create_model
    from deepmetric.run.builders import ClassSubset

    root = _digits(tmp_path / "d", size=(28, 28))
    cfg = _cfg(data={"name": "folder", "root": str(root), "transform": "glyph",
                     "transform_options": {"batched": True}},
               model={"name": "glyph_resnet"})
    ds = build_dataset("folder", root, split="all", transform=build_transform("glyph", train=True, batched=True))
    assert ds[0][0].dtype == torch.uint8  # what made the unbatched check fail
    model = create_model("glyph_resnet", widths=(8,), depths=(1,))
    assert check_model_input(model, ds, cfg) == (1, 28, 28)
    assert check_model_input(model, ClassSubset(ds, [0, 2]), cfg) == (1, 28, 28)
    # channels added per batch count in the channel check
    ds3 = build_dataset("folder", root, split="all",
                        transform=build_transform("glyph", train=True, batched=True, channels=3))
    with pytest.raises(ValueError, match=r"in_channels=1\) but data.transform 'glyph' gives 3-channel images"):
        check_model_input(model, ds3, cfg)


def test_size_warnings(tmp_path):
    root = _digits(tmp_path / "d", size=(28, 28))
    ds = build_dataset("folder", root, split="all")
    cfg = _cfg(data={"name": "folder", "transform": "resize_crop"}, model={"name": "resnet18"})
    w = size_warnings(cfg, ds, (3, 224, 224))
    assert len(w) == 1 and w[0].startswith("images are 28x28 px but data.transform 'resize_crop' enlarges them "
                                           "to 224x224 (8.0x per side): about 64x the computation")
    w = size_warnings(cfg, ds, (3, 28, 28))
    assert len(w) == 1 and "model 'resnet18' is an ImageNet architecture" in w[0]
    assert size_warnings(_cfg(model={"name": "glyph_resnet"}), ds, (1, 28, 28)) == []


@pytest.mark.parametrize("side, warns", [(64, True), (100, True), (128, False), (224, False)])
def test_an_enlargement_over_2x_per_side_warns(tmp_path, side, warns):
    """The issue's case: 64 px photos enlarged 3.5x to 224 got no warning (only <= 64 px images
    enlarged 4x or more did)."""
    root = _digits(tmp_path / "d", size=(side, side))
    ds = build_dataset("folder", root, split="all")
    cfg = _cfg(data={"name": "folder", "transform": "resize_crop"}, model={"name": "resnet18"})
    w = size_warnings(cfg, ds, (3, 224, 224))
    assert len(w) == int(warns), w
    if warns:
        assert w[0].startswith(f"images are {side}x{side} px but data.transform 'resize_crop' enlarges them to "
                               f"224x224 ({224 / side:.1f}x per side)")


def test_grey_colour_warning_only_for_colour_files_read_as_grey(tmp_path):
    from PIL import Image

    from deepmetric.train.image_warnings import grey_colour_warning, is_colour_image

    rng = np.random.default_rng(0)
    for kind in ("colour", "grey_rgb", "grey"):
        for c in ("a", "b"):
            d = tmp_path / kind / c
            d.mkdir(parents=True)
            for i in range(3):
                v = rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)
                if kind == "grey_rgb":  # grey levels stored as RGB (equal channels): not colour
                    v[..., 1] = v[..., 2] = v[..., 0]
                im = Image.fromarray(v[..., 0], "L") if kind == "grey" else Image.fromarray(v, "RGB")
                im.save(d / f"{i}.jpg", quality=90)
    cfg = _cfg(data={"name": "folder"})
    colour_as_l = build_dataset("folder", tmp_path / "colour", split="all", mode="L")
    w = grey_colour_warning(cfg, colour_as_l)
    assert w is not None and w.startswith("data.options.mode is 'L': images are read as grayscale, but 6 of 6 sampled")
    assert "recipes/own_folder.yaml" in w and str(tmp_path / "colour") in w
    assert grey_colour_warning(cfg, build_dataset("folder", tmp_path / "colour", split="all", mode="RGB")) is None
    for kind in ("grey_rgb", "grey"):
        assert grey_colour_warning(cfg, build_dataset("folder", tmp_path / kind, split="all", mode="L")) is None
    assert is_colour_image(tmp_path / "nothing.png") is None


def test_few_classes_warning():
    assert "only 5 training classes" in few_classes_warning(5)
    assert few_classes_warning(20) is None and few_classes_warning(100) is None


def test_few_classes_warning_only_for_unseen_test_classes(tmp_path):
    """A classification protocol tests the training classes themselves: no zero-shot warning."""
    from deepmetric.models import create_model
    from deepmetric.train.checks import check_run

    root = _digits(tmp_path / "d", size=(28, 28))
    ds = build_dataset("folder", root, split="all", transform=build_transform("mnist", train=False))
    model = create_model("glyph_resnet", widths=(8,), depths=(1,))
    base = dict(data={"name": "folder", "root": str(root), "transform": "mnist"}, model={"name": "glyph_resnet"})
    _, zero_shot = check_run(_cfg(**base), model, ds, {"query": ds})
    assert any("training classes" in w for w in zero_shot)
    _, classification = check_run(_cfg(**base, eval={"classification": True}), model, ds, {"query": ds})
    assert not any("training classes" in w for w in classification)


def test_backbone_features_baseline_pools_as_the_recipe_and_says_so(tmp_path):
    """The untrained / pretrained network's features are pooled as the config pools (the same
    pooling as the trained embedding); the label names a pooling other than the average."""
    from deepmetric.models import create_model

    root = _digits(tmp_path / "d", size=(28, 28))
    ds = build_dataset("folder", root, split="all", transform=build_transform("mnist", train=False))
    options = {"widths": [8], "depths": [1], "embedding_dim": 4}
    for pool, label in (("avg", "glyph_resnet untrained features (8-d)"),
                        ("gem", "glyph_resnet untrained features (8-d, gem pooling)")):
        cfg = _cfg(data={"name": "folder", "root": str(root), "transform": "mnist"},
                   model={"name": "glyph_resnet", "options": {**options, "pool": pool}})
        _, desc, f = P.backbone_features_baseline(cfg, ds)
        assert desc == label
        torch.manual_seed(cfg.train.seed)  # the baseline builds its network from this seed
        net = create_model("glyph_resnet", **options, pool=pool).eval()
        with torch.no_grad():
            fmap = net.forward_features(torch.stack([ds[i][0] for i in range(len(ds))]))
        want = fmap.mean(dim=(2, 3)) if pool == "avg" else fmap.clamp_min(1e-6).pow(3).mean(dim=(2, 3)).pow(1 / 3)
        np.testing.assert_allclose(f["embeddings"], want.numpy(), rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- raw pixels
def test_raw_pixel_baseline_equals_evaluate_on_flattened_pixels(tmp_path):
    root = _digits(tmp_path / "d", classes=("a", "b", "c", "d"), n=4, size=(9, 7), mode="RGB")
    ds = build_dataset("folder", root, split="all", transform=build_transform("mnist", train=False))
    cfg = _cfg(eval={"ks": [1, 2]})
    got, desc = raw_pixel_baseline({"query": ds}, cfg)
    # independent reference: read the PNGs with PIL/numpy, flatten, let evaluate() normalise
    x = np.stack([np.asarray(Image.open(p), dtype=np.float32).reshape(-1) / 255 for p in ds.paths])
    want = evaluate(x, ds.labels, ks=(1, 2))
    assert got == pytest.approx(want) and desc == "raw pixels (9x7x3 = 189-d)"
    # query / gallery
    q = np.arange(len(ds)) % 2 == 0
    sub_q = torch.utils.data.Subset(ds, np.flatnonzero(q))
    sub_g = torch.utils.data.Subset(ds, np.flatnonzero(~q))
    sub_q.labels, sub_g.labels = ds.labels[q], ds.labels[~q]
    got, _ = raw_pixel_baseline({"query": sub_q, "gallery": sub_g}, cfg)
    xm = np.stack([torch.as_tensor(ds[i][0]).reshape(-1).numpy() for i in range(len(ds))])
    order = np.r_[np.flatnonzero(q), np.flatnonzero(~q)]
    want = evaluate(xm[order], ds.labels[order], is_query=np.r_[np.ones(q.sum(), bool), np.zeros((~q).sum(), bool)],
                    is_gallery=np.r_[np.zeros(q.sum(), bool), np.ones((~q).sum(), bool)], ks=(1, 2))
    assert got == pytest.approx(want)
    # a split that marks its own queries and gallery (glyphs cross_family) is searched the same way
    ds.is_query, ds.is_gallery = q, ~q
    got, _ = raw_pixel_baseline({"query": ds}, cfg)
    want = evaluate(x, ds.labels, is_query=q, is_gallery=~q, ks=(1, 2))
    assert got == pytest.approx(want) and got != pytest.approx(evaluate(x, ds.labels, ks=(1, 2)))


def test_raw_pixel_baseline_skips_mixed_images_and_what_it_cannot_afford(tmp_path):
    big = _digits(tmp_path / "big", size=(80, 65))
    m, why = raw_pixel_baseline({"query": build_dataset("folder", big, split="all")}, _cfg(), max_side=64)
    assert m is None and why == "images are 80x65 px (baseline only up to 64x64)"
    mixed = _digits(tmp_path / "mixed", size=(10, 10))
    Image.new("L", (12, 10)).save(mixed / "a" / "9.png")
    m, why = raw_pixel_baseline({"query": build_dataset("folder", mixed, split="all")}, _cfg())
    assert m is None and "image sizes differ" in why
    ds = build_dataset("folder", big, split="all")
    n, d = len(ds), 80 * 65 * 3                               # read as RGB
    m, why = raw_pixel_baseline({"query": ds}, _cfg(), max_work=n * n * d - 1)
    assert m is None and why.startswith(f"{n} images x {d} pixels: an exact search would take about")
    assert "RAW_PIXEL_MAX_SECONDS" in why
    m, why = raw_pixel_baseline({"query": ds}, _cfg(), max_bytes=P.RAW_PIXEL_SEARCH_COPIES * 4 * n * d - 1)
    assert m is None and "of memory, more than the" in why and "RAW_PIXEL_MAX_BYTES" in why


def test_raw_pixel_baseline_has_no_side_limit_and_leaves_out_kmeans_it_cannot_afford(tmp_path):
    """80 x 65 images (over the old 64 px limit) get their baseline; when the search fits the
    time bound but k-means does not, NMI and F1 are left out and the label says so.  The
    values are evaluate()'s on the flattened pixels (one call with every metric)."""
    root = _digits(tmp_path / "big", size=(80, 65))
    ds = build_dataset("folder", root, split="all")
    x = np.stack([np.asarray(Image.open(p).convert("RGB"), dtype=np.float32).reshape(-1) / 255 for p in ds.paths])
    cfg = _cfg(eval={"ks": [1, 2], "metrics": ["recall", "map@r", "nmi", "f1"]})
    got, desc = raw_pixel_baseline({"query": ds}, cfg)
    want = evaluate(x, ds.labels, ks=(1, 2), metrics=["recall", "map@r", "nmi", "f1"])
    assert got == pytest.approx(want, abs=1e-12) and list(got) == list(want)
    assert desc == "raw pixels (80x65x3 = 15600-d)"
    n, d = len(ds), 80 * 65 * 3
    search = n * n * d                                        # every image against all others
    kmeans = n * len(set(ds.labels)) * d * 20                 # k-means: 20 iterations
    got, desc = raw_pixel_baseline({"query": ds}, cfg, max_work=search + kmeans - 1)
    assert got == pytest.approx(evaluate(x, ds.labels, ks=(1, 2), metrics=["recall", "map@r"]), abs=1e-12)
    assert "nmi" not in got and "nmi and f1 left out: k-means would add about" in desc
    got, _ = raw_pixel_baseline({"query": ds}, cfg, max_work=search + kmeans)
    assert set(got) == set(want)
    got, desc = raw_pixel_baseline({"query": ds}, cfg, max_bytes=P.RAW_PIXEL_KMEANS_COPIES * 4 * n * d - 1)
    assert set(got) == {"recall@1", "recall@2", "map@r"} and "k-means would need about" in desc
    only_clustering = _cfg(eval={"metrics": ["nmi"]})
    m, why = raw_pixel_baseline({"query": ds}, only_clustering, max_work=search)
    assert m is None and "nmi left out" in why


def test_raw_pixel_limits_let_the_emoji_test_split_run_at_128_px():
    """The emoji test split (5,635 images, 956 classes; bench/RESULTS.md) against the default
    limits, without reading a pixel: every metric at 64 and 96 px, the retrieval metrics at
    128 px (k-means there would take minutes and some 10 GiB)."""
    n, classes = 5635, 956
    for side, kmeans_fits in ((64, True), (96, True), (128, False)):
        d = side * side * 3
        search = n * n * d
        kmeans = n * classes * d * 20
        assert search <= P.RAW_PIXEL_MAX_WORK
        assert P.RAW_PIXEL_SEARCH_COPIES * 4 * n * d <= P.RAW_PIXEL_MAX_BYTES
        assert (search + kmeans <= P.RAW_PIXEL_MAX_WORK
                and P.RAW_PIXEL_KMEANS_COPIES * 4 * n * d <= P.RAW_PIXEL_MAX_BYTES) is kmeans_fits


# ----------------------------------------------------------------------------- summary
def test_run_summary_names_split_model_loss_device_and_output(tmp_path):
    from deepmetric.models import create_model

    root = _digits(tmp_path / "d", classes=("eight", "five", "four", "nine", "one", "seven"), n=2)
    cfg = _cfg(name="digits", data={"name": "folder", "root": str(root), "options": {"class_split": "half"}},
               loss=[{"name": "heated_softmax", "options": {"alpha": 16}}],
               train={"epochs": 3, "out_dir": str(tmp_path / "run")})
    tr = build_dataset("folder", root, split="train", class_split="half")
    te = build_dataset("folder", root, split="test", class_split="half")
    model = create_model("glyph_resnet", widths=(8,), depths=(1,), embedding_dim=4)
    text = format_run_summary(cfg, train_set=tr, eval_sets={"query": te}, model=model, embedding_dim=4,
                              input_shape=(1, 12, 10), device="cpu", threads=2, steps_per_epoch=5,
                              total_epochs=3, total_steps=15, out_dir=tmp_path / "run")
    n_params = sum(p.numel() for p in model.parameters())
    assert f"[deepmetric] run 'digits' -> {tmp_path / 'run'}" in text
    assert "class_split 'half' (first half of the sorted class names = train)" in text
    assert "train  3 classes, 6 images: eight, five, four" in text
    assert "test   3 classes, 6 images: nine, one, seven" in text
    assert f"glyph_resnet: {n_params / 1e3:.1f} k parameters, 4-d embedding, input [1, 12, 10]" in text
    gem = create_model("glyph_resnet", widths=(8,), depths=(1,), embedding_dim=4, pool="gem")
    assert "4-d embedding, gem pooling, input [1, 12, 10]" in format_run_summary(
        cfg, train_set=tr, eval_sets={"query": te}, model=gem, embedding_dim=4, input_shape=(1, 12, 10), device="cpu",
        threads=2, steps_per_epoch=5, total_epochs=3, total_steps=15, out_dir=tmp_path / "run")
    assert "1 x heated_softmax(alpha=16)" in text and "5 steps/epoch x 3 epochs = 15 steps" in text
    one = format_run_summary(cfg, train_set=tr, eval_sets={"query": te}, model=model, embedding_dim=4,
                             input_shape=(1, 12, 10), device="cpu", threads=2, steps_per_epoch=1, total_epochs=1,
                             total_steps=1, out_dir=tmp_path / "run")
    assert "1 step/epoch x 1 epoch = 1 step" in one  # was '1 steps/epoch x 1 epochs'
    assert "device   cpu, 2 threads, 0 loader workers" in text
    assert "optim    sgd, lr 0.01, weight decay 0" in text and " x" not in text.split("optim")[1].split("\n")[0]
    tuned = _cfg(optim={"name": "adamw", "lr": 6e-4, "weight_decay": 1e-4, "new_layer_lr_mult": 10.0,
                        "loss_lr_mult": 100.0, "layer_decay": 0.7})
    line = [x for x in format_run_summary(tuned, train_set=tr, eval_sets={"query": te}, model=model, embedding_dim=4,
                                          input_shape=(1, 12, 10), device="cpu").splitlines() if "optim" in x][0]
    # every factor of a parameter group's lr is in the banner (the proxy-lr runs differed only there)
    assert line.strip() == ("optim    adamw, lr 0.0006, weight decay 0.0001, new layers x10, loss parameters x100, "
                            "layer decay 0.7")
    assert "warning" not in format_run_end(metrics={"recall@1": 0.9}, best={"metric": "recall@1", "value": 0.9, "epoch": 1},
                                           seconds=1, epochs=1, steps=1, out_dir=tmp_path,
                                           baselines={"epoch0": {"label": "epoch 0", "metrics": {"recall@1": 0.5}}})
    assert describe_split(tr, max_names=2) == "3 classes, 6 images: eight, five, ... (+1 more)"


def test_run_end_lists_metrics_time_paths_and_baselines(tmp_path):
    (tmp_path / "last.pt").write_bytes(b"x")
    (tmp_path / "log.jsonl").write_text("")
    text = format_run_end(metrics={"recall@1": 0.855, "nmi": 0.5}, best={"metric": "recall@1", "value": 0.86, "epoch": 4},
                          seconds=12.34, epochs=5, steps=75, out_dir=tmp_path,
                          baselines={"raw_pixels": {"label": "raw pixels", "metrics": {"recall@1": 0.96}}})
    assert "done: 5 epochs, 75 steps in 12.3 s" in text
    assert "final    recall@1 85.5%, nmi 0.500" in text
    assert "best     validation recall@1 86.0% at epoch 4 (best.pt)" in text
    assert "(test, best.pt)" not in text  # best.pt's test metrics unknown: no line
    with_test = format_run_end(metrics={"recall@1": 0.855}, seconds=1, epochs=5, steps=75, out_dir=tmp_path,
                               best={"metric": "recall@1", "value": 0.86, "epoch": 4, "test": {"recall@1": 0.84}})
    assert "best     recall@1 84.0% (test, best.pt)" in with_test
    assert "baseline raw pixels: recall@1 96.0%" in text
    assert "warning: the trained embedding (recall@1 85.5%) is below the baseline of raw pixels" in text
    assert f"checkpoint {tmp_path / 'last.pt'}" in text and f"log       {tmp_path / 'log.jsonl'}" in text
    assert "best ckpt" not in text and f"deepmetric report {tmp_path}" in text


def test_every_recipe_passes_the_config_checks():
    """The option and metric checks accept every shipped recipe (no false alarms)."""
    from pathlib import Path

    from deepmetric.run.config_io import load_config
    from deepmetric.run.config_checks import check_config

    recipes = sorted((Path(__file__).resolve().parents[2] / "recipes").rglob("*.yaml"))
    assert len(recipes) > 100
    for p in recipes:
        check_config(load_config(p))


@pytest.mark.parametrize("options, input_, warned", [
    ({"norm": "l2"}, "embedding", "l2-normalised"),
    ({"norm": "bn"}, "embedding", "BN^ / sqrt(k)"),
    ({"norm": "none"}, "embedding", None),
    ({"norm": "bn", "bn_divide_sqrt_k": False}, "embedding", None),
    ({"norm": "none", "projection": {"dim": 8, "norm": "bn"}}, "projection", "BN^ / sqrt(k)"),
    ({"norm": "none", "projection": {"dim": 8, "norm": "bn", "bn_divide_sqrt_k": False}}, "projection", None),
])
def test_almn_on_a_unit_length_input_is_warned(options, input_, warned):
    """ALMN's logits have no temperature: a warning names the term and the fix when its input is
    about 1 long; the heated softmax on the same input (it has alpha) is not warned."""
    from deepmetric.models import create_model

    model = create_model("glyph_resnet", embedding_dim=16, in_chans=1, widths=[8, 32], depths=[1, 1], **options)
    for name, expect in (("almn", warned), ("heated_softmax", None)):
        cfg = _cfg(loss=[{"name": name, "input": input_}], model={"name": "glyph_resnet", "options": options})
        w = short_input_warnings(cfg, model)
        if expect is None:
            assert w == [], (name, options)
        else:
            assert len(w) == 1 and w[0].startswith(f"loss.0 (almn) reads '{input_}', which is {expect}"), w
            fix = "bn_divide_sqrt_k: false" if input_ == "projection" else "model.options.norm: none"
            assert fix in w[0]


def test_an_unknown_option_set_to_null_says_null_does_not_remove_it():
    """Switching a recipe's model by override kept its model options; freeze_stages=null to drop
    one was refused as an unknown option with nothing on how to drop it."""
    with pytest.raises(ConfigError, match=r"^config key 'model.options.freeze_stages': unknown option 'freeze_stages' "
                                          r"for model 'glyph_resnet'.*; model.options.freeze_stages=null sets the "
                                          r"option to null, it does not remove it: .*'model.options=\{...\}'"):
        check_config_options(_cfg(model={"name": "glyph_resnet", "options": {"freeze_stages": None}}))
    with pytest.raises(ConfigError) as err:  # a value: the plain message
        check_config_options(_cfg(model={"name": "glyph_resnet", "options": {"freeze_stages": 2}}))
    assert "null" not in str(err.value)


def test_a_vit_input_that_is_not_a_multiple_of_its_patch_is_warned_about():
    """timm builds a ViT for img_size 100 with 16 px patches and runs it: the patch grid covers
    96x96 and the last 4 pixel rows and columns of every image were dropped without a word."""
    from deepmetric.models import create_model

    vit = "timm/vit_tiny_patch16_224"
    cfg = _cfg(model={"name": vit})
    w = patch_grid_warning(cfg, create_model(vit, embedding_dim=4, img_size=[100, 96]), (3, 100, 96))
    assert w == (f"model '{vit}' cuts its 100x96 inputs into 16x16 patches: it sees only 96x96, the last 4 pixel "
                 "row(s) and 0 column(s) of every image never reach it; make the input 96x96 or 112x96 "
                 "(data.transform_options, and model.options.img_size if set)")
    assert patch_grid_warning(cfg, create_model(vit, embedding_dim=4, img_size=96), (3, 96, 96)) is None
    assert patch_grid_warning(_cfg(), create_model("glyph_resnet", embedding_dim=4), (1, 30, 30)) is None
