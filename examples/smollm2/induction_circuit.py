"""Which previous-token heads feed SmolLM2's induction heads: K-composition by the weights, and
path patching through the induction heads' keys, measured as ``interp report``'s circuit measures it.

Heads: the report's rule (``ablation.report_roles``: calibrated nulls at a 5% false-discovery rate
and a score of at least 0.4) on 64 probes (seed 0); senders: every previous-token head it names,
receivers: every induction head it names (an edge only where the sender's layer is earlier).
Measured on 16 other probes (seed 1), as many as the report's intervention probes, on the report's
own pair and metric (``induction_pair``: the probes, and the same probes with the first copy of the
segment replaced by other tokens; the loss on the second copy's predictable tokens, in nats) and in
the report's direction, noising (``circuit_edges(..., direction="noise")``): the clean run with one
sender's write into one receiver's key input taken from the corrupted run, the other inputs clean;
the effect is the rise of the loss (positive: the copy needs that edge), with its 95% interval over
the probes. Each edge also carries its K-composition score minus the score of random matrices.

The report differs in what it chooses, not in how it measures an edge: its senders and receivers are
every head with a previous-token, duplicate-token or induction role (q, k, v and logits edges), its
roles come from the other rows of its own probe draw, and it path-patches exactly only the edges its
screen chooses.

    OMP_NUM_THREADS=1 python examples/smollm2/induction_circuit.py
"""

from __future__ import annotations

import torch

from analyses import circuit_edges
from analyses.circuits.circuit import induction_pair
from ablation import report_roles
from setup_smollm2 import head_name, load, probes

N_CHOOSE = 64
N_MEASURE = 16
SHOWN = 8


def edge_name(row) -> str:
    return f"{head_name(row.sender_layer, row.sender_head)} -> {head_name(row.receiver_layer, row.receiver_head)}.k"


def main() -> None:
    torch.set_grad_enabled(False)
    model = load()
    named = report_roles(model, probes(model, n_prompts=N_CHOOSE, seed=0))
    receivers, senders = named["induction"], named["previous_token"]
    print(f"chosen on {N_CHOOSE} probes (seed 0) by the report's rule")
    print("senders (previous-token):", ", ".join(head_name(*h) for h in senders))
    print("receivers (induction):", ", ".join(head_name(*h) for h in receivers))

    test = probes(model, n_prompts=N_MEASURE, seed=1)
    clean, corrupted, metric = induction_pair(test, seed=0)
    with torch.no_grad():
        clean_loss, broken_loss = metric(model(clean)).item(), metric(model(corrupted)).item()
    print(f"{N_MEASURE} probes (seed 1), copy loss: clean {clean_loss:.2f} nats, first copy replaced {broken_loss:.2f}")
    edges = circuit_edges(model, clean, corrupted, metric, senders=senders, receivers=receivers, via="k",
                          direction="noise", progress=False)
    print(f"path patching by noising through the key ({len(edges)} edges), largest loss rises "
          "(95% interval over the probes; K-composition minus random):")
    for row in edges.sort_values("effect", ascending=False).head(SHOWN).itertuples():
        print(f"  {edge_name(row)} {row.effect:+.3f} [{row.ci_low:+.3f}, {row.ci_high:+.3f}] nats, "
              f"composition {row.composition_minus_baseline:+.3f}")
    print("K-composition minus random, strongest pairs:")
    for row in edges.sort_values("composition_minus_baseline", ascending=False).head(SHOWN).itertuples():
        print(f"  {edge_name(row)} {row.composition_minus_baseline:+.3f} (score {row.composition:.3f}), "
              f"path patching {row.effect:+.3f} [{row.ci_low:+.3f}, {row.ci_high:+.3f}]")


if __name__ == "__main__":
    main()
