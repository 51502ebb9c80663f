"""The ``pml`` loss term: the same values and gradients as calling pytorch-metric-learning
directly, proxies registered and trained by the loop, clear errors."""

import pytest
import torch

pml = pytest.importorskip("pytorch_metric_learning.losses")

from deepmetric.losses import build_loss  # noqa: E402
from deepmetric.run.config_io import config_from_dict  # noqa: E402
from deepmetric.run.builders import build_losses, build_model  # noqa: E402
from deepmetric.train.loop import train  # noqa: E402
from deepmetric.train.optim import build_optimizer  # noqa: E402
from conftest import synthetic_config  # noqa: E402


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
    from deepmetric.run.builders import seed_everything

    seed_everything(0)
    build_model(cfg(tmp_path), num_classes=6)
    assert torch.equal(build_losses(cfg(tmp_path), num_classes=6, embedding_dim=8)[0].loss.proxies.detach(), init)


# ----------------------------------------------------------------------------- every class / proxy loss
_SIZE_PARAMS = {"num_classes", "embedding_size", "descriptors_dim"}


def _class_losses():
    """Every PML loss whose constructor, or a base class its ``**kwargs`` reach, takes a class
    count or an embedding size (enumerated from the installed package, not listed by hand)."""
    from deepmetric.losses.pml import constructor_parameters, pml_loss_names

    return [n for n in pml_loss_names() if constructor_parameters(getattr(pml, n)) & _SIZE_PARAMS]


def test_constructor_parameters_follow_kwargs_through_the_mro():
    from deepmetric.losses.pml import constructor_parameters

    class Base:
        def __init__(self, num_classes, embedding_size, scale=1.0):
            pass

    class Mid(Base):
        def __init__(self, *args, margin=0.1, **kwargs):
            super().__init__(*args, **kwargs)

    class Closed(Mid):
        def __init__(self, gamma=2.0):          # no **kwargs: Mid's and Base's names stop here
            super().__init__(3, 4)

    assert constructor_parameters(Mid) == {"margin", "num_classes", "embedding_size", "scale"}
    assert constructor_parameters(Closed) == {"gamma"}
    # the two classes of the issue forward **kwargs to LargeMarginSoftmaxLoss / ArcFaceLoss
    for name in ("CosFaceLoss", "SubCenterArcFaceLoss"):
        assert {"num_classes", "embedding_size"} <= constructor_parameters(getattr(pml, name))


def test_the_class_losses_are_found():
    names = _class_losses()
    # the ones the issue and the studies name, found by the enumeration
    assert {"CosFaceLoss", "SubCenterArcFaceLoss", "ArcFaceLoss", "NormalizedSoftmaxLoss",
            "ProxyAnchorLoss", "ProxyNCALoss", "SoftTripleLoss", "P2SGradLoss"} <= set(names)


@pytest.mark.parametrize("name", _class_losses())
def test_every_class_or_proxy_loss_builds_and_trains(name):
    """Built with num_classes / embedding_dim only: the same value and gradients as PML's
    class built directly with the same sizes and weights, its weights sized by the classes,
    and a few SGD steps on embeddings and weights lower the loss."""
    from deepmetric.losses.pml import constructor_parameters

    n_cls, dim = 10, 16
    torch.manual_seed(0)
    ours = build_loss("pml", loss=name, num_classes=n_cls, embedding_dim=dim).double()
    sizes = {"num_classes": n_cls, "embedding_size": dim, "descriptors_dim": dim}
    ref = getattr(pml, name)(**{k: v for k, v in sizes.items()
                                if k in constructor_parameters(getattr(pml, name))}).double()
    ref.load_state_dict(ours.loss.state_dict())
    for p in ours.parameters():  # class weights / proxies: one axis per class (or sub-centre)
        assert dim in p.shape and any(s % n_cls == 0 for s in p.shape), (name, tuple(p.shape))
    g = torch.Generator().manual_seed(1)
    x0 = torch.randn(20, dim, generator=g, dtype=torch.float64)
    y = torch.arange(20) % n_cls
    xa, xb = x0.clone().requires_grad_(), x0.clone().requires_grad_()
    va, vb = ours(xa, y), ref(xb, y)
    va.backward()
    vb.backward()
    assert torch.isfinite(va) and va.item() == pytest.approx(vb.item(), rel=1e-9)
    assert torch.allclose(xa.grad, xb.grad, rtol=1e-8, atol=1e-12) and xa.grad.abs().sum() > 0
    for pa, pb in zip(ours.parameters(), ref.parameters()):
        assert torch.allclose(pa.grad, pb.grad, rtol=1e-8, atol=1e-12)
    # a short descent on the embeddings and the loss's own weights lowers the loss
    x = x0.clone().requires_grad_()
    opt = torch.optim.SGD([x, *ours.parameters()], lr=1e-3)
    first = None
    for _ in range(20):
        opt.zero_grad()
        v = ours(x, y)
        first = v.item() if first is None else first
        v.backward()
        opt.step()
    assert ours(x, y).item() < first
