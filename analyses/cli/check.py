"""``interp check``: the hook self-test (``analyses.core.hook_check``) of one model, printed."""

from __future__ import annotations

import argparse

from analyses.components.qk import qk_identity_gap, qk_refusal
from analyses.core.hook_check import check_hooks, probe_tokens
from analyses.cli.args import add_model_args, load_cli_model
from interp.errors import UserError

QK_TOLERANCE = 1e-4  # relative, as tests/test_qk.py checks the identity; bfloat16 products (--precision mixed) exceed it


def run(args: argparse.Namespace) -> int:
    """Print the self-test; exit 1 when a hook does not fire as documented, or the heads' outputs do
    not add up to the attention's output (before a norm on it), or that norm frozen at the clean
    run's scale does not give ``hook_attn_out`` (the analyses cannot run), 0 otherwise (an edit that
    reaches nothing is a finding: interventions on it are refused)."""
    model = load_cli_model(args)
    check = check_hooks(model)
    print(f"{args.model}: {check.summary()}")
    print(qk_line(model))
    return 0 if check.shapes_ok and check.sums_ok is not False and check.norm_ok is not False else 1


def qk_line(model) -> str:
    """The QK identity on this model (docs/guides/qk.md): the largest gap between the terms' sum and
    ``hook_attn_scores`` on the self-test's prompt, or why the model's scores cannot be split."""
    refusal = qk_refusal(model)
    if refusal is not None:
        return f"QK attribution: refused on this model ({refusal})"
    try:
        gap = qk_identity_gap(model, probe_tokens(model))
    except UserError as refused:  # e.g. a residual that its parts do not add up to: nothing to split
        return f"QK attribution: not stated on this model ({refused})"
    verdict = "add up to" if gap <= QK_TOLERANCE else "do NOT add up to"
    return (f"QK attribution: the terms {verdict} hook_attn_scores (the last layer's heads, every pair the self-test "
            f"prompt's queries see; max error {gap:.1e} of the largest |score|, tolerance {QK_TOLERANCE:.0e})")


def register(subparsers) -> None:
    parser = subparsers.add_parser("check", help="the hook self-test: do this model's hooks do what the analyses assume?")
    add_model_args(parser)
    parser.set_defaults(func=run)
