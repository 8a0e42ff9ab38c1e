"""What every command that analyses a model shares: its ``--model``/``--impl`` arguments, where and
in which precision it runs (``--device``, ``--dtype``), the memory an analysis may add
(``--memory-mb``), whether it shows progress (``--progress/--no-progress``), and the model they name."""

from __future__ import annotations

import argparse

from analyses.core.budget import DEFAULT_MEMORY_MB
from analyses.core.progress import DEFAULT_INTERVAL_S, INTERVAL_ENV
from interp import load_model
from interp.loading import DTYPES

IMPL_CHOICES = ("auto", "scratch", "transformer_lens")


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="toy",
                        help="toy (the embedded model, default), smollm2 (SmolLM2-135M-Instruct, a real "
                             "pretrained model), a GGUF file, a checkpoint of ours, or any Hugging Face model "
                             "directory or hub id")
    add_impl_arg(parser)
    add_run_args(parser)


def add_run_args(parser: argparse.ArgumentParser) -> None:
    """``--dtype``, ``--device`` (how the model is loaded), ``--memory-mb`` (the analyses' budget) and
    ``--progress/--no-progress``."""
    parser.add_argument("--dtype", default="float32", choices=list(DTYPES),
                        help="precision of the weights and the forward (default float32); scores are float32 always")
    parser.add_argument("--device", default="cpu", help="where the model runs: cpu (default), cuda, cuda:N, mps")
    parser.add_argument("--memory-mb", type=_positive_float, default=DEFAULT_MEMORY_MB,
                        help=f"memory an analysis may add beyond the weights, in MB (default {DEFAULT_MEMORY_MB:g})")
    add_progress_args(parser)


def add_progress_args(parser: argparse.ArgumentParser) -> None:
    """``--progress/--no-progress`` (and ``--quiet``, the same as ``--no-progress``) -> ``args.progress``:
    None by default, the analyses' ``progress`` (``analyses.core.progress``)."""
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="show progress on stderr (the default): a bar on a terminal, else a plain line per "
                             f"step and every ${INTERVAL_ENV} seconds ({DEFAULT_INTERVAL_S:g}) of a long one; "
                             "--no-progress: none")
    parser.add_argument("--quiet", dest="progress", action="store_const", const=False, help="the same as --no-progress")


def add_probe_args(parser: argparse.ArgumentParser, prompts: int) -> None:
    """``--prompts`` (default ``prompts``), ``--seq-len`` and ``--seed``: the repeated-segment probes
    a command runs the model on."""
    parser.add_argument("--prompts", type=int, default=prompts, help=f"number of probe prompts (default {prompts})")
    parser.add_argument("--seq-len", type=int, default=None, help="probe length (default min(n_ctx, 128))")
    parser.add_argument("--seed", type=int, default=0, help="seed of the probes (default 0)")


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
