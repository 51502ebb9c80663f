"""What the command modules share: description filling and the device options."""
from __future__ import annotations

import argparse
import textwrap


def wrap(text: str) -> str:
    """A description filled to 79 columns (the raw formatter keeps the examples' lines as written)."""
    return textwrap.fill(" ".join(text.split()), 79)


def add_model_device_arguments(p, searches: str) -> None:
    """--device and --search-device of a command that runs a model, then searches (report,
    index); run.evaluation.command_search_device decides from them."""
    p.add_argument("--device", default="auto",
                   help=f"where the model runs: auto (CUDA when available), cpu, cuda or cuda:INDEX; {searches} "
                        "runs there too unless --search-device cpu")
    p.add_argument("--search-device", default="auto", choices=["auto", "cpu"],
                   help=f"where {searches} runs: auto (the --device; on a GPU only when the embeddings fit in "
                        "its free memory) or cpu (faiss)")



def add_command(sub, run, name: str, **texts) -> argparse.ArgumentParser:
    """The parser of sub-command ``name`` (``texts``: its help, description and epilog), which
    ``main`` dispatches to ``run(args)``. Its --help keeps the description's and the examples'
    lines as written (every description that needs filling is filled by :func:`wrap`)."""
    parser = sub.add_parser(name, formatter_class=argparse.RawDescriptionHelpFormatter, **texts)
    parser.set_defaults(func=run)
    return parser
