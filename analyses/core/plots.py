"""Figures for head classification (seaborn on matplotlib ``Figure`` objects: no pyplot state).

``png_bytes`` renders with fixed metadata, so the same figure gives the same bytes every run.
"""

from __future__ import annotations

import io
import math
from typing import Mapping, Sequence

import numpy as np
import pandas as pd
import seaborn as sns
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from analyses.core.stats import excludes_zero

DPI = 100


def new_figure(**options) -> Figure:
    """``matplotlib.figure.Figure(**options)`` with its own Agg canvas. A bare ``Figure`` has none, so
    every text measurement (seaborn checks each tick label for overlap) renders a fresh full-size
    renderer: on a 144-head similarity heatmap that took minutes and grew the process by gigabytes
    (23 GB, measured); with a canvas the renderer is made once. Same PNG bytes."""
    figure = Figure(**options)
    FigureCanvasAgg(figure)
    return figure


def png_bytes(figure: Figure, description: str | None = None) -> bytes:
    """The figure as PNG bytes, byte-stable across runs (no software/date metadata);
    ``description`` goes into the PNG's Description text chunk."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=DPI, metadata={"Software": None, "Description": description})
    return buffer.getvalue()


def token_label(token: str) -> str:
    """A token as an axis label: spaces as a visible blank, escapes for other whitespace and
    control characters, and ``$``
    (which matplotlib would read as mathtext)."""
    label = repr(token)[1:-1] if not token.isprintable() else token.replace(" ", "\u2423")
    return label.replace("$", r"\$") or "''"


def role_heatmaps(table: pd.DataFrame, columns: Sequence[str],
                  diverging: Sequence[str] = ("ablation_effect", "distance"),
                  intervals: Mapping[str, tuple[str, str]] | None = None) -> Figure:
    """One layer x head heatmap per column of the per-head ``table`` (columns layer, head, ...).

    Columns share a 0..1 colour scale (role scores); those in ``diverging`` (e.g. ablation_effect,
    or changes between two models) get their own, centred on zero. ``intervals``: column -> the
    columns of its 95% interval's bounds (``ablation_effect``: ``ablation_ci_low, ablation_ci_high``);
    the cells whose interval contains 0 are hatched (``hatch_cells``) and the panel's title says so.
    """
    n_layers, n_heads = int(table["layer"].max()) + 1, int(table["head"].max()) + 1
    n_cols = min(3, len(columns))
    n_rows = math.ceil(len(columns) / n_cols)
    cell = max(0.35, min(0.7, 6 / n_heads))
    figure = new_figure(figsize=(n_cols * (n_heads * cell + 1.8), n_rows * (n_layers * cell + 1.2)))
    axes = figure.subplots(n_rows, n_cols, squeeze=False).flatten()
    for ax, column in zip(axes, columns):
        grid = table.pivot(index="layer", columns="head", values=column).reindex(index=range(n_layers), columns=range(n_heads))
        bounded = column not in diverging
        scale = {"vmin": 0.0, "vmax": 1.0, "cmap": "viridis"} if bounded else {"center": 0.0, "cmap": "RdBu_r"}
        sns.heatmap(grid, ax=ax, annot=n_heads <= 12, fmt=".2f", annot_kws={"size": 7}, square=True,
                    cbar_kws={"shrink": 0.8}, **scale)
        ax.set_title(column.replace("_", " "))
        if intervals and column in intervals:
            bounds = [table.pivot(index="layer", columns="head", values=bound).reindex(index=range(n_layers),
                                                                                       columns=range(n_heads))
                      for bound in intervals[column]]
            hatch_cells(ax, covers_zero(*bounds).to_numpy())
            ax.set_title(f"{column.replace('_', ' ')}\n(hatched: 95% interval contains 0)", fontsize=9)
    for ax in axes[len(columns):]:
        ax.set_visible(False)
    figure.tight_layout()
    return figure


def covers_zero(low, high):
    """Where an interval [low, high] contains 0 (floats, arrays, Series or frames); an unknown (NaN)
    bound claims nothing, so such a cell is not marked."""
    return ~excludes_zero(low, high) & ~(pd.isna(low) | pd.isna(high))


def hatch_cells(ax, mask: np.ndarray) -> None:
    """Hatch the cells of a heatmap drawn on ``ax`` (row r, column c spanning [c, c+1] x [r, r+1], as
    seaborn draws them) where ``mask`` (rows, columns) is True: one unfilled, hatched ``Rectangle``
    each, so the colour stays readable beneath."""
    for row, column in zip(*np.asarray(mask, dtype=bool).nonzero()):
        ax.add_patch(Rectangle((column, row), 1, 1, fill=False, hatch="///", edgecolor="0.3", linewidth=0))


def effect_error_bars(ax, frame: pd.DataFrame, x: str, y: str) -> None:
    """Each row's 95% intervals as grey error bars on a scatter of ``frame[x]`` against ``frame[y]``:
    a vertical bar from ``{y}_ci_low`` to ``{y}_ci_high`` at x and a horizontal one for ``x`` (for each
    column whose bounds the frame has; drawn beneath the points, none where a bound is NaN)."""
    for column, draw, at in ((y, ax.vlines, x), (x, ax.hlines, y)):
        low, high = f"{column}_ci_low", f"{column}_ci_high"
        if low in frame.columns and high in frame.columns:
            known = frame[low].notna() & frame[high].notna()
            draw(frame.loc[known, at], frame.loc[known, low], frame.loc[known, high], color="0.6", linewidth=0.8,
                 zorder=2)


def attention_grid(patterns: torch.Tensor, str_tokens: Sequence[str], titles: Sequence[str],
                   suptitle: str = "", vmax: float = 1.0) -> Figure:
    """Attention patterns side by side, token labels on both axes, colour scale 0..``vmax``.

    patterns: (n, q, k) post-softmax attention of n heads on one prompt of len(str_tokens) tokens.
    """
    n = patterns.shape[0]
    n_cols = min(4, n)
    n_rows = math.ceil(n / n_cols)
    labels = [token_label(t) for t in str_tokens]
    side = max(3.0, 0.16 * len(labels) + 1.0)
    figure = new_figure(figsize=(n_cols * side, n_rows * side + (0.4 if suptitle else 0)))
    axes = figure.subplots(n_rows, n_cols, squeeze=False).flatten()
    for ax, pattern, title in zip(axes, patterns.detach().float().cpu().numpy(), titles):
        ax.imshow(pattern, vmin=0.0, vmax=vmax, cmap="Blues")
        ticks = range(len(labels))
        ax.set_xticks(ticks, labels, rotation=90)
        ax.set_yticks(ticks, labels)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("key")
        ax.set_ylabel("query")
        ax.tick_params(labelsize=7, length=0)
    for ax in axes[n:]:
        ax.set_visible(False)
    if suptitle:
        figure.suptitle(suptitle)
    figure.tight_layout()
    return figure
