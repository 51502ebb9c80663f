"""``deepmetric report RUN_DIR``: one HTML page, PNG figures and a Markdown summary of a run.

Reads what a training run leaves in its directory - the JSON-lines log ``log.jsonl``, the
resolved ``config.yaml``, ``metrics.json`` and the checkpoint - and writes into
``RUN_DIR/report/``:

==========================  =======================================================
``report.html``             the whole report as one self-contained page (figures and
                            image thumbnails embedded): configuration and summary,
                            metric tables (validation / test marked, baselines),
                            training curves, Recall@K, cosine histograms, 2-d
                            embedding, retrieval grids (random and worst queries with
                            their top-8 neighbours, right / wrong marked), per-class
                            recall, misclassified test images beside their nearest
                            training image (classifiers)
``training_curves.png``     loss, lr, alpha per step; metrics per evaluation
``recall_at_k.png``         Recall@K, K = 1, 2, 4, ... (needs embeddings)
``cosine_histograms.png``   same- vs different-class cosine similarity (Fig. 4)
``embedding_2d.png``        2-d scatter / PCA coloured by class (Fig. 2)
``grad_norm_alpha.png``     gradient norm vs alpha (Fig. 1; needs class weights)
``report.md``               the numbers, with links to the figures
==========================  =======================================================

Embeddings come from ``--embeddings EMB.npz`` (``deepmetric embed`` output), else
``RUN_DIR/embeddings.npz``, else they are computed with the run's checkpoint (``best.pt``,
else ``last.pt``) on the test split rebuilt from ``config.yaml``. The ``.npz`` holds
``embeddings`` (N x d) and ``labels`` (N); optional keys add sections: ``is_query`` /
``is_gallery`` (In-shop protocol), ``train_embeddings`` + ``train_labels`` (train-split
histogram; with ``class_weights`` (C x d) of the trained classifier also Fig. 1 on real
samples), ``logits`` (N x C) or ``predictions`` (N) of a classifier (two-head model:
accuracy and the nearest-training-image analysis of misclassified test images, two-head
paper Sec. 4.3). The retrieval grids show images when the rebuilt split matches the
embedding rows label for label.
"""
from __future__ import annotations

import copy
import warnings
import zipfile
from pathlib import Path

import numpy as np

from . import diagnostics as dg
from . import page as pg
from deepmetric.evaluate.io import describe_file
from deepmetric.run import rundir

from deepmetric.run.evaluation import command_search_device

from .embedding_sections import embedding_sections
from .run_inputs import check_run_dir, embed_run, find_checkpoint
from .run_sections import Report, full_config_section, summary_section, training_section

__all__ = ["make_report", "load_embeddings_npz", "check_embedding_arrays", "CONFIG_NAMES", "LOG_NAME"]

LOG_NAME = rundir.LOG
CONFIG_NAMES = rundir.CONFIG_NAMES


def load_embeddings_npz(path: str | Path) -> dict[str, np.ndarray]:
    """Read an embeddings ``.npz`` and check the keys the report uses (see module doc)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"embeddings file not found: {path}")
    try:
        with np.load(path, allow_pickle=False) as z:
            data = {k: z[k] for k in z.files}
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as exc:  # empty, truncated, not an archive
        what = describe_file(path)  # text, an image, a checkpoint: numpy's reason would say "pickled data"
        raise ValueError(f"{path}: {f'this is {what}' if what else f'not a readable .npz file ({exc})'}; "
                         "expected an .npz with 'embeddings' and 'labels' ('deepmetric embed')") from None
    for key in ("embeddings", "labels"):
        if key not in data:
            raise ValueError(f"{path}: missing array '{key}' (found: {', '.join(sorted(data)) or 'none'})")
    n = len(data["embeddings"]) if np.ndim(data["embeddings"]) else 0
    for key in ("labels", "is_query", "is_gallery", "logits", "predictions"):
        if key in data and np.ndim(data[key]) and len(data[key]) != n:
            raise ValueError(f"{path}: '{key}' has {len(data[key])} rows but 'embeddings' has {n}")
    if ("train_embeddings" in data) != ("train_labels" in data):
        raise ValueError(f"{path}: 'train_embeddings' and 'train_labels' must be given together")
    check_embedding_arrays(data, str(path))
    return data


def check_embedding_arrays(data: dict, where: str) -> None:
    """The arrays the report's sections read (module docstring), checked before anything is
    written: a problem is one ``ValueError`` naming ``where`` (the .npz, or the checkpoint that
    embedded them) instead of a traceback, or an error without a file, half-way through the page."""
    from deepmetric.evaluate import check_embeddings

    try:
        x = np.asarray(data["embeddings"])
        check_embeddings(x, "'embeddings'")  # 2-D numbers, finite, no all-zero row
        n, d = x.shape
        y = dg._as_labels(data["labels"], n, "'labels'")
        masks = []
        for key in ("is_query", "is_gallery"):
            m = np.ones(n, bool) if data.get(key) is None else np.asarray(data[key])
            if m.dtype != bool or m.shape != (n,):
                raise ValueError(f"'{key}' must be a boolean array of shape ({n},), got shape {m.shape} dtype {m.dtype}")
            if not m.any():
                raise ValueError(f"'{key}' selects no row")
            masks.append(m)
        q, g = masks
        if len(np.unique(y[q | g])) < 2:
            raise ValueError("every row has the same label: retrieval and its figures need at least 2 classes")
        classes, counts = np.unique(y[g], return_counts=True)
        at = np.clip(np.searchsorted(classes, y[q]), 0, len(classes) - 1)
        refs = np.where(classes[at] == y[q], counts[at], 0) - g[q]  # same-label references, itself excluded
        if not (refs > 0).any():
            raise ValueError("no query has another row of its label to retrieve (each label occurs once, or only "
                             "among the queries)")
        if "train_embeddings" in data:
            xt = np.asarray(data["train_embeddings"])
            check_embeddings(xt, "'train_embeddings'")
            if xt.shape[1] != d:
                raise ValueError(f"'train_embeddings' have {xt.shape[1]} columns but 'embeddings' have {d}")
            dg._as_labels(data["train_labels"], len(xt), "'train_labels'")
        w = data.get("class_weights")
        if w is not None and (np.ndim(w) != 2 or np.shape(w)[1] != d):
            raise ValueError(f"'class_weights' must be (classes, {d}) like the embeddings, got shape {np.shape(w)}")
        if data.get("logits") is not None and (np.ndim(data["logits"]) != 2 or len(data["logits"]) != n):
            raise ValueError(f"'logits' must be ({n}, classes), one row per embedding, got shape "
                             f"{np.shape(data['logits'])}")
        if data.get("predictions") is not None:
            dg._as_labels(data["predictions"], n, "'predictions'")
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{where}: {exc}") from None


def _read_config(run_dir: Path) -> tuple[dict | None, Path | None]:
    """The run's config as a mapping and its path; a file that is not one (bad YAML, binary, a
    list) is a one-line ``ValueError`` naming it (it was shown as "no config.yaml", or a
    multi-line PyYAML message)."""
    import yaml

    for name in CONFIG_NAMES:
        p = run_dir / name
        if p.is_file():
            try:
                raw = yaml.safe_load(p.read_text(encoding="utf-8"))
            except UnicodeDecodeError as exc:
                raise ValueError(f"{p}: not a text file ({exc.reason} at byte {exc.start}); expected the run's "
                                 "YAML configuration") from None
            except yaml.YAMLError as exc:
                mark = getattr(exc, "problem_mark", None)
                at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
                problem = getattr(exc, "problem", None) or " ".join(str(exc).split())
                raise ValueError(f"{p}: invalid YAML ({problem}{at})") from None
            if not isinstance(raw, dict):
                raise ValueError(f"{p}: expected the run's configuration (a YAML mapping such as 'data: ...'), "
                                 f"got {'an empty file' if raw is None else type(raw).__name__}")
            return raw, p
    return None, None


def make_report(run_dir: str | Path, embeddings: str | Path | None = None, *,
                out_dir: str | Path | None = None, max_pairs: int = 1_000_000, seed: int = 0,
                ks: tuple[int, ...] = (1, 2, 4, 8, 16, 32), checkpoint: str | Path | bool | None = None,
                split: str | None = None, device: str = "cpu", batch_size: int = 256,
                embed_train: bool | None = None, images: bool = True, n_queries: int = 8,
                top_k: int = 8, search_device: str = "auto") -> Path:
    """Write ``report.html``, the figures and ``report.md`` of a run; returns the path of
    ``report.md`` (``report.html`` sits beside it).

    ``run_dir`` must be a training run (holding at least one of ``log.jsonl``,
    ``config.yaml``, ``metrics.json``, ``best.pt`` / ``last.pt``); anything else is a
    ``ValueError`` naming the folder. ``embeddings`` is an ``.npz`` as described in the
    module docstring; when omitted, ``RUN_DIR/embeddings.npz`` is used if it exists, else
    the embeddings of the test split (``split``: another split, or ``query+gallery``) are
    computed with ``checkpoint`` (default ``best.pt``, else ``last.pt``; ``False``: never)
    on ``device``. ``out_dir`` defaults to ``RUN_DIR/report``. ``max_pairs`` bounds the
    pairs per histogram (exact below it). ``images``: show dataset images in the grids;
    ``n_queries`` random and ``n_queries`` worst queries with their ``top_k`` neighbours.
    ``search_device``: where the neighbour searches run (:func:`~deepmetric.run.evaluation.command_search_device`:
    ``auto`` = ``device``, ``cpu`` = faiss on the CPU).
    """
    run_dir = Path(run_dir)
    check_run_dir(run_dir)
    command_search_device(device, search_device)  # a bad --device / --search-device fails before any work
    _check_counts({"--queries": n_queries, "--top-k": top_k, "--max-pairs": max_pairs, "--batch-size": batch_size})
    out = Path(out_dir) if out_dir is not None else run_dir / "report"
    if embeddings is None and (run_dir / "embeddings.npz").is_file():
        embeddings = run_dir / "embeddings.npz"

    # every input is read and checked before the report folder is made: an unreadable config,
    # metrics.json or log, or bad embeddings, is an error that leaves nothing written
    cfg_raw, cfg_path = _read_config(run_dir)
    summary = rundir.read_metrics(run_dir)
    log_path = run_dir / LOG_NAME
    log = dg.read_training_log(log_path) if log_path.is_file() else None
    data, source, cfg_from_ckpt, why_none = _embeddings(run_dir, embeddings, checkpoint, split=split, device=device,
                                                        batch_size=batch_size, embed_train=embed_train)
    out.mkdir(parents=True, exist_ok=True)
    report = Report(out, pg.HtmlPage(f"Run report: {run_dir.name}",
                                     str(cfg_raw.get("description") or "") if cfg_raw else ""),
                    md=[f"# Run report: `{run_dir.name}`", ""])
    cfg_obj, cfg_note = _config_object(cfg_raw)
    eval_cfg = (cfg_raw or {}).get("eval")
    eval_split = str(eval_cfg.get("split", "test")) if isinstance(eval_cfg, dict) else "test"
    baselines = summary_section(report, cfg_raw, cfg_path, summary, eval_split)
    baselines += training_section(report, log_path, run_dir.name, eval_split, log=log)
    if data is not None:
        where = command_search_device(device, search_device, nbytes=4 * int(np.asarray(data["embeddings"]).size))
        embedding_sections(
            report, data, source, max_pairs=max_pairs, seed=seed, ks=ks, cfg=cfg_obj or cfg_from_ckpt,
            search_device=where, baselines=[b for b in baselines if b.get("split") in (None, "test", split or "test")],
            cfg_note=cfg_note, split=split, images=images, n_queries=n_queries, top_k=top_k)
    else:
        report.html.add("embeddings", "Embeddings", f'<p class="note">{pg.esc(why_none)}</p>', "embeddings")
        report.md += [f"- {why_none}", ""]
    full_config_section(report, cfg_raw, cfg_path)
    return report.write()


def _check_counts(counts: dict) -> None:
    """Each count (by its flag) is a whole number >= 1 (checked before any figure is drawn)."""
    for flag, value in counts.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{flag} must be a whole number >= 1, got {value!r}")


def _embeddings(run_dir: Path, embeddings, checkpoint, *, split, device, batch_size, embed_train):
    """``(data, source, config, why_none)``: the embeddings the report shows (the ``.npz``
    ``embeddings``, else the run's ``checkpoint`` on ``split``), where they came from, the
    config the checkpoint holds (None unless it was used), and why there are none (data None).
    A failing default checkpoint on the default split is a warning, so that the log and metrics
    are still reported; with a checkpoint or a split asked for, it is the error."""
    why_none = "no embeddings: pass --embeddings EMB.npz, or keep best.pt / last.pt in the run directory"
    if embeddings is not None:
        return load_embeddings_npz(embeddings), f"`{Path(embeddings).name}`", None, why_none
    if checkpoint is False:
        return None, None, None, why_none
    explicit = checkpoint not in (None, True)
    ckpt = Path(checkpoint) if explicit else find_checkpoint(run_dir)
    if explicit and not ckpt.is_file():
        raise FileNotFoundError(f"checkpoint not found: {ckpt}")
    if ckpt is None:
        return None, None, None, why_none
    try:
        data, cfg_from_ckpt = embed_run(ckpt, split=split, device=device, batch_size=batch_size,
                                        embed_train=embed_train)
        check_embedding_arrays(data, f"the {split or 'test'} embeddings of {ckpt}")  # e.g. NaN: a diverged run
    except Exception as exc:  # noqa: BLE001 - reported on the page and as a warning
        if explicit or split is not None:  # the user asked for these embeddings (--checkpoint, --split)
            raise
        # e.g. the dataset is not on this machine: still report the log and metrics
        why_none = (f"no embeddings: embedding with {ckpt.name} failed "
                    f"({type(exc).__name__}: {str(exc)[:300]}); pass "
                    f"--embeddings EMB.npz, or --no-embed")
        warnings.warn(why_none)
        return None, None, None, why_none
    return data, f"`{ckpt.name}` on the {split or 'test'} split", cfg_from_ckpt, why_none


def _config_object(raw: dict | None):
    """The run's :class:`~deepmetric.run.config.Config` (to rebuild its data), or None
    with a note when the file does not describe a current config."""
    if raw is None:
        return None, "no config.yaml"
    try:
        from deepmetric.run.config_io import config_from_dict

        return config_from_dict(copy.deepcopy(raw)), ""
    except Exception as exc:  # noqa: BLE001 - only the images depend on it
        return None, f"config.yaml could not be read as a training config ({exc})"
