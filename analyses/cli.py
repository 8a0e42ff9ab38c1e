"""The ``interp`` command line. Each subcommand lives next to the analysis it runs and registers
itself through a ``register(subparsers)`` function listed in ``_COMMANDS``."""

from __future__ import annotations

import argparse
import importlib
import sys

from interp.errors import UserError

# module path -> it defines register(subparsers), adding one or more subcommands whose
# parser sets `func(args) -> int`.
_COMMANDS = [
    "interp.train",
    "analyses.report",
    "analyses.attention_map",
    "analyses.intervention_cli",
    "analyses.check_cli",
    "analyses.circuit_cli",
    "analyses.compare_cli",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="interp", description="Look inside attention heads.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in _COMMANDS:
        importlib.import_module(module).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except UserError as error:  # a user mistake: one line; anything else is a bug and keeps its traceback
        print(f"interp {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
