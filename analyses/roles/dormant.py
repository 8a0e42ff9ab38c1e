"""Dormant heads and redundancy (architecture §4.7).

A head can attend in a striking pattern and still write almost nothing: attention-sink scores
miss such heads (Sanyal et al. 2025, "dormant attention heads"), so a head is judged by what it
writes and by what ablating it does:

- **output norm**: the mean over prompts and positions of ``|z_h W_O[h]|``, the norm of the head's
  own write to the residual stream; ``relative_norm`` divides it by the mean over the heads of its
  layer (1 = a typical head of the layer);
- **ablation no-op**: the 95% interval over prompts of the metric's change when the head is
  mean-ablated covers 0 (its effect is not told apart from none: "no detectable effect", as the head
  table decides it);
- **dormant**: both, a relative norm below ``dormant_below`` and a no-op ablation.

Redundancy: every pair of heads compared by the cosine similarity of their outputs (``z_h W_O[h]``
over all prompts and positions, flattened) and of their patterns (flattened over prompts,
queries and keys), ordered by average-linkage agglomerative clustering, with flat clusters at a
similarity cut.
"""

from __future__ import annotations

from dataclasses import dataclass

import einops
import pandas as pd
import torch

from analyses.interventions.ablation import ablation_sweep
from analyses.core.execution import executing
from analyses.roles.classify import no_effect_labels, NO_EFFECT
from analyses.core.hook_names import pattern_names, z_names
from analyses.interventions.engine import cache_run
from analyses.core.metrics import Metric
from analyses.core.probes import RepeatedProbes
from analyses.interventions.run import Run
from interp.errors import UserError

DORMANT_BELOW = 0.1  # relative output norm under which (with a no-op ablation) a head is dormant
SIMILAR_ABOVE = 0.5  # cosine similarity that joins two heads into one flat cluster (average linkage)


def output_projection(model, layer: int) -> torch.Tensor:
    """``blocks.{layer}.attn.W_O`` (head, d_head, d_model); a one-line refusal where the model does
    not expose it (see ``interp check``: heads + b_O = hook_attn_out)."""
    try:
        w_o = model.blocks[layer].attn.W_O
    except (AttributeError, TypeError, RuntimeError):
        w_o = None
    if w_o is None or tuple(w_o.shape[:2]) != (model.cfg.n_heads, model.cfg.d_head):
        raise UserError("head output norms need the output projection blocks.L.attn.W_O (head, d_head, d_model), "
                        "which this model does not expose; see `interp check`")
    return w_o.detach()


def head_outputs(model, layer: int, z: torch.Tensor) -> torch.Tensor:
    """Each head's write to the residual stream, (batch, pos, head, d_model), from its ``hook_z``
    z (batch, pos, head, d_head)."""
    w_o = output_projection(model, layer)
    return einops.einsum(z, w_o.to(z.dtype), "b p h d, h d m -> b p h m")


def output_norms(model, tokens: torch.Tensor, run: Run | None = None) -> pd.DataFrame:
    """One row per head: ``layer, head, output_norm`` (mean |z_h W_O[h]| over prompts and
    positions) and ``relative_norm`` (over the mean of its layer's heads). tokens: (batch, pos);
    run: a ``Run`` of them whose ``hook_z`` serve instead of a forward."""
    if run is not None:
        run.check_tokens(tokens)
        cache = run.read(z_names(model))
    else:
        _, cache = cache_run(model, tokens, z_names(model), logits=False)
    norms = torch.stack([head_outputs(model, layer, cache[name]).norm(dim=-1).mean((0, 1))
                         for layer, name in enumerate(z_names(model))]).cpu().double()  # (layer, head)
    relative = norms / norms.mean(dim=1, keepdim=True).clamp(min=1e-30)
    n_layers, n_heads = norms.shape
    return pd.DataFrame({
        "layer": [l for l in range(n_layers) for _ in range(n_heads)],
        "head": [h for _ in range(n_layers) for h in range(n_heads)],
        "output_norm": norms.flatten().cpu().numpy(), "relative_norm": relative.flatten().cpu().numpy(),
    })


def dormant_heads(model, prompts, method: str = "mean", metric: Metric | None = None, *,
                  dormant_below: float = DORMANT_BELOW, memory_mb: float | None = None, progress: bool | None = None) -> pd.DataFrame:
    """Output norms and the ablation no-op test of every head (one ablation sweep; see
    ``dormant_frame`` to reuse effects already measured).

    prompts: ids (batch, pos) or ``RepeatedProbes``; metric: default the mean next-token loss;
    ``memory_mb``, ``progress``: the execution's (``analyses.core.execution``; None: the current one's).
    """
    with executing(memory_mb, progress):
        sweep = ablation_sweep(model, prompts, "each_head", method, metric)
    tokens = prompts.tokens if isinstance(prompts, RepeatedProbes) else prompts
    return dormant_frame(model, tokens, sweep["effect"].to_numpy(), sweep["ci_low"].to_numpy(),
                         sweep["ci_high"].to_numpy(), dormant_below=dormant_below)


def dormant_frame(model, tokens: torch.Tensor, effects, ci_low, ci_high, *, dormant_below: float = DORMANT_BELOW,
                  run: Run | None = None) -> pd.DataFrame:
    """Each head's output norm on ``tokens`` (batch, pos) beside its ablation effect ``effects`` and
    its 95% interval over prompts ``ci_low``, ``ci_high`` (each n_layers * n_heads, layer-major, in nats).

    Returns one row per head: ``layer, head, output_norm, relative_norm, ablation_effect,
    ablation_ci_low, ablation_ci_high``, ``no_op`` (the interval covers 0:
    ``analyses.roles.classify.no_effect_labels``) and ``dormant`` (no_op and relative_norm <
    dormant_below). run: see ``output_norms``.
    """
    frame = output_norms(model, tokens, run)
    frame["ablation_effect"], frame["ablation_ci_low"], frame["ablation_ci_high"] = effects, ci_low, ci_high
    frame["no_op"] = no_effect_labels(frame["ablation_ci_low"], frame["ablation_ci_high"]) == NO_EFFECT
    frame["dormant"] = frame["no_op"] & (frame["relative_norm"] < dormant_below)
    return frame


@dataclass
class Similarity:
    """Pairwise cosine similarity of heads, in cluster order.

    labels: head labels ``L{l}H{h}`` in cluster order; matrix: (n, n) similarity in that order;
    clusters: the flat cluster (0..) of each label."""

    labels: list[str]
    matrix: torch.Tensor
    clusters: list[int]

    def frame(self) -> pd.DataFrame:
        """One row per head: ``label, order, cluster``."""
        return pd.DataFrame({"label": self.labels, "order": range(len(self.labels)), "cluster": self.clusters})


def similarity_reads(model) -> list[str]:
    """The hooks ``head_similarities`` reads: every ``hook_z`` and every ``hook_pattern``."""
    return [*z_names(model), *pattern_names(model)]


def head_similarities(model, tokens: torch.Tensor, *, similar_above: float = SIMILAR_ABOVE,
                      cache: dict | None = None) -> dict[str, Similarity]:
    """Cosine similarity of every pair of heads' outputs (``z_h W_O[h]``) and patterns on ``tokens``
    (batch, pos), each clustered -> {"output": ..., "pattern": ...}. The Gram matrices are summed
    prompt by prompt, so memory holds one prompt's head outputs at a time. ``cache``: the
    ``similarity_reads`` activations of ``tokens`` already run (each (batch, ...)), instead of a forward."""
    if cache is None:
        _, cache = cache_run(model, tokens, similarity_reads(model), logits=False)
    n = model.cfg.n_layers * model.cfg.n_heads
    grams = {"output": torch.zeros(n, n, dtype=torch.double), "pattern": torch.zeros(n, n, dtype=torch.double)}
    for row in range(tokens.shape[0]):
        outputs = torch.cat([einops.rearrange(head_outputs(model, layer, cache[name][row:row + 1]), "b p h m -> h (b p m)")
                             for layer, name in enumerate(z_names(model))]).cpu().double()
        patterns = torch.cat([einops.rearrange(cache[name][row], "h q k -> h (q k)")
                              for name in pattern_names(model)]).cpu().double()
        grams["output"] += outputs @ outputs.T
        grams["pattern"] += patterns @ patterns.T
    labels = [f"L{l}H{h}" for l in range(model.cfg.n_layers) for h in range(model.cfg.n_heads)]
    return {kind: clustered(cosine_from_gram(gram), labels, similar_above) for kind, gram in grams.items()}


def cosine_from_gram(gram: torch.Tensor) -> torch.Tensor:
    """Gram matrix (n, n) of n vectors -> their cosine similarity; a zero vector is similar to
    nothing (0)."""
    norms = gram.diagonal().sqrt()
    return gram / (norms[:, None] * norms[None, :]).clamp(min=1e-300)


def clustered(similarity: torch.Tensor, labels: list[str], similar_above: float) -> Similarity:
    """Average-linkage agglomerative clustering of ``similarity`` (n, n) on distance 1 - similarity.

    The leaf order of the full dendrogram orders the heads; the flat clusters are those formed
    while the merged clusters' average similarity is at least ``similar_above``."""
    n = similarity.shape[0]
    distance = (1 - similarity).clone()
    distance.fill_diagonal_(torch.inf)
    members = {i: [i] for i in range(n)}
    flat = None
    while len(members) > 1:
        a, b = divmod(int(distance.argmin()), n)
        if flat is None and distance[a, b] > 1 - similar_above:
            flat = [list(group) for group in members.values()]
        size_a, size_b = len(members[a]), len(members[b])
        merged = (size_a * distance[a] + size_b * distance[b]) / (size_a + size_b)  # Lance-Williams, average
        distance[a], distance[:, a] = merged, merged
        distance[a, a] = torch.inf
        distance[b], distance[:, b] = torch.inf, torch.inf
        members[a] = members[a] + members.pop(b)
    order = next(iter(members.values()))
    flat = flat if flat is not None else [order]
    position = {head: rank for rank, head in enumerate(order)}
    groups = sorted(flat, key=lambda g: min(position[i] for i in g))
    cluster_of = {i: c for c, group in enumerate(groups) for i in group}
    return Similarity([labels[i] for i in order], similarity[order][:, order], [cluster_of[i] for i in order])
