"""Wang et al.'s completeness and minimality of SmolLM2's IOI circuit on the full graph.

The circuit is the one ``circuit_methods.py`` finds smallest by exact node patching: every edge
among the top-n heads and MLPs (ranked by ``node_patching`` on 24 prompts of the selection split of
200 ``ioi_task`` prompts, seed 0), the input and the logits, n the most whose circuit has at most
``--edges`` edges (6,116 by default: 5.0% of the 123,211, the smallest circuit whose full-graph
faithfulness has a lower bound >= 0.7). Wang et al.'s two checks (every edge outside a circuit
carries the ABC run's value; faithfulness normalised between the fully corrupted and the clean
model), each choosing its sets K of nodes on the first ``--search-prompts`` prompts of the selection
split (among those the ranking chose the circuit on) and reporting them, with 95% intervals from a
bootstrap over prompts, on ``--measure-prompts`` prompts of the measurement split:

- completeness (``analyses.completeness``): for sets K of the circuit's nodes, F(C\\K) - F(M\\K),
  the circuit and the whole model each with K's outgoing edges corrupted; a greedy K grown for
  ``--greedy`` steps by the largest |difference| on the selection prompts (every step's K reported),
  and ``--random`` random K (each node in with probability 1/2);
- minimality (``analyses.minimality``): per node v, the K of the circuit's other nodes that
  maximises |F(C\\K) - F(C\\(K + v))|, searched greedily from the empty set for
  ``--minimality-steps`` steps on the selection prompts; reported: F(C\\K) - F(C\\(K + v)) and its
  absolute value (Wang et al.'s score). 0 steps skips minimality (said so in the output).

Cost, in full-graph evaluations of one circuit on one prompt (about 0.09 s of CPU on one thread,
from benchmarks/README.md's timings of this script; the node ranking first takes about 6 CPU
minutes): the completeness search 2 x nodes x steps x search prompts, its report 2 x (steps +
random) x measure prompts; the minimality search about (1 + nodes^2 / 2) x search prompts for its
first step and up to 2 x nodes^2 per further step, its report 2 x nodes x measure prompts. With the 73-node circuit one
minimality step on 8 search prompts is about 21,000 evaluations (some 30 CPU minutes), the defaults
together about 45 CPU minutes with the ranking.

The model: the Q4_1 GGUF weights dequantised to float32, prompts without a start token.

    OMP_NUM_THREADS=1 python examples/smollm2/circuit_completeness.py
    OMP_NUM_THREADS=1 python examples/smollm2/circuit_completeness.py --search-prompts 4 --measure-prompts 8 \\
        --greedy 1 --random 2 --minimality-steps 0   # completeness only, a quick look
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from analyses.circuits.full_graph import (circuit_faithfulness, circuit_from_nodes, circuit_nodes, completeness,
                                          full_graph, minimality, node_name)
from analyses.circuits.full_graph_scores import NodeRanking, node_patching
from analyses.tasks.task import ioi_task, task_batch, task_metric, task_split
from setup_smollm2 import load


def prompts(model, task, indices):
    """The prompts ``indices`` of ``task`` -> (clean, corrupted, metric)."""
    chosen = task.subset(indices)
    batch = task_batch(model, chosen)
    return batch.clean, batch.corrupted, task_metric(chosen, batch.last)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--edges", type=int, default=6116, help="the circuit's most edges (circuit_methods.py's smallest)")
    parser.add_argument("--score-prompts", type=int, default=24, help="selection prompts node patching ranks on")
    parser.add_argument("--search-prompts", type=int, default=8, help="selection prompts the K searches run on")
    parser.add_argument("--measure-prompts", type=int, default=20, help="measurement prompts the K are reported on")
    parser.add_argument("--random", type=int, default=8, help="random K of completeness")
    parser.add_argument("--greedy", type=int, default=3, help="greedy steps of completeness (each: 2 x nodes evaluations)")
    parser.add_argument("--minimality-steps", type=int, default=1,
                        help="greedy steps of minimality's per-node K search (0: minimality skipped)")
    parser.add_argument("--memory-mb", type=float, default=2048)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    model = load()
    graph = full_graph(model)
    task = ioi_task(model, n=200, seed=0)
    split = task_split(task, seed=0)
    common = dict(memory_mb=args.memory_mb, progress=False)
    began = time.monotonic()
    ranking = NodeRanking.of(node_patching(model, *prompts(model, task, split.selection.tolist()[:args.score_prompts]),
                                           **common))
    sizes = [int(circuit_from_nodes(graph, ranking.nodes[:n]).sum()) for n in range(len(ranking.nodes) + 1)]
    n = max(i for i, size in enumerate(sizes) if size <= args.edges)
    circuit = circuit_from_nodes(graph, ranking.nodes[:n])
    search = prompts(model, task, split.selection.tolist()[:args.search_prompts])
    measure = prompts(model, task, split.measurement.tolist()[:args.measure_prompts])
    kept = circuit_faithfulness(model, *measure, [circuit], **common).iloc[0]
    nodes = circuit_nodes(graph, circuit)
    print(f"circuit: the top {n} nodes by exact node patching ({time.monotonic() - began:.0f} s), "
          f"{int(circuit.sum())} of {graph.n_edges} edges ({circuit.mean():.1%}); {len(nodes)} nodes send an edge: "
          f"{', '.join(node_name(v) for v in nodes)}")
    print(f"faithfulness on {int(kept.n_prompts)} measurement prompts: {kept.faithfulness:.3f} "
          f"[{kept.ci_low:.3f}, {kept.ci_high:.3f}]")

    report_completeness(model, search, measure, circuit, args, common)
    if args.minimality_steps > 0:
        report_minimality(model, search, measure, circuit, args, common)
    else:
        print("\n== minimality skipped (--minimality-steps 0)")


def report_completeness(model, search, measure, circuit, args, common) -> None:
    began = time.monotonic()
    complete = completeness(model, search, measure, circuit, greedy_steps=args.greedy, n_random=args.random,
                            **common)
    print(f"\n== completeness ({time.monotonic() - began:.0f} s): F(C\\K) - F(M\\K); K chosen on "
          f"{complete.attrs['n_selection']} selection prompts, measured on {int(complete.n_prompts.iloc[0])} "
          "measurement prompts")
    for row in complete.itertuples():
        chosen = f" (selection |difference| {row.selection_gap:.3f}); K = {row.removed}" if row.search == "greedy" else ""
        print(f"  {row.search} K of {row.size}: F(C\\K) {row.f_circuit:.3f}, F(M\\K) {row.f_model:.3f}, "
              f"difference {row.difference:+.3f} [{row.ci_low:+.3f}, {row.ci_high:+.3f}]{chosen}")
    randoms = complete[complete.search == "random"]
    if len(randoms):
        outside = int(((randoms.ci_low > 0) | (randoms.ci_high < 0)).sum())
        print(f"  random K: mean |difference| {randoms.gap.mean():.3f}, largest {randoms.gap.max():.3f}; "
              f"{outside} of {len(randoms)} intervals exclude 0")


def report_minimality(model, search, measure, circuit, args, common) -> None:
    began = time.monotonic()
    minimal = minimality(model, search, measure, circuit, greedy_steps=args.minimality_steps, **common)
    print(f"\n== minimality ({time.monotonic() - began:.0f} s): per node, F(C\\K) - F(C\\(K + v)) at the K "
          f"chosen on {minimal.attrs['n_selection']} selection prompts, measured on "
          f"{int(minimal.n_prompts.iloc[0])} measurement prompts")
    minimal = minimal.sort_values("score", ascending=False, ignore_index=True)
    needed = minimal[(minimal.ci_low > 0) | (minimal.ci_high < 0)]
    print(f"  {len(needed)} of {len(minimal)} nodes change F with their K, the interval excluding 0")
    for row in minimal.itertuples():
        print(f"  {row.node}: {row.difference:+.3f} [{row.ci_low:+.3f}, {row.ci_high:+.3f}] "
              f"(K = {row.removed or 'none'}; selection score {row.selection_score:.3f})")
    scores = minimal.score.to_numpy()
    print(f"  |scores|: median {np.median(scores):.3f}; nodes under 0.01: {int((scores < 0.01).sum())}")

if __name__ == "__main__":
    main()
