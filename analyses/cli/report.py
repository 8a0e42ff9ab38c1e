"""``interp report``: classify every head of a model and write the head-role report."""

from __future__ import annotations

import argparse

from analyses.circuits.ground_truth import read_truth
from analyses.cli.args import (THRESHOLD_HELP, add_chat_arg, add_intervention_prompts_arg, add_model_args, add_probe_args,
                               load_cli_model, number)
from analyses.core.probes import check_prompt_count
from analyses.core.tokens import chat_texts, read_text_lines
from analyses.report.build import PROMPTS_NEEDED_BY, build_report, write_report
from analyses.interventions.attribution import DEFAULT_SCREEN
from analyses.report.truth_page import write_truth_report
from analyses.roles.classify import DEFAULT_FDR, DEFAULT_THRESHOLD
from interp.errors import UserError


def read_texts(path: str) -> list[str]:
    """One text per non-empty line of ``path`` (UTF-8)."""
    return read_text_lines(path, "text file")


def run(args: argparse.Namespace) -> int:
    check_prompt_count(args.prompts, f"--prompts {args.prompts}", PROMPTS_NEEDED_BY)  # before the model loads
    check_prompt_count(args.intervention_prompts, f"--intervention-prompts {args.intervention_prompts}",
                       PROMPTS_NEEDED_BY)
    if args.chat and not args.text_file:
        raise UserError("--chat wraps the texts of --text-file in the chat template; pass --text-file FILE")
    texts = read_texts(args.text_file) if args.text_file else None
    model = load_cli_model(args)
    if args.chat and texts is not None:
        texts = chat_texts(model, texts)
    truth = read_truth(args.model)  # a known circuit (``interp tracr``): its logits are a program's outputs
    if truth is not None:
        print(write_truth_report(model, truth, str(args.model), args.out))
        return 0
    report = build_report(model, model_name=str(args.model), n_prompts=args.prompts, seq_len=args.seq_len,
                          seed=args.seed, texts=texts, thresholds=args.threshold, fdr=args.fdr,
                          intervention_prompts=args.intervention_prompts, memory_mb=args.memory_mb,
                          progress=args.progress, circuit_screen=None if args.exact_all else DEFAULT_SCREEN)
    print(write_report(report, args.out))
    return 0


def register(subparsers) -> None:
    parser = subparsers.add_parser("report", help="classify every head and write the head-role report")
    add_model_args(parser)
    add_probe_args(parser, prompts=64)
    add_intervention_prompts_arg(parser, "the per-head interventions (total and direct effects, backup, path "
                                         "patching, the components' patching)")
    parser.add_argument("--exact-all", action="store_true",
                        help="path-patch every edge of the circuit exactly (default: edge attribution estimates "
                             f"every edge and {DEFAULT_SCREEN.describe('edges')} are path-patched exactly)")
    parser.add_argument("--text-file", default=None, help="score the text-defined roles on these texts (one per line)")
    add_chat_arg(parser)
    parser.add_argument("--threshold", type=number(0, 1, closed=True, none=True), default=DEFAULT_THRESHOLD,
                        help=f"a role's minimum score, {THRESHOLD_HELP} (default {DEFAULT_THRESHOLD:g}); 'none': "
                             "significance alone decides")
    parser.add_argument("--fdr", type=number(0, 1, none=True), default=DEFAULT_FDR,
                        help="false-discovery rate of roles against their nulls (default 0.05); "
                             "'none': the fixed rule (threshold and an interval above chance)")
    parser.add_argument("--out", default="reports/toy", help="output directory (default reports/toy)")
    parser.set_defaults(func=run)
