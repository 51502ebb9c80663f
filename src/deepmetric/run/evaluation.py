"""A run's evaluation policy: which metrics an evaluation of ``cfg.eval`` produces
(:func:`expected_metrics`), how the evaluation splits are named, where the searches run
(``eval.device``: :func:`eval_search_device`; a command's ``--search-device``:
:func:`command_search_device`; :func:`place_for_search`), and the evaluation itself.

``evaluate_model`` embeds the evaluation split(s) and calls ``deepmetric.evaluate.evaluate`` --
all samples against each other for zero-shot splits, queries against the gallery for In-shop
(two splits) and for a split that marks its own queries and gallery (``is_query`` /
``is_gallery`` attributes: the glyphs ``cross_family`` test split).  On a CUDA run the
embeddings never leave the GPU for the search (``eval.device: auto``).  ``eval.cross_domain``
adds :func:`cross_domain_metrics`, ``eval.train_neighbours`` :func:`train_neighbour_metrics`.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from .builders import build_split
from .config import Config, ConfigError
from .device import resolve_device
from .embed import compute_embeddings, dataset_domains, dataset_query_gallery_masks

__all__ = ["expected_metrics", "final_test_metrics", "split_names", "cross_domain_metrics",
           "eval_search_device", "SEARCH_DEVICE_CHOICES", "command_search_device", "place_for_search",
           "train_neighbour_metrics", "evaluate_model", "evaluate_split"]


def expected_metrics(cfg: Config) -> list[str]:
    """The metric names one evaluation with ``cfg.eval`` produces, read from the metric registry
    (:func:`deepmetric.evaluate.evaluation_keys`): what :func:`evaluate_model` and
    :func:`cross_domain_metrics` compute."""
    from deepmetric.evaluate import evaluation_keys

    e = cfg.eval
    try:
        return evaluation_keys(e.metrics, e.ks, classification=e.classification, cross_domain=e.cross_domain)
    except ValueError as exc:
        raise ConfigError(f"config key 'eval.metrics': {exc}") from None


def final_test_metrics(cfg: Config) -> list[str]:
    """The metric names of a run's final test evaluation (``metrics.json``'s ``final.test``):
    :func:`expected_metrics`, then with ``eval.train_neighbours`` the keys of
    :func:`train_neighbour_metrics`, which only the final evaluation adds."""
    from deepmetric.evaluate import TRAIN_NEIGHBOUR_KEYS

    return expected_metrics(cfg) + (list(TRAIN_NEIGHBOUR_KEYS) if cfg.eval.train_neighbours else [])


def split_names(cfg: Config, eval_sets: dict[str, Any]) -> list[tuple[str, Any]]:
    """``[(split name, dataset)]`` of the evaluation splits: ``eval_sets`` is ``{"val": {"query":
    ds}, "test": {"query": ds[, "gallery": ds]}}`` (or one such inner mapping)."""
    if eval_sets and all(isinstance(v, dict) for v in eval_sets.values()):
        groups = list(eval_sets.items())
    else:
        groups = [("test", eval_sets)]
    out = []
    for group, sets in groups:
        for key, ds in sets.items():
            if group == "test":
                name = cfg.eval.split if key == "query" else (cfg.eval.gallery_split or key)
            else:
                name = group if key == "query" else f"{group} {key}"
            out.append((name, ds))
    return out


def eval_search_device(cfg, device: torch.device | str, *, nbytes: int = 0) -> torch.device:
    """Where an evaluation of a run searches (config key ``eval.device``): ``auto`` = the
    training ``device`` (on CUDA the embeddings stay on the GPU and
    :func:`deepmetric.evaluate.evaluate` searches there with its torch backend; on the CPU,
    faiss), ``cpu`` = faiss on the CPU whatever the training device.  ``nbytes`` (the
    embeddings' size): an ``auto`` search that would not fit in the GPU's free memory runs on
    the CPU (:func:`deepmetric.evaluate.choose_search_device`)."""
    from deepmetric.evaluate import choose_search_device

    return choose_search_device(cfg.eval.device, default=torch.device(device), nbytes=nbytes,
                                flag="config key 'eval.device'")


#: what the ``--search-device`` flag of ``deepmetric report`` and ``deepmetric index`` takes
#: (the GPU itself comes from their ``--device``)
SEARCH_DEVICE_CHOICES = ("auto", "cpu")


def command_search_device(device: str = "auto", search_device: str = "auto", *, nbytes: int = 0) -> torch.device:
    """Where a command that runs a model and then searches (``deepmetric report``, ``deepmetric
    index``) searches: ``--search-device cpu`` -> faiss on the CPU; ``auto`` -> the model's
    ``--device`` (auto | cpu | cuda[:i]), the GPU's torch backend when that is CUDA and
    ``nbytes`` (the embeddings) fit in its free memory
    (:func:`deepmetric.evaluate.choose_search_device`).  Errors name the flags."""
    from deepmetric.evaluate import choose_search_device

    if search_device not in SEARCH_DEVICE_CHOICES:
        raise ValueError(f"--search-device {search_device!r}: expected one of {', '.join(SEARCH_DEVICE_CHOICES)} "
                         "(auto: where --device puts the model)")
    model_device = resolve_device(device, name="--device")  # checked even when the search is on the CPU
    if search_device == "cpu":
        return torch.device("cpu")
    return choose_search_device("auto", default=model_device, nbytes=nbytes, flag="--search-device")


def place_for_search(x, device: torch.device | str | None):
    """``x`` (numpy array or tensor) where a search on ``device`` (None: the CPU) wants it: a
    tensor on that device (on the CPU, a CPU tensor goes to faiss), a numpy array as it is for
    the CPU."""
    device = torch.device("cpu" if device is None else device)
    if isinstance(x, torch.Tensor):
        return x.to(device)  # a GPU tensor bound for a CPU search comes to the host
    return x if device.type == "cpu" else torch.from_numpy(np.ascontiguousarray(x)).to(device)


def _postprocess(cfg) -> list:
    """``search.postprocess`` of a config (an older config object may lack the section)."""
    search = getattr(cfg, "search", None)
    return list(getattr(search, "postprocess", None) or [])


def cross_domain_metrics(embedded: dict, dataset, cfg, *, device: torch.device | str | None = None) -> dict[str, float]:
    """``eval.cross_domain``: ``cross_domain_<metric>``, the mean over domains of each domain's
    queries against the other domains' images (:func:`deepmetric.evaluate.evaluate_cross_domain`).
    ``device``: the training device; the searches run where :func:`eval_search_device` says
    (None: on the CPU)."""
    from deepmetric.evaluate import cross_domain_selection, evaluate_cross_domain

    domains = dataset_domains(dataset)
    if domains is None:
        raise ValueError(f"config key 'eval.cross_domain': the test split ({type(dataset).__name__}) has no "
                         "domains (domain_ids, or vendor_ids as in the emoji benchmark)")
    x = embedded["embeddings"]
    if device is not None:
        x = place_for_search(x, eval_search_device(cfg, device, nbytes=4 * int(np.prod(x.shape))))
    res = evaluate_cross_domain(x, embedded["labels"], domains[0], domain_names=domains[1], ks=tuple(cfg.eval.ks),
                                metrics=cross_domain_selection(cfg.eval.metrics), seed=cfg.train.seed,
                                postprocess=_postprocess(cfg))
    return {f"cross_domain_{k}": float(v) for k, v in res["mean"].items()}


def train_neighbour_metrics(model: nn.Module, embedded: dict, cfg, *, device: torch.device) -> dict[str, float]:
    """``eval.train_neighbours``: embed the training split (test transform) and compare every
    misclassified test image's prediction with its nearest training image
    (:func:`deepmetric.evaluate.misclassified_neighbour_agreement`), searched where
    :func:`eval_search_device` says."""
    from deepmetric.evaluate import misclassified_neighbour_agreement

    train_set = build_split(cfg, cfg.data.train_split, train=False)
    t = compute_embeddings(model, train_set, batch_size=cfg.eval.batch_size, device=device, amp=cfg.train.amp,
                           channels_last=cfg.train.channels_last, num_workers=cfg.data.num_workers, as_tensor=True)
    test = embedded["embeddings"]
    where = eval_search_device(cfg, device, nbytes=4 * (t["embeddings"].numel() + int(np.prod(test.shape))))
    return misclassified_neighbour_agreement(embedded["logits"], embedded["labels"], place_for_search(test, where),
                                             place_for_search(t["embeddings"], where), t["labels"])


def evaluate_model(model: nn.Module, eval_sets: dict[str, Dataset], cfg, *, device: torch.device,
                   losses: Sequence[nn.Module] = (), backend: str = "auto") -> tuple[dict[str, float], dict[str, Any]]:
    """Evaluate ``model`` on ``eval_sets`` (``{"query": ds}`` or ``{"query": ds, "gallery": ds}``)
    with the settings of ``cfg.eval``.  Returns ``(metrics, embedded)`` where ``embedded``
    holds the arrays (numpy, for plots).

    The embeddings stay on ``device`` and are searched where :func:`eval_search_device` says:
    on the GPU of a CUDA run (``evaluate``'s torch backend), on the CPU with faiss otherwise or
    with ``eval.device: cpu``.  ``backend`` is passed to :func:`deepmetric.evaluate.evaluate`
    (``auto``: faiss on the CPU, torch on a GPU)."""
    from deepmetric.evaluate import evaluate

    ec = cfg.eval
    clf_loss = next((l for l in losses if hasattr(l, "logits")), None)
    kw = dict(batch_size=ec.batch_size, device=device, amp=cfg.train.amp, channels_last=cfg.train.channels_last,
              num_workers=cfg.data.num_workers, as_tensor=True, output=ec.embedding)
    q = compute_embeddings(model, eval_sets["query"], with_logits=ec.classification, loss_with_logits=clf_loss, **kw)
    if "gallery" in eval_sets:
        g = compute_embeddings(model, eval_sets["gallery"], **kw)
        emb = torch.cat([q["embeddings"], g["embeddings"]])
        lab = np.concatenate([q["labels"], g["labels"]])
        is_query = np.r_[np.ones(len(q["labels"]), bool), np.zeros(len(g["labels"]), bool)]
        masks = {"is_query": is_query, "is_gallery": ~is_query}
    else:
        # a split that marks its own queries and gallery (glyphs, protocol cross_family: test)
        emb, lab = q["embeddings"], q["labels"]
        masks = dataset_query_gallery_masks(eval_sets["query"])
    where = eval_search_device(cfg, device, nbytes=4 * emb.numel())
    metrics = {} if ec.metrics == [] else evaluate(  # []: classification only
        place_for_search(emb, where), lab, ks=tuple(ec.ks), metrics=ec.metrics, seed=cfg.train.seed,
        kmeans_restarts=ec.kmeans_restarts, backend=backend, postprocess=_postprocess(cfg), **masks)
    emb_np = emb.cpu().numpy()
    if "gallery" in eval_sets:
        embedded = {"embeddings": emb_np, "labels": lab, **masks}
    else:
        embedded = {**q, "embeddings": emb_np, **masks}
    metrics = {k: float(v) for k, v in metrics.items()}
    if ec.classification:
        if "logits" not in q:
            raise ValueError("config key 'eval.classification': the model has no 'logits' output "
                             "and no loss term has a classifier (.logits)")
        from deepmetric.evaluate import classification_accuracy

        acc = classification_accuracy(q["logits"], q["labels"])
        metrics.update({k: float(v) for k, v in acc.items()})
    return metrics, embedded


def evaluate_split(model: nn.Module, sets: dict[str, Dataset], cfg, *, device: torch.device,
                   losses: Sequence[nn.Module] = ()) -> tuple[dict[str, float], dict[str, Any]]:
    """One evaluation of ``sets`` during training (the loop's evaluator, WiSE-FT's mixtures):
    :func:`evaluate_model`'s metrics and, with ``eval.cross_domain``, :func:`cross_domain_metrics`;
    returns ``(metrics, embedded)`` as :func:`evaluate_model` does."""
    metrics, embedded = evaluate_model(model, sets, cfg, device=device, losses=losses)
    if cfg.eval.cross_domain:
        metrics.update(cross_domain_metrics(embedded, sets["query"], cfg, device=device))
    return metrics, embedded

