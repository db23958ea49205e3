"""The `asyncflow` command line.

Each subcommand is one `_add_<name>(subparsers)` function that declares its
arguments and sets `func`, the handler called with the parsed arguments. The
design's `train`, `bench` and `report` subcommands are added the same way when
they exist.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from asyncflow import __version__


def _cmd_version(args: argparse.Namespace) -> int:
    print(f"asyncflow {__version__}")
    return 0


def _add_version(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("version", help="print the AsyncFlow version")
    parser.set_defaults(func=_cmd_version)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="asyncflow",
        description="AsyncFlow: asynchronous streaming RL for LLM post-training.",
    )
    parser.add_argument("-V", "--version", action="version", version=f"asyncflow {__version__}")
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    _add_version(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:  # no subcommand given: show what there is
        parser.print_help()
        return 0
    return func(args)


if __name__ == "__main__":
    raise SystemExit(main())
