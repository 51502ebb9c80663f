"""Distributed data-parallel helpers (``torchrun --nproc_per_node N deepmetric train ...``).

* ``init_distributed`` reads RANK / WORLD_SIZE / LOCAL_RANK set by torchrun and starts the
  process group (NCCL on CUDA, gloo on CPU).
* ``all_gather_with_grad`` concatenates a tensor from every rank; the gradient flows back
  only into the local slice (the others are constants on this rank).  A pair-based loss
  computed on the gathered batch therefore sees all ``world_size * B`` embeddings.

Loss scale: DDP *averages* parameter gradients over ranks.  A gathered loss L(all) is the
same number on every rank, and each rank back-propagates only through its own slice, so the
per-rank gradients are the partial sums of dL/dtheta; their average is dL/dtheta /
world_size.  Gathered terms are therefore multiplied by ``world_size`` (see
``deepmetric.train.module.TrainingModule``).  Per-sample-mean terms computed locally (the
classifier losses) need no correction: the average of the local means is the global mean.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from deepmetric.run.device import resolve_device

__all__ = [
    "DistInfo",
    "convert_sync_batchnorm",
    "init_distributed",
    "cleanup_distributed",
    "is_distributed",
    "get_rank",
    "get_world_size",
    "is_main_process",
    "barrier",
    "all_gather_with_grad",
    "all_reduce_mean",
    "any_true",
]


@dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    initialised_here: bool = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def init_distributed(device: str = "auto") -> DistInfo:
    """Initialise from torchrun's environment; a plain ``python`` run gets world size 1."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = resolve_device(device, local_rank, name="train.device")
    if world_size <= 1:
        return DistInfo(0, 1, 0, dev)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    initialised_here = False
    if not dist.is_initialized():
        backend = "nccl" if dev.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, init_method="env://",
                                rank=rank, world_size=world_size)
        initialised_here = True
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, dev, initialised_here)


def cleanup_distributed(info: DistInfo) -> None:
    if info.initialised_here and dist.is_initialized():
        dist.destroy_process_group()


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def get_rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def get_world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def is_main_process() -> bool:
    return get_rank() == 0


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def convert_sync_batchnorm(module: torch.nn.Module, process_group=None) -> torch.nn.Module:
    """``nn.SyncBatchNorm.convert_sync_batchnorm``, except for the heads' shift-only batch norm.

    torch's conversion turns every ``_BatchNorm`` into ``nn.SyncBatchNorm`` with the same
    ``affine`` flag; ``ShiftOnlyBatchNorm1d`` has ``affine=False`` plus its own learned shift,
    so it would come back without the shift (and its checkpoints without ``bn.bias``). Here it
    stays itself and synchronises its statistics itself (``sync = True``); every other batch
    norm is converted by torch. Returns the converted module (a new one only when ``module``
    itself is a plain batch norm)."""
    from deepmetric.models.heads import ShiftOnlyBatchNorm1d

    if isinstance(module, ShiftOnlyBatchNorm1d):
        module.sync, module.process_group = True, process_group
        return module
    if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
        return torch.nn.SyncBatchNorm.convert_sync_batchnorm(module, process_group)
    for name, child in list(module.named_children()):
        converted = convert_sync_batchnorm(child, process_group)
        if converted is not child:
            module.add_module(name, converted)
    return module


def all_gather_with_grad(x: torch.Tensor) -> torch.Tensor:
    """Concatenate ``x`` (first dimension may differ per rank) from all ranks, rank order.

    The local slice is ``x`` itself, so autograd reaches this rank's graph through it; the
    other ranks' slices are detached copies.
    """
    if not is_distributed():
        return x
    world, rank = dist.get_world_size(), dist.get_rank()
    n = torch.tensor([x.shape[0]], device=x.device, dtype=torch.long)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n)
    sizes = [int(s.item()) for s in sizes]
    max_n = max(sizes)
    xd = x.detach()
    if xd.shape[0] < max_n:  # all_gather needs equal shapes: pad, then trim
        pad = xd.new_zeros((max_n - xd.shape[0],) + tuple(xd.shape[1:]))
        xd = torch.cat([xd, pad])
    parts = [torch.empty_like(xd) for _ in range(world)]
    dist.all_gather(parts, xd.contiguous())
    parts = [p[:s] for p, s in zip(parts, sizes)]
    parts[rank] = x
    return torch.cat(parts)


def all_reduce_mean(value: float, device: torch.device | None = None) -> float:
    if not is_distributed():
        return float(value)
    t = torch.tensor([float(value)], dtype=torch.float64, device=device or "cpu")
    dist.all_reduce(t)
    return float(t.item()) / dist.get_world_size()


def any_true(flag: bool, device: torch.device | None = None) -> bool:
    """True on every rank if ``flag`` is True on any rank (keeps ranks in lock-step)."""
    if not is_distributed():
        return bool(flag)
    t = torch.tensor([1.0 if flag else 0.0], device=device or "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item() > 0)
