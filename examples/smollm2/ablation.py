"""Ablation confirms the roles: SmolLM2's induction and previous-token heads, against random heads.

Heads are named on one set of probes (seed 0: score above 0.3 by ``classify_heads``) and ablated on
another (seed 1), so no head is chosen on the prompts that test it. The metric is the next-token
loss on the predictable tokens of the second copy (everything after its first token), in nats.
Random controls: as many heads drawn uniformly from the heads not named, 10 draws.

    python examples/smollm2/ablation.py
"""

from __future__ import annotations

import torch

from analyses import classify_heads, loss_metric
from analyses.interventions.ablation import prepare_ablation
from setup_smollm2 import head_name, load, probes

ABOVE = 0.3
N_DRAWS = 10


def named_heads(frame, role: str, above: float = ABOVE) -> list[tuple[int, int]]:
    rows = frame[(frame.measure == role) & (frame.score > above)].sort_values("score", ascending=False)
    return [(int(l), int(h)) for l, h in zip(rows["layer"], rows["head"])]


def random_sets(model, exclude: list[tuple[int, int]], size: int, n_draws: int, seed: int = 0):
    others = [(l, h) for l in range(model.cfg.n_layers) for h in range(model.cfg.n_heads) if (l, h) not in exclude]
    generator = torch.Generator().manual_seed(seed)
    return [[others[i] for i in torch.randperm(len(others), generator=generator)[:size].tolist()] for _ in range(n_draws)]


def zeroed_by_hand(model, tokens: torch.Tensor, heads, metric) -> float:
    """The same zero ablation with hand-written hooks on hook_z (batch, pos, head, d_head)."""
    def hook_for(layer):
        def zero(z, hook):
            z = z.clone()
            z[:, :, [h for l, h in heads if l == layer]] = 0
            return z
        return zero
    hooks = [(f"blocks.{l}.attn.hook_z", hook_for(l)) for l in sorted({l for l, _ in heads})]
    with torch.no_grad():
        return metric(model.run_with_hooks(tokens, fwd_hooks=hooks)).item()


def compare(model, test, heads, role: str, method: str, metric) -> None:
    ablation = prepare_ablation(model, test.tokens, method, metric)
    controls = random_sets(model, heads, len(heads), N_DRAWS)
    values = ablation.run([heads, *controls], progress=False)
    base = ablation.baseline
    named, random = values[0] - base, values[1:] - base
    print(f"{role} heads ({len(heads)}), {method} ablation: loss {base:.2f} -> {values[0]:.2f} nats (+{named:.2f}); "
          f"{len(heads)} random heads: +{random.mean():.2f} (sd {random.std():.2f}, min {random.min():.2f}, "
          f"max {random.max():.2f}) over {N_DRAWS} draws; ratio {named / random.mean():.1f}x")


def main() -> None:
    model = load()
    frame = classify_heads(model, probes=probes(model, seed=0), n_boot=10, progress=False)
    test = probes(model, seed=1)
    metric = loss_metric(test.tokens, positions=test.predictable)
    induction = named_heads(frame, "induction")
    previous = named_heads(frame, "previous_token")
    print("induction heads:", ", ".join(head_name(*h) for h in induction))
    print("previous-token heads:", ", ".join(head_name(*h) for h in previous))
    compare(model, test, induction, "induction", "zero", metric)
    compare(model, test, induction, "induction", "mean", metric)
    before = [h for h in previous if h[0] < min(l for l, _ in induction)]
    compare(model, test, before, "previous-token (below the first induction layer)", "mean", metric)
    print(f"check: zeroing the induction heads by hand-written hook_z hooks gives "
          f"{zeroed_by_hand(model, test.tokens, induction, metric):.4f} nats")


if __name__ == "__main__":
    main()
