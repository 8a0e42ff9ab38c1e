"""What every command that analyses a model shares: its ``--model``/``--impl`` arguments, where and
in which precision it runs (``--device``, ``--dtype``) and the memory an analysis may add
(``--memory-mb``), and the record of the model in each output's ``meta.json`` (the spec it was
loaded from, its family, the implementation that ran it, its dtype and device, a hash of its
weights, the hook self-test's verdicts and the package versions)."""

from __future__ import annotations

import argparse
import json
import platform
from importlib import metadata
from pathlib import Path

from analyses.budget import DEFAULT_MEMORY_MB
from analyses.hook_check import describe
from interp import load_model
from interp.files import write_atomic
from interp.loading import DTYPES

IMPL_CHOICES = ("auto", "scratch", "transformer_lens")
VERSIONED = ("interp", "torch", "transformer-lens", "transformers", "matplotlib", "seaborn", "pandas")


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="toy",
                        help="toy (the embedded model, default), a checkpoint of ours, or any Hugging Face "
                             "model directory or hub id")
    add_impl_arg(parser)
    add_run_args(parser)


def add_run_args(parser: argparse.ArgumentParser) -> None:
    """``--dtype``, ``--device`` (how the model is loaded) and ``--memory-mb`` (the analyses' budget)."""
    parser.add_argument("--dtype", default="float32", choices=list(DTYPES),
                        help="precision of the weights and the forward (default float32); scores are float32 always")
    parser.add_argument("--device", default="cpu", help="where the model runs: cpu (default), cuda, cuda:N, mps")
    parser.add_argument("--memory-mb", type=_positive_float, default=DEFAULT_MEMORY_MB,
                        help=f"memory an analysis may add beyond the weights, in MB (default {DEFAULT_MEMORY_MB:g})")


def _positive_float(text: str) -> float:
    """An argparse type: a number above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be above 0")
    return value


def add_impl_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--impl", default="auto", choices=IMPL_CHOICES,
                        help="auto (default): the from-scratch model where it implements the family, else the "
                             "TransformerLens bridge")


def load_cli_model(args: argparse.Namespace, spec: str | None = None):
    """The model ``--model`` (or ``spec``) names, run by ``--impl``, in ``--dtype`` on ``--device``,
    in eval mode."""
    return load_model(args.model if spec is None else spec, impl=None if args.impl == "auto" else args.impl,
                      dtype=args.dtype, device=args.device).eval()


def versions() -> dict[str, str]:
    found = {"python": platform.python_version()}
    for package in VERSIONED:
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = "not installed"
    return found


def model_meta(model, spec: str) -> dict:
    """For an output's meta.json: ``{"model": spec, "family", "impl", "weights_hash", "dtype", "device"}``,
    the hook self-test's verdicts (``analyses.hook_check.describe``) and the package versions."""
    weight = next(model.parameters())
    return {"model": str(spec), **describe(model), "dtype": str(weight.dtype).removeprefix("torch."),
            "device": str(weight.device), "versions": versions()}


def write_meta(directory: str | Path, meta: dict) -> Path:
    """``directory/meta.json`` (sorted keys, atomically)."""
    return write_atomic(Path(directory) / "meta.json", json.dumps(meta, indent=2, sort_keys=True) + "\n")
