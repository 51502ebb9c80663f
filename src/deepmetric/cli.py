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
        help="one HTML page (report.html), figures and a Markdown report of a run (RUN_DIR/report/)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Write RUN_DIR/report/report.html - one self-contained page with the configuration,\n"
            "metric tables (validation / test marked, baselines), training curves, Recall@K,\n"
            "cosine-similarity histograms, a 2-d embedding, retrieval grids (random and worst\n"
            "queries with their top-8 neighbours, right / wrong marked), per-class recall and,\n"
            "for classifiers, misclassified test images beside their nearest training image -\n"
            "plus the PNG figures and report.md. Embeddings come from --embeddings, else\n"
            "RUN_DIR/embeddings.npz, else the run's best.pt (or last.pt) on the test split.\n"
            "See docs/report.md.\n\n"
            "example:\n"
            "  deepmetric demo --out runs/demo && deepmetric report runs/demo\n"
            "  xdg-open runs/demo/report/report.html"
        ),
    )
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
    p.add_argument("--device", default="auto", help="device for embedding: auto, cpu or cuda[:i]")
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
    p.set_defaults(func=_run_report)


def _run_report(args: argparse.Namespace) -> int:
    from deepmetric.report import make_report

    path = make_report(args.run_dir, args.embeddings, out_dir=args.out, max_pairs=args.max_pairs,
                       seed=args.seed, checkpoint=False if args.no_embed else args.checkpoint,
                       split=args.split, device=args.device, batch_size=args.batch_size,
                       embed_train=False if args.skip_train else None, images=not args.no_images,
                       n_queries=args.queries, top_k=args.top_k)
    print(f"report written to {path.with_name('report.html')} (and {path.name}, figures in {path.parent})")
    return 0


# --------------------------------------------------------------------------- train / embed / demo
def _add_train_parser(sub) -> None:
    p = sub.add_parser("train", help="train a model from a YAML config (see docs/training.md)",
                       description="Train from CONFIG.yaml; KEY=VALUE overrides (YAML values) change "
                                   "single keys, e.g. optim.lr=0.001 train.epochs=5. Use torchrun for DDP.")
    p.add_argument("config", help="YAML config file (e.g. recipes/demo_glyphs.yaml)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides")
    p.add_argument("--resume", default=None, metavar="CHECKPOINT", help="continue from this checkpoint (last.pt)")
    p.add_argument("--overwrite", action="store_true",
                   help="start afresh in a non-empty train.out_dir, removing the previous run's config.yaml, "
                        "log.jsonl, last.pt, best.pt and metrics.json (without it a new run refuses such a directory)")
    p.set_defaults(func=_run_train)


def _run_train(args: argparse.Namespace) -> int:
    from deepmetric.train.loop import NonFiniteLossError, train_from_config_file

    try:
        result = train_from_config_file(args.config, args.overrides, resume=args.resume,
                                        overwrite=args.overwrite)
    except NonFiniteLossError as exc:
        print(f"deepmetric train: error: {exc}", file=sys.stderr)
        return 3
    return 130 if result.interrupted else 0


def _add_embed_parser(sub) -> None:
    p = sub.add_parser("embed", help="embed a dataset split with a trained checkpoint into an .npz")
    p.add_argument("checkpoint", help="checkpoint written by 'deepmetric train' (last.pt / best.pt)")
    p.add_argument("--data", default=None, help="dataset name (default: the checkpoint's training data)")
    p.add_argument("--root", default=None, help="dataset root directory")
    p.add_argument("--split", default="test", help="split to embed (default test); query+gallery (In-shop: test) embeds both with is_query/is_gallery; val: the validation classes of data.val_classes")
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
    p = sub.add_parser(
        "demo",
        help="offline demo on real images: ImageNet EfficientNet-Lite0 fine-tuned on emoji (CPU, <10 min)",
        description=(
            "Fine-tune the ImageNet-pretrained EfficientNet-Lite0 with the heated-up BN softmax "
            "(alpha 16, then alpha 4 and lr / 10) on the training half of the emoji benchmark and "
            "measure zero-shot retrieval on the unseen half: raw pixels, ImageNet features, the "
            "network before training, and the trained embedding before / after heating-up; then "
            "draw a retrieval grid. --data glyphs runs the glyph demo (a compact ResNet from scratch)."),
        epilog="example:\n  deepmetric demo\n  deepmetric demo --data glyphs --out runs/demo_glyphs\n"
               "  deepmetric demo --quick --out /tmp/demo train.progress=false",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--data", default="emoji", choices=["emoji", "glyphs"],
                   help="emoji (default: real artwork, ImageNet backbone) or glyphs (rendered characters, from scratch)")
    p.add_argument("--out", default=None, help="output directory (default runs/demo; runs/demo_glyphs for --data glyphs)")
    p.add_argument("--quick", action="store_true", help="a tiny run (seconds) for smoke tests")
    p.add_argument("--keep", action="store_true",
                   help="refuse a non-empty --out instead of replacing an earlier demo's run files there")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. train.epochs=2")
    p.set_defaults(func=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    from deepmetric.train.demo import run_demo

    run_demo(args.out, data=args.data, quick=args.quick, overrides=args.overrides, overwrite=not args.keep)
    return 0


# --------------------------------------------------------------------------- emoji
_EMOJI_VENDORS = "apple,google,twitter,facebook,emojione,openmoji"  # deepmetric.data.emoji.VENDORS


def _add_emoji_parser(sub) -> None:
    p = sub.add_parser(
        "emoji", help="emoji benchmark: install its npm packages, print its counts or its raw-pixel baseline",
        description="The cross-vendor emoji benchmark (docs/offline-data.md#emoji).",
        epilog="example: deepmetric emoji install && deepmetric emoji counts && "
               "deepmetric emoji pixels --vendors apple,google,twitter,facebook",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    esub = p.add_subparsers(dest="emoji_command", required=True)
    pi = esub.add_parser("install", help="npm pack the pinned packages, check their sha512, extract only the "
                                         "files used (skips packages already extracted)",
                         epilog="example: deepmetric emoji install --packages openmoji")
    pi.add_argument("--packages", nargs="+", default=None, metavar="NAME",
                    help="subset of packages (default all six: emoji-datasource-{apple,google,twitter,facebook}, "
                         "emojione-assets, openmoji)")
    pi.add_argument("--from", dest="tarball_dir", default=None, metavar="DIR",
                    help="folder holding <name>-<version>.tgz tarballs to use instead of npm pack")
    pi.add_argument("--npm", default="npm", help="npm executable (default npm)")
    pi.add_argument("--force", action="store_true", help="extract again even when already extracted")
    pc = esub.add_parser("counts", help="build (or load) the arrays and print the counts of each split as JSON",
                         epilog="example: deepmetric emoji counts --vendors apple,google,twitter,facebook")
    pp = esub.add_parser("pixels", help="raw-pixel baseline (cosine on RGB pixels): Recall@K and MAP@R, "
                                        "all-vs-all and cross-vendor",
                         epilog="example: deepmetric emoji pixels --split test --size 64")
    pp.add_argument("--split", default="test", choices=("train", "test", "all"), help="split (default test)")
    for q in (pi, pc, pp):
        q.add_argument("--root", default=None,
                       help="deepmetric cache root (default $DEEPMETRIC_CACHE or ~/.cache/deepmetric)")
    for q in (pc, pp):
        q.add_argument("--size", type=int, default=64, help="image side in pixels, 32-128 (default 64)")
        q.add_argument("--vendors", default=None, help=f"comma-separated vendors (default all: {_EMOJI_VENDORS})")
    p.set_defaults(func=_run_emoji)


def _run_emoji(args: argparse.Namespace) -> int:
    import json

    from deepmetric.data import emoji

    if args.emoji_command == "install":
        emoji.install_emoji_packages(args.root, packages=args.packages, tarball_dir=args.tarball_dir,
                                     npm=args.npm, force=args.force)
    elif args.emoji_command == "counts":
        print(json.dumps(emoji.emoji_counts(args.root, size=args.size, vendors=args.vendors, verbose=True), indent=1))
    else:
        res = emoji.pixel_baseline(args.split, args.root, size=args.size, vendors=args.vendors)
        pct = lambda d: {k: round(100 * v, 1) if isinstance(v, float) else v for k, v in d.items()}  # noqa: E731
        print(f"{args.split}: {res['classes']} classes, {res['images']} images, vendors {','.join(res['vendors'])}, "
              f"{args.size} px, cosine on raw pixels")
        print("all-vs-all:", pct(res["all_vs_all"]))
        for name, r in res["cross_vendor"].items():
            print(f"cross-vendor {name}:", pct(r))
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
    _add_emoji_parser(sub)
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
