"""``interp ablate``, ``interp patch`` and ``interp study run``: each writes a CSV and a PNG."""

from __future__ import annotations

import argparse
from pathlib import Path

from analyses.ablation import METHODS, ablation_sweep, pruning_curve
from analyses.attribution import attribution_agreement, attribution_patch_heads, shortlist_patch_heads
from analyses.intervention_figures import ablation_figure, bars, patching_figure, save_csv, save_figure
from analyses.metrics import logit_diff_metric, loss_metric
from analyses.patching import DIRECTIONS, patch_heads, patch_patterns, patch_residual, patching_frame
from analyses.probes import bos_token_id, corrupt_first_copy, probes_for
from analyses.study import run_study
from interp import load_model
from interp.errors import UserError

PATCH_TARGETS = {
    "heads": (patch_heads, ("layer", "head"), {}),
    "heads_by_position": (patch_heads, ("layer", "pos", "head"), {"by_position": True}),
    "residual": (patch_residual, ("layer", "pos"), {}),
    "patterns": (patch_patterns, ("layer", "head"), {}),
}


def _model_and_prompt_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="toy", help="anything load_model takes (default: toy)")
    parser.add_argument("--impl", default="scratch", choices=["scratch", "transformer_lens"])
    parser.add_argument("--prompts", type=int, default=32, help="number of repeated-segment probe prompts")
    parser.add_argument("--seq-len", type=int, default=None, help="probe length (default min(n_ctx, 128))")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")


def register(subparsers) -> None:
    ablate = subparsers.add_parser("ablate", help="ablate heads (zero/mean/resample) and measure the loss")
    _model_and_prompt_args(ablate)
    ablate.add_argument("--text", action="append", help="a prompt (repeat for several; default: repeated probes)")
    ablate.add_argument("--method", default="mean", choices=METHODS)
    ablate.add_argument("--targets", default="each_head", choices=["each_head", "each_layer", "cumulative"])
    ablate.add_argument("--heads", help="ablate this group instead, e.g. 1.4,1.10 (layer.head, comma-separated)")
    ablate.add_argument("--preserve-patterns", action="store_true", help="freeze other heads' attention patterns")
    ablate.set_defaults(func=run_ablate)

    patch = subparsers.add_parser("patch", help="activation patching (and attribution) of a clean/corrupted pair")
    _model_and_prompt_args(patch)
    patch.add_argument("--clean", help="clean prompt (with --corrupted; default: the induction pair)")
    patch.add_argument("--corrupted", help="corrupted prompt of the same token length")
    patch.add_argument("--what", default="heads", choices=list(PATCH_TARGETS))
    patch.add_argument("--direction", default="denoise", choices=DIRECTIONS)
    patch.add_argument("--normalize", action="store_true", help="0 = corrupted, 1 = clean")
    patch.add_argument("--correct", help="with --incorrect: metric = logit difference at the last position")
    patch.add_argument("--incorrect")
    patch.add_argument("--attribution", action="store_true", help="also attribution patching, and its agreement")
    patch.add_argument("--shortlist", type=int, metavar="K",
                       help="attribution ranks all heads, exact patching confirms the top K")
    patch.set_defaults(func=run_patch)

    study = subparsers.add_parser("study", help="scripted ablation studies from a TOML spec")
    study_commands = study.add_subparsers(dest="study_command", required=True, metavar="SUBCOMMAND")
    run = study_commands.add_parser("run", help="run a study spec; rows go to OUT/results.csv as computed")
    run.add_argument("spec", type=Path)
    run.add_argument("--out", type=Path, required=True)
    run.add_argument("--resume", action="store_true", help="finish an interrupted run in OUT")
    run.add_argument("--quiet", action="store_true")
    run.set_defaults(func=run_study_command)


def parse_heads(text: str) -> list[tuple[int, int]]:
    try:
        return [tuple(int(v) for v in item.split(".")) for item in text.split(",")]
    except ValueError:
        raise UserError(f"--heads {text!r}: expected layer.head pairs separated by commas, e.g. 1.4,1.10") from None


def _prompts(model, args):
    """(tokens, predictable mask or None)."""
    if getattr(args, "text", None):
        return model.to_tokens(args.text), None
    probes = probes_for(model, args.prompts, args.seq_len, seed=args.seed)
    return probes.tokens, probes.predictable


def run_ablate(args) -> int:
    model = load_model(args.model, impl=args.impl).eval()
    tokens, predictable = _prompts(model, args)
    metric = loss_metric(tokens, predictable)
    common = dict(preserve_patterns=args.preserve_patterns, seed=args.seed, progress=not args.quiet)
    if args.heads:
        frame = ablation_sweep(model, tokens, {args.heads: parse_heads(args.heads)}, args.method, metric, **common)
    elif args.targets == "cumulative":
        frame = pruning_curve(model, tokens, args.method, metric, **common)
    else:
        frame = ablation_sweep(model, tokens, args.targets, args.method, metric, **common)
    what = "repeat loss" if predictable is not None else "loss"
    csv_path = save_csv(frame, args.out / "ablation.csv")
    png_path = save_figure(ablation_figure(frame, f"{args.method} ablation: {what}"), args.out / "ablation.png")
    print(f"baseline {what} {frame['baseline'].iloc[0]:.4f}; wrote {csv_path} and {png_path}")
    return 0


def _patch_pair(model, args):
    """(clean, corrupted, metric)."""
    if (args.clean is None) != (args.corrupted is None):
        raise UserError("pass both --clean and --corrupted, or neither (the built-in induction pair)")
    if args.clean is not None:
        clean, corrupted, predictable = model.to_tokens(args.clean), model.to_tokens(args.corrupted), None
    else:
        probes = probes_for(model, args.prompts, args.seq_len, seed=args.seed)
        clean, predictable = probes.tokens, probes.predictable
        corrupted = corrupt_first_copy(probes, model.cfg.d_vocab, bos_token_id(model), seed=args.seed + 1)
    if (args.correct is None) != (args.incorrect is None):
        raise UserError("pass both --correct and --incorrect, or neither (metric: the clean prompts' loss)")
    if args.correct is not None:
        ids = [model.to_tokens(t, prepend_bos=False)[0] for t in (args.correct, args.incorrect)]
        for text, id_ in zip((args.correct, args.incorrect), ids):
            if len(id_) != 1:
                raise UserError(f"{text!r} is {len(id_)} tokens; --correct/--incorrect must be one token each")
        return clean, corrupted, logit_diff_metric(int(ids[0][0]), int(ids[1][0]))
    return clean, corrupted, loss_metric(clean, predictable)


def run_patch(args) -> int:
    model = load_model(args.model, impl=args.impl).eval()
    clean, corrupted, metric = _patch_pair(model, args)
    options = dict(direction=args.direction, normalize=args.normalize)
    value = "normalized" if args.normalize else "metric"
    if args.shortlist is not None:
        frame = shortlist_patch_heads(model, clean, corrupted, metric, args.shortlist, progress=not args.quiet, **options)
        frame.insert(1, "target", "L" + frame["layer"].astype(str) + "H" + frame["head"].astype(str))
        figure = bars(frame[frame["exact"]], "target", "value", f"exact patching of the top {args.shortlist} heads")
    else:
        sweep, dims, extra = PATCH_TARGETS[args.what]
        result = sweep(model, clean, corrupted, metric, progress=not args.quiet, **extra, **options)
        frame = patching_frame(result, dims, value)
        if args.attribution:
            if args.what not in ("heads", "heads_by_position"):
                raise UserError(f"--attribution covers heads and heads_by_position, not --what {args.what}")
            attributed = attribution_patch_heads(model, clean, corrupted, metric, by_position="pos" in dims, **options)
            frame["attribution"] = attributed.flatten().numpy()
            agreement = attribution_agreement(attributed, result)
            print("attribution vs exact: " + ", ".join(f"{k} {v:.3f}" for k, v in agreement.items()))
        figure = patching_figure(frame, value, f"{args.direction} patching of {args.what}")
    csv_path = save_csv(frame, args.out / "patching.csv")
    png_path = save_figure(figure, args.out / "patching.png")
    print(f"wrote {csv_path} and {png_path}")
    return 0


def run_study_command(args) -> int:
    results = run_study(args.spec, args.out, resume=args.resume, progress=not args.quiet)
    print(f"wrote {results} and {results.with_name('results.png')}")
    return 0
