"""What every command that analyses a model shares: its ``--model``/``--impl`` arguments, and the
record of the model in each output's ``meta.json`` (the spec it was loaded from, its family, the
implementation that ran it, a hash of its weights, the hook self-test's verdicts and the package
versions)."""

from __future__ import annotations

import argparse
import json
import platform
from importlib import metadata
from pathlib import Path

from analyses.core.hook_check import describe
from interp import load_model
from interp.files import write_atomic

IMPL_CHOICES = ("auto", "scratch", "transformer_lens")
VERSIONED = ("interp", "torch", "transformer-lens", "transformers", "matplotlib", "seaborn", "pandas")


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


def versions() -> dict[str, str]:
    found = {"python": platform.python_version()}
    for package in VERSIONED:
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = "not installed"
    return found


def model_meta(model, spec: str) -> dict:
    """For an output's meta.json: ``{"model": spec, "family", "impl", "weights_hash"}``, the hook
    self-test's verdicts (``analyses.core.hook_check.describe``) and the package versions."""
    return {"model": str(spec), **describe(model), "versions": versions()}


def write_meta(directory: str | Path, meta: dict) -> Path:
    """``directory/meta.json`` (sorted keys, atomically)."""
    return write_atomic(Path(directory) / "meta.json", json.dumps(meta, indent=2, sort_keys=True) + "\n")
