"""Wang et al.'s completeness and minimality of SmolLM2's IOI circuit on the full graph.

The circuit is the one ``circuit_methods.py`` finds smallest by exact node patching: every edge
among the top-n heads and MLPs (ranked by ``node_patching`` on 24 prompts of the selection split of
200 ``ioi_task`` prompts, seed 0), the input and the logits, n the most whose circuit has at most
``--edges`` edges (6,116 by default: 5.0% of the 123,211, the smallest circuit whose full-graph
faithfulness has a lower bound >= 0.7). On prompts of the measurement split (every edge outside a
circuit carries the ABC run's value; faithfulness normalised between the fully corrupted and the
clean model; 95% intervals from a bootstrap over prompts):

- completeness (``analyses.completeness``): for sets K of the circuit's nodes, F(C\\K) - F(M\\K),
  the circuit and the whole model each with K's outgoing edges corrupted; random K (each node in
  with probability 1/2) and a greedy K grown one node at a time by the largest |difference|;
- minimality (``analyses.minimality``): per node v, F(C\\K) - F(C\\(K + v)) for the K among the empty
  set and random subsets that makes it largest.

Each full-graph evaluation of one circuit costs about 0.8 s per prompt on one thread (40 s for 50
prompts on a loaded machine), so the defaults are small: 20 prompts, 8 random K, one greedy step (it
costs two evaluations per node), and minimality with K empty (F(C) - F(C\\v) per node); together
about 230 evaluations (13 CPU minutes with the ranking, 16 of wall clock on a shared machine).

The model: the Q4_1 GGUF weights dequantised to float32, prompts without a start token.

    OMP_NUM_THREADS=1 python examples/smollm2/circuit_completeness.py
    OMP_NUM_THREADS=1 python examples/smollm2/circuit_completeness.py --measure-prompts 8 --random 2   # a quick look
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
    parser.add_argument("--measure-prompts", type=int, default=20, help="measurement prompts evaluated on")
    parser.add_argument("--random", type=int, default=8, help="random K of completeness")
    parser.add_argument("--greedy", type=int, default=1, help="greedy steps of completeness (each: 2 x nodes evaluations)")
    parser.add_argument("--minimality-random", type=int, default=0, help="random K per node of minimality (0: K empty)")
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
    measure = prompts(model, task, split.measurement.tolist()[:args.measure_prompts])
    kept = circuit_faithfulness(model, *measure, [circuit], **common).iloc[0]
    nodes = circuit_nodes(graph, circuit)
    print(f"circuit: the top {n} nodes by exact node patching ({time.monotonic() - began:.0f} s), "
          f"{int(circuit.sum())} of {graph.n_edges} edges ({circuit.mean():.1%}); {len(nodes)} nodes send an edge: "
          f"{', '.join(node_name(v) for v in nodes)}")
    print(f"faithfulness on {int(kept.n_prompts)} measurement prompts: {kept.faithfulness:.3f} "
          f"[{kept.ci_low:.3f}, {kept.ci_high:.3f}]")

    began = time.monotonic()
    complete = completeness(model, *measure, circuit, n_random=args.random, greedy_steps=args.greedy, **common)
    print(f"\n== completeness ({time.monotonic() - began:.0f} s): F(C\\K) - F(M\\K)")
    for row in complete.itertuples():
        print(f"  {row.search} K of {row.size}: F(C\\K) {row.f_circuit:.3f}, F(M\\K) {row.f_model:.3f}, "
              f"difference {row.difference:+.3f} [{row.ci_low:+.3f}, {row.ci_high:+.3f}]" + (f"; K = {row.removed}" if row.search == "greedy" else ""))
    randoms = complete[complete.search == "random"]
    if len(randoms):
        outside = int(((randoms.ci_low > 0) | (randoms.ci_high < 0)).sum())
        print(f"  random K: mean |difference| {randoms.gap.mean():.3f}, largest {randoms.gap.max():.3f}; "
              f"{outside} of {len(randoms)} intervals exclude 0")

    began = time.monotonic()
    minimal = minimality(model, *measure, circuit, n_random=args.minimality_random, **common)
    print(f"\n== minimality ({time.monotonic() - began:.0f} s): per node, F(C\\K) - F(C\\(K + v)) at its best K")
    minimal = minimal.sort_values("score", ascending=False, ignore_index=True)
    held = minimal[minimal.ci_low > 0]
    print(f"  {len(held)} of {len(minimal)} nodes have a K whose removal with them lowers F, the interval above 0")
    for row in minimal.itertuples():
        print(f"  {row.node}: {row.score:+.3f} [{row.ci_low:+.3f}, {row.ci_high:+.3f}] (K of {row.size})")
    scores = minimal.score.to_numpy()
    print(f"  scores: median {np.median(scores):+.3f}; nodes under 0.01: {int((scores < 0.01).sum())}")


if __name__ == "__main__":
    main()
