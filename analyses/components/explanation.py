"""Attention as explanation: token attributions for a prediction beside the attention that looks like one.

Jain and Wallace (2019, "Attention is not Explanation") and Serrano and Smith (2019, "Is Attention
Interpretable?") asked whether the tokens a model attends to are the tokens its prediction depends
on. Here, for each prompt's prediction (a per-prompt score such as a logit difference, read at its
last real token), three attributions say how much each input token matters:

- gradient x input: ``sum_d dscore/dembed[pos, d] * embed[pos, d]`` at ``hook_embed`` (the token
  embeddings as they enter the residual stream; learned position embeddings are not attributed);
- integrated gradients (Sundararajan et al. 2017): the same with the gradient averaged along the
  straight path from a zero embedding to the real one (``steps`` midpoints); per prompt the
  attributions add up to score(real) - score(all embeddings zero), up to the Riemann sum's error;
- occlusion (erasure): score(real) - score(that token's embedding zeroed), one forward per position,
  batched.

Beside them, what attention says: the attention of the heads that matter from the predicting
position to each token (their mean), and attention rollout and flow (``analyses.components.rollout``)
at the last layer from the same position. ``explain`` measures their agreement per prompt as
Spearman rank correlations over the prompt's tokens after the first (the start token, where heads
park attention they do not use, is left out) against each attribution's magnitude.

``decisive_attention`` then asks whether a pattern that looks decisive is: for each head that matters
and prompt, the token it attends to most from the predicting position, and the change of the score
when (a) that attention weight is removed and the row renormalised (attention knockout), (b) the
head's weights over the prompt's tokens are permuted at random (Jain and Wallace's permutation), and
(c) the token itself is erased (its embedding zeroed, as in occlusion).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import pandas as pd
import seaborn as sns
import torch
from matplotlib.figure import Figure

from analyses.core.budget import DEFAULT_MEMORY_MB, rows_within
from analyses.core.execution import executing
from analyses.core.hook_check import require_edit
from analyses.core.hook_names import pattern_name, pattern_names
from analyses.core.plots import heatmap, new_figure, token_label
from analyses.core.tokens import model_tokenizer
from analyses.core.checks import check_heads
from analyses.interventions.engine import cache_run
from analyses.components.rollout import attention_rollout, flow_into
from interp.errors import UserError

# logits (batch, pos, d_vocab) of the prompts in their given order -> one score per prompt (batch,)
PromptScore = Callable[[torch.Tensor], torch.Tensor]
ATTRIBUTIONS = ("gradient_x_input", "integrated_gradients", "occlusion")
ATTENTIONS = ("attention", "rollout", "flow")
EMBED = "hook_embed"


def _scores_of(score: PromptScore, logits: torch.Tensor, copies: int) -> torch.Tensor:
    """``score`` on logits of ``copies`` consecutive copies of the batch (copies * batch, pos, vocab)
    -> (copies, batch) float32."""
    return torch.stack([score(part).float() for part in logits.unflatten(0, (copies, -1))])


def _embed_run(model, tokens: torch.Tensor, edit, copies: int, score: PromptScore) -> torch.Tensor:
    """Scores (copies, batch) of ``tokens`` repeated ``copies`` times, with ``edit(embed)`` (the
    repeated (copies * batch, pos, d_model) token embeddings -> their replacement) at ``hook_embed``."""
    repeated = tokens.repeat(copies, 1)
    logits = model.run_with_hooks(repeated, fwd_hooks=[(EMBED, lambda embed, hook: edit(embed))])
    return _scores_of(score, logits, copies)


def _copies_per_forward(model, tokens: torch.Tensor, memory_mb: float, backward: bool) -> int:
    """How many copies of the batch ``tokens`` one forward (with ``backward``, and its backward) may hold."""
    rows = rows_within(model, tokens.shape[1], memory_mb, logits=True, layers=model.cfg.n_layers if backward else 1)
    return max(1, rows // tokens.shape[0])


def gradient_x_input(model, tokens: torch.Tensor, score: PromptScore) -> torch.Tensor:
    """tokens (batch, pos) -> (batch, pos) float32: ``sum_d dscore_b/dembed[b, pos, d] * embed[b, pos, d]``
    (each prompt's own score: prompts do not see each other, so the gradient of their sum is each one's)."""
    return integrated_gradients(model, tokens, score, steps=1, alphas=torch.ones(1))


def integrated_gradients(model, tokens: torch.Tensor, score: PromptScore, steps: int = 32, *,
                         alphas: torch.Tensor | None = None, memory_mb: float = DEFAULT_MEMORY_MB) -> torch.Tensor:
    """tokens (batch, pos) -> (batch, pos) float32: ``sum_d embed[b, pos, d] * mean_alpha dscore_b/dembed``
    evaluated at ``alpha * embed``, alpha the ``steps`` midpoints of [0, 1] (or the given ``alphas``),
    several alphas per forward as ``memory_mb`` allows."""
    if steps < 1:
        raise UserError(f"steps={steps} must be a positive number of integration steps")
    alphas = (torch.arange(steps, dtype=torch.float32) + 0.5) / steps if alphas is None else alphas
    per_forward = _copies_per_forward(model, tokens, memory_mb, backward=True)
    total, embed = 0.0, None
    for chunk in alphas.split(per_forward):
        kept = {}

        def scaled(embed_rows, chunk=chunk):
            kept["embed"] = embed_rows.detach()
            kept["input"] = (embed_rows.detach() * chunk.repeat_interleave(len(tokens)).to(embed_rows)[:, None, None]
                             ).requires_grad_(True)
            return kept["input"]

        with torch.enable_grad():
            scores = _embed_run(model, tokens, scaled, len(chunk), score)
            (grad,) = torch.autograd.grad(scores.sum(), kept["input"])
        total = total + grad.float().unflatten(0, (len(chunk), -1)).sum(0)
        embed = kept["embed"][: len(tokens)].float()
    return (total / len(alphas) * embed).sum(-1)


def occlusion(model, tokens: torch.Tensor, score: PromptScore, *, memory_mb: float = DEFAULT_MEMORY_MB) -> torch.Tensor:
    """tokens (batch, pos) -> (batch, pos) float32: score - score with that position's token
    embedding zeroed, one variant per position, several per forward as ``memory_mb`` allows."""
    n_pos = tokens.shape[1]
    per_forward = _copies_per_forward(model, tokens, memory_mb, backward=False)
    with torch.no_grad():
        clean = score(model(tokens)).float()
        dropped = []
        for start in range(0, n_pos, per_forward):
            positions = torch.arange(start, min(start + per_forward, n_pos))

            def erase(embed, positions=positions):
                grouped = embed.unflatten(0, (len(positions), -1)).clone()
                grouped[torch.arange(len(positions)), :, positions] = 0
                return grouped.flatten(0, 1)

            dropped.append(_embed_run(model, tokens, erase, len(positions), score))
    return (clean[None] - torch.cat(dropped)).T  # (positions, batch) -> (batch, positions)


def head_attention(patterns: dict, heads: Sequence[tuple[int, int]], last: torch.Tensor) -> torch.Tensor:
    """The mean over ``heads`` of their attention from each prompt's position ``last[b]`` ->
    (batch, pos) float32; ``patterns``: {``hook_pattern`` name: (batch, head, q, k)}."""
    rows = torch.arange(len(last))
    return torch.stack([patterns[pattern_name(layer)][rows, head, last].float() for layer, head in heads]).mean(0)


def attention_paths(patterns: dict, n_layers: int, last: torch.Tensor, flow: bool) -> dict[str, torch.Tensor]:
    """Rollout (and with ``flow`` attention flow) through every layer, from each prompt's position
    ``last[b]`` -> {"rollout": (batch, pos), "flow": (batch, pos)}; a prompt's own tokens only
    (padding after ``last[b]`` is cut off before the flow, which it would otherwise carry)."""
    stacked = torch.stack([patterns[pattern_name(layer)] for layer in range(n_layers)], dim=1).float().cpu()
    rows = torch.arange(len(last))
    found = {"rollout": attention_rollout(stacked)[rows, -1, last]}
    if flow:
        found["flow"] = torch.zeros_like(found["rollout"])
        for b, at in enumerate(last.tolist()):
            found["flow"][b, : at + 1] = flow_into(stacked[b, ..., : at + 1, : at + 1], at)
    return found


def rank_agreement(left: torch.Tensor, right: torch.Tensor, last: torch.Tensor) -> list[float]:
    """Per prompt, the Spearman correlation of ``left`` and ``right`` (batch, pos) over positions
    1..last[b] (the start token left out; NaN where fewer than 3 positions or one side is constant)."""
    values = []
    for b, at in enumerate(last.tolist()):
        x, y = left[b, 1: at + 1].cpu().numpy(), right[b, 1: at + 1].cpu().numpy()
        constant = len(x) < 3 or np.ptp(x) == 0 or np.ptp(y) == 0
        values.append(float("nan") if constant else spearman(x, y))
    return values



def spearman(x: np.ndarray, y: np.ndarray) -> float:
    """Spearman's rank correlation of two (n,) arrays: Pearson's correlation of their ranks, ties
    given their average rank (scipy's ``spearmanr`` statistic, without depending on scipy)."""
    return float(np.corrcoef(pd.Series(x).rank().to_numpy(), pd.Series(y).rank().to_numpy())[0, 1])


@dataclass
class Explanation:
    """What ``explain`` measured.

    scores: one row per (prompt, position, method): ``prompt, position, token, method, value``, the
        methods ``ATTENTIONS`` (attention of the heads that matter, rollout, flow) and ``ATTRIBUTIONS``;
        positions up to each prompt's last real token.
    agreement: one row per (prompt, attention method, attribution): ``prompt, attention,
        attribution, spearman`` (against the attribution's magnitude, positions after the start token).
    heads: the heads whose attention was read.
    """

    scores: pd.DataFrame
    agreement: pd.DataFrame
    heads: list[tuple[int, int]]

    def summary(self) -> pd.DataFrame:
        """The agreement's mean, median and spread over prompts, per (attention, attribution)."""
        return (self.agreement.groupby(["attention", "attribution"])["spearman"]
                .agg(["mean", "median", "std", "count"]).reset_index())


def explain(model, tokens: torch.Tensor, score: PromptScore, heads: Sequence[tuple[int, int]],
            last: torch.Tensor | None = None, *, steps: int = 32, flow: bool = True,
            memory_mb: float | None = None) -> Explanation:
    """Attributions and attention for each prompt's prediction, and their rank agreement.

    tokens (batch, pos), right-padded; score: logits (batch, pos, d_vocab) -> one value per prompt
    (e.g. its logit difference at its last real token); heads: the (layer, head) pairs whose
    attention is read (those that matter for the score, from ablation or patching); last (batch,):
    each prompt's last real position, where its prediction is made (default: the last position).
    ``steps``: integrated gradients' steps; ``flow``: also attention flow (a max-flow per key
    position and layer: keep prompts short). ``memory_mb``: the attributions' budget (None: the
    current execution's, ``analyses.core.execution``)."""
    heads = check_heads(model, heads)
    if not heads:
        raise UserError("explain needs at least one (layer, head) whose attention to read")
    last = torch.full((len(tokens),), tokens.shape[1] - 1) if last is None else torch.as_tensor(last).cpu()
    _, patterns = cache_run(model, tokens, pattern_names(model), logits=False)
    read = {"attention": head_attention(patterns, heads, last).cpu(),
            **attention_paths(patterns, model.cfg.n_layers, last, flow)}
    with executing(memory_mb) as execution:
        attributed = {"gradient_x_input": gradient_x_input(model, tokens, score),
                      "integrated_gradients": integrated_gradients(model, tokens, score, steps,
                                                                   memory_mb=execution.memory_mb),
                      "occlusion": occlusion(model, tokens, score, memory_mb=execution.memory_mb)}
    attributed = {name: values.detach().cpu() for name, values in attributed.items()}
    tokenizer = model_tokenizer(model)
    rows = [{"prompt": b, "position": p, "token": tokenizer.decode([int(tokens[b, p])]), "method": method,
             "value": float(values[b, p])}
            for method, values in {**read, **attributed}.items()
            for b, at in enumerate(last.tolist()) for p in range(at + 1)]
    agreement = [{"prompt": b, "attention": seen, "attribution": name, "spearman": value}
                 for seen, attention in read.items() for name, values in attributed.items()
                 for b, value in enumerate(rank_agreement(attention, values.abs(), last))]
    return Explanation(pd.DataFrame(rows), pd.DataFrame(agreement), heads)


def _pattern_edit(head: int, last: torch.Tensor, change):
    """A ``hook_pattern`` hook replacing, for each prompt b, head ``head``'s row at query ``last[b]``
    by ``change(b, row)`` (the row over the prompt's keys 0..last[b])."""

    def hook(pattern, hook):
        for b, at in enumerate(last.tolist()):
            pattern[b, head, at, : at + 1] = change(b, pattern[b, head, at, : at + 1])
        return pattern

    return hook


def decisive_attention(model, tokens: torch.Tensor, score: PromptScore, heads: Sequence[tuple[int, int]],
                       last: torch.Tensor | None = None, *, seed: int = 0) -> pd.DataFrame:
    """Is the token a head attends to most decisive? One row per (head, prompt): ``layer, head,
    prompt, top_position, top_token, top_weight`` (its attention from position ``last[b]`` to the
    token it attends to most, the start token excluded), ``knockout`` (score change when that weight
    is zeroed and the row renormalised), ``permuted`` (score change when the head's weights over the
    prompt's tokens are permuted at random, seeded), ``erased`` (score change when that token's
    embedding is zeroed). Changes are edited - clean: negative where the edit hurts the prediction."""
    heads = check_heads(model, heads)
    require_edit(model, "hook_pattern", "decisive_attention")
    last = torch.full((len(tokens),), tokens.shape[1] - 1) if last is None else torch.as_tensor(last).cpu()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        clean = score(model(tokens)).float().cpu()
        _, patterns = cache_run(model, tokens, [pattern_name(layer) for layer, _ in heads], logits=False)
        erased_all = -occlusion(model, tokens, score).cpu()  # (batch, pos): edited - clean
        rows, tokenizer = [], model_tokenizer(model)
        for layer, head in heads:
            weights = patterns[pattern_name(layer)][torch.arange(len(last)), head, last].float().cpu()
            weights[:, 0] = -1  # the start token is not a candidate
            top = weights.argmax(-1)

            def knockout(b, row):
                kept = row.clone()
                kept[top[b]] = 0
                return kept / kept.sum().clamp(min=1e-12)

            def permute(b, row):
                return row[torch.randperm(len(row), generator=generator).to(row.device)]

            edited = {}
            for name, change in (("knockout", knockout), ("permuted", permute)):
                logits = model.run_with_hooks(tokens, fwd_hooks=[(pattern_name(layer), _pattern_edit(head, last, change))])
                edited[name] = score(logits).float().cpu() - clean
            for b in range(len(last)):
                rows.append({"layer": layer, "head": head, "prompt": b, "top_position": int(top[b]),
                             "top_token": tokenizer.decode([int(tokens[b, top[b]])]),
                             "top_weight": float(weights[b, top[b]]), "knockout": float(edited["knockout"][b]),
                             "permuted": float(edited["permuted"][b]), "erased": float(erased_all[b, top[b]])})
    return pd.DataFrame(rows)


def explanation_figure(explanation: Explanation, prompt: int = 0) -> Figure:
    """One prompt's tokens (columns) under every method (rows), each row scaled to its largest
    magnitude, beside the agreement over all prompts (Spearman, per attention and attribution)."""
    scores = explanation.scores[explanation.scores["prompt"] == prompt]
    if scores.empty:
        raise UserError(f"prompt {prompt} is not in this explanation (prompts 0..{explanation.scores['prompt'].max()})")
    grid = scores.pivot(index="method", columns="position", values="value")
    grid = grid.loc[[m for m in (*ATTENTIONS, *ATTRIBUTIONS) if m in grid.index]]
    scaled = grid.div(grid.abs().max(axis=1).replace(0, 1), axis=0)
    labels = [token_label(t) for t in scores.drop_duplicates("position").sort_values("position")["token"]]
    figure = new_figure(figsize=(12, 4.5))
    left, right = figure.subplots(1, 2, width_ratios=[3, 1.4])
    heatmap(left, scaled, cmap="RdBu_r", center=0, vmin=-1, vmax=1, xticklabels=labels, cbar=False)
    left.set_title(f"prompt {prompt}: each row scaled to its largest |value|")
    left.set_ylabel("")
    sns.boxplot(explanation.agreement, x="spearman", y="attribution", hue="attention", ax=right)
    right.axvline(0, color="grey", lw=0.8)
    right.set_title("rank agreement over prompts")
    return figure
