"""Training that keeps what the pretrained backbone learnt (issue 21, item 2, the model side):
the PCA-initialised head, larger BN embeddings, the SimCLR projection head, the similarity
regulariser towards the pretrained features, WiSE-FT and frozen batch-norm statistics.

Training runs use a folder of 28-px digit images (``write_digit_folder``) and a compact
ResNet whose "pretrained" weights are a saved, seeded model file, so that the pretrained
network of a run is known exactly."""
import json

import numpy as np
import pytest

from deepmetric.run.rundir import read_log
import torch
import torch.nn.functional as F
from sklearn.decomposition import PCA

from deepmetric.data.synthetic import write_digit_folder
from deepmetric.losses import build_loss
from deepmetric.models import batchnorm_layers, create_model, model_options
from deepmetric.models.heads import EmbeddingHead
from deepmetric.train import setup as loop_module
from deepmetric.train import wise_ft as W
from deepmetric.run.builders import build_split, build_losses, build_model
from deepmetric.run.checkpoint import load_checkpoint
from deepmetric.run.config import ConfigError
from deepmetric.run.config_io import config_from_dict
from deepmetric.run.embed import compute_embeddings, embed_checkpoint, load_model_from_checkpoint
from deepmetric.train.loop import train
from deepmetric.train.module import PretrainedTeacher, TrainingModule

GLYPH = {"in_chans": 1, "widths": [8, 32], "depths": [1, 1]}


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    return write_digit_folder(tmp_path_factory.mktemp("heads") / "digits", per_class=12, seed=0)


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A glyph_resnet backbone file standing for ImageNet weights (the backbone's own keys, no
    head: the embedding head starts from its random initialisation, as on ImageNet weights)."""
    torch.manual_seed(123)
    path = tmp_path_factory.mktemp("weights") / "glyph.pt"
    torch.save(create_model("glyph_resnet", embedding_dim=8, norm="bn", **GLYPH).backbone.state_dict(), path)
    return path


def _raw(digits, pretrained, out_dir, *, options=None, loss=None, **sections):
    raw = {
        "data": {"name": "folder", "root": str(digits), "options": {"class_split": "half", "mode": "L"},
                 "transform": "mnist", "transform_options": {"size": 28, "channels": 1}},
        "model": {"name": "glyph_resnet",
                  "options": {"embedding_dim": 8, "norm": "bn", "pretrained": str(pretrained), **GLYPH,
                              **(options or {})}},
        "loss": loss or [{"name": "heated_softmax", "options": {"alpha": 16.0}}],
        "optim": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
        "train": {"epochs": 1, "batch_size": 20, "seed": 0, "out_dir": str(out_dir), "progress": False,
                  "num_threads": 1},
        "eval": {"every": 0, "ks": [1], "metrics": ["recall"], "baselines": False},
    }
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value}
    return raw


def _pretrained_model(pretrained, **options):
    return create_model("glyph_resnet", pretrained=str(pretrained), **{"embedding_dim": 8, "norm": "bn", **GLYPH,
                                                                          **options})


def _knn(x: np.ndarray, k: int) -> np.ndarray:
    x = x / np.linalg.norm(x, axis=1, keepdims=True)
    s = x @ x.T
    np.fill_diagonal(s, -np.inf)
    return np.argsort(-s, axis=1)[:, :k]


def _overlap(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.mean([len(set(p) & set(q)) / len(p) for p, q in zip(a, b)]))


# ----------------------------------------------------------------------------- PCA head
def _anisotropic(n=300, c=24, seed=0):
    g = np.random.default_rng(seed)
    scales = np.geomspace(5.0, 0.05, c)
    basis, _ = np.linalg.qr(g.standard_normal((c, c)))
    return (g.standard_normal((n, c)) * scales) @ basis.T + g.standard_normal(c) * 3


@pytest.mark.parametrize("whiten", [False, True])
def test_init_from_pca_is_sklearns_pca(whiten):
    x = _anisotropic()
    ref = PCA(n_components=6, whiten=whiten, svd_solver="full").fit(x)
    head = EmbeddingHead(24, 6, norm="none")
    stats = head.init_from_pca(torch.from_numpy(x).float(), whiten=whiten)
    w = head.proj.weight.detach().double().numpy()
    unit = w * np.sqrt(ref.explained_variance_)[:, None] if whiten else w
    signs = np.sign(np.sum(unit * ref.components_, axis=1))  # directions agree up to sign
    assert np.all(np.abs(signs) == 1)
    np.testing.assert_allclose(unit, signs[:, None] * ref.components_, atol=1e-5)
    np.testing.assert_allclose(stats["variances"].numpy(), ref.explained_variance_, rtol=1e-6)
    np.testing.assert_allclose(stats["mean"].numpy(), ref.mean_, rtol=1e-6, atol=1e-6)  # x went through float32
    # the projection is sklearn's transform (up to the same signs): centred, and whitened if asked
    with torch.no_grad():
        z = head(torch.from_numpy(x).float()).double().numpy()
    np.testing.assert_allclose(z, ref.transform(x) * signs, atol=2e-4)
    assert np.abs(z.mean(0)).max() < 1e-4


def test_init_from_pca_bn_head_statistics_and_errors():
    x = torch.from_numpy(_anisotropic()).float()
    head = EmbeddingHead(24, 6, norm="bn")
    stats = head.init_from_pca(x)
    # eval mode normalises as training mode does at this point: by the projection's own statistics
    assert torch.equal(head.bn.running_mean, torch.zeros(6))
    torch.testing.assert_close(head.bn.running_var, stats["variances"].float())
    head.train()
    with torch.no_grad():
        a = head(x)
        head.eval()
        b = head(x)
    torch.testing.assert_close(a, b, atol=2e-3, rtol=1e-2)  # batch (biased) vs running (unbiased) variance
    with pytest.raises(ValueError, match=r"a 30-d embedding needs at least 30 principal directions, but 300 "
                                         r"features of 24 dims give at most 24"):
        EmbeddingHead(24, 30, norm="bn").init_from_pca(x)
    with pytest.raises(ValueError, match="no bias"):
        EmbeddingHead(24, 6, bias=False).init_from_pca(x)


def test_head_init_pca_before_the_first_step_is_the_pca_of_the_pretrained_features(digits, pretrained, tmp_path):
    """The trainer sets the head from the pretrained model's pooled features of the training
    split (test transform, eval mode); lr 0 keeps it as initialised.  The epoch-0 embedding
    keeps the features' cosine neighbours better than the random head."""
    raw = _raw(digits, pretrained, tmp_path / "pca", options={"norm": "l2", "head_init": "pca"},
               optim={"lr": 0.0})
    cfg = config_from_dict(raw)
    train(cfg)
    head = load_checkpoint(tmp_path / "pca" / "last.pt")["model"]
    ref_model = _pretrained_model(pretrained, norm="l2")
    feats = compute_embeddings(ref_model, build_split(cfg, "train", train=False), output="features")["embeddings"]
    ref = PCA(n_components=8, svd_solver="full").fit(feats.astype(np.float64))
    w = head["head.proj.weight"].double().numpy()
    signs = np.sign(np.sum(w * ref.components_, axis=1))
    np.testing.assert_allclose(w, signs[:, None] * ref.components_, atol=1e-4)
    np.testing.assert_allclose(head["head.proj.bias"].double().numpy(), -w @ ref.mean_, atol=1e-4)

    # epoch 0: cosine neighbours of the pooled features on the (unseen) test classes
    pca_model = _pretrained_model(pretrained, norm="l2")
    pca_model.load_state_dict(head)
    test_set = build_split(cfg, "test", train=False)
    f = compute_embeddings(ref_model, test_set, output="features")["embeddings"]
    truth = _knn(f, 5)
    pca_overlap = _overlap(_knn(compute_embeddings(pca_model, test_set)["embeddings"], 5), truth)
    random_overlaps = []
    for seed in range(5):
        torch.manual_seed(seed)
        random_head = _pretrained_model(pretrained, norm="l2")
        random_head.head.proj.reset_parameters()
        random_overlaps.append(_overlap(_knn(compute_embeddings(random_head, test_set)["embeddings"], 5), truth))
    assert pca_overlap > max(random_overlaps) + 0.05, (pca_overlap, random_overlaps)


# ----------------------------------------------------------------------------- larger embeddings
@pytest.mark.parametrize("k", [512, 1280])
def test_large_bn_embeddings_train_on_efficientnet_lite(k):
    model = create_model("efficientnet_lite0", embedding_dim=k, norm="bn", freeze_stages=7)
    x = torch.randn(6, 3, 64, 64)
    out = model(x)
    assert out["embedding"].shape == (6, k) and out["features"].shape == (6, 1280)
    loss = build_loss("heated_softmax", num_classes=3, embedding_dim=k, alpha=16.0)
    value = loss(out["embedding"], torch.tensor([0, 0, 1, 1, 2, 2]))
    value.backward()
    assert torch.isfinite(value) and model.head.proj.weight.grad.abs().sum() > 0
    assert model.backbone.blocks[6][0].conv_pw.weight.grad.abs().sum() > 0
    # the PCA head needs k directions: 1280 of 1280 features are possible with enough images
    feats = torch.randn(k + 1, 1280)
    model.head.init_from_pca(feats)
    with pytest.raises(ValueError, match=f"a {k}-d embedding needs at least {k} principal directions"):
        model.head.init_from_pca(feats[:k])


# ----------------------------------------------------------------------------- projection head
def test_projection_head_output_gradient_and_what_is_indexed():
    torch.manual_seed(0)
    model = create_model("glyph_resnet", embedding_dim=16, norm="bn", projection={"dim": 6, "hidden": 32},
                         **GLYPH)
    assert model.projection_dim == 6 and model.projection.norm == "l2"
    x = torch.randn(8, 1, 28, 28)
    out = model(x)
    assert out["projection"].shape == (8, 6)
    torch.testing.assert_close(out["projection"].norm(dim=1), torch.ones(8))
    # the projection is computed from the embedding
    torch.testing.assert_close(out["projection"], model.projection(out["embedding"]))
    # the loss reads the projection; its gradient reaches the backbone through it
    loss = build_loss("heated_softmax", num_classes=4, embedding_dim=6, alpha=16.0)
    term = config_from_dict({"train": {"epochs": 1}, "loss": [{"name": "heated_softmax", "input": "projection"}]}).loss
    total, _ = TrainingModule(model, torch.nn.ModuleList([loss]), term)(x, torch.arange(8) % 4)
    total.backward()
    for name in ("backbone.stem.0.weight", "head.proj.weight", "projection.mlp.0.weight", "projection.out.proj.weight"):
        grad = dict(model.named_parameters())[name].grad
        assert grad is not None and grad.abs().sum() > 0, name
    # what retrieval indexes is the embedding before the projection
    model.eval()
    with torch.no_grad():
        emb = model(x)["embedding"]
    torch.testing.assert_close(model.forward_head(model.forward_features(x)), emb)
    ds = torch.utils.data.TensorDataset(x, torch.zeros(8, dtype=torch.long))
    np.testing.assert_allclose(compute_embeddings(model, ds)["embeddings"], emb.numpy(), atol=1e-6)


def test_projection_bn_without_the_sqrt_k_division_keeps_unit_variance_per_dimension():
    """``bn_divide_sqrt_k: false`` on the projection: each of its dims is BN^'s (x - mean) / std
    (batch statistics in training), so the rows are about sqrt(dim) long (less where a dim's
    variance is near BN's eps); the default divides by sqrt(dim).  Reference: the standardisation computed by hand from the linear layer."""
    torch.manual_seed(0)
    dim = 24
    long_ = create_model("glyph_resnet", embedding_dim=16, norm="bn",
                         projection={"dim": dim, "norm": "bn", "bn_divide_sqrt_k": False}, **GLYPH)
    torch.manual_seed(0)
    short = create_model("glyph_resnet", embedding_dim=16, norm="bn", projection={"dim": dim, "norm": "bn"}, **GLYPH)
    assert not long_.projection.out.bn_divide_sqrt_k and short.projection.out.bn_divide_sqrt_k
    assert long_.head.bn_divide_sqrt_k  # the embedding head keeps its own default
    x = torch.randn(64, 1, 28, 28)
    out_long, out_short = long_(x), short(x)
    linear = long_.projection.out.proj(out_long["embedding"]).detach()
    expected = (linear - linear.mean(0)) / (linear.var(0, unbiased=False) + long_.projection.out.bn.eps).sqrt()
    torch.testing.assert_close(out_long["projection"].detach(), expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out_short["projection"], out_long["projection"] / dim ** 0.5)


@pytest.mark.parametrize("projection, message", [
    ({"dim": 8, "norm": "bn", "bn_divide_sqrt_k": "no"}, "'bn_divide_sqrt_k' must be true or false, got 'no'"),
    ({"dim": 8, "norm": "l2", "bn_divide_sqrt_k": False}, "applies to norm 'bn' only, got norm 'l2'"),
    ({"dim": 8, "scale": 3}, "unknown key(s) ['scale']"),
])
def test_projection_options_are_checked(projection, message):
    with pytest.raises(ValueError) as info:
        create_model("glyph_resnet", embedding_dim=16, norm="bn", projection=projection, **GLYPH)
    assert message in str(info.value)


def test_projection_config_trains_and_exports_the_embedding(digits, pretrained, tmp_path):
    run = tmp_path / "proj"
    raw = _raw(digits, pretrained, run, options={"projection": {"dim": 5, "norm": "bn"}},
               loss=[{"name": "heated_softmax", "input": "projection", "options": {"alpha": 16.0}}])
    train(config_from_dict(raw))
    ckpt = load_checkpoint(run / "last.pt")
    assert ckpt["loss"][0]["weight"].shape == (5, 5)  # 5 training classes x the projection's 5 dims
    model, losses, cfg, _ = load_model_from_checkpoint(run / "last.pt")
    assert model.projection_dim == 5 and losses[0].weight.shape == (5, 5)
    out = embed_checkpoint(run / "last.pt", tmp_path / "e.npz", split="test")
    z = np.load(out)["embeddings"]
    assert z.shape[1] == 8  # the 8-d embedding, not the 5-d projection
    ref = compute_embeddings(model, build_split(cfg, "test", train=False))["embeddings"]
    np.testing.assert_allclose(z, ref, atol=1e-6)
    from deepmetric.search.export import export_model

    exported, side = export_model(run / "last.pt", tmp_path / "m.ts", "torchscript", normalize=False)
    net = torch.jit.load(str(exported))
    x = torch.stack([build_split(cfg, "test", train=False)[i][0] for i in range(3)])
    np.testing.assert_allclose(net(x).detach().numpy(), ref[:3], atol=1e-5)
    assert json.loads(side.read_text())["output"]["shape"] == ["batch", 8]


def test_projection_without_a_reader_and_a_reader_without_projection_are_refused(digits, pretrained, tmp_path):
    raw = _raw(digits, pretrained, tmp_path / "a", options={"projection": {"dim": 4}})
    with pytest.raises(ValueError, match=r"model.options.projection': no loss term reads the projection"):
        train(config_from_dict(raw))
    raw = _raw(digits, pretrained, tmp_path / "b", loss=[{"name": "heated_softmax", "input": "projection"}])
    with pytest.raises(ValueError, match=r"'loss.0.input': the model 'glyph_resnet' has no output 'projection'"):
        train(config_from_dict(raw))
    with pytest.raises(ValueError, match="projection needs 'dim'"):
        create_model("glyph_resnet", projection={"norm": "l2"})


# ----------------------------------------------------------------------------- similarity distillation
def _distillation_reference(z: np.ndarray, t: np.ndarray, centre: bool = False) -> float:
    """Independent NumPy loop: mean over ordered pairs i != j of (cos z_ij - cos t_ij)^2."""
    if centre:
        z, t = z - z.mean(0), t - t.mean(0)
    b = len(z)
    total = 0.0
    for i in range(b):
        for j in range(b):
            if i != j:
                cz = z[i] @ z[j] / (np.linalg.norm(z[i]) * np.linalg.norm(z[j]))
                ct = t[i] @ t[j] / (np.linalg.norm(t[i]) * np.linalg.norm(t[j]))
                total += (cz - ct) ** 2
    return total / (b * (b - 1))


@pytest.mark.parametrize("centre", [False, True])
def test_similarity_distillation_value_and_gradient(centre):
    g = torch.Generator().manual_seed(1)
    z = torch.randn(5, 3, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randn(5, 7, generator=g, dtype=torch.float64).abs()  # ReLU-like pretrained features
    loss = build_loss("similarity_distillation", centre=centre)
    value = loss(z, torch.zeros(5, dtype=torch.long), pretrained_features=t)
    assert value.item() == pytest.approx(_distillation_reference(z.detach().numpy(), t.numpy(), centre), rel=1e-12)
    value.backward()
    # autograd of an independent torch implementation (cosine_similarity over every pair)
    z2 = z.detach().clone().requires_grad_(True)
    zc = z2 - z2.mean(0) if centre else z2
    tc = t - t.mean(0) if centre else t
    sz = F.cosine_similarity(zc[:, None, :], zc[None, :, :], dim=2)
    st = F.cosine_similarity(tc[:, None, :], tc[None, :, :], dim=2)
    ((sz - st) ** 2).sum().div(5 * 4).backward()  # the diagonal is 0 on both sides
    torch.testing.assert_close(z.grad, z2.grad, rtol=1e-10, atol=1e-12)
    if not centre:  # closed form: dL/dz_i = (4 / (B (B-1))) (I - u_i u_i^T) / |z_i| sum_j (S_ij - T_ij) u_j
        u = F.normalize(z.detach(), dim=1)
        d = u @ u.T - F.normalize(t, dim=1) @ F.normalize(t, dim=1).T
        d.fill_diagonal_(0)
        gu = 4.0 / 20 * d @ u
        norms = z.detach().norm(dim=1, keepdim=True)
        closed = (gu - (gu * u).sum(1, keepdim=True) * u) / norms
        torch.testing.assert_close(z.grad, closed, rtol=1e-10, atol=1e-12)
    # no gradient reaches the pretrained features, and identical similarities cost nothing
    assert loss(t[:, :3] * 2, torch.zeros(5, dtype=torch.long), pretrained_features=t[:, :3]).item() == 0.0
    with pytest.raises(ValueError, match=r"pretrained_features must have shape \[5, C\]"):
        loss(z, torch.zeros(5, dtype=torch.long), pretrained_features=t[:4])


def test_teacher_is_frozen_not_optimised_not_saved_and_rebuilt_on_resume(digits, pretrained, tmp_path, monkeypatch):
    teachers = []

    class Recording(PretrainedTeacher):
        def __init__(self, model):
            super().__init__(model)
            teachers.append(self)

    monkeypatch.setattr(loop_module, "PretrainedTeacher", Recording)
    loss = [{"name": "heated_softmax", "options": {"alpha": 16.0}},
            {"name": "similarity_distillation", "weight": 5.0}]
    ref_run = tmp_path / "ref"
    train(config_from_dict(_raw(digits, pretrained, ref_run, loss=loss, train={"epochs": 2})))
    (teacher,) = teachers
    pre = _pretrained_model(pretrained).state_dict()
    assert not teacher.training and not any(p.requires_grad for p in teacher.parameters())
    backbone = {k: v for k, v in teacher.net.state_dict().items() if k.startswith("backbone.")}
    assert len(backbone) > 20
    for k, v in backbone.items():  # the pretrained parameters and BN statistics, unchanged
        assert torch.equal(v, pre[k]), k
    ckpt = load_checkpoint(ref_run / "last.pt")
    assert not torch.equal(ckpt["model"]["backbone.stem.0.weight"], pre["backbone.stem.0.weight"])  # it trained
    names = [n for g in ckpt["optimizer"]["param_groups"] for n in g["param_names"]]
    assert names and not any("teacher" in n or n.startswith("loss.1") for n in names)
    assert set(ckpt["model"]) == set(pre) and ckpt["loss"][1] == {}  # the checkpoint holds no teacher
    steps = read_log(ref_run, type="step")
    assert all(r["loss/1_similarity_distillation"] > 0 for r in steps)

    # one epoch, then resumed for the second: the teacher is rebuilt from the pretrained weights
    run = tmp_path / "run"
    train(config_from_dict(_raw(digits, pretrained, run, loss=loss, train={"epochs": 1})))
    train(config_from_dict(_raw(digits, pretrained, run, loss=loss, train={"epochs": 2})), resume=run / "last.pt")
    assert [r["step"] for r in read_log(run, type="step")] == [r["step"] for r in steps]  # continued, no step twice
    assert len(teachers) == 3  # ref, the first epoch, the resumed run: each built its own
    for k, v in teachers[2].net.state_dict().items():
        if k.startswith("backbone."):
            assert torch.equal(v, pre[k]), k  # rebuilt from the pretrained weights, not from last.pt
    a, b = load_checkpoint(ref_run / "last.pt")["model"], load_checkpoint(run / "last.pt")["model"]
    for k in a:
        assert torch.equal(a[k], b[k]), k


# ----------------------------------------------------------------------------- frozen BN statistics
@pytest.mark.parametrize("freeze", [False, True, "all"])
def test_freeze_bn_keeps_the_backbone_running_statistics(digits, pretrained, tmp_path, freeze):
    run = tmp_path / "bn"
    train(config_from_dict(_raw(digits, pretrained, run, options={"freeze_bn": freeze}, train={"epochs": 2})))
    pre = _pretrained_model(pretrained).state_dict()
    after = load_checkpoint(run / "last.pt")["model"]
    stats = [k for k in pre if k.startswith("backbone.") and ("running_mean" in k or "running_var" in k)]
    affine = [k for k in pre if k.startswith("backbone.") and k.rsplit(".", 1)[0] + ".running_mean" in pre
              and k.endswith(("weight", "bias"))]
    assert len(stats) >= 10 and len(affine) >= 10
    same = [torch.equal(pre[k], after[k]) for k in stats]
    assert all(same) if freeze else not any(same)
    assert all(torch.equal(pre[k], after[k]) for k in affine) == (freeze == "all")
    assert not torch.equal(pre["backbone.stem.0.weight"], after["backbone.stem.0.weight"])  # the rest trains
    assert after["head.bn.running_mean"].abs().sum() > 0  # the head's BN is not the backbone's: it still learns


def test_freeze_bn_model_modes_and_options():
    model = create_model("glyph_resnet", freeze_bn=True, **GLYPH).train()
    assert all(not bn.training for bn in batchnorm_layers(model.backbone)) and model.head.bn.training
    assert all(p.requires_grad for p in model.parameters())
    model.eval().train()
    assert all(not bn.training for bn in batchnorm_layers(model.backbone))
    two = create_model("two_head", backbone="glyph_resnet", num_classes=3, input_size=28, freeze_bn="all",
                       **GLYPH).train()
    bns = batchnorm_layers(two.backbone)
    assert bns and all(not bn.training and not bn.weight.requires_grad for bn in bns)
    with pytest.raises(ValueError, match="freeze_bn must be false, true"):
        create_model("glyph_resnet", freeze_bn="yes")
    # the registry knows the new options, so preflight's option check accepts them (and only where they apply)
    assert {"freeze_bn", "head_init", "projection"} <= model_options("efficientnet_lite0")
    assert "freeze_bn" in model_options("two_head") and "head_init" not in model_options("two_head")


# ----------------------------------------------------------------------------- WiSE-FT
def test_interpolation_end_points_and_mean():
    torch.manual_seed(0)
    pre = create_model("glyph_resnet", **GLYPH)
    ft = create_model("glyph_resnet", **GLYPH)
    with torch.no_grad():
        for m in batchnorm_layers(ft):
            m.running_mean.normal_()
            m.num_batches_tracked.fill_(7)
    p, f = W.snapshot_state(pre), W.snapshot_state(ft)
    keys = W.mixed_keys(f, "backbone")
    assert keys and all(k.startswith("backbone.") for k in keys) and not any("num_batches" in k for k in keys)
    assert set(W.mixed_keys(f, "all")) > set(keys) and "head.proj.weight" in W.mixed_keys(f, "all")
    at0, at1, mid = (W.interpolate_state(p, f, a, keys) for a in (0.0, 1.0, 0.5))
    for k in f:
        if k in keys:
            assert torch.equal(at0[k], p[k]) and torch.equal(at1[k], f[k]), k
            torch.testing.assert_close(mid[k], (p[k] + f[k]) / 2, rtol=0, atol=1e-6)
        else:  # the head and the counters are the fine-tuned ones
            assert torch.equal(at0[k], f[k]) and torch.equal(mid[k], f[k]), k
    assert W.wise_ft_alphas([0.5, 0.25, 0.5]) == [0.25, 0.5, 1.0]
    with pytest.raises(ValueError, match="eval.wise_ft_params"):
        W.mixed_keys(f, "head")


def test_wise_ft_chooses_on_validation_and_reports_test_of_the_chosen_only():
    torch.manual_seed(0)
    pre, ft = create_model("glyph_resnet", **GLYPH), create_model("glyph_resnet", **GLYPH)
    p, f = W.snapshot_state(pre), W.snapshot_state(ft)
    key = "backbone.stem.0.weight"
    calls = []
    val_by_alpha = {0.0: 0.2, 0.25: 0.6, 0.5: 0.6, 1.0: 0.4}

    def evaluate(net, split):
        w = net.state_dict()[key]
        a = float(((w - p[key]).norm() / (f[key] - p[key]).norm()).round(decimals=4))  # the a it was given
        calls.append((split, a))
        return {"recall@1": val_by_alpha[a] if split == "val" else 0.9, "map@r": 0.1}

    res = W.run_wise_ft(ft, p, f, [0.5, 0.0, 0.25], "backbone", "recall@1", evaluate)
    assert [c for c in calls if c[0] == "val"] == [("val", a) for a in (0.0, 0.25, 0.5, 1.0)]
    assert calls[-1] == ("test", 0.5) and sum(c[0] == "test" for c in calls) == 1  # ties: the larger a
    assert res["alpha"] == 0.5 and res["value"] == 0.6 and res["test"]["recall@1"] == 0.9
    assert [r["alpha"] for r in res["val"]] == [0.0, 0.25, 0.5, 1.0]
    torch.testing.assert_close(res["state"][key], (p[key] + f[key]) / 2)


def test_wise_ft_run_writes_wise_pt_and_metrics(digits, pretrained, tmp_path):
    run = tmp_path / "wise"
    raw = _raw(digits, pretrained, run, train={"epochs": 2},
               data={"val_classes": 2}, eval={"wise_ft": [0.0, 0.5], "every": 1, "best_metric": "recall@1"})
    train(config_from_dict(raw))
    summary = json.loads((run / "metrics.json").read_text())["wise_ft"]
    assert [r["alpha"] for r in summary["val"]] == [0.0, 0.5, 1.0]
    assert summary["params"] == "backbone" and summary["metric"] == "recall@1" and summary["finetuned"] == "best.pt"
    values = {r["alpha"]: r["recall@1"] for r in summary["val"]}
    assert summary["alpha"] == max(values, key=lambda a: (values[a], a)) and summary["value"] == values[summary["alpha"]]
    # a = 1 is the fine-tuned best.pt: its validation metric is the selected one
    selected = json.loads((run / "metrics.json").read_text())["selected"]
    assert values[1.0] == pytest.approx(selected["value"])
    # wise.pt is the chosen mixture of the pretrained backbone and best.pt, loadable like last.pt
    wise, best = load_checkpoint(run / "wise.pt"), load_checkpoint(run / "best.pt")
    pre = _pretrained_model(pretrained).state_dict()
    a = summary["alpha"]
    for k, v in wise["model"].items():
        if k.startswith("backbone.") and v.is_floating_point():
            torch.testing.assert_close(v, torch.lerp(pre[k], best["model"][k], a), rtol=0, atol=1e-6)
        else:
            assert torch.equal(v, best["model"][k]), k
    # the chosen model's validation recall, recomputed by brute force from wise.pt
    model, _, cfg, _ = load_model_from_checkpoint(run / "wise.pt")
    val = build_split(cfg, "val", train=False)
    z = compute_embeddings(model, val)
    nearest = _knn(z["embeddings"], 1)[:, 0]
    assert summary["value"] == pytest.approx(float(np.mean(z["labels"][nearest] == z["labels"])), abs=1e-6)
    assert set(summary["test"]) == {"recall@1"}
    assert np.load(embed_checkpoint(run / "wise.pt", tmp_path / "w.npz"))["embeddings"].shape[1] == 8
    with pytest.raises(ValueError, match="holds model weights only"):
        train(config_from_dict(raw), resume=run / "wise.pt")


def test_wise_ft_needs_a_validation_split_and_coefficients_in_0_1():
    with pytest.raises(ConfigError, match="'eval.wise_ft' chooses the WiSE-FT mixing coefficient on validation"):
        config_from_dict({"train": {"epochs": 1}, "eval": {"wise_ft": [0.5]}})
    with pytest.raises(ConfigError, match=r"mixing coefficients in \[0, 1\]"):
        config_from_dict({"train": {"epochs": 1}, "data": {"val_classes": 2}, "eval": {"wise_ft": [1.5]}})
    cfg = config_from_dict({"train": {"epochs": 1}, "data": {"val_classes": 2}, "eval": {"wise_ft": [0.5]}})
    assert cfg.eval.wise_ft_params == "backbone"


def test_build_losses_gives_projection_terms_the_projection_dim():
    cfg = config_from_dict({"train": {"epochs": 1}, "model": {"name": "glyph_resnet"},
                            "loss": [{"name": "heated_softmax"}, {"name": "proxy_nca", "input": "projection"}]})
    a, b = build_losses(cfg, num_classes=4, embedding_dim=16, projection_dim=6)
    assert a.weight.shape == (4, 16) and b.proxies.shape[1] == 6
    assert build_model(cfg).state_dict().keys() == create_model("glyph_resnet").state_dict().keys()


def test_embedding_dim_0_indexes_the_normalised_pooled_features():
    """embedding_dim 0: no linear layer; the embedding is the pooled features through the norm
    (here l2: exactly the normalised features), and a projection head can carry the loss."""
    import torch.nn.functional as F

    from deepmetric.models import create_model

    torch.manual_seed(0)
    model = create_model("glyph_resnet", embedding_dim=0, norm="l2", in_chans=1, widths=[8, 16], depths=[1, 1],
                         projection={"dim": 4, "norm": "l2"}).eval()
    x = torch.randn(3, 1, 32, 32)
    out = model(x)
    assert model.embedding_dim == model.num_features == out["features"].shape[1]
    assert torch.allclose(out["embedding"], F.normalize(out["features"], dim=1))
    assert out["projection"].shape == (3, 4) and not any("head.proj" in n for n, _ in model.named_parameters())
    with pytest.raises(ValueError, match="embedding_dim 0 has none"):
        create_model("glyph_resnet", embedding_dim=0, head_init="pca", in_chans=1, widths=[8], depths=[1])
