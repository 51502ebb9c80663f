"""The training loop, readable top to bottom.

``train(cfg)`` does, in order:

1. set up the process (torchrun/DDP from the environment, device, seed, run directory);
2. build the data: training split, batch sampler (random or m x n class-balanced, sharded
   over ranks), evaluation split(s) (``deepmetric.run.builders``);
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

Before the first step the config's option names and metric names are checked
(``deepmetric.run.config_checks``), every image of every split has its header read, and the model runs on two
training images; rank 0 prints a summary of the run (``deepmetric.train.summary``), warnings
(small images enlarged, very few training classes) and the baselines (``eval.baselines``: the
network at epoch 0 and raw pixels, on the test split, the pixels skipped where too costly).  After the
last step it prints the final metrics, the time and the paths of what was written.

Files in ``train.out_dir``: ``config.yaml`` (resolved), ``log.jsonl`` (one ``{"type":
"step"}`` record per optimisation step, one ``{"type": "eval", "split": "val"|"test"}`` per
evaluation, one ``{"type": "heat_up"}`` per temperature event, one ``{"type":
"early_stop"}``, one ``{"type": "baseline"}`` per baseline), ``last.pt``, ``best.pt`` (only
with a validation split), ``metrics.json`` (with ``baselines`` and ``warnings``).  Only
rank 0 writes.  ``train.loggers`` mirror ``log.jsonl`` in TensorBoard / MLflow
(``deepmetric.train.tracking``): the log hands them every record, each ``last.pt`` and the end.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from deepmetric.run import baselines as B
from deepmetric.run import rundir as R
from deepmetric.run.builders import seed_everything
from deepmetric.run.config import Config
from deepmetric.run.config_io import config_diff, save_config
from deepmetric.run.device import autocast_context
from deepmetric.run.rundir import RunLog

from . import distributed as D
from . import tracking as T
from .batches import make_train_loader
from .evaluator import check_metric, eval_due, test_selected, wise_ft_after_training
from .finetune import linear_probe, linear_probe_epoch
from .loss_stats import loss_step_stats
from .setup import set_up, torch_settings_kept
from .state import GracefulInterrupt, restore
from .summary import baseline_verdict, format_baseline, format_run_end, saturation_warning
from .training_run import TrainingRun

__all__ = ["train", "train_from_config_file", "TrainResult", "NonFiniteLossError", "set_learning_rates"]


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
def set_learning_rates(optimizer: torch.optim.Optimizer, cfg: Config, factor: float, epoch: int,
                       losses=()) -> float:
    """``lr = optim.lr * group.lr_mult * factor`` for every group (backbone 0 during a
    ``new_layers`` or ``linear_probe`` warm-up); losses that follow the learning rate (ALMN ``centre_rate: lr``:
    Eq. 2's rate is the learning rate) get the base lr too.  Returns ``optim.lr * factor``."""
    tc = cfg.train
    warm_new_only = epoch < tc.warmup_epochs and tc.warmup_mode in ("new_layers", "linear_probe")
    for g in optimizer.param_groups:
        frozen = warm_new_only and g["is_backbone"]
        g["lr"] = 0.0 if frozen else cfg.optim.lr * g["lr_mult"] * factor
    for loss in losses:
        if hasattr(loss, "set_learning_rate"):
            loss.set_learning_rate(cfg.optim.lr * factor)
    return cfg.optim.lr * factor


# --------------------------------------------------------------------------- the run's objects
def _resume(run: TrainingRun, resume) -> None:
    """Step 5: restore the checkpoint's states and drop the log records written after it."""
    ckpt, run.resume_ckpt = run.resume_ckpt, None
    run.state = restore(ckpt, run.objs, rank=run.dist_info.rank, config=run.config_dict, path=resume)
    if run.main:
        R.truncate_log(run.out_dir, run.state.iteration, run.state.epoch,
                       heat_ups=len(run.objs.temperature.history))
        print(f"[deepmetric] resumed from {resume}: epoch {run.state.epoch}, step {run.state.iteration}", flush=True)
        changed = [f"{k} {a!r} -> {b!r}" for k, a, b in config_diff(ckpt["config"], run.config_dict)]
        if changed:
            print(f"[deepmetric] resuming with changed config keys: {', '.join(changed)}", flush=True)
    run.last_ckpt = Path(resume)
    if run.finished:
        # The last checkpoint is written before the final evaluation: a run killed during (or
        # right after) it evaluates again, unless the log holds this epoch's records of every
        # split and the checkpoint already carries their test metrics.
        saved = run.main and R.final_evaluation_saved(R.read_log(run.out_dir), run.state.epoch,
                                                      list(run.eval_sets), run.state.metrics if "test" in
                                                      run.eval_sets else run.state.val_metrics)
        if run.main and not saved:
            R.drop_eval_records(run.out_dir, run.state.epoch)  # the partial evaluation's records
        run.reevaluate = D.any_true(run.main and not saved, run.device)


def _open_log(run: TrainingRun, resume) -> None:
    """``config.yaml``, ``log.jsonl`` and the trackers of ``train.loggers`` (rank 0)."""
    trackers, error = [], None
    if run.main:
        save_config(run.cfg, run.out_dir / R.CONFIG)
        try:
            trackers = T.open_trackers(run.cfg, run.out_dir, resumed=resume is not None)
        except Exception as exc:  # shared with every rank before anyone trains
            error = exc
    if D.any_true(error is not None, run.device):
        raise error or RuntimeError("rank 0 could not open the trackers of train.loggers (see its message)")
    run.log = run.evaluate.log = RunLog(run.out_dir / R.LOG if run.main else None, sinks=trackers)


def _log_heat_up(run: TrainingRun, epoch: int) -> None:
    """The one place a ``{"type": "heat_up"}`` record is written (after an event fired)."""
    if run.main:
        run.log.write({"type": "heat_up", "epoch": epoch, "step": run.state.iteration,
                       **run.objs.temperature.history[-1]})


def _baselines(run: TrainingRun, resume) -> None:
    """Before the first step: the untrained network (``eval.at_start``) and the baselines of
    ``eval.baselines``, printed and logged; a resumed run reads them back from its log."""
    cfg, state = run.cfg, run.state
    if resume is not None:
        if run.main:
            run.baselines = R.baselines_from_log(R.read_log(run.out_dir))
        return
    at_start = None
    if cfg.eval.at_start:
        results = run.evaluate(0, 0, run.alphas())
        state.metrics, state.val_metrics = results.get("test", {}), results.get("val", {})
        at_start = state.metrics
    if cfg.eval.baselines and run.main and "test" in run.eval_sets:
        run.baselines = B.compute_baselines(run.model, run.losses, run.eval_sets["test"], cfg, device=run.device,
                                            at_start=at_start)
        for name, b in run.baselines.items():
            print(format_baseline(b["label"], b.get("metrics"), b.get("skipped", "")), flush=True)
            extra = {"skipped": b["skipped"]} if "skipped" in b else b["metrics"]
            run.log.write({"type": "baseline", "name": name, "label": b["label"], "split": "test",
                           "epoch": 0, "step": 0, **extra})


def _warn_saturated(run: TrainingRun, value: float, epoch: int) -> None:
    """Print and keep (metrics.json) the warning of a selection metric at 100 % from the start."""
    val = (run.eval_sets.get("val") or {}).get("query")
    n = len(np.unique(np.asarray(val.labels))) if val is not None else None
    w = saturation_warning(run.select_key, float(value), epoch, n)
    if w is not None and w not in run.warnings:
        run.warnings.append(w)
        print(f"[deepmetric] warning: {w}", flush=True)


def _choose_best(run: TrainingRun, epoch: int, test_evaluated: bool = True) -> None:
    """After a validation evaluation: update ``state.best`` and write ``best.pt``.  The test
    metrics stored with it are this epoch's (None when the test split was not evaluated)."""
    state = run.state
    check_metric(run.select_key, "eval.best_metric", state.val_metrics)
    value = state.val_metrics[run.select_key]
    if state.best["value"] is None and run.main:
        _warn_saturated(run, value, epoch)
    if state.best["value"] is None or value > state.best["value"]:
        state.best = {"metric": run.select_key, "value": value, "epoch": epoch,
                      "test": dict(state.metrics) if test_evaluated else None}
        if run.main:
            run.save(R.BEST)


def _evaluate(run: TrainingRun, epoch: int, final: bool, splits=None) -> None:
    results = run.evaluate(epoch, run.state.iteration, run.alphas(), final=final, splits=splits)
    if "test" in results:
        run.state.metrics = results["test"]
    if "val" in results:
        run.state.val_metrics = results["val"]


def _evaluate_finished_resume(run: TrainingRun) -> None:
    """A finished run resumed whose final evaluation is missing (``_resume``): evaluate it."""
    state = run.state
    _evaluate(run, state.epoch, final=True)
    if run.has_val:
        _choose_best(run, state.epoch)
    if run.main:
        run.last_ckpt = run.save(R.LAST)


def _train_one_epoch(run: TrainingRun, epoch: int, interrupt: GracefulInterrupt) -> str | None:
    """Step 6: the batches of one epoch (from ``state.batch_in_epoch`` on a mid-epoch resume).
    Returns ``"finished"`` (the last step is done), ``"interrupted"`` (Ctrl-C) or None."""
    cfg, tc, state, device = run.cfg, run.cfg.train, run.state, run.device
    world = run.dist_info.world_size
    if state.batch_in_epoch == 0:
        # Each epoch's randomness is a function of (seed, epoch, rank) only.
        seed_everything(tc.seed + 1_000_003 * (epoch + 1) + 7919 * run.dist_info.rank)
    run.sampler.set_epoch(epoch)
    # augmentation seeded by each sample's position: exact resume with loader workers
    loader = make_train_loader(run.train_ds, run.sampler, epoch=epoch, start=state.batch_in_epoch,
                               run_seed=tc.seed, rank=run.dist_info.rank, num_workers=cfg.data.num_workers,
                               pin_memory=device.type == "cuda")
    bn_stats_only = epoch < tc.warmup_epochs and tc.warmup_mode == "bn_stats"
    bar = _progress_bar(run, epoch)
    run.step_module.train()
    t_epoch = time.perf_counter()
    step = {"t": t_epoch, "images": 0, "lr": 0.0}  # the optimiser step in progress
    outcome = None
    for x, y in loader:
        x = x.to(device, non_blocking=True)
        y = torch.as_tensor(y).to(device, non_blocking=True)
        if tc.channels_last and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        state.batch_in_epoch += 1
        step["images"] += x.shape[0] * world
        state.train_images += x.shape[0] * world
        if bar is not None:
            bar.update(1)
        if bn_stats_only:  # warm-up: update batch-norm statistics, no weight change
            with torch.no_grad(), autocast_context(device, tc.amp):
                run.model(x)
            continue
        if not _accumulate(run, epoch, x, y, step):
            continue
        _optimiser_step(run)
        _log_step(run, epoch, step, bar)
        if state.iteration >= run.total_iters:
            outcome = "finished"
            break
        if D.any_true(interrupt.requested, device):
            outcome = "interrupted"
            break
    if bar is not None:
        bar.close()
    state.train_seconds += time.perf_counter() - t_epoch
    return outcome


def _progress_bar(run: TrainingRun, epoch: int):
    """tqdm's bar over the epoch's batches (``train.progress``, rank 0), or None."""
    if not (run.cfg.train.progress and run.main):
        return None
    from tqdm.auto import tqdm

    return tqdm(total=run.batches_per_epoch, initial=run.state.batch_in_epoch,
                desc=f"epoch {epoch + 1}/{run.total_epochs}", leave=False, dynamic_ncols=True)


def _accumulate(run: TrainingRun, epoch: int, x: torch.Tensor, y: torch.Tensor, step: dict) -> bool:
    """One batch's forward and backward pass into the gradients (the schedules advance at the
    first batch of an optimiser step); True when the optimiser step is due (``train.grad_accum``
    batches done, or the epoch's last)."""
    cfg, tc, state, objs, device = run.cfg, run.cfg.train, run.state, run.objs, run.device
    accum_index = (state.batch_in_epoch - 1) % tc.grad_accum
    if accum_index == 0:
        if objs.temperature.step(epoch, state.iteration):
            _log_heat_up(run, epoch)
        step["lr"] = set_learning_rates(objs.optimizer, cfg, objs.lr_schedule.factor(epoch, state.iteration)
                                        * objs.temperature.lr_factor, epoch, run.losses)
    total, parts = run.step_module(x, y)
    loss_value = float(total.detach())
    if D.any_true(not math.isfinite(loss_value), device):
        raise NonFiniteLossError(
            f"non-finite loss ({loss_value}) at step {state.iteration + 1} (epoch {epoch + 1}, "
            f"batch {state.batch_in_epoch}); training stopped, the last good checkpoint "
            f"{run.last_ckpt if run.last_ckpt.exists() else '(none written yet)'} is intact")
    objs.scaler.scale(total / tc.grad_accum).backward()
    state.epoch_loss_sum += loss_value
    state.epoch_loss_n += 1
    step["loss"], step["parts"] = loss_value, parts
    return accum_index == tc.grad_accum - 1 or state.batch_in_epoch == run.batches_per_epoch


def _optimiser_step(run: TrainingRun) -> None:
    """Clip (``train.grad_clip``), step the optimiser through the scaler, zero the gradients."""
    objs, tc = run.objs, run.cfg.train
    if tc.grad_clip is not None:
        objs.scaler.unscale_(objs.optimizer)
        torch.nn.utils.clip_grad_norm_([p for g in objs.optimizer.param_groups for p in g["params"]],
                                       tc.grad_clip)
    objs.scaler.step(objs.optimizer)
    objs.scaler.update()
    objs.optimizer.zero_grad(set_to_none=True)
    run.state.iteration += 1


def _log_step(run: TrainingRun, epoch: int, step: dict, bar) -> None:
    """The ``{"type": "step"}`` record of the optimiser step just done, and the bar's numbers."""
    state = run.state
    now = time.perf_counter()
    ips = step["images"] / max(now - step["t"], 1e-9)
    step["t"], step["images"] = now, 0
    loss_value, parts, lr = step["loss"], step["parts"], step["lr"]
    alphas = run.alphas()
    rec = {"type": "step", "step": state.iteration, "epoch": epoch + state.batch_in_epoch / run.batches_per_epoch,
           "loss": loss_value, "lr": lr, "images_per_s": round(ips, 2)}
    if len(parts) > 1:
        rec.update({f"loss/{i}_{n}": float(p.detach()) for i, (n, p) in enumerate(zip(run.module.names, parts))})
    rec.update(loss_step_stats(run.module.names, run.losses))
    if alphas:
        rec["alpha"] = alphas[0]
    run.log.write(rec)
    if bar is not None:
        post = {"loss": f"{loss_value:.4f}", "lr": f"{lr:.2e}", "img/s": f"{ips:.0f}"}
        if alphas:
            post["alpha"] = f"{alphas[0]:.3g}"
        bar.set_postfix(post, refresh=False)


def _end_of_epoch(run: TrainingRun, epoch: int, finished: bool) -> bool:
    """Step 7 after epoch ``epoch`` (1-based count of epochs done): the plateau monitor, the
    evaluation when due, ``best.pt``, early stopping, ``last.pt``.  Returns ``finished``."""
    cfg, state, temperature = run.cfg, run.state, run.objs.temperature
    state.epoch, state.batch_in_epoch = epoch, 0
    mean_loss = D.all_reduce_mean(state.epoch_loss_sum / max(state.epoch_loss_n, 1), run.device)
    had_steps = state.epoch_loss_n > 0
    state.epoch_loss_sum, state.epoch_loss_n = 0.0, 0
    monitor = cfg.schedule.temperature.monitor
    if had_steps and monitor == "train_loss" and temperature.observe(mean_loss, epoch, state.iteration):
        _log_heat_up(run, epoch)
    last_epoch = epoch == run.total_epochs or finished
    if run.main and last_epoch:
        run.last_ckpt = run.save(R.LAST)  # the training is safe before evaluation runs
    due = eval_due(cfg, epoch, run.total_epochs, finished)
    test_due = (cfg.eval.test and cfg.eval.split is not None
                and eval_due(cfg, epoch, run.total_epochs, finished, split="test"))
    if due or test_due:
        _evaluate(run, epoch, final=last_epoch, splits=[s for s, d in (("val", due), ("test", test_due)) if d])
    if due and run.has_val:  # choose on validation metrics only
        check_metric(run.select_key, "eval.best_metric", state.val_metrics)
        if monitor != "train_loss":
            if cfg.schedule.temperature.name == "auto_plateau":
                check_metric(monitor, "schedule.temperature.monitor", state.val_metrics)
            if monitor in state.val_metrics and temperature.observe(state.val_metrics[monitor], epoch,
                                                                    state.iteration):
                _log_heat_up(run, epoch)
        _choose_best(run, epoch, test_evaluated=test_due)
        if run.on_validation is not None:  # e.g. a tuner's pruner: may raise to stop the run
            run.on_validation(epoch, dict(state.val_metrics))
        patience = cfg.eval.early_stop_patience
        if patience is not None and epoch - state.best["epoch"] >= patience and not finished:
            finished = state.stopped_early = True
            run.log.write({"type": "early_stop", "epoch": epoch, "step": state.iteration,
                           "best_epoch": state.best["epoch"], run.select_key: state.best["value"]})
            if run.main:
                print(f"[deepmetric] early stop at epoch {epoch}: validation {run.select_key} has not "
                      f"improved for {patience} epoch(s) since epoch {state.best['epoch']}", flush=True)
    if run.main and (epoch % cfg.train.checkpoint_every == 0 or epoch == run.total_epochs or finished):
        run.last_ckpt = run.save(R.LAST)
    D.barrier()
    return finished


def _finish(run: TrainingRun, interrupted: bool) -> TrainResult:
    """The result, ``metrics.json`` and the closing lines (rank 0)."""
    state = run.state
    selected = None
    if run.has_val and state.best.get("value") is not None:
        keys = ("epoch", "metric", "value") + (("test",) if "test" in run.eval_sets else ())
        selected = {k: state.best[k] for k in keys}
    final = {**({"test": state.metrics} if "test" in run.eval_sets or not run.main else {}),
             **({"val": state.val_metrics} if run.has_val else {})}
    state.wall_time_s = run.wall_before + time.perf_counter() - run.t_start
    result = TrainResult(run.out_dir, state.metrics, final, selected, state.epoch, state.iteration,
                         heat_ups=list(run.objs.temperature.history), wall_time_s=round(state.wall_time_s, 3),
                         train_images_per_s=round(state.train_images / max(state.train_seconds, 1e-9), 2),
                         interrupted=interrupted)
    if run.main and not interrupted:
        verdict = baseline_verdict(state.metrics, run.baselines, run.select_key or "recall@1")
        if verdict and verdict not in run.warnings:  # kept with the run, not only printed
            run.warnings.append(verdict)
        R.write_metrics(run.out_dir, {
            "metrics": result.metrics, "final": result.final, "selected": result.selected,
            "epochs": result.epochs_completed, "steps": result.iteration, "heat_ups": result.heat_ups,
            "wall_time_s": result.wall_time_s, "train_images_per_s": result.train_images_per_s,
            "baselines": run.baselines, "warnings": run.warnings,
            **({"wise_ft": run.wise_ft} if run.wise_ft is not None else {})})
        print(format_run_end(metrics=state.metrics, val_metrics=state.val_metrics if run.has_val else None,
                             best=state.best, key=run.select_key or "recall@1", seconds=result.wall_time_s,
                             epochs=state.epoch, steps=state.iteration, out_dir=run.out_dir,
                             baselines=run.baselines), flush=True)
    return result


# --------------------------------------------------------------------------- the loop
@torch_settings_kept()  # threads, determinism: the caller's again when the run ends (also after an error)
def train(cfg: Config, *, resume: str | os.PathLike | None = None, overwrite: bool = False,
          on_eval: Callable[[int, dict, dict], None] | None = None,
          on_validation: Callable[[int, dict], None] | None = None, quiet_interrupt: bool = False) -> TrainResult:
    """Train according to ``cfg``; ``resume`` continues from a checkpoint (``last.pt``).

    A new run refuses a non-empty ``train.out_dir`` unless ``overwrite=True`` (which
    removes the previous run's files) or ``resume`` is given.

    ``on_eval(epoch, metrics, embedded)`` is called on rank 0 after every evaluation (the
    demo uses it to keep embeddings for plots).  ``on_validation(epoch, val_metrics)`` is called
    after every validation evaluation, once ``best.pt`` is written; an exception it raises stops
    the run there (``deepmetric tune``'s pruner raises ``optuna.TrialPruned``).
    ``quiet_interrupt``: a Ctrl-C still checkpoints and stops the run (``result.interrupted``)
    but prints nothing: the caller says how to continue (``deepmetric tune``: rerun the command,
    not ``--resume``).
    """
    run = set_up(cfg, resume=resume, overwrite=overwrite, on_eval=on_eval)      # steps 1-4
    run.on_validation = on_validation
    if resume is not None:
        _resume(run, resume)                                                     # step 5
    _open_log(run, resume)
    with run.log:  # closes log.jsonl; an exception closes the trackers' run as failed
        run.t_start, run.wall_before = time.perf_counter(), run.state.wall_time_s
        _baselines(run, resume)
        finished = run.finished
        if run.reevaluate:
            _evaluate_finished_resume(run)
        interrupted = False
        with GracefulInterrupt(quiet=quiet_interrupt) as interrupt:
            while run.state.epoch < run.total_epochs and not finished:         # steps 6-7
                with linear_probe(run.model, active=linear_probe_epoch(run.cfg.train, run.state.epoch)):  # LP-FT
                    outcome = _train_one_epoch(run, run.state.epoch, interrupt)
                if outcome == "interrupted":
                    interrupted = True
                    if run.main:
                        run.save(R.LAST)
                    if run.main and not quiet_interrupt:
                        print(f"[deepmetric] interrupted at step {run.state.iteration}; checkpoint saved to "
                              f"{run.out_dir / R.LAST} (continue with --resume {run.out_dir / R.LAST})",
                              flush=True)
                    break
                finished = _end_of_epoch(run, run.state.epoch + 1, finished=outcome == "finished")
        if not interrupted:
            test_selected(run)
            wise_ft_after_training(run)
            D.barrier()
        result = _finish(run, interrupted)
        run.log.finish(run.out_dir, interrupted=interrupted)  # trackers: final metrics, artifacts
    D.cleanup_distributed(run.dist_info)
    return result


def train_from_config_file(path: str, overrides: list[str] | None = None, resume: str | None = None,
                           overwrite: bool = False) -> TrainResult:
    from deepmetric.run.config_io import load_config

    return train(load_config(path, overrides), resume=resume, overwrite=overwrite)
