"""Q/K/V composition scores between every earlier and later head, from the weights (architecture §4.6).

Elhage et al. (2021), "A Mathematical Framework for Transformer Circuits": a sender head s writes
``x @ W_OV^s`` into the residual stream (``W_OV = W_V @ W_O``, d_model x d_model, row-vector
convention), and a later receiver head r reads the stream through its query, key or value. How
much of what s writes lands where r reads is

    q:  ||W_OV^s @ W_QK^r||   / (||W_OV^s|| ||W_QK^r||)      (W_QK = W_Q @ W_K^T)
    k:  ||W_OV^s @ W_QK^r.T|| / (||W_OV^s|| ||W_QK^r||)
    v:  ||W_OV^s @ W_OV^r||   / (||W_OV^s|| ||W_OV^r||)

with Frobenius norms: at most 1, reached when both matrices have rank one and what s writes is
exactly the direction r reads; 0 when s writes only into a subspace r does not read. These are
TransformerLens's ``all_composition_scores("Q"|"K"|"V")`` (left = the earlier head's OV, right =
the later head's QK, QK transposed, or OV), computed here from the same stacked weights
(``model.W_Q, W_K, W_V, W_O``: a ``TransformerBridge``'s own, or ``GPTModel``'s through
``interp.weights.HeadWeights``), grouped-query key/value heads repeated onto their query heads as
TransformerLens does. No LayerNorm is folded in and nothing is centred: on a default bridge (not
compatibility mode) the scores equal TransformerLens's to float rounding; on a compatibility-mode
bridge both score its processed (folded, centred) weights, which gives other numbers.

A model that norms inside its attention is refused in one line: Gemma 3 norms each query and key
head (a per-head RMSNorm between ``W_Q``/``W_K`` and the scores, so ``W_QK`` is not the bilinear form
the scores use), and Gemma 2 and 3 norm the attention output before the residual (``ln1_post``,
whose per-position scale is a run's, not the weights'). Folding the norms' weights in would still
leave a score of something the model does not compute; exact path patching, which runs the model,
measures those edges.

The baseline: the mean score, over ``baseline_samples`` draws, of the same formula on independent
standard Gaussian matrices of the pair's shapes (W_V, W_K, W_Q: d_model x d_head; W_O: d_head x
d_model): random matrices of the same shapes are the comparison Elhage et al. give. The score is
invariant to each factor's scale, so the variance does not matter. Every head of a model has the
same shapes, so every pair gets the same baseline.

Computation: each d_model x d_model product has rank <= d_head, so nothing that size is formed.
With ``W_V^s = Q_a R_a`` and ``D^r = Q_d R_d`` (QR, orthonormal Q), ``||W_V^s W_O^s C^r D^r.T|| =
||R_a W_O^s C^r R_d.T||`` where ``C D^T`` is the receiver's matrix (q: W_Q W_K^T, k: W_K W_Q^T, v:
W_V W_O); each (sender layer, receiver layer) block is one matrix product.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import einops
import pandas as pd
import torch
from matplotlib.figure import Figure

from analyses.core.hook_check import norms_inside_heads
from analyses.core.checks import check_heads
from analyses.core.execution import executing
from analyses.core.progress import progress_bar
from analyses.core.plots import heatmap, new_figure
from interp.errors import UserError
from interp.weights import expand_kv_heads

KINDS = ("q", "k", "v")


@dataclass
class _Factors:
    """A model's composition factors, reduced to d_head x d_head sizes, in float32 or wider.

    sender: (layer, head, d_head, d_model): ``R_a @ W_O`` per head; sender_norm (layer, head): ||W_OV||.
    receiver[kind]: (layer, head, d_model, d_head): ``C @ R_d.T``; receiver_norm[kind] (layer, head):
    the norm of the receiver's matrix (W_QK, W_QK, W_OV).
    """

    sender: torch.Tensor
    sender_norm: torch.Tensor
    receiver: dict[str, torch.Tensor]
    receiver_norm: dict[str, torch.Tensor]


def _triangular(matrix: torch.Tensor) -> torch.Tensor:
    """(..., d_model, d_head) -> R (..., d_head, d_head) with matrix = Q R, Q's columns orthonormal."""
    return torch.linalg.qr(matrix, mode="r").R


def _reduce_sender(W_V: torch.Tensor, W_O: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W_V (..., d_model, d_head), W_O (..., d_head, d_model) -> (R_a @ W_O (..., d_head, d_model),
    ||W_V @ W_O|| (...))."""
    left = _triangular(W_V) @ W_O
    return left, torch.linalg.matrix_norm(left)


def _reduce_receiver(C: torch.Tensor, D: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The receiver's matrix C @ D.T, C and D (..., d_model, d_head) -> (C @ R_d.T (..., d_model,
    d_head), ||C @ D.T|| (...))."""
    right = C @ _triangular(D).transpose(-1, -2)
    return right, torch.linalg.matrix_norm(right)


def _receiver_sides(W_Q, W_K, W_V, W_O) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """kind -> (C, D), the receiver's matrix written C @ D.T: q W_Q W_K^T, k W_K W_Q^T, v W_V W_O."""
    return {"q": (W_Q, W_K), "k": (W_K, W_Q), "v": (W_V, W_O.transpose(-1, -2))}


def _factors(W_Q, W_K, W_V, W_O, kinds: Sequence[str]) -> _Factors:
    """Reduced factors from stacked weights (layer, head, ...), key/value heads already expanded."""
    sender, sender_norm = _reduce_sender(W_V, W_O)
    sides = _receiver_sides(W_Q, W_K, W_V, W_O)
    reduced = {kind: _reduce_receiver(*sides[kind]) for kind in kinds}
    return _Factors(sender, sender_norm, {k: r for k, (r, _) in reduced.items()},
                    {k: n for k, (_, n) in reduced.items()})


def model_factors(model, kinds: Sequence[str]) -> _Factors:
    """The model's stacked attention weights (``W_Q, W_K, W_V, W_O``, TransformerLens's names and
    shapes), key/value heads expanded to the query heads, reduced for ``kinds``. Refused in one line
    where a norm acts inside the attention (module docstring)."""
    if norms_inside_heads(model):
        raise UserError("composition scores read W_Q, W_K, W_V and W_O alone, and this model norms inside its "
                        "attention (each query and key head, or the attention output before the residual: Gemma 2 "
                        "and 3), which the weights do not hold; path patching measures the edges there")
    n_heads = model.cfg.n_heads
    with torch.no_grad():
        W_O = model.W_O
        dtype = torch.promote_types(W_O.dtype, torch.float32)
        W_Q = model.W_Q.to(dtype)
        W_K = expand_kv_heads(model.W_K, n_heads).to(dtype)
        W_V = expand_kv_heads(model.W_V, n_heads).to(dtype)
        return _factors(W_Q, W_K, W_V, W_O.to(dtype), kinds)


def _block_scores(factors: _Factors, kind: str, sender_layer: int, receiver_layer: int) -> torch.Tensor:
    """(sender head, receiver head) scores of one pair of layers."""
    sender = factors.sender[sender_layer]  # (head, d_head, d_model)
    receiver = factors.receiver[kind][receiver_layer]  # (head, d_model, d_head)
    products = torch.einsum("s a m, r m b -> s r a b", sender, receiver)
    norms = torch.linalg.matrix_norm(products)
    return norms / factors.sender_norm[sender_layer][:, None] / factors.receiver_norm[kind][receiver_layer][None, :]


def score_tensor(model, kind: str) -> torch.Tensor:
    """One kind's scores as TransformerLens shapes them: (sender layer, sender head, receiver
    layer, receiver head), zero unless sender layer < receiver layer, on the CPU."""
    _check_kinds([kind])
    everyone = torch.ones(model.cfg.n_layers, model.cfg.n_heads, dtype=torch.bool)
    return _score_tensor(model_factors(model, [kind]), kind, everyone, everyone)


def _score_tensor(factors: _Factors, kind: str, senders: torch.Tensor, receivers: torch.Tensor) -> torch.Tensor:
    """Scores (layer, head, layer, head) of the layer pairs holding a chosen sender and a chosen
    receiver (``senders``/``receivers``: (layer, head) bool); zero elsewhere. A bar over the layer
    pairs, shown per the current execution's progress."""
    n_layers, n_heads = factors.sender_norm.shape
    scores = torch.zeros(n_layers, n_heads, n_layers, n_heads, dtype=factors.sender.dtype)
    pairs = [(s, r) for r in range(n_layers) for s in range(r) if senders[s].any() and receivers[r].any()]
    for sender_layer, receiver_layer in progress_bar(pairs, desc=f"{kind}-composition"):
        scores[sender_layer, :, receiver_layer] = _block_scores(factors, kind, sender_layer, receiver_layer).cpu()
    return scores


def random_baseline(d_model: int, d_head: int, samples: int, seed: int = 0) -> float:
    """Mean composition score of ``samples`` draws of four independent standard Gaussian factors
    (sender W_V d_model x d_head, W_O d_head x d_model; receiver C, D d_model x d_head). The same
    for q, k and v, whose factors have these shapes alike. Float64, on the CPU, seeded."""
    if samples < 1:
        raise UserError(f"baseline_samples={samples} must be >= 1")
    generator = torch.Generator().manual_seed(seed)

    def gaussian(*shape):
        return torch.randn(samples, *shape, generator=generator, dtype=torch.float64)

    left, left_norm = _reduce_sender(gaussian(d_model, d_head), gaussian(d_head, d_model))
    right, right_norm = _reduce_receiver(gaussian(d_model, d_head), gaussian(d_model, d_head))
    scores = torch.linalg.matrix_norm(left @ right) / left_norm / right_norm
    return float(scores.mean())


def _check_kinds(kinds: Sequence[str]) -> None:
    for kind in kinds:
        if kind not in KINDS:
            raise UserError(f"composition kind {kind!r} is not one of {', '.join(KINDS)}")


def head_mask(model, heads: Sequence[tuple[int, int]] | None) -> torch.Tensor:
    """[(layer, head), ...] (None: every head) -> (layer, head) bool, True for the listed heads."""
    if heads is None:
        return torch.ones(model.cfg.n_layers, model.cfg.n_heads, dtype=torch.bool)
    mask = torch.zeros(model.cfg.n_layers, model.cfg.n_heads, dtype=torch.bool)
    for layer, head in check_heads(model, heads):
        mask[layer, head] = True
    return mask


def composition_scores(model, kind: str | Sequence[str] = "k", *, senders=None, receivers=None,
                       baseline_samples: int = 100, seed: int = 0, progress: bool | None = None) -> pd.DataFrame:
    """Composition scores of every (earlier head, later head) pair of a hooked model.

    Args:
        model: a ``GPTModel`` or ``TransformerBridge`` (anything with TransformerLens's stacked
            ``W_Q, W_K, W_V`` (layer, head or kv head, d_model, d_head) and ``W_O`` (layer, head,
            d_head, d_model)).
        kind: "q", "k" or "v" (the receiver's input the sender writes into), or several.
        senders, receivers: [(layer, head), ...] to score only pairs among these (None: all heads);
            only the layer pairs that hold them are computed.
        baseline_samples, seed: the Gaussian baseline's draws (``random_baseline``).
        progress: see ``analyses.core.progress`` (None: the current execution's).

    Returns a tidy frame, one row per (sender, receiver, kind) with sender_layer < receiver_layer, columns
    ``sender_layer, sender_head, receiver_layer, receiver_head, kind, score, baseline,
    score_minus_baseline``, sorted by kind (in the order given), sender, receiver.
    """
    kinds = [kind] if isinstance(kind, str) else list(kind)
    _check_kinds(kinds)
    chosen = head_mask(model, senders), head_mask(model, receivers)
    factors = model_factors(model, kinds)
    baseline = random_baseline(model.cfg.d_model, factors.sender.shape[-2], baseline_samples, seed)
    with executing(progress=progress):
        frames = [_tidy(_score_tensor(factors, k, *chosen), k, baseline, *chosen) for k in kinds]
    return pd.concat(frames, ignore_index=True)


def _tidy(scores: torch.Tensor, kind: str, baseline: float, senders: torch.Tensor,
          receivers: torch.Tensor) -> pd.DataFrame:
    """(layer, head, layer, head) scores -> rows of the chosen pairs with sender layer < receiver layer."""
    n_layers, n_heads = scores.shape[:2]
    index = torch.arange(n_layers * n_heads)
    layer_of, head_of = index // n_heads, index % n_heads
    flat = einops.rearrange(scores, "ls hs lr hr -> (ls hs) (lr hr)")
    sender, receiver = torch.meshgrid(index, index, indexing="ij")
    keep = (layer_of[sender] < layer_of[receiver]) & senders.flatten()[sender] & receivers.flatten()[receiver]
    sender, receiver = sender[keep], receiver[keep]
    values = flat[keep].cpu().double().numpy()
    return pd.DataFrame({
        "sender_layer": layer_of[sender].cpu().numpy(),
        "sender_head": head_of[sender].cpu().numpy(),
        "receiver_layer": layer_of[receiver].cpu().numpy(),
        "receiver_head": head_of[receiver].cpu().numpy(),
        "kind": kind,
        "score": values,
        "baseline": baseline,
        "score_minus_baseline": values - baseline,
    })


def head_label(layer: int, head: int) -> str:
    """'L1H4'."""
    return f"L{layer}H{head}"


def head_labels(frame: pd.DataFrame, side: str) -> list[str]:
    """'L{layer}H{head}' of each row's ``side`` ("sender" or "receiver") head."""
    return [head_label(l, h) for l, h in zip(frame[f"{side}_layer"], frame[f"{side}_head"])]


def composition_figure(frame: pd.DataFrame, value: str = "score_minus_baseline") -> Figure:
    """One sender x receiver heatmap per kind in ``frame`` (a ``composition_scores`` frame), of
    ``value`` on a colour scale centred on zero (the baseline) shared by the panels."""
    kinds = list(dict.fromkeys(frame["kind"]))
    labelled = frame.assign(sender=head_labels(frame, "sender"), receiver=head_labels(frame, "receiver"))
    n_senders, n_receivers = labelled["sender"].nunique(), labelled["receiver"].nunique()
    side = min(10.0, max(3.0, 0.3 * max(n_senders, n_receivers) + 1.5))
    figure = new_figure(figsize=(side * len(kinds) + 1, side))
    axes = figure.subplots(1, len(kinds), squeeze=False)[0]
    limit = float(labelled[value].abs().max()) or 1.0
    order = {"sender": list(dict.fromkeys(labelled["sender"])), "receiver": list(dict.fromkeys(labelled["receiver"]))}
    for ax, kind in zip(axes, kinds):
        grid = (labelled[labelled["kind"] == kind]
                .pivot(index="sender", columns="receiver", values=value)
                .reindex(index=order["sender"], columns=order["receiver"]))
        heatmap(ax, grid, cmap="RdBu_r", center=0.0, vmin=-limit, vmax=limit, square=True,
                cbar=ax is axes[-1], cbar_kws={"label": value.replace("_", " ")})
        ax.tick_params(axis="y", rotation=0)
        ax.set_title(f"{kind.upper()}-composition")
        ax.set_xlabel("receiver (later head)")
        ax.set_ylabel("sender (earlier head)")
    return figure
