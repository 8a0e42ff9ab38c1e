"""Random-head controls (architecture §4.12): "these heads matter N times as much as random heads", with
the ratio's interval.

``matched_random_sets`` draws head sets matched to a tested set: in each layer as many heads as
the tested set has there and, on a grouped-query model, as many in each key/value group of that
layer, never a tested head nor one of the ``exclude`` heads (see ``matched_strata`` for the rule and
its fallback). A caller testing the heads of a role or class passes every head of it as ``exclude``
(those it tests and those it leaves out), so the random sets hold none of them.
``control_effects`` ablates the tested set and every drawn set as the variants of ONE batched sweep
(``Ablation.scores``: one call of the engine, each prompt's numerator kept) and returns a
``ControlEffects``: the tested effect and the random sets' mean effect, each with its 95% interval,
and the ratio tested / random with its paired interval (``analyses.core.stats.control_intervals``:
the prompts and the draws resampled together). ``control_figure`` draws the tested effect against
the random sets' effects.

A control drawn from any layer compares a set of late heads with random heads that are mostly
elsewhere, and may draw the very heads that matter; matching by layer (and key/value group, whose
heads share their keys and values) and excluding the tested heads makes the random sets what the
tested set would be had its heads been chosen at random where they sit; excluding the rest of the
role makes them heads outside the role, not the role's other heads.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations, product
from math import comb, prod
from typing import Sequence

import pandas as pd
import seaborn as sns
import torch
from matplotlib.figure import Figure

from analyses.core.execution import executing
from analyses.core.metrics import Metric, PromptScores
from analyses.core.plots import new_figure
from analyses.core.stats import (EFFECT_COLUMNS, N_BOOT, control_intervals, control_z, effect_intervals, effect_text,
                                 normal_p_value)
from analyses.interventions.ablation import component_label, prepare_ablation
from analyses.core.checks import check_heads
from analyses.interventions.run import Run
from interp.errors import UserError

DEFAULT_DRAWS = 50  # random sets per control
Head = tuple[int, int]


@dataclass(frozen=True)
class Stratum:
    """One part of every random set: ``count`` heads drawn without replacement from ``pool`` (the
    eligible heads, neither tested nor excluded, of one ``layer``, or of one key/value ``group`` of
    it; None: the whole layer)."""

    layer: int
    group: int | None
    pool: tuple[Head, ...]
    count: int


def kv_group_size(model) -> int:
    """How many query heads share one key/value head (1 without grouped-query attention)."""
    n_kv = getattr(model.cfg, "n_key_value_heads", None) or model.cfg.n_heads
    return model.cfg.n_heads // n_kv


def matched_strata(model, heads: Sequence[Head], exclude: Sequence[Head] = ()) -> list[Stratum]:
    """Where the random sets matched to ``heads`` [(layer, head), ...] are drawn, layer by layer,
    from the eligible heads: those neither in ``heads`` nor in ``exclude`` [(layer, head), ...]
    (heads that may never be drawn, e.g. every head of the role under test; it may name tested heads).

    On a grouped-query model a layer is matched by key/value group: as many heads from each group's
    eligible heads as the tested set has in that group, where every group holding tested heads has
    at least as many eligible ones. Elsewhere (a group with too few, or a model whose every query
    head has its own keys and values) the layer is matched by layer alone: as many heads from all
    its eligible heads. A layer with fewer eligible heads than tested ones is refused in one line."""
    heads = check_heads(model, heads)
    if not heads:
        raise UserError("no heads to test: a control needs at least one (layer, head)")
    if len(set(heads)) < len(heads):
        repeated = next(head for head in heads if heads.count(head) > 1)
        raise UserError(f"head {repeated} is listed twice; a tested set names each head once")
    barred, size, n_heads = set(heads) | set(check_heads(model, exclude)), kv_group_size(model), model.cfg.n_heads
    strata = []
    for layer in sorted({layer for layer, _ in heads}):
        count = sum(1 for l, _ in heads if l == layer)
        others = tuple((layer, h) for h in range(n_heads) if (layer, h) not in barred)
        if len(others) < count:
            excluded = sum(1 for l, _ in barred if l == layer) - count
            raise UserError(f"layer {layer} has {count} tested heads and only {len(others)} others"
                            + (f" ({excluded} more excluded)" if excluded else "") + ", too few to draw a "
                            "layer-matched random set; test fewer of that layer's heads")
        groups = [[(layer, h) for h in range(g * size, (g + 1) * size)] for g in range(n_heads // size)]
        wanted = [(g, [h for h in group if h not in barred], sum(h in heads for h in group))
                  for g, group in enumerate(groups)]
        wanted = [(g, pool, n) for g, pool, n in wanted if n]
        if size > 1 and all(len(pool) >= n for _, pool, n in wanted):
            strata += [Stratum(layer, g, tuple(pool), n) for g, pool, n in wanted]
        else:
            strata.append(Stratum(layer, None, others, count))
    return strata


def distinct_sets(strata: Sequence[Stratum]) -> int:
    """How many different random sets the ``strata`` can give."""
    return prod(comb(len(stratum.pool), stratum.count) for stratum in strata)


def matched_random_sets(model, heads: Sequence[Head], n_draws: int = DEFAULT_DRAWS, seed: int = 0,
                        exclude: Sequence[Head] = ()) -> list[list[Head]]:
    """``n_draws`` random head sets matched to ``heads`` (``matched_strata``: by layer and, on a
    grouped-query model, by key/value group; no tested head and none of ``exclude``), each sorted
    (layer, head), seeded.

    The sets are all different where the strata allow at least ``n_draws`` different sets (drawn
    uniformly, a repeat drawn again); where they allow fewer, every possible set is used, in a
    seeded order, as evenly as ``n_draws`` allows (each ``n_draws // n`` or one more times), so
    only then do sets repeat."""
    if isinstance(n_draws, bool) or not isinstance(n_draws, int) or n_draws < 1:
        raise UserError(f"n_draws={n_draws!r}: draw at least 1 random set (the default is {DEFAULT_DRAWS})")
    strata = matched_strata(model, heads, exclude)
    generator = torch.Generator().manual_seed(seed)
    n_distinct = distinct_sets(strata)
    if n_distinct < n_draws:
        every = [sorted(head for part in parts for head in part)
                 for parts in product(*(combinations(s.pool, s.count) for s in strata))]
        order = torch.randperm(len(every), generator=generator).tolist()
        return [every[order[i % len(every)]] for i in range(n_draws)]
    drawn: dict[tuple, list[Head]] = {}
    while len(drawn) < n_draws:
        chosen = sorted(s.pool[i] for s in strata for i in torch.randperm(len(s.pool), generator=generator)[:s.count])
        drawn.setdefault(tuple(chosen), chosen)
    return list(drawn.values())


def matching_text(strata: Sequence[Stratum]) -> str:
    """How the strata match, in words: by layer, by layer and key/value group, or a mix."""
    by_group = sorted({s.layer for s in strata if s.group is not None})
    if not by_group:
        return "layer-matched"
    if len(by_group) == len({s.layer for s in strata}):
        return "layer- and key/value-group-matched"
    return f"layer-matched (key/value-group-matched in layers {', '.join(map(str, by_group))})"


@dataclass
class ControlEffects:
    """A tested head set against matched random sets (``control_effects``, ``control_from_scores``).

    heads: the tested set; sets: the random sets, n_draws of them; frame: one row per edited set,
    the tested one first: ``set`` ("tested" | "random"), ``draw`` (the random set's index, NA for the
    tested), ``heads`` (labels joined by '+'), ``metric``, ``baseline``, ``effect`` (metric -
    baseline) and its interval over prompts (``ci_low``, ``ci_high``, ``n_prompts``). effect /
    ci_low / ci_high: the tested set's; random_effect / random_ci_low / random_ci_high: the mean
    effect of the random sets, its interval resampling prompts and draws; ratio / ratio_ci_low /
    ratio_ci_high: effect / random_effect with its paired interval (``control_intervals``); NaN
    intervals for a metric without a per-prompt form.

    z / z_ci_low / z_ci_high: (effect - random_effect) / the random sets' standard deviation, with
    its interval from the same resamples of prompts and draws (``analyses.core.stats.control_z``):
    how unusual the tested set is among sets drawn at random where it sits, on a scale that, unlike
    p_value, does not stop at the number of draws; z_p_value: the two-sided normal p-value at the
    z interval's bound nearest 0 (``normal_p_value``; 1 where the interval holds 0; it assumes the
    random sets' effects spread about normally), which can be small enough to pass a false-discovery
    correction over many tests; NaN z (and p 1) where only one random set is possible, whose effect
    has no spread. p_value: (1 + the random sets whose |effect| is at least the tested |effect|) / (1
    + the random sets), each different set counted once: the Monte Carlo p-value of the tested set among
    the random ones, never below 1 / (1 + n_distinct) (the ratio's interval says how well the random
    mean is known, not how unusual the tested set is). n_distinct: how many different sets the
    matching allows (fewer than n_draws: the sets repeat); matching: how the sets were matched
    (``matching_text``); method: the edit's method ("zero", "mean_corrupted", ...); edit: what was
    edited ("ablation": the heads' outputs; a caller's own edit names itself)."""

    heads: list[Head]
    sets: list[list[Head]]
    frame: pd.DataFrame
    effect: float
    ci_low: float
    ci_high: float
    random_effect: float
    random_ci_low: float
    random_ci_high: float
    ratio: float
    ratio_ci_low: float
    ratio_ci_high: float
    z: float
    z_ci_low: float
    z_ci_high: float
    z_p_value: float
    p_value: float
    n_draws: int
    n_distinct: int
    n_prompts: int
    matching: str
    method: str
    edit: str = "ablation"

    def summary(self) -> pd.DataFrame:
        """One row: ``heads``, ``n_heads``, the tested effect, the random mean effect, the ratio and
        z, each with its interval, ``z_p_value``, ``p_value``, ``n_draws``, ``n_distinct``,
        ``n_prompts``, ``matching``, ``method``, ``edit``."""
        return pd.DataFrame([{
            "heads": "+".join(map(component_label, self.heads)), "n_heads": len(self.heads),
            "effect": self.effect, "ci_low": self.ci_low, "ci_high": self.ci_high,
            "random_effect": self.random_effect, "random_ci_low": self.random_ci_low,
            "random_ci_high": self.random_ci_high, "ratio": self.ratio, "ratio_ci_low": self.ratio_ci_low,
            "ratio_ci_high": self.ratio_ci_high, "z": self.z, "z_ci_low": self.z_ci_low, "z_ci_high": self.z_ci_high,
            "z_p_value": self.z_p_value, "p_value": self.p_value, "n_draws": self.n_draws,
            "n_distinct": self.n_distinct, "n_prompts": self.n_prompts, "matching": self.matching,
            "method": self.method, "edit": self.edit}])

    def describe(self) -> str:
        """One sentence with the numbers (``describe_control`` of ``summary``)."""
        return describe_control(self.summary().iloc[0])


def describe_control(row) -> str:
    """A ``ControlEffects.summary`` row in one sentence: the tested effect, the random sets' mean
    effect, the ratio and z, each with its 95% interval, z's normal p (at its interval's bound nearest
    0) and the Monte Carlo p, and how
    many draws and prompts."""
    repeats = ("" if row["n_distinct"] >= row["n_draws"] else ", the only possible set" if row["n_distinct"] == 1
               else f", every one of the {int(row['n_distinct'])} possible sets")
    effect = effect_text(row["effect"], row["ci_low"], row["ci_high"])
    return (f"{row['heads']} ({row['method']} {row['edit']}): effect {effect}; {row['matching']} random sets of "
            f"{int(row['n_heads'])}: "
            f"mean {effect_text(row['random_effect'], row['random_ci_low'], row['random_ci_high'])}; "
            f"ratio {row['ratio']:.2f}x [{row['ratio_ci_low']:.2f}, {row['ratio_ci_high']:.2f}], "
            f"z {effect_text(row['z'], row['z_ci_low'], row['z_ci_high'], digits=1)} (normal p "
            f"{row['z_p_value']:.2g}), p {row['p_value']:.3f} (95% intervals; {int(row['n_draws'])} draws{repeats}, "
            f"{int(row['n_prompts'])} prompts)")


def control_effects(model, tokens, heads: Sequence[Head], method: str = "zero", metric: Metric | None = None, *,
                    n_draws: int = DEFAULT_DRAWS, seed: int = 0, reference=None, preserve_patterns: bool = False,
                    run: Run | None = None, memory_mb: float | None = None, progress: bool | None = None,
                    n_boot: int = N_BOOT, exclude: Sequence[Head] = ()) -> ControlEffects:
    """Ablate ``heads`` [(layer, head), ...] and ``n_draws`` matched random sets
    (``matched_random_sets``; never a head of ``exclude``: pass every head of the role or class under
    test, tested or not), all as the variants of one batched sweep, on ``tokens`` (ids, texts
    or ``RepeatedProbes``) -> ``ControlEffects`` (``control_from_scores``).

    ``method``, ``metric`` (default: the mean next-token loss), ``reference``, ``preserve_patterns``,
    ``run`` (a ``Run`` of the prompts that serves instead of a forward): as ``prepare_ablation``
    takes them. ``seed`` seeds the draws, a resample ablation and the
    bootstraps. Each effect's numerator per prompt is the prompt's metric numerator ablated minus
    unablated (``Ablation.scores``). ``memory_mb``, ``progress``: the execution's
    (``analyses.core.execution``; None: the current one's)."""
    sets = matched_random_sets(model, heads, n_draws, seed, exclude)
    with executing(memory_mb, progress):
        ablation = prepare_ablation(model, tokens, method, metric, reference=reference,
                                    preserve_patterns=preserve_patterns, seed=seed, run=run)
        scores = ablation.scores([check_heads(model, heads), *sets], desc="control")
    return control_from_scores(model, heads, sets, scores, ablation.baseline_scores(), len(ablation.tokens), method,
                               exclude=exclude, n_boot=n_boot, seed=seed)


def control_from_scores(model, heads: Sequence[Head], sets: Sequence[Sequence[Head]], scores: PromptScores,
                        baseline: PromptScores, n_batch: int, method: str, *, edit: str = "ablation",
                        exclude: Sequence[Head] = (), n_boot: int = N_BOOT, seed: int = 0) -> ControlEffects:
    """A control's statistics from an edit of ``heads`` and of each of ``sets`` (``matched_random_sets``
    of ``heads`` and ``exclude``, drawn with ``seed``) scored on the same prompts, whatever the edit:
    ``scores`` the tested set's then each set's (values (1 + len(sets),), numerators (1 + len(sets),
    batch) where the metric has a per-prompt form), ``baseline`` the unedited run's (values 0-d,
    numerators (batch,), counts), on ``n_batch`` prompts -> ``ControlEffects``.

    The tested and each random set's interval is ``effect_intervals``' (prompts resampled); the
    random mean effect's resamples the prompts (weights w, seed ``seed``) and the draws (weights v,
    seed ``seed + 1``) at once, sum over prompts and draws of w * differences * v over (n_draws *
    sum of w * counts), and the ratio's and z's from the same resamples
    (``analyses.core.stats.control_intervals``, ``control_z``). Prompts that count nothing are left out."""
    strata = matched_strata(model, heads, exclude)
    heads, sets = check_heads(model, heads), [list(s) for s in sets]
    low, high, n_prompts = effect_intervals(scores, baseline, n_batch, seed=seed)
    baseline_value = float(baseline.values)
    effects = scores.values.cpu().double() - baseline_value
    frame = pd.DataFrame({"set": ["tested"] + ["random"] * len(sets),
                          "draw": pd.array([None, *range(len(sets))], dtype="Int64"),
                          "heads": ["+".join(map(component_label, group)) for group in [heads, *sets]],
                          "metric": scores.values.cpu().numpy(), "baseline": baseline_value,
                          "effect": effects.cpu().numpy()})
    frame = frame.assign(**dict(zip(EFFECT_COLUMNS, (low.cpu().numpy(), high.cpu().numpy(), n_prompts))))
    random_effect = float(effects[1:].mean())
    distinct = torch.tensor(frame.drop_duplicates("heads").index[1:].to_numpy())  # each different random set once
    p_value = (1 + int((effects[distinct].abs() >= effects[0].abs()).sum())) / (1 + len(distinct))
    ratio = float(effects[0] / effects[1:].mean())  # infinite or NaN where the random mean is 0
    nan = (float("nan"), float("nan"))
    random_ci = ratio_ci = nan
    spread = len(distinct) > 1  # one possible set (however often drawn) has no spread to measure against
    z = float((effects[0] - effects[1:].mean()) / effects[1:].std()) if spread else float("nan")
    z_ci = nan
    if scores.numerators is not None and baseline.numerators is not None:
        counted = (baseline.counts > 0).cpu()
        differences = (scores.numerators - baseline.numerators).cpu().double().T[counted]  # (prompts, 1 + draws)
        counts = baseline.counts.cpu().double()[counted]
        random_ci, ratio_ci = control_intervals(differences[:, 0], differences[:, 1:], counts, n_boot=n_boot, seed=seed)
        if spread:
            _, *z_ci = control_z(differences[:, 0], differences[:, 1:], counts, n_boot=n_boot, seed=seed)
    return ControlEffects(heads, sets, frame, float(effects[0]), float(low[0]), float(high[0]), random_effect,
                          *random_ci, ratio, *ratio_ci, z, *z_ci, normal_p_value(*z_ci), p_value, len(sets),
                          distinct_sets(strata), n_prompts, matching_text(strata), method, edit)


def control_figure(control: ControlEffects, title: str | None = None) -> Figure:
    """The random sets' effects (a histogram, with their mean and its interval) against the tested
    set's effect and its interval; the ratio and its interval in the title."""
    figure = new_figure(figsize=(6.4, 3.6))
    ax = figure.subplots()
    random = control.frame[control.frame["set"] == "random"]
    sns.histplot(data=random, x="effect", ax=ax, color="grey", bins=min(20, max(5, len(random) // 3)),
                 label=f"{control.n_draws} random sets")
    ax.axvspan(control.random_ci_low, control.random_ci_high, color="grey", alpha=0.2)
    ax.axvline(control.random_effect, color="grey", linestyle="--", label="random mean (95% interval)")
    ax.axvspan(control.ci_low, control.ci_high, color="tab:red", alpha=0.2)
    ax.axvline(control.effect, color="tab:red", label="tested (95% interval)")
    ax.set_xlabel(f"effect of {control.method} {control.edit} (metric - baseline)")
    ax.legend(fontsize="small")
    ax.set_title(title or f"{len(control.heads)} heads vs {control.matching} random sets: "
                          f"{control.ratio:.2f}x [{control.ratio_ci_low:.2f}, {control.ratio_ci_high:.2f}]",
                 fontsize="medium")
    return figure
