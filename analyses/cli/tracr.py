"""``interp tracr PROGRAM --vocab a,b,c --max-seq-len N --out DIR``: compile a program of
``tracr.compiler.lib`` with Tracr and write it as a checkpoint of ours (``interp.tracr``), which
``load_model(DIR)`` and every command (``interp report --model DIR``) load."""

from __future__ import annotations

import argparse

from interp.errors import UserError
from interp.loading import save_checkpoint
from interp.tracr import PROGRAMS, compile_program, from_tracr


def parse_vocab(text: str) -> list:
    """"a,b,c" -> ["a", "b", "c"]; "1,2,3" -> [1, 2, 3] (integers where every item is one)."""
    items = [item.strip() for item in text.split(",")]
    if not all(items):
        raise UserError(f"--vocab {text!r}: give comma-separated tokens, none empty (e.g. a,b,c or 1,2,3)")
    try:
        return [int(item) for item in items]
    except ValueError:
        return items


def run(args: argparse.Namespace) -> int:
    vocab = parse_vocab(args.vocab)
    model = from_tracr(compile_program(args.program, vocab, args.max_seq_len, causal=args.causal))
    save_checkpoint(model, args.out, training={"tracr": {"program": args.program, "vocab": vocab,
                                                         "max_seq_len": args.max_seq_len, "causal": args.causal}})
    cfg = model.cfg
    print(f"{args.program}: {cfg.n_layers} layers x {cfg.n_heads} heads, d_model {cfg.d_model}, "
          f"{'causal' if cfg.causal else 'bidirectional'} -> {args.out}")
    return 0


def register(subparsers) -> None:
    parser = subparsers.add_parser("tracr", help="compile a RASP program of tracr.compiler.lib into a model "
                                                 "(needs the [tracr] extra)")
    parser.add_argument("program", choices=sorted(PROGRAMS), metavar="PROGRAM",
                        help=f"one of {', '.join(sorted(PROGRAMS))}")
    parser.add_argument("--vocab", default="a,b,c", help="comma-separated input tokens (default a,b,c; "
                                                         "integers where all are, as sort needs)")
    parser.add_argument("--max-seq-len", type=int, default=5, help="longest input, start token excluded (default 5)")
    parser.add_argument("--causal", action="store_true", help="compile with causal attention (default: bidirectional)")
    parser.add_argument("--out", required=True, help="checkpoint directory to write")
    parser.set_defaults(func=run)
