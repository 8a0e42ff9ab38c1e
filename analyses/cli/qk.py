"""``interp qk``: why one head attends where it does (``analyses.components.qk``), on the pairs a role
defines on the repeated-segment probes or on the pairs of a CSV file, with ``--check`` the
attribution against removal of each component from the head's key and query inputs
(``analyses.circuits.qk_check``).

Writes to ``--out``: ``attribution.csv`` (each component's query-side and key-side attribution with
its interval), ``top_pairs.csv`` (the largest query-component x key-component terms), ``qk.png``,
``meta.json`` and with ``--check`` ``check.csv`` (per side and component: attribution and drop)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd
import torch

from analyses.circuits.qk_check import PAIR_ROLES, qk_intervention_check, role_pairs
from analyses.cli.args import add_model_args, add_probe_args, load_cli_model, whole
from analyses.components.qk import BASELINES, QKAttribution, chunk_prompts, qk_attribution, qk_figure
from analyses.core.plots import png_bytes
from analyses.core.probes import probes_for
from analyses.core.tokens import read_text
from analyses.core.heads import as_head
from analyses.report.meta import model_meta
from analyses.tasks.task import check_header
from interp.errors import UserError
from interp.files import write_atomic

PAIR_COLUMNS = ("text", "query_pos", "key_pos")


def parse_head(text: str) -> tuple[int, int]:
    """``L.H`` or ``LlHh`` -> (layer, head) (``as_head``)."""
    try:
        return as_head(text)
    except UserError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a head as LAYER.HEAD or LlayerHhead, e.g. 1.5 or L1H5") \
            from None


def file_pairs(model, path: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A CSV of ``text, query_pos, key_pos`` rows (positions in the text's tokens, the start token
    counted where the model's texts begin with one) -> (tokens, query_pos, key_pos), the texts in
    file order; every text must have as many pairs and as many tokens as the others."""
    read_text(path, "pairs file")  # a missing or non-UTF-8 file: one line
    try:
        frame = pd.read_csv(path)
    except pd.errors.EmptyDataError:  # not even a header
        frame = pd.DataFrame()
    check_header(f"pairs file {path!r}", list(frame.columns) or None, PAIR_COLUMNS)
    if frame.empty:
        raise UserError(f"pairs file {path!r}: no rows; it needs rows of {', '.join(PAIR_COLUMNS)}")
    groups = list(frame.groupby("text", sort=False))
    counts = {len(group) for _, group in groups}
    if len(counts) != 1:
        raise UserError(f"pairs file {path!r}: every text needs as many pairs (found {sorted(counts)})")
    tokens = [model.to_tokens(text)[0] for text, _ in groups]
    if len({len(t) for t in tokens}) != 1:
        raise UserError(f"pairs file {path!r}: every text must have as many tokens (found "
                        f"{sorted({len(t) for t in tokens})}); pad the texts or run them one file each")
    positions = [torch.tensor(group[list(PAIR_COLUMNS[1:])].to_numpy().T, dtype=torch.long) for _, group in groups]
    return torch.stack(tokens), torch.stack([p[0] for p in positions]), torch.stack([p[1] for p in positions])


def attribution_by_chunks(model, tokens, layer: int, head: int, query, key, baseline, memory_mb: float) -> QKAttribution:
    """``qk_attribution`` a chunk of prompts at a time (``chunk_prompts``: each chunk's (prompts,
    pairs, C, C) within ``memory_mb``), each chunk's pairs averaged (``pair_means``) before the next."""
    chunk = chunk_prompts(model, layer, tokens.shape[1], query.shape[1], memory_mb)
    pieces = [qk_attribution(model, tokens[at:at + chunk], layer, head, query[at:at + chunk], key[at:at + chunk],
                             baseline, memory_mb=memory_mb).pair_means() for at in range(0, len(tokens), chunk)]
    first = pieces[0]
    return QKAttribution(first.names, torch.cat([p.terms for p in pieces]), torch.cat([p.score for p in pieces]),
                         baseline, layer, head, torch.cat([p.query_pos for p in pieces]),
                         torch.cat([p.key_pos for p in pieces]), first.note)


def run(args: argparse.Namespace) -> int:
    layer, head = args.head
    model = load_cli_model(args)
    if args.pairs is not None:
        tokens, query, key = file_pairs(model, args.pairs)
    else:
        probes = probes_for(model, args.prompts, args.seq_len, args.seed)
        tokens = probes.tokens
        query, key = role_pairs(probes, args.role, args.max_pairs)
    result = attribution_by_chunks(model, tokens, layer, head, query, key, args.baseline, args.memory_mb)
    sides = pd.concat([result.query_side(seed=args.seed), result.key_side(seed=args.seed)], ignore_index=True)
    top = result.top_pairs(args.top, seed=args.seed)
    out = Path(args.out)
    write_atomic(out / "attribution.csv", lambda tmp: sides.to_csv(tmp, index=False))
    write_atomic(out / "top_pairs.csv", lambda tmp: top.to_csv(tmp, index=False))
    write_atomic(out / "qk.png", png_bytes(qk_figure(result, args.top)))
    meta = {**model_meta(model, args.model), "head": [layer, head], "baseline": args.baseline, "note": result.note,
            "pairs": args.pairs or args.role, "n_prompts": len(tokens), "pairs_per_prompt": int(query.shape[1])}
    print(f"L{layer}H{head}: {result.note}; {len(tokens)} prompts x {query.shape[1]} pairs")
    for side in ("query", "key"):
        print(f"\n{side} side (mean over pairs, 95% interval over prompts):")
        print(sides[sides["side"] == side].head(args.top).to_string(index=False, float_format="%.3f"))
    print("\ntop query x key terms:")
    print(top.to_string(index=False, float_format="%.3f"))
    if args.check:
        meta["check"] = check(model, tokens, layer, head, query, key, args, out)
    write_atomic(out / "meta.json", json.dumps(meta, indent=2, sort_keys=True))
    print(out)
    return 0


def check(model, tokens, layer: int, head: int, query, key, args: argparse.Namespace, out: Path) -> dict:
    """The attribution against removal of each component from the head's key (query) input alone:
    printed, written to ``check.csv``, returned for ``meta.json``."""
    frames, summary = [], {}
    for side in ("key", "query"):
        result = qk_intervention_check(model, tokens, layer, head, query, key, side=side, k=args.check_k,
                                       seed=args.seed, memory_mb=args.memory_mb)
        frames.append(result.frame.assign(side=side))
        summary[side] = {"spearman": result.spearman, "spearman_ci": list(result.spearman_ci), "k": result.k,
                         "top_k_overlap": result.overlap, "top_k_overlap_ci": list(result.overlap_ci)}
        print(f"\n{side} side against removal from the head's {side} input: Spearman {result.spearman:.2f} "
              f"[{result.spearman_ci[0]:.2f}, {result.spearman_ci[1]:.2f}], top-{result.k} overlap "
              f"{result.overlap:.2f} [{result.overlap_ci[0]:.2f}, {result.overlap_ci[1]:.2f}]")
    table = pd.concat(frames, ignore_index=True)
    write_atomic(out / "check.csv", lambda tmp: table.to_csv(tmp, index=False))
    return summary


def register(subparsers) -> None:
    parser = subparsers.add_parser("qk", help="why a head attends: its score split over the components it reads")
    add_model_args(parser)
    parser.add_argument("--head", type=parse_head, required=True, help="the head, as LAYER.HEAD (e.g. 1.5)")
    pairs = parser.add_mutually_exclusive_group()
    pairs.add_argument("--role", choices=PAIR_ROLES, default="induction",
                       help="the pairs this role defines on the probes: each query and its target key (default induction)")
    pairs.add_argument("--pairs", help="a CSV of text, query_pos, key_pos rows instead of probes")
    add_probe_args(parser, prompts=32)
    parser.add_argument("--max-pairs", type=whole(1), default=8, help="pairs per probe at most (default 8)")
    parser.add_argument("--baseline", choices=[b for b in BASELINES if b], default=None,
                        help="mean_other_keys: the score minus the mean score of the other keys the query sees "
                             "(default: the score itself)")
    parser.add_argument("--top", type=whole(1), default=10, help="components and terms shown (default 10)")
    parser.add_argument("--check", action="store_true",
                        help="also remove each component from the head's key (query) input alone and compare "
                             "(one forward per component)")
    parser.add_argument("--check-k", type=whole(1), default=3, help="top-k of the check's overlap (default 3)")
    parser.add_argument("--out", required=True, help="directory to write into")
    parser.set_defaults(func=run)
