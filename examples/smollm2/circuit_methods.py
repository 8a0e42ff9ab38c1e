"""EAP, EAP-IG and exact patching compared as Hanna et al. (2024) compare them, on SmolLM2's IOI and
greater-than: the full-graph faithfulness of the circuits each ranking finds, over circuit sizes.

Per task, the prompts are split by ``task_split`` (stratified by template). On the selection half:
EAP and EAP-IG (5 points, Hanna et al.'s inputs variant) score every edge of the full graph
(123,211 edges: the input, 270 heads and 30 MLPs into every later head's q/k/v input, every later MLP
and the logits; ``full_graph_edge_scores``), and exact patching removes each of the 300 heads and MLPs
from the full circuit in turn (``node_patching``: the node's output from the corrupted run, noising).
On the measurement half: each ranking's circuits at the chosen fractions of the graph's edges (EAP,
EAP-IG: the top-k edges by |score|; exact: every edge among the top-n nodes, n the most that fit) with
every other edge corrupted (``compare_circuit_methods``), faithfulness with its 95% interval over
prompts, MIB's CPR and CMD, the smallest circuit whose interval's lower bound reaches 0.7, and each two
methods' faithfulness at each fraction compared by the interval of their paired difference
(``attrs["paired"]``).

Metrics (``task_metric``): IOI logit(IO) - logit(S) at the last token, the corruption three other
names in the same template; greater-than the probability difference sum p(digit > D) - sum p(digit
<= D) for the decade digit D (SmolLM2 writes years digit by digit), the corruption decade 0.

    python examples/smollm2/circuit_methods.py     # both tasks as the guide: 200 prompts each, ranked on 24
                                                   # of the selection split, evaluated on the 100 of the
                                                   # measurement split (about 26 min on one CPU thread)
    python examples/smollm2/circuit_methods.py --task ioi --prompts 40 --fractions 0.01 0.1 1
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pandas as pd
import torch

from analyses.circuits.full_graph import MIB_FRACTIONS
from analyses.circuits.full_graph_scores import (IG_STEPS, EdgeRanking, NodeRanking, compare_circuit_methods,
                                                 full_graph_edge_scores, method_comparison_figure, node_patching)
from analyses.tasks.task import greater_than_task, ioi_task, task_batch, task_metric, task_split
from setup_smollm2 import load

DOCS = Path(__file__).resolve().parents[2] / "docs"
TASKS = {"ioi": ioi_task, "greater-than": greater_than_task}


def half(model, task, indices, cap: int | None):
    """The prompts ``indices`` of ``task`` (the first ``cap`` of them) -> (tokens clean, corrupted, metric, n)."""
    chosen = task.subset(indices[:cap] if cap else indices)
    batch = task_batch(model, chosen)
    return batch.clean, batch.corrupted, task_metric(chosen, batch.last), len(chosen)


def run_task(model, name: str, args) -> pd.DataFrame:
    task = TASKS[name](model, n=args.prompts, seed=0)
    split = task_split(task, seed=0)
    *select, n_select = half(model, task, split.selection.tolist(), args.score_prompts)
    *measure, n_measure = half(model, task, split.measurement.tolist(), args.measure_prompts)
    print(f"\n== {name}: {len(task)} prompts, ranked on {n_select} (selection split), evaluated on {n_measure} "
          f"(measurement split); {task.note or 'no change for this tokenizer'}")
    started = time.time()
    common = dict(memory_mb=args.memory_mb, progress=False)
    nodes = node_patching(model, *select, **common)
    eap = full_graph_edge_scores(model, *select, **common)
    eap_ig = full_graph_edge_scores(model, *select, steps=args.steps, **common)
    print(f"rankings in {time.time() - started:.0f} s; exact patching's top nodes (effect of removing each, "
          "selection split): " + ", ".join(f"{r.node} {r.effect:+.2f}" for r in nodes.head(8).itertuples()))
    for method, frame in (("EAP", eap), ("EAP-IG", eap_ig)):
        top = frame.reindex(frame.score.abs().sort_values(ascending=False).index).head(5)
        print(f"  {method} top edges: " + ", ".join(
            f"{row.sender_kind}{'' if row.sender_layer < 0 else row.sender_layer}"
            f"{'' if row.sender_head < 0 else 'H' + str(row.sender_head)}->{row.receiver_kind}"
            f"{'' if row.receiver_kind == 'logits' else row.receiver_layer}"
            f"{'' if row.receiver_head < 0 else 'H' + str(row.receiver_head)}.{row.via} {row.score:+.3f}"
            for row in top.itertuples()))
    rankings = {"exact": NodeRanking.of(nodes), "EAP": EdgeRanking(eap.score.to_numpy()),
                "EAP-IG": EdgeRanking(eap_ig.score.to_numpy())}
    started = time.time()
    frame = compare_circuit_methods(model, *measure, rankings, args.fractions, threshold=args.threshold,
                                    refine=args.refine, **common)
    print(f"evaluated in {time.time() - started:.0f} s; measurement split: clean {frame.attrs['full']:.3f}, "
          f"corrupted {frame.attrs['empty']:.3f}; {frame.attrs['graph_edges']} edges")
    print(frame.drop(columns=["value"]).to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    summary = frame.attrs["summary"]
    print(summary.to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    print("each two methods at each fraction: a's faithfulness minus b's, with the 95% interval of that paired "
          "difference (the same resamples of the measurement prompts)")
    print(frame.attrs["paired"].to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    path = args.figure_dir / f"smollm2_circuit_methods_{name}.png"
    method_comparison_figure(frame, title=f"SmolLM2-135M {name}: full-graph faithfulness\n"
                                          f"({n_measure} held-out prompts)").savefig(path, dpi=110)
    print(f"figure: {path}")
    return summary.assign(task=name, n_select=n_select)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=[*TASKS, "both"], default="both")
    parser.add_argument("--prompts", type=int, default=200, help="prompts per task, split half and half")
    parser.add_argument("--score-prompts", type=int, default=24, help="selection prompts the rankings use (cost)")
    parser.add_argument("--measure-prompts", type=int, default=None, help="measurement prompts evaluated (all)")
    parser.add_argument("--steps", type=int, default=IG_STEPS, help="EAP-IG's points")
    parser.add_argument("--fractions", type=float, nargs="+", default=list(MIB_FRACTIONS))
    parser.add_argument("--refine", type=int, default=2, help="extra sizes before the first circuit that passes")
    parser.add_argument("--threshold", type=float, default=0.7)
    parser.add_argument("--memory-mb", type=float, default=2048)
    parser.add_argument("--figure-dir", type=Path, default=DOCS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = load()
    names = list(TASKS) if args.task == "both" else [args.task]
    summaries = pd.concat([run_task(model, name, args) for name in names], ignore_index=True)
    print("\n== summary")
    print(summaries.to_string(index=False, float_format=lambda v: f"{v:.4g}"))


if __name__ == "__main__":
    main()
