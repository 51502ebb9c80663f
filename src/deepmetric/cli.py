"""The ``deepmetric`` command line: thin parsing that calls the library.

Each sub-command is registered by a small ``_add_<name>_parser(sub)`` function that adds its
arguments and ``set_defaults(func=...)``; ``main`` only dispatches. User errors (bad files,
bad values) raised as ValueError / FileNotFoundError / TypeError / KeyError / OSError are
printed as one clear line on stderr with exit code 2, without a traceback.
"""
from __future__ import annotations

import argparse
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


# --------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deepmetric", description="Deep metric learning toolkit.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_evaluate_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, TypeError, KeyError, OSError) as exc:
        msg = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"deepmetric {args.command}: error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
