"""The ``deepmetric`` command line: thin parsing that calls the library.\n\nEach sub-command is registered by a small ``_add_<name>_parser(sub)`` function that adds its\narguments and ``set_defaults(func=...)``; ``main`` only dispatches. User errors (bad files,\nbad values) raised as ValueError / FileNotFoundError / TypeError / KeyError / OSError are\nprinted as one clear line on stderr with exit code 2, without a traceback; set the\nenvironment variable ``DEEPMETRIC_DEBUG=1`` to get the full traceback instead.\n"""
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
    p.add_argument("--out", required=True, help="output .npz (embeddings, labels[, is_query, is_gallery, paths, class_names])")
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
    p.add_argument("--overwrite", action="store_true", help="replace the run files of an earlier demo in --out")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides")
    p.set_defaults(func=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    from deepmetric.train.demo import run_demo

    run_demo(args.out, quick=args.quick, overrides=args.overrides, overwrite=args.overwrite)
    return 0


# --------------------------------------------------------------------------- index / search / export / serve
def _add_index_parser(sub) -> None:
    p = sub.add_parser(
        "index", help="embed images with a checkpoint into a search index folder",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Embed a dataset split with CHECKPOINT (its test transform) and write INDEX_DIR: embeddings.npy, "
            "labels.npy, class_names.json, paths.json, index.faiss and manifest.json (checkpoint path, SHA-256 "
            "and config). Exact inner-product search by default. See docs/search.md."),
        epilog=("example:\n  deepmetric index runs/demo/best.pt --out runs/demo/index\n"
                "  deepmetric index runs/mine/best.pt --data folder --root photos/ --out photos.index\n"
                "  deepmetric index runs/mine/best.pt --data folder --root more_photos/ --out photos.index --add"))
    p.add_argument("checkpoint", help="checkpoint written by 'deepmetric train' (best.pt / last.pt)")
    p.add_argument("--data", default=None,
                   help="dataset name: folder, csv, glyphs, cub, ... (default: the checkpoint's training data)")
    p.add_argument("--root", default=None, help="dataset root: the folder (folder), the .csv file (csv), ...")
    p.add_argument("--split", default=None,
                   help="split to index (default: all for folder/csv, test otherwise)")
    p.add_argument("--out", required=True, metavar="INDEX_DIR", help="index folder to write (or add to)")
    p.add_argument("--approximate", default=None, choices=["ivf", "hnsw"],
                   help="build an approximate faiss index (large galleries); its recall@10 against exact "
                        "search is measured and stored in manifest.json")
    p.add_argument("--add", action="store_true",
                   help="add the images to the existing index in --out (same checkpoint; already indexed "
                        "paths are skipped)")
    p.add_argument("--batch-size", type=int, default=256, help="images per forward pass (default 256)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda[:i] (default auto)")
    p.add_argument("--num-workers", type=int, default=0, help="data loading processes (default 0)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_run_index)


def _run_index(args: argparse.Namespace) -> int:
    from deepmetric.search import Index

    index = Index.build(args.checkpoint, data=args.data, root=args.root, split=args.split, out=args.out,
                        approximate=args.approximate, add=args.add, batch_size=args.batch_size,
                        device=args.device, num_workers=args.num_workers, progress=not args.no_progress)
    d = index.meta.get("added", [index.meta.get("data", {})])[-1]
    what = "added" if args.add else "indexed"
    print(f"{what} {d.get('images')} images of {d.get('name')} (split {d.get('split')}) -> {args.out}: "
          f"{len(index)} images, {len(index.class_names)} classes, d={index.dim}, {index.kind}")
    if index.meta.get("skipped_already_indexed"):
        print(f"skipped {index.meta['skipped_already_indexed']} images already in the index")
    if index.kind != "exact":
        print(f"recall@10 against exact search: {index.meta['approximate']['recall@10_vs_exact']:.4f}")
    return 0


def _add_search_parser(sub) -> None:
    p = sub.add_parser(
        "search", help="nearest neighbours of query images in an index",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=("Embed each IMAGE with the index's checkpoint (checked by SHA-256) and print its K nearest "
                     "indexed images: rank, cosine similarity, class name (label) and path."),
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

    index = Index.load(args.index_dir, mmap=True)
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
                     "output: l2-normalised embedding [N, d]) and FILE's .preprocessing.json beside it "
                     "(resize, crop, mean/std, channels). ONNX needs the 'onnx' package."),
        epilog=("example:\n  deepmetric export runs/demo/best.pt --format onnx --out demo.onnx\n"
                "  deepmetric export runs/demo/best.pt --format torchscript --out demo.pt"))
    p.add_argument("checkpoint", help="checkpoint written by 'deepmetric train'")
    p.add_argument("--format", dest="fmt", default="onnx", choices=["onnx", "torchscript"],
                   help="onnx (default) or torchscript")
    p.add_argument("--out", required=True, metavar="FILE", help="output file (e.g. model.onnx)")
    p.add_argument("--raw", action="store_true", help="output the embedding without l2 normalisation")
    p.add_argument("--opset", type=int, default=17, help="ONNX opset version (default 17)")
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
                     "default. Needs the 'serve' extra: pip install 'deepmetric[serve]'."),
        epilog="example:\n  deepmetric serve runs/demo/index --port 8000   # then open http://127.0.0.1:8000/")
    p.add_argument("index_dir", metavar="INDEX_DIR", help="folder written by 'deepmetric index'")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--k", type=int, default=10, help="neighbours shown by default (default 10)")
    p.add_argument("--max-upload-mb", type=float, default=10.0, help="largest accepted upload in MiB (default 10)")
    p.add_argument("--checkpoint", default=None, help="the index's checkpoint if it moved (same SHA-256)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:i] for embedding queries (default cpu)")
    p.set_defaults(func=_run_serve)


def _run_serve(args: argparse.Namespace) -> int:
    from deepmetric.search.serve import serve

    serve(args.index_dir, host=args.host, port=args.port, checkpoint=args.checkpoint,
          max_upload_mb=args.max_upload_mb, k=args.k, device=args.device)
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
    _add_index_parser(sub)
    _add_search_parser(sub)
    _add_export_parser(sub)
    _add_serve_parser(sub)
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
