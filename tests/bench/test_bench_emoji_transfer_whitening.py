"""bench/emoji_transfer_whitening.py: the shrunk PCA whitening, against its closed form."""
import importlib.util
from pathlib import Path

import numpy as np
import pytest

SPEC = importlib.util.spec_from_file_location(
    "emoji_transfer_whitening", Path(__file__).resolve().parents[2] / "bench" / "emoji_transfer_whitening.py")
whiten = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(whiten)


def _data(n=400, d=6, seed=0):
    rng = np.random.default_rng(seed)
    a = rng.normal(size=(d, d)) * np.linspace(0.2, 3.0, d)  # correlated, unequal variances
    return rng.normal(size=(n, d)) @ a + rng.normal(size=d)


def test_without_shrinkage_the_whitened_training_data_has_identity_covariance():
    x = _data()
    mean, w = whiten.whitening(x, 0.0)
    z = (x - mean) @ w
    np.testing.assert_allclose(mean, x.mean(0), atol=1e-12)
    np.testing.assert_allclose(z.T @ z / len(z), np.eye(x.shape[1]), atol=1e-8)  # biased covariance, as sklearn
    np.testing.assert_allclose(w, w.T, atol=1e-10)  # the symmetric inverse square root (ZCA)


@pytest.mark.parametrize("s", [0.1, 0.3, 1.0])
def test_shrinkage_whitens_the_shrunk_covariance(s):
    x = _data(seed=1)
    mean, w = whiten.whitening(x, s)
    c = np.cov(x, rowvar=False, bias=True)
    d = c.shape[0]
    shrunk = (1 - s) * c + s * np.trace(c) / d * np.eye(d)  # by hand
    np.testing.assert_allclose(w @ shrunk @ w, np.eye(d), atol=1e-8)
    if s == 1.0:  # full shrinkage: one isotropic scale
        np.testing.assert_allclose(w, np.eye(d) / np.sqrt(np.trace(c) / d), atol=1e-10)


def test_l2n_rows_have_unit_norm_and_zero_rows_stay_finite():
    x = np.array([[3.0, 4.0], [0.0, 0.0]])
    y = whiten.l2n(x)
    np.testing.assert_allclose(y[0], [0.6, 0.8])
    assert np.all(np.isfinite(y[1]))
