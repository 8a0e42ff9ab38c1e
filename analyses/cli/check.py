"""``interp check``: the hook self-test (``analyses.core.hook_check``) of one model, printed."""

from __future__ import annotations

import argparse

from analyses.core.hook_check import check_hooks
from analyses.cli.args import add_model_args, load_cli_model


def run(args: argparse.Namespace) -> int:
    """Print the self-test; exit 1 when a hook does not fire as documented, or the heads' outputs do
    not add up to the attention's output (before a norm on it), or that norm frozen at the clean
    run's scale does not give ``hook_attn_out`` (the analyses cannot run), 0 otherwise (an edit that
    reaches nothing is a finding: interventions on it are refused)."""
    check = check_hooks(load_cli_model(args))
    print(f"{args.model}: {check.summary()}")
    return 0 if check.shapes_ok and check.sums_ok is not False and check.norm_ok is not False else 1


def register(subparsers) -> None:
    parser = subparsers.add_parser("check", help="the hook self-test: do this model's hooks do what the analyses assume?")
    add_model_args(parser)
    parser.set_defaults(func=run)
