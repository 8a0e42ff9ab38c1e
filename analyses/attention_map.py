"""``interp attention-map``: every head of one layer on one text, in one figure (the classic
multi-head attention map), token labels on both axes."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from matplotlib.figure import Figure

from analyses.hook_names import pattern_names
from analyses.plots import attention_grid, png_bytes
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


def text_tokens(model, text: str) -> torch.Tensor:
    """One text -> token ids (pos,), BOS first; a one-line error when empty or longer than n_ctx."""
    tokens = model.to_tokens(check_text(text))[0]
    if len(tokens) > model.cfg.n_ctx:
        raise UserError(f"text is {len(tokens)} tokens, longer than the context n_ctx={model.cfg.n_ctx}")
    return tokens


@torch.no_grad()
def all_patterns(model, tokens: torch.Tensor) -> torch.Tensor:
    """tokens (pos,) -> every layer's attention (layer, head, q, k), from one forward."""
    names = pattern_names(model)
    _, cache = model.run_with_cache(tokens[None], names_filter=names, return_type=None)
    return torch.stack([cache[name][0] for name in names]).cpu()


def attention_map(model, text: str, layer: int = 0) -> Figure:
    """The figure of every head of ``layer`` attending over ``text``."""
    check_layer(model, layer)
    tokens = text_tokens(model, text)
    patterns = all_patterns(model, tokens)[layer]
    titles = [f"L{layer}H{head}" for head in range(model.cfg.n_heads)]
    return attention_grid(patterns, model.to_str_tokens(tokens), titles, suptitle=f"layer {layer}")


def run(args: argparse.Namespace) -> int:
    from interp import load_model

    check_text(args.text)  # before the slow model load
    model = load_model(args.model, impl=args.impl)
    figure = attention_map(model, args.text, args.layer)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, png_bytes(figure))
    print(out)
    return 0


def register(subparsers) -> None:
    parser = subparsers.add_parser("attention-map", help="every head of one layer on one text, as a PNG")
    parser.add_argument("--model", default="toy", help="toy (default), a checkpoint or GPT-2 directory, or a hub name")
    parser.add_argument("--impl", default="scratch", choices=["scratch", "transformer_lens"])
    parser.add_argument("--text", required=True, help="the text to look at (BOS is prepended)")
    parser.add_argument("--layer", type=int, default=0, help="which layer (default 0)")
    parser.add_argument("--out", required=True, help="PNG file to write")
    parser.set_defaults(func=run)
