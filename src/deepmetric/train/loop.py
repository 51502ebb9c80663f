"""The training loop, readable top to bottom.

``train(cfg)`` does, in order:

1. set up the process (torchrun/DDP from the environment, device, seed, run directory);
2. build the data: training split, batch sampler (random or m x n class-balanced, sharded
   over ranks), evaluation split(s) (``deepmetric.train.builders``);
3. build the model and the weighted loss terms (e.g. CE + lambda x triplet), wrap both in
   one ``TrainingModule`` (and in DDP when distributed, so classifier-loss parameters are
   synchronised with the model's);
4. build the optimiser parameter groups (backbone lr, new-layer multiplier, loss params),
   the lr schedule and the temperature (heating-up) schedule, the fp16 gradient scaler;
5. resume from a checkpoint if asked (``checkpoint.restore``: module states, schedules,
   sampler position, RNG states and the ``TrainState`` counters);
6. for every epoch: re-seed, ``sampler.set_epoch``, and for every batch: fire due heating-up
   events, set the learning rates, forward under autocast, weighted loss, backward (with
   gradient accumulation and the fp16 scaler), step; log every step as JSON lines; stop
   cleanly on Ctrl-C (checkpoint first) or a non-finite loss (no checkpoint written);
7. at epoch end: evaluate when due (zero-shot retrieval/clustering with
   ``deepmetric.evaluate``) on the validation split (``data.val_classes`` / ``val_folds``) and the test
   split, feed ``auto_plateau``, keep ``best.pt`` (best validation metric), stop early when
   asked, save ``last.pt``.  The test split is logged, never used to choose anything.  The
   last epoch's ``last.pt`` is written before its evaluation runs, so a failing evaluation
   never loses the training (``--resume`` then only evaluates).

Before the first step (``deepmetric.train.preflight``) the config's option names and metric
names are checked, every image of every split has its header read, and the model runs on two
training images; rank 0 prints a summary of the run (``deepmetric.train.summary``), warnings
(small images enlarged, very few training classes) and the baselines (``eval.baselines``: the
network at epoch 0 and, for images up to 64 x 64, raw pixels, on the test split).  After the
last step it prints the final metrics, the time and the paths of what was written.

Files in ``train.out_dir``: ``config.yaml`` (resolved), ``log.jsonl`` (one ``{"type":
"step"}`` record per optimisation step, one ``{"type": "eval", "split": "val"|"test"}`` per
evaluation, one ``{"type": "heat_up"}`` per temperature event, one ``{"type":
"early_stop"}``, one ``{"type": "baseline"}`` per baseline), ``last.pt``, ``best.pt`` (only
with a validation split), ``metrics.json`` (with ``baselines`` and ``warnings``).  Only
rank 0 writes.
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from . import distributed as D
from . import preflight as P
from .amp import autocast_context, check_amp
from .batches import make_train_loader
from .builders import (VAL_SPLIT, build_dataset, build_losses, build_model, build_sampler,
                       embedding_dim_of, seed_everything)
from .checkpoint import (GracefulInterrupt, Trainables, TrainState, checkpoint_dict, load_checkpoint,
                         restore, save_checkpoint)
from .config import Config, config_diff, config_to_dict, save_config
from .embed import cross_domain_metrics, evaluate_model, train_neighbour_metrics
from .module import PAIR_BASED_LOSSES, TrainingModule, init_from_class_means
from .optim import build_optimizer
from .schedules import LrSchedule, TemperatureSchedule, get_alpha, has_alpha
from .summary import format_baseline, format_run_end, format_run_summary

#: The builders' old names, still importable from here.
build_dataset_split = build_dataset

__all__ = ["train", "TrainResult", "RunDirectoryError", "prepare_run_dir", "TrainingModule", "NonFiniteLossError", "build_dataset_split",
           "build_model", "build_losses", "seed_everything", "init_from_class_means",
           "PAIR_BASED_LOSSES"]


class NonFiniteLossError(RuntimeError):
    """Training produced a NaN/inf loss; the message names the step and the last checkpoint."""


@dataclass
class TrainResult:
    """What ``train`` returns; the same fields as ``metrics.json``."""

    out_dir: Path
    metrics: dict[str, float]           # final test metrics (= final["test"])
    final: dict[str, dict]              # {"test": {...}, "val": {...} with a validation split}
    selected: dict[str, Any] | None     # best.pt: {"epoch", "metric", "value" (val), "test"}
    epochs_completed: int
    iteration: int
    heat_ups: list = field(default_factory=list)
    wall_time_s: float = 0.0
    train_images_per_s: float = 0.0
    interrupted: bool = False


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


def _rewrite_log(path: Path, drop) -> None:
    """Rewrite the JSON-lines log without the records for which ``drop(record)`` is true, and
    without a truncated last line (a run killed while writing it)."""
    if not path.is_file():
        return
    keep = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not drop(rec):
            keep.append(line)
    path.write_text("".join(l + "\n" for l in keep), encoding="utf-8")


def _truncate_log(path: Path, iteration: int, epoch: int) -> None:
    """On resume drop the records a killed run wrote after its last checkpoint."""
    _rewrite_log(path, lambda rec: (rec.get("type") == "step" and rec.get("step", 0) > iteration)
                 or (rec.get("type") in ("eval", "heat_up") and rec.get("epoch", 0) > epoch))


def _final_evaluation_saved(records: list[dict], epoch: int, splits: list[str], test_metrics: dict) -> bool:
    """Whether epoch ``epoch`` was evaluated on every split and the checkpoint's test metrics
    are that evaluation's (not an earlier one's)."""
    at = {r.get("split"): r for r in records if r.get("type") == "eval" and r.get("epoch") == epoch}
    if not splits or not set(splits) <= set(at) or not test_metrics:
        return False
    return all(at["test"].get(k) == v for k, v in test_metrics.items())


def _drop_eval_records(path: Path, epoch: int) -> None:
    """Remove a partial evaluation's records of ``epoch`` (it is about to be redone)."""
    _rewrite_log(path, lambda rec: rec.get("type") == "eval" and rec.get("epoch") == epoch)


def _read_log(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def _baselines_from_log(path: Path) -> dict[str, dict]:
    """The ``{"type": "baseline"}`` records of a resumed run, as ``compute_baselines`` returns them."""
    out = {}
    for rec in _read_log(path):
        if rec.get("type") == "baseline":
            rest = {k: v for k, v in rec.items() if k not in ("type", "name", "label", "epoch", "step", "skipped")}
            out[rec["name"]] = ({"label": rec.get("label"), "skipped": rec["skipped"]} if "skipped" in rec
                                else {"label": rec.get("label"), "metrics": rest})
    return out


#: What a run writes into its directory (``--overwrite`` removes these and nothing else).
RUN_FILES = ("config.yaml", "log.jsonl", "last.pt", "best.pt", "metrics.json")


class RunDirectoryError(ValueError):
    """A new run was pointed at a directory that already holds files."""


def prepare_run_dir(out_dir: Path, *, resume, overwrite: bool) -> None:
    """Create ``out_dir``.  A new run refuses a non-empty directory (the report would mix
    runs) unless ``overwrite`` (the previous run's files are removed) or ``resume``."""
    if out_dir.exists() and not out_dir.is_dir():
        raise RunDirectoryError(f"config key 'train.out_dir': {out_dir} is a file, not a directory")
    existing = sorted(p.name for p in out_dir.iterdir()) if out_dir.is_dir() else []
    if existing and resume is None:
        if not overwrite:
            shown = ", ".join(existing[:5]) + (", ..." if len(existing) > 5 else "")
            hint = f" --resume {out_dir / 'last.pt'}" if (out_dir / "last.pt").is_file() else ""
            raise RunDirectoryError(
                f"run directory {out_dir} is not empty ({shown}); a new run would mix its log and "
                f"checkpoints with the old ones. Continue the old run with{hint or ' --resume CHECKPOINT'}, "
                f"replace it with --overwrite (train(cfg, overwrite=True)), or choose another "
                f"train.out_dir=...")
        for name in RUN_FILES:
            (out_dir / name).unlink(missing_ok=True)
        for tmp in out_dir.glob(".*.pt.*.tmp"):  # left by a killed save
            tmp.unlink(missing_ok=True)
    out_dir.mkdir(parents=True, exist_ok=True)


def _configure_torch(tc, device: torch.device) -> None:
    """Threads, precision check and determinism, decided once before anything is built."""
    if tc.num_threads is not None:
        torch.set_num_threads(tc.num_threads)
    check_amp(device, tc.amp)
    if tc.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
        if device.type == "cuda":
            torch.backends.cudnn.benchmark = False


def _run_length(tc, batches_per_epoch: int) -> tuple[int, int]:
    """``(total_epochs, total_iterations)`` from ``train.epochs`` or ``train.iterations``."""
    steps_per_epoch = max(batches_per_epoch // tc.grad_accum, 1)
    if tc.epochs is not None:
        return tc.epochs, tc.epochs * steps_per_epoch
    return math.ceil(tc.iterations / steps_per_epoch), tc.iterations


def _eval_due(cfg: Config, epoch_done: int, total_epochs: int, finished: bool) -> bool:
    if finished or epoch_done == total_epochs:
        return True
    return cfg.eval.every > 0 and epoch_done % cfg.eval.every == 0


def current_alphas(temperature: TemperatureSchedule, losses: nn.ModuleList) -> list[float]:
    """The temperatures now in force (for the logs): scheduled ones, else the losses' own."""
    return temperature.alphas() or [get_alpha(l) for l in losses if has_alpha(l)]


def set_learning_rates(optimizer: torch.optim.Optimizer, cfg: Config, factor: float, epoch: int,
                       losses=()) -> float:
    """``lr = optim.lr * group.lr_mult * factor`` for every group (backbone 0 during a
    ``new_layers`` warm-up); losses that follow the learning rate (ALMN ``centre_rate: lr``:
    Eq. 2's rate is the learning rate) get the base lr too.  Returns ``optim.lr * factor``."""
    tc = cfg.train
    warm_new_only = epoch < tc.warmup_epochs and tc.warmup_mode == "new_layers"
    for g in optimizer.param_groups:
        frozen = warm_new_only and g["is_backbone"]
        g["lr"] = 0.0 if frozen else cfg.optim.lr * g["lr_mult"] * factor
    for loss in losses:
        if hasattr(loss, "set_learning_rate"):
            loss.set_learning_rate(cfg.optim.lr * factor)
    return cfg.optim.lr * factor


class Evaluator:
    """Evaluate the model on the evaluation splits (``{"val": sets, "test": sets}``, each
    ``{"query": ds}`` or ``{"query": ds, "gallery": ds}``), log and print the metrics
    (rank 0) and share them with every rank.  ``evaluator(epoch, iteration, alphas)``
    returns ``{"val": metrics, "test": metrics}`` (``"val"`` only with a validation split).
    ``on_eval`` sees the test evaluations."""

    def __init__(self, model: nn.Module, losses: nn.ModuleList, eval_sets: dict, cfg: Config, *,
                 device: torch.device, world: int, log: _JsonLog,
                 on_eval: Callable[[int, dict, dict], None] | None):
        self.model, self.losses, self.eval_sets, self.cfg = model, losses, eval_sets, cfg
        self.device, self.world, self.log, self.on_eval = device, world, log, on_eval

    def __call__(self, epoch: int, iteration: int, alphas: list[float], final: bool = False) -> dict[str, dict]:
        results: dict[str, dict] = {}
        ec = self.cfg.eval
        for split, sets in self.eval_sets.items():  # rank 0 holds the evaluation splits
            t0 = time.perf_counter()
            metrics, embedded = evaluate_model(self.model, sets, self.cfg, device=self.device,
                                               losses=self.losses)
            if split == "test" and ec.cross_domain:
                metrics.update(cross_domain_metrics(embedded, sets["query"], self.cfg))
            if split == "test" and ec.train_neighbours and final:  # 1 pass over the training set
                metrics.update(train_neighbour_metrics(self.model, embedded, self.cfg, device=self.device))
            rec = {"type": "eval", "split": split, "epoch": epoch, "step": iteration,
                   "eval_seconds": round(time.perf_counter() - t0, 3), **metrics}
            if alphas:
                rec["alpha"] = alphas[0]
            self.log.write(rec)
            shown = ", ".join(f"{k}={v:.4f}" for k, v in metrics.items())
            print(f"[deepmetric] epoch {epoch} step {iteration} {split}: {shown}", flush=True)
            if split == "test" and self.on_eval is not None:
                self.on_eval(epoch, metrics, embedded)
            results[split] = metrics
        if self.world > 1:
            box = [results]
            torch.distributed.broadcast_object_list(box, src=0)
            results = box[0]
        return results


def _check_metric(key: str, cfg_key: str, metrics: dict) -> None:
    if key not in metrics:
        raise ValueError(f"config key '{cfg_key}': {key!r} is not among the evaluated metrics "
                         f"{sorted(metrics)}")


# --------------------------------------------------------------------------- the loop
def train(cfg: Config, *, resume: str | os.PathLike | None = None, overwrite: bool = False,
          on_eval: Callable[[int, dict, dict], None] | None = None) -> TrainResult:
    """Train according to ``cfg``; ``resume`` continues from a checkpoint (``last.pt``).

    A new run refuses a non-empty ``train.out_dir`` unless ``overwrite=True`` (which
    removes the previous run's files) or ``resume`` is given.

    ``on_eval(epoch, metrics, embedded)`` is called on rank 0 after every evaluation (the
    demo uses it to keep embeddings for plots).
    """
    # 1. process set-up ------------------------------------------------------------------
    tc = cfg.train
    P.check_config(cfg)  # option and metric names: fail before anything is built
    dist_info = D.init_distributed(tc.device)
    device, rank, world, main = dist_info.device, dist_info.rank, dist_info.world_size, dist_info.is_main
    _configure_torch(tc, device)
    out_dir = Path(tc.out_dir)
    refused = None
    if main:
        try:
            prepare_run_dir(out_dir, resume=resume, overwrite=overwrite)
        except RunDirectoryError as exc:
            refused = exc
    if D.any_true(refused is not None, device):  # every rank stops, before anything is written
        raise refused or RunDirectoryError(f"rank 0 refused the run directory {out_dir}")
    resume_ckpt = load_checkpoint(resume, map_location=device) if resume is not None else None  # a bad file fails first
    seed_everything(tc.seed)  # identical model/loss initialisation on every rank

    # 2. data ----------------------------------------------------------------------------
    train_ds = build_dataset(cfg, cfg.data.train_split, train=True)
    labels = np.asarray(train_ds.labels, dtype=np.int64)
    num_classes = int(getattr(train_ds, "num_classes", int(labels.max()) + 1))
    sampler = build_sampler(cfg, labels, rank, world)
    batches_per_epoch = len(sampler)
    if batches_per_epoch == 0:
        raise ValueError(f"the training split has too few samples ({len(train_ds)}) for one batch")
    total_epochs, total_iters = _run_length(tc, batches_per_epoch)
    has_val = cfg.data.has_validation
    select_key = (cfg.eval.best_metric or "recall@1") if has_val else None
    eval_sets: dict[str, dict] = {}
    if main:
        if has_val:
            eval_sets["val"] = {"query": build_dataset(cfg, VAL_SPLIT, train=False)}
        eval_sets["test"] = {"query": build_dataset(cfg, cfg.eval.split, train=False)}
        if cfg.eval.gallery_split is not None:
            eval_sets["test"]["gallery"] = build_dataset(cfg, cfg.eval.gallery_split, train=False)

    # 3. model and loss terms ------------------------------------------------------------
    model = build_model(cfg, num_classes=num_classes)
    # pre-flight: image headers of every split, the model on two training images.  Rank 0 alone
    # checks the evaluation splits, so a failure is shared before the ranks meet in DDP.
    preflight_error: Exception | None = None
    try:
        input_shape, run_warnings = P.check_run(cfg, model, train_ds, eval_sets)
    except (ValueError, OSError) as exc:
        preflight_error = exc
    if D.any_true(preflight_error is not None, device):
        raise preflight_error or RuntimeError("pre-flight checks failed on another rank (see its message)")
    embedding_dim = embedding_dim_of(model, train_ds)
    losses = build_losses(cfg, num_classes=num_classes, embedding_dim=embedding_dim)
    if world > 1 and tc.sync_bn and device.type == "cuda":
        model = D.convert_sync_batchnorm(model)  # keeps the BN head's learned shift
    model.to(device)
    losses.to(device)
    if tc.channels_last:
        model.to(memory_format=torch.channels_last)
    if main:
        print(format_run_summary(cfg, train_set=train_ds, eval_sets=eval_sets, model=model, losses=losses,
                                 embedding_dim=embedding_dim, input_shape=input_shape, device=device,
                                 world=world, threads=torch.get_num_threads(),
                                 steps_per_epoch=max(batches_per_epoch // tc.grad_accum, 1),
                                 total_epochs=total_epochs, total_steps=total_iters, out_dir=out_dir), flush=True)
        for w in run_warnings:
            print(f"[deepmetric] warning: {w}", flush=True)
    if resume is None and main:  # rank 0 only: DDP broadcasts rank 0's parameters below
        for term, loss in zip(cfg.loss, losses):
            if term.init == "class_means":
                init_from_class_means(model, loss, build_dataset(cfg, cfg.data.train_split, train=False),
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
    objs = Trainables(model, losses, optimizer, scaler, lr_schedule, temperature, sampler)
    model_args = {"num_classes": num_classes, "embedding_dim": embedding_dim, "world_size": world}
    config_dict = config_to_dict(cfg)

    # 5. resume --------------------------------------------------------------------------
    state = TrainState(best={"metric": select_key, "value": None, "epoch": None, "test": None})
    last_ckpt = out_dir / "last.pt"
    if resume is not None:
        ckpt = resume_ckpt
        state = restore(ckpt, objs, rank=rank, config=config_dict, path=resume)
        if main:
            _truncate_log(out_dir / "log.jsonl", state.iteration, state.epoch)
            print(f"[deepmetric] resumed from {resume}: epoch {state.epoch}, step {state.iteration}", flush=True)
            changed = [f"{k} {a!r} -> {b!r}" for k, a, b in config_diff(ckpt["config"], config_dict)]
            if changed:
                print(f"[deepmetric] resuming with changed config keys: {', '.join(changed)}", flush=True)
        del ckpt
        last_ckpt = Path(resume)
    if main:
        save_config(cfg, out_dir / "config.yaml")
    log = _JsonLog(out_dir / "log.jsonl" if main else None)
    evaluate = Evaluator(model, losses, eval_sets, cfg, device=device, world=world, log=log, on_eval=on_eval)

    t_start, wall_before = time.perf_counter(), state.wall_time_s

    def save(path: Path) -> Path:
        state.wall_time_s = wall_before + time.perf_counter() - t_start
        return save_checkpoint(checkpoint_dict(state, objs, model_args=model_args, config=config_dict), path)

    def choose_best(epoch: int) -> None:
        """After a validation evaluation: update ``state.best`` and write ``best.pt``."""
        value = state.val_metrics[select_key]
        if state.best["value"] is None or value > state.best["value"]:
            state.best = {"metric": select_key, "value": value, "epoch": epoch, "test": dict(state.metrics)}
            if main:
                save(out_dir / "best.pt")

    # 6. epochs --------------------------------------------------------------------------
    baselines: dict[str, dict] = {}
    if resume is None:
        at_start = None
        if cfg.eval.at_start:
            results = evaluate(0, 0, current_alphas(temperature, losses))
            state.metrics, state.val_metrics = results.get("test", {}), results.get("val", {})
            at_start = state.metrics
        if cfg.eval.baselines and main:
            baselines = P.compute_baselines(model, losses, eval_sets["test"], cfg, device=device,
                                            at_start=at_start)
            for name, b in baselines.items():
                print(format_baseline(b["label"], b.get("metrics"), b.get("skipped", "")), flush=True)
                extra = {"skipped": b["skipped"]} if "skipped" in b else b["metrics"]
                log.write({"type": "baseline", "name": name, "label": b["label"], "split": "test",
                           "epoch": 0, "step": 0, **extra})
    elif main:
        baselines = _baselines_from_log(out_dir / "log.jsonl")
    interrupted = False
    finished = state.iteration >= total_iters or state.stopped_early
    if resume is not None and finished:
        # The last epoch's checkpoint is written before its evaluation: a run killed during (or
        # right after) that evaluation resumes here with the previous evaluation's metrics.
        # Evaluate again unless the log holds this epoch's records of every split and the
        # checkpoint already carries their test metrics.
        evaluated = main and _final_evaluation_saved(_read_log(out_dir / "log.jsonl"), state.epoch,
                                                     list(eval_sets), state.metrics)
        if main and not evaluated:
            _drop_eval_records(out_dir / "log.jsonl", state.epoch)
        if D.any_true(main and not evaluated, device):
            results = evaluate(state.epoch, state.iteration, current_alphas(temperature, losses), final=True)
            state.metrics, state.val_metrics = results["test"], results.get("val", {})
            if has_val:
                _check_metric(select_key, "eval.best_metric", state.val_metrics)
                choose_best(state.epoch)
            if main:
                last_ckpt = save(out_dir / "last.pt")
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency
        tqdm = None
    with GracefulInterrupt() as interrupt:
        while state.epoch < total_epochs and not finished:
            epoch = state.epoch
            if state.batch_in_epoch == 0:
                # Each epoch's randomness is a function of (seed, epoch, rank) only.
                seed_everything(tc.seed + 1_000_003 * (epoch + 1) + 7919 * rank)
            sampler.set_epoch(epoch)
            # augmentation seeded by each sample's position: exact resume with loader workers
            loader = make_train_loader(train_ds, sampler, epoch=epoch, start=state.batch_in_epoch,
                                       run_seed=tc.seed, rank=rank, num_workers=cfg.data.num_workers,
                                       pin_memory=device.type == "cuda")
            bn_stats_only = epoch < tc.warmup_epochs and tc.warmup_mode == "bn_stats"
            bar = None
            if tqdm is not None and tc.progress and main:
                bar = tqdm(total=batches_per_epoch, initial=state.batch_in_epoch,
                           desc=f"epoch {epoch + 1}/{total_epochs}", leave=False, dynamic_ncols=True)
            step_module.train()
            t_epoch = t_step = time.perf_counter()
            images_in_step = 0
            for x, y in loader:
                x = x.to(device, non_blocking=True)
                y = torch.as_tensor(y).to(device, non_blocking=True)
                if tc.channels_last and x.dim() == 4:
                    x = x.contiguous(memory_format=torch.channels_last)
                state.batch_in_epoch += 1
                images_in_step += x.shape[0] * world
                state.train_images += x.shape[0] * world

                if bn_stats_only:  # warm-up: update batch-norm statistics, no weight change
                    with torch.no_grad(), autocast_context(device, tc.amp):
                        model(x)
                    if bar is not None:
                        bar.update(1)
                    continue

                accum_index = (state.batch_in_epoch - 1) % tc.grad_accum
                if accum_index == 0:
                    if temperature.step(epoch, state.iteration) and main:
                        log.write({"type": "heat_up", "epoch": epoch, "step": state.iteration,
                                   **temperature.history[-1]})
                    lr = set_learning_rates(optimizer, cfg, lr_schedule.factor(epoch, state.iteration)
                                            * temperature.lr_factor, epoch, losses)
                total, parts = step_module(x, y)
                loss_value = float(total.detach())
                if D.any_true(not math.isfinite(loss_value), device):
                    raise NonFiniteLossError(
                        f"non-finite loss ({loss_value}) at step {state.iteration + 1} (epoch {epoch + 1}, "
                        f"batch {state.batch_in_epoch}); training stopped, the last good checkpoint "
                        f"{last_ckpt if last_ckpt.exists() else '(none written yet)'} is intact")
                scaler.scale(total / tc.grad_accum).backward()
                state.epoch_loss_sum += loss_value
                state.epoch_loss_n += 1
                if bar is not None:
                    bar.update(1)
                if accum_index != tc.grad_accum - 1 and state.batch_in_epoch != batches_per_epoch:
                    continue
                if tc.grad_clip is not None:
                    scaler.unscale_(optimizer)
                    torch.nn.utils.clip_grad_norm_([p for g in optimizer.param_groups for p in g["params"]],
                                                   tc.grad_clip)
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                state.iteration += 1

                now = time.perf_counter()
                ips = images_in_step / max(now - t_step, 1e-9)
                t_step, images_in_step = now, 0
                alphas = current_alphas(temperature, losses)
                rec = {"type": "step", "step": state.iteration,
                       "epoch": epoch + state.batch_in_epoch / batches_per_epoch,
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

                if state.iteration >= total_iters:
                    finished = True
                    break
                if D.any_true(interrupt.requested, device):
                    interrupted = True
                    break
            if bar is not None:
                bar.close()
            state.train_seconds += time.perf_counter() - t_epoch

            if interrupted:
                if main:
                    save(out_dir / "last.pt")
                    print(f"[deepmetric] interrupted at step {state.iteration}; checkpoint saved to "
                          f"{out_dir / 'last.pt'} (continue with --resume {out_dir / 'last.pt'})", flush=True)
                break

            # 7. end of epoch: plateau monitor, evaluation, checkpoints -------------------
            state.epoch = epoch = epoch + 1
            state.batch_in_epoch = 0
            mean_loss = D.all_reduce_mean(state.epoch_loss_sum / max(state.epoch_loss_n, 1), device)
            had_steps = state.epoch_loss_n > 0
            state.epoch_loss_sum, state.epoch_loss_n = 0.0, 0
            monitor = cfg.schedule.temperature.monitor
            if had_steps and monitor == "train_loss":
                if temperature.observe(mean_loss, epoch, state.iteration) and main:
                    log.write({"type": "heat_up", "epoch": epoch, "step": state.iteration,
                               **temperature.history[-1]})
            if main and (epoch == total_epochs or finished):
                last_ckpt = save(out_dir / "last.pt")  # the training is safe before evaluation runs
            due = _eval_due(cfg, epoch, total_epochs, finished)
            if due:
                results = evaluate(epoch, state.iteration, current_alphas(temperature, losses),
                                   final=epoch == total_epochs or finished)
                state.metrics, state.val_metrics = results["test"], results.get("val", {})
            if due and has_val:  # choose on validation metrics only
                _check_metric(select_key, "eval.best_metric", state.val_metrics)
                if monitor != "train_loss":
                    if cfg.schedule.temperature.name == "auto_plateau":
                        _check_metric(monitor, "schedule.temperature.monitor", state.val_metrics)
                    if monitor in state.val_metrics and temperature.observe(
                            state.val_metrics[monitor], epoch, state.iteration) and main:
                        log.write({"type": "heat_up", "epoch": epoch, "step": state.iteration,
                                   **temperature.history[-1]})
                choose_best(epoch)
                patience = cfg.eval.early_stop_patience
                if patience is not None and epoch - state.best["epoch"] >= patience and not finished:
                    finished = state.stopped_early = True
                    log.write({"type": "early_stop", "epoch": epoch, "step": state.iteration,
                               "best_epoch": state.best["epoch"], select_key: state.best["value"]})
                    if main:
                        print(f"[deepmetric] early stop at epoch {epoch}: validation {select_key} has not "
                              f"improved for {patience} epoch(s) since epoch {state.best['epoch']}", flush=True)
            if main and (epoch % tc.checkpoint_every == 0 or epoch == total_epochs or finished):
                last_ckpt = save(out_dir / "last.pt")
            D.barrier()

    log.close()
    selected = None
    if has_val and state.best.get("value") is not None:
        selected = {k: state.best[k] for k in ("epoch", "metric", "value", "test")}
    final = {"test": state.metrics, **({"val": state.val_metrics} if has_val else {})}
    state.wall_time_s = wall_before + time.perf_counter() - t_start
    result = TrainResult(out_dir, state.metrics, final, selected, state.epoch, state.iteration,
                         heat_ups=list(temperature.history), wall_time_s=round(state.wall_time_s, 3),
                         train_images_per_s=round(state.train_images / max(state.train_seconds, 1e-9), 2),
                         interrupted=interrupted)
    if main and not interrupted:
        summary = {"metrics": result.metrics, "final": result.final, "selected": result.selected,
                   "epochs": result.epochs_completed, "steps": result.iteration, "heat_ups": result.heat_ups,
                   "wall_time_s": result.wall_time_s, "train_images_per_s": result.train_images_per_s,
                   "baselines": baselines, "warnings": run_warnings}
        (out_dir / "metrics.json").write_text(json.dumps(summary, indent=2, default=float))
        print(format_run_end(metrics=state.metrics, val_metrics=state.val_metrics if has_val else None,
                             best=state.best, key=select_key or "recall@1", seconds=result.wall_time_s,
                             epochs=state.epoch, steps=state.iteration, out_dir=out_dir,
                             baselines=baselines), flush=True)
    D.cleanup_distributed(dist_info)
    return result


def train_from_config_file(path: str, overrides: list[str] | None = None, resume: str | None = None,
                           overwrite: bool = False) -> TrainResult:
    from .config import load_config

    return train(load_config(path, overrides), resume=resume, overwrite=overwrite)
