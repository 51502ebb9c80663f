"""``loss.init: class_means`` (heated-up official code for SOP): the classifier starts from the
l2-normalised class means of the training embeddings, as the loss sees them in training."""
import numpy as np
import pytest
import torch
from torch import nn

from deepmetric.data.synthetic import build_synthetic_dataset
from deepmetric.losses import HeatedSoftmaxLoss
from deepmetric.models.heads import EmbeddingHead
from deepmetric.run.checkpoint import load_checkpoint
from deepmetric.run.config_io import config_from_dict
from deepmetric.train.loop import train
from deepmetric.train.module import init_from_class_means
from conftest import synthetic_config


class BNNet(nn.Module):
    """Linear + ReLU + dropout, then the paper's shift-only BN head (/ sqrt(k))."""

    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.5))
        self.head = EmbeddingHead(32, 8, norm="bn")

    def forward(self, x):
        return {"embedding": self.head(self.backbone(x))}


def _normalised_class_means(z, y, num_classes):
    means = np.stack([z[y == c].mean(0) for c in range(num_classes)])
    return means / np.linalg.norm(means, axis=1, keepdims=True)


def test_class_means_use_batch_statistics_and_restore_buffers():
    torch.manual_seed(0)
    ds = build_synthetic_dataset("train", num_classes=6, per_class=16, dim=16, seed=3)
    model, loss = BNNet(), HeatedSoftmaxLoss(6, 8)
    before = {k: v.clone() for k, v in model.named_buffers()}
    # one batch holds the whole split, so train-mode BN = standardising over all samples
    init_from_class_means(model, loss, ds, device=torch.device("cpu"), batch_size=len(ds))

    x = torch.stack([ds[i][0] for i in range(len(ds))]).double()
    y = np.asarray(ds.labels)
    lin, bn = model.head.proj, model.head.bn
    h = torch.relu(x @ model.backbone[0].weight.double().T + model.backbone[0].bias.double())  # no dropout
    p = h @ lin.weight.double().T + lin.bias.double()
    z = (p - p.mean(0)) / torch.sqrt(p.var(0, unbiased=False) + bn.eps) + bn.bias.double()
    z = z / np.sqrt(8)
    ref = _normalised_class_means(z.detach().numpy(), y, 6)
    np.testing.assert_allclose(loss.weight.detach().numpy(), ref, atol=1e-5)
    for k, v in model.named_buffers():  # running statistics untouched
        assert torch.equal(v, before[k]), k
    assert model.training  # mode restored (it was training)


def test_init_needs_a_classifier_loss():
    from deepmetric.losses import TripletLoss

    ds = build_synthetic_dataset("train", num_classes=3, per_class=4, dim=16)
    with pytest.raises(ValueError, match="loss.init"):
        init_from_class_means(BNNet(), TripletLoss(), ds, device=torch.device("cpu"))


def test_training_loop_applies_class_mean_init(tmp_path):
    raw = synthetic_config(tmp_path, loss=[{"name": "heated_softmax", "options": {"alpha": 16.0}, "init": "class_means"}],
                           optim={"lr": 0.0, "momentum": 0.0},  # lr 0: the weights stay at their init
                           train={"epochs": 1})
    train(config_from_dict(raw))
    state = load_checkpoint(tmp_path / "last.pt")
    from deepmetric.data.synthetic import SyntheticMLP

    model = SyntheticMLP(in_dim=16, hidden=32, embedding_dim=8)
    model.load_state_dict(state["model"])
    ds = build_synthetic_dataset("train", num_classes=6, per_class=16, dim=16, seed=5)
    with torch.no_grad():
        z = model(torch.stack([ds[i][0] for i in range(len(ds))]))["embedding"].numpy()
    ref = _normalised_class_means(z.astype(np.float64), np.asarray(ds.labels), 6)
    np.testing.assert_allclose(state["loss"][0]["weight"].numpy(), ref, atol=1e-5)


def test_config_rejects_unknown_init():
    from deepmetric.run.config import ConfigError

    with pytest.raises(ConfigError, match="loss.0.init"):
        config_from_dict({"loss": [{"name": "heated_softmax", "init": "class_mean"}], "train": {"epochs": 1}})
