"""The training loop, readable top to bottom.

``train(cfg)`` does, in order:

1. set up the process (torchrun/DDP from the environment, device, seed, run directory);
2. build the data: training split, batch sampler (random or m x n class-balanced, sharded
   over ranks), evaluation split(s);
3. build the model and the weighted loss terms (e.g. CE + lambda x triplet), wrap both in
   one ``TrainingModule`` (and in DDP when distributed, so classifier-loss parameters are
   synchronised with the model's);
4. build the optimiser parameter groups (backbone lr, new-layer multiplier, loss params),
   the lr schedule and the temperature (heating-up) schedule, the fp16 gradient scaler;
5. resume from a checkpoint if asked (model, loss state, optimiser, schedules, sampler,
   RNG states, counters);
6. for every epoch: re-seed, ``sampler.set_epoch``, and for every batch: fire due heating-up
   events, set the learning rates, forward under autocast, weighted loss, backward (with
   gradient accumulation and the fp16 scaler), step; log every step as JSON lines; stop
   cleanly on Ctrl-C (checkpoint first) or a non-finite loss (no checkpoint written);
7. at epoch end: evaluate when due (zero-shot retrieval/clustering with
   ``deepmetric.evaluate``), feed ``auto_plateau``, save ``last.pt`` (and ``best.pt``).

Files in ``train.out_dir``: ``config.yaml`` (resolved), ``log.jsonl`` (one ``{"type":
"step"}`` record per optimisation step, one ``{"type": "eval"}`` per evaluation, one
``{"type": "heat_up"}`` per temperature event), ``last.pt``, ``best.pt``, ``metrics.json``.
Only rank 0 writes.
"""
from __future__ import annotations

import json
import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from . import distributed as D
from .checkpoint import (GracefulInterrupt, get_rng_state, load_checkpoint, save_checkpoint,
                         set_rng_state, to_safe)
from .config import Config, config_from_dict, config_to_dict, save_config
from .embed import autocast_context, evaluate_model
from .optim import build_optimizer
from .schedules import LrSchedule, TemperatureSchedule, get_alpha, has_alpha, set_alpha

__all__ = ["train", "TrainResult", "TrainingModule", "NonFiniteLossError", "build_dataset_split",
           "build_model", "build_losses", "seed_everything"]


class NonFiniteLossError(RuntimeError):
    """Training produced a NaN/inf loss; the message names the step and the last checkpoint."""


@dataclass
class TrainResult:
    out_dir: Path
    metrics: dict[str, float]           # last evaluation
    best: dict[str, Any]                # {"epoch", "metric", "value"}
    epochs_completed: int
    iteration: int
    interrupted: bool = False


# --------------------------------------------------------------------------- builders
def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _call_filling(fn: Callable, name: str, options: dict, auto: dict, target: Callable | None = None):
    """``fn(name, **options, **auto)`` where ``auto`` holds values the loop knows
    (``num_classes``, ``embedding_dim``): each is passed only when ``target`` (the class or
    function that receives the keywords) accepts it and the user did not set it."""
    import inspect

    extra = {k: v for k, v in auto.items() if v is not None and k not in options}
    if target is not None and extra:
        try:
            params = inspect.signature(target).parameters
        except (TypeError, ValueError):
            params = None
        if params is not None and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            extra = {k: v for k, v in extra.items() if k in params}
    return fn(name, **extra, **options)


def build_dataset_split(cfg: Config, split: str, *, train: bool):
    """One split of ``cfg.data`` with the train or test transform."""
    d = cfg.data
    if d.name == "synthetic":
        from deepmetric.data.synthetic import build_synthetic_dataset

        return build_synthetic_dataset(split, **d.options)
    from deepmetric.data import build_dataset, build_transform

    transform = None
    if d.transform is not None:
        transform = build_transform(d.transform, train=train, **d.transform_options)
    return build_dataset(d.name, root=d.root, split=split, transform=transform, **d.options)


def build_model(cfg: Config, num_classes: int | None = None) -> nn.Module:
    """``create_model(cfg.model.name, **cfg.model.options)``.  ``num_classes`` is passed only
    when the model needs a classifier: the two-head model, or a loss term reading ``logits``."""
    m = cfg.model
    needs_classifier = m.name == "two_head" or any(t.input == "logits" for t in cfg.loss)
    if not needs_classifier:
        num_classes = None
    if m.name == "synthetic_mlp":
        from deepmetric.data.synthetic import SyntheticMLP

        def factory(name, **kw):
            return SyntheticMLP(**kw)
        target = SyntheticMLP
    else:  # create_model accepts num_classes for every model: nothing to filter
        from deepmetric.models import create_model as factory

        target = None
    return _call_filling(factory, m.name, dict(m.options), {"num_classes": num_classes}, target)


def build_losses(cfg: Config, num_classes: int | None = None, embedding_dim: int | None = None) -> nn.ModuleList:
    from deepmetric.losses import build_loss, loss_class

    terms = []
    for i, term in enumerate(cfg.loss):
        try:
            cls = loss_class(term.name)
        except ValueError as exc:
            raise ValueError(f"config key 'loss.{i}.name': {exc}") from None
        terms.append(_call_filling(build_loss, term.name, dict(term.options),
                                   {"num_classes": num_classes, "embedding_dim": embedding_dim}, cls))
    return nn.ModuleList(terms)


@torch.no_grad()
def init_from_class_means(model: nn.Module, loss: nn.Module, dataset, *, device: torch.device,
                          batch_size: int = 256, seed: int = 0, amp: str = "none") -> None:
    """Heated-up paper, official code for SOP: set the classifier's weights to the
    l2-normalised per-class means of the training embeddings before training.

    The embeddings are taken as the loss will see them in the first steps: batch-norm layers
    use the statistics of (shuffled, seeded) batches rather than their untrained running
    averages, dropout is off, and every buffer (running statistics) is restored afterwards.
    """
    if not hasattr(loss, "init_from_class_means"):
        raise ValueError(f"config key 'loss.init': {type(loss).__name__} has no class weights to "
                         f"initialise from class means (use it with heated_softmax)")
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    was_training = model.training
    model.train()
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.eval()
    g = torch.Generator().manual_seed(seed)
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=True, generator=g,
                                         drop_last=len(dataset) > batch_size)
    embs, labels = [], []
    try:
        for x, y in loader:
            with autocast_context(device, amp):
                embs.append(model(x.to(device))["embedding"].float())
            labels.append(torch.as_tensor(y).to(device))
    finally:
        with torch.no_grad():
            for k, v in model.named_buffers():
                v.copy_(buffers[k])
        model.train(was_training)
    loss.init_from_class_means(torch.cat(embs), torch.cat(labels))


def _embedding_dim(model: nn.Module, dataset) -> int:
    """The model's embedding size: ``model.embedding_dim`` or one probe forward pass."""
    k = getattr(model, "embedding_dim", None)
    if isinstance(k, int):
        return k
    x = torch.stack([torch.as_tensor(dataset[i][0]) for i in range(min(2, len(dataset)))])
    was = model.training
    model.eval()
    with torch.no_grad():
        k = int(model(x)["embedding"].shape[1])
    model.train(was)
    return k


#: Losses whose value depends on pairs/tuples of batch samples: under DDP they see the
#: embeddings of all ranks.  Per-sample losses (heated softmax, Proxy-NCA, CE) stay local
#: (DDP's gradient average is then the global-batch mean), and the centre loss all-reduces
#: its own centre update.
PAIR_BASED_LOSSES = frozenset({"triplet", "npair", "almn", "contrastive", "lifted"})


class TrainingModule(nn.Module):
    """Model + loss terms as one module, so DDP synchronises both (classifier-loss parameters
    such as heated-softmax ``W`` are trained like model parameters).

    ``forward(x, y)`` returns ``(total, parts)``: ``total = sum_i weight_i * term_i``.  When
    distributed, terms flagged ``gather`` see the embeddings/labels of all ranks and are
    multiplied by ``world_size`` so that DDP's gradient averaging gives exactly the
    single-process gradient of the whole global batch (see ``deepmetric.train.distributed``).
    """

    def __init__(self, model: nn.Module, losses: nn.ModuleList, terms, *, world_size: int = 1,
                 amp: str = "none", device: torch.device | None = None):
        super().__init__()
        self.model = model
        self.losses = losses
        self.weights = [float(t.weight) for t in terms]
        self.inputs = [t.input for t in terms]
        self.names = [t.name for t in terms]
        self.gather = [t.gather if t.gather is not None else t.name in PAIR_BASED_LOSSES for t in terms]
        self.world_size = world_size
        self.amp = amp
        self.device = device or torch.device("cpu")

    def forward(self, x: torch.Tensor, y: torch.Tensor):
        with autocast_context(self.device, self.amp):
            out = self.model(x)
        total = 0.0
        parts = []
        # Losses in float32 outside autocast: softmax temperatures and distances need it.
        with torch.autocast(device_type=self.device.type, enabled=False):
            for name, loss, w, inp, gather in zip(self.names, self.losses, self.weights,
                                                   self.inputs, self.gather):
                if inp not in out:
                    raise ValueError(f"loss term {name!r} reads the model output {inp!r}, but the model "
                                     f"returns only {sorted(out)}")
                z = out[inp].float()
                if gather and self.world_size > 1:
                    value = loss(D.all_gather_with_grad(z), D.all_gather_with_grad(y)) * self.world_size
                else:
                    value = loss(z, y)
                parts.append(value)
                total = total + w * value
        return total, parts


# --------------------------------------------------------------------------- helpers
class _JsonLog:
    """Append-only JSON-lines log (rank 0 only; other ranks get a no-op)."""

    def __init__(self, path: Path | None):
        self.f = open(path, "a", encoding="utf-8") if path is not None else None

    def write(self, record: dict) -> None:
        if self.f is not None:
            self.f.write(json.dumps(record, default=float) + "\n")
            self.f.flush()

    def close(self) -> None:
        if self.f is not None:
            self.f.close()


def _truncate_log(path: Path, iteration: int, epoch: int) -> None:
    """On resume drop the records a killed run wrote after its last checkpoint."""
    if not path.is_file():
        return
    keep = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # truncated last line of a killed run
        if rec.get("type") == "step" and rec.get("step", 0) > iteration:
            continue
        if rec.get("type") in ("eval", "heat_up") and rec.get("epoch", 0) > epoch:
            continue
        keep.append(line)
    path.write_text("".join(l + "\n" for l in keep), encoding="utf-8")


def _make_sampler(cfg: Config, labels: np.ndarray, rank: int, world: int):
    from deepmetric.data import ClassBalancedBatchSampler, RandomBatchSampler

    t = cfg.train
    if t.sampler == "class_balanced":
        return ClassBalancedBatchSampler(labels, t.m, t.n, seed=t.seed, rank=rank, world_size=world,
                                         class_sampling=t.class_sampling)
    return RandomBatchSampler(len(labels), t.batch_size, seed=t.seed, rank=rank, world_size=world,
                              drop_last=True)


def _make_loader(dataset, sampler, num_workers: int, pin: bool, seed: int):
    """A loader over the batch sampler.  ``seed`` (a function of run seed, epoch and rank)
    seeds the workers, so augmentations differ between epochs and repeat on resume."""
    from deepmetric.data import make_loader

    return make_loader(dataset, batch_sampler=sampler, num_workers=num_workers, pin_memory=pin,
                       persistent_workers=False, seed=seed)


def _eval_due(cfg: Config, epoch_done: int, total_epochs: int, finished: bool) -> bool:
    if finished or epoch_done == total_epochs:
        return True
    return cfg.eval.every > 0 and epoch_done % cfg.eval.every == 0


# --------------------------------------------------------------------------- the loop
def train(cfg: Config, *, resume: str | os.PathLike | None = None,
          on_eval: Callable[[int, dict, dict], None] | None = None) -> TrainResult:
    """Train according to ``cfg``; ``resume`` continues from a checkpoint (``last.pt``).

    ``on_eval(epoch, metrics, embedded)`` is called on rank 0 after every evaluation (the
    demo uses it to keep embeddings for plots).
    """
    # 1. process set-up ------------------------------------------------------------------
    dist_info = D.init_distributed(cfg.train.device)
    device, rank, world = dist_info.device, dist_info.rank, dist_info.world_size
    main = dist_info.is_main
    tc = cfg.train
    if tc.num_threads is not None:
        torch.set_num_threads(tc.num_threads)
    if tc.amp == "fp16" and device.type != "cuda":
        raise ValueError("config key 'train.amp': fp16 needs a CUDA device (gradient scaler); use bf16 on CPU")
    if tc.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
        if device.type == "cuda":
            torch.backends.cudnn.benchmark = False
    out_dir = Path(tc.out_dir)
    if main:
        out_dir.mkdir(parents=True, exist_ok=True)
    seed_everything(tc.seed)  # identical model/loss initialisation on every rank

    # 2. data ----------------------------------------------------------------------------
    train_ds = build_dataset_split(cfg, cfg.data.train_split, train=True)
    labels = np.asarray(train_ds.labels, dtype=np.int64)
    num_classes = int(getattr(train_ds, "num_classes", int(labels.max()) + 1))
    sampler = _make_sampler(cfg, labels, rank, world)
    batches_per_epoch = len(sampler)
    if batches_per_epoch == 0:
        raise ValueError(f"the training split has too few samples ({len(train_ds)}) for one batch")
    steps_per_epoch = max(batches_per_epoch // tc.grad_accum, 1)
    if tc.epochs is not None:
        total_epochs = tc.epochs
        total_iters = total_epochs * steps_per_epoch
    else:
        total_iters = tc.iterations
        total_epochs = math.ceil(total_iters / steps_per_epoch)
    eval_sets: dict[str, Any] = {}
    if main:
        eval_sets["query"] = build_dataset_split(cfg, cfg.eval.split, train=False)
        if cfg.eval.gallery_split is not None:
            eval_sets["gallery"] = build_dataset_split(cfg, cfg.eval.gallery_split, train=False)

    # 3. model and loss terms ------------------------------------------------------------
    model = build_model(cfg, num_classes=num_classes)
    embedding_dim = _embedding_dim(model, train_ds)
    losses = build_losses(cfg, num_classes=num_classes, embedding_dim=embedding_dim)
    if world > 1 and tc.sync_bn and device.type == "cuda":
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model.to(device)
    losses.to(device)
    if tc.channels_last:
        model.to(memory_format=torch.channels_last)
    if resume is None and main:  # rank 0 only: DDP broadcasts rank 0's parameters below
        for term, loss in zip(cfg.loss, losses):
            if term.init == "class_means":
                init_from_class_means(model, loss, build_dataset_split(cfg, cfg.data.train_split, train=False),
                                      device=device, seed=tc.seed, amp=tc.amp)
    module = TrainingModule(model, losses, cfg.loss, world_size=world, amp=tc.amp, device=device)
    step_module: nn.Module = module
    if world > 1:
        step_module = nn.parallel.DistributedDataParallel(
            module, device_ids=[device.index] if device.type == "cuda" else None)

    # 4. optimiser, schedules, scaler ----------------------------------------------------
    optimizer = build_optimizer(model, losses, cfg.optim)
    lr_schedule = LrSchedule(cfg.schedule.lr, total_epochs=total_epochs, total_iterations=total_iters)
    temperature = TemperatureSchedule(cfg.schedule.temperature, losses)
    scaler = torch.amp.GradScaler("cuda", enabled=(tc.amp == "fp16"))

    # 5. resume --------------------------------------------------------------------------
    epoch, iteration, batch_in_epoch = 0, 0, 0
    epoch_loss_sum, epoch_loss_n = 0.0, 0  # running mean of the current epoch (plateau monitor)
    best = {"metric": cfg.eval.best_metric, "value": None, "epoch": None}
    last_metrics: dict[str, float] = {}
    last_ckpt = out_dir / "last.pt"
    if resume is not None:
        state = load_checkpoint(resume, map_location=device)
        model.load_state_dict(state["model"])
        for loss, ls in zip(losses, state["loss"]):
            loss.load_state_dict(ls)
        for loss, a in zip(losses, state.get("alphas", [])):
            if a is not None and has_alpha(loss):
                set_alpha(loss, a)
        optimizer.load_state_dict(state["optimizer"])
        if state.get("grad_scaler"):
            scaler.load_state_dict(state["grad_scaler"])
        temperature.load_state_dict(state["schedules"]["temperature"])
        lr_schedule.load_state_dict(state["schedules"]["lr"])
        epoch, iteration = int(state["epoch"]), int(state["iteration"])
        batch_in_epoch = int(state.get("batch_in_epoch", 0))
        epoch_loss_sum, epoch_loss_n = float(state["epoch_loss"][0]), int(state["epoch_loss"][1])
        if state.get("sampler") is not None and batch_in_epoch > 0:
            sampler.load_state_dict(state["sampler"])
        best = dict(state.get("best", best))
        last_metrics = dict(state.get("metrics", {}))
        if rank < len(state["rng"]):
            set_rng_state(state["rng"][rank] if isinstance(state["rng"], list) else state["rng"])
        if main:
            _truncate_log(out_dir / "log.jsonl", iteration, epoch)
            print(f"[deepmetric] resumed from {resume}: epoch {epoch}, step {iteration}", flush=True)
        last_ckpt = Path(resume)
    if main:
        save_config(cfg, out_dir / "config.yaml")
    log = _JsonLog(out_dir / "log.jsonl" if main else None)

    def checkpoint_state(epoch_done: int, batch_done: int) -> dict:
        return {
            "model": model.state_dict(),
            "loss": [l.state_dict() for l in losses],
            "alphas": [get_alpha(l) if has_alpha(l) else None for l in losses],
            "optimizer": optimizer.state_dict(),
            "grad_scaler": scaler.state_dict() if scaler.is_enabled() else None,
            "schedules": {"lr": lr_schedule.state_dict(), "temperature": to_safe(temperature.state_dict())},
            "sampler": to_safe(sampler.state_dict(batches_done=batch_done)) if batch_done else None,
            "rng": [get_rng_state()],
            "epoch": epoch_done, "batch_in_epoch": batch_done, "iteration": iteration,
            "epoch_loss": [epoch_loss_sum, epoch_loss_n] if batch_done else [0.0, 0],
            "best": best, "metrics": last_metrics,
            "meta": {"num_classes": num_classes, "embedding_dim": embedding_dim, "world_size": world},
            "config": config_to_dict(cfg),
        }

    def current_alphas() -> list[float]:
        """The temperatures now in force (for the logs): scheduled ones, else the losses' own."""
        return temperature.alphas() or [get_alpha(l) for l in losses if has_alpha(l)]

    def set_learning_rates(ep: int) -> float:
        factor = lr_schedule.factor(ep, iteration) * temperature.lr_factor
        warm_new_only = ep < tc.warmup_epochs and tc.warmup_mode == "new_layers"
        for g in optimizer.param_groups:
            frozen = warm_new_only and g["is_backbone"]
            g["lr"] = 0.0 if frozen else cfg.optim.lr * g["lr_mult"] * factor
        for loss in losses:  # e.g. ALMN centre_rate: lr (Eq. 2's rate is the learning rate)
            if hasattr(loss, "set_learning_rate"):
                loss.set_learning_rate(cfg.optim.lr * factor)
        return cfg.optim.lr * factor

    def run_evaluation(epoch_done: int) -> dict:
        metrics: dict = {}
        if main:
            t0 = time.perf_counter()
            metrics, embedded = evaluate_model(model, eval_sets, cfg, device=device, losses=losses)
            rec = {"type": "eval", "epoch": epoch_done, "step": iteration,
                   "eval_seconds": round(time.perf_counter() - t0, 3), **metrics}
            alphas = current_alphas()
            if alphas:
                rec["alpha"] = alphas[0]
            log.write(rec)
            shown = ", ".join(f"{k}={v:.4f}" for k, v in metrics.items())
            print(f"[deepmetric] epoch {epoch_done} step {iteration}: {shown}", flush=True)
            if on_eval is not None:
                on_eval(epoch_done, metrics, embedded)
        if world > 1:
            box = [metrics]
            torch.distributed.broadcast_object_list(box, src=0)
            metrics = box[0]
        return metrics

    # 6. epochs --------------------------------------------------------------------------
    if resume is None and cfg.eval.at_start:
        last_metrics = run_evaluation(0)
    interrupted = False
    finished = iteration >= total_iters
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency
        tqdm = None
    with GracefulInterrupt() as interrupt:
        while epoch < total_epochs and not finished:
            if batch_in_epoch == 0:
                # Each epoch's randomness is a function of (seed, epoch, rank) only.
                seed_everything(tc.seed + 1_000_003 * (epoch + 1) + 7919 * rank)
            sampler.set_epoch(epoch)
            loader = _make_loader(train_ds, sampler, cfg.data.num_workers, device.type == "cuda",
                                  seed=(tc.seed * 1_000_003 + epoch * 7919 + rank) % 2**63)
            bn_stats_only = epoch < tc.warmup_epochs and tc.warmup_mode == "bn_stats"
            bar = None
            if tqdm is not None and tc.progress and main:
                bar = tqdm(total=batches_per_epoch, initial=batch_in_epoch, desc=f"epoch {epoch + 1}/{total_epochs}",
                           leave=False, dynamic_ncols=True)
            if batch_in_epoch == 0:
                epoch_loss_sum, epoch_loss_n = 0.0, 0
            step_module.train()
            t_step = time.perf_counter()
            images_in_step = 0
            for x, y in loader:
                x = x.to(device, non_blocking=True)
                y = torch.as_tensor(y).to(device, non_blocking=True)
                if tc.channels_last and x.dim() == 4:
                    x = x.contiguous(memory_format=torch.channels_last)
                batch_in_epoch += 1
                images_in_step += x.shape[0] * world

                if bn_stats_only:  # warm-up: update batch-norm statistics, no weight change
                    with torch.no_grad(), autocast_context(device, tc.amp):
                        model(x)
                    if bar is not None:
                        bar.update(1)
                    continue

                accum_index = (batch_in_epoch - 1) % tc.grad_accum
                if accum_index == 0:
                    if temperature.step(epoch, iteration) and main:
                        log.write({"type": "heat_up", "epoch": epoch, "step": iteration,
                                   **temperature.history[-1]})
                    lr = set_learning_rates(epoch)
                total, parts = step_module(x, y)
                loss_value = float(total.detach())
                nonfinite = D.any_true(not math.isfinite(loss_value), device)
                if nonfinite:
                    raise NonFiniteLossError(
                        f"non-finite loss ({loss_value}) at step {iteration + 1} (epoch {epoch + 1}, "
                        f"batch {batch_in_epoch}); training stopped, the last good checkpoint "
                        f"{last_ckpt if last_ckpt.exists() else '(none written yet)'} is intact")
                scaler.scale(total / tc.grad_accum).backward()
                epoch_loss_sum += loss_value
                epoch_loss_n += 1
                if bar is not None:
                    bar.update(1)
                if accum_index != tc.grad_accum - 1 and batch_in_epoch != batches_per_epoch:
                    continue
                if tc.grad_clip is not None:
                    scaler.unscale_(optimizer)
                    torch.nn.utils.clip_grad_norm_([p for g in optimizer.param_groups for p in g["params"]],
                                                   tc.grad_clip)
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                iteration += 1

                now = time.perf_counter()
                ips = images_in_step / max(now - t_step, 1e-9)
                t_step, images_in_step = now, 0
                alphas = current_alphas()
                rec = {"type": "step", "step": iteration, "epoch": epoch + batch_in_epoch / batches_per_epoch,
                       "loss": loss_value, "lr": lr, "images_per_s": round(ips, 2)}
                if len(parts) > 1:
                    rec.update({f"loss/{i}_{n}": float(p.detach()) for i, (n, p) in
                                enumerate(zip(module.names, parts))})
                if alphas:
                    rec["alpha"] = alphas[0]
                log.write(rec)
                if bar is not None:
                    post = {"loss": f"{loss_value:.4f}", "lr": f"{lr:.2e}", "img/s": f"{ips:.0f}"}
                    if alphas:
                        post["alpha"] = f"{alphas[0]:.3g}"
                    bar.set_postfix(post, refresh=False)

                if iteration >= total_iters:
                    finished = True
                    break
                if D.any_true(interrupt.requested, device):
                    interrupted = True
                    break
            if bar is not None:
                bar.close()

            if interrupted:
                if main:
                    save_checkpoint(checkpoint_state(epoch, batch_in_epoch), out_dir / "last.pt")
                    print(f"[deepmetric] interrupted at step {iteration}; checkpoint saved to "
                          f"{out_dir / 'last.pt'} (continue with --resume {out_dir / 'last.pt'})", flush=True)
                break

            # 7. end of epoch: plateau monitor, evaluation, checkpoints -------------------
            epoch += 1
            batch_in_epoch = 0
            mean_loss = D.all_reduce_mean(epoch_loss_sum / max(epoch_loss_n, 1), device)
            if epoch_loss_n and cfg.schedule.temperature.monitor == "train_loss":
                if temperature.observe(mean_loss, epoch, iteration) and main:
                    log.write({"type": "heat_up", "epoch": epoch, "step": iteration, **temperature.history[-1]})
            if _eval_due(cfg, epoch, total_epochs, finished):
                last_metrics = run_evaluation(epoch)
                key = cfg.eval.best_metric
                if key not in last_metrics:
                    raise ValueError(f"config key 'eval.best_metric': {key!r} is not among the "
                                     f"evaluated metrics {sorted(last_metrics)}")
                value = last_metrics[key]
                if cfg.schedule.temperature.monitor != "train_loss":
                    mon = cfg.schedule.temperature.monitor
                    if cfg.schedule.temperature.name == "auto_plateau" and mon not in last_metrics:
                        raise ValueError(f"config key 'schedule.temperature.monitor': {mon!r} is not "
                                         f"among the evaluated metrics {sorted(last_metrics)}")
                    if mon in last_metrics and temperature.observe(last_metrics[mon], epoch, iteration) and main:
                        log.write({"type": "heat_up", "epoch": epoch, "step": iteration,
                                   **temperature.history[-1]})
                is_best = best["value"] is None or value > best["value"]
                if is_best:
                    best = {"metric": key, "value": value, "epoch": epoch}
                if main and is_best:
                    save_checkpoint(checkpoint_state(epoch, 0), out_dir / "best.pt")
            if main and (epoch % tc.checkpoint_every == 0 or epoch == total_epochs or finished):
                last_ckpt = save_checkpoint(checkpoint_state(epoch, 0), out_dir / "last.pt")
            D.barrier()

    log.close()
    if main and not interrupted:
        summary = {"metrics": last_metrics, "best": best, "epochs": epoch, "steps": iteration,
                   "heat_ups": temperature.history}
        (out_dir / "metrics.json").write_text(json.dumps(summary, indent=2, default=float))
    D.cleanup_distributed(dist_info)
    return TrainResult(out_dir, last_metrics, best, epoch, iteration, interrupted)


def train_from_config_file(path: str, overrides: list[str] | None = None, resume: str | None = None) -> TrainResult:
    from .config import load_config

    return train(load_config(path, overrides), resume=resume)
