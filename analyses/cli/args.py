"""What every command that analyses a model shares: its ``--model``/``--impl`` arguments, where and
in which precision it runs (``--device``, ``--dtype``, ``--precision``), the memory an analysis may add
(``--memory-mb``), whether its texts begin with the start token (``--prepend-bos/--no-prepend-bos``),
whether it shows progress (``--progress/--no-progress``), and the model they name."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Callable

from analyses.core.budget import DEFAULT_MEMORY_MB
from analyses.report.build import DEFAULT_INTERVENTION_PROMPTS
from analyses.core.probes import MIN_SEQ_LEN
from analyses.core.progress import DEFAULT_INTERVAL_S, INTERVAL_ENV
from interp import load_model
from interp.errors import UserError
from interp.loading import DTYPES
from interp.precision import PRECISIONS
from interp.tokenizer import chat_text, set_start_token

IMPL_CHOICES = ("auto", "scratch", "transformer_lens")


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="toy",
                        help="toy (the embedded model, default), smollm2 (SmolLM2-135M-Instruct, a real "
                             "pretrained model), a GGUF file, a checkpoint of ours, or any Hugging Face model "
                             "directory or hub id")
    add_impl_arg(parser)
    add_run_args(parser)


def add_run_args(parser: argparse.ArgumentParser) -> None:
    """``--dtype``, ``--device``, ``--precision`` (how the model is loaded and run), ``--memory-mb`` (the analyses' budget),
    ``--prepend-bos/--no-prepend-bos`` (None by default: the model's own setting) and
    ``--progress/--no-progress``."""
    parser.add_argument("--dtype", default="float32", choices=list(DTYPES),
                        help="precision of the weights and the forward (default float32); scores are float32 always")
    parser.add_argument("--device", default="cpu", help="where the model runs: cpu (default), cuda, cuda:N, mps")
    parser.add_argument("--precision", default="float32", choices=list(PRECISIONS),
                        help="float32 (default), or mixed: the from-scratch model's linear maps multiply in "
                             "bfloat16 (float32 accumulation), the residual, norms, attention scores, unembedding "
                             "and every hook stay float32; heads' findings hold, edge rankings (path patching) do not: "
                             "rank edges in float32 (docs/guides/sizes.md, 'Mixed precision')")
    parser.add_argument("--memory-mb", type=number(above=0), default=DEFAULT_MEMORY_MB,
                        help=f"memory an analysis may add beyond the weights, in MB (default {DEFAULT_MEMORY_MB:g})")
    parser.add_argument("--prepend-bos", action=argparse.BooleanOptionalAction, default=None,
                        help="begin every text and probe with the model's start token (BOS); default: as the "
                             "model's tokenizer says (add_bos_token; tokenizer.ggml.add_bos_token in a GGUF file), "
                             "else its family's default")
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
    parser.add_argument("--prompts", type=whole(1), default=prompts, help=f"number of probe prompts (default {prompts})")
    parser.add_argument("--seq-len", type=whole(MIN_SEQ_LEN), default=None, help="probe length (default min(n_ctx, 128))")
    parser.add_argument("--seed", type=SEED, default=0, help="seed of the probes (default 0)")


def add_intervention_prompts_arg(parser: argparse.ArgumentParser, what: str) -> None:
    """``--intervention-prompts``: ``what`` runs on this many more probes of the same draw as the
    ``--prompts`` that choose the roles (the report's split, meta.json's ``probe_split``)."""
    parser.add_argument("--intervention-prompts", type=whole(1), default=DEFAULT_INTERVENTION_PROMPTS,
                        help=f"{what} run on this many more probes of the same draw (default "
                             f"{DEFAULT_INTERVENTION_PROMPTS}); the roles are chosen on the --prompts others, so every "
                             "effect is measured on prompts that did not choose the heads")


# A role's score threshold (``--threshold``): the attention roles' scores are attention masses in [0, 1]
# (``analyses.roles.classify``), so a threshold outside [0, 1] names no role, or every head. 0 keeps
# the threshold out of the decision (every score reaches it); 1 asks for a perfect score.
THRESHOLD_HELP = "in [0, 1]: 0 lets every score through, 1 asks for a perfect one"


# Argparse types: a bad value is refused while the command line is parsed, before any model loads or
# any work starts, in one line naming the option, the value and what is allowed, e.g.
# "argument --top: -1 is not a whole number >= 1".
def whole(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """An argparse type: a whole number in [minimum, maximum] (no maximum: >= minimum)."""
    allowed = f"a whole number >= {minimum}" if maximum is None else f"a whole number in [{minimum}, {maximum}]"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text} is not {allowed}") from None
        if value < minimum or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"{text} is not {allowed}")
        return value

    parse.__name__ = allowed  # argparse's name for the type
    return parse


SEED = whole(0, 2**32 - 1)  # what every generator (torch, numpy, random) takes


def number(above: float = -math.inf, below: float = math.inf, *, closed: bool = False, infinite: bool = False,
           none: bool = False) -> Callable[[str], float | None]:
    """An argparse type: a number strictly between ``above`` and ``below`` (with ``closed``, the
    bounds included; never nan, nor an infinity unless ``infinite``: then also +inf); with ``none``,
    also the word 'none' -> None."""
    low, high = ("at least", "at most") if closed else ("above", "below")
    bounds = [f"{low} {above:g}"] * math.isfinite(above) + [f"{high} {below:g}"] * math.isfinite(below)
    interval = f"[{above:g}, {below:g}]" if closed else f"({above:g}, {below:g})"
    allowed = (f"a number in {interval}" if len(bounds) == 2 else
               " ".join(["a", "number" if infinite else "finite number", *bounds]))
    allowed += ", or inf" * infinite + ", or none" * none

    def parse(text: str) -> float | None:
        if none and text.strip().lower() == "none":
            return None
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text} is not {allowed}") from None
        inside = above <= value <= below if closed else above < value < below
        if not (inside and math.isfinite(value) or infinite and value == math.inf):
            raise argparse.ArgumentTypeError(f"{text} is not {allowed}")
        return value

    parse.__name__ = allowed
    return parse


# The options of a resumable command (``interp task --resume``) that say where it writes and how it
# shows its progress, never what it computes: the only ones its fingerprint leaves out. Every other
# option is fingerprinted, one added later too, since any may change a number: even --memory-mb and
# --device do (the budget cuts the prompts into chunks whose sums round differently; another device
# runs other kernels), so a run is resumed with the settings it began with.
NOT_FINGERPRINTED = ("out", "resume", "progress")


def arguments_record(args: argparse.Namespace, leave_out: tuple[str, ...] = ("resume", "progress")) -> dict:
    """The command's parsed arguments as data, by their names in ``args`` (paths as strings), but
    ``leave_out`` and argparse's ``func`` and ``command``: by default what ``meta.json`` records, not
    ``--resume`` nor ``--progress``, which say how the run went, not what it is."""
    return {key: str(value) if isinstance(value, Path) else value
            for key, value in vars(args).items() if key not in ("func", "command", *leave_out)}


def fingerprinted_arguments(args: argparse.Namespace) -> dict:
    """Every argument a resumable run's results may depend on: all but ``NOT_FINGERPRINTED``."""
    return arguments_record(args, NOT_FINGERPRINTED)


def add_impl_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--impl", default="auto", choices=IMPL_CHOICES,
                        help="auto (default): the from-scratch model where it implements the family, else the "
                             "TransformerLens bridge")


def load_cli_model(args: argparse.Namespace, spec: str | None = None):
    """The model ``--model`` (or ``spec``) names, run by ``--impl``, in ``--dtype`` and ``--precision`` on ``--device``,
    in eval mode, its texts beginning with the start token as ``--prepend-bos/--no-prepend-bos``
    says (where given: ``meta.json`` records it as from the command line)."""
    model = load_model(args.model if spec is None else spec, impl=None if args.impl == "auto" else args.impl,
                       dtype=args.dtype, device=args.device, precision=args.precision).eval()
    if getattr(args, "chat", False):  # the template writes its own markers, as apply_chat_template encodes them
        chat_text(model.tokenizer, "a")  # refused here, before any work, where the model has no template
        set_start_token(model, False, "chat template")
    if args.prepend_bos is not None:
        set_start_token(model, args.prepend_bos, "command line")
    return model


def add_chat_arg(parser: argparse.ArgumentParser) -> None:
    """``--chat``: wrap each text in the model's chat template (the commands that take texts)."""
    parser.add_argument("--chat", action="store_true",
                        help="give each text as a user's message in the model's chat template (instruct models; "
                             "refused where the tokenizer has none), with no start token added unless --prepend-bos")


def check_head_count(model, count: int, option: str) -> None:
    """Refuse a count of heads (``--top``, ``--shortlist``) beyond the model's, which would silently
    take them all, right after the model loads and before any sweep."""
    heads = model.cfg.n_layers * model.cfg.n_heads
    if count > heads:
        raise UserError(f"{option} {count} is more than the model's {heads} heads; allowed: 1 to {heads}")
