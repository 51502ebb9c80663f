"""The ``deepmetric`` command line: thin parsing that calls the library."""
from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="deepmetric", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    del sub
    args = parser.parse_args(argv)
    del args
    return 0


if __name__ == "__main__":
    sys.exit(main())
