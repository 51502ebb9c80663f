"""The ``pml`` loss term: the same values and gradients as calling pytorch-metric-learning
directly, proxies registered and trained by the loop, clear errors."""

import pytest
import torch

pml = pytest.importorskip("pytorch_metric_learning.losses")

from deepmetric.losses import build_loss  # noqa: E402
from deepmetric.train.config import config_from_dict  # noqa: E402
from deepmetric.train.loop import build_losses, build_model, train  # noqa: E402
from deepmetric.train.optim import build_optimizer  # noqa: E402
from conftest import synthetic_config


@pytest.mark.parametrize("name", ["NormalizedSoftmaxLoss", "ProxyAnchorLoss", "MultiSimilarityLoss"])
def test_same_value_and_gradients_as_pml_at_its_defaults(name):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(24, 8, generator=g, dtype=torch.float64)
    y = torch.randint(0, 5, (24,), generator=g)
    ours = build_loss("pml", loss=name, num_classes=5, embedding_dim=8).double()
    if name == "MultiSimilarityLoss":
        ref = pml.MultiSimilarityLoss()
    else:  # the documented defaults, proxies copied from ours
        ref = getattr(pml, name)(num_classes=5, embedding_size=8).double()
        ref.load_state_dict(ours.loss.state_dict())
        assert len(list(ours.parameters())) == 1  # the proxies / class weights are ours to train
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    va, vb = ours(xa, y), ref(xb, y)
    va.backward()
    vb.backward()
    assert va.item() == pytest.approx(vb.item(), rel=1e-12) and va.item() > 0
    assert torch.allclose(xa.grad, xb.grad, rtol=1e-10, atol=1e-14)
    for pa, pb in zip(ours.parameters(), ref.parameters()):
        assert torch.allclose(pa.grad, pb.grad, rtol=1e-10, atol=1e-14)


def test_options_are_passed_and_errors_are_clear():
    ms = build_loss("pml", loss="MultiSimilarityLoss", alpha=1.0, beta=20.0)
    assert (ms.loss.alpha, ms.loss.beta, ms.loss.base) == (1.0, 20.0, 0.5)
    with pytest.raises(ValueError, match="did you mean 'ProxyAnchorLoss'"):
        build_loss("pml", loss="ProxyAnchorLos", num_classes=3, embedding_dim=4)
    with pytest.raises(ValueError, match="ProxyAnchorLoss needs num_classes"):
        build_loss("pml", loss="ProxyAnchorLoss", embedding_dim=4)
    with pytest.raises(TypeError, match="bad options.*'marginn'"):
        build_loss("pml", loss="ProxyAnchorLoss", num_classes=3, embedding_dim=4, marginn=0.1)


def test_training_loop_fills_sizes_and_trains_the_proxies(tmp_path):
    def cfg(out, **optim):
        return config_from_dict(synthetic_config(out, loss=[{"name": "pml", "options": {"loss": "ProxyAnchorLoss"}}],
                                                 optim=optim, train={"epochs": 1},
                                                 eval={"every": 0, "metrics": ["recall"], "ks": [1]}))

    (loss,) = build_losses(cfg(tmp_path), num_classes=6, embedding_dim=8)
    assert tuple(loss.loss.proxies.shape) == (6, 8)
    opt = build_optimizer(build_model(cfg(tmp_path)), torch.nn.ModuleList([loss]), cfg(tmp_path).optim)
    assert any("loss.0.loss.proxies" in g["param_names"] for g in opt.param_groups)
    # Same seed, same initial proxies: frozen (loss lr 0) they stay, trained they move.
    train(cfg(tmp_path / "frozen", loss_lr_mult=0.0))
    train(cfg(tmp_path / "trained"))
    frozen = torch.load(tmp_path / "frozen" / "last.pt", weights_only=True)
    trained = torch.load(tmp_path / "trained" / "last.pt", weights_only=True)
    init = frozen["loss"][0]["loss.proxies"]
    assert trained["loss"][0]["loss.proxies"].shape == (6, 8)
    assert not torch.allclose(trained["loss"][0]["loss.proxies"], init)
    # the frozen run's proxies are the initial ones: rebuild them with the loop's seeding
    from deepmetric.train.loop import seed_everything

    seed_everything(0)
    build_model(cfg(tmp_path), num_classes=6)
    assert torch.equal(build_losses(cfg(tmp_path), num_classes=6, embedding_dim=8)[0].loss.proxies.detach(), init)
