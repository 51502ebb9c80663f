"""Steps 1-4 of a run (:func:`set_up`): the process (torchrun / DDP, device, seed), the run
directory, the data, the model and loss terms (checked before the first step), the optimiser
and the schedules, as one :class:`~deepmetric.train.training_run.TrainingRun`."""
from __future__ import annotations

import math
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from torch import nn

from deepmetric.run import rundir as R
from deepmetric.run.builders import (VAL_SPLIT, build_split, build_losses, build_model, build_sampler, build_test_sets,
                                     embedding_dim_of, fill_model_input_size, resolve_model_preprocessing,
                                     seed_everything)
from deepmetric.run.checkpoint import load_checkpoint, rng_preserved
from deepmetric.run.config import Config, config_to_dict
from deepmetric.run.config_checks import check_config
from deepmetric.run.device import check_amp
from deepmetric.run.rundir import RunDirectoryError, prepare_run_dir

from . import distributed as D
from . import tracking as T
from .checks import check_out_dir_outside_data, check_run
from .evaluator import Evaluator
from .finetune import probed_backbone
from .module import PretrainedTeacher, TrainingModule, init_from_class_means, init_head_from_pca
from .optim import build_optimizer
from .schedules import LrSchedule, TemperatureSchedule
from .state import Trainables, TrainState
from .summary import format_run_summary
from .training_run import TrainingRun

__all__ = ["set_up", "torch_settings_kept"]


@contextmanager
def torch_settings_kept():
    """Put back the process-wide torch settings a run changes (``train.num_threads``,
    ``train.deterministic``, cuDNN autotuning) when it ends: ``train()`` called from a notebook,
    a test or a tune worker leaves the caller's process as it found it (a CLI run exits anyway)."""
    threads = torch.get_num_threads()
    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    cudnn_benchmark = torch.backends.cudnn.benchmark
    try:
        yield
    finally:
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
        torch.backends.cudnn.benchmark = cudnn_benchmark


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


def set_up(cfg: Config, *, resume, overwrite: bool, on_eval) -> TrainingRun:
    """Steps 1-4: process, run directory, data, model, losses, optimiser and schedules. A run
    directory that step 1 created is removed again, while still empty, when a later step
    fails (a bad model option left an empty train.out_dir behind)."""
    with R.folders_removed_on_failure(Path(cfg.train.out_dir)):
        return _set_up(cfg, resume=resume, overwrite=overwrite, on_eval=on_eval)


def _set_up(cfg: Config, *, resume, overwrite: bool, on_eval) -> TrainingRun:
    dist_info, out_dir, resume_ckpt, replaces = _start(cfg, resume=resume, overwrite=overwrite)
    data = _build_data(cfg, dist_info)
    model, losses, teacher, embedding_dim, run_warnings = _build_model_and_losses(cfg, data, dist_info, resume_ckpt)
    if dist_info.is_main:
        _print_summary(cfg, data, model, losses, embedding_dim, run_warnings, dist_info, out_dir)
    restored = resume_ckpt is not None and resume_ckpt.get("start_model") is not None
    pretrained_state = (_init_head(cfg, model, dist_info.device, resume=resume, restored=restored)
                        if dist_info.is_main else None)  # rank 0
    if resume is None and dist_info.is_main:  # rank 0 only: DDP broadcasts rank 0's parameters below
        _init_class_means(cfg, model, losses, dist_info.device)
    module, step_module = _training_module(cfg, model, losses, teacher, dist_info)

    # 4. optimiser, schedules, scaler ----------------------------------------------------
    tc, world = cfg.train, dist_info.world_size
    optimizer = build_optimizer(model, losses, cfg.optim)
    lr_schedule = LrSchedule(cfg.schedule.lr, total_epochs=data["total_epochs"], total_iterations=data["total_iters"])
    temperature = TemperatureSchedule(cfg.schedule.temperature, losses)
    scaler = torch.amp.GradScaler("cuda", enabled=(tc.amp == "fp16"))
    select_key = data["select_key"]
    run = TrainingRun(
        cfg=cfg, dist_info=dist_info, out_dir=out_dir, train_ds=data["train_ds"], sampler=data["sampler"],
        batches_per_epoch=data["batches_per_epoch"], total_epochs=data["total_epochs"],
        total_iters=data["total_iters"], eval_sets=data["eval_sets"], select_key=select_key, model=model,
        losses=losses, module=module, step_module=step_module,
        objs=Trainables(model, losses, optimizer, scaler, lr_schedule, temperature, data["sampler"]),
        model_args={"num_classes": data["num_classes"], "embedding_dim": embedding_dim, "world_size": world},
        config_dict=config_to_dict(cfg), warnings=run_warnings,
        state=TrainState(best={"metric": select_key, "value": None, "epoch": None, "test": None}),
        last_ckpt=out_dir / R.LAST, resume_ckpt=resume_ckpt, pretrained_state=pretrained_state)
    run.evaluate = Evaluator(model, losses, data["eval_sets"], cfg, device=dist_info.device, world=world,
                             log=run.log, on_eval=on_eval)
    if replaces and dist_info.is_main:  # --overwrite: the old run goes only now, once the new one is built
        R.remove_run_files(out_dir)
    return run


def _start(cfg: Config, *, resume, overwrite: bool):
    """Step 1: the config's names checked, the process group, torch's settings, the run
    directory (every rank stops when rank 0 refuses it; ``--overwrite`` removes the previous
    run's files only at the end of set-up, ``replaces``) and the ``--resume`` checkpoint, loaded
    (a damaged one fails here, before the data, the model and the run summary).  Returns
    ``(dist_info, out_dir, resume_ckpt, replaces)``."""
    tc = cfg.train
    resolve_model_preprocessing(cfg)  # data.transform: timm: the model's numbers, saved with the config
    check_config(cfg)  # option and metric names: fail before anything is built
    check_out_dir_outside_data(cfg)
    T.check_loggers(tc.loggers)  # the trackers' libraries too
    dist_info = D.init_distributed(tc.device)
    device = dist_info.device
    _configure_torch(tc, device)
    out_dir = Path(tc.out_dir)
    refused, replaces = None, False
    if dist_info.is_main:
        try:
            replaces = prepare_run_dir(out_dir, resume=resume, overwrite=overwrite)
        except RunDirectoryError as exc:
            refused = exc
    if D.any_true(refused is not None, device):  # every rank stops, before anything is written
        raise refused or RunDirectoryError(f"rank 0 refused the run directory {out_dir}")
    resume_ckpt = load_checkpoint(resume, map_location=device) if resume is not None else None
    seed_everything(tc.seed)  # identical model/loss initialisation on every rank
    return dist_info, out_dir, resume_ckpt, replaces


def _build_data(cfg: Config, dist_info) -> dict:
    """Step 2: the training split, its sampler (this rank's shard), the run's length and, on
    rank 0, the evaluation splits (``{"val": ..., "test": ...}``)."""
    rank, world, main = dist_info.rank, dist_info.world_size, dist_info.is_main
    train_ds = build_split(cfg, cfg.data.train_split, train=True)
    labels = np.asarray(train_ds.labels, dtype=np.int64)
    num_classes = int(train_ds.num_classes if train_ds.num_classes is not None else labels.max() + 1)
    sampler = build_sampler(cfg, labels, rank, world)
    batches_per_epoch = len(sampler)
    if batches_per_epoch == 0:
        raise ValueError(f"the training split has too few samples ({len(train_ds)}) for one batch")
    total_epochs, total_iters = _run_length(cfg.train, batches_per_epoch)
    select_key = (cfg.eval.best_metric or "recall@1") if cfg.data.has_validation else None
    eval_sets: dict[str, dict] = {}
    if main:  # rank 0 evaluates
        if select_key is not None:
            eval_sets["val"] = {"query": build_split(cfg, VAL_SPLIT, train=False)}
        if cfg.eval.test and cfg.eval.split is not None:  # eval.test false / eval.split null: no test split
            eval_sets["test"] = build_test_sets(cfg)
    return {"train_ds": train_ds, "num_classes": num_classes, "sampler": sampler,
            "batches_per_epoch": batches_per_epoch, "total_epochs": total_epochs, "total_iters": total_iters,
            "select_key": select_key, "eval_sets": eval_sets}


def _build_model_and_losses(cfg: Config, data: dict, dist_info, resume_ckpt: dict | None):
    """Step 3: the model (a resumed run's as it started, from its checkpoint), the teacher of
    ``pretrained_features``, the pre-flight checks of the built run, and the loss terms, all on
    the device.  Returns ``(model, losses, teacher, embedding_dim, warnings)``."""
    tc, device, world = cfg.train, dist_info.device, dist_info.world_size
    train_ds, num_classes, eval_sets = data["train_ds"], data["num_classes"], data["eval_sets"]
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
                          projection_dim=model.projection_dim)
    if world > 1 and tc.sync_bn and device.type == "cuda":
        model = D.convert_sync_batchnorm(model)  # keeps the BN head's learned shift
    model.to(device)
    losses.to(device)
    if teacher is not None:
        teacher.to(device)
    if tc.channels_last:
        model.to(memory_format=torch.channels_last)
    data["input_shape"] = input_shape  # for the run summary
    return model, losses, teacher, embedding_dim, run_warnings


def _print_summary(cfg: Config, data: dict, model, losses, embedding_dim: int, run_warnings: list[str],
                   dist_info, out_dir: Path) -> None:
    """Rank 0's summary of the run before it starts, and the pre-flight warnings."""
    print(format_run_summary(cfg, train_set=data["train_ds"], eval_sets=data["eval_sets"], model=model,
                             losses=losses, embedding_dim=embedding_dim, input_shape=data["input_shape"],
                             device=dist_info.device, world=dist_info.world_size, threads=torch.get_num_threads(),
                             steps_per_epoch=max(data["batches_per_epoch"] // cfg.train.grad_accum, 1),
                             total_epochs=data["total_epochs"], total_steps=data["total_iters"], out_dir=out_dir),
          flush=True)
    for w in run_warnings:
        print(f"[deepmetric] warning: {w}", flush=True)


def _init_class_means(cfg: Config, model: nn.Module, losses: nn.ModuleList, device: torch.device) -> None:
    """``loss.i.init: class_means``: a classifier's weights from the training classes' mean
    embeddings (a new run, rank 0)."""
    tc = cfg.train
    for term, loss in zip(cfg.loss, losses):
        if term.init == "class_means":
            init_from_class_means(model, loss, build_split(cfg, cfg.data.train_split, train=False),
                                  device=device, seed=tc.seed, amp=tc.amp,
                                  output="projection" if term.input == "projection" else "embedding")


def _training_module(cfg: Config, model: nn.Module, losses: nn.ModuleList, teacher, dist_info):
    """The ``TrainingModule`` (model + weighted loss terms) and the module a step calls (it, or
    its DDP wrapper)."""
    tc, device, world = cfg.train, dist_info.device, dist_info.world_size
    module = TrainingModule(model, losses, cfg.loss, world_size=world, amp=tc.amp, device=device, teacher=teacher)
    step_module: nn.Module = module
    probes = tc.warmup_mode == "linear_probe" and tc.warmup_epochs > 0
    if probes:
        probed_backbone(model)  # LP-FT needs a backbone to keep fixed: say so before training
    if world > 1:  # a linear probe leaves the backbone without gradients: DDP must expect that
        step_module = nn.parallel.DistributedDataParallel(
            module, device_ids=[device.index] if device.type == "cuda" else None, find_unused_parameters=probes)
    return module, step_module


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
    if model.head_init is not None and needed:
        with rng_preserved():
            info = init_head_from_pca(model, build_split(cfg, cfg.data.train_split, train=False), device=device,
                                      batch_size=cfg.eval.batch_size, amp=tc.amp, channels_last=tc.channels_last,
                                      num_workers=cfg.data.num_workers)
        print(f"[deepmetric] head_init {model.head_init}: the projection is the PCA of {info['images']} training "
              f"images' pooled features ({100 * info['explained_variance']:.1f} % of their variance kept)", flush=True)
    if not _needs_start(cfg):
        return None
    from .wise_ft import snapshot_state

    return snapshot_state(model)

