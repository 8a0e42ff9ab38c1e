"""``interp report``: classify every head of a model and write the head-role report."""

from __future__ import annotations

import argparse
from pathlib import Path

from analyses.circuits.ground_truth import read_truth
from analyses.cli.args import (THRESHOLD_HELP, add_chat_arg, add_intervention_prompts_arg, add_model_args, add_probe_args,
                               load_cli_model, number)
from analyses.core.probes import check_prompt_count
from analyses.core.tokens import chat_texts, read_text_lines
from analyses.report.build import PROMPTS_NEEDED_BY, REPORT_SECTIONS, build_report, plan_lines
from analyses.report.sections import chosen_sections, parse_sections
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
    if args.sections is not None:
        chosen_sections(REPORT_SECTIONS, args.sections, always="roles")  # a bad name refused before the model loads
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
    if args.plan:
        print("\n".join(plan_lines(model, n_prompts=args.prompts, seq_len=args.seq_len, seed=args.seed, texts=texts,
                                   intervention_prompts=args.intervention_prompts, sections=args.sections)))
        return 0
    report = build_report(model, model_name=str(args.model), n_prompts=args.prompts, seq_len=args.seq_len,
                          seed=args.seed, texts=texts, thresholds=args.threshold, fdr=args.fdr,
                          intervention_prompts=args.intervention_prompts, memory_mb=args.memory_mb,
                          progress=args.progress, circuit_screen=None if args.exact_all else DEFAULT_SCREEN,
                          sections=args.sections, out=args.out, resume=args.resume)
    print("\n".join(summary_text(report.summary)))
    print(f"\nThe report: {Path(args.out) / 'index.html'} (and report.md, head_roles.csv beside it)")
    return 0


def summary_text(lines: list[str]) -> list[str]:
    """The report's summary (``report_summary``: Markdown) as the terminal prints it: without the bold marks."""
    return [line.replace("**", "") for line in lines]


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
    names = ", ".join(section.name for section in REPORT_SECTIONS)
    parser.add_argument("--sections", type=parse_sections, default=None,
                        help=f"the sections to run, comma-separated, of {names} (default: every one; roles always, "
                             "and every section a chosen one needs); --plan lists them with their cost")
    parser.add_argument("--plan", action="store_true",
                        help="print the sections the report would run with each one's estimated cost, and run nothing")
    parser.add_argument("--resume", action="store_true",
                        help="reuse the sections finished in --out by an earlier run of the same inputs (its .sections "
                             "store) and compute the rest; a store of other inputs is refused")
    parser.add_argument("--out", default="reports/toy",
                        help="output directory (default reports/toy); the page is written there once the roles land "
                             "and rewritten as each section does")
    parser.set_defaults(func=run)
