"""Backup heads and self-repair (DESIGN 4.7), batched through the intervention engine.

- **Pairwise ablation**: for heads A and B, the effect of ablating both together against the sum
  of their single effects. ``excess = joint - (effect_A + effect_B)``: with a loss metric
  (effects are rises in loss), a positive excess means that each head covers for the other (the
  pair matters more than its parts: backup, redundancy); negative, that their effects overlap.
  Heads joined by an excess of at least ``min_excess`` are one **backup group** (connected
  components), and each group is ablated as a whole.
- **Direct vs total effect** (McGrath et al. 2023, "the Hydra effect"): a head's *total* effect
  is the ordinary ablation effect, where every later component reacts; its *direct* effect is
  the same ablation with everything downstream frozen at its unablated value (every later
  layer's head outputs, and every MLP output from the head's own layer on), so the change
  reaches the logits only through the residual stream and the unembedding. The residual stream
  being a sum, the final residual then moves by exactly the head's own change of output,
  ``(z_ablated - z_clean)[head] @ W_O[layer, head]`` (the output bias is unchanged), so on a model
  that can start at the final norm (``GPTModel``) the direct effect is computed from that alone:
  the metric of ``unembed(final_resid_clean + delta)`` (the final norm recomputed, as a rerun
  would), no block rerun; elsewhere (a ``TransformerBridge``, whose ``start_at_layer`` reruns the
  earlier blocks) by rerunning the blocks after the head with every later output frozen.
  ``self_repair = direct - total``: how much of the direct effect later components undo.

Every set of ablations is one ``evaluate_variants`` call (one forward per chunk of variants;
suffix-only on ``GPTModel``).
"""

from __future__ import annotations

from itertools import combinations
from typing import Sequence

import pandas as pd
import torch

from analyses.interventions.ablation import Ablation, ablation_reads, prepare_ablation, prompts_run
from analyses.core.budget import DEFAULT_MEMORY_MB
from analyses.core.hook_check import EDIT_TOLERANCE, probe_effect, probe_tokens
from analyses.core.hook_names import final_resid_name, mlp_out_name, z_name, z_names
from analyses.interventions.engine import (Edit, check_heads, evaluate_chunks, evaluate_variants, head_cells,
                                           partial_logits, rows_of, runs_suffix_only)
from analyses.core.metrics import Metric
from analyses.interventions.run import Run
from interp.errors import UserError

DEFAULT_MIN_EXCESS = 0.05  # nats: a pair whose joint effect exceeds the sum of its single effects by this much backs itself up


def head_label(head: tuple[int, int]) -> str:
    return f"L{head[0]}H{head[1]}"


def pairwise_ablation(model, prompts, heads: Sequence[tuple[int, int]], method: str = "mean",
                      metric: Metric | None = None, *, memory_mb: float = DEFAULT_MEMORY_MB,
                      progress: bool | None = None, run: Run | None = None) -> pd.DataFrame:
    """Ablate each of ``heads`` alone and every pair together (one batched call).

    prompts: ids, texts or ``RepeatedProbes`` (see ``analyses.interventions.ablation``); metric: default the mean
    next-token loss; run: a ``Run`` of the prompts (``prepare_ablation``). Returns one row per pair: ``a, b`` (labels ``L{l}H{h}``), ``layer_a, head_a,
    layer_b, head_b, effect_a, effect_b, joint, additive`` (effect_a + effect_b), ``excess``
    (joint - additive), ``baseline``.
    """
    heads = check_heads(model, heads)
    if len(heads) < 2:
        raise UserError(f"pairwise ablation needs at least 2 heads, got {len(heads)}")
    ablation = prepare_ablation(model, prompts, method, metric, run=run, memory_mb=memory_mb)
    pairs = list(combinations(heads, 2))
    values = ablation.run([[h] for h in heads] + [list(p) for p in pairs], memory_mb=memory_mb,
                          progress=progress, desc="pairwise ablation") - ablation.baseline
    single = dict(zip(heads, values[:len(heads)].tolist()))
    rows = [{"a": head_label(a), "b": head_label(b), "layer_a": a[0], "head_a": a[1], "layer_b": b[0], "head_b": b[1],
             "effect_a": single[a], "effect_b": single[b], "joint": joint}
            for (a, b), joint in zip(pairs, values[len(heads):].tolist())]
    frame = pd.DataFrame(rows)
    frame["additive"] = frame["effect_a"] + frame["effect_b"]
    frame["excess"] = frame["joint"] - frame["additive"]
    frame["baseline"] = ablation.baseline
    return frame


def backup_groups(pairs: pd.DataFrame, min_excess: float = DEFAULT_MIN_EXCESS) -> list[list[str]]:
    """Connected components of the heads joined by ``excess >= min_excess`` in a
    ``pairwise_ablation`` table -> groups of head labels (each sorted, groups by first member);
    heads with no such partner are left out."""
    parent: dict[str, str] = {}

    def root(label: str) -> str:
        while parent.setdefault(label, label) != label:
            label = parent[label]
        return label

    for a, b in pairs.loc[pairs["excess"] >= min_excess, ["a", "b"]].itertuples(index=False):
        parent[root(a)] = root(b)
    groups: dict[str, list[str]] = {}
    for label in parent:
        groups.setdefault(root(label), []).append(label)
    return sorted((sorted(g, key=_label_key) for g in groups.values()), key=lambda g: _label_key(g[0]))


def _label_key(label: str) -> tuple[int, int]:
    layer, head = label[1:].split("H")
    return int(layer), int(head)


def backup_report(model, prompts, heads: Sequence[tuple[int, int]], method: str = "mean",
                  metric: Metric | None = None, *, min_excess: float = DEFAULT_MIN_EXCESS,
                  memory_mb: float = DEFAULT_MEMORY_MB, progress: bool | None = None,
                  run: Run | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Pairwise ablation of ``heads`` and their backup groups, each ablated as a whole (``run``: a
    ``Run`` of the prompts, made here where None, that both steps read).

    Returns (pairs: see ``pairwise_ablation``, groups: one row per group ``group`` (0..),
    ``heads`` (labels joined by ';'), ``n_heads``, ``sum_single`` (the sum of its heads' single
    effects), ``joint`` (all of them ablated together), ``excess`` (joint - sum_single))."""
    run = run if run is not None else prompts_run(model, prompts, ablation_reads(model, method),
                                                  memory_mb=memory_mb)
    pairs = pairwise_ablation(model, prompts, heads, method, metric, memory_mb=memory_mb, progress=progress, run=run)
    groups = backup_groups(pairs, min_excess)
    single = dict(zip(pairs["a"], pairs["effect_a"])) | dict(zip(pairs["b"], pairs["effect_b"]))
    joint = torch.empty(0)
    if groups:
        ablation = prepare_ablation(model, prompts, method, metric, run=run, memory_mb=memory_mb)
        members = [[_label_key(label) for label in group] for group in groups]
        joint = ablation.run(members, memory_mb=memory_mb, progress=progress, desc="backup groups") - ablation.baseline
    frame = pd.DataFrame({
        "group": range(len(groups)),
        "heads": [";".join(g) for g in groups],
        "n_heads": [len(g) for g in groups],
        "sum_single": [sum(single[label] for label in g) for g in groups],
        "joint": joint.tolist(),
    })
    frame["excess"] = frame["joint"] - frame["sum_single"]
    return pairs, frame


def direct_effect_reads(model, method: str) -> list[str]:
    """What ``direct_and_total_effects`` reads from a ``Run`` of its prompts: the ablation's hooks,
    every ``hook_z``, and the final residual (a model that starts at the final norm) or every
    ``hook_mlp_out`` (one that reruns the blocks with them frozen)."""
    frozen = [final_resid_name(model)] if runs_suffix_only(model) else mlp_out_names(model)
    return list(dict.fromkeys([*ablation_reads(model, method), *z_names(model), *frozen]))


def mlp_out_names(model) -> list[str]:
    """Every layer's ``hook_mlp_out`` that the model has (none for attention-only models)."""
    names = [mlp_out_name(layer) for layer in range(model.cfg.n_layers)]
    return [name for name in names if name in model.hook_dict]


def require_mlp_freeze(model, names: Sequence[str]) -> None:
    """Refuse direct effects in one line where an edit of ``hook_mlp_out`` does not reach the output,
    measured with the hook self-test's probe (``probe_effect``: a fixed pattern added, the last
    layer first), which changes the activation whatever it is, an MLP writing exactly zero too."""
    if not names:
        return
    tokens = probe_tokens(model)
    with torch.no_grad():
        logits = model(tokens)
    if probe_effect(model, tokens, logits, names[::-1]) <= EDIT_TOLERANCE:
        raise UserError("direct effects freeze the MLP outputs, but edits of hook_mlp_out do not reach the output "
                        "of this model; see `interp check`")


def direct_and_total_effects(model, prompts, heads: Sequence[tuple[int, int]] | None = None, method: str = "mean",
                             metric: Metric | None = None, *, memory_mb: float = DEFAULT_MEMORY_MB,
                             progress: bool | None = None, run: Run | None = None) -> pd.DataFrame:
    """Each head's total and direct ablation effect (see the module docstring; ``run``: a ``Run``
    of the prompts reading at least ``direct_effect_reads``, made here where None).

    heads: default every head. Returns one row per head: ``layer, head, total, direct,
    self_repair`` (direct - total), ``baseline``. One batched call for the totals; the direct
    effects from the final residual (``final_residual_effects``) where the model starts at the
    final norm, else one rerun per layer (each freezes a different set of downstream outputs).
    """
    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
    heads = check_heads(model, heads if heads is not None else [(l, h) for l in range(n_layers) for h in range(n_heads)])
    ablation = prepare_ablation(model, prompts, method, metric, run=run, memory_mb=memory_mb)
    total = ablation.run([[h] for h in heads], memory_mb=memory_mb, progress=progress, desc="total effects")
    if runs_suffix_only(model):
        direct = final_residual_effects(ablation, heads, memory_mb, progress).double()  # float64 as the totals
    else:
        mlps = mlp_out_names(model)
        require_mlp_freeze(model, mlps)
        clean = ablation.base.read([*z_names(model), *mlps])
        direct = torch.empty(len(heads), dtype=torch.float64)
        for layer in sorted({l for l, _ in heads}):
            members = [i for i, (l, _) in enumerate(heads) if l == layer]
            direct[members] = frozen_downstream_run(ablation, clean, layer, [heads[i][1] for i in members],
                                                    mlps, memory_mb, progress)
    return pd.DataFrame({
        "layer": [l for l, _ in heads], "head": [h for _, h in heads],
        "total": (total - ablation.baseline).numpy(), "direct": (direct - ablation.baseline).numpy(),
    }).assign(self_repair=lambda f: f["direct"] - f["total"], baseline=ablation.baseline)


def frozen_downstream_run(ablation: Ablation, clean: dict, layer: int, heads: Sequence[int], mlps: Sequence[str],
                          memory_mb: float, progress: bool | None) -> torch.Tensor:
    """The metric with each head of ``layer`` in ``heads`` ablated and every later head output and
    every MLP output from ``layer`` on held at ``clean`` -> (len(heads),) float64."""
    later = [z_name(l) for l in range(layer + 1, ablation.model.cfg.n_layers)]
    frozen = [name for name in mlps if int(name.split(".")[1]) >= layer] + later
    sources = {z_name(layer): ablation.sources[z_name(layer)]} | {name: clean[name] for name in frozen}
    variants = [head_cells([(layer, h)]) + [Edit(name) for name in frozen] for h in heads]
    values = evaluate_variants(ablation.model, ablation.tokens, variants, sources, ablation.metric,
                               starts=ablation.starts, memory_mb=memory_mb, progress=progress, desc="direct effects")
    return values.double()


def final_residual_effects(ablation: Ablation, heads: Sequence[tuple[int, int]], memory_mb: float,
                           progress: bool | None) -> torch.Tensor:
    """The metric with each of ``heads`` ablated alone and everything downstream frozen, from the
    final residual: ``unembed(final_clean + (z_source - z_clean)[:, :, h] @ W_O[l, h])`` (the
    change in float32, (rows, pos, d_model)), unembedded at the metric's read positions only, in
    the chunks of heads and prompts that ``evaluate_chunks`` makes within ``memory_mb`` ->
    (len(heads),) float32. Needs a model whose ``unembed`` is the final norm and the unembedding
    (``GPTModel``: ``runs_suffix_only``)."""
    model, batch = ablation.model, ablation.tokens.shape[0]
    clean = ablation.base.read([final_resid_name(model), *dict.fromkeys(z_name(layer) for layer, _ in heads)])

    def chunk_logits(members: list, rows: slice, positions: torch.Tensor | None, compact: bool) -> torch.Tensor:
        at = positions if compact else slice(None)
        final = clean[final_resid_name(model)][rows][:, at]  # (rows, n, d_model)
        moved = torch.stack([final.float() + head_write_change(ablation, clean, *heads[v], rows, at)
                             for v in members]).to(final.dtype).flatten(0, 1)
        logits = model.unembed(moved) if compact or positions is None else partial_logits(model, moved, positions)
        return logits.unflatten(0, (len(members), -1))

    with torch.no_grad():
        return evaluate_chunks(model, ablation.tokens, [head_cells([head]) for head in heads], ablation.metric,
                               chunk_logits, read_only=True, memory_mb=memory_mb, progress=progress,
                               desc="direct effects")


def head_write_change(ablation: Ablation, clean: dict, layer: int, head: int, rows: slice,
                      at: torch.Tensor | slice = slice(None)) -> torch.Tensor:
    """How the head's write to the residual stream changes under the ablation on the prompts ``rows``
    at the positions ``at``, in float32: (z_source - z_clean)[rows, at, head] @ W_O[layer, head] ->
    (rows, n, d_model), the block's own output projection read in place (``GPTModel``), not the
    stacked ``model.W_O``."""
    W_O = ablation.model.blocks[layer].attn.W_O.detach()  # (n_heads, d_head, d_model), a view of out_proj
    name = z_name(layer)
    z = clean[name][rows][:, at, head].float()  # (rows, n, d_head)
    source = rows_of(ablation.sources[name], rows, len(ablation.tokens))[:, at, head].float()  # (rows or 1, n, d_head)
    return (source - z) @ W_O[head].float()
