"""The typed training configuration: the schema of a run.

A run is described by one YAML file that maps onto the nested dataclasses below
(``Config`` at the top).  Reading it is :mod:`deepmetric.run.config_io` (``load_config(path,
overrides)`` reads the YAML, applies ``key.sub=value`` overrides, values parsed as YAML, so
``optim.lr=1e-3`` is a float and ``eval.ks=[1,10]`` a list); turning the mapping into these
dataclasses, key by key and type by type, is :mod:`deepmetric.run.config_types`; the checks
across keys and of option names against the registries are :mod:`deepmetric.run.config_checks`:

* an unknown or misspelt key is a ``ConfigError`` naming its full path and the closest valid
  key (``difflib``), e.g. ``unknown config key 'optim.lrr'`` and ``'optim.lr'``;
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
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

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
    "SearchConfig",
    "Config",
    "config_to_dict",
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
    file in the run directory, no server).  ``deepmetric tune`` / ``study`` pass them on as
    command-line overrides, so one ``mlflow_uri`` there puts every trial in one store."""

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
    before training, the untrained (or pretrained) network and the raw pixels (skipped when
    their exact search would cost too much: ``run/baselines.py``); they are printed, logged as ``{"type": "baseline"}`` records and stored
    in ``metrics.json`` under ``baselines``.

    ``cross_domain`` adds ``cross_domain_recall@K`` and ``cross_domain_map@r`` (by default) to the
    validation and test metrics: the queries of each domain (the emoji vendors) against the
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
    #: retrieval / clustering metrics (null: recall, map@r, r_precision, nmi, f1); ``[]``: none, only ``eval.classification``'s
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
    so ``best.pt`` is chosen on the post-processed validation metric), ``deepmetric evaluate
    --postprocess``, ``deepmetric index`` (fitted parameters stored in the index; ``search``
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


def config_to_dict(cfg: Any) -> dict:
    """The configuration as plain Python data (YAML/JSON/``torch.save`` safe)."""
    return dataclasses.asdict(cfg)
