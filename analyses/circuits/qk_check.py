"""QK attribution confirmed by intervention: does a head's attribution name the components whose
removal from its key (query) input moves its attention the most?

For one head and a set of (query, key) pairs, ``qk_intervention_check`` measures two things per
component of the head's input residual (``decompose_residual(model, tokens, layer=L)``'s parts):

- the attribution: its key-side (query-side) share of the contrast ``qk_attribution(...,
  baseline="mean_other_keys")``, the pair's score minus the mean score of the other keys the query
  sees, summed over the other side's components (the pre-attention norm frozen at the clean run);
- the intervention: the drop of the head's attention weight on the pair's key when that component's
  part is subtracted from the head's own key (query) input alone, the path into this head's keys
  (queries) only (``GPTModel.set_split_qkv_inputs``: every query head reads its own copy of the
  residual; the norm is recomputed on the edited copy, as the model runs it). Other heads, other
  inputs and earlier layers keep the clean run.

The agreement is the Spearman rank correlation of the two over the components and the overlap of
their top ``k`` (the largest attributions and the largest drops), each with a percentile bootstrap
interval over prompts (``analyses.core.stats.resample_weights``: every resample recomputes both
means on the same prompts). Cost: per chunk of prompts one clean forward, then per component only
the head's own layer's attention where the model can start a forward part-way (GPTModel; a
TransformerBridge runs every layer up to it), plus ``qk_attribution``'s.

``role_pairs`` gives the pairs a role defines on repeated-segment probes: each query where the role
has a target, with that target as its key (``analyses.roles.classify.probe_targets``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from analyses.components.decompose import decompose_residual
from analyses.components.qk import chunk_prompts, qk_attribution
from analyses.core.execution import executing
from analyses.core.hook_names import pattern_name, qkv_input_name, resid_pre_name
from analyses.core.probes import RepeatedProbes
from analyses.core.stats import N_BOOT, percentile_bounds, resample_weights
from analyses.circuits.edge_attribution import split_qkv_inputs
from analyses.core.checks import check_choice
from analyses.interventions.engine import Edit, cache_run, collect_variants, runs_suffix_only
from analyses.roles.classify import probe_targets
from interp.errors import UserError

SIDES = ("key", "query")
PAIR_ROLES = ("induction", "previous_token", "duplicate_token")


def role_pairs(probes: RepeatedProbes, role: str, max_pairs: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(query_pos, key_pos), each (prompts, pairs): per probe the last ``pairs`` queries where ``role``
    has a target key, and that key; ``pairs`` is the fewest any probe has (at most ``max_pairs``)."""
    check_choice("role", role, PAIR_ROLES)
    targets = probe_targets(probes).targets[role]  # (batch, q, k) one-hot on the rows where it is defined
    defined = targets.sum(-1) > 0
    n_pairs = int(defined.sum(-1).min())
    if max_pairs is not None:
        n_pairs = min(n_pairs, max_pairs)
    if n_pairs == 0:
        raise UserError(f"some probe has no query where the role {role!r} is defined")
    queries = torch.stack([row.nonzero()[-n_pairs:, 0] for row in defined])
    keys = targets.argmax(-1).gather(1, queries)
    return queries, keys


@dataclass(frozen=True)
class QKCheck:
    """frame: one row per component, ``component, attribution, drop`` (means over pairs and prompts)
    with their ``*_ci_low``/``*_ci_high``; spearman and overlap (the share of the top ``k``
    attributions among the top ``k`` drops) with their 95% intervals; side; n_prompts."""

    frame: pd.DataFrame
    spearman: float
    spearman_ci: tuple[float, float]
    overlap: float
    overlap_ci: tuple[float, float]
    k: int
    side: str
    n_prompts: int


@torch.no_grad()
def qk_intervention_check(model, tokens: torch.Tensor, layer: int, head: int, query_pos, key_pos, *, side: str = "key",
                          k: int = 3, n_boot: int = N_BOOT, seed: int = 0,
                          memory_mb: float | None = None) -> QKCheck:
    """Agreement of ``head``'s ``side`` attribution with removal of each component from that input
    alone (module docstring). tokens (prompts, pos); query_pos, key_pos (prompts, pairs); ``k``: the
    top-k of the overlap, at most the number of components (a layer-0 head reads two or three;
    ``QKCheck.k`` says which k was used). ``memory_mb``: the execution's (``analyses.core.execution``;
    None: the current one's)."""
    check_choice("side", side, SIDES)
    with executing(memory_mb) as execution:
        attribution = qk_attribution(model, tokens, layer, head, query_pos, key_pos, "mean_other_keys")
        query_pos, key_pos = attribution.query_pos, attribution.key_pos
        per_side = attribution.terms.sum(2 if side == "key" else 3).mean(1)  # (prompts, C)
        chunk = chunk_prompts(model, layer, tokens.shape[1], query_pos.shape[1], execution.memory_mb)
        drops = torch.cat([_drops(model, tokens[at:at + chunk], layer, head, query_pos[at:at + chunk],
                                  key_pos[at:at + chunk], side) for at in range(0, len(tokens), chunk)])
    n_parts = drops.shape[1]  # the residual's parts; the extra terms (biases, ALiBi) cannot be removed from the input
    names, per_side = attribution.names[:n_parts], per_side[:, :n_parts].cpu().double()
    if k < 1:
        raise UserError(f"k={k} must be at least 1")
    k = min(k, n_parts)
    weights = resample_weights(len(tokens), n_boot, seed)  # (n_boot, prompts)
    attr_means, drop_means = (weights @ values / len(tokens) for values in (per_side, drops))
    spearman = _spearman(attr_means, drop_means)
    overlap = _overlap(attr_means, drop_means, k)
    full_attr, full_drop = per_side.mean(0, keepdim=True), drops.mean(0, keepdim=True)
    frame = pd.DataFrame({"component": list(names), "attribution": full_attr[0].cpu().numpy(), "drop": full_drop[0].cpu().numpy()})
    for column, means in (("attribution", attr_means), ("drop", drop_means)):
        low, high = percentile_bounds(means)
        frame[f"{column}_ci_low"], frame[f"{column}_ci_high"] = low.cpu().numpy(), high.cpu().numpy()
    return QKCheck(frame, float(_spearman(full_attr, full_drop)[0]), _bounds(spearman),
                   float(_overlap(full_attr, full_drop, k)[0]), _bounds(overlap), k, side, len(tokens))


def _drops(model, tokens: torch.Tensor, layer: int, head: int, query_pos: torch.Tensor, key_pos: torch.Tensor,
           side: str) -> torch.Tensor:
    """(prompts, C) float64: the mean over pairs of the head's attention on the pair's key, clean minus
    with component c's part subtracted from the head's own ``side`` input. One variant per
    component, run by the engine from the clean residual entering ``layer`` where the model can start
    there (GPTModel: only this layer's attention runs per component) and stopped at its pattern, within
    the current execution's memory."""
    entering, pattern = resid_pre_name(layer), pattern_name(layer)
    _, clean = cache_run(model, tokens, [entering, pattern], logits=False)  # stopped at the head's layer
    resid = clean[entering]  # (b, pos, d_model): every head's clean q/k/v input
    starts = {entering: resid} if runs_suffix_only(model) else None
    parts = decompose_residual(model, tokens, layer=layer).parts  # (C, b, pos, d_model)
    which = "k" if side == "key" else "q"
    variants = [[Edit(qkv_input_name(layer, which), (slice(None), head), resid - part)] for part in parts]
    with split_qkv_inputs(model, [which]):
        edited = collect_variants(model, tokens, variants, {}, [pattern], starts=starts)[pattern]  # (C, b, head, q, k)
    patterns = torch.cat([clean[pattern][None], edited])[:, :, head].cpu().double()
    rows = torch.arange(len(tokens))[:, None]
    attention = patterns[:, rows, query_pos, key_pos].mean(-1)  # (1 + C, b)
    return (attention[:1] - attention[1:]).T


def _spearman(a: torch.Tensor, b: torch.Tensor) -> np.ndarray:
    """Row-wise Spearman correlation of a, b (rows, C) (ties averaged) -> (rows,)."""
    ranks_a, ranks_b = (pd.DataFrame(x.cpu().double().numpy()).rank(axis=1).to_numpy() for x in (a, b))
    ranks_a, ranks_b = ranks_a - ranks_a.mean(1, keepdims=True), ranks_b - ranks_b.mean(1, keepdims=True)
    return (ranks_a * ranks_b).sum(1) / np.sqrt((ranks_a ** 2).sum(1) * (ranks_b ** 2).sum(1))


def _overlap(a: torch.Tensor, b: torch.Tensor, k: int) -> np.ndarray:
    """Row-wise share of the top ``k`` entries of a (rows, C) that are among the top ``k`` of b -> (rows,)."""
    top_a, top_b = a.topk(k, dim=1).indices, b.topk(k, dim=1).indices
    return (top_a[:, :, None] == top_b[:, None, :]).any(-1).cpu().double().numpy().mean(1)


def _bounds(values: np.ndarray) -> tuple[float, float]:
    low, high = percentile_bounds(torch.as_tensor(values)[:, None])
    return float(low[0]), float(high[0])
