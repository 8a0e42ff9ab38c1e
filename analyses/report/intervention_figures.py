"""Output files of the ablation, patching and study commands: tables and figures, each written to a
temporary name and renamed, so no file is ever left half-written (DESIGN 5). Figures are plain
matplotlib ``Figure`` objects (no pyplot state, no backend switch), which notebooks display inline."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import seaborn as sns
from matplotlib.figure import Figure

from analyses.core.plots import heatmap as draw_heatmap
from analyses.core.plots import new_figure, png_bytes
from interp.files import write_atomic


def save_csv(frame: pd.DataFrame, path) -> Path:
    return write_atomic(path, lambda tmp: frame.to_csv(tmp, index=False))


def save_figure(fig: Figure, path) -> Path:
    return write_atomic(path, png_bytes(fig))


def _axes(width: float, height: float):
    fig = new_figure(figsize=(width, height))
    return fig, fig.subplots()


def heatmap(frame: pd.DataFrame, rows: str, columns: str, value: str, title: str, center: float | None = None,
            annotate: bool = True):
    """A rows x columns heatmap of ``value`` (e.g. layer x head) from a tidy frame; cells are
    annotated when asked and there are at most 200."""
    grid = frame.pivot(index=rows, columns=columns, values=value)
    width = min(16.0, max(4.0, 0.7 * grid.shape[1] + 2))
    fig, ax = _axes(width, min(12.0, max(3.0, 0.5 * grid.shape[0] + 1.5)))
    annotate = annotate and grid.size <= 200
    draw_heatmap(ax, grid, cmap="RdBu_r" if center is not None else "viridis", center=center,
                 annot=annotate, cbar_kws={"label": value})
    ax.set_title(title)
    return fig


def curve(frame: pd.DataFrame, x: str, y: str, title: str, baseline: float | None = None):
    fig, ax = _axes(6, 4)
    sns.lineplot(data=frame, x=x, y=y, marker="o", ax=ax)
    if baseline is not None:
        ax.axhline(baseline, color="grey", linestyle="--", label="unablated")
        ax.legend()
    ax.set_title(title)
    return fig


def bars(frame: pd.DataFrame, label: str, value: str, title: str):
    fig, ax = _axes(max(4.0, 0.5 * len(frame) + 2), 4)
    sns.barplot(data=frame, x=label, y=value, ax=ax, color="steelblue")
    ax.tick_params(axis="x", rotation=45)
    ax.set_title(title)
    return fig


def ablation_figure(frame: pd.DataFrame, title: str | None = None) -> Figure:
    """The natural picture of an ablation table (``ablation_sweep``'s or ``pruning_curve``'s): a
    layer x head heatmap of the effect for single heads, a layer x position one for MLPs at single
    positions, a curve for a pruning curve, bars otherwise. ``title``: default says which. Returns
    a matplotlib ``Figure``."""
    if title is None:
        title = "pruning curve: metric by fraction of heads ablated" if "fraction" in frame else \
            "ablation effect (metric - unablated)"
    if "fraction" in frame:
        return curve(frame, "fraction", "metric", title, baseline=float(frame["baseline"].iloc[0]))
    if (frame["n_heads"] == 1).all() and frame["head"].notna().all():
        return heatmap(frame.astype({"layer": int, "head": int}), "layer", "head", "effect", title, center=0.0)
    if "position" in frame and frame["position"].notna().all():
        return heatmap(frame.astype({"layer": int, "position": int}), "layer", "position", "effect", title, center=0.0)
    return bars(frame, "target", "effect", title)


def patching_figure(frame: pd.DataFrame, value: str | None = None, title: str | None = None) -> Figure:
    """A ``patching_frame`` as a heatmap: layer x head, layer x pos, or (layer, head) x pos
    (cells annotated when normalised: raw metrics differ in late digits only); bars per layer (MLPs).
    ``value``: the column drawn, default the frame's one value column (``normalized`` where it has
    several and that is one, else ``metric``); ``title``: default "patching: {value}". Returns a
    matplotlib ``Figure``."""
    if value is None:
        values = [column for column in frame.columns if column not in ("layer", "head", "pos")]
        value = values[0] if len(values) == 1 else "normalized" if "normalized" in values else "metric"
    title = f"patching: {value}" if title is None else title
    if "pos" not in frame and "head" not in frame:
        return bars(frame, "layer", value, title)
    if "pos" in frame and "head" in frame:
        frame = frame.assign(layer_head=[f"L{l:02d}H{h:02d}" for l, h in zip(frame["layer"], frame["head"])])
        return heatmap(frame, "layer_head", "pos", value, title, annotate=value == "normalized")
    return heatmap(frame, "layer", "pos" if "pos" in frame else "head", value, title, annotate=value == "normalized")
