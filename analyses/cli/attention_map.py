"""``interp attention-map``: every head of one layer on one text, as a PNG (``analyses/report/attention_map.py``
draws it). The text is ``--text`` or the whole of ``--text-file`` (newlines included: they are tokens too)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from analyses.cli.args import add_chat_arg, add_model_args, load_cli_model, whole
from analyses.report.attention_map import attention_map, check_text
from analyses.report.meta import model_meta
from analyses.core.plots import png_bytes
from analyses.core.tokens import chat_texts, read_text
from interp.errors import UserError
from interp.files import write_atomic


def file_text(path: str) -> str:
    """The whole UTF-8 file ``path`` as one text; a missing, non-UTF-8 or blank file is refused in one line."""
    text = read_text(path, "text file")
    if not text.strip():
        raise UserError(f"text file {path!r} is empty; pass a file with at least one non-space character")
    return text


def run(args: argparse.Namespace) -> int:
    text = file_text(args.text_file) if args.text_file is not None else check_text(args.text)  # before the slow load
    model = load_cli_model(args)
    if args.chat:
        text = chat_texts(model, [text])[0]
    figure = attention_map(model, text, args.layer)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # a lone PNG has no meta.json beside it: the model's record travels in its Description chunk
    write_atomic(out, png_bytes(figure, json.dumps(model_meta(model, args.model), sort_keys=True)))
    print(out)
    return 0


def register(subparsers) -> None:
    parser = subparsers.add_parser("attention-map", help="every head of one layer on one text, as a PNG")
    add_model_args(parser)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--text", help="the text to look at (the start token first where the model's texts have one)")
    source.add_argument("--text-file", help="a UTF-8 file whose whole text (newlines included) to look at")
    add_chat_arg(parser)
    parser.add_argument("--layer", type=whole(0), default=0, help="which layer (default 0)")
    parser.add_argument("--out", required=True, help="PNG file to write")
    parser.set_defaults(func=run)
