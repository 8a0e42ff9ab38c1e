"""``interp ablate`` and ``interp patch``: each writes a CSV, a PNG and a ``meta.json`` recording
the model (spec, family, impl, weights hash) and the arguments. Text prompts follow
``analyses.core.tokens``' rule: texts of unequal lengths are right-padded and only their real tokens
count in the loss."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from analyses.interventions.ablation import FROM_OTHER_PROMPTS, METHODS, TARGET_KINDS, ablation_sweep, as_component, pruning_curve
from analyses.interventions.attribution import (attribution_agreement, attribution_patch_heads, attribution_patch_mlps,
                                                shortlist_patch_heads, unpatched_value)
from analyses.report.intervention_figures import ablation_figure, bars, patching_figure, save_csv, save_figure
from analyses.core.metrics import logit_diff_metric, loss_metric
from analyses.cli.args import add_model_args, add_probe_args, check_head_count, load_cli_model, whole
from analyses.report.meta import model_meta, write_meta
from analyses.core.stats import effect_text
from analyses.interventions.patching import DIRECTIONS, patch_effects
from analyses.core.probes import check_prompt_count, corrupt_first_copy, probes_for
from analyses.core.tokens import as_tokens, single_token_id
from interp.errors import UserError

# --what -> (component, by_position) of ``patch_effects``
PATCH_TARGETS = {
    "heads": ("heads", False),
    "heads_by_position": ("heads", True),
    "residual": ("residual", True),
    "patterns": ("patterns", False),
    "mlps": ("mlps", False),
    "mlps_by_position": ("mlps", True),
}
ATTRIBUTION = {"heads": attribution_patch_heads, "heads_by_position": attribution_patch_heads,
               "mlps": attribution_patch_mlps, "mlps_by_position": attribution_patch_mlps}


def _model_and_prompt_args(parser: argparse.ArgumentParser) -> None:
    add_model_args(parser)
    add_probe_args(parser, prompts=32)
    parser.add_argument("--out", type=Path, required=True, help="output directory")


def register(subparsers) -> None:
    ablate = subparsers.add_parser("ablate", help="ablate heads or MLPs (zero/mean/resample) and measure the loss")
    _model_and_prompt_args(ablate)
    ablate.add_argument("--text", action="append",
                        help="a prompt (repeat for several, of any lengths; default: repeated probes)")
    ablate.add_argument("--method", default="mean", choices=METHODS)
    ablate.add_argument("--targets", default="each_head", choices=[*TARGET_KINDS, "cumulative"],
                        help="each head, each layer's heads, each MLP (all positions, or each position), or "
                             "the cumulative pruning curve of the heads")
    ablate.add_argument("--heads", help="ablate this group instead, e.g. 1.4,1.10,mlp2 (layer.head or mlpL, "
                                        "mlpL@P for one position; comma-separated)")
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
    patch.add_argument("--shortlist", type=whole(1), metavar="K",
                       help="attribution ranks all heads, exact patching confirms the top K")
    patch.set_defaults(func=run_patch)


def parse_heads(text: str) -> list:
    """``--heads`` -> components: (layer, head) pairs and MLPs (``analyses.interventions.ablation.as_component``)."""
    try:
        return [as_component(item) for item in text.split(",")]
    except UserError:
        raise UserError(f"--heads {text!r}: expected heads (1.4 or L1H4) or mlpL (mlpL@P) separated by commas, "
                        "e.g. 1.4,L1H10,mlp2") from None


def _write_meta(model, args) -> None:
    arguments = {key: str(value) if isinstance(value, Path) else value
                 for key, value in vars(args).items() if key not in ("func", "command")}
    write_meta(args.out, model_meta(model, args.model) | {"command": args.command, "seed": args.seed,
                                                           "arguments": arguments})


def _ablation_prompts(model, args):
    """(prompts: the --text texts or the probes (whose structure --method mean_aligned needs),
    metric: None for texts (the library's loss over real tokens) or the probes' repeat loss)."""
    if args.text:
        return args.text, None
    probes = probes_for(model, args.prompts, args.seq_len, seed=args.seed)
    return probes, loss_metric(probes.tokens, probes.predictable)


def run_ablate(args) -> int:
    what = f"{len(args.text)} --text prompt(s)" if args.text else f"--prompts {args.prompts}"
    check_prompt_count(len(args.text) if args.text else args.prompts, what, FROM_OTHER_PROMPTS.get(args.method))
    model = load_cli_model(args)
    prompts, metric = _ablation_prompts(model, args)
    common = dict(preserve_patterns=args.preserve_patterns, seed=args.seed, memory_mb=args.memory_mb,
                  progress=args.progress)
    if args.heads:
        frame = ablation_sweep(model, prompts, {args.heads: parse_heads(args.heads)}, args.method, metric, **common)
    elif args.targets == "cumulative":
        frame = pruning_curve(model, prompts, args.method, metric, **common)
    else:
        frame = ablation_sweep(model, prompts, args.targets, args.method, metric, **common)
    what = "loss" if args.text else "repeat loss"
    csv_path = save_csv(frame, args.out / "ablation.csv")
    png_path = save_figure(ablation_figure(frame, f"{args.method} ablation: {what}"), args.out / "ablation.png")
    _write_meta(model, args)
    print(f"baseline {what} {frame['baseline'].iloc[0]:.4f}; wrote {csv_path} and {png_path}")
    return 0


def _patch_pair(model, args):
    """(clean, corrupted, metric)."""
    if (args.clean is None) != (args.corrupted is None):
        raise UserError("pass both --clean and --corrupted, or neither (the built-in induction pair)")
    if args.clean is not None:
        clean, corrupted = as_tokens(model, args.clean), as_tokens(model, args.corrupted)
        predictable = None
    else:
        probes = probes_for(model, args.prompts, args.seq_len, seed=args.seed)
        clean, predictable = probes.tokens, probes.predictable
        corrupted = corrupt_first_copy(probes, seed=args.seed + 1)
    if (args.correct is None) != (args.incorrect is None):
        raise UserError("pass both --correct and --incorrect, or neither (metric: the clean prompts' loss)")
    if args.correct is not None:
        return clean, corrupted, logit_diff_metric(single_token_id(model, args.correct),
                                                   single_token_id(model, args.incorrect))
    return clean, corrupted, loss_metric(clean, predictable)


def run_patch(args) -> int:
    model = load_cli_model(args)
    if args.shortlist is not None:
        check_head_count(model, args.shortlist, "--shortlist")
    clean, corrupted, metric = _patch_pair(model, args)
    options = dict(direction=args.direction, normalize=args.normalize)
    value = "normalized" if args.normalize else "metric"
    if args.shortlist is not None:
        frame = shortlist_patch_heads(model, clean, corrupted, metric, args.shortlist, progress=args.progress,
                                      memory_mb=args.memory_mb, seed=args.seed, **options)
        frame.insert(1, "target", "L" + frame["layer"].astype(str) + "H" + frame["head"].astype(str))
        exact = frame[frame["exact"]]
        figure = bars(exact, "target", "value", f"exact patching of the top {args.shortlist} heads")
        print(f"exact {args.direction} patching of the top {len(exact)} heads by attribution: effect on the "
              f"{'normalized ' if args.normalize else ''}metric [95% interval over {exact['n_prompts'].max()} prompts]")
        for row in exact.itertuples():
            print(f"  {row.target}: {effect_text(row.effect, row.ci_low, row.ci_high)}")
    else:
        component, by_position = PATCH_TARGETS[args.what]
        frame = patch_effects(model, clean, corrupted, metric, component, by_position=by_position, seed=args.seed,
                              progress=args.progress, memory_mb=args.memory_mb, **options)
        frame = frame.rename(columns={"metric": value})  # with effect, ci_low, ci_high, n_prompts
        if args.attribution:
            if args.what not in ATTRIBUTION:
                raise UserError(f"--attribution covers {', '.join(ATTRIBUTION)}, not --what {args.what}")
            attributed = ATTRIBUTION[args.what](model, clean, corrupted, metric, by_position=by_position,
                                                memory_mb=args.memory_mb, progress=args.progress, **options)
            frame["attribution"] = attributed.flatten().cpu().numpy()
            exact = torch.tensor(frame[value].to_numpy(), dtype=attributed.dtype).reshape(attributed.shape)  # a copy
            baseline = unpatched_value(model, clean, corrupted, metric, memory_mb=args.memory_mb, **options)
            agreement = attribution_agreement(attributed, exact, baseline=baseline)
            print("attribution vs exact: " + ", ".join(f"{k} {v:.3f}" for k, v in agreement.items()))
        figure = patching_figure(frame, value, f"{args.direction} patching of {args.what}")
    csv_path = save_csv(frame, args.out / "patching.csv")
    png_path = save_figure(figure, args.out / "patching.png")
    _write_meta(model, args)
    print(f"wrote {csv_path} and {png_path}")
    return 0
