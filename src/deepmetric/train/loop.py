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

Before the first step (``deepmetric.train.checks``) the config's option names and metric
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
from torch import nn

from deepmetric.run import baselines as B
from deepmetric.run import rundir as R
from deepmetric.run.builders import (VAL_SPLIT, build_dataset, build_losses, build_model, build_sampler, build_test_sets,
                                     embedding_dim_of, fill_model_input_size, resolve_model_preprocessing,
                                     seed_everything)
from deepmetric.run.checkpoint import load_checkpoint, rng_preserved, save_checkpoint
from deepmetric.run.config import Config, config_to_dict
from deepmetric.run.config_checks import check_config
from deepmetric.run.config_io import config_diff, save_config
from deepmetric.run.device import autocast_context, check_amp
from deepmetric.run.evaluation import evaluate_split, train_neighbour_metrics
from deepmetric.run.rundir import RunDirectoryError, RunLog, prepare_run_dir

from . import distributed as D
from . import tracking as T
from .batches import make_train_loader
from .checks import check_run
from .finetune import linear_probe, linear_probe_epoch, probed_backbone
from .loss_stats import loss_step_stats
from .module import PretrainedTeacher, TrainingModule, init_from_class_means, init_head_from_pca
from .optim import build_optimizer
from .schedules import LrSchedule, TemperatureSchedule, get_alpha, has_alpha
from .state import GracefulInterrupt, Trainables, TrainState, checkpoint_dict, restore
from .summary import baseline_verdict, format_baseline, format_run_end, format_run_summary, saturation_warning

#: The builders' old names, still importable from here.
build_dataset_split = build_dataset
#: What a run writes into its directory (kept for callers of the old name; see rundir).
RUN_FILES = R.RUN_FILES

__all__ = ["train", "TrainResult", "RunDirectoryError", "prepare_run_dir", "TrainingModule", "NonFiniteLossError",
           "build_dataset_split", "build_model", "build_losses", "seed_everything", "init_from_class_means"]


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


def _eval_due(cfg: Config, epoch_done: int, total_epochs: int, finished: bool, split: str = "val") -> bool:
    """Whether ``split`` is evaluated after ``epoch_done`` epochs: always at the end, else every
    ``eval.every`` epochs (the test split every ``eval.test_every``, default the same)."""
    if finished or epoch_done == total_epochs:
        return True
    every = cfg.eval.every if split != "test" or cfg.eval.test_every is None else cfg.eval.test_every
    return every > 0 and epoch_done % every == 0


def current_alphas(temperature: TemperatureSchedule, losses: nn.ModuleList) -> list[float]:
    """The temperatures now in force (for the logs): scheduled ones, else the losses' own."""
    return temperature.alphas() or [get_alpha(l) for l in losses if has_alpha(l)]


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


class Evaluator:
    """Evaluate the model on the evaluation splits (``{"val": sets, "test": sets}``, each
    ``{"query": ds}`` or ``{"query": ds, "gallery": ds}``), log and print the metrics
    (rank 0) and share them with every rank.  ``evaluator(epoch, iteration, alphas)``
    returns ``{"val": metrics, "test": metrics}`` (``"val"`` only with a validation split).
    ``splits`` limits one call to some of the splits (``eval.test_every``).  With
    ``eval.cross_domain`` every split also gets the cross-domain metrics (each domain's queries
    against the other domains' images), so validation mirrors a cross-domain test.
    ``on_eval`` sees the test evaluations."""

    def __init__(self, model: nn.Module, losses: nn.ModuleList, eval_sets: dict, cfg: Config, *,
                 device: torch.device, world: int, log: RunLog,
                 on_eval: Callable[[int, dict, dict], None] | None):
        self.model, self.losses, self.eval_sets, self.cfg = model, losses, eval_sets, cfg
        self.device, self.world, self.log, self.on_eval = device, world, log, on_eval

    def __call__(self, epoch: int, iteration: int, alphas: list[float], final: bool = False,
                 splits=None) -> dict[str, dict]:
        results: dict[str, dict] = {}
        ec = self.cfg.eval
        for split, sets in self.eval_sets.items():  # rank 0 holds the evaluation splits
            if splits is not None and split not in splits:
                continue
            t0 = time.perf_counter()
            metrics, embedded = evaluate_split(self.model, sets, self.cfg, device=self.device, losses=self.losses)
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


# --------------------------------------------------------------------------- the run's objects
@dataclass
class _Run:
    """What the steps of :func:`train` share, built once by :func:`_set_up`."""

    cfg: Config
    dist_info: Any
    out_dir: Path
    train_ds: Any
    sampler: Any
    batches_per_epoch: int
    total_epochs: int
    total_iters: int
    eval_sets: dict
    select_key: str | None          # the validation metric that selects best.pt (None: no validation)
    model: nn.Module
    losses: nn.ModuleList
    module: TrainingModule
    step_module: nn.Module          # the module or its DDP wrapper
    objs: Trainables
    model_args: dict
    config_dict: dict
    warnings: list[str]
    state: TrainState = field(default_factory=TrainState)
    log: RunLog = field(default_factory=lambda: RunLog(None))
    evaluate: Any = None            # an Evaluator
    last_ckpt: Path | None = None   # the last good checkpoint (named in errors)
    baselines: dict = field(default_factory=dict)
    reevaluate: bool = False        # a finished run resumed without its final evaluation
    on_validation: Any = None       # callback(epoch, val_metrics) after each validation
    resume_ckpt: dict | None = None  # the --resume checkpoint, loaded (and checked) first
    pretrained_state: dict | None = None  # the model before the first step (CPU, rank 0; eval.wise_ft, a
                                          # teacher): checkpoints' start_model
    wise_ft: dict | None = None     # eval.wise_ft: metrics.json's "wise_ft" section
    t_start: float = 0.0
    wall_before: float = 0.0

    @property
    def device(self) -> torch.device:
        return self.dist_info.device

    @property
    def main(self) -> bool:
        return self.dist_info.is_main

    @property
    def has_val(self) -> bool:
        return self.select_key is not None

    @property
    def finished(self) -> bool:
        return self.state.iteration >= self.total_iters or self.state.stopped_early

    def alphas(self) -> list[float]:
        return current_alphas(self.objs.temperature, self.losses)

    def save(self, name: str) -> Path:
        """Write checkpoint ``name`` (``last.pt`` / ``best.pt``) of the run so far (rank 0)."""
        self.state.wall_time_s = self.wall_before + time.perf_counter() - self.t_start
        extra = {"start_model": self.pretrained_state} if self.pretrained_state is not None else None
        path = save_checkpoint(checkpoint_dict(self.state, self.objs, model_args=self.model_args,
                                               config=self.config_dict, extra=extra), self.out_dir / name)
        if name == R.LAST:
            self.log.checkpointed()  # trackers take the records a resume keeps
        return path


def _set_up(cfg: Config, *, resume, overwrite: bool, on_eval) -> _Run:
    """Steps 1-4: process, run directory, data, model, losses, optimiser and schedules."""
    tc = cfg.train
    resolve_model_preprocessing(cfg)  # data.transform: timm: the model's numbers, saved with the config
    check_config(cfg)  # option and metric names: fail before anything is built
    T.check_loggers(tc.loggers)  # the trackers' libraries too
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
    # a damaged --resume checkpoint fails here, before the data, the model and the run summary
    resume_ckpt = load_checkpoint(resume, map_location=device) if resume is not None else None
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
    select_key = (cfg.eval.best_metric or "recall@1") if cfg.data.has_validation else None
    eval_sets: dict[str, dict] = {}
    if main:  # rank 0 evaluates
        if select_key is not None:
            eval_sets["val"] = {"query": build_dataset(cfg, VAL_SPLIT, train=False)}
        if cfg.eval.test and cfg.eval.split is not None:  # eval.test false / eval.split null: no test split
            eval_sets["test"] = build_test_sets(cfg)

    # 3. model and loss terms ------------------------------------------------------------
    fill_model_input_size(cfg, train_ds)  # a ViT's img_size: the data's (saved with the config)
    start_state = resume_ckpt.get("start_model") if resume_ckpt is not None else None
    model = build_model(cfg, num_classes=num_classes, pretrained=_reads_pretrained(cfg, resume_ckpt))
    if start_state is not None:  # a resumed run: the model as the run started, from the checkpoint
        model.load_state_dict(start_state)
    teacher = _pretrained_teacher(cfg, model)  # before any change: the model as built (pretrained)
    # pre-flight: image headers of every split, the model on two training images.  Rank 0 alone
    # checks the evaluation splits, so a failure is shared before the ranks meet in DDP.
    preflight_error: Exception | None = None
    input_shape, run_warnings = (), []
    try:
        input_shape, run_warnings = check_run(cfg, model, train_ds, eval_sets)
    except (ValueError, OSError) as exc:
        preflight_error = exc
    if D.any_true(preflight_error is not None, device):
        raise preflight_error or RuntimeError("pre-flight checks failed on another rank (see its message)")
    embedding_dim = embedding_dim_of(model, train_ds)
    losses = build_losses(cfg, num_classes=num_classes, embedding_dim=embedding_dim,
                          projection_dim=getattr(model, "projection_dim", None))
    if world > 1 and tc.sync_bn and device.type == "cuda":
        model = D.convert_sync_batchnorm(model)  # keeps the BN head's learned shift
    model.to(device)
    losses.to(device)
    if teacher is not None:
        teacher.to(device)
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
    pretrained_state = (_init_head(cfg, model, device, resume=resume, restored=start_state is not None)
                        if main else None)  # rank 0
    if resume is None and main:  # rank 0 only: DDP broadcasts rank 0's parameters below
        for term, loss in zip(cfg.loss, losses):
            if term.init == "class_means":
                init_from_class_means(model, loss, build_dataset(cfg, cfg.data.train_split, train=False),
                                      device=device, seed=tc.seed, amp=tc.amp,
                                      output="projection" if term.input == "projection" else "embedding")
    module = TrainingModule(model, losses, cfg.loss, world_size=world, amp=tc.amp, device=device, teacher=teacher)
    step_module: nn.Module = module
    probes = tc.warmup_mode == "linear_probe" and tc.warmup_epochs > 0
    if probes:
        probed_backbone(model)  # LP-FT needs a backbone to keep fixed: say so before training
    if world > 1:  # a linear probe leaves the backbone without gradients: DDP must expect that
        step_module = nn.parallel.DistributedDataParallel(
            module, device_ids=[device.index] if device.type == "cuda" else None, find_unused_parameters=probes)

    # 4. optimiser, schedules, scaler ----------------------------------------------------
    optimizer = build_optimizer(model, losses, cfg.optim)
    lr_schedule = LrSchedule(cfg.schedule.lr, total_epochs=total_epochs, total_iterations=total_iters)
    temperature = TemperatureSchedule(cfg.schedule.temperature, losses)
    scaler = torch.amp.GradScaler("cuda", enabled=(tc.amp == "fp16"))
    run = _Run(cfg=cfg, dist_info=dist_info, out_dir=out_dir, train_ds=train_ds, sampler=sampler,
               batches_per_epoch=batches_per_epoch, total_epochs=total_epochs, total_iters=total_iters,
               eval_sets=eval_sets, select_key=select_key, model=model, losses=losses, module=module,
               step_module=step_module,
               objs=Trainables(model, losses, optimizer, scaler, lr_schedule, temperature, sampler),
               model_args={"num_classes": num_classes, "embedding_dim": embedding_dim, "world_size": world},
               config_dict=config_to_dict(cfg), warnings=run_warnings,
               state=TrainState(best={"metric": select_key, "value": None, "epoch": None, "test": None}),
               last_ckpt=out_dir / R.LAST, resume_ckpt=resume_ckpt, pretrained_state=pretrained_state)
    run.evaluate = Evaluator(model, losses, eval_sets, cfg, device=device, world=world, log=run.log,
                             on_eval=on_eval)
    return run


def _wants_teacher(cfg: Config) -> bool:
    """Whether a loss term reads ``pretrained_features`` (``similarity_distillation``)."""
    from deepmetric.losses import loss_class

    return any("pretrained_features" in getattr(loss_class(t.name), "extra_inputs", ()) for t in cfg.loss)


def _needs_start(cfg: Config) -> bool:
    """Whether the run keeps the model as it started (WiSE-FT's end point, the teacher of
    ``pretrained_features``): checkpoints then hold it as ``start_model``."""
    return cfg.eval.wise_ft is not None or _wants_teacher(cfg)


def _reads_pretrained(cfg: Config, resume_ckpt: dict | None) -> bool:
    """Whether the model is built with ``model.options.pretrained``: for a new run; a resumed one
    takes every weight from its checkpoint (``model``, and ``start_model`` when the run keeps the
    model as it started), so the pretrained file may have moved.  A checkpoint written before
    ``start_model`` existed, of a run that needs it, reads the pretrained weights again."""
    if resume_ckpt is None:
        return True
    return _needs_start(cfg) and resume_ckpt.get("start_model") is None


def _pretrained_teacher(cfg: Config, model: nn.Module) -> PretrainedTeacher | None:
    """A frozen copy of the model as built (its pretrained weights) when a loss term reads
    ``pretrained_features`` (``similarity_distillation``); on resume, of the checkpoint's
    ``start_model``."""
    return PretrainedTeacher(model) if _wants_teacher(cfg) else None


def _init_head(cfg: Config, model: nn.Module, device: torch.device, *, resume=None,
               restored: bool = False) -> dict | None:
    """Before the first step (rank 0): ``model.options.head_init`` (the head from the PCA of the
    training images' pooled features), then, with ``eval.wise_ft``, a CPU copy of the model as
    it starts (WiSE-FT's pretrained end point).  A resumed run's checkpoint overwrites the head,
    so it computes the PCA only for ``eval.wise_ft_params: all`` (the head's starting value is
    mixed) and only when the checkpoint has no ``start_model`` (``restored``).  The random
    streams are left as they were.  Returns that copy or None."""
    tc = cfg.train
    # restored: the model already is the checkpoint's start_model (head initialised as it was)
    needed = not restored and (resume is None or (cfg.eval.wise_ft is not None
                                                  and cfg.eval.wise_ft_params == "all"))
    if getattr(model, "head_init", None) is not None and needed:
        with rng_preserved():
            info = init_head_from_pca(model, build_dataset(cfg, cfg.data.train_split, train=False), device=device,
                                      batch_size=cfg.eval.batch_size, amp=tc.amp, channels_last=tc.channels_last,
                                      num_workers=cfg.data.num_workers)
        print(f"[deepmetric] head_init {model.head_init}: the projection is the PCA of {info['images']} training "
              f"images' pooled features ({100 * info['explained_variance']:.1f} % of their variance kept)", flush=True)
    if not _needs_start(cfg):
        return None
    from .wise_ft import snapshot_state

    return snapshot_state(model)


def _wise_ft(run: _Run) -> None:
    """After training (rank 0): WiSE-FT (``eval.wise_ft``) between the model as it started and
    the fine-tuned ``best.pt``; the mixture chosen on validation is written as ``wise.pt``."""
    cfg = run.cfg
    if cfg.eval.wise_ft is None or not run.main:
        return
    from .wise_ft import run_wise_ft

    source = run.out_dir / (R.BEST if (run.out_dir / R.BEST).is_file() else R.LAST)
    best = load_checkpoint(source, map_location=run.device)

    def evaluate(net: nn.Module, split: str) -> dict:
        return evaluate_split(net, run.eval_sets[split], cfg, device=run.device, losses=run.losses)[0]

    res = run_wise_ft(run.model, run.pretrained_state, best["model"], cfg.eval.wise_ft, cfg.eval.wise_ft_params,
                      run.select_key, evaluate, with_test=cfg.eval.test, known=_best_metrics(run, source))
    state = res.pop("state")
    res["finetuned"] = source.name
    keep = ("loss", "alphas", "model_args", "config", "epoch", "iteration")
    save_checkpoint({**{k: best[k] for k in keep if k in best}, "model": state, "wise_ft": _plain_summary(res)},
                    run.out_dir / R.WISE)
    for rec in res["val"]:
        print(f"[deepmetric] WiSE-FT a={rec['alpha']:g} val {run.select_key}={rec[run.select_key]:.4f}", flush=True)
    tested = ("; its test metrics: " + ", ".join(f"{k}={v:.4f}" for k, v in res["test"].items())
              if "test" in res else "")
    print(f"[deepmetric] WiSE-FT: a={res['alpha']:g} chosen on validation {run.select_key} "
          f"({res['value']:.4f}){tested}; written to {run.out_dir / R.WISE}", flush=True)
    run.wise_ft = res


def _best_metrics(run: _Run, source: Path) -> dict:
    """The validation (and test) metrics of ``best.pt`` from this run's log, when best.pt is the
    model of a logged evaluation (its epoch's record): WiSE-FT's a = 1 is that model exactly."""
    epoch = run.state.best.get("epoch")
    if source.name != R.BEST or epoch is None:
        return {}
    out = {}
    for rec in R.read_log(run.out_dir):
        if rec.get("epoch") == epoch and rec.get("type") in ("eval", "selected_eval") and rec.get("split") in ("val", "test"):
            out[rec["split"]] = {k: v for k, v in rec.items()
                                 if k not in ("type", "split", "epoch", "step", "eval_seconds", "alpha")}
    return out


def _test_selected(run: _Run) -> None:
    """After training (rank 0), with ``eval.test_selected``: the test metrics of ``best.pt``
    when its epoch's test split was not evaluated (``eval.test_every``), so that ``selected``
    in metrics.json (a study's ``selected/`` columns) always holds the test metrics of the model
    validation chose.  Evaluated on copies: the final model and its loss terms are untouched."""
    import copy

    state, path = run.state, run.out_dir / R.BEST
    if (not run.main or not run.has_val or not run.cfg.eval.test_selected or state.best.get("value") is None
            or state.best.get("test") is not None or not path.is_file() or "test" not in run.eval_sets):
        return
    ckpt = load_checkpoint(path, map_location=run.device)
    model, losses = copy.deepcopy(run.model), copy.deepcopy(run.losses)
    model.load_state_dict(ckpt["model"])
    for loss, saved in zip(losses, ckpt.get("loss", [])):
        loss.load_state_dict(saved)
    t0 = time.perf_counter()
    metrics = evaluate_split(model, run.eval_sets["test"], run.cfg, device=run.device, losses=losses)[0]
    state.best["test"] = metrics
    # its own record type: an "eval" record of an earlier epoch would read as that epoch's evaluation
    run.log.write({"type": "selected_eval", "split": "test", "epoch": state.best["epoch"], "step": state.iteration,
                   "eval_seconds": round(time.perf_counter() - t0, 3), **metrics})
    print(f"[deepmetric] best.pt (epoch {state.best['epoch']}, chosen on validation) test: "
          + ", ".join(f"{k}={v:.4f}" for k, v in metrics.items()), flush=True)


def _plain_summary(info: dict) -> dict:
    """The ``wise_ft`` summary as plain floats / strings (a checkpoint entry)."""
    return {k: ([{kk: float(vv) for kk, vv in r.items()} for r in v] if k == "val" else
                {kk: float(vv) for kk, vv in v.items()} if k == "test" else v) for k, v in info.items()}


def _resume(run: _Run, resume) -> None:
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


def _open_log(run: _Run, resume) -> None:
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


def _log_heat_up(run: _Run, epoch: int) -> None:
    """The one place a ``{"type": "heat_up"}`` record is written (after an event fired)."""
    if run.main:
        run.log.write({"type": "heat_up", "epoch": epoch, "step": run.state.iteration,
                       **run.objs.temperature.history[-1]})


def _baselines(run: _Run, resume) -> None:
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


def _warn_saturated(run: _Run, value: float, epoch: int) -> None:
    """Print and keep (metrics.json) the warning of a selection metric at 100 % from the start."""
    val = (run.eval_sets.get("val") or {}).get("query")
    n = len(np.unique(np.asarray(val.labels))) if val is not None else None
    w = saturation_warning(run.select_key, float(value), epoch, n)
    if w is not None and w not in run.warnings:
        run.warnings.append(w)
        print(f"[deepmetric] warning: {w}", flush=True)


def _choose_best(run: _Run, epoch: int, test_evaluated: bool = True) -> None:
    """After a validation evaluation: update ``state.best`` and write ``best.pt``.  The test
    metrics stored with it are this epoch's (None when the test split was not evaluated)."""
    state = run.state
    _check_metric(run.select_key, "eval.best_metric", state.val_metrics)
    value = state.val_metrics[run.select_key]
    if state.best["value"] is None and run.main:
        _warn_saturated(run, value, epoch)
    if state.best["value"] is None or value > state.best["value"]:
        state.best = {"metric": run.select_key, "value": value, "epoch": epoch,
                      "test": dict(state.metrics) if test_evaluated else None}
        if run.main:
            run.save(R.BEST)


def _evaluate(run: _Run, epoch: int, final: bool, splits=None) -> None:
    results = run.evaluate(epoch, run.state.iteration, run.alphas(), final=final, splits=splits)
    if "test" in results:
        run.state.metrics = results["test"]
    if "val" in results:
        run.state.val_metrics = results["val"]


def _evaluate_finished_resume(run: _Run) -> None:
    """A finished run resumed whose final evaluation is missing (``_resume``): evaluate it."""
    state = run.state
    _evaluate(run, state.epoch, final=True)
    if run.has_val:
        _choose_best(run, state.epoch)
    if run.main:
        run.last_ckpt = run.save(R.LAST)


def _train_one_epoch(run: _Run, epoch: int, interrupt: GracefulInterrupt) -> str | None:
    """Step 6: the batches of one epoch (from ``state.batch_in_epoch`` on a mid-epoch resume).
    Returns ``"finished"`` (the last step is done), ``"interrupted"`` (Ctrl-C) or None."""
    cfg, tc, state, device = run.cfg, run.cfg.train, run.state, run.device
    world, objs = run.dist_info.world_size, run.objs
    if state.batch_in_epoch == 0:
        # Each epoch's randomness is a function of (seed, epoch, rank) only.
        seed_everything(tc.seed + 1_000_003 * (epoch + 1) + 7919 * run.dist_info.rank)
    run.sampler.set_epoch(epoch)
    # augmentation seeded by each sample's position: exact resume with loader workers
    loader = make_train_loader(run.train_ds, run.sampler, epoch=epoch, start=state.batch_in_epoch,
                               run_seed=tc.seed, rank=run.dist_info.rank, num_workers=cfg.data.num_workers,
                               pin_memory=device.type == "cuda")
    bn_stats_only = epoch < tc.warmup_epochs and tc.warmup_mode == "bn_stats"
    bar = None
    if tc.progress and run.main:
        from tqdm.auto import tqdm

        bar = tqdm(total=run.batches_per_epoch, initial=state.batch_in_epoch,
                   desc=f"epoch {epoch + 1}/{run.total_epochs}", leave=False, dynamic_ncols=True)
    run.step_module.train()
    t_epoch = t_step = time.perf_counter()
    images_in_step, outcome, lr = 0, None, 0.0
    for x, y in loader:
        x = x.to(device, non_blocking=True)
        y = torch.as_tensor(y).to(device, non_blocking=True)
        if tc.channels_last and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        state.batch_in_epoch += 1
        images_in_step += x.shape[0] * world
        state.train_images += x.shape[0] * world
        if bar is not None:
            bar.update(1)
        if bn_stats_only:  # warm-up: update batch-norm statistics, no weight change
            with torch.no_grad(), autocast_context(device, tc.amp):
                run.model(x)
            continue

        accum_index = (state.batch_in_epoch - 1) % tc.grad_accum
        if accum_index == 0:
            if objs.temperature.step(epoch, state.iteration):
                _log_heat_up(run, epoch)
            lr = set_learning_rates(objs.optimizer, cfg, objs.lr_schedule.factor(epoch, state.iteration)
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
        if accum_index != tc.grad_accum - 1 and state.batch_in_epoch != run.batches_per_epoch:
            continue
        if tc.grad_clip is not None:
            objs.scaler.unscale_(objs.optimizer)
            torch.nn.utils.clip_grad_norm_([p for g in objs.optimizer.param_groups for p in g["params"]],
                                           tc.grad_clip)
        objs.scaler.step(objs.optimizer)
        objs.scaler.update()
        objs.optimizer.zero_grad(set_to_none=True)
        state.iteration += 1

        now = time.perf_counter()
        ips = images_in_step / max(now - t_step, 1e-9)
        t_step, images_in_step = now, 0
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


def _end_of_epoch(run: _Run, epoch: int, finished: bool) -> bool:
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
    due = _eval_due(cfg, epoch, run.total_epochs, finished)
    test_due = (cfg.eval.test and cfg.eval.split is not None
                and _eval_due(cfg, epoch, run.total_epochs, finished, split="test"))
    if due or test_due:
        _evaluate(run, epoch, final=last_epoch, splits=[s for s, d in (("val", due), ("test", test_due)) if d])
    if due and run.has_val:  # choose on validation metrics only
        _check_metric(run.select_key, "eval.best_metric", state.val_metrics)
        if monitor != "train_loss":
            if cfg.schedule.temperature.name == "auto_plateau":
                _check_metric(monitor, "schedule.temperature.monitor", state.val_metrics)
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


def _finish(run: _Run, interrupted: bool) -> TrainResult:
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
    run = _set_up(cfg, resume=resume, overwrite=overwrite, on_eval=on_eval)      # steps 1-4
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
            _test_selected(run)
            _wise_ft(run)
            D.barrier()
        result = _finish(run, interrupted)
        run.log.finish(run.out_dir, interrupted=interrupted)  # trackers: final metrics, artifacts
    D.cleanup_distributed(run.dist_info)
    return result


def train_from_config_file(path: str, overrides: list[str] | None = None, resume: str | None = None,
                           overwrite: bool = False) -> TrainResult:
    from deepmetric.run.config_io import load_config

    return train(load_config(path, overrides), resume=resume, overwrite=overwrite)
