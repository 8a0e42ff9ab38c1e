"""The role calibration (architecture §4.7): every table the report's calibration stands on, from
probes run once.

``probe_run`` is the probes' one forward (an ``analyses.interventions.run.Run``) that every step
reads; the roles are chosen on some probes (``choosing_probes``) and every ablation runs on the
others (``FirstProbes``). From them: the role nulls with Benjamini-Hochberg roles
(``role_calibration``: ``analyses.roles.nulls`` for the attention roles and
``analyses.roles.copying`` for the copying roles, in one false-discovery family), each head's and
MLP's direct and total effect (``head_effects``; the head table's columns of them: ``total_effects``,
``with_direct_effects``), backup groups from pairwise ablation of the role
heads (``backup_frames``, ``analyses.roles.backup``), dormant heads and the clustered similarity of
head outputs and patterns (``dormant_and_similarity``, ``analyses.roles.dormant``).
``calibration_frames`` runs them all in order. The figures drawn from these tables are
``analyses.report.calibration_figures``'.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import pandas as pd
import torch

from analyses.core.execution import current, executing
from analyses.core.budget import DEFAULT_MEMORY_MB, left_after
from analyses.core.hook_names import has_mlps, pattern_names, z_names
from analyses.core.metrics import Metric, as_metric, loss_metric
from analyses.core.probes import RepeatedProbes
from analyses.core.progress import progress_bar
from analyses.interventions.ablation import prepare_ablation
from analyses.interventions.run import FirstRows, Run
from analyses.roles.backup import (backup_report, direct_and_total_effects, direct_effect_reads,
                                   first_order_head_effects)
from analyses.roles.classify import DEFAULT_FDR, MEASURES, ROLES, PromptSums, probe_targets
from analyses.roles.copying import meaning_nulls, null_copying
from analyses.roles.dormant import Similarity, dormant_frame, head_similarities
from analyses.roles.nulls import (DEFAULT_NULL_SEEDS, calibrate_roles, check_null_seeds, joint_fdr, null_role_scores,
                                  score_random_models)
from interp.errors import UserError
from interp.memory import release_freed_memory

DEFAULT_PAIR_HEADS = 12  # pairwise ablation covers at most this many role heads (the largest effects)
SIMILARITY_PROMPTS = 16  # prompts the head similarities are measured on


def calibration_reads(model, method: str = "mean_aligned") -> list[str]:
    """The hooks of the probes' ``Run`` that the calibration reads (the ablations' and direct
    effects' ``hook_z`` and ``hook_mlp_out``; dormant and similarity read ``hook_z`` too)."""
    return direct_effect_reads(model, method, mlps=has_mlps(model))


def calibration_reducers(model, probes: RepeatedProbes) -> dict:
    """The streaming reducers the probes' ``Run`` feeds for the calibration: every head's per-prompt
    pattern sums for every measure (``prompt_sums``: the role scores, also classification's) and the
    patterns of the first ``SIMILARITY_PROMPTS`` probes (``similarity``)."""
    return {"prompt_sums": PromptSums(model, probe_targets(probes), MEASURES),
            "similarity": FirstRows(pattern_names(model), SIMILARITY_PROMPTS)}


def probe_run(model, probes: RepeatedProbes, metric: Metric | None = None, names: Sequence[str] = (), *,
              intervention_prompts: int | None = None) -> Run:
    """The one ``Run`` of the probes that the calibration (and the report) reads: one forward keeping
    ``calibration_reads`` and ``names`` (of the first ``intervention_prompts`` probes only, the ones
    the interventions run on; None: all), feeding ``calibration_reducers`` every probe; ``metric``
    default the loss of the probes' predictable tokens. Within the current execution: its memory
    bounds the forward's chunks, its progress shows the forward's bar."""
    metric = metric if metric is not None else loss_metric(probes.tokens, probes.predictable)
    return Run.make(model, probes.tokens, metric, [*calibration_reads(model), *names],
                    reducers=calibration_reducers(model, probes), keep_rows=intervention_prompts,
                    progress=current().progress, desc="probes")


@dataclass(frozen=True)
class FirstProbes:
    """The probes the interventions run on: the first ``n`` of a batch, the batch's ``Run`` and
    metric restricted to them (``Run.first``, ``analyses.core.metrics.Metric.rows``)."""

    probes: RepeatedProbes
    run: Run
    metric: Metric

    @classmethod
    def of(cls, probes: RepeatedProbes, run: Run, metric: Metric, n: int | None) -> "FirstProbes":
        """The first ``n`` (None, or at least the batch: every probe, and ``metric`` as it is)."""
        if n is None or n >= probes.n_prompts:
            return cls(probes, run, metric)
        metric = as_metric(metric)
        if not metric.restricts:
            raise UserError(f"intervention_prompts={n}: the metric {metric!r} cannot be restricted to the first "
                            f"{n} prompts (a metric built by analyses.core.metrics can); pass None for all")
        return cls(probes.first(n), run.first(n), metric.rows(slice(0, n)))


def choosing_probes(probes: RepeatedProbes, run: Run, n: int | None) -> tuple[RepeatedProbes, Run]:
    """The probes the roles are chosen on where the interventions run on the first ``n``: the others,
    so every effect is measured on prompts that did not choose the heads (architecture §4.12), and a ``Run``
    of them holding only their per-prompt pattern sums (``reduced["prompt_sums"]`` of ``run``, all that
    classification and the role nulls read from it), nothing run again. ``n`` None: every probe, the
    interventions' too (in-sample). Refused in one line where fewer than 2 probes are left (the role
    nulls' t-test compares prompts)."""
    if n is None:
        return probes, run
    if probes.n_prompts - n < 2:
        raise UserError(f"intervention_prompts={n} leaves {max(probes.n_prompts - n, 0)} of the {probes.n_prompts} "
                        "probes to choose the roles on; at least 2 are needed")
    sums = {measure: numerators[n:] for measure, numerators in run.reduced["prompt_sums"].items()}
    return probes.after(n), Run(run.model, run.tokens[n:], reduced={"prompt_sums": sums}, memory_mb=run.memory_mb)


@dataclass(frozen=True)
class CalibrationOptions:
    """What ``calibration_frames`` is asked for beyond its probes.

    method: the ablation method of every ablation; null_seeds: the random-initialisation nulls'
    seeds; fdr: the Benjamini-Hochberg rate over every (head, role) test; pair_heads: pairwise
    ablation covers the heads with a role at ``fdr`` that have the largest |total effect|, at most
    this many (pairs grow as its square); seed: the control probes' shuffle;
    intervention_prompts: the ablations (effects, backup, dormant, similarities) run on the first
    this many probes (``FirstProbes``), the roles on the others (``choosing_probes``), None: both
    on every probe; direct: False where the plan left the heads' direct effects out
    (``direct_effect_needs``): the totals alone, no self-repair figure; memory_mb: the budget, of
    which each step gets what the probe run's store leaves; progress: see ``analyses.core.progress``."""

    method: str = "mean_aligned"
    null_seeds: Sequence[int] = DEFAULT_NULL_SEEDS
    fdr: float = DEFAULT_FDR
    pair_heads: int = DEFAULT_PAIR_HEADS
    seed: int = 0
    intervention_prompts: int | None = None
    direct: bool = True
    memory_mb: float = DEFAULT_MEMORY_MB
    progress: bool | None = None

    def but(self, **changes) -> "CalibrationOptions":
        """A copy with ``changes`` (a name that is not an option: a TypeError naming it)."""
        return replace(self, **changes)


def calibration_frames(model, probes: RepeatedProbes, options: CalibrationOptions | None = None, *,
                       metric: Metric | None = None, run: Run | None = None, choose: "FirstProbes | None" = None,
                       **changes) -> tuple[dict[str, pd.DataFrame], dict[str, Similarity]]:
    """The calibration's tables on ``probes`` by name (``calibration``: every (head, role) test;
    ``pairs``, ``groups``: the backup pairs and groups; ``effects``, ``mlp_effects``: the heads' and
    the MLPs' effects, the latter empty without MLPs; ``dormant``; ``output_clusters``,
    ``pattern_clusters``) and the head similarities by kind (``output``, ``pattern``).

    options: ``CalibrationOptions`` (default its defaults), with the keyword arguments ``changes``
    (``fdr=``, ``pair_heads=``, ... any of its fields) on top. metric: default the loss of the
    probes' predictable tokens (the run's metric where it has one); run: the probes' ``probe_run``
    (made here where None), which every step reads instead of running the probes again. The
    ``calibration`` table holds every (head, role) test, the attention roles (``calibrate_roles``)
    and the copying roles (``meaning_nulls``), with one Benjamini-Hochberg over all of them
    (``joint_fdr``). choose: probes apart from the intervention probes with a ``Run`` reading the
    ablation's hooks (the report's selection rows): the pairwise ablation's heads are ranked by
    their first-order effect there (``first_order_head_effects``) and its backup groups formed
    there (``backup_report(choose=...)``); None: both on the intervention probes (in-sample).
    """
    o = (options or CalibrationOptions()).but(**changes)
    if run is None:
        with executing(memory_mb=o.memory_mb):
            run = probe_run(model, probes, metric, intervention_prompts=o.intervention_prompts)
    metric = metric if metric is not None else run.metric
    first = FirstProbes.of(probes, run, metric, o.intervention_prompts)
    chosen_on, chosen_run = choosing_probes(probes, run, o.intervention_prompts)
    with executing(progress=o.progress):
        steps = progress_bar(total=4, desc="calibration", unit="step")
        with executing(memory_mb=left_after(o.memory_mb, run.held_mb())):  # the run's store stays taken
            calibration = role_calibration(model, chosen_on, seed=o.seed, null_seeds=o.null_seeds, fdr=o.fdr,
                                           run=chosen_run)
            steps.update()
            effects, mlp_effects = head_effects(model, first, o.method, direct=o.direct)
            steps.update()
            pairs, groups = backup_frames(model, first, calibration, effects, o.method, pair_heads=o.pair_heads,
                                          choose=choose)
            steps.update()
        dormant, similarities = dormant_and_similarity(model, probes, run, first, effects)
        steps.update()
        steps.close()
    frames = {"calibration": calibration, "pairs": pairs, "groups": groups, "effects": effects, "mlp_effects": mlp_effects,
              "dormant": dormant,
              "output_clusters": similarities["output"].frame(), "pattern_clusters": similarities["pattern"].frame()}
    return frames, similarities


def role_calibration(model, probes: RepeatedProbes, *, seed: int = 0, null_seeds: Sequence[int] = DEFAULT_NULL_SEEDS,
                     fdr: float = DEFAULT_FDR, run: Run | None = None) -> pd.DataFrame:
    """The report's calibration table on ``probes`` (the probes the roles are chosen on:
    ``choosing_probes``; ``run``: a ``Run`` of them, see ``calibrate_roles``): every (head, attention
    role) against its nulls (``calibrate_roles``) and every (head, meaning role) against its
    random-initialisation null (``meaning_nulls``), with one Benjamini-Hochberg at ``fdr`` over all of
    them (``joint_fdr``). Reads no ablation: the roles are decided by these tests and the scores alone.
    Both nulls read the same null models, each made once (``random_init_scores``); their memory goes
    back to the system before it returns. Within the current execution's memory
    (``analyses.core.execution``)."""
    check_null_seeds(null_seeds)
    attention, copying = random_init_scores(model, probes, null_seeds)
    calibration = joint_fdr(calibrate_roles(model, probes, seed=seed, null_seeds=null_seeds, fdr=fdr, run=run,
                                            random_scores=attention),
                            meaning_nulls(model, null_seeds, null_scores=copying),
                            fdr=fdr)
    release_freed_memory()  # the null models' memory, before the ablations
    return calibration


def random_init_scores(model, probes: RepeatedProbes,
                       null_seeds: Sequence[int] = DEFAULT_NULL_SEEDS) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Both random-initialisation nulls from one null model per seed in ``null_seeds``, one alive at
    a time (``score_random_models``) -> (role -> (seeds, layer, head): the attention roles' scores on
    ``probes``, as ``random_init_null``; (seeds, layer, head): the OV copying scores, as
    ``meaning_nulls`` draws them). The current execution's memory counts the null model."""
    memory_mb = current().memory_mb
    both = score_random_models(model, null_seeds, lambda null: (null_role_scores(null, probes, memory_mb),
                                                                null_copying(null, memory_mb)))
    attention = {role: torch.stack([scores[role] for scores, _ in both]) for role in ROLES}
    return attention, torch.stack([copying for _, copying in both])


def head_effects(model, first: FirstProbes, method: str = "mean_aligned", *,
                 direct: bool = True) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Every head's and every MLP's total (and, with ``direct``, direct) ablation effect on ``first``'s
    probes and run (``direct_and_total_effects``) -> (the heads' rows, the MLPs' rows, the latter
    empty without MLPs), within the current execution."""
    effects = direct_and_total_effects(model, first.probes, None, method, first.metric, mlps=has_mlps(model),
                                       run=first.run, direct=direct)
    return effects[effects["kind"] == "head"], effects[effects["kind"] == "mlp"].reset_index(drop=True)


def backup_frames(model, first: FirstProbes, calibration: pd.DataFrame, effects: pd.DataFrame,
                  method: str = "mean_aligned", *, pair_heads: int = DEFAULT_PAIR_HEADS,
                  choose: FirstProbes | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The backup ``pairs`` and ``groups`` (``backup_report``) of the role heads (``calibration``'s
    significant ones) with the largest |effect|, at most ``pair_heads``: ranked by their first-order
    effect on ``choose`` where given (``first_order_head_effects``), else by ``effects`` (the heads'
    total effects on ``first``, in-sample); two empty frames where fewer than two heads qualify. Within
    the current execution."""
    chooser = None if choose is None else prepare_ablation(model, choose.probes, method, choose.metric,
                                                           run=choose.run)
    role_heads = role_heads_by_effect(calibration, effects if chooser is None else
                                      first_order_head_effects(chooser), pair_heads)
    if len(role_heads) < 2:
        return pd.DataFrame(), pd.DataFrame()
    return backup_report(model, first.probes, role_heads, method, first.metric, run=first.run, choose=chooser)


def dormant_and_similarity(model, probes: RepeatedProbes, run: Run, first: FirstProbes,
                           effects: pd.DataFrame) -> tuple[pd.DataFrame, dict[str, Similarity]]:
    """The ``dormant`` table (each head's output norm and whether its total ablation, ``effects``, is a
    no-op) and the head similarities of outputs and patterns on the first ``SIMILARITY_PROMPTS`` probes,
    all read from ``run`` (the probes' ``probe_run``) and ``first``'s run: no forward."""
    dormant = dormant_frame(model, first.probes.tokens, *(effects[c].to_numpy() for c in ("total", "total_ci_low",
                                                                                        "total_ci_high")), run=first.run)
    sample = min(SIMILARITY_PROMPTS, first.probes.n_prompts)
    similarities = head_similarities(model, probes.tokens[:sample],
                                     cache={name: z[:sample] for name, z in first.run.read(z_names(model)).items()}
                                     | {name: pattern[:sample] for name, pattern in run.reduced["similarity"].items()})
    return dormant, similarities


def role_heads_by_effect(calibration: pd.DataFrame, effects: pd.DataFrame, limit: int) -> list[tuple[int, int]]:
    """The heads with a significant role, largest |total effect| first, at most ``limit``, in
    (layer, head) order."""
    significant = calibration.loc[calibration["significant"], ["layer", "head"]].drop_duplicates()
    ranked = significant.merge(effects, on=["layer", "head"])
    ranked = ranked.assign(size=ranked["total"].abs()).sort_values(["size", "layer", "head"], ascending=[False, True, True])
    return sorted((int(l), int(h)) for l, h in ranked[["layer", "head"]].head(limit).itertuples(index=False))


def total_effects(effects: pd.DataFrame) -> pd.DataFrame:
    """``layer, head, ablation_effect, ablation_ci_low, ablation_ci_high, ablation_n_prompts``: each head's
    total ablation effect and its 95% interval over prompts, from the ablation section's ``effects``
    (``head_effects``: position-aligned mean ablation, loss on the probes' predictable tokens)."""
    names = {"total": "ablation_effect", "total_ci_low": "ablation_ci_low", "total_ci_high": "ablation_ci_high",
             "n_prompts": "ablation_n_prompts"}
    return effects.rename(columns=names)[["layer", "head", *names.values()]]


def with_direct_effects(table: pd.DataFrame, effects: pd.DataFrame) -> pd.DataFrame:
    """The head table with each head's direct effect (downstream frozen, as the ablation measured it in ``effects``;
    NaN where the plan left direct effects out) and its 95% interval, ``direct_effect, direct_ci_low,
    direct_ci_high``, right after the ablation (total) effect's columns and ``causal``."""
    direct = effects[["layer", "head", "direct", "direct_ci_low", "direct_ci_high"]]
    merged = table.merge(direct.rename(columns={"direct": "direct_effect"}).astype({"head": int}), on=["layer", "head"],
                         how="left")
    at = list(table.columns).index("causal") + 1
    return merged[[*table.columns[:at], "direct_effect", "direct_ci_low", "direct_ci_high", *table.columns[at:]]]
