"""Fine-tuning recipes: LP-FT (``train.warmup_mode: linear_probe``) and layer-wise learning-rate
decay (``optim.layer_decay``), on a small MLP with batch norm in its backbone and on the real
backbones' stages."""
import os
import signal

import pytest
import torch
from torch import nn

from deepmetric.models import backbone_stages, create_backbone, create_model, list_backbones, register_model
from deepmetric.models.registry import MODELS
from deepmetric.models.synthetic import SyntheticMLP
from deepmetric.run.builders import build_model, seed_everything
from deepmetric.run.config import ConfigError
from deepmetric.run.config_io import config_from_dict
from deepmetric.train.finetune import linear_probe
from deepmetric.train.loop import set_learning_rates, train
from deepmetric.train.optim import build_optimizer
from deepmetric.run.rundir import read_log
from conftest import synthetic_config

STEPS_PER_EPOCH = 6  # synthetic_config: 6 classes x 16 images, batch 16


def autograd_nodes(t: torch.Tensor) -> int:
    """The number of autograd nodes ``t`` depends on (0 for a tensor outside any graph)."""
    seen, todo = set(), [t.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        todo += [nxt for nxt, _ in fn.next_functions]
    return len(seen)


class BatchNormMLP(SyntheticMLP):
    """SyntheticMLP whose backbone has batch norm and dropout (what a linear probe must keep
    fixed), and which records every training forward pass of its backbone: ``(backbone in
    training mode, its output requires grad, autograd nodes behind the output)``.  With
    ``interrupt_at`` set, the forward pass of that training step sends this process a SIGINT
    (a Ctrl-C in the middle of an epoch)."""

    records: list = []
    interrupt_at: int | None = None

    def __init__(self, in_dim=16, hidden=32, embedding_dim=8, num_classes=None):
        super().__init__(in_dim=in_dim, hidden=hidden, embedding_dim=embedding_dim)
        self.backbone = nn.Sequential(nn.Linear(in_dim, hidden), nn.BatchNorm1d(hidden), nn.ReLU(), nn.Dropout(0.2),
                                      nn.Linear(hidden, hidden), nn.BatchNorm1d(hidden), nn.ReLU())

    def forward_features(self, x):
        h = self.backbone(x.flatten(1))
        if torch.is_grad_enabled():  # a training step (evaluation runs under no_grad)
            cls = type(self)
            cls.records.append((self.backbone.training, h.requires_grad, autograd_nodes(h)))
            if cls.interrupt_at is not None and len(cls.records) == cls.interrupt_at:
                os.kill(os.getpid(), signal.SIGINT)
        return h


@pytest.fixture
def bn_mlp():
    with MODELS.scratch():  # module state: leave the registry as other tests expect it
        register_model("bn_mlp")(BatchNormMLP)
        BatchNormMLP.records, BatchNormMLP.interrupt_at = [], None
        yield BatchNormMLP
    BatchNormMLP.records, BatchNormMLP.interrupt_at = [], None


def _probe_raw(out_dir, epochs, warmup_epochs, mode="linear_probe", **train_extra):
    return synthetic_config(out_dir, model={"name": "bn_mlp", "options": {"in_dim": 16, "hidden": 32, "embedding_dim": 8}},
                            data={"options": {"augment": 0.2}},
                            train={"epochs": epochs, "warmup_epochs": warmup_epochs, "warmup_mode": mode, **train_extra},
                            eval={"every": 0, "baselines": False})


def _initial_state(cfg):
    seed_everything(cfg.train.seed)  # the loop seeds and builds identically
    return {k: v.clone() for k, v in build_model(cfg).state_dict().items()}


def _final_state(out_dir):
    return torch.load(out_dir / "last.pt", weights_only=True)["model"]


def test_linear_probe_keeps_backbone_weights_and_bn_statistics_bit_identical(tmp_path, bn_mlp):
    cfg = config_from_dict(_probe_raw(tmp_path / "probe", epochs=2, warmup_epochs=2))
    init = _initial_state(cfg)
    train(cfg)
    final = _final_state(tmp_path / "probe")
    backbone = [k for k in init if k.startswith("backbone.")]
    assert any("running_mean" in k for k in backbone) and any("num_batches_tracked" in k for k in backbone)
    for k in backbone:  # weights, biases, running mean / var and the batch counter
        assert torch.equal(final[k], init[k]), k
    assert not torch.equal(final["head.weight"], init["head.weight"])  # the probe trained
    # every training forward pass ran the backbone in eval mode with no graph behind it
    assert len(bn_mlp.records) == 2 * STEPS_PER_EPOCH
    assert set(bn_mlp.records) == {(False, False, 0)}

    # the old warm-up (backbone lr 0) keeps the weights but moves the batch-norm statistics
    # and backpropagates through the backbone
    bn_mlp.records.clear()
    old = config_from_dict(_probe_raw(tmp_path / "new_layers", epochs=2, warmup_epochs=2, mode="new_layers"))
    train(old)
    moved = _final_state(tmp_path / "new_layers")
    assert torch.equal(moved["backbone.0.weight"], init["backbone.0.weight"])
    assert not torch.equal(moved["backbone.1.running_mean"], init["backbone.1.running_mean"])
    assert all(training and grad and nodes > 0 for training, grad, nodes in bn_mlp.records)


def test_fine_tuning_follows_the_probe_and_costs_more_per_step(tmp_path, bn_mlp):
    cfg = config_from_dict(_probe_raw(tmp_path, epochs=3, warmup_epochs=2))
    init = _initial_state(cfg)
    train(cfg)
    final = _final_state(tmp_path)
    for k in ("backbone.0.weight", "backbone.4.weight", "backbone.1.running_mean", "backbone.5.running_var"):
        assert not torch.equal(final[k], init[k]), k  # epoch 3 fine-tunes everything
    probe, finetune = bn_mlp.records[:2 * STEPS_PER_EPOCH], bn_mlp.records[2 * STEPS_PER_EPOCH:]
    assert len(finetune) == STEPS_PER_EPOCH
    assert set(probe) == {(False, False, 0)}
    # fine-tuning: training mode, and a graph through the backbone's 7 layers for the backward
    assert all(training and grad and nodes >= 7 for training, grad, nodes in finetune)
    assert len(read_log(tmp_path / "log.jsonl", type="step")) == 3 * STEPS_PER_EPOCH


def test_resume_in_the_middle_of_the_probe_is_exact(tmp_path, bn_mlp):
    ref_raw = _probe_raw(tmp_path / "ref", epochs=3, warmup_epochs=2)
    ref = train(config_from_dict(ref_raw))
    bn_mlp.records.clear()
    bn_mlp.interrupt_at = STEPS_PER_EPOCH + 3  # Ctrl-C in the 4th step of epoch 2, a probe epoch
    raw = _probe_raw(tmp_path / "run", epochs=3, warmup_epochs=2)
    first = train(config_from_dict(raw))
    assert first.interrupted and first.iteration == STEPS_PER_EPOCH + 3
    ckpt = torch.load(tmp_path / "run" / "last.pt", weights_only=True)
    assert ckpt["epoch"] == 1 and ckpt["batch_in_epoch"] == 3
    bn_mlp.interrupt_at = None
    bn_mlp.records.clear()
    res = train(config_from_dict(raw), resume=tmp_path / "run" / "last.pt")
    assert res.iteration == ref.iteration and not res.interrupted
    # the resumed part: 3 more probe steps, then the fine-tuning epoch
    assert bn_mlp.records[:3] == [(False, False, 0)] * 3 and all(r[0] and r[1] for r in bn_mlp.records[3:])
    a, b = _final_state(tmp_path / "ref"), _final_state(tmp_path / "run")
    assert all(torch.equal(a[k], b[k]) for k in a)
    la = torch.load(tmp_path / "ref" / "last.pt", weights_only=True)
    lb = torch.load(tmp_path / "run" / "last.pt", weights_only=True)
    assert all(torch.equal(la["loss"][0][k], lb["loss"][0][k]) for k in la["loss"][0])


def test_linear_probe_restores_what_was_trainable_and_needs_a_backbone():
    model = create_model("efficientnet_lite0", embedding_dim=8, freeze_stages=5)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    with linear_probe(model):
        assert {n for n, p in model.named_parameters() if p.requires_grad} == {n for n in trainable
                                                                               if not n.startswith("backbone.")}
        model.train()  # the loop's epoch start: the backbone still runs in eval mode
        out = model(torch.randn(2, 3, 64, 64))
        assert not model.backbone.training and not out["features"].requires_grad
        assert out["embedding"].requires_grad  # the head trains
    assert {n for n, p in model.named_parameters() if p.requires_grad} == trainable  # frozen stages stay frozen
    model.train()
    assert model.backbone.training and model(torch.randn(2, 3, 64, 64))["features"].requires_grad

    with pytest.raises(ValueError, match=r"train\.warmup_mode.*no \.backbone"):
        with linear_probe(nn.Linear(2, 2)):
            pass


# --------------------------------------------------------------------------- layer-wise lr decay
@pytest.mark.parametrize("name", list_backbones())
def test_every_backbone_parameter_lies_in_one_stage_in_forward_order(name):
    with torch.device("meta"):  # shapes only: no memory, no initialisation
        backbone = create_backbone(name)
    stages = backbone_stages(backbone)
    ids = [id(p) for stage in stages for p in stage.parameters()]
    assert len(ids) == len(set(ids)) and set(ids) == {id(p) for p in backbone.parameters()}
    assert all(any(True for _ in stage.parameters()) for stage in stages)
    # the stages run in the listed order: the first forward call of each stage's modules
    calls: list[int] = []
    hooks = [m.register_forward_pre_hook(lambda mod, args, s=s: calls.append(s))
             for s, stage in enumerate(stages) for m in stage.modules() if any(True for _ in m.parameters(False))]
    side = 28 if name == "lenet" else 96
    with torch.no_grad():
        backbone.eval()(torch.empty(2, 1 if name in ("lenet", "glyph_resnet") else 3, side, side, device="meta"))
    for h in hooks:
        h.remove()
    firsts = [calls.index(s) for s in range(len(stages))]
    assert firsts == sorted(firsts), calls


def test_a_module_without_stages_is_refused_by_name():
    with pytest.raises(ValueError, match=r"backbone 'Sequential' has no known stages.*efficientnet_lite0"):
        backbone_stages(nn.Sequential(nn.Linear(2, 2)))
    cfg = config_from_dict(synthetic_config(optim={"layer_decay": 0.5}))
    with pytest.raises(ValueError, match=r"config key 'optim\.layer_decay'.*no known stages"):
        build_optimizer(build_model(cfg), [], cfg.optim)
    with pytest.raises(ConfigError, match=r"optim\.layer_decay.*\(0, 1\]"):
        config_from_dict(synthetic_config(optim={"layer_decay": 1.5}))


def test_layer_decay_learning_rates_follow_the_formula_and_frozen_stages_get_no_group():
    decay, lr, head_mult, freeze = 0.7, 0.01, 10.0, 5
    cfg = config_from_dict({
        "train": {"epochs": 1},
        "model": {"name": "efficientnet_lite0", "options": {"embedding_dim": 16, "freeze_stages": freeze}},
        "optim": {"lr": lr, "new_layer_lr_mult": head_mult, "layer_decay": decay, "weight_decay": 1e-4,
                  "param_groups": [{"pattern": r"^model\.backbone\.conv_head\.", "lr_mult": 2.0},
                                   {"pattern": r"^model\.backbone\.blocks\.5\..*bias$", "weight_decay": 0.0}]},
    })
    model = build_model(cfg)
    losses = nn.ModuleList([nn.Linear(16, 3)])  # stands for a classifier loss's weights
    opt = build_optimizer(model, losses, cfg.optim)
    set_learning_rates(opt, cfg, factor=0.5, epoch=0)
    group_of = {n: g for g in opt.param_groups for n in g["param_names"]}
    stage_paths = ["conv_stem|bn1", *[f"blocks.{i}" for i in range(7)], "conv_head|bn2"]
    n_stages = len(stage_paths)
    for name, p in model.backbone.named_parameters():
        stage = next(s for s, paths in enumerate(stage_paths) if name.split(".")[0] in paths.split("|")
                     or name.startswith(paths + "."))
        qualified = f"model.backbone.{name}"
        if stage < freeze:  # frozen: no trainable parameter, so no group
            assert not p.requires_grad and qualified not in group_of
            continue
        g = group_of[qualified]
        if name.startswith("conv_head."):  # an explicit lr_mult wins over the decay
            assert g["lr"] == pytest.approx(lr * 2.0 * 0.5)
        else:  # stage s counted from the top: lr x decay ** s (weight-decay-only entries keep it)
            s = n_stages - 1 - stage
            assert g["lr"] == pytest.approx(lr * decay ** s * 0.5), name
        assert g["weight_decay"] == (0.0 if name.startswith("blocks.5.") and name.endswith("bias") else 1e-4)
    for name, _ in model.named_parameters():
        if not name.startswith("backbone."):  # the head keeps its multiplier
            assert group_of[f"model.{name}"]["lr"] == pytest.approx(lr * head_mult * 0.5)
    assert group_of["loss.0.weight"]["lr"] == pytest.approx(lr * head_mult * 0.5)
    # the lowest trainable stage is blocks.4 (stage 5 of 0..8), 3 below the top: decay ** 3
    assert group_of["model.backbone.blocks.4.0.conv_pw.weight"]["lr"] == pytest.approx(lr * decay ** 3 * 0.5)
    assert "model.backbone.blocks.3.0.conv_pw.weight" not in group_of
    # without the key nothing changes: one backbone group at the base lr
    plain = config_from_dict({"train": {"epochs": 1}, "model": cfg.model.__dict__, "optim": {"lr": lr}})
    groups = build_optimizer(build_model(plain), [], plain.optim).param_groups
    assert sorted(g["lr_mult"] for g in groups) == [1.0, 1.0] and sum(g["is_backbone"] for g in groups) == 1


# --------------------------------------------------------------------------- LP-FT under DDP
def _ddp_probe_worker(rank, world, port, out_dir):
    import torch.distributed as dist

    from deepmetric.losses import build_loss
    from deepmetric.run.config import LossTermConfig
    from deepmetric.train.module import TrainingModule

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)  # the same initial model on both ranks
        model = BatchNormMLP(in_dim=16, hidden=32, embedding_dim=8)
        terms = [LossTermConfig(name="heated_softmax")]
        losses = nn.ModuleList([build_loss("heated_softmax", num_classes=4, embedding_dim=8)])
        module = TrainingModule(model, losses, terms, world_size=world)
        # what the loop builds with warmup_mode linear_probe: the probe leaves the backbone unused
        ddp = nn.parallel.DistributedDataParallel(module, find_unused_parameters=True)
        opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
        g = torch.Generator().manual_seed(rank)
        x, y = torch.randn(8, 16, generator=g), torch.arange(4).repeat(2)
        init = {k: v.clone() for k, v in model.backbone.state_dict().items()}
        snapshots = []
        for probing in (True, True, False, False):  # two probe steps, then two fine-tuning steps
            with linear_probe(model, active=probing):
                module.train()
                total, _ = ddp(x, y)
                total.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            snapshots.append({k: v.clone() for k, v in model.backbone.state_dict().items()})
        params = {n: p.detach().clone() for n, p in module.named_parameters()}
        torch.save({"init": init, "snapshots": snapshots, "params": params}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_linear_probe_then_fine_tuning_under_ddp(tmp_path):
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_ddp_probe_worker, args=(2, port, str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    for r in ranks:
        for k in r["init"]:  # both probe steps left the backbone (weights and BN statistics) alone
            assert torch.equal(r["snapshots"][1][k], r["init"][k]), k
        assert not torch.equal(r["snapshots"][3]["0.weight"], r["init"]["0.weight"])  # then it trained
        assert not torch.equal(r["snapshots"][3]["1.running_mean"], r["init"]["1.running_mean"])
    for n in ranks[0]["params"]:  # DDP kept the ranks' parameters in sync through both phases
        assert torch.equal(ranks[0]["params"][n], ranks[1]["params"][n]), n
