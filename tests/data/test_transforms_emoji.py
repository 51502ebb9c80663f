"""The emoji transform's style augmentation (hue jitter and rotation, grayscale, posterize, blur,
random resized crop, random background), each against an independent computation on synthetic
images; the defaults leave the transform as it was; determinism under the loader's per-sample
seeding; 128 px inputs through the transform and the model."""
import colorsys

import numpy as np
import pytest
import torch
from scipy import ndimage
from torchvision.transforms import v2

from deepmetric.data import RandomBatchSampler
from deepmetric.data.emoji_transform import white_background_mask
from deepmetric.data.transforms import build_transform
from deepmetric.train.batches import make_train_loader

ALL_STYLE = dict(hue=0.05, hue_rotate_p=0.5, grayscale_p=0.3, posterize_bits=4, posterize_p=0.3, blur_p=0.3,
                 crop_scale=(0.6, 1.0), background_p=0.5)


def _only(**style):
    """The emoji training transform with the old augmentation off (identity affine, no jitter),
    no normalisation, and ``style`` on."""
    return build_transform("emoji", True, degrees=0.0, translate=0.0, scale=(1.0, 1.0), brightness=0.0,
                           contrast=0.0, saturation=0.0, normalize="none", **style)


def _colourful(rng, size=32):
    """uint8 [3, size, size] of saturated colours (hue well defined everywhere)."""
    hsv = np.stack([rng.random((size, size)), rng.uniform(0.5, 1.0, (size, size)), rng.uniform(0.4, 1.0, (size, size))])
    rgb = np.apply_along_axis(lambda p: colorsys.hsv_to_rgb(*p), 0, hsv)
    return torch.from_numpy(np.round(rgb * 255).astype(np.uint8))


def _hsv(img: torch.Tensor) -> np.ndarray:
    """[3, H, W] float in [0, 1] -> [3, H, W] HSV with Python's colorsys (the reference)."""
    return np.apply_along_axis(lambda p: colorsys.rgb_to_hsv(*p), 0, img.double().numpy())


def _hue_shift(a: torch.Tensor, b: torch.Tensor) -> np.ndarray:
    """Per pixel hue(b) - hue(a), wrapped to [-0.5, 0.5)."""
    d = _hsv(b)[0] - _hsv(a)[0]
    return (d + 0.5) % 1.0 - 0.5


def _drawing_on_white(size=64):
    """White canvas, a red disk of radius 20 around the centre with an enclosed white hole of
    radius 5 (an eye), and a blue bar touching nothing.  Returns (uint8 image, background mask)."""
    yy, xx = np.mgrid[:size, :size]
    r = np.hypot(yy - size / 2 + 0.5, xx - size / 2 + 0.5)
    img = np.full((size, size, 3), 255, np.uint8)
    img[r <= 20] = (200, 30, 40)
    img[r <= 5] = 255
    img[4:8, 4:30] = (20, 40, 220)
    background = (r > 20) & ~((yy >= 4) & (yy < 8) & (xx >= 4) & (xx < 30))
    return torch.from_numpy(img).permute(2, 0, 1).contiguous(), torch.from_numpy(background)


def test_defaults_leave_the_transform_unchanged(rng):
    """Today's pipeline, written out: every new option at its default (or off) gives the same
    images for the same random stream, in training and test mode."""
    old_train = v2.Compose([v2.ToImage(), v2.RGB(), v2.ToDtype(torch.float32, scale=True),
                            v2.Resize((96, 96), antialias=True),
                            v2.RandomAffine(degrees=8.0, translate=(0.06, 0.06), scale=(0.85, 1.1),
                                            interpolation=v2.InterpolationMode.BILINEAR, fill=1.0),
                            v2.ColorJitter(brightness=0.15, contrast=0.15, saturation=0.15),
                            v2.Lambda(lambda t: t.clamp(0.0, 1.0)), v2.Normalize([0.5] * 3, [0.5] * 3)])
    x = torch.from_numpy(rng.integers(0, 256, (3, 64, 64), dtype=np.uint8))
    off = dict(hue=0.0, hue_rotate_p=0.0, grayscale_p=0.0, posterize_p=0.0, blur_p=0.0, crop_scale=None,
               background_p=0.0)
    for t in (build_transform("emoji", True, size=96, normalize="minus_one_one"),
              build_transform("emoji", True, size=96, normalize="minus_one_one", **off)):
        for seed in range(5):
            torch.manual_seed(seed)
            want = old_train(x)
            torch.manual_seed(seed)
            assert torch.equal(t(x), want)
    # the test transform has no augmentation, style options or not
    test = build_transform("emoji", False, size=96, normalize="minus_one_one", **ALL_STYLE)
    assert torch.equal(test(x), build_transform("emoji", False, size=96, normalize="minus_one_one")(x))
    assert [type(s) for s in test.transforms] == [v2.ToImage, v2.RGB, v2.ToDtype, v2.Resize, v2.Normalize]


def test_grayscale_is_the_itu_r_601_luma():
    x = _colourful(np.random.default_rng(1))
    y = _only(grayscale_p=1.0)(x)
    r, g, b = (x.double() / 255).unbind(0)
    luma = 0.299 * r + 0.587 * g + 0.114 * b
    assert y.shape == (3, 32, 32)
    for c in range(3):  # torchvision weighs red 0.2989, not 0.299: at most 1e-4, under 1/255
        np.testing.assert_allclose(y[c].double().numpy(), luma.numpy(), atol=1.01e-4)
    t = _only(grayscale_p=0.3)
    torch.manual_seed(0)
    grey = sum(bool(torch.equal(o[0], o[1]) and torch.equal(o[1], o[2])) for o in (t(x) for _ in range(400)))
    assert abs(grey / 400 - 0.3) < 4 * (0.3 * 0.7 / 400) ** 0.5  # binomial, 4 standard deviations


def test_posterize_is_bit_masking_of_the_8_bit_values():
    x = torch.from_numpy(np.random.default_rng(2).integers(0, 256, (3, 32, 32), dtype=np.uint8))
    for bits in (1, 3, 6):
        y = _only(posterize_bits=bits, posterize_p=1.0)(x)
        mask = (0xFF << (8 - bits)) & 0xFF
        assert torch.equal(torch.round(y * 255).to(torch.uint8), x & mask)
    with pytest.raises(ValueError, match="posterize_bits must be an int in 1..8"):
        _only(posterize_bits=0, posterize_p=1.0)


def test_hue_rotation_shifts_every_hue_by_one_uniform_angle():
    x = _colourful(np.random.default_rng(3), size=12)
    xf = x.float() / 255
    t = _only(hue_rotate_p=1.0)
    shifts = []
    for seed in range(60):
        torch.manual_seed(seed)
        y = t(x)
        d = _hue_shift(xf, y)
        # one angle for the whole image (mod the circle), saturation and value kept
        spread = np.abs((d - d.flat[0] + 0.5) % 1.0 - 0.5)
        assert spread.max() < 0.01
        np.testing.assert_allclose(_hsv(y)[1:], _hsv(xf)[1:], atol=0.01)
        shifts.append(float(np.median(d)))
    shifts = np.array(shifts)
    assert shifts.min() < -0.35 and shifts.max() > 0.35 and np.abs(shifts).min() < 0.15  # the whole circle
    # the colour jitter's hue: small shifts, at most `hue` of the circle
    small = []
    for seed in range(40):
        torch.manual_seed(seed)
        small.append(float(np.median(_hue_shift(xf, _only(hue=0.05)(x)))))
    assert max(map(abs, small)) <= 0.05 + 0.01 and np.std(small) > 0.01


def test_blur_is_the_sampled_gaussian_with_mirrored_border():
    x = torch.from_numpy(np.random.default_rng(4).integers(0, 256, (3, 24, 24), dtype=np.uint8))
    sigma = 0.8
    y = _only(blur_p=1.0, blur_sigma=(sigma, sigma), blur_kernel=5)(x)
    for c in range(3):  # scipy's 'mirror' (d c b | a b c d) is torch's 'reflect' padding
        want = ndimage.gaussian_filter(x[c].double().numpy() / 255, sigma, mode="mirror", radius=2)
        np.testing.assert_allclose(y[c].double().numpy(), want, atol=1e-6)


def test_random_resized_crop_takes_a_box_of_the_given_area_and_aspect():
    size = 64
    yy, xx = torch.meshgrid(torch.arange(size), torch.arange(size), indexing="ij")
    coords = torch.stack([4 * xx, 4 * yy, torch.zeros_like(xx)]).to(torch.uint8)  # red = 4 x column, green = 4 x row
    t = _only(crop_scale=(0.3, 0.6), crop_ratio=(3 / 4, 4 / 3))
    areas = []
    for seed in range(40):
        torch.manual_seed(seed)
        y = t(coords) * 255 / 4
        assert y.shape == (3, size, size)
        # bilinear enlargement clamps at the box's edge pixels: the corners give the box exactly
        x0, x1 = float(y[0, 0, 0]), float(y[0, 0, -1])
        y0, y1 = float(y[1, 0, 0]), float(y[1, -1, 0])
        w, h = round(x1 - x0) + 1, round(y1 - y0) + 1
        assert 0 <= x0 and x0 + w <= size and 0 <= y0 and y0 + h <= size
        area = w * h / size ** 2
        assert 0.3 - (w + h) / size ** 2 <= area <= 0.6 + (w + h) / size ** 2  # up to rounding w and h
        assert 3 / 4 - 1 / min(w, h) <= w / h <= 4 / 3 + 1 / min(w, h)
        areas.append(area)
    assert max(areas) - min(areas) > 0.15


def test_random_background_replaces_the_white_background_only():
    x, background = _drawing_on_white()
    xf = x.float() / 255
    assert torch.equal(white_background_mask(xf), background)  # the enclosed hole is not background
    t = _only(background_p=1.0)
    colours = []
    for seed in range(20):
        torch.manual_seed(seed)
        y = t(x)
        assert torch.allclose(y[:, ~background], xf[:, ~background], atol=1e-6)  # drawing and hole intact
        bg = y[:, background]
        colour = bg[:, 0]
        assert torch.equal(bg, colour[:, None].expand_as(bg))  # one uniform colour
        colours.append(colour)
    colours = torch.stack(colours)
    assert colours.min() < 0.1 and colours.max() > 0.9 and (colours < 0.94).any(dim=1).all()  # not white
    torch.manual_seed(0)
    t = _only(background_p=0.5)
    changed = sum(not torch.equal(t(x), _only()(x)) for _ in range(300))
    assert abs(changed / 300 - 0.5) < 4 * (0.25 / 300) ** 0.5


class _Artwork(torch.utils.data.Dataset):
    """Drawings on white (uint8 [3, 64, 64]) through a transform, like EmojiDataset."""

    def __init__(self, n, transform):
        x, _ = _drawing_on_white()
        rng = np.random.default_rng(0)
        self.images = [torch.roll(x, (int(rng.integers(-8, 9)), int(rng.integers(-8, 9))), dims=(1, 2)) for _ in range(n)]
        self.labels = np.arange(n) % 4
        self.transform = transform

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        return self.transform(self.images[i]), int(self.labels[i])


def test_style_augmentation_is_determined_by_the_sample_position():
    ds = _Artwork(24, build_transform("emoji", True, normalize="minus_one_one", **ALL_STYLE))
    sampler = RandomBatchSampler(len(ds), 6, seed=1)

    def batches(epoch, start, workers):
        sampler.set_epoch(epoch)
        if start:
            sampler.load_state_dict(sampler.state_dict(batches_done=start))
        return [x for x, _ in make_train_loader(ds, sampler, epoch=epoch, start=start, run_seed=3, num_workers=workers)]

    full = batches(2, 0, 0)
    assert len(full) == 4
    assert all(torch.equal(a, b) for a, b in zip(full, batches(2, 0, 2)))  # two workers, same images
    assert all(torch.equal(a, b) for a, b in zip(full[1:], batches(2, 1, 2)))  # resumed after one batch
    assert not torch.equal(full[0], batches(3, 0, 0)[0])  # another epoch, other augmentations


def test_128_px_through_the_emoji_transform_and_the_model():
    from deepmetric.models import create_model

    x = torch.from_numpy(np.random.default_rng(5).integers(0, 256, (3, 64, 64), dtype=np.uint8))
    t = build_transform("emoji", True, size=128, normalize="minus_one_one", **ALL_STYLE)
    torch.manual_seed(0)
    batch = torch.stack([t(x) for _ in range(2)])
    assert batch.shape == (2, 3, 128, 128) and batch.min() >= -1 and batch.max() <= 1
    model = create_model("efficientnet_lite0", embedding_dim=16, freeze_stages=5)
    model.train()
    assert model.forward_features(batch).shape == (2, 1280, 4, 4)  # stride 32
    out = model(batch)
    out["embedding"].pow(2).sum().backward()  # a training step's backward at 128 px
    assert out["embedding"].shape == (2, 16)
    assert model.backbone.blocks[6][0].conv_pw.weight.grad is not None


def test_a_128_px_emoji_run_with_style_augmentation(tmp_path):
    """A one-epoch run on a miniature emoji tree at 128 px with every style option."""
    from deepmetric.run.config_io import config_from_dict
    from deepmetric.train.loop import train
    from test_data_emoji import make_tree

    make_tree(tmp_path / "root")
    raw = {"data": {"name": "emoji", "root": str(tmp_path / "root"), "options": {"size": 128}, "transform": "emoji",
                    "transform_options": {"normalize": "minus_one_one", **ALL_STYLE}},
           "model": {"name": "efficientnet_lite0", "options": {"embedding_dim": 16, "freeze_stages": 5}},
           "loss": [{"name": "heated_softmax", "options": {"alpha": 16.0}}],
           "optim": {"lr": 0.01, "layer_decay": 0.7},
           "train": {"epochs": 1, "batch_size": 4, "progress": False, "out_dir": str(tmp_path / "run"),
                     "warmup_epochs": 0},
           "eval": {"every": 0, "baselines": False, "ks": [1]}}
    res = train(config_from_dict(raw))
    assert res.iteration > 0 and 0.0 <= res.metrics["recall@1"] <= 1.0
