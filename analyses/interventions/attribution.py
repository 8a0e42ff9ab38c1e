"""Attribution patching, judged (Nanda 2023; Syed et al. 2023): the estimate itself is
``patch_components(method="attribution")`` (exact patching linearised, about three
forward-equivalents for every cell); here are its shortcuts, how well it agrees with exact
patching (measured, never assumed), and the shortlist that ranks every head by attribution and
confirms the top ones exactly.
"""

from __future__ import annotations

import pandas as pd
import torch

from analyses.core.budget import DEFAULT_MEMORY_MB
from analyses.core.hook_check import require_edit
from analyses.core.hook_names import z_names
from analyses.core.metrics import Metric
from analyses.interventions.patching import (COMPONENTS, base_and_source, linearised_patches, patch_components,
                                            patch_specific_heads, prepare)
from analyses.interventions.run import Options, Run
from interp.errors import UserError


def attribution_patch_heads(model, clean_tokens, corrupted_tokens, metric: Metric, **keywords) -> torch.Tensor:
    """The estimated ``patch_heads``: ``patch_components(..., "heads", method="attribution")``."""
    return patch_components(model, clean_tokens, corrupted_tokens, metric, "heads", method="attribution", **keywords)


def attribution_patch_mlps(model, clean_tokens, corrupted_tokens, metric: Metric, **keywords) -> torch.Tensor:
    """The estimated ``patch_mlps``: ``patch_components(..., "mlps", method="attribution")``."""
    return patch_components(model, clean_tokens, corrupted_tokens, metric, "mlps", method="attribution", **keywords)


def attribution_agreement(attributed: torch.Tensor, exact: torch.Tensor, top_k: int = 10, *,
                          baseline: float) -> dict[str, float]:
    """How well attribution matches exact patching (same shape): Pearson and Spearman correlation
    of the cells, the largest absolute error, and the share of exact's ``top_k`` cells by effect
    size (distance from ``baseline``, the unpatched run's metric: ``unpatched_value``) that
    attribution also puts in its top k."""
    if attributed.shape != exact.shape:
        raise UserError(f"shapes differ: attribution {tuple(attributed.shape)} vs exact {tuple(exact.shape)}")
    a = pd.Series(attributed.detach().flatten().double().cpu().numpy())
    e = pd.Series(exact.detach().flatten().double().cpu().numpy())
    k = min(top_k, len(e))
    top = lambda s: set((s - baseline).abs().nlargest(k).index)  # noqa: E731
    return {
        "pearson": float(a.corr(e)),
        "spearman": float(a.rank().corr(e.rank())),
        "max_abs_error": float((a - e).abs().max()),
        f"top{k}_overlap": len(top(a) & top(e)) / k,
    }


def unpatched_value(model, clean_tokens, corrupted_tokens, metric: Metric, *, direction: str = "denoise",
                    normalize: bool = False, memory_mb: float = DEFAULT_MEMORY_MB) -> float:
    """The metric of the run that patching edits (the corrupted run when denoising, the clean one
    when noising): every patched cell's effect is measured from it. Normalised: 0 when denoising,
    1 when noising. ``memory_mb``: the budget of that run (``Run.make``)."""
    base, _ = base_and_source(model, clean_tokens, corrupted_tokens, direction)
    if normalize:
        return 0.0 if direction == "denoise" else 1.0
    return Run.make(model, base, metric, starts=False, memory_mb=memory_mb).baseline


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
    Costs about 5 forwards (the attribution's over chunks of prompts within ``memory_mb``) + the
    exact patches of k heads (suffix forwards on GPTModel).
    """
    require_edit(model, "hook_z", "shortlist_patch_heads")
    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
    if not 0 <= k <= n_layers * n_heads:
        raise UserError(f"k={k} out of range [0, {n_layers * n_heads}] (the model has that many heads)")
    contrast = prepare(model, clean_tokens, corrupted_tokens, metric, z_names(model), direction, memory_mb=memory_mb)
    estimate = linearised_patches(model, clean_tokens, corrupted_tokens, metric, COMPONENTS["heads"], False,
                                  Options(direction, False, memory_mb, progress)).cpu()
    order = (estimate - contrast.baseline).abs().flatten().argsort(descending=True, stable=True)
    heads = [divmod(int(i), n_heads) for i in order]
    frame = pd.DataFrame(heads, columns=["layer", "head"])
    frame.insert(0, "rank", range(len(frame)))
    frame["attribution"] = estimate.flatten()[order].cpu().numpy()
    exact = patch_specific_heads(contrast, heads[:k], Options(direction, normalize, memory_mb, progress))
    frame["value"] = torch.cat([exact, estimate.flatten()[order][k:]]).cpu().numpy()
    frame["exact"] = frame["rank"] < k
    if normalize:
        for column in ("attribution", "value"):
            frame[column] = contrast.normalize(torch.tensor(frame[column].to_numpy())).cpu().numpy()
    return frame
