"""Which previous-token heads feed SmolLM2's induction heads: K-composition by the weights, and
path patching through the induction heads' keys.

Senders: the five strongest previous-token heads below the first induction layer; receivers: the
four strongest induction heads (both named on 64 probes of seed 0 by the report's own rule,
``ablation.report_roles``; measured on other probes, seed 1). Path patching runs the
probes with the first copy of the segment replaced by other tokens (nothing to copy) and adds
one sender's clean write to one receiver's key input alone; the effect is the change in the
loss on the second copy's predictable tokens (nats; negative = the copy comes back).

    python examples/smollm2/induction_circuit.py
"""

from __future__ import annotations

import torch

from analyses import composition_scores, loss_metric, path_patch
from analyses.core.probes import corrupt_first_copy
from ablation import report_roles
from setup_smollm2 import head_name, load, probes

N_RECEIVERS = 4
N_SENDERS = 5


def main() -> None:
    model = load()
    named = report_roles(model, probes(model, n_prompts=64, seed=0))
    induction = named["induction"][:N_RECEIVERS]
    senders = [h for h in named["previous_token"] if h[0] < min(l for l, _ in induction)][:N_SENDERS]
    print("senders (previous-token):", ", ".join(map(lambda h: head_name(*h), senders)))
    print("receivers (induction):", ", ".join(map(lambda h: head_name(*h), induction)))

    weights = composition_scores(model, "k", senders=senders, receivers=induction, progress=False)
    weights = weights[[(l, h) in senders and (rl, rh) in induction for l, h, rl, rh in
                       weights[["sender_layer", "sender_head", "receiver_layer", "receiver_head"]].to_numpy()]]
    print("K-composition (score minus its random baseline), strongest pairs:")
    for row in weights.sort_values("score_minus_baseline", ascending=False).head(6).itertuples():
        print(f"  {head_name(row.sender_layer, row.sender_head)} -> {head_name(row.receiver_layer, row.receiver_head)}"
              f" {row.score_minus_baseline:+.3f} (score {row.score:.3f})")

    test = probes(model, n_prompts=4, seed=1)
    corrupted = corrupt_first_copy(test)
    metric = loss_metric(test.tokens, positions=test.predictable)
    with torch.no_grad():
        clean, broken = metric(model(test.tokens)).item(), metric(model(corrupted)).item()
    print(f"copy loss: clean {clean:.2f} nats, first copy replaced {broken:.2f}")
    edges = path_patch(model, test.tokens, corrupted, metric, senders=senders, receivers=induction, via="k",
                       progress=False)
    edges = edges[edges["receiver_head"] >= 0].sort_values("effect")
    print("path patching through the key, largest loss drops:")
    for row in edges.head(6).itertuples():
        print(f"  {head_name(row.sender_layer, row.sender_head)} -> {head_name(row.receiver_layer, row.receiver_head)}.k"
              f" {row.effect:+.3f} nats")


if __name__ == "__main__":
    main()
