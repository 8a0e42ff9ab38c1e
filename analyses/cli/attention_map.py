"""``interp attention-map``: every head of one layer on one text, as a PNG (``analyses/report/attention_map.py``
draws it)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from analyses.cli.args import add_model_args, load_cli_model
from analyses.report.attention_map import attention_map, check_text
from analyses.report.meta import model_meta
from analyses.core.plots import png_bytes
from interp.files import write_atomic


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
