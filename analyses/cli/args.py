"""What every command that analyses a model shares: its ``--model``/``--impl`` arguments and the
model they name."""

from __future__ import annotations

import argparse

from interp import load_model

IMPL_CHOICES = ("auto", "scratch", "transformer_lens")


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="toy",
                        help="toy (the embedded model, default), a checkpoint of ours, or any Hugging Face "
                             "model directory or hub id")
    add_impl_arg(parser)


def add_impl_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--impl", default="auto", choices=IMPL_CHOICES,
                        help="auto (default): the from-scratch model where it implements the family, else the "
                             "TransformerLens bridge")


def load_cli_model(args: argparse.Namespace, spec: str | None = None):
    """The model ``--model`` (or ``spec``) names, run by ``--impl``, in eval mode."""
    return load_model(args.model if spec is None else spec, impl=None if args.impl == "auto" else args.impl).eval()
