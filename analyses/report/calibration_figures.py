"""The calibration section of the head-role report (DESIGN 4.7): its tables and seaborn figures.

``calibration_section(model, probes)`` computes everything the section shows, from probes made
once: the role nulls with Benjamini-Hochberg roles (``analyses.roles.nulls``; the attention roles and
the copying roles of ``analyses.components.meaning`` in one false-discovery family), backup groups from
pairwise ablation of the role heads and each head's direct vs total effect (``analyses.roles.backup``),
dormant heads and the clustered similarity of head outputs and patterns (``analyses.roles.dormant``).
Each figure is a matplotlib ``Figure`` (``analyses.core.plots.png_bytes`` makes PNG bytes of it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import pandas as pd
import seaborn as sns
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from analyses.interventions.ablation import prepare_ablation
from analyses.roles.backup import (backup_report, direct_and_total_effects, direct_effect_reads,
                                   first_order_head_effects)
from analyses.core.budget import DEFAULT_MEMORY_MB, left_after
from analyses.components.meaning import meaning_nulls
from analyses.roles.classify import ALL_ROLES, DEFAULT_FDR, MEANING_ROLES, MEASURES, PromptSums, probe_targets
from analyses.roles.dormant import DORMANT_BELOW, Similarity, dormant_frame, head_similarities
from analyses.core.hook_names import has_mlps, pattern_names, z_names
from analyses.core.metrics import Metric, as_metric, loss_metric
from analyses.roles.nulls import DEFAULT_NULL_SEEDS, calibrate_roles, joint_fdr
from analyses.core.probes import RepeatedProbes
from analyses.core.progress import progress_bar
from analyses.interventions.run import FirstRows, Run
from analyses.core.plots import effect_error_bars, new_figure
from interp.errors import UserError
from interp.memory import release_freed_memory

DEFAULT_PAIR_HEADS = 12  # pairwise ablation covers at most this many role heads (the largest effects)
# no figure of every head is wider or taller than this (10,000 pixels at the report's 100 dpi): past
# 2 ** 16 pixels matplotlib refuses to draw it (a 70B model has 5120 heads), and long before, such a
# figure costs gigabytes to draw; where the heads do not fit at their usual size, their labels are left out
MAX_INCHES = 100.0
SIMILARITY_PROMPTS = 16  # prompts the head similarities are measured on


@dataclass
class CalibrationSection:
    """frames: name -> table (``calibration``, ``pairs``, ``groups``, ``effects`` (the heads'),
    ``mlp_effects`` (the MLPs', empty without MLPs), ``dormant``, ``output_clusters``,
    ``pattern_clusters``); figures: name -> Figure; captions: name -> text."""

    frames: dict[str, pd.DataFrame]
    figures: dict[str, Figure]
    captions: dict[str, str] = field(default_factory=dict)


CAPTIONS = {
    "null_bands": "Each head's role score (dot) against its null band (grey: centre +- 1.96 spread); "
                  "red: beats its nulls at the false-discovery rate (a role also needs the score threshold)",
    "backup": "Pairwise ablation of role heads: joint effect minus the sum of single effects (nats)",
    "self_repair": "Direct effect (downstream frozen) vs total effect of ablating each head (nats)",
    "dormant": "Output norm relative to the layer's mean head; crosses: ablation is a no-op",
    "similarity": "Cosine similarity of head outputs and of attention patterns, in cluster order",
}


def calibration_section(model, probes: RepeatedProbes, **options) -> CalibrationSection:
    """The calibration section on ``probes``: ``calibration_frames`` (``options`` go there) and
    their figures (``section_figures``)."""
    frames, similarities = calibration_frames(model, probes, **options)
    figures = section_figures(frames, similarities)
    return CalibrationSection(frames, figures, {name: CAPTIONS[name] for name in figures})


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
              intervention_prompts: int | None = None, memory_mb: float = DEFAULT_MEMORY_MB,
              progress: bool | None = None) -> Run:
    """The one ``Run`` of the probes that the calibration (and the report) reads: one forward keeping
    ``calibration_reads`` and ``names`` (of the first ``intervention_prompts`` probes only, the ones
    the interventions run on; None: all), feeding ``calibration_reducers`` every probe; ``metric``
    default the loss of the probes' predictable tokens."""
    metric = metric if metric is not None else loss_metric(probes.tokens, probes.predictable)
    return Run.make(model, probes.tokens, metric, [*calibration_reads(model), *names],
                    reducers=calibration_reducers(model, probes), keep_rows=intervention_prompts,
                    memory_mb=memory_mb, progress=progress, desc="probes")


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
    so every effect is measured on prompts that did not choose the heads (DESIGN 4.12), and a ``Run``
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


def calibration_frames(model, probes: RepeatedProbes, *, metric: Metric | None = None, method: str = "mean_aligned",
                       null_seeds: Sequence[int] = DEFAULT_NULL_SEEDS, fdr: float = DEFAULT_FDR,
                       pair_heads: int = DEFAULT_PAIR_HEADS, seed: int = 0, memory_mb: float = DEFAULT_MEMORY_MB,
                       progress: bool | None = None, run: Run | None = None,
                       intervention_prompts: int | None = None, direct: bool = True,
                       choose: "FirstProbes | None" = None) -> tuple[dict[str, pd.DataFrame], dict[str, Similarity]]:
    """The section's tables on ``probes`` (see ``CalibrationSection``) and the head similarities.

    metric: default the loss of the probes' predictable tokens (the run's metric where it has
    one); method: the ablation method of every ablation here; pair_heads: pairwise ablation covers
    the heads with a role at ``fdr`` that have the largest |total effect|, at most this many (pairs
    grow as its square); seed: the control probes' shuffle; run: the probes' ``probe_run`` (made
    here where None), which every step reads instead of running the probes again. The
    ``calibration`` table holds every (head, role) test, the attention roles (``calibrate_roles``)
    and the copying roles (``meaning_nulls``), with one Benjamini-Hochberg over all of them
    (``joint_fdr``). intervention_prompts: the ablations (effects, backup, dormant, similarities)
    run on the first this many probes (``FirstProbes``), the roles on the others (``choosing_probes``);
    None: both on every probe; each
    step's budget is what the run's store leaves of ``memory_mb``. direct: False where the plan left
    the heads' direct effects out (``direct_effect_needs``): the totals alone, no self-repair figure.
    choose: probes apart from the intervention probes with a ``Run`` reading the ablation's hooks (the
    report's selection rows, ``analyses.report.build.selection_probes``): the pairwise ablation's heads
    are ranked by their first-order effect there (``first_order_head_effects``) and its backup groups
    formed there (``backup_report(choose=...)``); None: both on the intervention probes (in-sample).
    """
    run = run if run is not None else probe_run(model, probes, metric, intervention_prompts=intervention_prompts,
                                                memory_mb=memory_mb)
    metric = metric if metric is not None else run.metric
    first = FirstProbes.of(probes, run, metric, intervention_prompts)
    chosen_on, chosen_run = choosing_probes(probes, run, intervention_prompts)
    memory_mb = left_after(memory_mb, run.held_mb())  # the run's store stays taken
    steps = progress_bar(total=4, progress=progress, desc="calibration", unit="step")
    calibration = role_calibration(model, chosen_on, seed=seed, null_seeds=null_seeds, fdr=fdr, memory_mb=memory_mb,
                                   progress=progress, run=chosen_run)
    steps.update()
    effects, mlp_effects = head_effects(model, first, method, direct=direct, memory_mb=memory_mb, progress=progress)
    steps.update()
    pairs, groups = backup_frames(model, first, calibration, effects, method, pair_heads=pair_heads, choose=choose,
                                  memory_mb=memory_mb, progress=progress)
    steps.update()
    dormant, similarities = dormant_and_similarity(model, probes, run, first, effects)
    steps.update()
    steps.close()
    frames = {"calibration": calibration, "pairs": pairs, "groups": groups, "effects": effects, "mlp_effects": mlp_effects,
              "dormant": dormant,
              "output_clusters": similarities["output"].frame(), "pattern_clusters": similarities["pattern"].frame()}
    return frames, similarities


def role_calibration(model, probes: RepeatedProbes, *, seed: int = 0, null_seeds: Sequence[int] = DEFAULT_NULL_SEEDS,
                     fdr: float = DEFAULT_FDR, memory_mb: float = DEFAULT_MEMORY_MB, progress: bool | None = None,
                     run: Run | None = None) -> pd.DataFrame:
    """The report's calibration table on ``probes`` (the probes the roles are chosen on:
    ``choosing_probes``; ``run``: a ``Run`` of them, see ``calibrate_roles``): every (head, attention
    role) against its nulls (``calibrate_roles``) and every (head, meaning role) against its
    random-initialisation null (``meaning_nulls``), with one Benjamini-Hochberg at ``fdr`` over all of
    them (``joint_fdr``). Reads no ablation: the roles are decided by these tests and the scores alone.
    The null models' memory goes back to the system before it returns."""
    calibration = joint_fdr(calibrate_roles(model, probes, seed=seed, null_seeds=null_seeds, fdr=fdr,
                                            memory_mb=memory_mb, progress=progress, run=run),
                            meaning_nulls(model, null_seeds, progress, memory_mb=memory_mb), fdr=fdr)
    release_freed_memory()  # the null models' memory, before the ablations
    return calibration


def head_effects(model, first: FirstProbes, method: str = "mean_aligned", *, direct: bool = True,
                 memory_mb: float = DEFAULT_MEMORY_MB, progress: bool | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Every head's and every MLP's total (and, with ``direct``, direct) ablation effect on ``first``'s
    probes and run (``direct_and_total_effects``) -> (the heads' rows, the MLPs' rows, the latter
    empty without MLPs)."""
    effects = direct_and_total_effects(model, first.probes, None, method, first.metric, mlps=has_mlps(model),
                                       memory_mb=memory_mb, progress=progress, run=first.run, direct=direct)
    return effects[effects["kind"] == "head"], effects[effects["kind"] == "mlp"].reset_index(drop=True)


def backup_frames(model, first: FirstProbes, calibration: pd.DataFrame, effects: pd.DataFrame,
                  method: str = "mean_aligned", *, pair_heads: int = DEFAULT_PAIR_HEADS, choose: FirstProbes | None = None,
                  memory_mb: float = DEFAULT_MEMORY_MB, progress: bool | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The backup ``pairs`` and ``groups`` (``backup_report``) of the role heads (``calibration``'s
    significant ones) with the largest |effect|, at most ``pair_heads``: ranked by their first-order
    effect on ``choose`` where given (``first_order_head_effects``), else by ``effects`` (the heads'
    total effects on ``first``, in-sample); two empty frames where fewer than two heads qualify."""
    chooser = None if choose is None else prepare_ablation(model, choose.probes, method, choose.metric,
                                                           run=choose.run, memory_mb=memory_mb)
    role_heads = role_heads_by_effect(calibration, effects if chooser is None else
                                      first_order_head_effects(chooser, memory_mb), pair_heads)
    if len(role_heads) < 2:
        return pd.DataFrame(), pd.DataFrame()
    return backup_report(model, first.probes, role_heads, method, first.metric, memory_mb=memory_mb,
                         progress=progress, run=first.run, choose=chooser)


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


def section_figures(frames: dict[str, pd.DataFrame], similarities: dict[str, Similarity]) -> dict[str, Figure]:
    """The section's figures from ``calibration_frames``' output (no backup figure without pairs)."""
    direct = frames["effects"]["direct"].notna().any()  # the direct effects, where the plan kept them
    figures = {"null_bands": null_band_figure(frames["calibration"]),
               **({"self_repair": self_repair_figure(frames["effects"])} if direct else {}),
               "dormant": dormant_figure(frames["dormant"]), "similarity": similarity_figure(similarities)}
    if not frames["pairs"].empty:
        figures["backup"] = backup_figure(frames["pairs"])
    return figures


def role_heads_by_effect(calibration: pd.DataFrame, effects: pd.DataFrame, limit: int) -> list[tuple[int, int]]:
    """The heads with a significant role, largest |total effect| first, at most ``limit``, in
    (layer, head) order."""
    significant = calibration.loc[calibration["significant"], ["layer", "head"]].drop_duplicates()
    ranked = significant.merge(effects, on=["layer", "head"])
    ranked = ranked.assign(size=ranked["total"].abs()).sort_values(["size", "layer", "head"], ascending=[False, True, True])
    return sorted((int(l), int(h)) for l, h in ranked[["layer", "head"]].head(limit).itertuples(index=False))


def head_extent(n_heads: int, per_head: float, margin: float, limit: float = MAX_INCHES) -> tuple[float, bool]:
    """Inches for an axis of ``n_heads`` heads at ``per_head`` inches each plus ``margin``, at most
    ``limit``; and whether each head still gets its ``per_head`` (room for its label)."""
    wanted = per_head * n_heads + margin
    return min(wanted, limit), wanted <= limit


def _figure(width: float, height: float, n_cols: int = 1):
    """A figure and its row of axes; each figure is laid out once (tight_layout) when drawn, so
    rendering it again gives the same bytes."""
    figure = new_figure(figsize=(width, height))
    return figure, figure.subplots(1, n_cols, squeeze=False)[0]


BEATS_NULL, WITHIN_NULL = "beats its nulls (FDR)", "does not"


def null_band_figure(calibration: pd.DataFrame) -> Figure:
    """One panel per role: every head's score, and its null band as a grey bar; red where the
    score beats its nulls at the false-discovery rate (a role also needs the threshold, if any)."""
    roles = [role for role in ALL_ROLES if role in calibration["role"].unique()]
    frame = calibration.assign(head_label="L" + calibration["layer"].astype(str) + "H" + calibration["head"].astype(str))
    n_heads = frame["head_label"].nunique()
    width, labelled = head_extent(n_heads, 0.22, 2)
    figure = new_figure(figsize=(max(6.0, width), 1.9 * len(roles) + 0.6))
    axes = figure.subplots(len(roles), 1, squeeze=False, sharex=True)[:, 0]
    for ax, role in zip(axes, roles):
        rows = frame[frame["role"] == role].reset_index(drop=True)
        ax.vlines(rows.index, rows["null_low"], rows["null_high"], color="0.7", linewidth=4)
        beats = rows["significant"].map({True: BEATS_NULL, False: WITHIN_NULL})
        sns.scatterplot(x=rows.index, y=rows["score"], hue=beats, hue_order=[BEATS_NULL, WITHIN_NULL],
                        palette={BEATS_NULL: "C3", WITHIN_NULL: "C0"}, ax=ax, s=18, legend=ax is axes[0])
        ax.set_ylabel(role.replace("_", " "))
        ax.set_ylim(-1.02 if role in MEANING_ROLES else -0.02, 1.02)  # copying scores lie in [-1, 1]
    _head_ticks(axes[-1], frame["head_label"].unique(), labelled)
    axes[0].set_title("role scores against their nulls")
    figure.tight_layout()
    return figure


def backup_figure(pairs: pd.DataFrame) -> Figure:
    """Heads x heads heatmap of the pairwise excess (joint - sum of singles), centred on 0."""
    both = pd.concat([pairs[["a", "b", "excess"]], pairs.rename(columns={"a": "b", "b": "a"})[["a", "b", "excess"]]])
    labels = list(dict.fromkeys([*pairs["a"], *pairs["b"]]))
    grid = both.pivot(index="a", columns="b", values="excess").reindex(index=labels, columns=labels)
    side = max(4.0, 0.45 * len(labels) + 2)
    figure, (ax,) = _figure(side + 1, side)
    sns.heatmap(grid, ax=ax, center=0.0, cmap="RdBu_r", annot=len(labels) <= 12, fmt=".2f", annot_kws={"size": 7},
                square=True, cbar_kws={"label": "excess (nats)"})
    ax.set_xlabel("")
    ax.set_ylabel("")
    ax.set_title("backup: joint minus additive ablation effect")
    figure.tight_layout()
    return figure


def self_repair_figure(effects: pd.DataFrame) -> Figure:
    """Direct vs total effect per head, coloured by layer, each with its 95% interval as error bars
    (``effect_error_bars``), with the diagonal (no repair)."""
    figure, (ax,) = _figure(5.5, 4.5)
    effect_error_bars(ax, effects, "direct", "total")
    sns.scatterplot(data=effects, x="direct", y="total", hue="layer", palette="viridis", ax=ax, s=25, zorder=3)
    low = min(effects["direct"].min(), effects["total"].min())
    high = max(effects["direct"].max(), effects["total"].max())
    ax.plot([low, high], [low, high], color="0.5", linestyle="--", linewidth=1)
    ax.set_xlabel("direct effect (nats)")
    ax.set_ylabel("total effect (nats)")
    ax.set_title("self-repair: below the diagonal, later components undo the head's direct effect")
    figure.tight_layout()
    return figure


def dormant_figure(dormant: pd.DataFrame, dormant_below: float = DORMANT_BELOW) -> Figure:
    """Relative output norm per head (bars coloured by layer), the dormant line, no-op heads marked."""
    frame = dormant.assign(label="L" + dormant["layer"].astype(str) + "H" + dormant["head"].astype(str))
    width, labelled = head_extent(len(frame), 0.22, 2)
    figure, (ax,) = _figure(max(6.0, width), 3.5)
    sns.barplot(data=frame, x="label", y="relative_norm", hue="layer", palette="viridis", dodge=False, ax=ax)
    no_op = frame.index[frame["no_op"]]
    ax.scatter(no_op, frame.loc[no_op, "relative_norm"], marker="x", color="C3", zorder=3, label="no-op ablation")
    ax.axhline(dormant_below, color="C3", linestyle=":", linewidth=1)
    _head_ticks(ax, frame["label"], labelled)
    ax.set_ylabel("output norm / layer mean")
    ax.set_title("dormant heads: tiny output and no ablation effect")
    figure.tight_layout()
    return figure


def similarity_figure(similarities: dict[str, Similarity]) -> Figure:
    """One heatmap per similarity kind, heads in cluster order, flat clusters outlined."""
    n = len(next(iter(similarities.values())).labels)
    side, labelled = head_extent(n, 0.2, 2, limit=(MAX_INCHES - 1) / 2)  # two panels side by side
    side = max(4.0, side)
    figure, axes = _figure(2 * side + 1, side, n_cols=len(similarities))
    for ax, (kind, similarity) in zip(axes, similarities.items()):
        grid = pd.DataFrame(similarity.matrix.cpu().numpy(), index=similarity.labels, columns=similarity.labels)
        sns.heatmap(grid, ax=ax, vmin=-1, vmax=1, center=0, cmap="RdBu_r", square=True, xticklabels=labelled,
                    yticklabels=labelled, cbar_kws={"shrink": 0.7})
        for start, size in _runs(similarity.clusters):
            ax.add_patch(_outline(start, size))
        ax.tick_params(labelsize=6)
        ax.set_title(f"{kind} similarity" + ("" if labelled else f" ({n} heads in cluster order; labels left out)"))
    figure.tight_layout()
    return figure


def _head_ticks(ax, labels: Sequence[str], labelled: bool) -> None:
    """One x tick label per head where there is room (``head_extent``), else a note that they are
    left out."""
    if labelled:
        ax.set_xticks(range(len(labels)), labels, rotation=90, fontsize=6)
        ax.set_xlabel("")
    else:
        ax.set_xticks([])
        ax.set_xlabel(f"{len(labels)} heads in (layer, head) order (too many to label)")


def _runs(clusters: Sequence[int]) -> list[tuple[int, int]]:
    """(start, length) of each run of equal cluster ids of more than one head."""
    runs, start = [], 0
    for i in range(1, len(clusters) + 1):
        if i == len(clusters) or clusters[i] != clusters[start]:
            if i - start > 1:
                runs.append((start, i - start))
            start = i
    return runs


def _outline(start: int, size: int) -> Rectangle:
    return Rectangle((start, start), size, size, fill=False, edgecolor="black", linewidth=1.2)
