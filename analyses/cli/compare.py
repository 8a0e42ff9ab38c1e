"""``interp compare A B``: two models of one shape, head by head (``analyses.report.compare``)."""

from __future__ import annotations

import argparse

from analyses.roles.classify import DEFAULT_THRESHOLD
from analyses.report.compare import PROMPTS_NEEDED_BY, compare_models, write_comparison
from analyses.cli.args import THRESHOLD_HELP, add_impl_arg, add_probe_args, add_run_args, load_cli_model, number
from analyses.core.probes import check_prompt_count


def run(args: argparse.Namespace) -> int:
    check_prompt_count(args.prompts, f"--prompts {args.prompts}", PROMPTS_NEEDED_BY)  # before the models load
    model_a, model_b = (load_cli_model(args, spec) for spec in (args.a, args.b))
    comparison = compare_models(model_a, model_b, names=(str(args.a), str(args.b)), n_prompts=args.prompts,
                                seq_len=args.seq_len, seed=args.seed, thresholds=args.threshold,
                                memory_mb=args.memory_mb, progress=args.progress)
    print(write_comparison(comparison, args.out))
    return 0


def register(subparsers) -> None:
    parser = subparsers.add_parser("compare", help="compare the heads of two models of the same shape "
                                                   "(two checkpoints, a model and its fine-tune)")
    parser.add_argument("a", help="model A (the baseline): toy, a shipped checkpoint of it (toy@200), a checkpoint of ours, a Hugging Face directory or id")
    parser.add_argument("b", help="model B (compared with A): same kinds, same shape as A")
    add_impl_arg(parser)
    add_run_args(parser)
    add_probe_args(parser, prompts=64)
    parser.add_argument("--threshold", type=number(0, 1, closed=True), default=DEFAULT_THRESHOLD,
                        help=f"a role's minimum score, {THRESHOLD_HELP} (default {DEFAULT_THRESHOLD:g})")
    parser.add_argument("--out", default="reports/compare", help="output directory (default reports/compare)")
    parser.set_defaults(func=run)
