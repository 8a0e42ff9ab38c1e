"""Why removal and attribution disagree on SmolLM2's role heads: ``L11 MLP`` and the norm.

``qk_heads.py --check`` finds that removing ``L11 MLP`` from a role head's key input moves its
attention most, while its frozen-norm attribution is small. This script checks the cause with plain
hooks, not interp's check: the size of ``L11 MLP``'s part of the residual entering each head's layer
at position 0 and elsewhere (``decompose_residual``), and each head's attention on its role's target
and on position 0 with that part removed from its own key input (``blocks.L.hook_k_input``, the
per-head copy) at position 0 only, then at every other key only. Same 8 probes (64 tokens, seed 1)
and pairs as ``qk_heads.py``.

    OMP_NUM_THREADS=1 python examples/smollm2/qk_sink.py
"""

from __future__ import annotations

import torch

from analyses.circuits.edge_attribution import split_qkv_inputs
from analyses.circuits.qk_check import role_pairs
from analyses.components.decompose import decompose_residual
from setup_smollm2 import load, probes

HEADS = ((16, 0, "previous_token"), (14, 3, "duplicate_token"), (18, 6, "induction"))
COMPONENT = "L11 MLP"


def attention(model, tokens, layer, head, query, key, part=None, where=None) -> tuple[float, float]:
    """The head's mean attention (on the pairs' keys, on position 0), ``part`` (b, pos, d_model)
    subtracted from its own key input at the key positions ``where`` (pos,) 0/1."""
    def edit(copies, hook):  # (b, pos, head, d_model)
        copies[:, :, head] -= part * where[None, :, None]
        return copies

    hooks = [] if part is None else [(f"blocks.{layer}.hook_k_input", edit)]
    with split_qkv_inputs(model, ["k"]), model.hooks(fwd_hooks=hooks):
        _, cache = model.run_with_cache(tokens)
    pattern = cache[f"blocks.{layer}.attn.hook_pattern"][:, head]  # (b, q, k)
    rows = torch.arange(len(tokens))[:, None]
    return float(pattern[rows, query, key].mean()), float(pattern[rows, query, 0].mean())


def main() -> None:
    torch.set_grad_enabled(False)
    model = load()
    measure = probes(model, 8, 64, seed=1)
    for layer, head, role in HEADS:
        parts = decompose_residual(model, measure.tokens, layer=layer)
        part = parts.parts[parts.components["component"].tolist().index(COMPONENT)]  # (b, pos, d_model)
        resid = parts.parts.sum(0)
        if layer == HEADS[0][0]:
            print(f"{COMPONENT} in the residual entering layer {layer}: norm at position 0 "
                  f"{float(part[:, 0].norm(dim=-1).mean()):.0f} (residual {float(resid[:, 0].norm(dim=-1).mean()):.0f}), "
                  f"elsewhere {float(part[:, 1:].norm(dim=-1).mean()):.0f} (residual {float(resid[:, 1:].norm(dim=-1).mean()):.0f})")
        query, key = role_pairs(measure, role, 8)
        first = torch.zeros(measure.tokens.shape[1])
        first[0] = 1
        runs = {"clean": attention(model, measure.tokens, layer, head, query, key),
                "removed at position 0": attention(model, measure.tokens, layer, head, query, key, part, first),
                "removed at every other key": attention(model, measure.tokens, layer, head, query, key, part, 1 - first)}
        print(f"L{layer}H{head} ({role}): " + "; ".join(f"{name}: target {t:.2f}, position 0 {p:.2f}"
                                                      for name, (t, p) in runs.items()))


if __name__ == "__main__":
    main()
