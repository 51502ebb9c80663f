"""The ``deepmetric`` command line: thin parsing that calls the library.

Each sub-command is registered by a small ``_add_<name>_parser(sub)`` function that adds its
arguments and ``set_defaults(func=...)``; ``main`` only dispatches. User errors (bad files,
bad values) raised as ValueError / FileNotFoundError / TypeError / KeyError / OSError are
printed as one clear line on stderr with exit code 2, without a traceback; set the
environment variable ``DEEPMETRIC_DEBUG=1`` to get the full traceback instead.
"""
from __future__ import annotations

import argparse
import os
import sys


# --------------------------------------------------------------------------- evaluate
def _add_evaluate_parser(sub) -> None:
    p = sub.add_parser(
        "evaluate",
        help="retrieval / clustering metrics of saved embeddings (.npz)",
        description=(
            "Evaluate embeddings stored in an .npz file with arrays 'embeddings' (N x d float), "
            "'labels' (N integers) and optionally boolean 'is_query' / 'is_gallery' (In-shop "
            "style). Without them every sample is a query against all the others."
        ),
    )
    p.add_argument("npz", help="path to the .npz file")
    p.add_argument("--k", dest="ks", type=int, nargs="+", default=[1, 2, 4, 8],
                   help="K values for Recall@K (default: 1 2 4 8)")
    p.add_argument("--metrics", nargs="+", default=None,
                   help="subset of: recall map@r r_precision nmi f1 (default: all)")
    p.add_argument("--out", default=None, help="write the metrics as JSON to this path")
    p.add_argument("--backend", default="auto",
                   choices=["auto", "torch", "faiss", "faiss-hnsw", "faiss-ivf"],
                   help="nearest-neighbour backend; faiss-hnsw / faiss-ivf are APPROXIMATE")
    p.add_argument("--chunk-size", type=int, default=None,
                   help="queries per search chunk (default: derived from --memory-mb)")
    p.add_argument("--memory-mb", type=float, default=None,
                   help="memory budget for one search chunk in MiB (default 256)")
    p.add_argument("--seed", type=int, default=0, help="k-means seed for NMI / F1")
    p.add_argument("--nmi-average", default="arithmetic", choices=["arithmetic", "geometric"],
                   help="NMI normalisation (default arithmetic, as scikit-learn)")
    p.set_defaults(func=_run_evaluate)


def _run_evaluate(args: argparse.Namespace) -> int:
    from deepmetric.evaluate.io import run_evaluate_cli

    return run_evaluate_cli(args)


# --------------------------------------------------------------------------- report
def _add_report_parser(sub) -> None:
    p = sub.add_parser(
        "report",
        help="figures and a Markdown report of a run (RUN_DIR/report/)",
        description=(
            "Write PNG figures (training curves from log.jsonl; with --embeddings also "
            "Recall@K, cosine-similarity histograms, a 2-d embedding scatter, and Fig. 1 / "
            "two-head diagnostics when the .npz holds the needed arrays) and report.md into "
            "RUN_DIR/report/. See docs/report.md for the .npz keys."
        ),
    )
    p.add_argument("run_dir", help="the run directory (holds log.jsonl and config.yaml)")
    p.add_argument("--embeddings", default=None,
                   help="embeddings .npz (default: RUN_DIR/embeddings.npz if present)")
    p.add_argument("--out", default=None, help="output folder (default: RUN_DIR/report)")
    p.add_argument("--max-pairs", type=int, default=1_000_000,
                   help="pairs per cosine histogram before sampling (default 1000000)")
    p.add_argument("--seed", type=int, default=0, help="seed for pair sampling / subsampling")
    p.set_defaults(func=_run_report)


def _run_report(args: argparse.Namespace) -> int:
    from deepmetric.report import make_report

    path = make_report(args.run_dir, args.embeddings, out_dir=args.out,
                       max_pairs=args.max_pairs, seed=args.seed)
    print(f"report written to {path}")
    return 0


# --------------------------------------------------------------------------- train / embed / demo
def _add_train_parser(sub) -> None:
    p = sub.add_parser("train", help="train a model from a YAML config (see docs/training.md)",
                       description="Train from CONFIG.yaml; KEY=VALUE overrides (YAML values) change "
                                   "single keys, e.g. optim.lr=0.001 train.epochs=5. Use torchrun for DDP.")
    p.add_argument("config", help="YAML config file (e.g. recipes/demo_glyphs.yaml)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides")
    p.add_argument("--resume", default=None, metavar="CHECKPOINT", help="continue from this checkpoint (last.pt)")
    p.set_defaults(func=_run_train)


def _run_train(args: argparse.Namespace) -> int:
    from deepmetric.train.loop import NonFiniteLossError, train_from_config_file

    try:
        result = train_from_config_file(args.config, args.overrides, resume=args.resume)
    except NonFiniteLossError as exc:
        print(f"deepmetric train: error: {exc}", file=sys.stderr)
        return 3
    return 130 if result.interrupted else 0


def _add_embed_parser(sub) -> None:
    p = sub.add_parser("embed", help="embed a dataset split with a trained checkpoint into an .npz")
    p.add_argument("checkpoint", help="checkpoint written by 'deepmetric train' (last.pt / best.pt)")
    p.add_argument("--data", default=None, help="dataset name (default: the checkpoint's training data)")
    p.add_argument("--root", default=None, help="dataset root directory")
    p.add_argument("--split", default="test", help="split to embed (default test); query+gallery (In-shop: test) embeds both with is_query/is_gallery")
    p.add_argument("--out", required=True, help="output .npz (embeddings, labels[, is_query, is_gallery])")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--device", default="auto", help="auto, cpu or cuda[:i]")
    p.add_argument("--num-workers", type=int, default=0)
    p.set_defaults(func=_run_embed)


def _run_embed(args: argparse.Namespace) -> int:
    from deepmetric.train.embed import embed_checkpoint

    out = embed_checkpoint(args.checkpoint, args.out, data=args.data, root=args.root, split=args.split,
                           batch_size=args.batch_size, device=args.device, num_workers=args.num_workers)
    print(f"wrote {out}")
    return 0


def _add_demo_parser(sub) -> None:
    p = sub.add_parser("demo", help="offline demo: heated-up BN embedding on the glyph benchmark (CPU, <10 min)")
    p.add_argument("--out", default="runs/demo", help="output directory (default runs/demo)")
    p.add_argument("--quick", action="store_true", help="a tiny run (seconds) for smoke tests")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides")
    p.set_defaults(func=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    from deepmetric.train.demo import run_demo

    run_demo(args.out, quick=args.quick, overrides=args.overrides)
    return 0


# --------------------------------------------------------------------------- study
def _add_study_parser(sub) -> None:
    p = sub.add_parser(
        "study", help="train variants x seeds (x benchmarks) of a config; mean, sd and 95%% CI tables",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Run every (benchmark, variant, seed) of STUDY.yaml in order, skipping finished runs "
            "(a killed study resumes; a killed run continues from its last.pt), and rewrite "
            "OUT/results.json, results.csv, summary.md (mean ± sd, Student-t CI, paired "
            "differences) and summary.png after every run. File format: docs/study.md."),
        epilog=(
            "example:\n"
            "  deepmetric study studies/fashion_mnist_two_head.yaml --workers 2\n"
            "  deepmetric study studies/fashion_mnist_two_head.yaml --summary   # tables only\n"
            "  nohup deepmetric study studies/emoji.yaml --commit > emoji.log 2>&1 &"),
    )
    p.add_argument("study", help="study file (YAML: base, overrides, variants, seeds, benchmarks, compare)")
    p.add_argument("--workers", type=int, default=None,
                   help="runs in parallel (default: the file's 'workers', else 1); each of N > 1 "
                        "runs is a subprocess with cores/N torch threads")
    p.add_argument("--out", default=None, help="study directory (default: the file's 'out_dir')")
    p.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", dest="overrides",
                   help="config overrides for every run, after the variants' (e.g. train.epochs=1 "
                        "with --out /tmp/smoke for a quick check of the whole study)")
    p.add_argument("--only", nargs="+", default=None, metavar="PREFIX",
                   help="train only runs whose key starts with PREFIX (e.g. HBN or HBN/seed0)")
    p.add_argument("--summary", action="store_true",
                   help="train nothing: rewrite the results files from the finished runs")
    p.add_argument("--list", action="store_true", help="list the runs and whether they are finished")
    p.add_argument("--progress", action="store_true", help="show the per-epoch progress bars of each run")
    p.add_argument("--commit", action="store_true",
                   help="git-commit the result files (only those) after every run")
    p.set_defaults(func=_run_study)


def _run_study(args: argparse.Namespace) -> int:
    from deepmetric.train.study import load_study, run_study, write_results

    study = load_study(args.study, out_dir=args.out, overrides=args.overrides)
    if args.workers is not None and args.workers < 1:
        raise ValueError(f"--workers: expected an int >= 1, got {args.workers}")
    if args.list:
        for run in study.runs:
            state = "finished" if run.finished else ("partial" if (run.out_dir / "last.pt").is_file() else "-")
            print(f"{run.key:40s} {state:9s} {run.out_dir}")
        return 0
    if args.summary:
        paths = write_results(study)
        print(f"wrote {', '.join(str(p) for p in paths.values())}")
        return 0
    result = run_study(study, workers=args.workers, progress=args.progress, commit=args.commit, only=args.only)
    print(f"summary: {result['paths']['md']}")
    if result["interrupted"]:
        return 130
    return 1 if result["failed"] else 0


# --------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    from deepmetric import __version__

    parser = argparse.ArgumentParser(prog="deepmetric", description="Deep metric learning toolkit.")
    parser.add_argument("--version", action="version", version=f"deepmetric {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_evaluate_parser(sub)
    _add_report_parser(sub)
    _add_train_parser(sub)
    _add_embed_parser(sub)
    _add_demo_parser(sub)
    _add_study_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, TypeError, KeyError, OSError) as exc:
        if os.environ.get("DEEPMETRIC_DEBUG"):
            raise
        msg = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"deepmetric {args.command}: error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
