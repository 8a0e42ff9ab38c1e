"""The calibration section of the head-role report (architecture §4.7): its seaborn figures.

The tables come from ``analyses.roles.calibration`` (``calibration_frames``: the role nulls, the
heads' and MLPs' effects, backup groups, dormant heads, head similarities); this module draws them
(``section_figures``) and ``calibration_section(model, probes)`` computes and draws the whole
section. Each figure is a matplotlib ``Figure`` (``analyses.core.plots.png_bytes`` makes PNG bytes of it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import pandas as pd
import seaborn as sns
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from analyses.core.plots import effect_error_bars, heatmap, new_figure
from analyses.core.probes import RepeatedProbes
from analyses.roles.calibration import calibration_frames
from analyses.roles.classify import ALL_ROLES, MEANING_ROLES
from analyses.roles.dormant import DORMANT_BELOW, Similarity

# no figure of every head is wider or taller than this (10,000 pixels at the report's 100 dpi): past
# 2 ** 16 pixels matplotlib refuses to draw it (a 70B model has 5120 heads), and long before, such a
# figure costs gigabytes to draw; where the heads do not fit at their usual size, their labels are left out
MAX_INCHES = 100.0


@dataclass
class CalibrationSection:
    """frames: name -> table (``analyses.roles.calibration.calibration_frames``' tables); figures:
    name -> Figure; captions: name -> text."""

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


def section_figures(frames: dict[str, pd.DataFrame], similarities: dict[str, Similarity]) -> dict[str, Figure]:
    """The section's figures from ``calibration_frames``' output (no backup figure without pairs)."""
    direct = frames["effects"]["direct"].notna().any()  # the direct effects, where the plan kept them
    figures = {"null_bands": null_band_figure(frames["calibration"]),
               **({"self_repair": self_repair_figure(frames["effects"])} if direct else {}),
               "dormant": dormant_figure(frames["dormant"]), "similarity": similarity_figure(similarities)}
    if not frames["pairs"].empty:
        figures["backup"] = backup_figure(frames["pairs"])
    return figures


def head_extent(n_heads: int, per_head: float, margin: float, limit: float = MAX_INCHES) -> tuple[float, bool]:
    """Inches for an axis of ``n_heads`` heads at ``per_head`` inches each plus ``margin``, at most
    ``limit``; and whether each head still gets its ``per_head`` (room for its label)."""
    wanted = per_head * n_heads + margin
    return min(wanted, limit), wanted <= limit


def _figure(width: float, height: float, n_cols: int = 1):
    """A figure (``new_figure``: laid out as it is drawn) and its row of axes."""
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
    return figure


def backup_figure(pairs: pd.DataFrame) -> Figure:
    """Heads x heads heatmap of the pairwise excess (joint - sum of singles), centred on 0."""
    both = pd.concat([pairs[["a", "b", "excess"]], pairs.rename(columns={"a": "b", "b": "a"})[["a", "b", "excess"]]])
    labels = list(dict.fromkeys([*pairs["a"], *pairs["b"]]))
    grid = both.pivot(index="a", columns="b", values="excess").reindex(index=labels, columns=labels)
    side = max(4.0, 0.45 * len(labels) + 2)
    figure, (ax,) = _figure(side + 1, side)
    heatmap(ax, grid, center=0.0, cmap="RdBu_r", annot=len(labels) <= 12, annot_kws={"size": 7},
            square=True, cbar_kws={"label": "excess (nats)"})
    ax.set_xlabel("")
    ax.set_ylabel("")
    ax.set_title("backup: joint minus additive ablation effect")
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
    return figure


def similarity_figure(similarities: dict[str, Similarity]) -> Figure:
    """One heatmap per similarity kind, heads in cluster order, flat clusters outlined."""
    n = len(next(iter(similarities.values())).labels)
    side, labelled = head_extent(n, 0.2, 2, limit=(MAX_INCHES - 1) / 2)  # two panels side by side
    side = max(4.0, side)
    figure, axes = _figure(2 * side + 1, side, n_cols=len(similarities))
    for ax, (kind, similarity) in zip(axes, similarities.items()):
        grid = pd.DataFrame(similarity.matrix.cpu().numpy(), index=similarity.labels, columns=similarity.labels)
        heatmap(ax, grid, vmin=-1, vmax=1, center=0, cmap="RdBu_r", square=True, xticklabels=labelled,
                yticklabels=labelled, cbar_kws={"shrink": 0.7})
        for start, size in _runs(similarity.clusters):
            ax.add_patch(_outline(start, size))
        ax.tick_params(labelsize=6)
        ax.set_title(f"{kind} similarity" + ("" if labelled else f" ({n} heads in cluster order; labels left out)"))
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
