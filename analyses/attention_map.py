"""``interp attention-map``: every head of one layer on one text, in one figure (the classic
multi-head attention map), token labels on both axes."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from matplotlib.figure import Figure

from analyses.hook_names import pattern_names
from analyses.interventions import cache_run
from analyses.outputs import add_model_args, load_cli_model, model_meta
from analyses.plots import attention_grid, png_bytes
from analyses.tokens import encode
from interp.files import write_atomic
from interp.errors import UserError


def check_layer(model, layer: int) -> int:
    if not 0 <= layer < model.cfg.n_layers:
        raise UserError(f"layer {layer} out of range [0, {model.cfg.n_layers - 1}]")
    return layer


def check_text(text: str) -> str:
    if not text or not text.strip():
        raise UserError("text is empty; pass --text with at least one non-space character")
    return text


def all_patterns(model, tokens: torch.Tensor) -> torch.Tensor:
    """tokens (pos,) -> every layer's attention (layer, head, q, k), from one forward that stops
    after the last layer's pattern."""
    names = pattern_names(model)
    _, cache = cache_run(model, tokens[None], names, logits=False)
    return torch.stack([cache[name][0] for name in names]).cpu()


def attention_map(model, text: str, layer: int = 0) -> Figure:
    """The figure of every head of ``layer`` attending over ``text``."""
    check_layer(model, layer)
    tokens = encode(model, check_text(text)).tokens[0]
    patterns = all_patterns(model, tokens)[layer]
    titles = [f"L{layer}H{head}" for head in range(model.cfg.n_heads)]
    return attention_grid(patterns, model.to_str_tokens(tokens), titles, suptitle=f"layer {layer}")


def run(args: argparse.Namespace) -> int:
    check_text(args.text)  # before the slow model load
    model = load_cli_model(args)
    figure = attention_map(model, args.text, args.layer)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # a lone PNG has no meta.json beside it: the model's record travels in its Description chunk
    write_atomic(out, png_bytes(figure, json.dumps(model_meta(model, args.model), sort_keys=True)))
    print(out)
    return 0


def register(subparsers) -> None:
    parser = subparsers.add_parser("attention-map", help="every head of one layer on one text, as a PNG")
    add_model_args(parser)
    parser.add_argument("--text", required=True, help="the text to look at (the start token is prepended)")
    parser.add_argument("--layer", type=int, default=0, help="which layer (default 0)")
    parser.add_argument("--out", required=True, help="PNG file to write")
    parser.set_defaults(func=run)
