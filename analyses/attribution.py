"""Attribution patching (Nanda 2023; Syed et al. 2023): exact patching linearised.

Patching head h moves its output from ``z`` (the run being patched) to ``z'`` (the other run);
to first order the metric becomes ``M + sum(dM/dz * (z' - z))`` over prompts, positions and
d_head. One forward caching the other run, one forward and one backward (gradients wrt the
activations only) on the patched run give every head: about three forward-equivalents, instead
of one (suffix) forward per head. Values use exact patching's convention (the patched metric),
so the two compare cell for cell; how well they agree is measured, never assumed.
"""

from __future__ import annotations

import pandas as pd
import torch
from einops import einsum

from analyses.budget import DEFAULT_MEMORY_MB
from analyses.hook_names import z_names
from analyses.interventions import cache_run
from analyses.metrics import Metric, evaluate_metric
from analyses.patching import base_and_source, normalize_values, patch_specific_heads, prepare
from interp.errors import UserError


def metric_gradients(model, tokens: torch.Tensor, metric: Metric) -> tuple[float, list, list]:
    """One forward and backward -> (metric value, z per layer, dmetric/dz per layer); each z and
    gradient is (batch, pos, head, d_head). Only activation gradients are computed (no weight grads)."""
    kept = {}

    def start_graph(embed, hook):  # a graph even when the weights do not require grad
        return embed.detach().requires_grad_(True)

    def keeper(name):
        def keep(z, hook):  # hook.name may be the backend's own alias, so the name is bound here
            kept[name] = z.view_as(z)  # returned, so this very tensor is what the model uses next
            return kept[name]

        return keep

    names = z_names(model)
    hooks = [("hook_embed", start_graph)] + [(name, keeper(name)) for name in names]
    with torch.enable_grad():
        value = evaluate_metric(metric, model.run_with_hooks(tokens, fwd_hooks=hooks))
        grads = torch.autograd.grad(value, [kept[name] for name in names])
    return value.item(), [kept[name].detach() for name in names], list(grads)


def linear_effects(grads: list, z: list, z_target: list, keep: str = "p h") -> torch.Tensor:
    """First-order change of the metric moving each head's z to ``z_target`` (each per layer,
    (batch, pos, head, d_head)), summed over every axis not in ``keep`` -> [n_layers, *keep],
    e.g. ``keep="p h"`` -> [n_layers, pos, n_heads]."""
    return torch.stack([
        einsum(g, target - current, f"b p h d, b p h d -> {keep}") for g, current, target in zip(grads, z, z_target)
    ])


def attribution_patch_heads(
    model,
    clean_tokens,
    corrupted_tokens,
    metric: Metric,
    *,
    by_position: bool = False,
    direction: str = "denoise",
    normalize: bool = False,
) -> torch.Tensor:
    """Estimated ``patch_heads``: [n_layers, n_heads] or with ``by_position`` [n_layers, pos, n_heads].
    ``normalize`` rescales to 0 = corrupted, 1 = clean as in ``patch_heads(normalize=True)``."""
    base, source = base_and_source(model, clean_tokens, corrupted_tokens, direction)
    names = z_names(model)
    source_logits, source_cache = cache_run(model, source, names, logits=normalize)  # logits: normalising only
    value, z, grads = metric_gradients(model, base, metric)
    effects = linear_effects(grads, z, [source_cache[name] for name in names])
    estimate = value + (effects if by_position else effects.sum(dim=1))
    if not normalize:
        return estimate
    source_value = evaluate_metric(metric, source_logits).item()
    clean_value, corrupted_value = (source_value, value) if direction == "denoise" else (value, source_value)
    return normalize_values(estimate, clean_value, corrupted_value)


def attribution_agreement(attributed: torch.Tensor, exact: torch.Tensor, top_k: int = 10) -> dict[str, float]:
    """How well attribution matches exact patching (same shape): Pearson and Spearman correlation
    of the cells, the largest absolute error, and the share of exact's ``top_k`` cells (by distance
    from the median cell, i.e. effect size) that attribution also puts in its top k."""
    if attributed.shape != exact.shape:
        raise UserError(f"shapes differ: attribution {tuple(attributed.shape)} vs exact {tuple(exact.shape)}")
    a = pd.Series(attributed.detach().flatten().cpu().double().numpy())
    e = pd.Series(exact.detach().flatten().cpu().double().numpy())
    k = min(top_k, len(e))
    top = lambda s: set((s - s.median()).abs().nlargest(k).index)  # noqa: E731
    return {
        "pearson": float(a.corr(e)),
        "spearman": float(a.rank().corr(e.rank())),
        "max_abs_error": float((a - e).abs().max()),
        f"top{k}_overlap": len(top(a) & top(e)) / k,
    }


def shortlist_patch_heads(
    model,
    clean_tokens,
    corrupted_tokens,
    metric: Metric,
    k: int = 10,
    *,
    direction: str = "denoise",
    normalize: bool = False,
    memory_mb: float = DEFAULT_MEMORY_MB,
    progress: bool = True,
) -> pd.DataFrame:
    """Attribution ranks every head; exact patching confirms the ``k`` with the largest estimated effect.

    Returns one row per head, by rank: ``rank, layer, head, attribution`` (estimated patched
    metric), ``value`` (exact where ``exact`` is True, else the attribution estimate), ``exact``.
    Costs about 3 forwards + the exact patches of k heads (suffix forwards on GPTModel).
    """
    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
    if not 0 <= k <= n_layers * n_heads:
        raise UserError(f"k={k} out of range [0, {n_layers * n_heads}] (the model has that many heads)")
    names = z_names(model)
    setup = prepare(model, clean_tokens, corrupted_tokens, metric, names, direction)
    value, z, grads = metric_gradients(model, setup.base, metric)
    estimate = value + linear_effects(grads, z, [setup.sources[name] for name in names]).sum(dim=1).cpu()
    order = (estimate - value).abs().flatten().argsort(descending=True, stable=True)
    heads = [divmod(int(i), n_heads) for i in order]
    frame = pd.DataFrame(heads, columns=["layer", "head"])
    frame.insert(0, "rank", range(len(frame)))
    frame["attribution"] = estimate.flatten()[order].numpy()
    exact = patch_specific_heads(model, setup, metric, heads[:k], memory_mb=memory_mb, progress=progress)
    frame["value"] = torch.cat([exact, estimate.flatten()[order][k:]]).numpy()
    frame["exact"] = frame["rank"] < k
    if normalize:
        for column in ("attribution", "value"):
            frame[column] = setup.normalize(torch.tensor(frame[column].to_numpy())).numpy()
    return frame
