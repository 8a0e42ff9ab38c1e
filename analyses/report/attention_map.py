"""``interp attention-map``: every head of one layer on one text, in one figure (the classic
multi-head attention map), token labels on both axes.

A map shows at most the first ``MAX_MAP_TOKENS`` tokens, and fewer where the heads' grid would pass
``MAX_MAP_PIXELS`` on a side (matplotlib refuses an image of 2^16 pixels, and long before that a
map's labels are unreadable); the title then says how many of the text's tokens it shows. The
weights shown are the model's on the whole text (among the first tokens: a causal model's whole
rows)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from matplotlib.figure import Figure

from analyses.core.hook_names import pattern_names
from analyses.interventions.engine import cache_run
from analyses.cli.args import add_model_args, load_cli_model
from analyses.report.meta import model_meta
from analyses.core.plots import DPI, attention_grid, png_bytes
from analyses.core.tokens import encode
from interp.files import write_atomic
from interp.errors import UserError

MAX_MAP_TOKENS = 128  # a map shows at most this many tokens (beyond it the labels cannot be read)
MAX_MAP_PIXELS = 2 ** 15  # nor more pixels than this on either side (matplotlib's limit is 2 ** 16)


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
    """The figure of every head of ``layer`` attending over ``text``: its first tokens only where
    the text is longer than a readable map that fits the image size limit (the title says so)."""
    check_layer(model, layer)
    tokens = encode(model, check_text(text)).tokens[0]
    patterns = all_patterns(model, tokens)[layer]
    labels = model.to_str_tokens(tokens)
    titles = [f"L{layer}H{head}" for head in range(model.cfg.n_heads)]
    shown = min(len(labels), MAX_MAP_TOKENS)
    while True:
        title = f"layer {layer}" + ("" if shown == len(labels) else
                                    f": the first {shown} of the text's {len(labels)} tokens (a map of more "
                                    f"would pass the image size limit)")
        figure = attention_grid(patterns[:, :shown, :shown], labels[:shown], titles, suptitle=title)
        largest = max(figure.get_size_inches()) * DPI
        if largest <= MAX_MAP_PIXELS or shown == 1:
            return figure
        shown = max(1, min(shown - 1, int(shown * MAX_MAP_PIXELS / largest)))


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
