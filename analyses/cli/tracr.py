"""``interp tracr PROGRAM --vocab a,b,c --max-seq-len N --out DIR``: compile a program of
``tracr.compiler.lib`` with Tracr and write it as a checkpoint of ours (``interp.tracr``), which
``load_model(DIR)`` and every command load, with its true circuit and task in ``DIR/ground_truth/``
(``analyses.circuits.ground_truth.write_truth``), which ``interp circuit`` and ``interp report``
score discovery against."""

from __future__ import annotations

import argparse

from pathlib import Path

from analyses.circuits.circuit_eval import METRIC_NAME, PAIRINGS, curve_figure, evaluate_known, program_inputs
from analyses.cli.args import SEED, add_progress_args, whole
from analyses.circuits.ground_truth import KnownTruth, compile_with_graph, ground_truth, write_truth
from interp.errors import UserError
from interp.files import write_atomic
from interp.loading import save_checkpoint
from interp.tracr import PROGRAMS, from_tracr


def parse_vocab(text: str) -> list:
    """"a,b,c" -> ["a", "b", "c"]; "1,2,3" -> [1, 2, 3] (integers where every item is one)."""
    items = [item.strip() for item in text.split(",")]
    if not all(items):
        raise UserError(f"--vocab {text!r}: give comma-separated tokens, none empty (e.g. a,b,c or 1,2,3)")
    try:
        return [int(item) for item in items]
    except ValueError:
        return items


def write_discovery(out: Path, scores, curves, title: str) -> None:
    """Write ``evaluate_discovery``'s scores and curves (discovery.csv, discovery_curves.csv,
    faithfulness_vs_size.png) into ``out`` and print the scores."""
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "discovery.csv", scores.to_csv(index=False))
    write_atomic(out / "discovery_curves.csv", curves.to_csv(index=False))
    figure = curve_figure(curves, title)
    write_atomic(out / "faithfulness_vs_size.png", lambda path: figure.savefig(path, dpi=120, format="png"))
    print(scores.drop(columns="note").round(3).to_string(index=False))


def run(args: argparse.Namespace) -> int:
    vocab = parse_vocab(args.vocab)
    # the passes of Tracr's compile_rasp_to_model, with the graph kept for the truth
    compilation = compile_with_graph(args.program, vocab, args.max_seq_len, causal=args.causal)
    model = from_tracr(compilation.assembled)
    program = {"program": args.program, "vocab": vocab, "max_seq_len": args.max_seq_len, "causal": args.causal}
    save_checkpoint(model, args.out, training={"tracr": program})
    length = max(1, args.max_seq_len - 1)  # one shorter than allowed: see docs/guides/tracr.md
    inputs = program_inputs(vocab, length, args.prompts, args.seed)
    task = program | {"inputs": inputs, "outputs": getattr(model.tokenizer, "outputs", None), "pairs": args.pairs,
                      "seed": args.seed, "ig_steps": args.ig_steps, "metric": METRIC_NAME}
    truth = KnownTruth(*ground_truth(compilation, model), task)
    write_truth(args.out, truth)
    cfg = model.cfg
    print(f"{args.program}: {cfg.n_layers} layers x {cfg.n_heads} heads, d_model {cfg.d_model}, "
          f"{'causal' if cfg.causal else 'bidirectional'} -> {args.out} (true circuit: "
          f"{int(truth.nodes.true.sum())} components, {len(truth.edges)} edges)")
    if args.evaluate:
        write_discovery(Path(args.out), *evaluate_known(model, truth), args.program)
    return 0


def register(subparsers) -> None:
    parser = subparsers.add_parser("tracr", help="compile a RASP program of tracr.compiler.lib into a model "
                                                 "(needs the [tracr] extra)")
    parser.add_argument("program", choices=sorted(PROGRAMS), metavar="PROGRAM",
                        help=f"one of {', '.join(sorted(PROGRAMS))}")
    parser.add_argument("--vocab", default="a,b,c", help="comma-separated input tokens (default a,b,c; "
                                                         "integers where all are, as sort needs)")
    parser.add_argument("--max-seq-len", type=whole(1), default=5, help="longest input, start token excluded (default 5)")
    parser.add_argument("--causal", action="store_true", help="compile with causal attention (default: bidirectional)")
    parser.add_argument("--out", required=True, help="checkpoint directory to write")
    parser.add_argument("--evaluate", action="store_true",
                        help="also score circuit discovery against the true circuit now (discovery.csv, "
                             "discovery_curves.csv, faithfulness_vs_size.png in --out; `interp circuit --model OUT` "
                             "does the same later)")
    parser.add_argument("--prompts", type=whole(2), default=128,
                        help="the task's inputs, stored with the truth: at most this many (default 128; at least 2, "
                             "since a patching task pairs them)")
    parser.add_argument("--pairs", choices=PAIRINGS, default="every",
                        help="the task's (clean, corrupted) pairs: every ordered pair of two inputs (default; the "
                             "strongest corruption) or one seeded derangement")
    parser.add_argument("--ig-steps", type=whole(1), default=5, help="EAP-IG's steps in the stored task (default 5)")
    parser.add_argument("--seed", type=SEED, default=0)
    add_progress_args(parser)  # accepted as by every command; compiling and --evaluate have no long loops to show
    parser.set_defaults(func=run)
