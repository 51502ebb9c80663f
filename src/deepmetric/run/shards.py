"""Embedding images over torchrun processes, in shards that survive a restart (``deepmetric
index`` and ``deepmetric embed``).

``torchrun --nproc_per_node P [--nnodes N ...] -m deepmetric.cli index CHECKPOINT ... --out INDEX``
(or ``... embed CHECKPOINT --out FILE.npz``):
the images to embed (the split, less the paths an ``--add`` finds already indexed) are cut into
shards of ``--shard-size`` images; rank ``r`` of ``W`` embeds the contiguous run of shards
``[r J / W, (r + 1) J / W)`` and writes each as ``shard-NNNNNN.npy`` (a temporary file renamed:
a shard file is whole or absent) into ``.INDEX.shards-FINGERPRINT`` beside the index. The
fingerprint (SHA-256 of the checkpoint's SHA-256, the shard size and the image list) makes the
same command find its own shards again: a rank killed and restarted skips finished shards.
After a gloo barrier (timeout one day: ranks finish at different times), rank 0 reads every
shard back in order, builds the index exactly as one process would (training any coarse
quantiser on its sample) and removes the shard folder. On several machines the index's parent
folder must be shared (the same path on every node).
"""
from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import math
import os
import shutil
from pathlib import Path

import numpy as np

__all__ = ["ShardPlan", "torchrun_world", "torchrun_group", "DEFAULT_SHARD_SIZE"]

DEFAULT_SHARD_SIZE = 4096


def torchrun_world() -> tuple[int, int] | None:
    """``(rank, world size)`` when this process was started by torchrun, else ``None``."""
    if "TORCHELASTIC_RUN_ID" not in os.environ and "WORLD_SIZE" not in os.environ:
        return None
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


@contextlib.contextmanager
def torchrun_group():
    """A gloo process group for the barrier between embedding and assembling."""
    import torch.distributed as dist

    rank, world = torchrun_world() or (0, 1)
    made = False
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world,
                                timeout=datetime.timedelta(days=1))
        made = True
    try:
        yield rank, world
    finally:
        if made:
            dist.destroy_process_group()


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


class ShardPlan:
    """Which shards this rank embeds, and where shards live (beside the index ``out``)."""

    def __init__(self, out: str | Path, *, rank: int, world_size: int, shard_size: int = DEFAULT_SHARD_SIZE,
                 checkpoint_sha256: str | None = None):
        if shard_size < 1:
            raise ValueError(f"--shard-size must be >= 1, got {shard_size}")
        self.out = Path(out).expanduser().absolute()
        self.rank, self.world_size, self.shard_size = rank, world_size, int(shard_size)
        self.checkpoint_sha256 = checkpoint_sha256
        self.folder: Path | None = None
        self.embedded = self.reused = 0

    def _fingerprint(self, paths: list[str]) -> str:
        h = hashlib.sha256(json.dumps([self.checkpoint_sha256, self.shard_size, len(paths)]).encode())
        for p in paths:
            h.update(p.encode("utf-8", "surrogateescape") + b"\0")
        return h.hexdigest()[:16]

    def mine(self, count: int) -> range:
        j = math.ceil(count / self.shard_size)
        return range(self.rank * j // self.world_size, (self.rank + 1) * j // self.world_size)

    def _write(self, j: int, emb: np.ndarray) -> None:
        f = self.folder / f"shard-{j:06d}.npy"
        tmp = self.folder / f".shard-{j:06d}.npy.tmp-{os.getpid()}"
        with open(tmp, "wb") as fh:
            np.save(fh, np.ascontiguousarray(emb, dtype=np.float32), allow_pickle=False)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, f)

    def run(self, rows, paths: list[str], embed, *, progress: bool = False) -> np.ndarray | None:
        """Embed this rank's shards of ``rows`` (dataset rows, with their ``paths``) with
        ``embed(rows) -> [n, d]`` unless already on disk; after the barrier rank 0 returns all
        embeddings in order, the other ranks ``None``."""
        from tqdm.auto import tqdm

        self.folder = self.out.parent / f".{self.out.name}.shards-{self._fingerprint(paths)}"
        self.folder.mkdir(parents=True, exist_ok=True)
        rows = list(rows)
        mine = self.mine(len(rows))
        for j in tqdm(mine, desc=f"rank {self.rank} shards", disable=not progress, leave=False):
            if (self.folder / f"shard-{j:06d}.npy").is_file():
                self.reused += 1  # written whole by an earlier run of the same command
                continue
            self._write(j, embed(rows[j * self.shard_size:(j + 1) * self.shard_size]))
            self.embedded += 1
        _barrier()
        if self.rank != 0:
            return None
        return self._read_all(len(rows))

    def _read_all(self, count: int) -> np.ndarray:
        parts = []
        for j in range(math.ceil(count / self.shard_size)):
            f = self.folder / f"shard-{j:06d}.npy"
            if not f.is_file():
                raise FileNotFoundError(f"{f} is missing after every rank finished: is {self.folder.parent} "
                                        "the same shared folder on every node?")
            part = np.load(f, allow_pickle=False)
            want = min(self.shard_size, count - j * self.shard_size)
            if part.ndim != 2 or part.shape[0] != want:
                raise ValueError(f"{f}: {part.shape[0] if part.ndim else 0} rows, expected {want}")
            parts.append(part)
        return np.concatenate(parts) if parts else np.zeros((0, 0), np.float32)

    def summary(self) -> dict:
        return {"world_size": self.world_size, "shard_size": self.shard_size,
                "embedded_by_rank_0": self.embedded, "reused_by_rank_0": self.reused}

    def finish(self) -> None:
        """Rank 0, once the index is written: the shards are no longer needed."""
        if self.folder is not None and self.rank == 0:
            shutil.rmtree(self.folder, ignore_errors=True)
