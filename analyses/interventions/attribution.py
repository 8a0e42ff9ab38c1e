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

from analyses.core.budget import DEFAULT_MEMORY_MB
from analyses.core.hook_check import require_edit
from analyses.core.hook_names import z_names
from analyses.interventions.engine import activation_gradients, cache_run, linear_effects, metric_gradients
from analyses.core.metrics import Metric, evaluate_metric
from analyses.interventions.patching import base_and_source, mlp_out_names, patch_specific_heads, prepare
from analyses.interventions.run import Options, normalize_values
from interp.errors import UserError


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
    require_edit(model, "hook_z", "attribution_patch_heads")
    return _attribution(model, clean_tokens, corrupted_tokens, metric, z_names(model), lambda act: act,
                        by_position=by_position, direction=direction, normalize=normalize)


def attribution_patch_mlps(
    model,
    clean_tokens,
    corrupted_tokens,
    metric: Metric,
    *,
    by_position: bool = False,
    direction: str = "denoise",
    normalize: bool = False,
) -> torch.Tensor:
    """Estimated ``patch_mlps``: [n_layers] or with ``by_position`` [n_layers, pos] (each MLP's
    ``hook_mlp_out`` linearised as a head's ``hook_z`` is)."""
    estimate = _attribution(model, clean_tokens, corrupted_tokens, metric, mlp_out_names(model),
                            lambda act: act[:, :, None], by_position=by_position, direction=direction,
                            normalize=normalize)
    return estimate[..., 0]  # the one "head" each MLP layer was given


def _attribution(model, clean_tokens, corrupted_tokens, metric: Metric, names, as_heads, *, by_position: bool,
                 direction: str, normalize: bool) -> torch.Tensor:
    """The attribution estimate of patching each of ``names`` (one per layer) -> [n_layers, (pos,) head];
    ``as_heads`` views an activation as (batch, pos, head, d)."""
    base, source = base_and_source(model, clean_tokens, corrupted_tokens, direction)
    source_logits, source_cache = cache_run(model, source, names, logits=normalize)  # logits: normalising only
    value, acts, grads = activation_gradients(model, base, metric, names)
    effects = linear_effects([as_heads(grads[name]) for name in names], [as_heads(acts[name]) for name in names],
                             [as_heads(source_cache[name]) for name in names])
    estimate = value + (effects if by_position else effects.sum(dim=1))
    if not normalize:
        return estimate
    source_value = evaluate_metric(metric, source_logits).item()
    clean_value, corrupted_value = (source_value, value) if direction == "denoise" else (value, source_value)
    return normalize_values(estimate, clean_value, corrupted_value)


def attribution_agreement(attributed: torch.Tensor, exact: torch.Tensor, top_k: int = 10, *,
                          baseline: float) -> dict[str, float]:
    """How well attribution matches exact patching (same shape): Pearson and Spearman correlation
    of the cells, the largest absolute error, and the share of exact's ``top_k`` cells by effect
    size (distance from ``baseline``, the unpatched run's metric: ``unpatched_value``) that
    attribution also puts in its top k."""
    if attributed.shape != exact.shape:
        raise UserError(f"shapes differ: attribution {tuple(attributed.shape)} vs exact {tuple(exact.shape)}")
    a = pd.Series(attributed.detach().flatten().cpu().double().numpy())
    e = pd.Series(exact.detach().flatten().cpu().double().numpy())
    k = min(top_k, len(e))
    top = lambda s: set((s - baseline).abs().nlargest(k).index)  # noqa: E731
    return {
        "pearson": float(a.corr(e)),
        "spearman": float(a.rank().corr(e.rank())),
        "max_abs_error": float((a - e).abs().max()),
        f"top{k}_overlap": len(top(a) & top(e)) / k,
    }


def unpatched_value(model, clean_tokens, corrupted_tokens, metric: Metric, *, direction: str = "denoise",
                    normalize: bool = False) -> float:
    """The metric of the run that patching edits (the corrupted run when denoising, the clean one
    when noising): every patched cell's effect is measured from it. Normalised: 0 when denoising,
    1 when noising."""
    base, _ = base_and_source(model, clean_tokens, corrupted_tokens, direction)
    if normalize:
        return 0.0 if direction == "denoise" else 1.0
    logits, _ = cache_run(model, base, [])
    return evaluate_metric(metric, logits).item()


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
    progress: bool | None = None,
) -> pd.DataFrame:
    """Attribution ranks every head; exact patching confirms the ``k`` with the largest estimated effect.

    Returns one row per head, by rank: ``rank, layer, head, attribution`` (estimated patched
    metric), ``value`` (exact where ``exact`` is True, else the attribution estimate), ``exact``.
    Costs about 3 forwards + the exact patches of k heads (suffix forwards on GPTModel).
    """
    require_edit(model, "hook_z", "shortlist_patch_heads")
    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
    if not 0 <= k <= n_layers * n_heads:
        raise UserError(f"k={k} out of range [0, {n_layers * n_heads}] (the model has that many heads)")
    names = z_names(model)
    contrast = prepare(model, clean_tokens, corrupted_tokens, metric, names, direction)
    value, z, grads = metric_gradients(model, contrast.tokens, metric)
    estimate = value + linear_effects(grads, z, [contrast.sources[name] for name in names]).sum(dim=1).cpu()
    order = (estimate - value).abs().flatten().argsort(descending=True, stable=True)
    heads = [divmod(int(i), n_heads) for i in order]
    frame = pd.DataFrame(heads, columns=["layer", "head"])
    frame.insert(0, "rank", range(len(frame)))
    frame["attribution"] = estimate.flatten()[order].numpy()
    exact = patch_specific_heads(contrast, heads[:k], Options(direction, normalize, memory_mb, progress))
    frame["value"] = torch.cat([exact, estimate.flatten()[order][k:]]).numpy()
    frame["exact"] = frame["rank"] < k
    if normalize:
        for column in ("attribution", "value"):
            frame[column] = contrast.normalize(torch.tensor(frame[column].to_numpy())).numpy()
    return frame
