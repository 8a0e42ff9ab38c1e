"""``interp train``: train the embedded toy model (or a variant); the training itself is
``interp.train`` (which ``python -m interp train`` runs without the analyses package)."""

from __future__ import annotations

from interp.train import TRAIN_HELP, add_arguments


def register(subparsers) -> None:
    """Add the ``train`` subcommand to an argparse subparsers object."""
    add_arguments(subparsers.add_parser("train", help=TRAIN_HELP))
