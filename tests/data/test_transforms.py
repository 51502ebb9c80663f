"""Transforms: output shapes / ranges, exact crops checked against numpy slicing, the
normalisation constants, and stroke-width morphology against a brute-force neighbourhood max."""
import numpy as np
import pytest
import torch
from PIL import Image

from deepmetric.data.transforms import StrokeWidth, build_transform, list_transforms

MEAN = np.array([0.485, 0.456, 0.406])
STD = np.array([0.229, 0.224, 0.225])


def _rgb(rng, h, w):
    return rng.integers(0, 256, (h, w, 3), dtype=np.uint8)


def test_names():
    assert list_transforms() == ["emoji", "glyph", "mnist", "resize_crop", "short_side", "sod", "timm"]
    with pytest.raises(ValueError, match="unknown transform 'nope'"):
        build_transform("nope", True)
    with pytest.raises(TypeError, match="unknown option"):
        build_transform("resize_crop", True, crops=3)
    with pytest.raises(TypeError, match="train must be a bool"):
        build_transform("glyph", "yes")
    with pytest.raises(ValueError, match="normalize"):
        build_transform("glyph", False, normalize="zscore")


@pytest.mark.parametrize("name", ["resize_crop", "short_side"])
@pytest.mark.parametrize("train", [True, False])
def test_image_pipelines_shapes(rng, name, train):
    for h, w in ((300, 400), (520, 260), (224, 224)):
        arr = _rgb(rng, h, w)
        for inp in (Image.fromarray(arr), torch.from_numpy(arr).permute(2, 0, 1).contiguous()):
            x = build_transform(name, train)(inp)
            assert x.shape == (3, 224, 224) and x.dtype == torch.float32
            lo, hi = (0 - MEAN) / STD, (1 - MEAN) / STD
            for c in range(3):
                assert lo[c] - 1e-5 <= x[c].min() and x[c].max() <= hi[c] + 1e-5
    gray = Image.fromarray(rng.integers(0, 256, (260, 300), dtype=np.uint8))
    assert build_transform(name, train)(gray).shape == (3, 224, 224)  # grayscale JPEGs become RGB


def test_resize_crop_centre_crop_exact(rng):
    arr = _rgb(rng, 256, 256)  # already 256x256: the resize is the identity
    x = build_transform("resize_crop", False, normalize="none")(Image.fromarray(arr))
    ref = arr[16:240, 16:240].transpose(2, 0, 1) / 255.0
    np.testing.assert_allclose(x.numpy(), ref, atol=1e-6)
    x = build_transform("resize_crop", False)(Image.fromarray(arr))  # ImageNet normalisation
    np.testing.assert_allclose(x.numpy(), (ref - MEAN[:, None, None]) / STD[:, None, None], atol=1e-5)
    x = build_transform("resize_crop", False, normalize="minus_one_one")(Image.fromarray(arr))
    np.testing.assert_allclose(x.numpy(), ref * 2 - 1, atol=1e-6)
    # ALMN: 227 crops from 256x256
    assert build_transform("resize_crop", True, crop=227)(Image.fromarray(arr)).shape == (3, 227, 227)


def test_resize_crop_train_is_a_window_or_its_mirror(rng):
    arr = _rgb(rng, 64, 64)  # small sizes keep the exhaustive window search fast
    t = build_transform("resize_crop", True, resize=64, crop=48, normalize="none")
    flipped = 0
    torch.manual_seed(0)
    for _ in range(12):
        x = (t(Image.fromarray(arr)).numpy() * 255).round().astype(np.uint8).transpose(1, 2, 0)
        plain = [(i, j) for i in range(17) for j in range(17) if np.array_equal(arr[i:i + 48, j:j + 48], x)]
        mirror = [(i, j) for i in range(17) for j in range(17)
                  if np.array_equal(arr[i:i + 48, j:j + 48][:, ::-1], x)]
        assert plain or mirror
        flipped += bool(mirror)
    assert 0 < flipped < 12  # flips happen, but not always


def test_short_side_test_exact(rng):
    arr = _rgb(rng, 350, 700)  # short side already 350: no resize, centre 224 crop
    x = build_transform("short_side", False, normalize="none")(Image.fromarray(arr))
    ref = arr[63:287, 238:462].transpose(2, 0, 1) / 255.0
    np.testing.assert_allclose(x.numpy(), ref, atol=1e-6)


def test_short_side_train_keeps_aspect(rng):
    arr = _rgb(rng, 100, 300)
    # short side forced to 100: no resize, so a random 100x100 crop must be a window of the image
    t = build_transform("short_side", True, min_size=100, max_size=100, crop=100, flip=False, normalize="none")
    x = (t(Image.fromarray(arr)).numpy() * 255).round().astype(np.uint8).transpose(1, 2, 0)
    assert any(np.array_equal(arr[:, j:j + 100], x) for j in range(201))
    # random short side in [min, max]: the crop-free output size reveals it
    t = build_transform("short_side", True, min_size=120, max_size=130, crop=120, flip=False)
    sizes = set()
    torch.manual_seed(0)
    for step in t.transforms:
        if type(step).__name__ == "RandomResize":
            for _ in range(200):
                sizes.add(min(step(torch.zeros(3, 100, 300, dtype=torch.uint8)).shape[-2:]))
    assert sizes and min(sizes) >= 120 and max(sizes) <= 130 and len(sizes) > 5
    with pytest.raises(ValueError, match="crop <= min_size"):
        build_transform("short_side", True, min_size=200, crop=224)


def _brute_morph(a, r, op):
    h, w = a.shape
    out = np.empty_like(a)
    for i in range(h):
        for j in range(w):
            win = a[max(0, i - r):i + r + 1, max(0, j - r):j + r + 1]
            out[i, j] = op(win)
    return out


def test_stroke_width_morphology_matches_brute_force(rng):
    a = rng.random((13, 11)).astype(np.float32)
    for r in (1, 2):
        dil = StrokeWidth.morph(torch.from_numpy(a)[None], r)[0].numpy()
        ero = StrokeWidth.morph(torch.from_numpy(a)[None], -r)[0].numpy()
        np.testing.assert_allclose(dil, _brute_morph(a, r, np.max))
        np.testing.assert_allclose(ero, _brute_morph(a, r, np.min))
    assert torch.equal(StrokeWidth.morph(torch.from_numpy(a), 0), torch.from_numpy(a))


def _stroke():
    g = torch.zeros(1, 32, 32, dtype=torch.uint8)
    g[0, 6:26, 14:18] = 255
    g[0, 14:17, 6:26] = 255
    return g


def test_glyph_and_mnist_pipelines():
    g = _stroke()
    test_t = build_transform("glyph", False)
    x = test_t(g)
    assert x.shape == (1, 32, 32)
    np.testing.assert_allclose(x.numpy(), g.numpy() / 255.0 * 2 - 1, atol=1e-6)
    train_t = build_transform("glyph", True)
    torch.manual_seed(0)
    outs = [train_t(g) for _ in range(8)]
    for y in outs:
        assert y.shape == (1, 32, 32) and y.min() >= -1 and y.max() <= 1
        assert not torch.equal(y, x)  # noise alone changes every image
    torch.manual_seed(0)
    again = [train_t(g) for _ in range(8)]
    assert all(torch.equal(a, b) for a, b in zip(outs, again))  # seeded torch RNG -> reproducible
    # no noise/blur/stroke/affine -> identity
    ident = build_transform("glyph", True, degrees=0, translate=0, scale=(1, 1), shear=0,
                            stroke_p=0, blur_p=0, noise_sigma=0)
    np.testing.assert_allclose(ident(g).numpy(), x.numpy(), atol=1e-6)
    # stroke only: always thicker or thinner ink
    thick = build_transform("glyph", True, degrees=0, translate=0, scale=(1, 1), shear=0,
                            stroke_p=1.0, blur_p=0, noise_sigma=0, normalize="none")
    ink = {int((thick(g) > 0.5).sum()) for _ in range(20)}
    assert min(ink) < int((g > 0).sum()) < max(ink)
    rgb = build_transform("glyph", True, channels=3, normalize="imagenet")(g)
    assert rgb.shape == (3, 32, 32)
    raw = rgb.numpy() * STD[:, None, None] + MEAN[:, None, None]  # undo ImageNet per-channel stats
    np.testing.assert_allclose(raw[0], raw[2], atol=1e-5)  # the gray channel repeated
    one = build_transform("glyph", False, normalize="imagenet")(g)  # 1 channel: channel-averaged stats
    np.testing.assert_allclose(one.numpy(), (g.numpy() / 255.0 - 0.449) / 0.226, atol=1e-5)
    m = torch.from_numpy(np.arange(28 * 28, dtype=np.uint8).reshape(1, 28, 28))
    for train in (True, False):
        y = build_transform("mnist", train)(m)
        assert y.shape == (1, 28, 28) and y.min() >= -1 and y.max() <= 1
    np.testing.assert_allclose(build_transform("mnist", False, normalize="none")(m).numpy(), m.numpy() / 255.0)
    # size=: own images of any size and colour -> one grayscale size (PIL's antialiased resize as reference)
    from PIL import Image

    rgb = Image.fromarray(np.random.default_rng(0).integers(0, 255, (40, 30, 3), dtype=np.uint8))
    got = build_transform("mnist", False, normalize="none", size=20)(rgb)
    want = np.asarray(rgb.convert("L").resize((20, 20), Image.BILINEAR), dtype=np.float32) / 255
    assert got.shape == (1, 20, 20)
    np.testing.assert_allclose(got[0].numpy(), want, atol=2 / 255)


# --------------------------------------------------------------------------- batched glyph augmentation
def _glyph_batch(n=6, size=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, 1, size, size, generator=g)


def test_batched_affine_equals_torchvision_affine_per_image():
    from torchvision.transforms.v2 import functional as TF

    from deepmetric.data.transforms import _affine_batch, affine_inverse_matrices

    x = _glyph_batch(5, 32)
    params = [(3.0, (2, -1), 1.05, 4.0), (-6.0, (0, 0), 0.9, -5.5), (0.0, (1, 2), 1.0, 0.0),
              (5.9, (-2, -2), 1.1, 6.0), (1.0, (0, 1), 0.95, 1.0)]
    ref = torch.stack([TF.affine(x[i], angle=a, translate=list(t), scale=s, shear=[sh, 0.0],
                                 interpolation=TF.InterpolationMode.BILINEAR, fill=0.0)
                       for i, (a, t, s, sh) in enumerate(params)])
    col = lambda f: torch.tensor([f(p) for p in params], dtype=torch.float64)  # noqa: E731
    theta = affine_inverse_matrices(col(lambda p: p[0]), col(lambda p: p[1][0]), col(lambda p: p[1][1]),
                                    col(lambda p: p[2]), col(lambda p: p[3]), torch.zeros(5, dtype=torch.float64))
    assert torch.allclose(_affine_batch(x, theta), ref, atol=1e-6)


def test_batched_glyph_augment_parts_against_references():
    from torchvision.transforms.v2 import functional as TF

    from deepmetric.data.transforms import GlyphBatchAugment

    x = _glyph_batch()
    none = dict(degrees=0.0, translate=0.0, scale=(1.0, 1.0), shear=0.0, stroke_p=0.0, blur_p=0.0, noise_sigma=0.0)
    assert torch.allclose(GlyphBatchAugment(**none)(x), x, atol=1e-6)        # identity warp is exact
    # translation only: every image is shifted by whole pixels within +-round(0.1 * 16) = 2
    torch.manual_seed(1)
    out = GlyphBatchAugment(**{**none, "translate": 0.1})(x)
    pad = torch.nn.functional.pad(x, (2, 2, 2, 2))
    for i in range(len(x)):
        shifts = [(dx, dy) for dx in range(-2, 3) for dy in range(-2, 3)
                  if torch.allclose(out[i, 0], pad[i, 0, 2 - dy:18 - dy, 2 - dx:18 - dx], atol=1e-6)]
        assert shifts, f"image {i} is no integer shift of its input"
    # strokes always on: each image is its dilation or its erosion (StrokeWidth.morph)
    out = GlyphBatchAugment(**{**none, "stroke_p": 1.0})(x)
    kinds = [next(s for s in (1, -1) if torch.allclose(out[i], StrokeWidth.morph(x[i], s))) for i in range(len(x))]
    assert set(kinds) <= {1, -1}
    # blur always on with a fixed sigma: torchvision's gaussian_blur
    out = GlyphBatchAugment(**{**none, "blur_p": 1.0, "blur_sigma": (0.6, 0.6)})(x)
    assert torch.allclose(out, TF.gaussian_blur(x, [3, 3], [0.6, 0.6]), atol=1e-6)
    # noise: N(0, 0.05^2) on a mid-grey batch, clamped to [0, 1]
    grey = torch.full((64, 1, 16, 16), 0.5)
    d = GlyphBatchAugment(**{**none, "noise_sigma": 0.05})(grey) - 0.5
    assert abs(float(d.std()) - 0.05) < 0.003 and abs(float(d.mean())) < 0.003


def test_batched_glyph_transform_through_make_loader():
    from deepmetric.data import make_loader

    class Images(torch.utils.data.Dataset):
        def __init__(self, transform):
            self.transform = transform
            self.x = (_glyph_batch(10, 16) * 255).to(torch.uint8)

        def __len__(self):
            return 10

        def __getitem__(self, i):
            return self.transform(self.x[i]), i % 3

    t = build_transform("glyph", True, batched=True)
    assert t(torch.zeros(1, 16, 16, dtype=torch.uint8)).dtype == torch.uint8  # per image: as it is
    x, y = next(iter(make_loader(Images(t), batch_size=10, num_workers=0)))
    assert x.shape == (10, 1, 16, 16) and x.dtype == torch.float32 and -1.0 <= x.min() and x.max() <= 1.0
    assert y.tolist() == [0, 1, 2, 0, 1, 2, 0, 1, 2, 0]
    plain = next(iter(make_loader(Images(build_transform("glyph", False)), batch_size=10, num_workers=0)))[0]
    assert not torch.allclose(x, plain)  # augmented, in the same [-1, 1] scale
    x3 = build_transform("glyph", True, batched=True, channels=3).batch_transform(torch.zeros(2, 1, 16, 16,
                                                                                            dtype=torch.uint8))
    assert x3.shape == (2, 3, 16, 16)


def test_batched_glyph_augmentation_has_the_per_image_distribution():
    """Same augmentation, drawn per image by torchvision or per batch by us: the per-pixel mean
    profiles and standard deviations over 400 augmented copies of one glyph-like image agree."""
    img = torch.zeros(1, 16, 16, dtype=torch.uint8)
    img[:, 4:12, 7:9] = 255   # a vertical stroke
    img[:, 5:7, 3:13] = 255   # and a horizontal one
    torch.manual_seed(0)
    per_image = torch.stack([build_transform("glyph", True)(img) for _ in range(400)])
    t = build_transform("glyph", True, batched=True)
    batched = t.batch_transform(torch.stack([t(img)] * 400))
    # row and column profiles (sampling noise < 0.05 over seeds; translate 0.06 -> 0.12 moves them > 0.1)
    for axis in (2, 3):
        assert torch.allclose(per_image.mean((0, axis)), batched.mean((0, axis)), atol=0.07)
        assert torch.allclose(per_image.std(0).mean(axis - 1), batched.std(0).mean(axis - 1), atol=0.07)
    assert abs(float(per_image.mean() - batched.mean())) < 0.01
