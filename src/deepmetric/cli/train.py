"""``deepmetric train``, ``embed``, ``demo`` and ``emoji``."""
from __future__ import annotations

import argparse
import os
import sys

from deepmetric.cli.common import add_command


# --------------------------------------------------------------------------- train / embed / demo
def add_train_parser(sub) -> None:
    p = add_command(sub, _run_train, "train")
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
                        "log.jsonl, last.pt, best.pt, wise.pt, metrics.json and the trackers' files (without it a new run "
                        "refuses such a directory)")


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


def add_embed_parser(sub) -> None:
    p = add_command(sub, _run_embed, "embed")
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
                        "shards (docs/search.md, section 8)")
    p.add_argument("--batch-size", type=int, default=256, help="images per forward pass (default 256)")
    p.add_argument("--device", default="auto",
                   help="where the model runs: auto (CUDA when available), cpu, cuda or cuda:INDEX")
    p.add_argument("--num-workers", type=int, default=0,
                   help="data-loader worker processes (default 0: load in the main process)")


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


def add_demo_parser(sub) -> None:
    p = add_command(sub, _run_demo, "demo")
    p.add_argument("--data", default="emoji", choices=["emoji", "glyphs"],
                   help="emoji (default: real artwork, ImageNet backbone) or glyphs (rendered characters, from scratch)")
    p.add_argument("--out", default=None, help="output directory (default runs/demo; runs/demo_glyphs for --data glyphs)")
    p.add_argument("--quick", action="store_true", help="a tiny run (seconds) for smoke tests")
    p.add_argument("--keep", action="store_true",
                   help="refuse a non-empty --out instead of replacing an earlier demo's run files there")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. train.epochs=2")


def _run_demo(args: argparse.Namespace) -> int:
    from deepmetric.workflows.demo import run_demo

    run_demo(args.out, data=args.data, quick=args.quick, overrides=args.overrides, overwrite=not args.keep)
    return 0


# --------------------------------------------------------------------------- emoji
_EMOJI_VENDORS = "apple,google,twitter,facebook,emojione,openmoji"  # deepmetric.data.emoji.VENDORS


def add_emoji_parser(sub) -> None:
    p = add_command(sub, _run_emoji, "emoji")
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

