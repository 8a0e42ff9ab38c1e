"""Attention rollout (Abnar & Zuidema 2020, "Quantifying Attention Flow in Transformers").

Each layer's attention, averaged over its heads, is mixed with the identity to stand for the
residual connection and its rows renormalised; the mixed matrices are multiplied through the
layers:

    Â_l = normalise_rows(w A_l + (1 - w) I),   A_l = mean over heads of the layer's pattern
    R_0 = Â_0,   R_l = Â_l R_{l-1}

so R_l[i, j] is how much of token j's information reaches position i after layer l, if the
only thing a layer did were to mix positions by its attention weights (w = 0.5 in the paper).

What rollout cannot tell: it ignores the value vectors and the output projection (a head that
attends strongly but writes nothing counts fully), the MLPs and layer norms, and it averages
heads, so one decisive head is diluted by the others. It is a description of where attention
*could* route information, not a measurement of what the model uses: for that, ablate or patch.
"""

from __future__ import annotations

import einops
import torch
from matplotlib.figure import Figure

from analyses.attention_map import all_patterns
from analyses.plots import attention_grid
from interp.errors import UserError

ROLLOUT_NOTE = (
    "Attention rollout (Abnar & Zuidema 2020) multiplies each layer's head-averaged attention, mixed "
    "half-and-half with the identity for the residual stream, through the layers: entry (i, j) is how much "
    "of token j reaches position i if layers only moved information along attention weights. It ignores "
    "the value vectors, the output projections and the MLPs, and averages the heads, so it shows where "
    "information could flow, not what the model uses (ablation and patching measure that)."
)


def attention_rollout(patterns: torch.Tensor, attention_weight: float = 0.5) -> torch.Tensor:
    """patterns (..., layer, head, q, k) post-softmax attention -> rollout (..., layer, q, k):
    entry [l] is the product through layers 0..l of the head-averaged, identity-mixed, row-renormalised
    attention. ``attention_weight`` is w in w A + (1 - w) I (the paper's 0.5)."""
    if not 0.0 <= attention_weight <= 1.0:
        raise UserError(f"attention_weight={attention_weight} must be in [0, 1]")
    mean = einops.reduce(patterns.float(), "... l h q k -> ... l q k", "mean")
    eye = torch.eye(mean.shape[-1], dtype=mean.dtype, device=mean.device)
    mixed = attention_weight * mean + (1 - attention_weight) * eye
    mixed = mixed / mixed.sum(dim=-1, keepdim=True)
    layers = [mixed[..., 0, :, :]]
    for layer in range(1, mixed.shape[-3]):
        layers.append(mixed[..., layer, :, :] @ layers[-1])
    return torch.stack(layers, dim=-3)


def model_rollout(model, tokens: torch.Tensor, attention_weight: float = 0.5) -> torch.Tensor:
    """Attention rollout of a hooked model on tokens (pos,) -> (layer, q, k)."""
    return attention_rollout(all_patterns(model, tokens), attention_weight)


def rollout_figure(rolled: torch.Tensor, str_tokens: list[str]) -> Figure:
    """rolled (layer, q, k) -> the rollout after the first, a middle and the last layer."""
    n_layers = rolled.shape[0]
    layers = sorted({0, n_layers // 2, n_layers - 1})
    shown = rolled[layers]
    # the identity mixing makes the diagonal dominate: the colour scale stops at the largest
    # off-diagonal value (the diagonal saturates), so the flow between tokens stays visible
    off_diagonal = float((shown * (1 - torch.eye(shown.shape[-1]))).max())
    titles = [f"rollout after layer {layer}" for layer in layers]
    return attention_grid(shown, str_tokens, titles, vmax=off_diagonal if off_diagonal > 0 else 1.0,
                          suptitle="attention rollout (colour scale capped at the largest off-diagonal value)")
