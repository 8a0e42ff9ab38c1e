"""MLP neurons: which of a layer's neurons matter for a metric, and which tokens each one promotes.

A neuron is one coordinate of an MLP's hidden activation, ``blocks.{l}.mlp.hook_post`` (batch, pos,
d_mlp), the hook both backends name as TransformerLens does. Geva et al. (2021, "Transformer
Feed-Forward Layers Are Key-Value Memories") read an MLP as a memory: neuron i's input weights are a
key that decides how strongly it fires, and row i of ``W_out[l]`` is the value it then adds to the
residual stream, scaled by its activation. Geva et al. (2022, "... Build Predictions by Promoting
Concepts in the Vocabulary Space") read a value in the vocabulary: ``W_out[l, i] @ W_U`` scores
every token, and the top ones are what the neuron promotes (the final norm is left out, as there:
it rescales the residual as a whole, and with RMSNorm per dimension, so the ranking is a reading,
not a measurement - ``promotion_effects`` measures it).

- ``neuron_effects``: every neuron's first-order effect on a metric when its activation is replaced
  (zero, or its mean over the prompts and positions), from one forward and backward (attribution:
  dmetric/dactivation . (replacement - activation), summed over prompts and positions), then the
  exact effect of ablating each of the strongest ones alone, one variant per neuron batched
  through the intervention engine (on GPTModel a suffix run from the layer), a mean over prompts
  with its 95% interval (a bootstrap over prompts of the per-prompt effects of the same forwards);
  the attribution is a first-order estimate, without an interval.
- ``promoted_tokens``: the top tokens of each neuron's value vector through the unembedding.
- ``promotion_effects``: the promotion confirmed by ablation: how much the neuron's top tokens'
  logits fall, beyond the mean logit's fall, when it is ablated.
"""

from __future__ import annotations

from typing import Sequence

import pandas as pd
import torch
from einops import einsum

from analyses.core.budget import DEFAULT_MEMORY_MB
from analyses.core.execution import executing
from analyses.core.hook_names import has_mlps, mlp_post_name
from analyses.core.metrics import Metric, PromptMeanMetric, evaluate_metric, prompt_scores
from analyses.core.stats import effect_intervals
from analyses.core.tokens import as_tokens, model_tokenizer
from analyses.core.checks import check_choice, check_layer
from analyses.interventions.engine import (Edit, activation_gradients, base_run, cache_run, gradient_parts,
                                           score_variants)
from interp.errors import UserError

NEURON_METHODS = ("zero", "mean")
DEFAULT_EXACT = 20  # how many of the strongest neurons by attribution get an exact ablation


def check_mlp_layer(model, layer: int) -> None:
    """Refuse, in one line, a model without MLPs or a layer out of range."""
    if not has_mlps(model):
        raise UserError("neuron analyses need MLPs; this model is attention-only")
    check_layer(model, layer)


def neuron_replacement(activation: torch.Tensor, method: str) -> torch.Tensor:
    """What replaces each neuron's activation (batch, pos, d_mlp) -> (1, 1, d_mlp): zero, or its mean
    over every prompt and position of the batch."""
    check_choice("neuron ablation method", method, NEURON_METHODS)
    if method == "zero":
        return activation.new_zeros(1, 1, activation.shape[-1])
    return activation.float().mean(dim=(0, 1))[None, None].to(activation.dtype)


def neuron_attribution(model, tokens: torch.Tensor, metric: Metric, layer: int, replacement: torch.Tensor,
                       memory_mb: float = DEFAULT_MEMORY_MB) -> torch.Tensor:
    """The first-order change of ``metric`` when each neuron of ``layer`` takes ``replacement``
    (broadcast to (batch, pos, d_mlp)) at every position -> (d_mlp,) float32: the sum over prompts
    and positions of dmetric/dactivation x (replacement - activation), over chunks of prompts that
    fit ``memory_mb`` (a prompt's gradient of the batch's metric is its chunk's times the chunk's share)."""
    name, d_mlp = mlp_post_name(layer), model.blocks[layer].mlp.W_out.shape[0]
    parts, positions = gradient_parts(model, tokens, metric, memory_mb, per_position=2 * d_mlp)
    total = torch.zeros(d_mlp, dtype=torch.float32, device=tokens.device)
    for part in parts:
        _, acts, grads = activation_gradients(model, tokens[part.rows], part.metric, [name], positions=positions)
        moved = (replacement - acts[name]).float()
        total += part.share * einsum(grads[name].float(), moved, "b p n, b p n -> n")
    return total


def neuron_effects(model, tokens, metric: Metric, layer: int, *, method: str = "zero",
                   exact: int | str = DEFAULT_EXACT, memory_mb: float | None = None,
                   progress: bool | None = None) -> pd.DataFrame:
    """Which neurons of ``layer``'s MLP matter for ``metric`` on ``tokens`` (texts of equal token
    length or ids (batch, pos)) -> a tidy frame, one row per neuron, the strongest attribution first:
    ``layer, neuron, activation`` (its mean over prompts and positions), ``attribution`` (the
    first-order change of the metric when it is ablated, ``neuron_attribution``), ``effect`` (the
    exact change: the metric with that neuron alone ablated at every position, minus ``baseline``;
    NaN where not run), ``ci_low``, ``ci_high`` (its 95% interval over prompts, a percentile bootstrap
    of the per-prompt effects, ``analyses.core.stats.effect_intervals``; NaN where not run or
    for a metric without a per-prompt form), ``n_prompts``, ``baseline``.

    ``method``: what replaces the activation, ``zero`` or ``mean`` (``neuron_replacement``).
    ``exact``: how many neurons, the largest |attribution| first, get the exact ablation, or
    ``"all"`` for every one (d_mlp variants). ``memory_mb``, ``progress``: the execution's
    (``analyses.core.execution``; None: the current one's). Deterministic."""
    check_mlp_layer(model, layer)
    if not (exact == "all" or isinstance(exact, int) and exact >= 0):
        raise UserError(f"exact={exact!r} must be a number of neurons (>= 0) or 'all'")
    tokens, name = as_tokens(model, tokens), mlp_post_name(layer)
    logits, cache, starts = base_run(model, tokens, [name])
    baseline = float(evaluate_metric(metric, logits))
    base_scores = prompt_scores(metric, logits)
    activation = cache[name]
    replacement = neuron_replacement(activation, method)
    with executing(memory_mb, progress) as execution:
        attribution = neuron_attribution(model, tokens, metric, layer, replacement, execution.memory_mb).cpu()
        order = attribution.abs().argsort(descending=True, stable=True)
        checked = order if exact == "all" else order[:exact]
        effect = torch.full_like(attribution, torch.nan, dtype=torch.float64)
        low, high, n_prompts = effect.clone(), effect.clone(), len(tokens)
        if len(checked):
            variants = [[Edit(name, (slice(None), int(neuron)))] for neuron in checked]
            scores = score_variants(model, tokens, variants, {name: replacement.expand_as(activation)}, metric,
                                    starts=starts, desc="neuron ablations")
            effect[checked] = scores.values.cpu().double() - baseline
            low[checked], high[checked], n_prompts = effect_intervals(scores, base_scores, len(tokens))
    return pd.DataFrame({
        "layer": layer, "neuron": order.cpu().numpy(),
        "activation": activation.float().mean(dim=(0, 1))[order.to(activation.device)].cpu().numpy(),
        "attribution": attribution[order].cpu().numpy(), "effect": effect[order].cpu().numpy(),
        "ci_low": low[order].cpu().numpy(), "ci_high": high[order].cpu().numpy(), "n_prompts": n_prompts, "baseline": baseline,
    })


def value_logits(model, layer: int, neurons: Sequence[int]) -> torch.Tensor:
    """Each neuron's value vector read in the vocabulary: ``W_out[layer, neurons] @ W_U`` ->
    (len(neurons), d_vocab_out) float32 (no final norm; see the module docstring)."""
    check_mlp_layer(model, layer)
    w_out = model.blocks[layer].mlp.W_out  # (d_mlp, d_model): this layer's alone, not every layer's stacked
    bad = [n for n in neurons if not 0 <= int(n) < w_out.shape[0]]
    if bad:
        raise UserError(f"neuron {bad[0]} out of range [0, {w_out.shape[0]})")
    with torch.no_grad():
        return w_out[[int(n) for n in neurons]].float() @ model.W_U.float()


def promoted_tokens(model, layer: int, neurons: Sequence[int], k: int = 10) -> pd.DataFrame:
    """The ``k`` tokens each neuron promotes most (Geva et al. 2022) -> one row per (neuron, rank):
    ``layer, neuron, rank, token_id, token, score`` (``value_logits``)."""
    if k <= 0:
        raise UserError(f"k={k} must be a positive number of tokens")
    scores, ids = value_logits(model, layer, neurons).topk(k, dim=-1)
    tokenizer = model_tokenizer(model)
    return pd.DataFrame([
        {"layer": layer, "neuron": int(neuron), "rank": rank, "token_id": int(token),
         "token": tokenizer.decode([int(token)]), "score": float(score)}
        for neuron, row_scores, row_ids in zip(neurons, scores, ids)
        for rank, (score, token) in enumerate(zip(row_scores, row_ids))
    ])


def promotion_metric(token_ids: Sequence[int], position: int = -1) -> Metric:
    """logits (batch, pos, d_vocab) -> the mean over prompts, at ``position``, of the mean logit of
    ``token_ids`` minus the mean logit over the vocabulary (a shift of every logit cancels)."""
    ids = torch.as_tensor(list(token_ids))

    def scores(logits: torch.Tensor) -> torch.Tensor:  # (batch, pos, d_vocab) -> (batch,)
        at = logits[:, position].float()
        return at[:, ids.to(at.device)].mean(-1) - at.mean(-1)

    return PromptMeanMetric(scores, read_positions=[position])


def promotion_effects(model, tokens, layer: int, neurons: Sequence[int], *, k: int = 10, position: int = -1,
                      method: str = "zero", memory_mb: float | None = None) -> pd.DataFrame:
    """The promotion confirmed by ablation: for each neuron, how much its ``k`` top tokens
    (``promoted_tokens``) lose, relative to the mean logit, at ``position`` of ``tokens`` when it is
    ablated at every position -> one row per neuron: ``layer, neuron, promotion`` (the metric
    ``promotion_metric`` of its tokens unablated minus ablated: positive where the neuron raises
    them), ``activation`` (its mean at ``position``). A neuron that does not fire on these prompts
    promotes nothing here, whatever its value vector says. The ablations run within ``memory_mb``
    (None: the current execution's, ``analyses.core.execution``), without a bar."""
    check_mlp_layer(model, layer)
    tokens, name = as_tokens(model, tokens), mlp_post_name(layer)
    top = value_logits(model, layer, neurons).topk(k, dim=-1).indices.cpu()
    logits, cache = cache_run(model, tokens, [name])
    activation = cache[name]
    source = neuron_replacement(activation, method).expand_as(activation)
    rows = []
    for neuron, ids in zip(neurons, top):
        metric = promotion_metric(ids.tolist(), position)
        clean = evaluate_metric(metric, logits)
        with executing(memory_mb, progress=False):
            ablated = score_variants(model, tokens, [[Edit(name, (slice(None), int(neuron)))]], {name: source},
                                     metric).values[0]
        rows.append({"layer": layer, "neuron": int(neuron), "promotion": float(clean - ablated),
                     "activation": float(activation[:, position, int(neuron)].float().mean())})
    return pd.DataFrame(rows)
