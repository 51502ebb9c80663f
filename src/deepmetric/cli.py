"""The ``deepmetric`` command line: thin parsing that calls the library.

Each sub-command is registered by a small ``_add_<name>_parser(sub)`` function that adds its
arguments and ``set_defaults(func=...)``; ``main`` only dispatches. User errors (bad files,
bad values) raised as ValueError / FileNotFoundError / TypeError / KeyError / OSError are
printed as one clear line on stderr with exit code 2, without a traceback (an error raised in
a data-loader worker is unwrapped to the worker's own message); set the environment variable
``DEEPMETRIC_DEBUG=1`` to get the full traceback instead.  Every sub-command's ``--help``
ends with runnable examples.
"""
from __future__ import annotations

import argparse
import os
import sys
import textwrap


def _wrap(text: str) -> str:
    """A description filled to 79 columns (the raw formatter keeps the examples' lines as written)."""
    return textwrap.fill(" ".join(text.split()), 79)


# --------------------------------------------------------------------------- evaluate
def _add_evaluate_parser(sub) -> None:
    p = sub.add_parser(
        "evaluate",
        help="retrieval / clustering metrics of saved embeddings (.npz)",
        description=_wrap(
            "Evaluate embeddings stored in an .npz file with arrays 'embeddings' (N x d float), "
            "'labels' (N integers) and optionally boolean 'is_query' / 'is_gallery' (In-shop "
            "style). Without them every sample is a query against all the others. Write such a "
            "file with 'deepmetric embed' or numpy.savez(path, embeddings=E, labels=y)."
        ),
        epilog=(
            "examples:\n"
            "  deepmetric embed runs/demo/best.pt --split test --out emb.npz\n"
            "  deepmetric evaluate emb.npz\n"
            "  deepmetric evaluate emb.npz --k 1 10 100 --metrics recall map@r --out metrics.json\n"
            "  deepmetric evaluate emb.npz --backend faiss-hnsw   # approximate, for millions of images"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("npz", help="the .npz file with 'embeddings' and 'labels'")
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
        description=_wrap(
            "Write PNG figures (training curves from log.jsonl; with --embeddings also "
            "Recall@K, cosine-similarity histograms, a 2-d embedding scatter, and Fig. 1 / "
            "two-head diagnostics when the .npz holds the needed arrays) and report.md into "
            "RUN_DIR/report/. See docs/report.md for the .npz keys."
        ),
        epilog=(
            "examples:\n"
            "  deepmetric demo --quick --out runs/quick\n"
            "  deepmetric report runs/quick\n"
            "  deepmetric embed runs/quick/last.pt --out runs/quick/embeddings.npz\n"
            "  deepmetric report runs/quick --embeddings runs/quick/embeddings.npz --out runs/quick/figs"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
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
    p = sub.add_parser(
        "train", help="train a model from a YAML config (see docs/training.md)",
        description=_wrap(
            "Train from CONFIG.yaml. KEY=VALUE overrides (values are YAML) change single keys of "
            "the config, e.g. optim.lr=0.001 train.epochs=5 'data.options={class_split: half}'. "
            "Without a config file the defaults apply and the overrides must give at least "
            "train.epochs (or train.iterations). The run prints a summary (data split, model, loss, "
            "device, output folder) and baselines (untrained network, raw pixels for images up to "
            "64x64), checks data, model and metric names before the first step, and writes "
            "config.yaml, log.jsonl, last.pt, best.pt (with a validation split, data.val_classes) and "
            "metrics.json to train.out_dir. "
            "Use torchrun for DDP. See docs/training.md and, for your own images, docs/data.md."
        ),
        epilog=(
            "examples:\n"
            "  deepmetric train recipes/demo_glyphs.yaml train.epochs=2\n"
            "  deepmetric train recipes/own_folder.yaml data.root=my_images train.out_dir=runs/mine\n"
            "  deepmetric train recipes/demo_glyphs.yaml --resume runs/demo/last.pt\n"
            "  torchrun --nproc_per_node 2 -m deepmetric.cli train recipes/demo_glyphs.yaml"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("config", nargs="?", default=None,
                   help="YAML config file (e.g. recipes/own_folder.yaml); may be left out when "
                        "KEY=VALUE overrides describe the whole run")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="config overrides, e.g. train.epochs=5 data.root=my_images (values are YAML)")
    p.add_argument("--resume", default=None, metavar="CHECKPOINT",
                   help="continue from this checkpoint (OUT_DIR/last.pt); exact on one process")
    p.add_argument("--overwrite", action="store_true",
                   help="start afresh in a non-empty train.out_dir, removing the previous run's config.yaml, "
                        "log.jsonl, last.pt, best.pt and metrics.json (without it a new run refuses such a directory)")
    p.set_defaults(func=_run_train)


def _run_train(args: argparse.Namespace) -> int:
    config, overrides = args.config, list(args.overrides)
    if config is not None and "=" in config and not os.path.isfile(config):
        overrides.insert(0, config)  # 'deepmetric train train.epochs=2 ...' without a file
        config = None
    if config is None and not overrides:
        print("deepmetric train: error: nothing to train: give a YAML config and/or KEY=VALUE overrides, e.g.\n"
              "  deepmetric train recipes/own_folder.yaml data.root=my_images\n"
              "  deepmetric train recipes/demo_glyphs.yaml train.epochs=2\n"
              "Without a config file the defaults apply, and the overrides must give at least "
              "train.epochs=N (or train.iterations=N). See 'deepmetric train --help'.", file=sys.stderr)
        return 2
    from deepmetric.train.loop import NonFiniteLossError, train_from_config_file

    try:
        result = train_from_config_file(config, overrides, resume=args.resume, overwrite=args.overwrite)
    except NonFiniteLossError as exc:
        print(f"deepmetric train: error: {exc}", file=sys.stderr)
        return 3
    return 130 if result.interrupted else 0


def _add_embed_parser(sub) -> None:
    p = sub.add_parser(
        "embed", help="embed a dataset split with a trained checkpoint into an .npz",
        description=_wrap("Rebuild the model stored in a training checkpoint, embed one split of a dataset "
                     "(by default the checkpoint's own data and test transform) and write an .npz "
                     "that 'deepmetric evaluate' and 'deepmetric report' read."),
        epilog=(
            "examples:\n"
            "  deepmetric embed runs/demo/best.pt --split test --out emb.npz\n"
            "  deepmetric embed runs/mine/best.pt --data folder --root new_images --split all --out new.npz\n"
            "  deepmetric embed runs/inshop/best.pt --split query+gallery --out inshop.npz"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("checkpoint", help="checkpoint written by 'deepmetric train' (last.pt / best.pt)")
    p.add_argument("--data", default=None, help="dataset name (default: the checkpoint's training data)")
    p.add_argument("--root", default=None, help="dataset root directory (default: the checkpoint's data.root)")
    p.add_argument("--split", default="test", help="split to embed (default test; 'all' for a folder without "
                   "splits); query+gallery (In-shop: test) embeds both with is_query/is_gallery; "
                   "val: the validation classes of data.val_classes")
    p.add_argument("--out", required=True, help="output .npz (embeddings, labels[, is_query, is_gallery])")
    p.add_argument("--batch-size", type=int, default=256, help="images per forward pass (default 256)")
    p.add_argument("--device", default="auto", help="auto (CUDA when available), cpu or cuda[:i]")
    p.add_argument("--num-workers", type=int, default=0,
                   help="data-loader worker processes (default 0: load in the main process)")
    p.set_defaults(func=_run_embed)


def _run_embed(args: argparse.Namespace) -> int:
    from deepmetric.train.embed import embed_checkpoint

    out = embed_checkpoint(args.checkpoint, args.out, data=args.data, root=args.root, split=args.split,
                           batch_size=args.batch_size, device=args.device, num_workers=args.num_workers)
    print(f"wrote {out}")
    return 0


def _add_demo_parser(sub) -> None:
    p = sub.add_parser(
        "demo", help="offline demo: heated-up BN embedding on the glyph benchmark (CPU, <10 min)",
        description=_wrap("Train recipes/demo_glyphs.yaml (heated softmax with a BN embedding on the offline "
                     "glyph benchmark), evaluate on unseen characters and write a metrics table and "
                     "figures. Needs no download; see docs/training.md#the-offline-demo."),
        epilog=(
            "examples:\n"
            "  deepmetric demo\n"
            "  deepmetric demo --quick --out runs/quick\n"
            "  deepmetric demo train.epochs=2 train.num_threads=1"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", default="runs/demo", help="output directory (default runs/demo)")
    p.add_argument("--quick", action="store_true", help="a tiny run (seconds) for smoke tests")
    p.add_argument("--overwrite", action="store_true", help="replace the run files of an earlier demo in --out")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="overrides of the demo config, e.g. train.epochs=2 (values are YAML)")
    p.set_defaults(func=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    from deepmetric.train.demo import run_demo

    run_demo(args.out, quick=args.quick, overrides=args.overrides, overwrite=args.overwrite)
    return 0


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
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, TypeError, KeyError, OSError, RuntimeError) as exc:
        from deepmetric.data.loader import worker_error_message

        in_worker = worker_error_message(exc)
        if os.environ.get("DEEPMETRIC_DEBUG") or (isinstance(exc, RuntimeError) and in_worker is None):
            raise
        msg = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        msg = in_worker if in_worker is not None else msg
        print(f"deepmetric {args.command}: error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
