"""The ``interp`` command line. Each subcommand is a module of this package (``analyses/cli/``) that
registers itself through a ``register(subparsers)`` function listed in ``_COMMANDS``; the library
never imports a command module."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import warnings

from interp.errors import UserError
from interp.memory import command_limit_mb, retain_freed_memory_once
from analyses.core.budget import DEFAULT_MEMORY_MB

# module path -> it defines register(subparsers), adding one or more subcommands whose
# parser sets `func(args) -> int`.
_COMMANDS = [
    "analyses.cli.train",
    "analyses.cli.report",
    "analyses.cli.attention_map",
    "analyses.cli.interventions",
    "analyses.cli.study",
    "analyses.cli.check",
    "analyses.cli.circuit",
    "analyses.cli.compare",
    "analyses.cli.tasks",
    "analyses.cli.tracr",
    "analyses.cli.qk",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="interp", description="Look inside attention heads.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in _COMMANDS:
        importlib.import_module(module).register(subparsers)
    return parser


def quiet_libraries() -> None:
    """Keep the libraries under a command quiet: Hugging Face's per-load progress bars and every
    library's warnings and log lines below ERROR stay off the user's terminal, so a command prints
    only its own progress and results. Warnings raised by interp's own code still show."""
    import huggingface_hub.utils
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    huggingface_hub.utils.disable_progress_bars()
    for name in ("transformer_lens", "jax", "absl", "accelerate", "datasets"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    warnings.filterwarnings("default", module=r"(interp|analyses)(\.|$)")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    quiet_libraries()
    # the process is ours: keep freed memory for the next chunk, a share of the budget
    retain_freed_memory_once(command_limit_mb(getattr(args, "memory_mb", DEFAULT_MEMORY_MB)))
    try:
        return args.func(args) or 0
    except UserError as error:  # a user mistake: one line; anything else is a bug and keeps its traceback
        print(f"interp {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
