"""DDP on CPU (gloo, 2 processes): one step with 2 ranks x batch B gives the gradients of
1 process with batch 2B, for pair-based (gathered) and classifier (local) losses."""
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from deepmetric.data.synthetic import SyntheticMLP
from deepmetric.losses import build_loss
from deepmetric.run.config import LossTermConfig
from deepmetric.train.module import TrainingModule
from conftest import free_port

B, C, DIM, K = 8, 4, 16, 8

# name -> loss terms; each built identically on every rank and in the reference process
CASES = {
    "triplet_semihard": [LossTermConfig(name="triplet", options={"mining": "semihard"})],
    "heated_softmax": [LossTermConfig(name="heated_softmax", options={"num_classes": C, "embedding_dim": K})],
    "ce_plus_triplet": [
        LossTermConfig(name="heated_softmax", options={"num_classes": C, "embedding_dim": K}),
        LossTermConfig(name="triplet", weight=0.5, options={"mining": "hard", "soft_margin": True}),
    ],
    "almn": [LossTermConfig(name="almn", options={"num_classes": C, "embedding_dim": K, "beta": 1.0})],
    "contrastive": [LossTermConfig(name="contrastive")],
}


def _batch():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2 * B, DIM, generator=g)
    y = torch.arange(C).repeat_interleave(2).repeat(2)  # every class in both halves
    return x, y


def _module(terms, world_size):
    torch.manual_seed(1)
    model = SyntheticMLP(in_dim=DIM, hidden=16, embedding_dim=K, normalization="l2")
    losses = torch.nn.ModuleList([build_loss(t.name, **t.options) for t in terms])
    return TrainingModule(model, losses, terms, world_size=world_size)


def _grads_and_buffers(module):
    grads = {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}
    buffers = {n: b.detach().clone() for n, b in module.losses.named_buffers()}
    return grads, buffers


def _worker(rank, world, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        x, y = _batch()
        xs, ys = x[rank * B:(rank + 1) * B], y[rank * B:(rank + 1) * B]
        results = {}
        for name, terms in CASES.items():
            module = _module(terms, world)
            ddp = torch.nn.parallel.DistributedDataParallel(module)
            total, _ = ddp(xs, ys)
            total.backward()
            results[name] = (float(total), *_grads_and_buffers(module))
        # all_gather_with_grad with unequal sizes: gradient only reaches the local part
        from deepmetric.train.distributed import all_gather_with_grad

        local = torch.full((3 + 2 * rank, 2), float(rank + 1), requires_grad=True)
        gathered = all_gather_with_grad(local)
        coeff = torch.arange(gathered.numel(), dtype=torch.float32).reshape(gathered.shape)
        (gathered * coeff).sum().backward()
        results["_gather"] = (gathered.detach(), local.grad.clone())
        # a learnable alpha frozen by heating-up *after* DDP was built: DDP still expects a
        # gradient for it on every step (no "unused parameter" error) and alpha stays put
        terms = [LossTermConfig(name="heated_softmax", options={
            "num_classes": C, "embedding_dim": K, "learnable_alpha": True})]
        module = _module(terms, world)
        ddp = torch.nn.parallel.DistributedDataParallel(module)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.5, momentum=0.9)
        alphas = []
        for step in range(4):
            if step == 1:
                module.losses[0].scale_alpha(0.25)  # the heat-up event freezes the learned value
            opt.zero_grad()
            total, _ = ddp(xs, ys)
            total.backward()
            opt.step()
            alphas.append(module.losses[0].alpha)
        results["_frozen_alpha"] = (torch.tensor(alphas), module.losses[0]._alpha.grad.clone())
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    mp.spawn(_worker, args=(2, free_port(), str(out)), nprocs=2, join=True)
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(2)]


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_match_one_process_with_double_batch(ddp_results, case):
    x, y = _batch()
    ref = _module(CASES[case], world_size=1)
    total, _ = ref(x, y)
    total.backward()
    ref_grads, ref_buffers = _grads_and_buffers(ref)
    for rank in range(2):
        value, grads, buffers = ddp_results[rank][case]
        assert set(grads) == set(ref_grads)
        for n in ref_grads:  # DDP-averaged gradients == single-process gradients of 2B
            torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-5, atol=1e-6, msg=f"{case}: {n}")
        for n in ref_buffers:  # stateful losses (ALMN centres) stay in sync with 1 process
            torch.testing.assert_close(buffers[n], ref_buffers[n], rtol=1e-5, atol=1e-6)
    pair_based = all(t.name in ("triplet", "almn", "contrastive") for t in CASES[case])
    if pair_based:  # the gathered loss is the global-batch loss (x world_size, see docs)
        assert ddp_results[0][case][0] == pytest.approx(2 * float(total.detach()), rel=1e-5)


def test_frozen_alpha_under_ddp(ddp_results):
    for rank in range(2):
        alphas, grad = ddp_results[rank]["_frozen_alpha"]
        assert alphas[1] == alphas[2] == alphas[3]  # frozen after the event at step 1
        assert alphas[1] == pytest.approx(float(ddp_results[0]["_frozen_alpha"][0][0]) / 4)
        assert float(grad) == 0.0  # an exact zero gradient keeps DDP's reducer complete


def test_all_gather_with_grad_unequal_sizes(ddp_results):
    g0, grad0 = ddp_results[0]["_gather"]
    g1, grad1 = ddp_results[1]["_gather"]
    expected = torch.cat([torch.full((3, 2), 1.0), torch.full((5, 2), 2.0)])
    assert torch.equal(g0, expected) and torch.equal(g1, expected)
    coeff = torch.arange(16, dtype=torch.float32).reshape(8, 2)
    assert torch.equal(grad0, coeff[:3]) and torch.equal(grad1, coeff[3:])


def _sync_bn_model():
    from deepmetric.models import ShiftOnlyBatchNorm1d

    torch.manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Linear(DIM, K), ShiftOnlyBatchNorm1d(K))
    with torch.no_grad():
        model[1].bias.copy_(torch.randn(K))
    return model


def _sync_bn_data():
    g = torch.Generator().manual_seed(3)
    return torch.randn(2 * B, DIM, generator=g) * 3 + 1, torch.randn(2 * B, K, generator=g)


def _sync_bn_worker(rank, world, port, out_dir):
    from deepmetric.train.distributed import convert_sync_batchnorm

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = convert_sync_batchnorm(_sync_bn_model())
        x, g = _sync_bn_data()
        xs = x[rank * B:(rank + 1) * B].clone().requires_grad_(True)
        y = model(xs)
        (y * g[rank * B:(rank + 1) * B]).sum().backward()
        bn = model[1]
        torch.save({"y": y.detach(), "x_grad": xs.grad, "bias_grad": bn.bias.grad, "w_grad": model[0].weight.grad,
                    "running_mean": bn.running_mean, "running_var": bn.running_var,
                    "keys": sorted(model.state_dict()), "type": type(bn).__name__},
                   os.path.join(out_dir, f"sync{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_sync_bn_keeps_the_heads_shift_and_matches_one_process_on_the_whole_batch(tmp_path):
    """train.sync_bn: torch's convert_sync_batchnorm turned the BN head's ShiftOnlyBatchNorm1d
    into an affine-less SyncBatchNorm and dropped its learned shift. Ours keeps the module, and
    2 ranks x B rows give the outputs, input gradients, summed parameter gradients and running
    statistics of one process on all 2B rows."""
    mp.spawn(_sync_bn_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"sync{r}.pt", weights_only=True) for r in range(2)]
    ref_model = _sync_bn_model()
    x, g = _sync_bn_data()
    x = x.clone().requires_grad_(True)
    y = ref_model(x)
    (y * g).sum().backward()
    for r in ranks:
        assert r["type"] == "ShiftOnlyBatchNorm1d" and "1.bias" in r["keys"]
        torch.testing.assert_close(r["running_mean"], ref_model[1].running_mean)
        torch.testing.assert_close(r["running_var"], ref_model[1].running_var)
    torch.testing.assert_close(torch.cat([r["y"] for r in ranks]), y.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat([r["x_grad"] for r in ranks]), x.grad, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(ranks[0]["bias_grad"] + ranks[1]["bias_grad"], ref_model[1].bias.grad)
    torch.testing.assert_close(ranks[0]["w_grad"] + ranks[1]["w_grad"], ref_model[0].weight.grad, atol=1e-4, rtol=1e-4)
