"""The Tracr discovery table of docs/guides/tracr.md: every program of ``interp.tracr.PROGRAMS``
compiled with ``max_seq_len=5``, its inputs of length 4 (all, or a seeded ``--prompts`` of them:
by default 128, and 32 for ``shuffle_dyck2``, whose 128 would make 16,256 pairs), every ordered
pair of two of them as (clean, corrupted) (``task_pairs(every=True)``), every method scored
against the compiler's truth (``evaluate_discovery``), and the true components no patching can
see (``invisible_components``).

    python benchmarks/tracr_table.py --out /tmp/tracr_table   # one CPU core: OMP_NUM_THREADS=1
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pandas as pd
import torch

from analyses.circuits.circuit_eval import evaluate_discovery, invisible_components, program_inputs, task_pairs
from analyses.circuits.ground_truth import compile_with_graph, ground_truth
from interp.tracr import PROGRAMS, encode_inputs, from_tracr

SAMPLED = {"shuffle_dyck2": 32}  # inputs drawn where --prompts is not given (others: DEFAULT_PROMPTS)
DEFAULT_PROMPTS = 128
VOCABS = {"sort": [1, 2, 3], "pair_balance": list("()"), "shuffle_dyck": list("()"), "shuffle_dyck2": list("(){}")}
COLUMNS = {"patch": "patch", "mean_ablate": "mean abl.", "zero_ablate": "zero abl.", "path patching": "path patch.",
           "EAP": "EAP", "EAP-IG": "EAP-IG", "edge patching (all)": "edge patch. (all)", "EAP (all)": "EAP (all)",
           "EAP-IG (all)": "EAP-IG (all)"}


def measure(name: str, steps: int, prompts: int) -> tuple[pd.DataFrame, pd.DataFrame]:
    vocab = VOCABS.get(name, list("abc"))
    compilation = compile_with_graph(name, vocab, 5)
    model = from_tracr(compilation.assembled)
    nodes, edges = ground_truth(compilation, model)
    tokens = encode_inputs(model, program_inputs(vocab, 4, prompts, seed=0))
    clean, corrupted = task_pairs(tokens, every=True)
    start = time.perf_counter()
    scores, _ = evaluate_discovery(model, nodes, edges, clean, corrupted, steps=steps)
    print(f"{name}: {len(clean)} pairs, {time.perf_counter() - start:.1f} s", flush=True)
    hidden = invisible_components(model, tokens, nodes)
    return scores.assign(program=name, pairs=len(clean)), hidden[hidden.constant].assign(program=name)


def cell(row) -> str:
    if isinstance(row.note, str) and row.note.startswith("refused"):
        return "refused"
    if pd.isna(row.auc):
        return "–"
    text = f"{row.auc:.3g}"
    return text if row.bound == 1 else f"{text} (≤ {row.bound:.3g})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=None,
                        help=f"inputs per program at most (default {DEFAULT_PROMPTS}; {SAMPLED} where not given)")
    parser.add_argument("--programs", default=",".join(sorted(PROGRAMS)))
    args = parser.parse_args()
    torch.manual_seed(0)
    args.out.mkdir(parents=True, exist_ok=True)
    results = [measure(name, args.steps, args.prompts or SAMPLED.get(name, DEFAULT_PROMPTS))
               for name in args.programs.split(",")]
    scores = pd.concat([r[0] for r in results], ignore_index=True)
    hidden = pd.concat([r[1] for r in results], ignore_index=True)
    scores.to_csv(args.out / "scores.csv", index=False)
    hidden.to_csv(args.out / "invisible.csv", index=False)
    table = scores[scores.method.isin(COLUMNS)].assign(cell=lambda f: [cell(r) for r in f.itertuples()])
    table = table.pivot(index="program", columns="method", values="cell")[list(COLUMNS)].rename(columns=COLUMNS)
    circuit = scores[scores.level == "circuit"].pivot(index="program", columns="method", values="faithfulness")
    table["true circuit"] = circuit["true circuit"].map(lambda v: "undefined" if pd.isna(v) else f"{v:.3g}")
    table["complement"] = circuit["complement"].map(lambda v: "undefined" if pd.isna(v) else f"{v:.3g}")
    (args.out / "table.md").write_text(table.reset_index().to_markdown(index=False))
    print(table.reset_index().to_markdown(index=False))
    print(hidden[["program", "component", "op"]].to_markdown(index=False))


if __name__ == "__main__":
    main()
