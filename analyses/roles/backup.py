"""Backup heads and self-repair (architecture §4.7), batched through the intervention engine.

- **Pairwise ablation**: for heads A and B, the effect of ablating both together against the sum
  of their single effects. ``excess = joint - (effect_A + effect_B)``: with a loss metric
  (effects are rises in loss), a positive excess means the pair matters more than its parts; negative,
  that their effects overlap. Each prompt's excess is its joint effect minus its two single effects,
  all from the same forwards of the same prompts, so the excess has its own interval. A
  superadditive pair is not yet backup: a loss that saturates makes any two heads that add to the
  same logits superadditive.
- **Backup as Wang et al. (2022) test it** (``direct_effect_rises``): B backs A up where B's direct
  logit attribution on the metric rises when A is ablated, on the side of A's own attribution (B
  writes more of what A wrote), with the rise's paired 95% interval over prompts. Both attributions
  are read through the unablated run's readout (the metric's gradient with respect to the logits,
  the final norm's scale held), so a rise is a change of what B writes, never the metric's curvature.
  Heads joined by a pair that is superadditive (an excess of at least ``min_excess`` whose 95%
  interval excludes 0) *and* compensates one way or the other are one **backup group** (connected
  components), and each group is ablated as a whole; ``backup_report(choose=...)`` forms the groups
  on other prompts than those it measures them on (the report's selection rows: architecture §4.12).
- **Direct vs total effect** (McGrath et al. 2023, "the Hydra effect"): a head's *total* effect
  is the ordinary ablation effect, where every later component reacts; its *direct* effect is
  the same ablation with everything downstream frozen at its unablated value (every later
  layer's head outputs, and every MLP output from the head's own layer on), so the change
  reaches the logits only through the residual stream and the unembedding. The residual stream
  being a sum, the final residual then moves by exactly the head's own change of output,
  ``(z_ablated - z_clean)[head] @ W_O[layer, head]`` (the output bias is unchanged; in a block that
  norms its attention output, Gemma 2 and 3's ``ln1_post``, that norm is held too, at the clean
  run's scale: ``weight * change / scale``, the head's contribution as docs/guides/families.md
  defines it; a rerun would recompute it, so the rerun below refuses heads there), so on a model
  that can start at the final norm (``GPTModel``) the direct effect is computed from that alone:
  the metric of ``unembed(final_resid_clean + delta)`` (the final norm recomputed, as a rerun
  would), no block rerun; elsewhere (a ``TransformerBridge``, whose ``start_at_layer`` reruns the
  earlier blocks) by rerunning the blocks after the head with every later output frozen.
  ``self_repair = direct - total``: how much of the direct effect later components undo. An MLP's
  effects are measured alike (``mlps=True``): its ``hook_mlp_out`` ablated, and for the direct effect
  every later head and MLP output frozen, so the final residual moves by its output's change.

Every set of ablations is one ``score_variants`` call (one forward per chunk of variants;
suffix-only on ``GPTModel``). Each effect is a mean over prompts with its 95% interval (a percentile
bootstrap over prompts of the per-prompt effects the same forwards give,
``analyses.core.stats.effect_intervals``): total, direct and self-repair, a pair's joint
effect and its excess; a first-order estimate (``screen``) has none (NaN).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from itertools import combinations
from typing import Sequence

import pandas as pd
import torch

from analyses.interventions.ablation import (MLP, Ablation, Component, ablation_reads, check_components, component_cells,
                                             component_label, component_layer, prepare_ablation, prompts_run)
from analyses.core.budget import held_mb
from analyses.core.execution import current, executing
from analyses.core.hook_check import (EDIT_TOLERANCE, HEAD_CONTRIBUTIONS, UNNORMED_ATTN_OUT, check_hooks,
                                      frozen_output_norm, norm_weight, output_norm, output_norm_reads, probe_effect,
                                      probe_tokens, require)
from analyses.core.hook_names import final_resid_name, layer_of, mlp_out_name, z_name, z_names
from analyses.core.checks import check_heads
from analyses.core.heads import head_label
from analyses.interventions.engine import (Edit, activation_gradients, collect_variants, gradient_parts, partial_logits,
                                           rows_of, runs_suffix_only, score_chunks, score_variants)
from analyses.core.metrics import Metric, PromptScores
from analyses.core.stats import (N_BOOT, bootstrap_cluster_ratio, bootstrap_ratio, effect_intervals, excludes_zero,
                                 paired_difference)
from analyses.core.tokens import accumulator
from analyses.interventions.run import Run
from analyses.roles.readout import FinalReadout
from interp.errors import UserError

DEFAULT_MIN_EXCESS = 0.05  # nats: a pair whose joint effect exceeds the sum of its single effects by this much backs itself up


def pairwise_ablation(model, prompts, heads: Sequence[tuple[int, int]], method: str = "mean",
                      metric: Metric | None = None, *, memory_mb: float | None = None,
                      progress: bool | None = None, run: Run | None = None) -> pd.DataFrame:
    """Ablate each of ``heads`` alone and every pair together (one batched call).

    prompts: ids, texts or ``RepeatedProbes`` (see ``analyses.interventions.ablation``); metric: default the mean
    next-token loss; run: a ``Run`` of the prompts (``prepare_ablation``). Returns one row per
    pair: ``a, b`` (labels ``L{l}H{h}``), ``layer_a, head_a, layer_b, head_b, effect_a, effect_b,
    joint, additive`` (effect_a + effect_b), ``excess`` (joint - additive), ``baseline``, and the 95%
    intervals over prompts ``joint_ci_low, joint_ci_high, excess_ci_low, excess_ci_high`` and
    ``n_prompts`` (``joint_effects``: each prompt's excess is its joint effect minus its two single
    effects, all from the same forwards of the same prompts). ``memory_mb``, ``progress``: the
    execution's (``analyses.core.execution``; None: the current one's).
    """
    heads = check_heads(model, heads)
    if len(heads) < 2:
        raise UserError(f"pairwise ablation needs at least 2 heads, got {len(heads)}")
    with executing(memory_mb, progress):
        ablation = prepare_ablation(model, prompts, method, metric, run=run)
        return pair_frame(joint_effects(ablation, list(combinations(heads, 2)), desc="pairwise ablation"))


def joint_effects(ablation: Ablation, sets: Sequence[Sequence[tuple[int, int]]], *,
                  desc: str = "joint ablations") -> pd.DataFrame:
    """Each set of heads ablated together and each of their heads alone (one batched call) -> one
    row per set: ``heads`` (the set, as given), ``effects`` (its heads' single effects, in order),
    ``sum_single``, ``joint``, ``excess`` (joint - sum_single), ``baseline``, and the 95% intervals
    over prompts ``joint_ci_low, joint_ci_high, excess_ci_low, excess_ci_high``, ``n_prompts``. The
    excess's interval bootstraps each prompt's own excess, its joint effect minus its heads' single
    effects (``(J - B) - sum_i (S_i - B)`` of the per-prompt numerators, ``effect_intervals``); NaN
    for a metric without a per-prompt form."""
    alone = sorted({head for members in sets for head in members})
    scores = ablation.scores([[h] for h in alone] + [list(members) for members in sets], desc=desc)
    single = dict(zip(alone, (scores.values[:len(alone)] - ablation.baseline).tolist()))
    joint = scores.values[len(alone):] - ablation.baseline
    joint_scores = PromptScores(scores.values[len(alone):], None if scores.numerators is None
                                else scores.numerators[len(alone):], scores.counts)
    frame = pd.DataFrame({"heads": [tuple(members) for members in sets],
                          "effects": [[single[h] for h in members] for members in sets],
                          "joint": joint.tolist()})
    frame["sum_single"] = frame["effects"].apply(sum)
    frame["excess"] = frame["joint"] - frame["sum_single"]
    frame["baseline"] = ablation.baseline
    frame["joint_ci_low"], frame["joint_ci_high"], n_prompts = interval_columns(ablation, joint_scores)
    frame["excess_ci_low"], frame["excess_ci_high"] = excess_intervals(ablation, scores, alone, sets)
    frame["n_prompts"] = n_prompts
    return frame


def pair_frame(joint: pd.DataFrame) -> pd.DataFrame:
    """``joint_effects`` of pairs -> ``pairwise_ablation``'s columns."""
    a, b = zip(*joint["heads"]) if len(joint) else ((), ())
    frame = pd.DataFrame({"a": list(map(head_label, a)), "b": list(map(head_label, b)),
                          "layer_a": [h[0] for h in a], "head_a": [h[1] for h in a],
                          "layer_b": [h[0] for h in b], "head_b": [h[1] for h in b],
                          "effect_a": [e[0] for e in joint["effects"]], "effect_b": [e[1] for e in joint["effects"]],
                          "joint": joint["joint"]})
    frame["additive"] = frame["effect_a"] + frame["effect_b"]
    frame["excess"] = frame["joint"] - frame["additive"]
    columns = ["baseline", "joint_ci_low", "joint_ci_high", "excess_ci_low", "excess_ci_high", "n_prompts"]
    return frame.assign(**{column: joint[column].to_numpy() for column in columns})


def interval_columns(ablation: Ablation, scores: PromptScores) -> tuple:
    """The 95% intervals over prompts of the effects ``scores.values - baseline`` (``Contrast.intervals``)
    -> (ci_low, ci_high) as numpy arrays, and n_prompts."""
    low, high, n_prompts = ablation.intervals(scores)
    return low.cpu().numpy(), high.cpu().numpy(), n_prompts


def excess_intervals(ablation: Ablation, scores: PromptScores, alone: list, sets: Sequence) -> tuple:
    """The 95% intervals of each set's excess, joint - sum of its single effects, per prompt
    ``J - sum_i S_i + (k - 1) B`` of the numerators (J the set's, S_i its k heads' alone, B the
    baseline's) -> (ci_low, ci_high) numpy arrays (len(sets),); NaN where the metric has no
    per-prompt form. ``scores``: the singles ``alone`` then the ``sets``, as ``joint_effects`` ablates them."""
    baseline = ablation.baseline_scores()
    if scores.numerators is None or baseline.numerators is None:
        nan = torch.full((len(sets),), float("nan"), dtype=torch.float64).cpu().numpy()
        return nan, nan.copy()
    single = dict(zip(alone, scores.numerators[:len(alone)]))
    joint = scores.numerators[len(alone):]
    excess = torch.stack([j - sum(single[h] for h in members) + len(members) * baseline.numerators
                          for j, members in zip(joint, sets)])  # (sets, batch): the excess plus the baseline
    low, high, _ = effect_intervals(PromptScores(torch.zeros(len(sets)), excess, baseline.counts), baseline,
                                    len(ablation.tokens))
    return low.cpu().numpy(), high.cpu().numpy()


def backup_groups(pairs: pd.DataFrame, min_excess: float = DEFAULT_MIN_EXCESS) -> list[list[str]]:
    """Connected components of the heads joined by a backing pair (``backing``) in a
    ``pairwise_ablation`` table with its ``compensates`` column (``with_rises``) -> groups of head
    labels (each sorted, groups by first member); heads with no such partner are left out."""
    parent: dict[str, str] = {}

    def root(label: str) -> str:
        while parent.setdefault(label, label) != label:
            label = parent[label]
        return label

    for a, b in pairs.loc[backing(pairs, min_excess), ["a", "b"]].itertuples(index=False):
        parent[root(a)] = root(b)
    groups: dict[str, list[str]] = {}
    for label in parent:
        groups.setdefault(root(label), []).append(label)
    return sorted((sorted(g, key=_label_key) for g in groups.values()), key=lambda g: _label_key(g[0]))


def superadditive(pairs: pd.DataFrame, min_excess: float = DEFAULT_MIN_EXCESS) -> pd.Series:
    """Which pairs of a ``pairwise_ablation`` table cost more together than apart: ``excess >=
    min_excess`` and its 95% interval ``[excess_ci_low, excess_ci_high]`` excluding 0 (a NaN interval
    excludes nothing): bool per row. Not by itself backup: a loss that saturates makes any two heads
    that add to the same logits superadditive."""
    return (pairs["excess"] >= min_excess) & excludes_zero(pairs["excess_ci_low"], pairs["excess_ci_high"])


def backing(pairs: pd.DataFrame, min_excess: float = DEFAULT_MIN_EXCESS) -> pd.Series:
    """Which pairs of a ``pairwise_ablation`` table back each other up (``backup_groups``' rule): bool per
    row, superadditive (``superadditive``) and compensating (``compensates``, from ``with_rises``: one
    head's direct logit attribution rises when the other is ablated, as Wang et al. test backup)."""
    return superadditive(pairs, min_excess) & pairs["compensates"].astype(bool)


RISE_COLUMNS = [f"rise_{way}{end}" for way in ("ab", "ba") for end in ("", "_ci_low", "_ci_high")]


def with_rises(ablation: Ablation, pairs: pd.DataFrame, which: Sequence[bool]) -> pd.DataFrame:
    """``pairs`` (a ``pairwise_ablation`` table) with, for the rows ``which`` (bool per row), each head's
    direct logit attribution rise when the other is ablated on ``ablation``'s prompts
    (``direct_effect_rises``): ``rise_ab`` (b's, a ablated) and ``rise_ba`` (a's, b ablated), each with
    ``_ci_low``, ``_ci_high`` (NaN on the other rows), and ``compensates``: either way compensates
    (False on the other rows, which were not measured)."""
    which = pd.Series(which, index=pairs.index).astype(bool)
    chosen = pairs[which]
    a = list(zip(chosen["layer_a"].astype(int), chosen["head_a"].astype(int)))
    b = list(zip(chosen["layer_b"].astype(int), chosen["head_b"].astype(int)))
    frame = pairs.assign(**{column: float("nan") for column in RISE_COLUMNS}, compensates=False)
    if not len(chosen):
        return frame
    rises = direct_effect_rises(ablation, [*zip(a, b), *zip(b, a)])
    for way, part in (("ab", rises.iloc[:len(chosen)]), ("ba", rises.iloc[len(chosen):])):
        for end in ("", "_ci_low", "_ci_high"):
            frame.loc[which, f"rise_{way}{end}"] = part[f"rise{end}"].to_numpy()
    frame.loc[which, "compensates"] = (rises["compensates"].to_numpy()[:len(chosen)]
                                       | rises["compensates"].to_numpy()[len(chosen):])
    return frame


def _label_key(label: str) -> tuple[int, int]:
    layer, head = label[1:].split("H")
    return int(layer), int(head)


def backup_report(model, prompts, heads: Sequence[tuple[int, int]], method: str = "mean",
                  metric: Metric | None = None, *, min_excess: float = DEFAULT_MIN_EXCESS,
                  memory_mb: float | None = None, progress: bool | None = None,
                  run: Run | None = None, choose: Ablation | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Pairwise ablation of ``heads`` and their backup groups (``backup_groups``: pairs whose excess is
    at least ``min_excess`` with a 95% interval excluding 0, and where one head's direct logit
    attribution rises when the other is ablated, ``with_rises``), each ablated as a whole (``run``: a
    ``Run`` of the prompts, made here where None, that both steps read). The rises are measured for
    the superadditive pairs only.

    choose: None forms the groups from the pairs measured on ``prompts`` (in-sample); an ``Ablation``
    of other prompts (``prepare_ablation``, same method and metric) forms them from the pairs and
    rises measured there, so the groups' effects printed from ``prompts`` are measured on prompts that
    did not choose them (architecture §4.12): the pairs are ablated on both, the groups on ``prompts`` alone.

    Returns a tuple of two tidy frames (pairs: see ``pairwise_ablation``, on ``prompts``, with the
    rises and ``compensates`` (``with_rises``, on ``prompts``, for the pairs superadditive on the
    choosing prompts), ``backs`` (the pair joins a group, as decided on the choosing prompts) and,
    with ``choose``,
    ``chosen_excess, chosen_excess_ci_low, chosen_excess_ci_high`` and ``chosen_compensates`` (there);
    groups: one row per group ``group`` (0..), ``heads`` (labels joined by ';'), ``n_heads``,
    ``sum_single`` (the sum of its heads' single effects), ``joint`` (all of them ablated together),
    ``excess`` (joint - sum_single), ``joint_ci_low``, ``joint_ci_high``, ``excess_ci_low``,
    ``excess_ci_high``, ``n_prompts`` (95% intervals over ``prompts``: ``joint_effects``)).
    ``memory_mb``, ``progress``: the execution's (``analyses.core.execution``; None: the current one's)."""
    with executing(memory_mb, progress):
        run = run if run is not None else prompts_run(model, prompts, ablation_reads(model, method))
        heads = check_heads(model, heads)
        if len(heads) < 2:
            raise UserError(f"pairwise ablation needs at least 2 heads, got {len(heads)}")
        ablation = prepare_ablation(model, prompts, method, metric, run=run)
        pairs = list(combinations(heads, 2))
        screen = None
        if choose is not None:
            screen = pair_frame(joint_effects(choose, pairs, desc="pairwise ablation (choosing)"))
            screen = with_rises(choose, screen, superadditive(screen, min_excess))
        groups = [] if screen is None else backup_groups(screen, min_excess)
        members = [[_label_key(label) for label in group] for group in groups]
        measured = joint_effects(ablation, [*pairs, *members], desc="pairwise ablation")
        frame = pair_frame(measured.iloc[:len(pairs)].reset_index(drop=True))
        frame = with_rises(ablation, frame, superadditive(frame if screen is None else screen, min_excess).to_numpy())
        if screen is None:
            groups = backup_groups(frame, min_excess)
            members = [[_label_key(label) for label in group] for group in groups]
            measured = pd.concat([measured, joint_effects(ablation, members, desc="backup groups")] if members else [measured],
                                 ignore_index=True)
            frame["backs"] = backing(frame, min_excess)
        else:
            frame["backs"] = backing(screen, min_excess).to_numpy()
            frame["chosen_excess"], frame["chosen_excess_ci_low"], frame["chosen_excess_ci_high"] = (
                screen["excess"].to_numpy(), screen["excess_ci_low"].to_numpy(), screen["excess_ci_high"].to_numpy())
            frame["chosen_compensates"] = screen["compensates"].to_numpy()
        return frame, group_frame(groups, measured.iloc[len(pairs):])


def group_frame(groups: list[list[str]], measured: pd.DataFrame) -> pd.DataFrame:
    """``backup_report``'s groups table from the groups (labels) and their ``joint_effects`` rows."""
    columns = ["sum_single", "joint", "excess", "joint_ci_low", "joint_ci_high", "excess_ci_low", "excess_ci_high",
               "n_prompts"]
    frame = pd.DataFrame({"group": range(len(groups)), "heads": [";".join(g) for g in groups],
                          "n_heads": [len(g) for g in groups]})
    return frame.assign(**{column: measured[column].to_numpy() if len(groups) else [] for column in columns})


BACKUP_RISE = "the rise of a partner's direct logit attribution"


@dataclass(frozen=True)
class MetricReadout:
    """The metric's readout of the final residual at the clean run, linearised with the final norm's
    scale held: ``u`` (batch, n, d_model) float32, per prompt and read position, the gradient of the
    prompt's metric numerator with respect to the logits times the final norm's clean scale, taken
    back through the unembedding, so that a write ``c`` (batch, n, d_model) at the read positions
    ``at`` has the direct logit attribution ``(u * normed(c)).sum((1, 2))`` per prompt numerator
    (``FinalReadout.normed``: the norm without its scale); counts (batch,) the metric's denominators."""

    readout: FinalReadout
    at: torch.Tensor | slice
    u: torch.Tensor
    counts: torch.Tensor

    def attribution(self, write: torch.Tensor) -> torch.Tensor:
        """A write to the residual stream (batch, pos, d_model) -> its direct logit attribution on the
        metric, each prompt's numerator (batch,) float64 on the CPU."""
        return (self.u * self.readout.normed(write[:, self.at])).sum((1, 2)).cpu().double()


def backup_refusal(model) -> str | None:
    """Why ``direct_effect_rises`` cannot run on ``model``, in one line (None where it can): it reads
    the final norm and unembedding of a ``GPTModel`` (``FinalReadout``), and a head's write as z @ W_O,
    which a block that norms its attention output (Gemma 2 and 3) rescales per run."""
    if not runs_suffix_only(model):
        return f"{BACKUP_RISE} reads the final norm and unembedding of interp's GPTModel; got {type(model).__name__}"
    normed = [layer for layer in range(model.cfg.n_layers) if output_norm(model, layer) is not None]
    if normed:
        return (f"{BACKUP_RISE}: layer {normed[0]} norms its attention output, so a head's write is not z @ W_O "
                "alone; the rise is measured on models without that norm")
    return None


def metric_readout(ablation: Ablation) -> MetricReadout:
    """``MetricReadout`` of ``ablation``'s unedited run and metric, from its final residual: per chunk of
    prompts within the current execution's memory (``analyses.core.execution``), the logits at the metric's read positions as ``FinalReadout`` makes
    them (``scale * linear + offset``, capped where the model caps), the gradient of the sum of the
    prompts' numerators with respect to the uncapped logits, times the scale, through the unembedding.
    Refused in one line where ``backup_refusal`` says so or for a metric without a per-prompt form."""
    model, tokens, metric = ablation.model, ablation.tokens, ablation.metric
    refusal = backup_refusal(model)
    if refusal is not None:
        raise UserError(refusal)
    if not metric.splits:
        raise UserError(f"{BACKUP_RISE} needs a metric with a per-prompt form (loss_metric, logit_diff_metric, a "
                        "task metric); a plain callable has none")
    batch, n_pos = tokens.shape
    readout, positions = FinalReadout(model), metric.positions(n_pos)
    at = slice(None) if positions is None else positions
    final = ablation.base.read([final_resid_name(model)])[final_resid_name(model)]  # (batch, pos, d_model)
    n_read = n_pos if positions is None else len(positions)
    rows_fit = max(1, int(current().memory_mb * 2 ** 20 // (4 * 4 * n_read * model.cfg.d_vocab)))  # logits, grads, caps
    parts, counts = [], []
    for start in range(0, batch, rows_fit):
        rows = slice(start, min(start + rows_fit, batch))
        part, _ = metric.part(rows, positions)
        resid = final[rows][:, at].float()
        scale = readout.scale(resid)  # (rows, n, 1)
        raw = torch.addcmul(readout.offset, readout.linear(resid), scale).requires_grad_(True)
        with torch.enable_grad():
            logits = raw if readout.cap is None else readout.cap * torch.tanh(raw / readout.cap)
            _, numerators = part.per_prompt(logits if part.entries is None else logits[part.entries])
            grad, = torch.autograd.grad(numerators.sum(), raw)
        parts.append((grad * scale) @ readout.readout.T)  # (rows, n, d_model)
        counts.append(part.counts.to(grad.device))
    return MetricReadout(readout, at, torch.cat(parts), torch.cat(counts))


def contribution(ablation: Ablation, head: tuple[int, int], z: torch.Tensor) -> torch.Tensor:
    """What ``head`` adds to the residual stream beyond its ablated value when its z is ``z`` (batch,
    pos, d_head): ``(z - z_source) @ W_O[head]`` (batch, pos, d_model) float32, the source being
    ``ablation``'s replacement (one row broadcasts to every prompt), so that a constant part of the
    head's output, which the ablation keeps, is no part of its attribution."""
    source = rows_of(ablation.sources[z_name(head[0])], slice(None), len(ablation.tokens))[:, :, head[1]]
    return (z.float() - source.float()) @ head_W_O(ablation, head)


def partner_contributions(ablation: Ablation, head: tuple[int, int],
                          partner: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``partner``'s ``contribution`` (batch, pos, d_model) in the unedited run and in the run with
    ``head`` ablated (``ablation``'s method; one forward up to the partner's layer, from the head's own
    where the model can start there). A partner in the head's layer or before it reads nothing the
    head wrote: its contribution is the same."""
    name = z_name(partner[0])
    clean = contribution(ablation, partner, ablation.base.read([name])[name][:, :, partner[1]])
    if partner[0] <= head[0]:
        return clean, clean
    ablated = collect_variants(ablation.model, ablation.tokens, [component_cells([head])], ablation.sources, [name],
                               starts=ablation.starts)[name][0]
    return clean, contribution(ablation, partner, ablated[:, :, partner[1]])


def direct_effect_rises(ablation: Ablation, pairs: Sequence[tuple[tuple[int, int], tuple[int, int]]], *,
                        n_boot: int = N_BOOT, seed: int = 0,
                        clusters: Sequence | None = None) -> pd.DataFrame:
    """For each (head, partner) of ``pairs``: the partner's direct logit attribution on ``ablation``'s
    metric in the unedited run and with ``head`` ablated (``ablation``'s method), Wang et al.'s (2022)
    test of backup: the partner compensates where what it writes moves the metric more when the
    head is gone.

    A head's attribution is that of its ``contribution``, its write beyond its ablated value
    ((z - z_source) @ W_O: a zero ablation's is the whole write), read through the unedited run's
    readout (``metric_readout``: the metric's gradient with respect to the logits, the final norm's
    scale held at the clean run's), the same in both runs, so a rise is a change of what the partner
    writes, never the metric's curvature or the norm's scale responding to the head's absence (for a
    logit difference and zero ablation it is the exact DLA with the final norm frozen; for a loss,
    its linearisation at the clean run). The head's own attribution is read alike, and the partner
    ``compensates`` where the rise's 95% interval excludes 0 on the side of the head's attribution,
    whose own interval excludes 0: it writes more of what the head wrote.

    Returns one row per pair: ``head``, ``partner`` (labels), ``head_dla``, ``partner_dla`` (unedited),
    ``partner_dla_ablated``, ``rise`` (ablated - unedited), each with ``*_ci_low``, ``*_ci_high``
    (95% percentile bootstrap over prompts, or over ``clusters`` (one label per prompt) where given,
    ``seed``; the rise's paired, ``paired_difference``), ``n_prompts`` (those the metric counts),
    ``compensates``. Refused in one line where ``backup_refusal`` says why. Its forwards run within
    the current execution's memory (``analyses.core.execution``)."""
    refusal = backup_refusal(ablation.model)
    if refusal is not None:
        raise UserError(refusal)
    readout = metric_readout(ablation)
    counted = (readout.counts > 0).cpu()
    labels = None if clusters is None else [label for label, kept in zip(clusters, counted.tolist()) if kept]
    counts = readout.counts[counted].cpu().double()

    def interval(per_prompt: torch.Tensor) -> tuple[float, float, float]:
        return tuple(map(float, bootstrap_ratio(per_prompt[counted], counts, n_boot=n_boot, seed=seed)
                         if labels is None else
                         bootstrap_cluster_ratio(per_prompt[counted], counts, labels, n_boot=n_boot, seed=seed)))

    rows = []
    for head, partner in pairs:
        own = contribution(ablation, head, ablation.base.read([z_name(head[0])])[z_name(head[0])][:, :, head[1]])
        clean, ablated = map(readout.attribution, partner_contributions(ablation, head, partner))
        rise = paired_difference(ablated[counted], counts, clean[counted], counts, clusters=labels, n_boot=n_boot,
                                 seed=seed)
        row = {"head": head_label(head), "partner": head_label(partner)}
        for stem, values in (("head_dla", interval(readout.attribution(own))), ("partner_dla", interval(clean)),
                             ("partner_dla_ablated", interval(ablated)), ("rise", tuple(map(float, rise)))):
            row |= dict(zip((stem, f"{stem}_ci_low", f"{stem}_ci_high"), values))
        rows.append(row | {"n_prompts": int(counted.sum())})
    frame = pd.DataFrame(rows, columns=["head", "partner", *(f"{stem}{end}" for stem in
                                        ("head_dla", "partner_dla", "partner_dla_ablated", "rise")
                                        for end in ("", "_ci_low", "_ci_high")), "n_prompts"])
    return frame.assign(compensates=compensating(frame))


def compensating(rises: pd.DataFrame) -> pd.Series:
    """Which rows of a ``direct_effect_rises`` frame compensate: the head's attribution's interval
    excludes 0, and the rise's excludes 0 on the same side (bool per row)."""
    above = (rises["head_dla_ci_low"] > 0) & (rises["rise_ci_low"] > 0)
    below = (rises["head_dla_ci_high"] < 0) & (rises["rise_ci_high"] < 0)
    return above | below


def backup_direct_effect_rise(model, tokens, metric: Metric | None, head, partner, method: str = "mean", *,
                              reference=None, memory_mb: float | None = None, n_boot: int = N_BOOT,
                              seed: int = 0, clusters: Sequence | None = None) -> pd.Series:
    """Whether ``partner`` backs ``head`` up as Wang et al. (2022) test it: the partner's direct logit
    attribution on ``metric`` (default the mean next-token loss) over ``tokens`` (ids, texts or
    ``RepeatedProbes``), unedited and with ``head`` ablated by ``method`` (``reference``: as
    ``prepare_ablation`` takes it), and its rise with a 95% interval over prompts -> one
    ``direct_effect_rises`` row (a Series: ``rise``, ``rise_ci_low``, ``rise_ci_high``,
    ``compensates``, ...). ``memory_mb``: the execution's (``analyses.core.execution``; None: the
    current one's)."""
    (head,), (partner,) = check_heads(model, [head]), check_heads(model, [partner])
    if head == partner:
        raise UserError(f"head and partner are both {head_label(head)}; a head cannot back itself up")
    with executing(memory_mb):
        ablation = prepare_ablation(model, tokens, method, metric, reference=reference)
        return direct_effect_rises(ablation, [(head, partner)], n_boot=n_boot, seed=seed, clusters=clusters).iloc[0]


def direct_effect_reads(model, method: str, mlps: bool = False) -> list[str]:
    """What ``direct_and_total_effects`` (with ``mlps``) reads from a ``Run`` of its prompts: the
    ablation's hooks, every ``hook_z`` (with ``mlps`` every ``hook_mlp_out``), and the final residual
    (a model that starts at the final norm, with what ``frozen_output_norm`` reads where blocks norm
    their attention output) or every ``hook_mlp_out`` (one that reruns the blocks with them frozen;
    ``from_final_residual`` decides, and what a ``Run`` lacks it reads when asked)."""
    frozen = [final_resid_name(model), *output_norm_reads(model)] if runs_suffix_only(model) else mlp_out_names(model)
    written = [*z_names(model), *(mlp_out_names(model) if mlps else [])]
    return list(dict.fromkeys([*ablation_reads(model, method, mlps=mlps), *written, *frozen]))


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
                             metric: Metric | None = None, *, mlps: bool = False,
                             memory_mb: float | None = None, progress: bool | None = None,
                             run: Run | None = None, screen: float | None = None, direct: bool = True) -> pd.DataFrame:
    """Each head's total and direct ablation effect (see the module docstring; ``run``: a ``Run``
    of the prompts reading at least ``direct_effect_reads``, made here where None). ``direct=False``
    measures the totals alone, ``direct`` and ``self_repair`` NaN: for a page whose plan left the
    direct effects out (``direct_effect_needs``), which says so.

    screen: None measures every total effect exactly (one suffix rerun each). A number (nats) is
    the shortcut: the total effect is measured exactly for the components whose first-order
    estimate (``first_order_effects``, one forward and backward) or exact direct effect reaches
    ``screen`` in size, and is that estimate for the others (column ``total_exact`` says which).

    heads: default every head; mlps: also each MLP's (its ``hook_mlp_out`` ablated at every position
    by the same method; the run must then read every ``hook_mlp_out`` too). Returns a tidy frame, one row per
    component, the heads first: ``component`` (``L{l}H{h}``, ``L{l} MLP``), ``kind`` ("head" |
    "mlp"), ``layer``, ``head`` (Int64, <NA> for an MLP), ``total, direct, self_repair`` (direct -
    total), ``baseline``, ``total_exact``, and each effect's 95% interval over prompts
    (``total_ci_low, total_ci_high, direct_ci_low, direct_ci_high, self_repair_ci_low,
    self_repair_ci_high``: the per-prompt effects of the same forwards, ``effect_intervals``; NaN for
    a total that is a first-order estimate) and ``n_prompts``. One batched call for the totals; the
    direct effects from ``direct_effects``. ``memory_mb``, ``progress``: the execution's
    (``analyses.core.execution``; None: the current one's).
    """
    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
    heads = check_heads(model, heads if heads is not None else [(l, h) for l in range(n_layers) for h in range(n_heads)])
    components = [*heads, *check_components(model, [MLP(layer) for layer in range(n_layers)] if mlps else [])]
    with executing(memory_mb, progress):
        ablation = prepare_ablation(model, prompts, method, metric, run=run, mlps=mlps)
        direct_scores = (direct_effects(ablation, components) if direct else
                         PromptScores(accumulator(model, len(components)).fill_(float("nan")), None, None))
        direct = direct_scores.values
        exact = torch.ones(len(components), dtype=torch.bool, device=direct.device)
        total = accumulator(model, len(components))
        if screen is not None:
            estimate = first_order_effects(ablation, components)
            exact = (estimate.abs() >= screen) | ((direct - ablation.baseline).abs() >= screen)
            total[~exact] = ablation.baseline + estimate[~exact]
        chosen = exact.nonzero()[:, 0].tolist()
        measured = ablation.scores([[components[i]] for i in chosen], desc="total effects")
    total[chosen] = measured.values
    total_scores = PromptScores(total, None, None)
    if measured.numerators is not None:  # an estimate has no per-prompt numerators: NaN, so no interval
        numerators = measured.numerators.new_full((len(components), len(ablation.tokens)), float("nan"))
        numerators[chosen] = measured.numerators
        total_scores = PromptScores(total, numerators, measured.counts)
    intervals = {}
    for name, scores in (("total", total_scores), ("direct", direct_scores)):
        intervals[f"{name}_ci_low"], intervals[f"{name}_ci_high"], n_prompts = interval_columns(ablation, scores)
    low, high, _ = effect_intervals(direct_scores, total_scores, len(ablation.tokens))  # direct - total, per prompt
    intervals |= {"self_repair_ci_low": low.cpu().numpy(), "self_repair_ci_high": high.cpu().numpy(),
                  "n_prompts": n_prompts}
    return pd.DataFrame({
        "component": [component_label(c) for c in components], "kind": [kind_of(c) for c in components],
        "layer": [component_layer(c) for c in components],
        "head": pd.array([None if isinstance(c, MLP) else c[1] for c in components], dtype="Int64"),
        "total": (total - ablation.baseline).cpu().numpy(), "direct": (direct - ablation.baseline).cpu().numpy(),
    }).assign(self_repair=lambda f: f["direct"] - f["total"], baseline=ablation.baseline,
              total_exact=exact.cpu().numpy(), **intervals)


def direct_effects(ablation: Ablation, components: Sequence[Component]) -> PromptScores:
    """The metric with each component ablated alone and everything downstream frozen ->
    ``PromptScores``: values (len(components),) in the accumulators' dtype, as the totals (float64;
    float32 on mps), and each prompt's numerator (len(components), batch) and count where the metric
    has a per-prompt form: from the final residual (``final_residual_effects``) where the model starts
    at the final norm and its heads' contributions are known, else one rerun per layer and kind
    (``frozen_downstream_run``): ``from_final_residual``."""
    model = ablation.model
    direct = accumulator(model, len(components))
    numerators, counts = accumulator(model, len(components), len(ablation.tokens)), None
    if from_final_residual(model, any(not isinstance(c, MLP) for c in components)):
        scored = final_residual_effects(ablation, components)
        direct[:] = scored.values
        if scored.numerators is not None:
            numerators[:], counts = scored.numerators, scored.counts
    else:
        mlp_names = mlp_out_names(model)
        require_mlp_freeze(model, mlp_names)
        clean = ablation.base.read([*z_names(model), *mlp_names])
        for group in dict.fromkeys(map(layer_and_kind, components)):
            members = [i for i, c in enumerate(components) if layer_and_kind(c) == group]
            scored = frozen_downstream_run(ablation, clean, [components[i] for i in members], mlp_names)
            direct[members] = scored.values.to(direct)
            if scored.numerators is not None:
                numerators[members], counts = scored.numerators.to(numerators), scored.counts
    return PromptScores(direct, None if counts is None else numerators, counts)


def from_final_residual(model, heads: bool) -> bool:
    """Whether ``direct_effects`` reads the direct effects off the final residual (else it reruns the
    blocks), the hook self-test asked first where ``heads`` are among the components: from the final
    residual where the model starts at the final norm and each head's contribution is known
    (``HEAD_CONTRIBUTIONS``: z @ W_O, through the frozen norm on the attention output where a block
    has one); else by a rerun, which edits z and needs no W_O but would recompute such a norm, so it
    is refused in one line there (``UNNORMED_ATTN_OUT``)."""
    if not heads:
        return runs_suffix_only(model)
    if reads_final_residual(model):
        return True
    require(model, UNNORMED_ATTN_OUT, DIRECT_EFFECTS)
    return False


DIRECT_EFFECTS = "direct effects of heads"


def reads_final_residual(model) -> bool:
    """Whether heads' direct effects are read off the final residual: the model starts at the final
    norm and each head's contribution is known (``HEAD_CONTRIBUTIONS``)."""
    return runs_suffix_only(model) and check_hooks(model).refusal(HEAD_CONTRIBUTIONS, DIRECT_EFFECTS) is None


def direct_effect_needs(model) -> tuple[str, ...]:
    """What heads' direct effects need of ``model`` beyond what it has (``analyses.core.hook_check``'s
    NEEDS, for a page's plan): nothing where they are read off the final residual, else a rerun that
    recomputes no norm between the heads and the residual (``UNNORMED_ATTN_OUT``)."""
    return () if reads_final_residual(model) else (UNNORMED_ATTN_OUT,)


def first_order_effects(ablation: Ablation, components: Sequence[Component]) -> torch.Tensor:
    """Each component's ablation effect to first order (attribution patching: the metric's gradient
    on the unablated run dotted with the ablation's change of what the component holds, summed over
    prompts and positions) -> (len(components),) in the accumulators' dtype. One forward and backward per chunk of
    prompts that fits the current execution's memory (``gradient_parts``), each weighted by its share of
    the metric."""
    model, batch = ablation.model, len(ablation.tokens)
    names = list(dict.fromkeys(map(written_by, components)))
    width = max(model.cfg.d_model, model.cfg.n_heads * model.cfg.d_head)
    parts, positions = gradient_parts(model, ablation.tokens, ablation.metric, current().memory_mb,
                                      per_position=(len(names) + 2) * width)
    estimate = accumulator(model, len(components))
    for part in parts:
        _, held, grads = activation_gradients(model, ablation.tokens[part.rows], part.metric, names,
                                              positions=positions)
        summed = {}  # hook -> gradient x change summed over prompts, positions and width: (,) or (head,)
        for name in names:
            change = rows_of(ablation.sources[name], part.rows, batch).float() - held[name].float()
            product = grads[name].float() * change  # (rows, pos, d_model) or (rows, pos, head, d_head)
            summed[name] = product.sum(dim=(0, 1)).sum(-1)
        for i, component in enumerate(components):
            total = summed[written_by(component)]
            estimate[i] += part.share * (total if isinstance(component, MLP) else total[component[1]]).to(estimate)
    return estimate


def first_order_head_effects(ablation: Ablation) -> pd.DataFrame:
    """Every head's ablation effect to first order (``first_order_effects``: one forward and backward,
    a screen, no interval) -> ``layer, head, total``, the columns a ranking by total effect reads."""
    cfg = ablation.model.cfg
    heads = [(layer, head) for layer in range(cfg.n_layers) for head in range(cfg.n_heads)]
    estimate = first_order_effects(ablation, heads)
    return pd.DataFrame({"layer": [h[0] for h in heads], "head": [h[1] for h in heads],
                         "total": estimate.cpu().numpy()})


def kind_of(component: Component) -> str:
    return "mlp" if isinstance(component, MLP) else "head"


def layer_and_kind(component: Component) -> tuple[int, str]:
    return component_layer(component), kind_of(component)


def frozen_downstream_run(ablation: Ablation, clean: dict, components: Sequence[Component],
                          mlps: Sequence[str]) -> PromptScores:
    """The metric with each of ``components`` (of one layer and one kind) ablated alone and every
    output downstream of it held at ``clean``: every later layer's head outputs, and every MLP output
    from the layer on (after a head) or after it (after an MLP) -> ``PromptScores`` (values
    (len(components),) float; ``score_variants``)."""
    layer, after_mlp = component_layer(components[0]), isinstance(components[0], MLP)
    later = [z_name(l) for l in range(layer + 1, ablation.model.cfg.n_layers)]
    frozen = [name for name in mlps if layer_of(name) >= layer + after_mlp] + later
    cells = component_cells(components)
    sources = {cell.hook: ablation.sources[cell.hook] for cell in cells} | {name: clean[name] for name in frozen}
    variants = [component_cells([c]) + [Edit(name) for name in frozen] for c in components]
    return score_variants(ablation.model, ablation.tokens, variants, sources, ablation.metric,
                          starts=ablation.starts, desc="direct effects")


def final_residual_effects(ablation: Ablation, components: Sequence[Component]) -> PromptScores:
    """The metric with each of ``components`` (heads and ``MLP``s) ablated alone and everything
    downstream frozen, from the final residual: ``unembed(final_clean + write_change)`` at the
    metric's read positions only, in the chunks of components and prompts that ``score_chunks``
    makes within the current execution's memory -> ``PromptScores`` (values (len(components),) float32). Needs a model whose ``unembed`` is the
    final norm and the unembedding (``GPTModel``: ``runs_suffix_only``).

    Where the split of the unembedding is exact (``FinalReadout.exact_for``: float32 weights) and
    its readouts fit beside the chunks' quarter of that memory, the logits come from
    ``readout_logits``: the clean residual's linear part made once per chunk of prompts (and kept
    for later components in what the readouts leave of the budget), a head's change through its own
    (d_head, vocab) readout, the norm's scale recomputed (``analyses.roles.readout``). Elsewhere each
    changed residual is unembedded whole (``unembedded_logits``)."""
    model = ablation.model
    heads = {c[0] for c in components if not isinstance(c, MLP)}
    clean = ablation.base.read([final_resid_name(model), *dict.fromkeys(map(written_by, components)),
                                *output_norm_reads(model, sorted(heads))])
    memory_mb = current().memory_mb
    spare = 0.75 * memory_mb - FinalReadout.held_mb(model)  # what the readouts leave beside the chunks' quarter
    split = FinalReadout.exact_for(model) and spare >= 0
    chunk_logits = (readout_logits(ablation, clean, components, keep_mb=spare) if split
                    else unembedded_logits(ablation, clean, components))
    with torch.no_grad(), executing(memory_mb=memory_mb / 4 if split else None):
        return score_chunks(model, ablation.tokens, [component_cells([c]) for c in components], ablation.metric,
                            chunk_logits, read_only=True, desc="direct effects", by_prompts=split)


def unembedded_logits(ablation: Ablation, clean: dict, components: Sequence[Component]):
    """``score_chunks``' ``chunk_logits`` for ``final_residual_effects``: each component's changed
    final residual through ``model.unembed`` (the read positions, or the metric part's ``entries``
    alone; every position, NaN off the read ones, where the metric cannot take the read positions
    alone)."""
    model = ablation.model

    def chunk_logits(members: list, rows: slice, positions: torch.Tensor | None, compact: bool,
                     entries: torch.Tensor | None) -> torch.Tensor:
        at = positions if compact else slice(None)
        final = clean[final_resid_name(model)][rows][:, at]  # (rows, n, d_model)
        moved = torch.stack([final.float() + write_change(ablation, clean, components[v], rows, at)
                             for v in members]).to(final.dtype)  # (members, rows, n, d_model)
        if entries is not None:
            moved = moved[:, entries]  # (members, m, d_model): the entries the metric reads
        moved = moved.flatten(0, 1)
        logits = model.unembed(moved) if compact or positions is None else partial_logits(model, moved, positions)
        return logits.unflatten(0, (len(members), -1))

    return chunk_logits


def readout_logits(ablation: Ablation, clean: dict, components: Sequence[Component], keep_mb: float = 0.0):
    """``score_chunks``' ``chunk_logits`` for ``final_residual_effects`` through the split
    unembedding (``FinalReadout``): logits ``scale(final + change) * (linear(final) + linear(change))
    + offset`` at the read positions (at the metric part's ``entries`` alone where it has them), where
    a head's ``linear(change)`` is its z change (n, d_head)
    times its (d_head, vocab) readout (kept for the heads of one layer at a time, as the chunks come
    layer by layer) and ``linear(final)`` is made once per chunk of prompts and kept for the
    components after (the latest chunks' within ``keep_mb``, at least the last one's); equal to
    ``unembedded_logits`` up to float rounding."""
    model = ablation.model
    readout = FinalReadout(model)
    clean_linear: dict[tuple, torch.Tensor] = {}  # a chunk's prompts -> linear(final_clean) there (rows, n or m, vocab)

    @lru_cache(maxsize=model.cfg.n_heads)
    def head_readout(layer: int, head: int) -> torch.Tensor:  # (d_head, vocab)
        return readout.head_readout(head_W_O(ablation, (layer, head)))

    def chunk_logits(members: list, rows: slice, positions: torch.Tensor | None, compact: bool,
                     entries: torch.Tensor | None) -> torch.Tensor:
        at = slice(None) if positions is None else positions

        def read(x: torch.Tensor) -> torch.Tensor:  # (rows, n, ...) -> (rows, n, ...), or (m, ...) at ``entries``
            return x if entries is None else x[entries]

        final = read(clean[final_resid_name(model)][rows][:, at].float())  # (rows, n, d_model) or (m, d_model)
        key = (rows.start, rows.stop)
        if key not in clean_linear:
            made = readout.linear(final)
            while clean_linear and held_mb([*clean_linear.values(), made]) > keep_mb:
                del clean_linear[next(iter(clean_linear))]  # the oldest
            clean_linear[key] = made
        base = clean_linear[key]  # (rows, n, vocab) or (m, vocab)
        logits = base.new_empty((len(members), *base.shape))
        for out, v in zip(logits, members):
            component = components[v]
            change = read(scaled_change(ablation, clean, component, rows, at))  # (rows, n, d_head or d_model) or (m, ...)
            if isinstance(component, MLP):
                readout.logits(base, readout.normed(change), readout.readout, readout.scale(final + change), out=out)
            else:
                write = change @ head_W_O(ablation, component)
                readout.logits(base, change, head_readout(*component), readout.scale(final + write), out=out)
        if positions is None or compact:
            return logits
        full = logits.new_full((*logits.shape[:2], ablation.tokens.shape[1], logits.shape[-1]), torch.nan)
        full[:, :, positions] = logits
        return full

    return chunk_logits


def written_by(component: Component) -> str:
    """The hook that holds what ``component`` writes: its layer's ``hook_z`` or ``hook_mlp_out``."""
    return mlp_out_name(component.layer) if isinstance(component, MLP) else z_name(component[0])


def write_change(ablation: Ablation, clean: dict, component: Component, rows: slice,
                 at: torch.Tensor | slice = slice(None)) -> torch.Tensor:
    """How ``component``'s write to the residual stream changes under the ablation on the prompts
    ``rows`` at the positions ``at``, in float32 -> (rows, n, d_model): for an MLP its output's change,
    for a head ``(z_source - z_clean)[rows, at, head] @ W_O[layer, head]``, and in a block that norms
    its attention output that through the norm frozen at the clean run's scale, ``weight * ... /
    scale`` (``scaled_change``, ``head_W_O``: a head's contribution, docs/guides/families.md)."""
    change = scaled_change(ablation, clean, component, rows, at)
    return change if isinstance(component, MLP) else change @ head_W_O(ablation, component)


def scaled_change(ablation: Ablation, clean: dict, component: Component, rows: slice,
                  at: torch.Tensor | slice = slice(None)) -> torch.Tensor:
    """``own_change``, for a head in a block that norms its attention output divided by that norm's
    scale in the clean run (rows, n, 1), frozen (``frozen_output_norm``), so that through
    ``head_W_O`` (which holds the norm's weight) it is the change of the head's contribution."""
    change = own_change(ablation, clean, component, rows, at)
    norm = None if isinstance(component, MLP) else frozen_output_norm(ablation.model, component[0], clean, rows, at)
    return change if norm is None else change / norm.scale


def own_change(ablation: Ablation, clean: dict, component: Component, rows: slice,
               at: torch.Tensor | slice = slice(None)) -> torch.Tensor:
    """How what ``component`` holds changes under the ablation on the prompts ``rows`` at the
    positions ``at``, float32: an MLP's output (rows, n, d_model), a head's z (rows, n, d_head); a
    source of one row (broadcast to every prompt) minus the clean value gives every prompt's row."""
    name = written_by(component)
    now = clean[name][rows][:, at].float()  # (rows, n, ...)
    source = rows_of(ablation.sources[name], rows, len(ablation.tokens))[:, at].float()  # (rows or 1, n, ...)
    if isinstance(component, MLP):
        return source - now
    return source[:, :, component[1]] - now[:, :, component[1]]


def head_W_O(ablation: Ablation, head: tuple[int, int]) -> torch.Tensor:
    """A head's output projection (d_head, d_model), float32, the block's own read in place
    (``GPTModel``), not the stacked ``model.W_O``; in a block that norms its attention output, times
    that norm's weight (its scale is the run's: ``scaled_change``)."""
    layer, index = head
    w_o = ablation.model.blocks[layer].attn.W_O.detach()[index].float()  # a view of out_proj
    norm = output_norm(ablation.model, layer)
    return w_o if norm is None else w_o * norm_weight(norm).to(w_o.device)
