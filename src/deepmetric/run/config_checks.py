"""Validating a run's config beyond the types (:mod:`deepmetric.run.config_types`): the one
place a config's values and option names are checked.

* :func:`check_values` (every config, when it is read): cross-field checks (the run's length,
  the sampler, the validation split that every selection needs, the schedules);
* :func:`check_config_options` (before a run is built): unknown keys inside the free-form
  ``options`` mappings of ``data``, ``data.transform_options``, ``model`` and ``loss.i``, with
  the closest valid name (``unknown option 'alpah'`` and ``alpha``), against the registries,
  and the values of a loss term's, a dataset's and a transform's options against their type hints;
* :func:`check_monitored_metrics`: ``eval.best_metric`` and ``schedule.temperature.monitor``
  against :func:`~deepmetric.run.evaluation.expected_metrics`, the metric names the
  evaluation will produce.

Every failure is a :class:`~deepmetric.run.config.ConfigError` in the terms of the YAML config
(``config key 'eval.best_metric'``).
"""
from __future__ import annotations

from typing import Iterable

from deepmetric.options import option_hints
from deepmetric.registry import did_you_mean

from .config import Config, ConfigError, heating_factors
from .config_types import convert_value, convertible, describe_value

__all__ = ["check_values", "check_config", "check_config_options", "check_monitored_metrics", "loss_term_options",
           "unknown_option_error"]


def check_values(cfg: Config) -> None:
    """Cross-field checks that the types alone cannot express (in place: ``search.postprocess``
    is normalised and the heating factors' defaults filled in)."""
    _check_search(cfg)
    _check_train(cfg)
    _check_optim_and_eval(cfg)
    _check_validation(cfg)
    _check_schedules(cfg)


def _check_search(cfg: Config) -> None:
    """``search.postprocess``: known steps and keys (fitted on the gallery, never on training)."""
    from deepmetric.evaluate.postprocess import check_steps

    try:
        cfg.search.postprocess = check_steps(cfg.search.postprocess, "search.postprocess")
    except ValueError as exc:
        raise ConfigError(f"config key {exc}") from None
    if any(s.get("fit") == "train" for s in cfg.search.postprocess):
        raise ConfigError("config key search.postprocess (whiten): fit: train is not available here (the "
                          "evaluation and the index fit on the gallery they search); use fit: gallery, or "
                          "'deepmetric evaluate --postprocess ... --fit-embeddings TRAIN.npz' for a training-set fit")


def _check_train(cfg: Config) -> None:
    """``train``: the run's length, the sampler's m x n, counts and the trackers' settings."""
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
                              f"string, number or bool value, got {describe_value(value)}")
    for key in ("experiment", "run_name", "mlflow_uri"):
        if getattr(t.tracking, key) == "":
            raise ConfigError(f"config key 'train.tracking.{key}': empty; leave it out (null) for the default")


def _check_optim_and_eval(cfg: Config) -> None:
    """``loss``, ``optim`` and ``eval`` values, each on its own."""
    if not cfg.loss:
        raise ConfigError("config key 'loss': needs at least one loss term")
    if not 0 <= cfg.optim.lr < float("inf"):  # nan fails every comparison
        raise ConfigError(f"config key 'optim.lr': must be a finite number >= 0, got {cfg.optim.lr}")
    if not 0 <= cfg.optim.weight_decay < float("inf"):
        raise ConfigError(f"config key 'optim.weight_decay': must be a finite number >= 0, got {cfg.optim.weight_decay}")
    if not 0 <= cfg.train.seed < 2**32:  # NumPy's generators take 0 .. 2**32 - 1
        raise ConfigError(f"config key 'train.seed': must be an integer in 0 .. 4294967295, got {cfg.train.seed}")
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


def _check_schedules(cfg: Config) -> None:
    """``schedule.lr`` and ``schedule.temperature``; fills in the heating factors' defaults."""
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


# --------------------------------------------------------------------------- option and metric names
def unknown_option_error(path: str, key: str, accepted: Iterable[str], owner: str) -> ConfigError:
    """``config key 'loss.0.options.alpah': unknown option 'alpah' for loss 'heated_softmax'``
    with the closest option (``alpha``) -- or the list of accepted options when nothing is close."""
    accepted = sorted(set(accepted))
    hint = did_you_mean(key, accepted) or f"; accepted: {', '.join(accepted) or 'none'}"
    return ConfigError(f"config key '{path}.{key}': unknown option '{key}' for {owner}{hint}")


def _check_options(path: str, given: dict, accepted: set[str] | None, owner: str) -> None:
    """Every key of ``given`` must be in ``accepted`` (None: the registry cannot tell, the
    builder checks them itself).  An unknown key set to null is most often a recipe's option
    that an override ``KEY=null`` was meant to remove (another model than the recipe's): the
    message says that null sets a value and how to replace the whole mapping."""
    if accepted is None:
        return
    for key in given:
        if key not in accepted:
            err = unknown_option_error(path, key, accepted, owner)
            if given[key] is None:
                err = ConfigError(f"{err}; {path}.{key}=null sets the option to null, it does not remove it: "
                                  f"to drop an option of the recipe, give the whole mapping, e.g. "
                                  f"'{path}={{...}}' with the options you keep")
            raise err


def _unknown_name_error(key: str, what: str, name, names: list[str]) -> ConfigError:
    """``config key 'loss.0.name': unknown loss 'tripet'``, the closest name (``triplet``) and
    ``available: ...``."""
    return ConfigError(f"config key '{key}': unknown {what} '{name}'{did_you_mean(name, names)}; "
                       f"available: {', '.join(names)}")


def check_config_options(cfg: Config) -> None:
    """Unknown keys inside ``data.options``, ``data.transform_options``, ``model.options`` and
    ``loss.i.options`` raise a :class:`ConfigError` naming the full key and the closest valid
    option, before anything is built.  The accepted options come from the registries
    (:func:`~deepmetric.data.dataset_options`, :func:`~deepmetric.data.transform_options`,
    :func:`~deepmetric.models.model_options`, :func:`~deepmetric.losses.loss_options`)."""
    from deepmetric.data import (dataset_option_hints, dataset_options, list_transforms, transform_option_hints,
                                 transform_options)
    from deepmetric.models import model_options

    d = cfg.data
    try:
        accepted = dataset_options(d.name)
    except (ValueError, TypeError):
        accepted = None  # build_dataset names the unknown dataset itself
    _check_options("data.options", d.options, accepted, f"dataset '{d.name}'")
    if accepted is not None:
        _check_option_values("data.options", d.options, dataset_option_hints(d.name))
    if d.transform is not None:
        try:
            accepted = transform_options(d.transform)
        except ValueError:
            raise _unknown_name_error("data.transform", "transform", d.transform, list_transforms()) from None
        _check_options("data.transform_options", d.transform_options, accepted, f"transform '{d.transform}'")
        _check_option_values("data.transform_options", d.transform_options, transform_option_hints(d.transform))

    m = cfg.model
    try:
        accepted = model_options(m.name, m.options)
    except ValueError:
        accepted = None  # create_model names the unknown model itself
    _check_options("model.options", m.options, accepted, f"model '{m.name}'")

    from deepmetric.losses import loss_class

    for i, term in enumerate(cfg.loss):
        _check_options(f"loss.{i}.options", term.options, loss_term_options(cfg, i), f"loss '{term.name}'")
        _check_option_values(f"loss.{i}.options", term.options, option_hints(loss_class(term.name)))


def _check_option_values(path: str, options: dict, hints: dict) -> None:
    """Each value of ``options`` against its type hint in ``hints`` (a loss constructor's, a
    dataset loader's), converted in place as the typed config's own keys are (an int option
    given 2.0 becomes 2, a float option a numeric string: YAML 1.1 reads ``1e-3`` as one).
    These options were passed on as given: ``learnable_alpha: "false"`` or ``skip_missing:
    "false"`` counted as true.  Hints outside the config's types (a tensor, a sequence) and
    options without a hint are left to the code that takes them."""
    for key, value in list(options.items()):
        tp = hints.get(key)
        if tp is not None and convertible(tp):
            options[key] = convert_value(value, tp, f"{path}.{key}")


def loss_term_options(cfg: Config, i: int) -> set[str] | None:
    """The options loss term ``i`` accepts (None: the loss takes ``**options`` and checks them
    itself); an unknown loss name is a ``ConfigError`` naming ``loss.i.name``, the closest name
    and the registered ones.  :func:`check_config_options` and
    :func:`deepmetric.run.builders.build_losses` both ask here."""
    from deepmetric.losses import list_losses, loss_options

    name = cfg.loss[i].name
    try:
        return loss_options(name)
    except ValueError:
        raise _unknown_name_error(f"loss.{i}.name", "loss", name, list_losses()) from None


def check_monitored_metrics(cfg: Config) -> list[str]:
    """``eval.best_metric`` (and an evaluation metric as ``schedule.temperature.monitor``) must
    be among :func:`~deepmetric.run.evaluation.expected_metrics`; returns those names."""
    from .evaluation import expected_metrics

    names = expected_metrics(cfg)

    def fail(key: str, value: str) -> ConfigError:
        return ConfigError(f"config key '{key}': '{value}' is not a metric this run computes"
                           f"{did_you_mean(value, names)}; "
                           f"the evaluation gives {', '.join(names)} (see eval.ks, eval.metrics, "
                           "eval.classification)")

    best = cfg.eval.best_metric
    if best is None and cfg.data.has_validation:
        best = "recall@1"  # the default selection metric with a validation split
    if best is not None and best not in names:
        raise fail("eval.best_metric", best)
    t = cfg.schedule.temperature
    if t.monitor != "train_loss" and t.name == "auto_plateau" and t.monitor not in names:
        raise fail("schedule.temperature.monitor", t.monitor)
    return names


def check_config(cfg: Config) -> None:
    """Everything checkable from the config alone (before data or model are built)."""
    check_config_options(cfg)
    check_monitored_metrics(cfg)

