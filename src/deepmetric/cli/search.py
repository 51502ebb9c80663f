"""``deepmetric index`` (and ``index export`` / ``index migrate``), ``search``, ``export`` and ``serve``."""
from __future__ import annotations

import argparse
import sys

from deepmetric.wording import counted
from deepmetric.cli.common import (add_command, add_model_device_arguments, check_output_file, positive_finite,
                                   refuse_output_over_inputs)


# --------------------------------------------------------------------------- index / search / export / serve
def add_index_parser(sub) -> None:
    p = add_command(sub, _run_index, "index")
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
    p.add_argument("--data-option", action="append", default=[], metavar="KEY=VALUE", dest="data_options",
                   help="a data.options entry for the images to index, the value read as YAML (repeatable; e.g. "
                        "allow_empty_classes=true, skip_missing=true); the checkpoint's own data.options apply too "
                        "unless --data names another dataset")
    p.add_argument("--out", required=True, metavar="INDEX_DIR", help="index folder to write (or add to)")
    p.add_argument("--approximate", default=None, choices=["ivf", "hnsw", "ivfpq"],
                   help="build an approximate faiss index (large galleries); its recall@10 against exact "
                        "search is measured and stored in manifest.json. ivfpq: OPQ + IVF + PQ codes in memory, "
                        "candidates re-ranked with float16 vectors read from disk (docs/search.md)")
    p.add_argument("--memory-budget", type=positive_finite, default=None, metavar="GB",
                   help="ivfpq: resident memory the index may take; chooses the lists, PQ bytes and refinement")
    p.add_argument("--reduce-dim", type=int, default=None, metavar="D",
                   help="ivfpq: PCA to D dimensions before the PQ codes (re-ranking keeps every dimension)")
    p.add_argument("--add", action="store_true",
                   help="add the images (same checkpoint), or the --embeddings vectors, to the existing index in "
                        "--out; paths already indexed are skipped and counted")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the index in --out (without --add or --overwrite an existing index is "
                        "refused; a folder that is not an index always is; a symbolic link --out: the folder it "
                        "points to is replaced, the link kept)")
    p.add_argument("--batch-size", type=int, default=256, help="images per forward pass (default 256)")
    p.add_argument("--shard-size", type=int, default=None,
                   help="under torchrun: images per shard file (default 4096); a restarted rank skips finished "
                        "shards (docs/search.md)")
    add_model_device_arguments(p, "the exact search")
    p.add_argument("--num-workers", type=int, default=0, help="data loading processes (default 0)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--postprocess", nargs="+", default=None, metavar="STEP",
                   help="post-processing fitted on the indexed images and stored with the index (default: the "
                        "checkpoint's search.postprocess; 'none' for none), e.g. whiten:dim=256 dba:k=3,alpha=3 "
                        "aqe:k=2,alpha=3; search and serve then answer with the processed ranking")


def _run_index(args: argparse.Namespace) -> int:
    from deepmetric.search import Index

    from deepmetric.search.postprocess import parse_steps

    if (args.checkpoint is None) == (args.embeddings is None):
        raise ValueError("give either CHECKPOINT (embed images) or --embeddings FILE (vectors you have)")
    data_options = _data_options(args.data_options)
    if data_options and args.embeddings is not None:
        raise ValueError("--data-option applies to images embedded with a CHECKPOINT, not to --embeddings")
    if args.reduce_dim is not None and args.reduce_dim < 1:  # 0 was taken for "not given"
        raise ValueError(f"--reduce-dim must be a whole number >= 1 (the PCA's dimensions), got {args.reduce_dim}")
    options = {k: v for k, v in (("memory_gb", args.memory_budget), ("reduce_dim", args.reduce_dim)) if v is not None}
    if options and args.approximate != "ivfpq":
        raise ValueError("--memory-budget / --reduce-dim apply to --approximate ivfpq")
    steps = args.postprocess
    if steps is not None:
        steps = [] if [s.lower() for s in steps] == ["none"] else parse_steps(steps)
    if args.embeddings is not None:
        from deepmetric.search.interchange import index_from_file

        index = index_from_file(args.embeddings, args.out, approximate=args.approximate, add=args.add,
                                overwrite=args.overwrite, options=options, postprocess=steps)
        print(f"{'added' if args.add else 'indexed'} {args.embeddings} -> {args.out}: {counted(len(index), 'vector')}, "
              f"{counted(len(index.class_names), 'class', 'classes')}, d={index.dim}, {index.kind}")
        _print_skipped(index, "vector(s)")
        _print_recall(index)
        return 0
    index = Index.build(args.checkpoint, data=args.data, root=args.root, split=args.split, out=args.out,
                        options=data_options,
                        approximate=args.approximate, add=args.add, overwrite=args.overwrite,
                        index_options=options, batch_size=args.batch_size, shard_size=args.shard_size,
                        search_device=args.search_device, device=args.device, num_workers=args.num_workers,
                        progress=not args.no_progress, postprocess=steps)
    if index is None:  # a torchrun rank other than 0: its shards are written, rank 0 writes the index
        return 0
    d = index.meta.get("added", [index.meta.get("data", {})])[-1]
    what = "added" if args.add else "indexed"
    print(f"{what} {counted(d.get('images'), 'image')} of {d.get('name')} (split {d.get('split')}) -> {args.out}: "
          f"{counted(len(index), 'image')}, {counted(len(index.class_names), 'class', 'classes')}, d={index.dim}, "
          f"{index.kind}")
    _print_skipped(index, "image(s)")
    if index.meta.get("embedding_output", "embedding") != "embedding":  # not the head's output: say so
        print(f"embedded with the model's {index.meta['embedding_output']} output (the checkpoint's eval.embedding)")
    _print_recall(index)
    return 0


def _data_options(given: list[str]) -> dict:
    """``--data-option KEY=VALUE`` entries as a mapping, each value read as YAML (``true``, ``3``)."""
    from deepmetric.run.config_io import parse_override

    out = {}
    for item in given:
        parts, value = parse_override(item, "--data-option", "allow_empty_classes=true")
        out[".".join(parts)] = value
    return out


def _print_skipped(index, unit: str) -> None:
    """``--add`` leaves out the rows whose path the index already holds: how many."""
    if index.meta.get("skipped_already_indexed"):
        print(f"skipped {index.meta['skipped_already_indexed']} {unit} whose path is already in the index")


def _print_recall(index) -> None:
    if index.kind != "exact":
        a = index.meta["approximate"]
        extra = f" ({a['factory']}, nprobe {a['nprobe']}, {a['k_factor']}x candidates re-ranked)" \
            if index.kind == "ivfpq" else ""
        print(f"recall@10 against exact search: {a['recall@10_vs_exact']:.4f}{extra}")
    if index.postprocessor is not None:
        from deepmetric.search.postprocess import format_steps

        print(f"post-processing: {format_steps(index.postprocessor.steps)} (queries: {index.query_dim}-d)")


def add_index_tools_parsers(sub) -> None:
    p = add_command(sub, _run_index_export, "index-export")
    p.add_argument("index_dir", metavar="INDEX_DIR", help="folder written by 'deepmetric index'")
    p.add_argument("--to", required=True, metavar="parquet:FILE|qdrant:PATH_OR_URL", help="where to write")
    p.add_argument("--collection", default="deepmetric", help="Qdrant collection (re-created; default deepmetric)")
    m = add_command(sub, _run_index_migrate, "index-migrate")
    m.add_argument("index_dir", metavar="INDEX_DIR", help="folder written by 'deepmetric index'")


def _run_index_export(args: argparse.Namespace) -> int:
    from deepmetric.search import Index
    from deepmetric.search.interchange import (export_parquet, export_qdrant, export_warning, is_server_url,
                                               parse_target)

    scheme, where = parse_target(args.to)
    if not is_server_url(where):  # a file or a local Qdrant folder, not a server's URL
        refuse_output_over_inputs("--to", where, folders=(args.index_dir,))
        if scheme == "parquet":
            check_output_file("--to", where, "index.parquet")
    index = Index.load(args.index_dir, mmap=True, verify_hashes=True)  # never export a damaged index
    if scheme == "parquet":
        export_parquet(index, where)
    else:
        export_qdrant(index, where, collection=args.collection)
    print(f"exported {len(index)} vectors (d={index.dim}) of {args.index_dir} -> {args.to}")
    warning = export_warning(index)
    if warning:
        print(f"post-processed index: {warning}", file=sys.stderr)
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


def add_search_parser(sub) -> None:
    p = add_command(sub, _run_search, "search")
    p.add_argument("index_dir", metavar="INDEX_DIR", help="folder written by 'deepmetric index'")
    p.add_argument("images", nargs="+", metavar="IMAGE", help="query image file(s)")
    p.add_argument("--k", type=int, default=10, help="neighbours per query (default 10)")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--html", default=None, metavar="OUT.html",
                   help="also write an HTML page with a thumbnail grid (self-contained)")
    p.add_argument("--checkpoint", default=None,
                   help="the index's checkpoint if it moved (must have the same SHA-256); for an index built "
                        "from --embeddings, the checkpoint whose model made the vectors")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:i] for embedding the queries (default cpu)")


def _run_search(args: argparse.Namespace) -> int:
    from deepmetric.run.device import resolve_device
    from deepmetric.search import Index
    from deepmetric.search.output import results_html, results_json, results_text

    if args.html:
        refuse_output_over_inputs("--html", args.html, inputs=args.images, folders=(args.index_dir,))
        check_output_file("--html", args.html, "results.html")
    device = str(resolve_device(args.device, name="--device"))  # a bad or absent device: one line, first
    index = Index.load(args.index_dir, mmap=True, verify_hashes=True)
    index.model(args.checkpoint, device)
    sims, idx = index.search(list(args.images), args.k)
    results = index.neighbours(sims, idx)
    print(results_json(args.images, results) if args.json else results_text(args.images, results))
    if args.html:
        out = results_html(args.images, results, args.html)
        print(f"wrote {out}", file=sys.stderr if args.json else sys.stdout)
    return 0


def add_export_parser(sub) -> None:
    p = add_command(sub, _run_export, "export")
    p.add_argument("checkpoint", help="checkpoint written by 'deepmetric train'")
    p.add_argument("--format", dest="fmt", default="onnx", choices=["onnx", "torchscript"],
                   help="onnx (default) or torchscript")
    p.add_argument("--out", required=True, metavar="FILE", help="output file (e.g. model.onnx)")
    p.add_argument("--raw", action="store_true", help="output the embedding without l2 normalisation")
    p.add_argument("--opset", type=int, default=17,
                   help="ONNX opset version (default 17; one torch's exporter cannot write is refused)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing --out and its .preprocessing.json (without it they are refused)")


def _run_export(args: argparse.Namespace) -> int:
    from pathlib import Path

    from deepmetric.search.export import export_model, preprocessing_path

    refuse_output_over_inputs("--out", args.out, inputs=(args.checkpoint,))
    check_output_file("--out", args.out, "model.onnx" if args.fmt == "onnx" else "model.pt")
    existing = [str(p) for p in (Path(args.out), preprocessing_path(args.out)) if p.exists()]
    if existing and not args.overwrite:  # index and train refuse to replace what is there; export replaced it
        raise FileExistsError(f"--out {args.out}: {' and '.join(existing)} already exist(s); replace with "
                              "--overwrite, or choose another --out")
    out, side = export_model(args.checkpoint, args.out, args.fmt, normalize=not args.raw, opset=args.opset)
    print(f"wrote {out} and {side}")
    return 0


def add_serve_parser(sub) -> None:
    p = add_command(sub, _run_serve, "serve")
    p.add_argument("index_dir", metavar="INDEX_DIR", help="folder written by 'deepmetric index'")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: a free port, printed in the banner)")
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


def _run_serve(args: argparse.Namespace) -> int:
    from deepmetric.search.serve import serve

    serve(args.index_dir, host=args.host, port=args.port, checkpoint=args.checkpoint,
          max_upload_mb=args.max_upload_mb, k=args.k, device=args.device, workers=args.workers,
          max_in_flight=args.max_in_flight, timeout_s=args.timeout, allow_hosts=args.allow_host,
          max_decode_mb=args.max_decode_mb, header_timeout_s=args.header_timeout,
          max_connections=args.max_connections)
    return 0

