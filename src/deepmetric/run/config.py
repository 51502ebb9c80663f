"""Typed, validated training configuration.

A run is described by one YAML file that maps onto the nested dataclasses below
(``Config`` at the top).  ``load_config(path, overrides)`` reads the YAML, applies
``key.sub=value`` overrides (values are parsed as YAML, so ``optim.lr=1e-3`` is a float and
``eval.ks=[1,10]`` a list), and validates every key and type:

* an unknown or misspelt key is a ``ConfigError`` naming its full path and suggesting the
  closest valid key (``difflib``), e.g. ``unknown config key 'optim.lrr' (did you mean
  'optim.lr'?)``;
* a value of the wrong type is a ``ConfigError`` naming the key and the expected type.

``save_config(cfg, path)`` writes the resolved configuration (every default filled in) so a
run directory always records exactly what was trained.  The YAML layout (see
docs/training.md for every key)::

    data:     {name, root, options, train_split, transform, transform_options, num_workers,
               val_classes, val_seed, val_folds, val_fold, val_query_families, val_split}
    model:    {name, options}
    loss:     [{name, weight, input: embedding|logits|projection, options, gather}, ...]
    optim:    {name: sgd|adam|adamw, lr, momentum, weight_decay, new_layer_lr_mult, ...}
    schedule: {lr: {name: constant|step|multistep|poly|cosine, ...},
               temperature: {name: none|heat_up|gradual|auto_plateau, ...}}
    train:    {epochs | iterations, batch_size, sampler, m, n, amp, seed, out_dir, ...}
    eval:     {every, split, gallery_split, ks, metrics, best_metric, early_stop_patience, baselines,
               cross_domain, train_neighbours, wise_ft, wise_ft_params, device, ...}
"""
from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml

__all__ = [
    "ConfigError",
    "HEATING_DEFAULTS",
    "heating_factors",
    "DataConfig",
    "ModelConfig",
    "LossTermConfig",
    "ParamGroupConfig",
    "OptimConfig",
    "LrScheduleConfig",
    "TemperatureScheduleConfig",
    "ScheduleConfig",
    "TrackingConfig",
    "TrainConfig",
    "EvalConfig",
    "Config",
    "config_from_dict",
    "config_to_dict",
    "config_diff",
    "flatten_config",
    "apply_overrides",
    "load_config",
    "read_yaml_mapping",
    "save_config",
]


class ConfigError(ValueError):
    """A configuration file or override is invalid (unknown key, wrong type, bad value)."""


# --------------------------------------------------------------------------- sections
@dataclass
class DataConfig:
    """Which dataset to train on and how to load it (``deepmetric.data.build_dataset``)."""

    name: str = "glyphs"
    root: Optional[str] = None
    #: extra keyword arguments for ``build_dataset`` (e.g. ``protocol: classification``).
    options: dict[str, Any] = field(default_factory=dict)
    train_split: str = "train"
    #: ``build_transform`` name; ``null`` leaves the dataset's own default.
    transform: Optional[str] = None
    transform_options: dict[str, Any] = field(default_factory=dict)
    num_workers: int = 0
    #: validation classes carved from the training split's classes (class-disjoint from
    #: training and test): ``null`` (no validation split), a fraction in (0, 1) of the
    #: training classes, a count, or an explicit list of class names / label ids.  Their
    #: images leave the training set and form the ``val`` split, which selects ``best.pt``
    #: and drives early stopping and ``auto_plateau`` on a metric.
    val_classes: Union[int, float, list[Union[int, str]], None] = None
    #: seed of the random choice of validation classes (``null`` = ``train.seed``).
    val_seed: Optional[int] = None
    #: how a fraction or count of validation classes is chosen: ``random`` (seeded) or ``last``
    #: (the last classes in label order, the way a zero-shot test split takes the second half:
    #: on the emoji benchmark they are a category the other training classes do not have, as
    #: the test's categories are).
    val_pick: Literal["random", "last"] = "random"
    #: k-fold class-disjoint cross-validation (instead of ``val_classes``): the training
    #: classes are split (seeded) into ``val_folds`` class-disjoint folds and fold
    #: ``val_fold`` (0-based) is the validation split; run once per fold.
    val_folds: Optional[int] = None
    val_fold: int = 0
    #: validation that mirrors a cross-family test (glyphs): the images of these typeface
    #: families leave training (every class), and the validation classes are searched with
    #: their images in these families as queries against the other families' images, as the
    #: test's held-out families are searched against the training families.  Needs
    #: ``val_classes`` or ``val_folds`` and a dataset with per-image ``families``.
    val_query_families: Optional[list[str]] = None
    #: a validation split the dataset provides itself, by name (instead of carving classes):
    #: the emoji benchmark's closed-set ``val`` (the validation vendor's images of the training
    #: classes). It is evaluated as validation (selects ``best.pt``; ``eval.classification`` works
    #: on it, as its classes are the training classes).
    val_split: Optional[str] = None

    @property
    def has_validation(self) -> bool:
        """Whether there is a validation split (carved from the training classes or ``val_split``)."""
        return self.val_classes is not None or self.val_folds is not None or self.val_split is not None

    @property
    def carves_validation(self) -> bool:
        """Whether the validation split is carved from the training classes (class-disjoint)."""
        return self.val_classes is not None or self.val_folds is not None


@dataclass
class ModelConfig:
    """``deepmetric.models.create_model(name, **options)``.

    ``num_classes`` is filled in from the training split when the model accepts it and the
    options do not set it (e.g. the two-head model).
    """

    name: str = "glyph_resnet"
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class LossTermConfig:
    """One weighted term of the total loss: ``weight * build_loss(name, **options)(input, y)``.

    ``input`` picks the model output the term reads: ``embedding``, ``logits`` (the
    two-head model's classifier, for ``cross_entropy``) or ``projection`` (the SimCLR
    projection head of ``model.options.projection``: the loss trains through it while the
    embedding before it is what retrieval indexes).  ``num_classes`` and
    ``embedding_dim`` are filled in automatically when the loss accepts them.
    ``gather`` (distributed training only) makes the term see the embeddings of all ranks;
    ``null`` = automatic: the pair-based losses (triplet, npair, almn, contrastive, lifted)
    are gathered, per-sample losses (heated_softmax, proxy_nca, cross_entropy, center)
    stay local.
    ``init: class_means`` (classifier losses with ``init_from_class_means``, e.g. heated
    softmax) sets each class weight to the l2-normalised mean training embedding of its class
    before the first step: the heated-up authors' initialisation for Stanford Online Products.
    """

    name: str = "heated_softmax"
    weight: float = 1.0
    input: Literal["embedding", "logits", "projection"] = "embedding"
    options: dict[str, Any] = field(default_factory=dict)
    gather: Optional[bool] = None
    init: Optional[Literal["class_means"]] = None


@dataclass
class ParamGroupConfig:
    """An explicit parameter group: parameters whose qualified name matches the regular
    expression ``pattern`` (names look like ``model.backbone.conv1.weight`` or
    ``loss.0.weight``) get this lr multiplier and/or weight decay.  First match wins."""

    pattern: str = ""
    lr_mult: Optional[float] = None
    weight_decay: Optional[float] = None


@dataclass
class OptimConfig:
    """Optimiser and its parameter groups.

    Parameters of the model whose names start with one of ``new_layers`` (default: every
    model parameter outside ``backbone``) and all loss parameters (heated-softmax ``W``,
    Proxy-NCA proxies, learnable alpha) train with ``lr * new_layer_lr_mult`` (ALMN uses
    10x for the embedding layer); ``loss_lr_mult`` overrides the multiplier for the loss.
    ``layer_decay`` (layer-wise learning-rate decay, null = off): a backbone parameter of
    stage ``s`` counted from the top (``deepmetric.models.backbone_stages``; the top stage is
    0) trains at ``lr * layer_decay ** s``; the new layers and the loss keep their multipliers.
    ``decay_exclude`` (default none) lists the parameters that get no weight decay whatever
    ``weight_decay`` says: ``bias`` (every parameter named ``*.bias``), ``norm`` (the weights
    and shifts of normalisation layers: batch, layer, group, instance norm) and ``loss`` (every
    loss parameter: proxies, class weights, centres, learnable temperatures), as is usual since
    Goyal et al. 2017 (no decay on BN's gamma / beta) and BERT (no decay on biases and LayerNorm);
    a ``param_groups`` entry that sets ``weight_decay`` still wins.
    """

    name: Literal["sgd", "adam", "adamw"] = "sgd"
    lr: float = 0.01
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    new_layer_lr_mult: float = 1.0
    new_layers: Optional[list[str]] = None
    loss_lr_mult: Optional[float] = None
    param_groups: list[ParamGroupConfig] = field(default_factory=list)
    layer_decay: Optional[float] = None
    decay_exclude: list[Literal["bias", "norm", "loss"]] = field(default_factory=list)


@dataclass
class LrScheduleConfig:
    """Base learning-rate schedule (a multiplier of ``optim.lr``).

    * ``constant``;
    * ``step``: ``gamma ** (t // step_size)``;
    * ``multistep``: ``gamma ** (number of milestones <= t)``;
    * ``poly``: ``end_factor + (1 - end_factor) * (1 - t / T) ** power`` (two-head paper:
      power 1 from lr to 0 over the run);
    * ``cosine``: ``end_factor + (1 - end_factor) * (1 + cos(pi t / T)) / 2``, a half cosine
      from 1 to ``end_factor`` over the run (SGDR without restarts, Loshchilov & Hutter 2017).
    ``unit`` says whether ``t`` counts epochs or iterations.  ``warmup`` linear warm-up
    iterations (0 = none), a factor ``(i + 1) / warmup`` on top of the schedule.
    """

    name: Literal["constant", "step", "multistep", "poly", "cosine"] = "constant"
    unit: Literal["epoch", "iteration"] = "epoch"
    step_size: int = 10
    gamma: float = 0.1
    milestones: list[int] = field(default_factory=list)
    power: float = 1.0
    end_factor: float = 0.0
    warmup: int = 0


@dataclass
class TemperatureScheduleConfig:
    """Temperature (alpha) schedule of heated-softmax style losses (heated-up paper, Sec. 3.4).

    * ``none``;
    * ``heat_up``: at epoch/iteration ``at`` multiply alpha by ``alpha_factor`` (default
      1/4: 16 -> 4) and the learning rate by ``lr_factor`` (default 1/10).  With a learnable
      alpha the factor is applied to its learned value (paper Table 5);
    * ``gradual``: every ``every`` epochs/iterations (until ``until``) multiply alpha by
      ``alpha_factor`` (default 1/1.41) and lr by ``lr_factor`` (default 0.562), the
      official code's gradual variant; without ``until`` it stops after the event that
      brings alpha closest to 1/4 of its start (4 events with the defaults: alpha 16 -> 4.04,
      lr x 0.0998, the paper's end point);
    * ``auto_plateau`` (ours): heat up (as ``heat_up``) when ``monitor`` (``train_loss``
      or an evaluation metric such as ``recall@1``) has not improved by ``min_delta`` for
      ``patience`` consecutive observations; at most ``max_heatups`` times.
    ``losses`` restricts the schedule to these loss-term indices (default: every term
    with an ``alpha``).
    """

    name: Literal["none", "heat_up", "gradual", "auto_plateau"] = "none"
    unit: Literal["epoch", "iteration"] = "epoch"
    at: Optional[int] = None
    every: Optional[int] = None
    until: Optional[int] = None
    alpha_factor: Optional[float] = None
    lr_factor: Optional[float] = None
    monitor: str = "train_loss"
    mode: Literal["auto", "min", "max"] = "auto"
    patience: int = 3
    min_delta: float = 0.0
    max_heatups: int = 1
    losses: Optional[list[int]] = None


#: ``(alpha_factor, lr_factor)`` of one heating event when the config leaves them out (heated-up
#: paper, Sec. 3.4 and its official code): one step alpha x 1/4 (16 -> 4) and lr x 1/10; the
#: gradual variant alpha / 1.41 and lr x 0.562 per event (4 events reach the same end point).
HEATING_DEFAULTS = {"heat_up": (0.25, 0.1), "auto_plateau": (0.25, 0.1), "gradual": (1 / 1.41, 0.562)}


def heating_factors(kind: str) -> tuple[float, float]:
    """The default ``(alpha_factor, lr_factor)`` of a temperature schedule kind."""
    return HEATING_DEFAULTS.get(kind, HEATING_DEFAULTS["heat_up"])


@dataclass
class ScheduleConfig:
    lr: LrScheduleConfig = field(default_factory=LrScheduleConfig)
    temperature: TemperatureScheduleConfig = field(default_factory=TemperatureScheduleConfig)


@dataclass
class TrackingConfig:
    """Where ``train.loggers`` send a run (:mod:`deepmetric.train.tracking`, docs/tracking.md).

    ``experiment`` (default: the config's ``name``) and ``run_name`` (default: the name of
    ``train.out_dir``) name the MLflow experiment and run; ``tags`` (string-keyed scalars) are
    set on the MLflow run.  ``mlflow_uri`` is the MLflow tracking URI; ``null`` takes
    ``MLFLOW_TRACKING_URI`` from the environment, else ``sqlite:///OUT/mlflow.db`` (a SQLite
    file in the run directory, no server).  ``deepmetric tune`` / ``study`` set all four so
    that every trial becomes a run of one experiment in one store."""

    experiment: Optional[str] = None
    run_name: Optional[str] = None
    tags: dict[str, Any] = field(default_factory=dict)
    mlflow_uri: Optional[str] = None


@dataclass
class TrainConfig:
    """Run length, batching, precision and bookkeeping.

    Give exactly one of ``epochs`` / ``iterations``.  ``sampler: random`` draws batches of
    ``batch_size`` (heated-up paper); ``class_balanced`` draws ``m`` classes x ``n`` images
    (ALMN m x n, two-head P x K), the classes picked by ``class_sampling``: ``uniform``
    (default; both papers: every class equally likely) or ``proportional`` (every image at
    least once per epoch, so classes appear in proportion to their size).  ``warmup_epochs`` > 0 starts with a warm-up:
    ``warmup_mode: new_layers`` trains only the new layers and the loss (backbone lr 0,
    batch-norm statistics still update); ``bn_stats`` runs forward passes only, to
    re-estimate batch-norm statistics before any weight changes; ``linear_probe`` is the
    linear-probe phase of LP-FT (Kumar et al., ICLR 2022): the backbone is a fixed feature
    extractor (eval mode, so its batch-norm statistics stay, and no autograd graph through
    it), only the head, classifier and loss parameters train; then everything fine-tunes.
    """

    epochs: Optional[int] = None
    iterations: Optional[int] = None
    batch_size: int = 32
    sampler: Literal["random", "class_balanced"] = "random"
    class_sampling: Literal["uniform", "proportional"] = "uniform"
    m: Optional[int] = None
    n: Optional[int] = None
    amp: Literal["none", "bf16", "fp16"] = "none"
    channels_last: bool = False
    grad_accum: int = 1
    grad_clip: Optional[float] = None
    warmup_epochs: int = 0
    warmup_mode: Literal["new_layers", "bn_stats", "linear_probe"] = "new_layers"
    seed: int = 0
    deterministic: bool = False
    #: torch intra-op threads (``null`` = torch's default).  With data-loader workers on a
    #: small CPU, 1 avoids oversubscription (spinning OpenMP threads slow down >10x when
    #: another process holds a core).
    num_threads: Optional[int] = None
    device: str = "auto"
    out_dir: str = "runs/run"
    checkpoint_every: int = 1
    progress: bool = True
    sync_bn: bool = True
    #: experiment trackers fed alongside ``log.jsonl``: ``tensorboard`` (``OUT/tensorboard``),
    #: ``mlflow`` (optional extra ``deepmetric[tracking]``; docs/tracking.md)
    loggers: list[Literal["tensorboard", "mlflow"]] = field(default_factory=list)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)


@dataclass
class EvalConfig:
    """Zero-shot evaluation during training with ``deepmetric.evaluate``.

    Every ``every`` epochs (0 = only at the end; the end is always evaluated) the model
    embeds the test ``split`` (logged, marked ``"split": "test"``; never used to choose
    anything) and, when ``data.val_classes`` carves one, the validation split; with
    ``gallery_split`` (In-shop: ``split: query``, ``gallery_split: gallery``) test queries
    are ranked against the gallery.  With a validation split the checkpoint with the best
    validation ``best_metric`` (default ``recall@1``) is kept as ``best.pt``, and
    ``early_stop_patience`` stops training after that many epochs without a validation
    improvement; without one there is no ``best.pt`` (the final model is the result) and
    setting either key is an error.  ``at_start`` also evaluates the untrained model.
    ``classification`` adds top-1 / mean-per-class accuracy of the model's (or the loss's)
    classifier on ``split``.  ``baselines`` (default on) evaluates,
    before training, the untrained (or pretrained) network and, for images up to 64 x 64,
    the raw pixels; they are printed, logged as ``{"type": "baseline"}`` records and stored
    in ``metrics.json`` under ``baselines``.

    ``cross_domain`` (test split only) adds ``cross_domain_recall@K`` and
    ``cross_domain_map@r``: the queries of each domain (the emoji vendors) against the
    images of the other domains, averaged over domains
    (:func:`deepmetric.evaluate.evaluate_cross_domain`); the split must carry domains.
    ``train_neighbours`` (with ``classification``, final evaluation only) embeds the training
    split and adds ``misclassified_nn_agrees`` (the share of misclassified test images whose
    nearest training image carries the predicted label, two-head paper Sec. 5),
    ``misclassified`` and ``train_1nn_top1``
    (:func:`deepmetric.evaluate.misclassified_neighbour_agreement`).
    """

    every: int = 1
    #: epochs between test-split evaluations (``null`` = ``every``; 0 = only the final
    #: evaluation): tuning trials select on validation and need the test split once at most
    test_every: Optional[int] = None
    #: after training, evaluate ``best.pt`` on the test split when its epoch's test split was
    #: not evaluated (``test_every``), so that metrics.json's ``selected.test`` is always the
    #: test score of the model validation chose (one more test evaluation; off in tuning trials)
    test_selected: bool = True
    #: false: the test split is never built nor evaluated during training (no final test
    #: evaluation, no test_selected, no WiSE-FT test metrics, no baselines): metrics.json holds
    #: validation only, for protocols that keep the test split out of sight until one final
    #: step over the finished runs (``deepmetric tune``'s trials; bench/protocol_v2.py)
    test: bool = True
    #: the model output that is indexed and evaluated (validation, best.pt's selection, WiSE-FT,
    #: the test split): ``embedding`` (the head's output, what ``forward_head`` returns) or
    #: ``projection`` (the SimCLR projection head of ``model.options.projection``: the output a
    #: ``loss.N.input: projection`` term trains)
    embedding: Literal["embedding", "projection"] = "embedding"
    at_start: bool = False
    #: the test split; ``null``: none (the run evaluates its validation split only, and a later
    #: step tests the finished model: test out of sight while anything is chosen)
    split: Optional[str] = "test"
    gallery_split: Optional[str] = None
    ks: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    #: retrieval / clustering metrics (null: all); ``[]``: none, only ``eval.classification``'s
    #: (a closed-set split with one image per class has no retrieval positives)
    metrics: Optional[list[str]] = None
    best_metric: Optional[str] = None
    early_stop_patience: Optional[int] = None
    batch_size: int = 256
    classification: bool = False
    baselines: bool = True
    cross_domain: bool = False
    train_neighbours: bool = False
    #: k-means initialisations behind NMI / F1 (lowest inertia kept); 1 as pytorch-metric-learning
    kmeans_restarts: int = 1
    #: where the evaluations' nearest-neighbour searches run: ``auto`` = the training device (a
    #: CUDA run keeps its embeddings on the GPU and searches there with the torch backend; a CPU
    #: run uses faiss), ``cpu`` = always faiss on the CPU.  Same metrics either way
    #: (bench/RESULTS.md section 8); the model always embeds on the training device.
    device: Literal["auto", "cpu"] = "auto"
    #: WiSE-FT (Wortsman et al., CVPR 2022) after training: the mixing coefficients a in [0, 1]
    #: of theta(a) = (1 - a) theta_pretrained + a theta_finetuned to evaluate on the validation
    #: split besides a = 1 (the fine-tuned model, best.pt); the best a on ``best_metric`` is
    #: written as ``wise.pt`` and reported in metrics.json under ``wise_ft``.  Needs a
    #: validation split.
    wise_ft: Optional[list[float]] = None
    #: what WiSE-FT mixes: ``backbone`` (its parameters and BN statistics; the head stays the
    #: fine-tuned one: it has no pretrained value) or ``all`` (every model tensor, the head from
    #: its value before the first step: its PCA initialisation, or a pretrained deepmetric model's)
    wise_ft_params: Literal["backbone", "all"] = "backbone"


@dataclass
class SearchConfig:
    """How every search of the run's embeddings is answered (docs/search.md, "Post-processing").

    ``postprocess``: retrieval post-processing steps, run in the order whiten -> dba -> aqe ->
    kreciprocal wherever a search happens: the in-training evaluation (validation and test,
    so ``best.pt`` is chosen on the post-processed validation metric), ``deepmetric evaluate``
    with ``--config``, ``deepmetric index`` (fitted parameters stored in the index; ``search``
    and ``serve`` apply the query side), the report and the export's preprocessing JSON. Each
    step is a mapping with ``name`` and its keys, e.g. ``[{name: whiten, dim: 256, fit: gallery},
    {name: dba, k: 3, alpha: 3}, {name: aqe, k: 2, alpha: 3}]``
    (:data:`deepmetric.evaluate.postprocess.STEPS` lists the keys and defaults). Choose them on
    validation: ``deepmetric tune --postprocess CHECKPOINT``.
    """

    postprocess: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Config:
    """A whole run.  ``description`` is free text (recipes name their paper table row)."""

    name: str = "run"
    description: str = ""
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    loss: list[LossTermConfig] = field(default_factory=lambda: [LossTermConfig()])
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    search: SearchConfig = field(default_factory=SearchConfig)


# --------------------------------------------------------------------------- validation
def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        inner = " or ".join(_type_name(a) for a in args)
        return f"{inner} or null" if len(args) < len(typing.get_args(tp)) else inner
    if origin is list:
        (arg,) = typing.get_args(tp) or (Any,)
        return f"list of {_type_name(arg)}"
    if origin is dict:
        return "mapping"
    if dataclasses.is_dataclass(tp):
        return "mapping"
    if tp is Any:
        return "any value"
    return getattr(tp, "__name__", str(tp))


def _describe(value: Any) -> str:
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{type(value).__name__} {text}"


def _convert(value: Any, tp: Any, path: str) -> Any:
    """Check ``value`` against the type hint ``tp`` and return the typed value."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise ConfigError(f"config key '{path}': expected {_type_name(tp)}, got null")
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg, path)
            except ConfigError as exc:
                errors.append(exc)
        # A single non-null alternative: its own message is the most precise.
        if len(errors) == 1:
            raise errors[0]
        raise ConfigError(f"config key '{path}': expected {_type_name(tp)}, got {_describe(value)}")
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            close = difflib.get_close_matches(str(value), [str(a) for a in allowed], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(
                f"config key '{path}': expected {_type_name(tp)}, got {value!r}{hint}"
            )
        return value
    if origin is list:
        (arg,) = typing.get_args(tp) or (Any,)
        if isinstance(value, tuple):
            value = list(value)
        if not isinstance(value, list):
            raise ConfigError(f"config key '{path}': expected {_type_name(tp)}, got {_describe(value)}")
        return [_convert(v, arg, f"{path}.{i}") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"config key '{path}': expected a mapping, got {_describe(value)}")
        return dict(value)
    if dataclasses.is_dataclass(tp):
        return _build_dataclass(tp, value, path)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"config key '{path}': expected bool (true/false), got {_describe(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConfigError(f"config key '{path}': expected int, got {_describe(value)}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            # YAML 1.1 reads '1e-3' (no dot) as a string; accept numeric strings.
            if isinstance(value, str):
                try:
                    return float(value)
                except ValueError:
                    pass
            raise ConfigError(f"config key '{path}': expected float, got {_describe(value)}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"config key '{path}': expected str, got {_describe(value)}")
        return value
    raise TypeError(f"unsupported config type {tp!r} at '{path}'")  # programming error


def _build_dataclass(cls: type, value: Any, path: str) -> Any:
    if value is None:
        value = {}
    if dataclasses.is_dataclass(value) and isinstance(value, cls):
        value = config_to_dict(value)
    if not isinstance(value, dict):
        where = f"config key '{path}'" if path else "config"
        raise ConfigError(f"{where}: expected a mapping, got {_describe(value)}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, val in value.items():
        full = f"{path}.{key}" if path else str(key)
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1, cutoff=0.5)
            if close:
                hint = f" (did you mean '{path + '.' if path else ''}{close[0]}'?)"
            else:
                hint = f"; valid keys{' of ' + repr(path) if path else ''}: {', '.join(names)}"
            raise ConfigError(f"unknown config key '{full}'{hint}")
        kwargs[key] = _convert(val, hints[key], full)
    return cls(**kwargs)


def _check_values(cfg: Config) -> None:
    """Cross-field checks that the types alone cannot express."""
    from deepmetric.evaluate.postprocess import check_steps

    try:
        cfg.search.postprocess = check_steps(cfg.search.postprocess, "search.postprocess")
    except ValueError as exc:
        raise ConfigError(f"config key {exc}") from None
    if any(s.get("fit") == "train" for s in cfg.search.postprocess):
        raise ConfigError("config key search.postprocess (whiten): fit: train is not available here (the "
                          "evaluation and the index fit on the gallery they search); use fit: gallery, or "
                          "'deepmetric evaluate --postprocess ... --fit-embeddings TRAIN.npz' for a training-set fit")
    t = cfg.train
    if (t.epochs is None) == (t.iterations is None):
        raise ConfigError("config: give exactly one of 'train.epochs' and 'train.iterations'")
    for key in ("epochs", "iterations"):
        v = getattr(t, key)
        if v is not None and v <= 0:
            raise ConfigError(f"config key 'train.{key}': must be positive, got {v}")
    if t.sampler == "class_balanced" and (t.m is None or t.n is None):
        raise ConfigError(
            "config: 'train.sampler: class_balanced' needs 'train.m' (classes per batch) and "
            "'train.n' (images per class)"
        )
    for key in ("batch_size", "grad_accum", "checkpoint_every"):
        if getattr(t, key) < 1:
            raise ConfigError(f"config key 'train.{key}': must be >= 1, got {getattr(t, key)}")
    for key in ("m", "n"):
        v = getattr(t, key)
        if v is not None and v < 1:
            raise ConfigError(f"config key 'train.{key}': must be >= 1, got {v}")
    if t.num_threads is not None and t.num_threads < 1:
        raise ConfigError(f"config key 'train.num_threads': must be >= 1, got {t.num_threads}")
    if t.warmup_epochs < 0:
        raise ConfigError(f"config key 'train.warmup_epochs': must be >= 0, got {t.warmup_epochs}")
    if len(set(t.loggers)) != len(t.loggers):
        raise ConfigError(f"config key 'train.loggers': names a logger twice: {t.loggers}")
    for key, value in t.tracking.tags.items():
        if not isinstance(key, str) or isinstance(value, (dict, list)) or value is None:
            raise ConfigError(f"config key 'train.tracking.tags.{key}': expected a string key and a "
                              f"string, number or bool value, got {_describe(value)}")
    for key in ("experiment", "run_name", "mlflow_uri"):
        if getattr(t.tracking, key) == "":
            raise ConfigError(f"config key 'train.tracking.{key}': empty; leave it out (null) for the default")
    if not cfg.loss:
        raise ConfigError("config key 'loss': needs at least one loss term")
    if cfg.optim.lr < 0:
        raise ConfigError(f"config key 'optim.lr': must be >= 0, got {cfg.optim.lr}")
    if cfg.optim.layer_decay is not None and not 0.0 < cfg.optim.layer_decay <= 1.0:
        raise ConfigError(f"config key 'optim.layer_decay': must be in (0, 1] (the lr factor per stage "
                          f"below the top one), got {cfg.optim.layer_decay}")
    if len(cfg.optim.betas) != 2:
        raise ConfigError(f"config key 'optim.betas': expected two floats, got {cfg.optim.betas}")
    if cfg.eval.every < 0:
        raise ConfigError(f"config key 'eval.every': must be >= 0, got {cfg.eval.every}")
    if cfg.eval.test_every is not None and cfg.eval.test_every < 0:
        raise ConfigError(f"config key 'eval.test_every': must be >= 0, got {cfg.eval.test_every}")
    if not cfg.eval.ks or any(k < 1 for k in cfg.eval.ks):
        raise ConfigError(f"config key 'eval.ks': expected positive ints, got {cfg.eval.ks}")
    if not cfg.eval.test and not cfg.data.has_validation:
        raise ConfigError("config key 'eval.test': false evaluates no split at all without a validation split; "
                          "add data.val_classes (e.g. data.val_classes=0.2) or keep eval.test true")
    if not cfg.eval.test and cfg.eval.train_neighbours:
        raise ConfigError("config key 'eval.test': false, but eval.train_neighbours is measured on the test "
                          "split; turn one of them off")
    if cfg.eval.embedding == "projection" and not cfg.model.options.get("projection"):
        raise ConfigError("config key 'eval.embedding': 'projection' indexes the projection head's output, but "
                          "the model has none (set model.options.projection, e.g. {dim: 128, norm: l2})")
    if len(set(cfg.optim.decay_exclude)) != len(cfg.optim.decay_exclude):
        raise ConfigError(f"config key 'optim.decay_exclude': names a kind twice: {cfg.optim.decay_exclude}")
    _check_validation(cfg)
    s = cfg.schedule.lr
    if s.name == "step" and s.step_size < 1:
        raise ConfigError(f"config key 'schedule.lr.step_size': must be >= 1, got {s.step_size}")
    if s.name == "multistep" and not s.milestones:
        raise ConfigError("config key 'schedule.lr.milestones': 'multistep' needs milestones")
    if s.name == "cosine" and not 0.0 <= s.end_factor <= 1.0:
        raise ConfigError(f"config key 'schedule.lr.end_factor': must be in [0, 1] (the factor the "
                          f"cosine schedule ends at), got {s.end_factor}")
    tc = cfg.schedule.temperature
    if tc.name == "heat_up" and tc.at is None:
        raise ConfigError("config key 'schedule.temperature.at': 'heat_up' needs the epoch/iteration to heat up at")
    if tc.name == "gradual" and (tc.every is None or tc.every < 1):
        raise ConfigError("config key 'schedule.temperature.every': 'gradual' needs a positive interval")
    if tc.name == "auto_plateau" and tc.patience < 1:
        raise ConfigError(f"config key 'schedule.temperature.patience': must be >= 1, got {tc.patience}")
    if tc.losses is not None:
        for i in tc.losses:
            if not 0 <= i < len(cfg.loss):
                raise ConfigError(
                    f"config key 'schedule.temperature.losses': index {i} out of range for "
                    f"{len(cfg.loss)} loss term(s)"
                )
    # Resolve the factor defaults (they depend on the schedule kind).
    default_alpha, default_lr = heating_factors(tc.name)
    if tc.alpha_factor is None:
        tc.alpha_factor = default_alpha
    if tc.lr_factor is None:
        tc.lr_factor = default_lr


def _check_validation(cfg: Config) -> None:
    """Selecting (best.pt, early stopping, auto_plateau on a metric) needs a validation split:
    the test split is never used to choose anything."""
    v = cfg.data.val_classes
    if isinstance(v, float) and not 0.0 < v < 1.0:
        raise ConfigError(f"config key 'data.val_classes': a fraction must be in (0, 1), got {v}")
    if isinstance(v, int) and v < 1:
        raise ConfigError(f"config key 'data.val_classes': a class count must be >= 1, got {v}")
    if isinstance(v, list) and not v:
        raise ConfigError("config key 'data.val_classes': the list of validation classes is empty")
    vq = cfg.data.val_query_families
    if vq is not None:
        if not isinstance(vq, list) or not vq or not all(isinstance(f, str) and f for f in vq):
            raise ConfigError(f"config key 'data.val_query_families': expected a non-empty list of family "
                              f"names, got {vq!r}")
        if not cfg.data.carves_validation:
            raise ConfigError("config key 'data.val_query_families': needs validation classes "
                              "(data.val_classes or data.val_folds)")
    if cfg.data.val_split is not None and cfg.data.carves_validation:
        raise ConfigError("config keys 'data.val_split' and 'data.val_classes' / 'data.val_folds': give one "
                          "validation split (the dataset's own, or classes carved from training)")
    if cfg.eval.metrics == [] and not cfg.eval.classification:
        raise ConfigError("config key 'eval.metrics': [] evaluates no retrieval metric, so it needs "
                          "eval.classification: true (else nothing is evaluated)")
    if cfg.eval.split is None and (cfg.eval.gallery_split is not None or cfg.eval.wise_ft is not None
                                   or cfg.eval.train_neighbours):
        raise ConfigError("config key 'eval.split': null (no test split) cannot go with eval.gallery_split, "
                          "eval.wise_ft or eval.train_neighbours, which evaluate the test split")
    if cfg.data.val_folds is not None:
        if v is not None:
            raise ConfigError("config keys 'data.val_classes' and 'data.val_folds': give one of them")
        if cfg.data.val_folds < 2:
            raise ConfigError(f"config key 'data.val_folds': needs at least 2 folds, got {cfg.data.val_folds}")
        if not 0 <= cfg.data.val_fold < cfg.data.val_folds:
            raise ConfigError(f"config key 'data.val_fold': must be in [0, {cfg.data.val_folds}), "
                              f"got {cfg.data.val_fold}")
    if cfg.eval.kmeans_restarts < 1:
        raise ConfigError(f"config key 'eval.kmeans_restarts': must be >= 1, got {cfg.eval.kmeans_restarts}")
    if cfg.eval.early_stop_patience is not None and cfg.eval.early_stop_patience < 1:
        raise ConfigError(f"config key 'eval.early_stop_patience': must be >= 1, got "
                          f"{cfg.eval.early_stop_patience}")
    if cfg.eval.cross_domain and cfg.eval.gallery_split is not None:
        raise ConfigError("config keys 'eval.cross_domain' and 'eval.gallery_split': cross-domain retrieval "
                          "splits one test set by domain into queries and gallery; drop one of the two")
    if cfg.eval.train_neighbours and not cfg.eval.classification:
        raise ConfigError("config key 'eval.train_neighbours': compares the classifier's mistakes with the "
                          "nearest training images, so it needs eval.classification: true")
    if cfg.eval.wise_ft is not None:
        bad = [a for a in cfg.eval.wise_ft if not 0.0 <= a <= 1.0]
        if not cfg.eval.wise_ft or bad:
            raise ConfigError(f"config key 'eval.wise_ft': expected a non-empty list of mixing coefficients in "
                              f"[0, 1] (e.g. [0.25, 0.5, 0.75]), got {cfg.eval.wise_ft}")
    if cfg.data.carves_validation and cfg.eval.classification:
        raise ConfigError("config keys 'data.val_classes' and 'eval.classification': validation classes "
                          "are carved out of training (class-disjoint), so a classifier cannot be "
                          "evaluated on the test split's classes; use a zero-shot protocol")
    if cfg.data.has_validation:
        return
    why = "the test split is never used to choose a model; add a validation split with " \
          "data.val_classes (e.g. data.val_classes=0.2)"
    if cfg.eval.best_metric is not None:
        raise ConfigError(f"config key 'eval.best_metric' ({cfg.eval.best_metric!r}) selects best.pt "
                          f"on validation metrics, but there is no validation split: {why}, or remove "
                          f"the key (the final model is then the result)")
    if cfg.eval.early_stop_patience is not None:
        raise ConfigError(f"config key 'eval.early_stop_patience' stops on validation metrics, but "
                          f"there is no validation split: {why}")
    if cfg.eval.wise_ft is not None:
        raise ConfigError(f"config key 'eval.wise_ft' chooses the WiSE-FT mixing coefficient on validation "
                          f"metrics, but there is no validation split: {why}")
    t = cfg.schedule.temperature
    if t.name == "auto_plateau" and t.monitor != "train_loss":
        raise ConfigError(f"config key 'schedule.temperature.monitor' ({t.monitor!r}) watches a "
                          f"validation metric, but there is no validation split: {why}, or monitor "
                          f"train_loss")


def config_from_dict(raw: dict | None) -> Config:
    """Validate a plain mapping (as read from YAML) into a ``Config``."""
    raw = dict(raw or {})
    if isinstance(raw.get("loss"), dict):  # one term may be written without the list
        raw["loss"] = [raw["loss"]]
    cfg = _build_dataclass(Config, raw, "")
    _check_values(cfg)
    return cfg


def config_to_dict(cfg: Any) -> dict:
    """The configuration as plain Python data (YAML/JSON/``torch.save`` safe)."""
    return dataclasses.asdict(cfg)


def _flatten(value: Any, prefix: str, out: dict) -> dict:
    if isinstance(value, dict) and value:
        for k, v in value.items():
            _flatten(v, f"{prefix}.{k}" if prefix else str(k), out)
    elif isinstance(value, (list, tuple)) and value and all(isinstance(v, dict) for v in value):
        for i, v in enumerate(value):  # loss terms, parameter groups
            _flatten(v, f"{prefix}.{i}", out)
    else:
        out[prefix] = value
    return out


def flatten_config(cfg: Any) -> dict[str, Any]:
    """The configuration (``Config`` or plain dict) as ``{"dotted.key": value}``: mappings and
    lists of mappings (loss terms, parameter groups) are opened up, other lists stay values
    (``eval.ks``).  Trackers log these as hyperparameters."""
    return _flatten(config_to_dict(cfg) if dataclasses.is_dataclass(cfg) else cfg, "", {})


def config_diff(old: Any, new: Any) -> list[tuple[str, Any, Any]]:
    """The keys whose values differ between two configs (``Config`` or plain dicts), as
    ``(dotted.key, old value, new value)`` sorted by key; a key missing on one side has
    the value ``"<absent>"`` there."""
    a = _flatten(config_to_dict(old) if dataclasses.is_dataclass(old) else old, "", {})
    b = _flatten(config_to_dict(new) if dataclasses.is_dataclass(new) else new, "", {})
    missing = "<absent>"
    return [(k, a.get(k, missing), b.get(k, missing)) for k in sorted(set(a) | set(b))
            if a.get(k, missing) != b.get(k, missing)]


# --------------------------------------------------------------------------- overrides
def _parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected KEY=VALUE, e.g. optim.lr=0.001")
    key, _, raw = text.partition("=")
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r}: empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {text!r}: value is not valid YAML ({exc})") from None
    return key.split("."), value


def apply_overrides(raw: dict, overrides: list[str] | tuple[str, ...] | None) -> dict:
    """Apply ``a.b.c=value`` overrides to a raw config mapping (in place) and return it.

    Integer path parts index lists (``loss.0.weight=2``).  Unknown keys are created here and
    then rejected, with a suggestion, by validation.
    """
    for text in overrides or ():
        parts, value = _parse_override(text)
        node: Any = raw
        for depth, part in enumerate(parts[:-1]):
            where = ".".join(parts[: depth + 1])
            if isinstance(node, list):
                node = node[_list_index(node, part, where, text)]
                continue
            if not isinstance(node, dict):
                raise ConfigError(f"override {text!r}: '{'.'.join(parts[:depth])}' is not a mapping")
            if node.get(part) is None:
                node[part] = [] if part == "loss" else {}
                if part == "loss":
                    node[part] = [dict(config_to_dict(LossTermConfig()))]
            node = node[part]
        last = parts[-1]
        if isinstance(node, list):
            node[_list_index(node, last, text, text)] = value
        elif isinstance(node, dict):
            node[last] = value
        else:
            raise ConfigError(f"override {text!r}: '{'.'.join(parts[:-1])}' is not a mapping")
    return raw


def _list_index(node: list, part: str, where: str, text: str) -> int:
    try:
        i = int(part)
    except ValueError:
        raise ConfigError(f"override {text!r}: '{where}' indexes a list; use an integer") from None
    if not -len(node) <= i < len(node):
        raise ConfigError(f"override {text!r}: index {i} out of range (list has {len(node)} items)")
    return i


# --------------------------------------------------------------------------- files
def read_yaml_mapping(path: str | Path, what: str = "config file") -> dict:
    """A YAML file whose top level is a mapping (an empty file reads as ``{}``); a missing file
    is a ``FileNotFoundError`` and bad YAML or another top level a ``ConfigError``, each naming
    the file (the recipes, study files and tune spaces are all read here)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{what} not found: {p}")
    try:
        raw = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{what} {p}: invalid YAML ({exc})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{what} {p}: top level must be a mapping, got {type(raw).__name__}")
    return raw


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Read a YAML config (or start from defaults when ``path`` is None), apply overrides,
    validate, and return the ``Config``."""
    raw: dict = {}
    if path is not None:
        raw = read_yaml_mapping(path)
    apply_overrides(raw, overrides)
    try:
        return config_from_dict(raw)
    except ConfigError as exc:
        if path is not None:
            raise ConfigError(f"{path}: {exc}") from None
        raise


def save_config(cfg: Config, path: str | Path) -> Path:
    """Write the resolved configuration as YAML (keys in dataclass order)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False, default_flow_style=None))
    return p
