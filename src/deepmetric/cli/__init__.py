"""The ``deepmetric`` command line: thin parsing that calls the library.

The sub-commands live in one module per group (:mod:`.evaluate`: evaluate, report;
:mod:`.train`: train, embed, demo, emoji; :mod:`.search`: index, search, export, serve;
:mod:`.experiments`: study, tune), each registered by a small ``add_<name>_parser(sub)``
function that adds its arguments and ``set_defaults(func=...)``; their help, description and
examples are in ``commands.yaml`` (:func:`.common.add_command` reads it); ``main`` only
dispatches. User errors (bad files, bad values) raised as ValueError / FileNotFoundError /
TypeError / KeyError / OSError are printed as one clear line on stderr with exit code 2,
without a traceback (an error raised in a data-loader worker is unwrapped to the worker's own
message); set the environment variable ``DEEPMETRIC_DEBUG=1`` to get the full traceback
instead.  Every sub-command's ``--help`` ends with runnable examples.  The ``KEY=VALUE`` config
overrides of the commands that take them (train, demo, tune, study) may stand anywhere on the
line (:func:`parse_command_line`).

Ctrl-C ends every command with one line (``deepmetric serve: interrupted``; ``index`` adds that
its ``--out`` was left as it was) and exit code 130, as ``train`` and ``tune`` do. A
standard output closed by its reader (``deepmetric search ... | head -3``) ends the command
quietly with exit code 141 (128 + SIGPIPE, as a shell reports a command SIGPIPE ended). The
library's own warnings are printed as one line each, ``deepmetric COMMAND: note: MESSAGE``,
not Python's ``file:line: UserWarning`` with a source line (:func:`_note_format`); other
libraries' warnings keep Python's form.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import warnings
from pathlib import Path

from deepmetric.cli import evaluate, experiments, search, train
from deepmetric.cli.common import spoken
from deepmetric.errors import MissingPackageError


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
    for add_parser in (evaluate.add_evaluate_parser, evaluate.add_report_parser,
                       train.add_train_parser, train.add_embed_parser, train.add_demo_parser, train.add_emoji_parser,
                       search.add_index_parser, search.add_index_tools_parsers, search.add_search_parser,
                       search.add_export_parser, search.add_serve_parser,
                       experiments.add_study_parser, experiments.add_tune_parser):  # the order of --help
        add_parser(sub)
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


#: the folder of the deepmetric package: a warning raised from a file under it is the library's
_PACKAGE_DIR = Path(__file__).resolve().parents[1]


def _from_deepmetric(category: type, filename: str) -> bool:
    """Whether a warning is deepmetric's own: its category is defined in deepmetric, or the line
    it points to (``stacklevel``) lies in a file of the package."""
    if getattr(category, "__module__", "").split(".")[0] == "deepmetric":
        return True
    try:
        return Path(filename).resolve().is_relative_to(_PACKAGE_DIR)
    except (OSError, ValueError, TypeError):
        return False


def _note_format(command: str, python_format):
    """A ``warnings.formatwarning`` for the command line: deepmetric's warnings as one line
    ``deepmetric COMMAND: note: MESSAGE``, other libraries' in Python's form (``python_format``).
    It replaces the formatting only, so ``warnings.catch_warnings(record=True)`` (pytest.warns,
    the commands that collect warnings themselves) still records them."""
    def format_warning(message, category, filename, lineno, line=None):
        if _from_deepmetric(category, filename):
            return f"deepmetric {spoken(command)}: note: {message}\n"
        return python_format(message, category, filename, lineno, line)
    return format_warning


#: what an interrupted command leaves, after "interrupted" (the others: nothing more to say)
_INTERRUPTED = {"index": "; {out} was left as it was (an index is replaced only once complete)",
                "index-migrate": "; {index_dir} was left as it was (it is replaced only once rewritten whole)",
                "export": "; {out} was left as it was (it is replaced only once written whole)"}


def _interrupted_line(args: argparse.Namespace) -> str:
    """The one line a command ended by Ctrl-C prints."""
    what = _INTERRUPTED.get(args.command, "")
    try:
        what = what.format(**vars(args))
    except (KeyError, IndexError, ValueError):
        what = ""
    return f"deepmetric {spoken(args.command)}: interrupted{what}"


def _stdout_closed() -> bool:
    """Whether standard output is a pipe (or socket) whose reader has gone: a BrokenPipeError
    from there ends the command quietly; one from elsewhere (a server's socket) is an error."""
    import select

    try:
        fd = sys.stdout.fileno()
        poller = select.poll()
    except (AttributeError, OSError, ValueError):  # no poll (Windows) or no real stdout: assume it was stdout
        return True
    poller.register(fd, select.POLLOUT)
    return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))


def _quiet_stdout() -> None:
    """Point standard output at /dev/null, so that the interpreter's last flush of what is still
    buffered does not fail again (the recipe of Python's docs, 'Note on SIGPIPE')."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (AttributeError, OSError, ValueError):
        pass


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parse_command_line(parser, argv)
    saved_format = warnings.formatwarning
    warnings.formatwarning = _note_format(args.command, saved_format)
    try:
        return _run(args)
    except KeyboardInterrupt:  # anywhere: loading, embedding, serving (an index's temporary folder is already removed)
        if os.environ.get("DEEPMETRIC_DEBUG"):
            raise
        print(_interrupted_line(args), file=sys.stderr)
        return 130
    except BrokenPipeError:  # _run lets through only one from a closed standard output
        _quiet_stdout()
        return 141
    finally:
        warnings.formatwarning = saved_format


def _run(args: argparse.Namespace) -> int:
    """Run the sub-command; a user error is one line on stderr and exit code 2 (module doc)."""
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # a pipe closed by its reader fails here, not at the interpreter's exit
        return code
    except (ValueError, FileNotFoundError, TypeError, KeyError, OSError, RuntimeError, ImportError) as exc:
        if isinstance(exc, BrokenPipeError) and _stdout_closed():
            raise  # main ends quietly
        from deepmetric.data.loader import worker_error_message

        in_worker = worker_error_message(exc)
        if os.environ.get("DEEPMETRIC_DEBUG") or (isinstance(exc, RuntimeError) and in_worker is None):
            raise
        if isinstance(exc, ImportError) and not isinstance(exc, MissingPackageError):
            raise  # only a missing optional package we name (with its install command) is the user's to fix
        msg = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        msg = in_worker if in_worker is not None else msg
        # a file name that is not UTF-8 is shown with its bytes escaped (caf\xe9.png)
        msg = str(msg).encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
        print(f"deepmetric {spoken(args.command)}: error: {msg}", file=sys.stderr)
        return 2
