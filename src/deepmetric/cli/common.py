"""What the command modules share: the sub-commands' texts (commands.yaml), description filling
and the device options."""
from __future__ import annotations

import argparse
import functools
import textwrap
from pathlib import Path


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


#: the sub-commands' help, description and epilog (a data file beside this module: the prose of
#: --help reads, and is edited, apart from the code that parses the arguments)
COMMAND_TEXTS = Path(__file__).with_name("commands.yaml")


@functools.lru_cache(maxsize=1)
def command_texts() -> dict[str, dict]:
    """:data:`COMMAND_TEXTS`, read once: ``{command name: {help, description, epilog, wrap}}``."""
    import yaml

    return yaml.safe_load(COMMAND_TEXTS.read_text(encoding="utf-8"))


def add_command(sub, run, name: str) -> argparse.ArgumentParser:
    """The parser of sub-command ``name``, which ``main`` dispatches to ``run(args)``; its help,
    description and epilog come from :data:`COMMAND_TEXTS`. Its --help keeps the description's and
    the examples' lines as written, except a description marked ``wrap: true``, which :func:`wrap`
    fills."""
    texts = command_texts()[name]
    description = wrap(texts["description"]) if texts.get("wrap") else texts["description"]
    parser = sub.add_parser(name, formatter_class=argparse.RawDescriptionHelpFormatter, help=texts["help"],
                            description=description, epilog=texts["epilog"], prog=f"deepmetric {spoken(name)}")
    parser.set_defaults(func=run)
    return parser


def spoken(command: str) -> str:
    """A sub-command as the user types it: 'index-export' is 'index export' (messages name it so)."""
    return command.replace("-", " ", 1) if command.startswith("index-") else command


def refuse_output_over_inputs(flag: str, out, inputs=(), folders=()) -> None:
    """Before any work: an output path that is one of the command's input files, or lies inside a
    folder it reads (an index), is refused with a ValueError naming both; writing there would
    destroy what the command reads."""
    target = Path(out).resolve()
    for given in inputs:
        if given is not None and Path(given).resolve() == target:
            raise ValueError(f"{flag} {out}: that is the input {given}; writing there would destroy it "
                             "(choose another path)")
    for folder in folders:
        if folder is not None and (target == Path(folder).resolve() or Path(folder).resolve() in target.parents):
            raise ValueError(f"{flag} {out}: inside {folder}, which this command reads; writing there would damage "
                             "it (choose a path outside it)")


def check_output_file(flag: str, out, example: str) -> None:
    """Before any work: the folder of the output file ``out`` exists or is created now, and
    ``out`` is not a folder (the message suggests ``out/example``); otherwise a ValueError
    naming ``flag`` (it was an OSError naming only the folder, after the work was done)."""
    target = Path(out)
    if target.is_dir():
        raise ValueError(f"{flag} {out}: is a folder; give a file name inside it, such as {target / example}")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"{flag} {out}: its folder {target.parent} cannot be created "
                         f"({exc.strerror or exc}); choose a path you can write") from None
    if not target.parent.is_dir():
        raise ValueError(f"{flag} {out}: {target.parent} is not a folder; choose a path you can write")


def positive_finite(text: str) -> float:
    """An argparse type: a finite number > 0 (an infinite or NaN budget is refused by the parser)."""
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return value
