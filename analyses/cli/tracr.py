"""``interp tracr PROGRAM --vocab a,b,c --max-seq-len N --out DIR``: compile a program of
``tracr.compiler.lib`` with Tracr and write it as a checkpoint of ours (``interp.tracr``), which
``load_model(DIR)`` and every command (``interp report --model DIR``) load."""

from __future__ import annotations

import argparse

from pathlib import Path

from interp.errors import UserError
from interp.loading import save_checkpoint
from interp.tracr import PROGRAMS, compile_program, encode_inputs, from_tracr


def parse_vocab(text: str) -> list:
    """"a,b,c" -> ["a", "b", "c"]; "1,2,3" -> [1, 2, 3] (integers where every item is one)."""
    items = [item.strip() for item in text.split(",")]
    if not all(items):
        raise UserError(f"--vocab {text!r}: give comma-separated tokens, none empty (e.g. a,b,c or 1,2,3)")
    try:
        return [int(item) for item in items]
    except ValueError:
        return items


def evaluate(args: argparse.Namespace, vocab: list, compilation, model) -> None:
    """Score every circuit-discovery method against the program's true circuit; write the truth,
    the scores, the faithfulness-vs-size curves and their figure next to the checkpoint."""
    from analyses.circuits.circuit_eval import curve_figure, evaluate_discovery, program_inputs, task_pairs
    from analyses.circuits.ground_truth import ground_truth
    nodes, edges = ground_truth(compilation, model)
    length = max(1, args.max_seq_len - 1)  # one shorter than allowed: see docs/guides/tracr.md
    clean, corrupted = task_pairs(encode_inputs(model, program_inputs(vocab, length, args.prompts, args.seed)), args.seed)
    scores, curves = evaluate_discovery(model, nodes, edges, clean, corrupted, steps=args.ig_steps)
    out = Path(args.out)
    nodes.to_csv(out / "true_nodes.csv", index=False)
    edges.to_csv(out / "true_edges.csv", index=False)
    scores.to_csv(out / "discovery.csv", index=False)
    curves.to_csv(out / "discovery_curves.csv", index=False)
    curve_figure(curves, args.program).savefig(out / "faithfulness_vs_size.png", dpi=120)
    print(scores.drop(columns="note").round(3).to_string(index=False))


def run(args: argparse.Namespace) -> int:
    vocab = parse_vocab(args.vocab)
    if args.prompts < 2:
        raise UserError(f"--prompts {args.prompts}: a patching task needs at least 2")
    if args.evaluate:  # the same compiler passes, with the graph kept for the truth
        from analyses.circuits.ground_truth import compile_with_graph
        compilation = compile_with_graph(args.program, vocab, args.max_seq_len, causal=args.causal)
        assembled = compilation.assembled
    else:
        assembled = compile_program(args.program, vocab, args.max_seq_len, causal=args.causal)
    model = from_tracr(assembled)
    save_checkpoint(model, args.out, training={"tracr": {"program": args.program, "vocab": vocab,
                                                         "max_seq_len": args.max_seq_len, "causal": args.causal}})
    cfg = model.cfg
    print(f"{args.program}: {cfg.n_layers} layers x {cfg.n_heads} heads, d_model {cfg.d_model}, "
          f"{'causal' if cfg.causal else 'bidirectional'} -> {args.out}")
    if args.evaluate:
        evaluate(args, vocab, compilation, model)
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
    parser.add_argument("--evaluate", action="store_true",
                        help="also score circuit discovery against the true circuit (discovery.csv, true_nodes.csv, "
                             "true_edges.csv, discovery_curves.csv, faithfulness_vs_size.png in --out)")
    parser.add_argument("--prompts", type=int, default=128, help="with --evaluate: at most this many inputs (default 128)")
    parser.add_argument("--ig-steps", type=int, default=5, help="with --evaluate: EAP-IG's steps (default 5)")
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(func=run)
