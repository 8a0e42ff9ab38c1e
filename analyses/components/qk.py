"""Why a head attends: its pre-softmax score split exactly over the components of its input residual.

A head's score at query position i and key position j is

    score = scale * q_i . k_j  (+ ALiBi's slope * j),   q_i = rot_i(qnorm(W_Q ln1(x_i) + b_Q)),
                                                         k_j = rot_j(knorm(W_K ln1(x_j) + b_K))

With the pre-attention norm ``ln1`` frozen at the clean run (``weight * centre(x) / scale + bias``,
its scale per prompt and position read off that run: ``frozen_affine_norm``) and, where the model
norms each query and key head (Gemma 3's ``q_norm``/``k_norm``), that norm frozen too (its RMS per
prompt, position and head: ``frozen_norm``), both q_i and k_j are affine in the residual, and the
rotation at a fixed position is linear. The residual entering the layer is the sum of its parts
(``decompose_residual(model, tokens, layer=L)``: ``embed``, ``pos_embed``, each earlier head
``L{l}H{h}``, ``L{l} attn bias``, ``L{l} MLP``), so q_i = sum_c q_i[c] and k_j = sum_c k_j[c], and

    score = sum_{c, c'} scale * q_i[c] . k_j[c']

exactly, within float32 rounding. The components on both axes are the residual's parts plus the
terms the layer adds, each present only where the model has it:

- ``L{L} ln1 bias``: the pre-attention LayerNorm's bias, through W_Q (query side) and W_K (key side);
- ``L{L}H{h} qk bias``: the head's b_Q on the query side, its key/value group's b_K on the key side;
- ``alibi``: ALiBi's ``slope_h * j``, a position term: it sits in the (alibi, alibi) cell, with zeros
  in the rest of its row and column.

Grouped- and multi-query attention: head h reads key/value head ``h // (n_heads // n_kv_heads)``.
A soft cap on the scores (Gemma 2: ``cap * tanh(score / cap)``) is applied after the product: the
terms decompose the score *before* the cap (``QKAttribution.note`` says so), whose cap is elementwise
and increasing, so the ranking of keys is the capped one's; ``QKAttribution.score`` is then the
model's capped score uncapped (``cap * atanh(s / cap)``).

``baseline="mean_other_keys"`` decomposes the contrast instead: the pair's score minus the mean
score of the other keys that query sees (those the model did not mask), which is bilinear too (the
key vector of each component minus its mean over those keys): why *this* key rather than the others.

Cost: one forward per chunk of prompts, stopped at the head's layer (``hook_attn_scores``), then a
handful of products of width d_head; memory per prompt about two d_model-wide copies of every
component at every position plus the (pairs, C, C) terms, chunked over prompts within ``memory_mb``.

Only interp's own attention (``GroupedQueryAttention``, ``impl="scratch"``) exposes the norms and
the rotation the split needs; a model without it (a TransformerLens bridge) is refused in one line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import pandas as pd
import torch
from einops import einsum, rearrange
from matplotlib.figure import Figure

from analyses.components.decompose import component_hooks, decompose_residual, frozen_affine_norm
from analyses.core.execution import executing
from analyses.core.hook_check import FrozenNorm, frozen_norm
from analyses.core.hook_names import qkv_name
from analyses.core.plots import heatmap, new_figure
from analyses.core.stats import N_BOOT, bootstrap_ratio
from analyses.core.checks import check_choice, check_heads, check_layer
from analyses.interventions.engine import cache_run
from interp.attention import GroupedQueryAttention, apply_rotary
from interp.errors import UserError
from interp.provenance import model_family, model_impl

BASELINES = (None, "mean_other_keys")
ALIBI = "alibi"


def scores_name(layer: int) -> str:
    """A layer's masked, scaled, pre-softmax scores (batch, head, q_pos, k_pos)."""
    return f"blocks.{layer}.attn.hook_attn_scores"


@dataclass(frozen=True)
class QKAttribution:
    """One head's scores split over its input's components (module docstring).

    names: the components, the same list on the query and the key axis. terms: (prompts, pairs,
    query component, key component) float32, summing over the last two axes to ``score``. score:
    (prompts, pairs) float32, what the model computed at each pair (before the soft cap where it has
    one), or with ``baseline`` the contrast: that minus the mean of the other keys the query sees.
    query_pos, key_pos: (prompts, pairs) the pairs. note: what the score is, in words."""

    names: tuple[str, ...]
    terms: torch.Tensor
    score: torch.Tensor
    baseline: str | None
    layer: int
    head: int
    query_pos: torch.Tensor
    key_pos: torch.Tensor
    note: str

    def pair_means(self) -> "QKAttribution":
        """The same attribution with each prompt's pairs averaged: terms (prompts, 1, C, C), score
        (prompts, 1), positions -1 (no single pair). Its ``key_side``, ``query_side`` and
        ``top_pairs`` are this one's (every prompt has as many pairs), at 1/pairs of the memory."""
        none = torch.full((len(self.terms), 1), -1, dtype=torch.long)
        return QKAttribution(self.names, self.terms.mean(1, keepdim=True), self.score.mean(1, keepdim=True),
                             self.baseline, self.layer, self.head, none, none, self.note)

    def key_side(self, n_boot: int = N_BOOT, seed: int = 0) -> pd.DataFrame:
        """Each component's key-side attribution (its terms summed over the query components): one
        row per component, ``component, side, attribution`` (the mean over pairs, pooled over prompts)
        with ``ci_low, ci_high, n_prompts`` (bootstrap over prompts), largest |attribution| first."""
        return _side_frame(self.names, self.terms.sum(2), "key", n_boot, seed)

    def query_side(self, n_boot: int = N_BOOT, seed: int = 0) -> pd.DataFrame:
        """As ``key_side``, the terms summed over the key components."""
        return _side_frame(self.names, self.terms.sum(3), "query", n_boot, seed)

    def top_pairs(self, k: int = 10, n_boot: int = N_BOOT, seed: int = 0) -> pd.DataFrame:
        """The ``k`` (query component, key component) terms of largest mean |value| over pairs:
        ``query_component, key_component, attribution, ci_low, ci_high, n_prompts``."""
        n_prompts, n_pairs, n_comp, _ = self.terms.shape
        means = self.terms.mean((0, 1)).abs().flatten()
        picked = means.topk(min(k, len(means))).indices
        sums = self.terms.sum(1).flatten(1)[:, picked]  # (prompts, k)
        estimate, low, high = bootstrap_ratio(sums, torch.full((n_prompts,), float(n_pairs)), n_boot=n_boot, seed=seed)
        return pd.DataFrame({"query_component": [self.names[int(i) // n_comp] for i in picked],
                             "key_component": [self.names[int(i) % n_comp] for i in picked],
                             "attribution": estimate.cpu().numpy(), "ci_low": low.cpu().numpy(), "ci_high": high.cpu().numpy(),
                             "n_prompts": n_prompts})


def _side_frame(names: Sequence[str], values: torch.Tensor, side: str, n_boot: int, seed: int) -> pd.DataFrame:
    """values (prompts, pairs, component) -> one row per component with its mean over pairs and its
    bootstrap interval over prompts, largest |attribution| first."""
    n_prompts, n_pairs, _ = values.shape
    estimate, low, high = bootstrap_ratio(values.sum(1), torch.full((n_prompts,), float(n_pairs)), n_boot=n_boot,
                                          seed=seed)
    frame = pd.DataFrame({"component": list(names), "side": side, "attribution": estimate.cpu().numpy(),
                          "ci_low": low.cpu().numpy(), "ci_high": high.cpu().numpy(), "n_prompts": n_prompts})
    return frame.reindex(frame["attribution"].abs().sort_values(ascending=False).index).reset_index(drop=True)


def qk_attention(model, layer: int) -> GroupedQueryAttention:
    """Block ``layer``'s attention module; refused in one line where it is not interp's own (the
    norms and rotation inside the score are then out of reach: ``qk_refusal``)."""
    check_layer(model, layer)
    attn = getattr(model.blocks[layer], "attn", None)
    if not isinstance(attn, GroupedQueryAttention):
        raise UserError(_refusal(model))
    return attn


def qk_refusal(model) -> str | None:
    """Why this model's scores cannot be split (one line), or None where every block's attention is
    interp's own (``GroupedQueryAttention``)."""
    if all(isinstance(getattr(block, "attn", None), GroupedQueryAttention) for block in model.blocks):
        return None
    return _refusal(model)


def _refusal(model) -> str:
    return (f"QK attribution needs interp's own attention to freeze the norms and the rotation inside a head's "
            f"score; this {model_family(model)} model is a {type(model).__name__} (impl={model_impl(model)}): "
            "load it with impl='scratch'")


def _pairs(tokens: torch.Tensor, query_pos, key_pos) -> tuple[torch.Tensor, torch.Tensor]:
    """query_pos, key_pos as (prompts, pairs) long tensors within the prompts' positions."""
    query_pos, key_pos = (torch.as_tensor(p, dtype=torch.long).to(tokens.device) for p in (query_pos, key_pos))
    n_prompts, n_pos = tokens.shape
    for name, value in (("query_pos", query_pos), ("key_pos", key_pos)):
        if value.ndim != 2 or value.shape[0] != n_prompts or value.shape[1] == 0:
            raise UserError(f"{name} of shape {tuple(value.shape)} must be (prompts={n_prompts}, pairs >= 1)")
        if ((value < 0) | (value >= n_pos)).any():
            raise UserError(f"{name} must hold positions in [0, {n_pos})")
    if query_pos.shape != key_pos.shape:
        raise UserError(f"query_pos {tuple(query_pos.shape)} and key_pos {tuple(key_pos.shape)} must have one shape")
    return query_pos, key_pos


def chunk_prompts(model, layer: int, n_pos: int, n_pairs: int, memory_mb: float) -> int:
    """How many prompts one chunk may hold: per prompt, two float32 copies of each component (the
    residual's parts and their normed shares, d_model wide) at every position, the rotated queries
    and keys, and the (pairs, C, C) terms."""
    n_comp = 3 + layer * (model.cfg.n_heads + 2)
    per_prompt = 4 * n_comp * (n_pos * (2 * model.cfg.d_model + 4 * model.cfg.d_head) + n_pairs * n_comp)
    return max(1, int(memory_mb * 2**20 // per_prompt))


@torch.no_grad()
def qk_attribution(model, tokens: torch.Tensor, layer: int, head: int, query_pos, key_pos,
                   baseline: str | None = None, *, memory_mb: float | None = None,
                   cache: Mapping[str, torch.Tensor] | None = None) -> QKAttribution:
    """Head ``head`` of block ``layer``, a ``QKAttribution`` value: its pre-softmax score at each
    (query, key) pair split over the components of its input residual (module docstring).

    tokens: (prompts, positions) token ids; query_pos, key_pos: (prompts, pairs) the pairs, each key
    one the model lets its query see. ``baseline``: None (the score) or ``"mean_other_keys"`` (the
    score minus the mean score of the other keys the query sees). Chunked over prompts within
    ``memory_mb`` (None: the current execution's, ``analyses.core.execution``; one forward per chunk,
    stopped at the layer). ``cache``: the activations of a
    forward of ``tokens`` already made, holding ``qk_hooks(model, layer)`` for every prompt (as
    ``cache_run`` returns them): no forward runs, so several heads can share one."""
    check_choice("baseline", baseline, BASELINES)
    attn = qk_attention(model, layer)
    check_heads(model, [(layer, head)])
    tokens = torch.as_tensor(tokens)
    if tokens.ndim != 2:
        raise UserError(f"tokens of shape {tuple(tokens.shape)} must be (prompts, positions)")
    query_pos, key_pos = _pairs(tokens, query_pos, key_pos)
    with executing(memory_mb) as execution:
        chunk = chunk_prompts(model, layer, tokens.shape[1], query_pos.shape[1], execution.memory_mb)
    pieces = [_attribute(model, attn, tokens[at:at + chunk], layer, head, query_pos[at:at + chunk],
                         key_pos[at:at + chunk], baseline,
                         None if cache is None else {name: cache[name][at:at + chunk] for name in qk_hooks(model, layer)})
              for at in range(0, len(tokens), chunk)]
    names = pieces[0][0]
    cap = attn.soft_cap
    note = ("the pre-softmax score" if cap is None else
            f"the pre-softmax score before the soft cap (the model attends by {cap:g} * tanh(score / {cap:g}))")
    if baseline is not None:
        note = f"{note}, minus its mean over the other keys the query sees"
    return QKAttribution(names, torch.cat([p[1] for p in pieces]), torch.cat([p[2] for p in pieces]), baseline, layer,
                         head, query_pos.cpu(), key_pos.cpu(), note)


@torch.no_grad()
def qk_identity_gap(model, tokens: torch.Tensor) -> float:
    """How exactly the terms add up on this model: the largest |sum of a pair's terms - the model's
    score| over every head of the last layer (the most components) at every (query, key) pair its
    query sees on ``tokens`` (1, pos), relative to the largest |score| there. One forward per head."""
    layer = model.cfg.n_layers - 1
    _, cache = cache_run(model, tokens[:1], [scores_name(layer)], logits=False)
    query_pos, key_pos = (positions[None] for positions in torch.isfinite(cache[scores_name(layer)][0, 0]).nonzero().T)
    gap, largest = 0.0, 0.0
    for head in range(model.cfg.n_heads):
        result = qk_attribution(model, tokens[:1], layer, head, query_pos.cpu(), key_pos.cpu())
        gap = max(gap, float((result.terms.double().sum((2, 3)) - result.score.double()).abs().max()))
        largest = max(largest, float(result.score.abs().max()))
    return gap / largest


def qk_hooks(model, layer: int) -> list[str]:
    """The hooks a split of block ``layer``'s scores reads: the components of its input residual, its
    scores, queries and keys."""
    return [*component_hooks(model, layer=layer), scores_name(layer), qkv_name(layer, "q"), qkv_name(layer, "k")]


def _attribute(model, attn: GroupedQueryAttention, tokens: torch.Tensor, layer: int, head: int,
               query_pos: torch.Tensor, key_pos: torch.Tensor, baseline: str | None,
               cache: Mapping[str, torch.Tensor] | None = None):
    """One chunk of prompts (``cache``: its activations, else a forward is made) -> (names, terms
    (b, pairs, C, C) float32 on the CPU, score (b, pairs))."""
    group = head // attn.group_size
    if cache is None:
        _, cache = cache_run(model, tokens, qk_hooks(model, layer), logits=False)
    parts = decompose_residual(model, cache, layer=layer)
    names = list(parts.components["component"])
    resid = cache[f"blocks.{layer}.hook_resid_pre"]
    ln1 = frozen_affine_norm(model, model.blocks[layer].ln1, resid, f"block {layer}'s norm on its input",
                             "QK attribution")
    shares = ln1.linear(parts.parts)  # (C, b, pos, d_model)
    w_q = attn.W_query.weight.detach().float()[head * attn.head_dim:(head + 1) * attn.head_dim]  # (d_head, d_model)
    w_k = attn.W_key.weight.detach().float()[group * attn.head_dim:(group + 1) * attn.head_dim]
    queries, keys = shares @ w_q.T, shares @ w_k.T  # (C, b, pos, d_head)
    extra_q, extra_k, extra_names = [], [], []
    if getattr(model.blocks[layer].ln1, "bias", None) is not None:
        extra_names.append(f"L{layer} ln1 bias")
        extra_q.append(ln1.bias @ w_q.T)
        extra_k.append(ln1.bias @ w_k.T)
    if attn.W_query.bias is not None or attn.W_key.bias is not None:
        extra_names.append(f"L{layer}H{head} qk bias")
        extra_q.append(_bias(attn.W_query, head, attn.head_dim, w_q))
        extra_k.append(_bias(attn.W_key, group, attn.head_dim, w_k))
    if extra_names:
        shape = queries.shape[1:]
        queries = torch.cat([queries, torch.stack(extra_q)[:, None, None].expand(-1, *shape)])
        keys = torch.cat([keys, torch.stack(extra_k)[:, None, None].expand(-1, *shape)])
        names += extra_names
    if attn.q_norm is not None:
        queries = _frozen_head_norm(attn.q_norm, cache[qkv_name(layer, "q")][:, :, head])(queries)
        keys = _frozen_head_norm(attn.k_norm, cache[qkv_name(layer, "k")][:, :, group])(keys)
    if attn.rotary is not None:
        queries, keys = (_rotate(attn, x) for x in (queries, keys))
    scores = cache[scores_name(layer)][:, head].float()  # (b, q, k), -inf where masked
    visible = torch.isfinite(scores)
    rows = torch.arange(len(tokens), device=scores.device)[:, None]
    if not visible[rows, query_pos, key_pos].all():
        raise UserError(f"some key_pos are masked from their query_pos in layer {layer} (a later key, or outside "
                        "the sliding window): a head's score exists only where its query sees the key")
    position_term = None
    if attn.alibi_slopes is not None:
        position_term = attn.alibi_slopes[head].float() * torch.arange(scores.shape[-1], device=scores.device).float()
        names.append(ALIBI)
    uncapped = _uncapped(attn, scores, position_term)
    q_at = queries[:, rows, query_pos]  # (C, b, pairs, d_head)
    k_at = keys[:, rows, key_pos]
    score = uncapped[rows, query_pos, key_pos]
    alibi = None if position_term is None else position_term[key_pos]
    if baseline == "mean_other_keys":
        others = visible[rows, query_pos].float()  # (b, pairs, k)
        others[rows, torch.arange(query_pos.shape[1]), key_pos] = 0.0
        count = others.sum(-1, keepdim=True)
        if (count == 0).any():
            raise UserError("baseline='mean_other_keys' needs every query to see another key besides key_pos "
                            "(a query at the first position sees only itself)")
        weights = others / count
        k_at = k_at - einsum(keys, weights, "c b k d, b p k -> c b p d")
        score = score - einsum(torch.where(visible[rows, query_pos], uncapped[rows, query_pos], 0.0), weights,
                               "b p k, b p k -> b p")
        if alibi is not None:
            alibi = alibi - weights @ position_term
    terms = attn.scale * einsum(q_at, k_at, "c b p d, e b p d -> b p c e")
    if alibi is not None:
        terms = torch.nn.functional.pad(terms, (0, 1, 0, 1))
        terms[..., -1, -1] = alibi
    return tuple(names), terms.cpu(), score.cpu()


def _bias(linear, head: int, d_head: int, weight: torch.Tensor) -> torch.Tensor:
    """A projection's bias for one head (d_head,) float32, zeros where it has none."""
    if linear.bias is None:
        return weight.new_zeros(d_head)
    return linear.bias.detach().float()[head * d_head:(head + 1) * d_head]


def _frozen_head_norm(norm, projected: torch.Tensor) -> FrozenNorm:
    """A per-head norm (Gemma 3's q_norm / k_norm over d_head) frozen at the clean run, where
    ``projected`` (b, pos, d_head) went in (the model's own ``hook_q``/``hook_k`` slice)."""
    return frozen_norm(norm, projected, norm(projected))


def _rotate(attn: GroupedQueryAttention, x: torch.Tensor) -> torch.Tensor:
    """x (C, b, pos, d_head) -> each position's rotary rotation applied (the model's own ``Rotary``)."""
    n_comp, n_batch, n_pos, _ = x.shape
    cos, sin = attn.rotary.cos_sin(0, n_pos, like=x)
    flat = rearrange(x, "c b p d -> (c b) p 1 d")
    return rearrange(apply_rotary(flat, cos, sin), "(c b) p 1 d -> c b p d", c=n_comp)


def _uncapped(attn: GroupedQueryAttention, scores: torch.Tensor, position_term: torch.Tensor | None) -> torch.Tensor:
    """The model's scores (b, q, k) before its soft cap (``cap * atanh``), the position term kept outside
    the cap as the model adds it; unchanged where there is no cap."""
    if attn.soft_cap is None:
        return scores
    position = 0.0 if position_term is None else position_term
    capped = (scores - position) / attn.soft_cap
    return attn.soft_cap * torch.atanh(capped.clamp(-1.0, 1.0)) + position


def qk_figure(result: QKAttribution, top: int = 10) -> Figure:
    """A heatmap of the mean terms over the ``top`` query-side and ``top`` key-side components (largest
    |attribution|), and the two sides' bar charts with their 95% intervals."""
    key_side, query_side = result.key_side().head(top), result.query_side().head(top)
    rows = [result.names.index(name) for name in query_side["component"]]
    columns = [result.names.index(name) for name in key_side["component"]]
    grid = pd.DataFrame(result.terms.mean((0, 1))[rows][:, columns].cpu().numpy(), index=query_side["component"],
                        columns=key_side["component"])
    figure = new_figure(figsize=(15, 0.35 * top + 2.5))
    heat, query_ax, key_ax = figure.subplots(1, 3, gridspec_kw={"width_ratios": [1.4, 1, 1]})
    heatmap(heat, grid, center=0.0, cmap="RdBu_r", annot=top <= 10, annot_kws={"size": 6})
    heat.set_xlabel("key component")
    heat.set_ylabel("query component")
    heat.set_title(f"L{result.layer}H{result.head}: mean terms")
    for ax, frame, side in ((query_ax, query_side, "query"), (key_ax, key_side, "key")):
        errors = [frame["attribution"] - frame["ci_low"], frame["ci_high"] - frame["attribution"]]
        ax.barh(frame["component"], frame["attribution"], xerr=errors, color="tab:blue", ecolor="grey")
        ax.invert_yaxis()
        ax.axvline(0.0, color="grey", lw=0.5)
        ax.set_title(f"{side} side")
    figure.suptitle(result.note, fontsize=9)
    return figure
