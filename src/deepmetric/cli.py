"""The ``deepmetric`` command line: thin parsing that calls the library.

Each sub-command is registered by a small ``_add_<name>_parser(sub)`` function that adds its
arguments and ``set_defaults(func=...)``; ``main`` only dispatches. User errors (bad files,
bad values) raised as ValueError / FileNotFoundError / TypeError / KeyError / OSError are
printed as one clear line on stderr with exit code 2, without a traceback (an error raised in
a data-loader worker is unwrapped to the worker's own message); set the environment variable
``DEEPMETRIC_DEBUG=1`` to get the full traceback instead.  Every sub-command's ``--help``
ends with runnable examples.  The ``KEY=VALUE`` config overrides of the commands that take them
(train, demo, tune, study) may stand anywhere on the line (:func:`parse_command_line`).
"""
from __future__ import annotations

import argparse
import os
import re
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
            "file with 'deepmetric embed' or numpy.savez(path, embeddings=E, labels=y). The exact "
            "search runs on the GPU when one is present (--device auto; the torch backend, same "
            "metrics as faiss, bench/RESULTS.md section 8) and on the CPU with faiss otherwise or "
            "with --device cpu."
        ),
        epilog=(
            "examples:\n"
            "  deepmetric embed runs/demo/last.pt --split test --out emb.npz\n"
            "  deepmetric evaluate emb.npz\n"
            "  deepmetric evaluate emb.npz --k 1 10 100 --metrics recall map@r --out metrics.json\n"
            "  deepmetric evaluate emb.npz --device cpu        # faiss on the CPU even on a GPU machine\n"
            "  deepmetric evaluate emb.npz --device cuda:1     # the second GPU; an error without CUDA\n"
            "  deepmetric evaluate emb.npz --backend faiss-hnsw   # approximate, for millions of images\n"
            "  deepmetric evaluate emb.npz --postprocess whiten:dim=256,fit=gallery dba:k=3,alpha=3 aqe:k=2,alpha=3"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
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
    p.add_argument("--memory-mb", type=float, default=None,
                   help="memory budget for one search chunk in MiB (default 256)")
    p.add_argument("--seed", type=int, default=0, help="k-means seed for NMI / F1")
    p.add_argument("--nmi-average", default="arithmetic", choices=["arithmetic", "geometric"],
                   help="NMI normalisation (default arithmetic, as scikit-learn)")
    p.add_argument("--kmeans-restarts", type=int, default=1,
                   help="k-means initialisations for NMI / F1, the lowest-inertia one kept (default 1)")
    p.set_defaults(func=_run_evaluate)


def _run_evaluate(args: argparse.Namespace) -> int:
    from deepmetric.evaluate.io import run_evaluate_cli

    return run_evaluate_cli(args)


# --------------------------------------------------------------------------- report
def _add_model_device_arguments(p, searches: str) -> None:
    """--device and --search-device of a command that runs a model, then searches (report,
    index); run.evaluation.command_search_device decides from them."""
    p.add_argument("--device", default="auto",
                   help=f"where the model runs: auto (CUDA when available), cpu, cuda or cuda:INDEX; {searches} "
                        "runs there too unless --search-device cpu")
    p.add_argument("--search-device", default="auto", choices=["auto", "cpu"],
                   help=f"where {searches} runs: auto (the --device; on a GPU only when the embeddings fit in "
                        "its free memory) or cpu (faiss)")


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
            "--device says where the model embeds and, unless --search-device cpu, where the\n"
            "neighbours are searched (a GPU: the torch backend, same results as faiss).\n"
            "See docs/report.md."
        ),
        epilog=(
            "examples:\n"
            "  deepmetric demo --out runs/demo && deepmetric report runs/demo\n"
            "  xdg-open runs/demo/report/report.html\n"
            "  deepmetric demo --quick --out runs/quick\n"
            "  deepmetric report runs/quick\n"
            "  deepmetric embed runs/quick/last.pt --out runs/quick/embeddings.npz\n"
            "  deepmetric report runs/quick --embeddings runs/quick/embeddings.npz --out runs/quick/figs\n"
            "  deepmetric report runs/demo --device cuda --search-device cpu   # embed on the GPU, faiss search"
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
    _add_model_device_arguments(p, "the neighbour searches")
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
                       n_queries=args.queries, top_k=args.top_k, search_device=args.search_device)
    print(f"report written to {path.with_name('report.html')} (and {path.name}, figures in {path.parent})")
    from deepmetric.train.tracking import log_report, read_tracking

    if "mlflow" in read_tracking(args.run_dir):  # the run went to MLflow (train.loggers): the report joins it
        try:
            run_id = log_report(args.run_dir, path.parent)
            print(f"report stored in MLflow run {run_id} (artifacts report/)")
        except ImportError as exc:
            print(f"note: the report was not stored in the run's MLflow run: {exc}")
    return 0


# --------------------------------------------------------------------------- train / embed / demo
def _add_train_parser(sub) -> None:
    p = sub.add_parser(
        "train", help="train a model from a YAML config (see docs/training.md)",
        description=_wrap(
            "Train from CONFIG.yaml. KEY=VALUE overrides (values are YAML) change single keys of "
            "the config, e.g. optim.lr=0.001 train.epochs=5 'data.options={class_split: half}'; "
            "they may stand anywhere on the line, also after the options. "
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
                   help="continue from this checkpoint (OUT_DIR/last.pt); exact on one process. Another run's "
                        "checkpoint into a non-empty train.out_dir needs --overwrite")
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
                     "that 'deepmetric evaluate' and 'deepmetric report' read. 'embed' searches nothing: "
                     "--device is where the model runs (on CUDA the batches come from pinned memory); "
                     "'deepmetric evaluate EMB.npz' then searches on the GPU when one is present."),
        epilog=(
            "examples:\n"
            "  deepmetric embed runs/demo/last.pt --split test --out emb.npz\n"
            "  deepmetric embed runs/demo/last.pt --out emb.npz --device cpu   # the CPU even on a GPU machine\n"
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
                   "val: the validation classes of data.val_classes; a split that marks its own queries "
                   "(glyphs protocol=cross_family: test) stores its masks too")
    p.add_argument("--out", required=True, help="output .npz (embeddings, labels[, is_query, is_gallery, paths, class_names])")
    p.add_argument("--shard-size", type=int, default=None,
                   help="under torchrun: images per shard file (default 4096); a restarted rank skips finished "
                        "shards (docs/search.md, section 7)")
    p.add_argument("--batch-size", type=int, default=256, help="images per forward pass (default 256)")
    p.add_argument("--device", default="auto",
                   help="where the model runs: auto (CUDA when available), cpu, cuda or cuda:INDEX")
    p.add_argument("--num-workers", type=int, default=0,
                   help="data-loader worker processes (default 0: load in the main process)")
    p.set_defaults(func=_run_embed)


def _run_embed(args: argparse.Namespace) -> int:
    from deepmetric.run.device import resolve_device
    from deepmetric.run.embed import embed_checkpoint

    device = resolve_device(args.device, name="--device")  # errors name the flag
    out = embed_checkpoint(args.checkpoint, args.out, data=args.data, root=args.root, split=args.split,
                           batch_size=args.batch_size, device=str(device), num_workers=args.num_workers,
                           shard_size=args.shard_size)
    if out is not None:  # None: a torchrun rank other than 0 (rank 0 writes the file)
        print(f"wrote {out}")
    return 0


def _add_demo_parser(sub) -> None:
    p = sub.add_parser(
        "demo",
        help="offline demo on real images: ImageNet EfficientNet-Lite0 fine-tuned on emoji (CPU, about 6 minutes on 2 idle cores)",
        description=(
            "Fine-tune the ImageNet-pretrained EfficientNet-Lite0 on the training half of the emoji "
            "benchmark with the transfer recipe (recipes/demo_emoji.yaml: the pooled features are the "
            "embedding, the heated softmax trains a projection head on them, style augmentation, cosine "
            "lr) and measure zero-shot retrieval on the unseen half, all-vs-all and cross-vendor: raw "
            "pixels, ImageNet features and the trained embedding; then draw a retrieval grid. --data "
            "glyphs runs the glyph demo (a compact ResNet from scratch, heated-up BN softmax)."),
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
    from deepmetric.workflows.demo import run_demo

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
        from deepmetric.run.baselines import emoji_pixel_baseline

        res = emoji_pixel_baseline(args.split, args.root, size=args.size, vendors=args.vendors)
        pct = lambda d: {k: round(100 * v, 1) if isinstance(v, float) else v for k, v in d.items()}  # noqa: E731
        print(f"{args.split}: {res['classes']} classes, {res['images']} images, vendors {','.join(res['vendors'])}, "
              f"{args.size} px, cosine on raw pixels")
        print("all-vs-all:", pct(res["all_vs_all"]))
        for name, r in res["cross_vendor"].items():
            print(f"cross-vendor {name}:", pct(r))
    return 0


# --------------------------------------------------------------------------- index / search / export / serve
def _add_index_parser(sub) -> None:
    p = sub.add_parser(
        "index", help="embed images with a checkpoint into a search index folder",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Embed a dataset split with CHECKPOINT (its test transform) and write INDEX_DIR: embeddings.npy "
            "(ivfpq: vectors.f16.npy), metadata.arrow and class_names.arrow (paths, labels, class names), "
            "index.faiss and manifest.json (checkpoint path, SHA-256 "
            "and config; every file's size and SHA-256). Exact inner-product search by default. The folder "
            "is written beside the target and swapped in atomically: a failure leaves an existing index "
            "untouched. --device is where the model embeds and, unless --search-device cpu, where the exact "
            "search behind --approximate's recall measurement runs (a GPU: the torch backend, same "
            "neighbours as faiss). See docs/search.md."),
        epilog=("example:\n  deepmetric index runs/demo/last.pt --out runs/demo/index\n"
                "  deepmetric index runs/big/best.pt --data folder --root photos/ --out big.index --approximate ivf "
                "--device cuda --search-device cpu   # embed on the GPU, exact search with faiss\n"
                "  deepmetric index runs/mine/best.pt --data folder --root photos/ --out photos.index\n"
                "  deepmetric index runs/mine/best.pt --data folder --root more_photos/ --out photos.index --add"))
    p.add_argument("checkpoint", nargs="?", default=None,
                   help="checkpoint written by 'deepmetric train' (best.pt / last.pt); not with --embeddings")
    p.add_argument("--embeddings", default=None, metavar="FILE",
                   help="index vectors you already have instead of embedding images: an .npz with 'embeddings' "
                        "(optional 'labels', 'class_names', 'paths'), an .npy, or a parquet file of 'index export'")
    p.add_argument("--data", default=None,
                   help="dataset name: folder, csv, glyphs, cub, ... (default: the checkpoint's training data)")
    p.add_argument("--root", default=None, help="dataset root: the folder (folder), the .csv file (csv), ...")
    p.add_argument("--split", default=None,
                   help="split to index (default: all for folder/csv, test otherwise)")
    p.add_argument("--out", required=True, metavar="INDEX_DIR", help="index folder to write (or add to)")
    p.add_argument("--approximate", default=None, choices=["ivf", "hnsw", "ivfpq"],
                   help="build an approximate faiss index (large galleries); its recall@10 against exact "
                        "search is measured and stored in manifest.json. ivfpq: OPQ + IVF + PQ codes in memory, "
                        "candidates re-ranked with float16 vectors read from disk (docs/search.md)")
    p.add_argument("--memory-budget", type=float, default=None, metavar="GB",
                   help="ivfpq: resident memory the index may take; chooses the lists, PQ bytes and refinement")
    p.add_argument("--reduce-dim", type=int, default=None, metavar="D",
                   help="ivfpq: PCA to D dimensions before the PQ codes (re-ranking keeps every dimension)")
    p.add_argument("--add", action="store_true",
                   help="add the images to the existing index in --out (same checkpoint; already indexed "
                        "paths are skipped)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the index in --out (without --add or --overwrite an existing index is "
                        "refused; a folder that is not an index always is; a symbolic link --out: the folder it "
                        "points to is replaced, the link kept)")
    p.add_argument("--batch-size", type=int, default=256, help="images per forward pass (default 256)")
    p.add_argument("--shard-size", type=int, default=None,
                   help="under torchrun: images per shard file (default 4096); a restarted rank skips finished "
                        "shards (docs/search.md)")
    _add_model_device_arguments(p, "the exact search")
    p.add_argument("--num-workers", type=int, default=0, help="data loading processes (default 0)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--postprocess", nargs="+", default=None, metavar="STEP",
                   help="post-processing fitted on the indexed images and stored with the index (default: the "
                        "checkpoint's search.postprocess; 'none' for none), e.g. whiten:dim=256 dba:k=3,alpha=3 "
                        "aqe:k=2,alpha=3; search and serve then answer with the processed ranking")
    p.set_defaults(func=_run_index)


def _run_index(args: argparse.Namespace) -> int:
    from deepmetric.search import Index

    from deepmetric.search.postprocess import parse_steps

    if (args.checkpoint is None) == (args.embeddings is None):
        raise ValueError("give either CHECKPOINT (embed images) or --embeddings FILE (vectors you have)")
    options = {k: v for k, v in (("memory_gb", args.memory_budget), ("reduce_dim", args.reduce_dim)) if v}
    if options and args.approximate != "ivfpq":
        raise ValueError("--memory-budget / --reduce-dim apply to --approximate ivfpq")
    steps = args.postprocess
    if steps is not None:
        steps = [] if [s.lower() for s in steps] == ["none"] else parse_steps(steps)
    if args.embeddings is not None:
        from deepmetric.search.interchange import index_from_file

        index = index_from_file(args.embeddings, args.out, approximate=args.approximate, add=args.add,
                                overwrite=args.overwrite, options=options, postprocess=steps)
        print(f"{'added' if args.add else 'indexed'} {args.embeddings} -> {args.out}: {len(index)} vectors, "
              f"{len(index.class_names)} classes, d={index.dim}, {index.kind}")
        _print_recall(index)
        return 0
    index = Index.build(args.checkpoint, data=args.data, root=args.root, split=args.split, out=args.out,
                        approximate=args.approximate, add=args.add, overwrite=args.overwrite,
                        index_options=options, batch_size=args.batch_size, shard_size=args.shard_size,
                        search_device=args.search_device, device=args.device, num_workers=args.num_workers,
                        progress=not args.no_progress, postprocess=steps)
    if index is None:  # a torchrun rank other than 0: its shards are written, rank 0 writes the index
        return 0
    d = index.meta.get("added", [index.meta.get("data", {})])[-1]
    what = "added" if args.add else "indexed"
    print(f"{what} {d.get('images')} images of {d.get('name')} (split {d.get('split')}) -> {args.out}: "
          f"{len(index)} images, {len(index.class_names)} classes, d={index.dim}, {index.kind}")
    if index.meta.get("skipped_already_indexed"):
        print(f"skipped {index.meta['skipped_already_indexed']} images already in the index")
    _print_recall(index)
    return 0


def _print_recall(index) -> None:
    if index.kind != "exact":
        a = index.meta["approximate"]
        extra = f" ({a['factory']}, nprobe {a['nprobe']}, {a['k_factor']}x candidates re-ranked)" \
            if index.kind == "ivfpq" else ""
        print(f"recall@10 against exact search: {a['recall@10_vs_exact']:.4f}{extra}")
    if index.postprocessor is not None:
        from deepmetric.search.postprocess import format_steps

        print(f"post-processing: {format_steps(index.postprocessor.steps)} (queries: {index.query_dim}-d)")


def _add_index_tools_parsers(sub) -> None:
    p = sub.add_parser(
        "index-export", help="'deepmetric index export INDEX --to ...': an index's vectors and payload "
                             "to parquet or Qdrant",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=("Write every indexed vector (l2-normalised float32) with its path, label and class name, "
                     "and the manifest (checkpoint, preprocessing) a query needs: parquet:FILE (one row per "
                     "image; 'deepmetric index --embeddings FILE.parquet' reads it back) or qdrant:PATH_OR_URL "
                     "(a collection with cosine distance through qdrant-client: a folder runs Qdrant embedded, "
                     "http://HOST:6333 a server or cluster; needs the 'qdrant' extra). Written as "
                     "'deepmetric index export'."),
        epilog=("example:\n  deepmetric index export runs/demo/index --to parquet:demo.parquet\n"
                "  deepmetric index export runs/demo/index --to qdrant:demo.qdrant\n"
                "  deepmetric index export photos.index --to qdrant:http://localhost:6333 --collection photos"))
    p.add_argument("index_dir", metavar="INDEX_DIR", help="folder written by 'deepmetric index'")
    p.add_argument("--to", required=True, metavar="parquet:FILE|qdrant:PATH_OR_URL", help="where to write")
    p.add_argument("--collection", default="deepmetric", help="Qdrant collection (re-created; default deepmetric)")
    p.set_defaults(func=_run_index_export)
    m = sub.add_parser(
        "index-migrate", help="'deepmetric index migrate INDEX': rewrite an older index in the current format",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=("Rewrite INDEX_DIR (atomically) in the current format: paths, labels and class names in "
                     "Arrow files read lazily instead of JSON, and every file's SHA-256 in the manifest. An "
                     "'index --add' migrates too. Written as 'deepmetric index migrate'."),
        epilog="example:\n  deepmetric index migrate runs/demo/index")
    m.add_argument("index_dir", metavar="INDEX_DIR", help="folder written by 'deepmetric index'")
    m.set_defaults(func=_run_index_migrate)


def _run_index_export(args: argparse.Namespace) -> int:
    from deepmetric.search import Index
    from deepmetric.search.interchange import export_parquet, export_qdrant, parse_target

    scheme, where = parse_target(args.to)
    index = Index.load(args.index_dir, mmap=True, verify_hashes=True)  # never export a damaged index
    if scheme == "parquet":
        export_parquet(index, where)
    else:
        export_qdrant(index, where, collection=args.collection)
    print(f"exported {len(index)} vectors (d={index.dim}) of {args.index_dir} -> {args.to}")
    return 0


def _run_index_migrate(args: argparse.Namespace) -> int:
    import warnings

    from deepmetric.search import Index

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the "written by an older deepmetric" warning: that is the point
        index = Index.load(args.index_dir, verify_hashes=True)  # never bless a damaged index with fresh hashes
    index.save(args.index_dir)
    print(f"rewrote {args.index_dir} in the current format ({len(index)} images)")
    return 0


def _add_search_parser(sub) -> None:
    p = sub.add_parser(
        "search", help="nearest neighbours of query images in an index",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=("Check every file of INDEX_DIR against the SHA-256 in its manifest, embed each IMAGE with "
                     "the index's checkpoint (checked by SHA-256) and print its K nearest indexed images: rank, "
                     "cosine similarity, class name (label) and path."),
        epilog=("example:\n  deepmetric search runs/demo/index query.png --k 5\n"
                "  deepmetric search photos.index a.jpg b.jpg --k 10 --json --html results.html"))
    p.add_argument("index_dir", metavar="INDEX_DIR", help="folder written by 'deepmetric index'")
    p.add_argument("images", nargs="+", metavar="IMAGE", help="query image file(s)")
    p.add_argument("--k", type=int, default=10, help="neighbours per query (default 10)")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--html", default=None, metavar="OUT.html",
                   help="also write an HTML page with a thumbnail grid (self-contained)")
    p.add_argument("--checkpoint", default=None,
                   help="the index's checkpoint if it moved (must have the same SHA-256)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:i] for embedding the queries (default cpu)")
    p.set_defaults(func=_run_search)


def _run_search(args: argparse.Namespace) -> int:
    from deepmetric.search import Index
    from deepmetric.search.output import results_html, results_json, results_text

    index = Index.load(args.index_dir, mmap=True, verify_hashes=True)
    index.model(args.checkpoint, args.device)
    sims, idx = index.search(list(args.images), args.k)
    results = index.neighbours(sims, idx)
    print(results_json(args.images, results, args.k) if args.json else results_text(args.images, results))
    if args.html:
        out = results_html(args.images, results, args.html)
        print(f"wrote {out}", file=sys.stderr if args.json else sys.stdout)
    return 0


def _add_export_parser(sub) -> None:
    p = sub.add_parser(
        "export", help="export the embedding network of a checkpoint (ONNX / TorchScript)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=("Write the embedding network (input: preprocessed image batch [N, C, H, W] float32; "
                     "output: l2-normalised embedding [N, d]) and FILE.preprocessing.json beside it "
                     "(resize, crop, mean/std, channels). ONNX needs the 'onnx' package."),
        epilog=("example:\n  deepmetric export runs/demo/last.pt --format onnx --out demo.onnx\n"
                "  deepmetric export runs/demo/last.pt --format torchscript --out demo.pt"))
    p.add_argument("checkpoint", help="checkpoint written by 'deepmetric train'")
    p.add_argument("--format", dest="fmt", default="onnx", choices=["onnx", "torchscript"],
                   help="onnx (default) or torchscript")
    p.add_argument("--out", required=True, metavar="FILE", help="output file (e.g. model.onnx)")
    p.add_argument("--raw", action="store_true", help="output the embedding without l2 normalisation")
    p.add_argument("--opset", type=int, default=17,
                   help="ONNX opset version (default 17; one torch's exporter cannot write is refused)")
    p.set_defaults(func=_run_export)


def _run_export(args: argparse.Namespace) -> int:
    from deepmetric.search.export import export_model

    out, side = export_model(args.checkpoint, args.out, args.fmt, normalize=not args.raw, opset=args.opset)
    print(f"wrote {out} and {side}")
    return 0


def _add_serve_parser(sub) -> None:
    p = sub.add_parser(
        "serve", help="local web page and JSON API to search an index",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=("Serve a search page (drop or pick an image, see its nearest neighbours) and POST /search "
                     "(multipart field 'image', optional 'k'; JSON answer) for INDEX_DIR. Binds 127.0.0.1 by "
                     "default. The index is read into memory and checked (SHA-256) at start; changes on disk "
                     "are used after POST /api/reload or kill -HUP. Needs the 'serve' extra: pip install "
                     "'deepmetric[serve]'."),
        epilog="example:\n  deepmetric serve runs/demo/index --port 8000   # then open http://127.0.0.1:8000/\n"
               "  curl -X POST http://127.0.0.1:8000/api/reload   # after 'deepmetric index ... --add'")
    p.add_argument("index_dir", metavar="INDEX_DIR", help="folder written by 'deepmetric index'")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--k", type=int, default=10,
                   help="neighbours shown by default (default 10; at most 100 and the index size)")
    p.add_argument("--max-upload-mb", type=float, default=10.0, help="largest accepted upload in MiB (default 10)")
    p.add_argument("--max-decode-mb", type=float, default=None,
                   help="cap on an upload's decoded size in MiB (default 512); the limit is derived from the "
                        "model's input (4096 bytes per input pixel, at least 64 MiB) and checked before decoding")
    p.add_argument("--workers", type=int, default=2, help="threads that decode, embed and search (default 2)")
    p.add_argument("--max-in-flight", type=int, default=8,
                   help="searches accepted at once; more get 503 with Retry-After (default 8)")
    p.add_argument("--timeout", type=float, default=30.0,
                   help="seconds a search may take, reading the upload included (default 30)")
    p.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds a connection may take to send a request's headers, from opening or from "
                        "its last answer (default 10)")
    p.add_argument("--max-connections", type=int, default=512,
                   help="open connections; beyond it those idle longest are closed (default 512)")
    p.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                   help="a Host header name to answer besides loopback ones (repeatable; '*': any). "
                        "Guards against DNS rebinding; --host ADDRESS is allowed by itself")
    p.add_argument("--checkpoint", default=None, help="the index's checkpoint if it moved (same SHA-256)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:i] for embedding queries (default cpu)")
    p.set_defaults(func=_run_serve)


def _run_serve(args: argparse.Namespace) -> int:
    from deepmetric.search.serve import serve

    serve(args.index_dir, host=args.host, port=args.port, checkpoint=args.checkpoint,
          max_upload_mb=args.max_upload_mb, k=args.k, device=args.device, workers=args.workers,
          max_in_flight=args.max_in_flight, timeout_s=args.timeout, allow_hosts=args.allow_host,
          max_decode_mb=args.max_decode_mb, header_timeout_s=args.header_timeout,
          max_connections=args.max_connections)
    return 0


# --------------------------------------------------------------------------- study
def _add_study_parser(sub) -> None:
    p = sub.add_parser(
        "study", help="train variants x seeds (x benchmarks) of a config; mean, sd and 95%% CI tables",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Run every (benchmark, variant, seed) of STUDY.yaml, skipping finished runs (a killed study "
            "resumes; a killed run continues from its last.pt), and rewrite OUT/results.json, results.csv, "
            "summary.md (mean ± sd, Student-t CI, paired differences) and summary.png after every run. The "
            "runs are trials in OUT/study.db (SQLite) or --storage: the same command on several machines "
            "with --storage postgresql://... shares the work. File format: docs/study.md."),
        epilog=(
            "example:\n"
            "  deepmetric study studies/fashion_mnist_two_head.yaml --workers 2\n"
            "  deepmetric study studies/fashion_mnist_two_head.yaml --summary   # tables only\n"
            "  nohup deepmetric study studies/emoji.yaml --commit > emoji.log 2>&1 &\n"
            "  deepmetric study studies/emoji.yaml --storage postgresql://user@db/studies   # on each machine"),
    )
    p.add_argument("study", help="study file (YAML: base, overrides, variants, seeds, benchmarks, compare)")
    p.add_argument("--workers", type=int, default=None,
                   help="runs at once on this machine (default: the file's 'workers', else 1): "
                        "worker processes with cores/N torch threads each")
    p.add_argument("--storage", default=None,
                   help="Optuna storage URL of the runs (default sqlite:///OUT/study.db; postgresql://... "
                        "to share a study between machines)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # a child of --workers K
    p.add_argument("--out", default=None, help="study directory (default: the file's 'out_dir')")
    p.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", dest="overrides",
                   help="config overrides for every run, after the variants' (e.g. train.epochs=1 "
                        "with --out /tmp/smoke for a quick check of the whole study)")
    p.add_argument("--only", nargs="+", default=None, metavar="KEY",
                   help="train only the runs under these keys, by whole path parts (HBN or "
                        "HBN/seed0; 'triplet' does not match triplet_hard)")
    p.add_argument("--summary", action="store_true",
                   help="train nothing: rewrite the results files from the finished runs")
    p.add_argument("--list", action="store_true", help="list the runs and whether they are finished")
    p.add_argument("--progress", action="store_true", help="show the per-epoch progress bars of each run")
    p.add_argument("--commit", action="store_true",
                   help="git-commit the result files (only those) after every run")
    p.set_defaults(func=_run_study)


def _run_study(args: argparse.Namespace) -> int:
    from deepmetric.run import rundir
    from deepmetric.workflows.study import load_study, run_study, write_results

    from deepmetric.workflows.study import default_storage, open_trials, run_worker, sync_finished

    study = load_study(args.study, out_dir=args.out, overrides=args.overrides)
    if args.workers is not None and args.workers < 1:
        raise ValueError(f"--workers: expected an int >= 1, got {args.workers}")
    storage = args.storage or default_storage(study)
    if args.worker:  # one of the processes of 'deepmetric study --workers K'
        from deepmetric.workflows.engine import worker_threads

        result = run_worker(study, storage=storage, only=args.only, threads=worker_threads(), progress=args.progress)
        return 130 if result["interrupted"] else 0
    if args.list:
        sync_finished(study, open_trials(study, storage).get_trials(deepcopy=False))
        for run in study.runs:
            state = "finished" if run.finished else ("partial" if (run.out_dir / rundir.LAST).is_file() else "-")
            print(f"{run.key:40s} {state:9s} {run.out_dir}")
        return 0
    if args.summary:
        paths = write_results(study, storage=storage)
        print(f"wrote {', '.join(str(p) for p in paths.values())}")
        return 0
    result = run_study(study, workers=args.workers, progress=args.progress, commit=args.commit, only=args.only,
                       storage=storage, overrides=args.overrides)
    print(f"summary: {result['paths']['md']}")
    if result["interrupted"]:
        return 130
    return 1 if result["failed"] else 0


# --------------------------------------------------------------------------- tune
def _add_tune_parser(sub) -> None:
    p = sub.add_parser(
        "tune", help="search hyper-parameters on validation classes (Optuna; resumable, several machines)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Train RECIPE once per trial with values from SPACE.yaml and keep the best on a VALIDATION "
            "metric (the recipe needs data.val_classes); the pruner stops hopeless trials at their "
            "evaluations. The study lives in OUT/tune.db (SQLite) or --storage: rerunning the same "
            "command continues it (a trial killed mid-way is failed and retried once, and a seeded sampler "
            "draws new values, never the first run's again) until N trials have finished or been pruned; the same command with --storage postgresql://... on several machines "
            "shares one study. Writes OUT/best.yaml (a runnable recipe), trials.csv / trials.md, "
            "optimization_history.png, param_importances.png and report.html. Space format: docs/tuning.md."),
        epilog=(
            "example:\n"
            "  deepmetric tune recipes/glyphs_cross_family.yaml --space spaces/glyphs_lr_alpha.yaml "
            "--trials 12 --workers 2 --out runs/tune/glyphs\n"
            "  deepmetric train runs/tune/glyphs/best.yaml                 # train the winner\n"
            "  deepmetric tune RECIPE --space S --trials 40 --storage postgresql://user@db/tune --study-name s1\n"
            "  deepmetric tune runs/emoji_transfer/best.pt --postprocess   # post-processing chosen on validation"),
    )
    p.add_argument("recipe", help="the config to tune (YAML, as for 'deepmetric train'); with --postprocess a "
                                  "finished checkpoint (best.pt / last.pt)")
    p.add_argument("--space", default=None, help="search space (YAML: objective, params, pruner, sampler); "
                                                  "required unless --postprocess")
    p.add_argument("--trials", type=int, default=None,
                   help="trials to finish or prune (counted over every worker and machine of the study); "
                        "required unless --postprocess")
    p.add_argument("--postprocess", action="store_true",
                   help="fast mode: choose the retrieval post-processing (whiten, dba, aqe) of the checkpoint RECIPE "
                        "on its validation split, without training (seconds after one embedding pass); writes "
                        "OUT/postprocess.yaml; never reads the test split")
    p.add_argument("--metric", default=None,
                   help="with --postprocess: the validation metric (default cross_domain_map@r for a cross-domain "
                        "run, else map@r)")
    p.add_argument("--kreciprocal", action="store_true", help="with --postprocess: also try k-reciprocal re-ranking")
    p.add_argument("--device", default="auto", help="with --postprocess: where the model embeds (auto, cpu, cuda[:i])")
    p.add_argument("--count", choices=("finished", "completed"), default="finished",
                   help="what --trials counts: finished or pruned trials (default), or completed ones only "
                        "(pruned ones do not count: every tune gets the same number of complete trials)")
    p.add_argument("--max-trials", type=int, default=None,
                   help="with --count completed: stop after this many finished or pruned trials (default 3 x --trials)")
    p.add_argument("--workers", type=int, default=1,
                   help="trials at once on this machine (processes with cores/K torch threads each)")
    p.add_argument("--storage", default=None,
                   help="Optuna storage URL (default sqlite:///OUT/tune.db; postgresql://... to share a study)")
    p.add_argument("--study-name", default=None, help="study name in the storage (default RECIPE__SPACE)")
    p.add_argument("--out", default=None, help="tune directory (default runs/tune/<study name>)")
    p.add_argument("--report-only", action="store_true", help="train nothing: rewrite the outputs from the storage")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # a child of --workers K
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="config overrides for every trial (anywhere on the line, also after the options)")
    p.set_defaults(func=_run_tune)


def _run_tune_postprocess(args: argparse.Namespace) -> int:
    from deepmetric.workflows.tune_postprocess import tune_postprocess

    res = tune_postprocess(args.recipe, metric=args.metric, out=args.out, device=args.device,
                           kreciprocal=args.kreciprocal)
    print(f"[tune] validation ({res['split']}, {res['images']} images, embedded in {res['embed_seconds']:.0f} s), "
          f"{res['metric']}, {len(res['trials'])} lists in {res['seconds']:.0f} s:")
    for t in res["trials"]:
        print(f"  {100 * t['value']:6.2f}  {t['spelled']}")
    print(f"[tune] chosen: {res['spelled']} ({100 * res['value']:.2f}, without {100 * res['baseline']:.2f})")
    for name, path in res["files"].items():
        print(f"[tune] {name:<6} {path}")
    return 0


def _run_tune(args: argparse.Namespace) -> int:
    from deepmetric.workflows.tune import TuneError, prepare_tune, run_tune, run_worker, write_outputs

    if args.postprocess:
        return _run_tune_postprocess(args)
    if args.space is None or args.trials is None:
        print("deepmetric tune: error: the following arguments are required: --space, --trials "
              "(or --postprocess with a checkpoint)", file=sys.stderr)
        return 2

    try:
        if args.workers < 1:
            raise TuneError(f"--workers: expected an int >= 1, got {args.workers}")
        setup = prepare_tune(args.recipe, args.space, trials=args.trials, out=args.out, storage=args.storage,
                             study_name=args.study_name, overrides=args.overrides, count=args.count,
                             max_trials=args.max_trials)
        if args.worker:  # one of the processes of 'deepmetric tune --workers K'
            from deepmetric.workflows.engine import worker_threads

            run_worker(setup, threads=worker_threads())
            return 0
        paths = write_outputs(setup) if args.report_only else run_tune(setup, workers=args.workers)
    except KeyboardInterrupt:
        print("deepmetric tune: interrupted; rerun the same command to continue the study", file=sys.stderr)
        return 130
    except TuneError as exc:
        print(f"deepmetric tune: error: {exc}", file=sys.stderr)
        return 2
    for name, path in paths.items():
        print(f"[tune] {name:<22} {path}")
    return 0


# --------------------------------------------------------------------------- main
class _Parser(argparse.ArgumentParser):
    """The top-level parser: 'deepmetric index export|migrate ...' are the sub-commands
    index-export / index-migrate ('index' itself takes a positional CHECKPOINT)."""

    def parse_known_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        if args[:1] == ["index"] and args[1:2] in (["export"], ["migrate"]):
            args = [f"index-{args[1]}"] + args[2:]
        return super().parse_known_args(args, namespace)


def build_parser() -> argparse.ArgumentParser:
    from deepmetric import __version__

    parser = _Parser(
        prog="deepmetric", description="Deep metric learning toolkit. 'deepmetric COMMAND --help' "
        "describes each command's options, with examples.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=("examples:\n"
                "  deepmetric demo                                   # the offline demo (emoji, CPU)\n"
                "  deepmetric train recipes/own_folder.yaml data.root=my_images train.out_dir=runs/mine\n"
                "  deepmetric report runs/demo                       # one HTML page of the run\n"
                "  deepmetric index runs/demo/last.pt --out runs/demo/index\n"
                "  deepmetric search runs/demo/index query.png --k 5\n"
                "  deepmetric study studies/emoji.yaml --workers 2   # variants x seeds, with CIs\n"
                "  deepmetric tune RECIPE.yaml --space SPACE.yaml --trials 12   # tune on validation classes"))
    parser.add_argument("--version", action="version", version=f"deepmetric {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_evaluate_parser(sub)
    _add_report_parser(sub)
    _add_train_parser(sub)
    _add_embed_parser(sub)
    _add_demo_parser(sub)
    _add_emoji_parser(sub)
    _add_index_parser(sub)
    _add_index_tools_parsers(sub)
    _add_search_parser(sub)
    _add_export_parser(sub)
    _add_serve_parser(sub)
    _add_study_parser(sub)
    _add_tune_parser(sub)
    parser.commands = sub.choices  # {name: sub-command parser}: parse_command_line's errors
    return parser


#: A ``KEY=VALUE`` config override as a token of the command line (``loss.0.options.alpha=8``).
_OVERRIDE = re.compile(r"[A-Za-z_][\w.-]*=")


def parse_command_line(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``parser.parse_args``, except that ``KEY=VALUE`` overrides may stand anywhere on the line
    of a command that takes them (``tune R --space S --trials 5 train.epochs=3``, ``train CFG
    --overwrite KEY=VAL``): argparse fills a ``nargs='*'`` positional only where it first meets
    it, so the overrides after an option come back unparsed and are appended here, in order.
    Any other unparsed token is still an error of its sub-command."""
    args, extra = parser.parse_known_args(argv)
    if not extra:
        return args
    takes = isinstance(getattr(args, "overrides", None), list)
    unknown = [t for t in extra if not (takes and _OVERRIDE.match(t))]
    if unknown:
        sub = getattr(parser, "commands", {}).get(getattr(args, "command", None), parser)
        what = "a known option" + (" or a KEY=VALUE override" if takes else "")
        sub.error(f"unrecognized argument(s): {' '.join(unknown)} (expected {what}; see --help)")
    args.overrides = list(args.overrides) + extra
    return args


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parse_command_line(parser, argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, TypeError, KeyError, OSError, RuntimeError) as exc:
        from deepmetric.data.loader import worker_error_message

        in_worker = worker_error_message(exc)
        if os.environ.get("DEEPMETRIC_DEBUG") or (isinstance(exc, RuntimeError) and in_worker is None):
            raise
        msg = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        msg = in_worker if in_worker is not None else msg
        # a file name that is not UTF-8 is shown with its bytes escaped (caf\xe9.png)
        msg = str(msg).encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
        print(f"deepmetric {args.command}: error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
