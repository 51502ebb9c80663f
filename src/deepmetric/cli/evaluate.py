"""``deepmetric evaluate`` (metrics of saved embeddings) and ``deepmetric report`` (a run's HTML page)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from deepmetric.cli.common import (add_command, add_model_device_arguments, check_output_file, positive_finite,
                                   refuse_output_over_inputs)


# --------------------------------------------------------------------------- evaluate
def add_evaluate_parser(sub) -> None:
    p = add_command(sub, _run_evaluate, "evaluate")
    p.add_argument("npz", help="the .npz file with 'embeddings' and 'labels'")
    p.add_argument("--k", dest="ks", type=int, nargs="+", default=[1, 2, 4, 8],
                   help="K values for Recall@K (default: 1 2 4 8)")
    p.add_argument("--metrics", nargs="+", default=None,
                   help="any of: recall map@r r_precision mrr map@k recall_class_avg map@r_class_avg nmi f1 ami "
                        "(default: recall map@r r_precision nmi f1)")
    p.add_argument("--postprocess", nargs="+", default=None, metavar="STEP",
                   help="post-processing before the search, in the order whiten, dba, aqe, kreciprocal, e.g. "
                        "whiten:dim=256,fit=gallery dba:k=3,alpha=3 aqe:k=2,alpha=3 kreciprocal:k1=20,k2=6,lambda=0.3 "
                        "(docs/search.md, Post-processing)")
    p.add_argument("--fit-embeddings", default=None, metavar="TRAIN.npz",
                   help="embeddings that whiten:fit=train fits on (e.g. 'deepmetric embed ... --split train')")
    p.add_argument("--out", default=None, help="write the metrics as JSON to this path")
    p.add_argument("--backend", default="auto",
                   choices=["auto", "torch", "faiss", "faiss-hnsw", "faiss-ivf"],
                   help="nearest-neighbour backend (auto: torch on a GPU, faiss on the CPU); the faiss ones run "
                        "on the CPU; faiss-hnsw / faiss-ivf are APPROXIMATE")
    p.add_argument("--device", default="auto",
                   help="where the search runs: auto (the GPU when CUDA is available, the embeddings fit in its "
                        "free memory and --backend allows it; else the CPU), cpu, cuda or cuda:INDEX")
    p.add_argument("--chunk-size", type=int, default=None,
                   help="queries per search chunk (default: derived from --memory-mb)")
    p.add_argument("--memory-mb", type=positive_finite, default=None,
                   help="memory budget for one search chunk in MiB (default 256)")
    p.add_argument("--seed", type=int, default=0, help="k-means seed for NMI / F1")
    p.add_argument("--nmi-average", default="arithmetic", choices=["arithmetic", "geometric"],
                   help="NMI normalisation (default arithmetic, as scikit-learn)")
    p.add_argument("--kmeans-restarts", type=int, default=1,
                   help="k-means initialisations for NMI / F1, the lowest-inertia one kept (default 1)")


#: from this many rows on, ``deepmetric evaluate`` shows its progress on stderr (a 2 M-row
#: file takes minutes on a CPU)
PROGRESS_ROWS = 100_000


def _check_evaluate_flags(args: argparse.Namespace, steps: list[dict]) -> None:
    """The flags' values, before any file is read: an error names the flag, not the .npz."""
    from deepmetric.evaluate import check_metric_names

    for k in args.ks:
        if k < 1:
            raise ValueError(f"--k {k}: every K must be a whole number >= 1")
    try:
        check_metric_names(args.metrics)
    except ValueError as exc:
        raise ValueError(f"--metrics: {exc}") from None
    for flag, value, low in (("--chunk-size", args.chunk_size, 1), ("--kmeans-restarts", args.kmeans_restarts, 1),
                             ("--seed", args.seed, 0)):
        if value is not None and value < low:
            raise ValueError(f"{flag} {value}: expected a whole number >= {low}")
    fit_train = any(s["name"] == "whiten" and s["fit"] == "train" for s in steps)
    if getattr(args, "fit_embeddings", None) and not fit_train:  # it would be ignored without a word
        raise ValueError(f"--fit-embeddings {args.fit_embeddings}: only the step whiten:fit=train reads it; add "
                         "--postprocess whiten:fit=train (with dim=...), or leave the flag out")


def _load_fit_set(path: str, emb):
    """The whitening fit set of ``--fit-embeddings`` (its labels are not needed), checked here so
    that an error names that file, not the evaluated one."""
    from deepmetric.evaluate import check_embeddings
    from deepmetric.evaluate.io import load_npz

    fit = load_npz(path, require_labels=False)["embeddings"]
    try:
        check_embeddings(fit, "'embeddings'")
    except (ValueError, TypeError) as exc:
        raise type(exc)(f"{path}: {exc}") from None
    if fit.shape[1] != emb.shape[1]:
        raise ValueError(f"{path}: 'embeddings' have {fit.shape[1]} columns but the evaluated embeddings have "
                         f"{emb.shape[1]}; --fit-embeddings must come from the same model")
    return fit


def _run_evaluate(args: argparse.Namespace) -> int:
    from deepmetric.evaluate.postprocess import parse_steps
    from deepmetric.run.rundir import folders_removed_on_failure

    steps = parse_steps(getattr(args, "postprocess", None))  # a bad step is refused before any work
    _check_evaluate_flags(args, steps)
    if args.out:
        refuse_output_over_inputs("--out", args.out, inputs=(args.npz, getattr(args, "fit_embeddings", None)))
    # check_output_file makes --out's folder before the work: a failed evaluation removes it again
    with folders_removed_on_failure(Path(args.out).parent if args.out else None):
        if args.out:
            check_output_file("--out", args.out, "metrics.json")
        return _evaluate_file(args, steps)


def _evaluate_file(args: argparse.Namespace, steps: list[dict]) -> int:
    import warnings

    import numpy as np
    import torch

    from deepmetric.evaluate.engine import evaluate
    from deepmetric.evaluate.io import evaluate_cli_search_device, format_table, load_npz

    data = load_npz(args.npz)
    emb = data["embeddings"]
    fit_sets = None
    if getattr(args, "fit_embeddings", None):
        fit_sets = {"train": _load_fit_set(args.fit_embeddings, emb)}
    device = evaluate_cli_search_device(args, nbytes=4 * emb.size)
    if device.type != "cpu":  # float32 before the copy: half the bytes of a float64 file
        emb = torch.from_numpy(np.ascontiguousarray(emb, dtype=np.float32)).to(device)
        if fit_sets:
            fit_sets["train"] = torch.from_numpy(np.ascontiguousarray(fit_sets["train"], dtype=np.float32)).to(device)
    progress = len(emb) >= PROGRESS_ROWS
    if progress:
        print(f"evaluating {len(emb):,} embeddings of {args.npz} on {device} (a k-NN bar follows; the "
              "clustering metrics, NMI and F1, come after it)", file=sys.stderr, flush=True)
    try:
        # the library's warnings (queries without a positive) as one line each, not Python's
        # two-line "file:line: UserWarning" with a source line
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", UserWarning)
            res = evaluate(emb, data["labels"], is_query=data["is_query"],
                           is_gallery=data["is_gallery"], ks=args.ks, metrics=args.metrics,
                           seed=args.seed, chunk_size=args.chunk_size, backend=args.backend,
                           memory_mb=args.memory_mb, nmi_average=args.nmi_average,
                           kmeans_restarts=args.kmeans_restarts, progress=progress, postprocess=steps,
                           fit_sets=fit_sets)
    except (ValueError, TypeError) as exc:
        raise type(exc)(f"{args.npz}: {exc}") from None
    for w in caught:
        print(f"deepmetric evaluate: note: {args.npz}: {w.message}", file=sys.stderr)
    print(format_table(res))
    if args.out:
        from deepmetric.run.rundir import write_text_atomic

        out = Path(args.out)  # its folder was made by check_output_file, before the work
        write_text_atomic(out, json.dumps({k: (int(v) if isinstance(v, (int, np.integer)) else float(v))
                                           for k, v in res.items()}, indent=2) + "\n")
        print(f"wrote {out}")
    return 0


def add_report_parser(sub) -> None:
    p = add_command(sub, _run_report, "report")
    p.add_argument("run_dir", help="the run directory 'deepmetric train' wrote (log.jsonl, config.yaml, "
                                   "metrics.json, best.pt / last.pt)")
    p.add_argument("--embeddings", default=None,
                   help="embeddings .npz (default: RUN_DIR/embeddings.npz if present, else computed "
                        "with the checkpoint)")
    p.add_argument("--checkpoint", default=None,
                   help="checkpoint to embed with (default: RUN_DIR/best.pt, else RUN_DIR/last.pt)")
    p.add_argument("--no-embed", action="store_true",
                   help="never compute embeddings from a checkpoint (log and metrics only)")
    p.add_argument("--split", default=None,
                   help="split to embed and show (default: test; In-shop style runs: query+gallery)")
    p.add_argument("--skip-train", action="store_true",
                   help="do not embed the training split (it is embedded by default when the model "
                        "has a classifier: two-head Fig. 10, heated-up Fig. 1, train histogram)")
    add_model_device_arguments(p, "the neighbour searches")
    p.add_argument("--batch-size", type=int, default=256, help="batch size for embedding (default 256)")
    p.add_argument("--no-images", action="store_true",
                   help="do not rebuild the dataset for images (grids show labels only)")
    p.add_argument("--queries", type=int, default=8,
                   help="random queries and worst queries shown in the retrieval grids (default 8 each)")
    p.add_argument("--top-k", type=int, default=8, help="neighbours shown per query (default 8)")
    p.add_argument("--out", default=None, help="output folder (default: RUN_DIR/report)")
    p.add_argument("--max-pairs", type=int, default=1_000_000,
                   help="pairs per cosine histogram before sampling (default 1000000)")
    p.add_argument("--seed", type=int, default=0, help="seed for pair sampling, random queries, subsampling")


def _run_report(args: argparse.Namespace) -> int:
    import warnings

    from deepmetric.report import make_report

    # the report's warnings (a truncated last log line, queries without a positive, a checkpoint
    # that could not embed) as one line each, not Python's "file:line: UserWarning" and source line
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UserWarning)
        try:
            path = make_report(args.run_dir, args.embeddings, out_dir=args.out, max_pairs=args.max_pairs,
                               seed=args.seed, checkpoint=False if args.no_embed else args.checkpoint,
                               split=args.split, device=args.device, batch_size=args.batch_size,
                               embed_train=False if args.skip_train else None, images=not args.no_images,
                               n_queries=args.queries, top_k=args.top_k, search_device=args.search_device)
        finally:
            for w in caught:
                print(f"deepmetric report: note: {w.message}", file=sys.stderr)
    print(f"report written to {path.with_name('report.html')} (and {path.name}, figures in {path.parent})")
    from deepmetric.train.tracking import log_report, read_tracking

    if "mlflow" in read_tracking(args.run_dir):  # the run went to MLflow (train.loggers): the report joins it
        try:
            run_id = log_report(args.run_dir, path.parent)
            print(f"report stored in MLflow run {run_id} (artifacts report/)")
        except ImportError as exc:
            print(f"note: the report was not stored in the run's MLflow run: {exc}")
    return 0

