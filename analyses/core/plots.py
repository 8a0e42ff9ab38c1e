"""Figures for head classification (seaborn on matplotlib ``Figure`` objects: no pyplot state).

Every figure comes from ``new_figure`` (constrained layout: laid out once, as it is drawn; no
``tight_layout``), heatmaps from ``heatmap`` (no draw while building the figure), and no axis carries
more than ``MAX_TICK_LABELS`` labels (``thinned``). ``png_bytes`` renders with fixed metadata, so the
same figure gives the same bytes every run.
"""

from __future__ import annotations

import io
import math
from typing import Mapping, Sequence

import numpy as np
import pandas as pd
import torch
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import ListedColormap, Normalize
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from seaborn.utils import relative_luminance

from analyses.core.stats import excludes_zero

DPI = 100
# at most this many tick labels on an axis: a longer axis shows every k-th (``thinned``); at a
# figure's usual size, more than this are too small or too dense to read
MAX_TICK_LABELS = 64


def new_figure(**options) -> Figure:
    """``matplotlib.figure.Figure(**options)`` with its own Agg canvas and constrained layout (unless
    ``options`` name another ``layout``): the layout is computed as the figure is drawn, so saving it
    costs one layout pass and one render; callers do not call ``tight_layout``. A bare ``Figure`` has
    no canvas, so every text measurement would render a fresh full-size renderer (on a 144-head
    similarity heatmap: minutes, and gigabytes); with a canvas the renderer is made once."""
    figure = Figure(**{"layout": "constrained", **options})
    FigureCanvasAgg(figure)
    return figure


def png_bytes(figure: Figure, description: str | None = None) -> bytes:
    """The figure as PNG bytes at ``DPI``, byte-stable across runs (no software/date metadata);
    ``description`` goes into the PNG's Description text chunk. Pillow's default zlib level: level 1
    would save about 1% of a toy report's time and make its page 10% larger.

    One draw on the figure's Agg canvas lays it out and renders it (``savefig`` with a layout engine
    would draw the whole figure twice: once without rendering, for the layout alone); the same
    pixels as ``savefig(dpi=DPI)``. The figure then keeps that layout (its layout engine is switched
    off: constrained layout run again on a laid-out figure with colour bars or square cells moves
    them), so saving it again gives the same bytes."""
    canvas, dpi = figure.canvas, figure.dpi
    renderer = canvas if isinstance(canvas, FigureCanvasAgg) else FigureCanvasAgg(figure)
    figure.dpi = DPI
    buffer = io.BytesIO()
    try:
        renderer.print_png(buffer, metadata={"Software": None, "Description": description})
    finally:  # a pyplot figure keeps its own canvas and dpi, as after savefig
        figure.dpi = dpi
        figure.set_canvas(canvas)
    figure.set_layout_engine("none")
    return buffer.getvalue()


def thinned(labels: Sequence[str], limit: int = MAX_TICK_LABELS) -> tuple[list[int], list[str]]:
    """Positions and labels of the ticks to show for ``labels`` (one per position 0..n-1): all of them
    when there are at most ``limit``, else every k-th from the first, k = ceil(n / limit), so at most
    ``limit`` remain."""
    step = max(1, math.ceil(len(labels) / limit))
    positions = list(range(0, len(labels), step))
    return positions, [labels[i] for i in positions]


def heatmap(ax, grid: pd.DataFrame, cmap: str, vmin: float | None = None, vmax: float | None = None,
            center: float | None = None, annot: bool = False, fmt: str = ".2f", annot_kws: Mapping | None = None,
            square: bool = False, cbar: bool = True, cbar_kws: Mapping | None = None,
            xticklabels: Sequence[str] | bool = True, yticklabels: Sequence[str] | bool = True) -> None:
    """``grid`` (rows x columns) as a heatmap on ``ax``, as ``seaborn.heatmap`` draws it (cell (r, c)
    spans [c, c+1] x [r, r+1], row 0 on top; NaN cells left blank; ``center``: the colour map recentred
    on it over [vmin, vmax], which default to the data's range; annotations dark or white by the
    cell's luminance; axis names from the grid's index and columns), without drawing the figure:
    ``seaborn.heatmap`` renders the whole figure once per call to decide its labels' rotation.

    Tick labels: the grid's index and columns (or the sequences given; False: none), at most
    ``MAX_TICK_LABELS`` per axis (``thinned``); row labels horizontal, column labels horizontal when
    none is longer than 3 characters, else vertical."""
    values = np.ma.masked_invalid(grid.to_numpy(dtype=float))
    low = float(np.nanmin(values.filled(np.nan))) if vmin is None else vmin
    high = float(np.nanmax(values.filled(np.nan))) if vmax is None else vmax
    colours = matplotlib_cmap(cmap, low, high, center)
    mesh = ax.pcolormesh(values, cmap=colours, vmin=low, vmax=high)
    ax.set(xlim=(0, grid.shape[1]), ylim=(0, grid.shape[0]))
    ax.invert_yaxis()
    for spine in ax.spines.values():
        spine.set_visible(False)
    if cbar:
        ax.figure.colorbar(mesh, ax=ax, **(cbar_kws or {})).outline.set_linewidth(0)
    _heatmap_ticks(ax, grid, xticklabels, yticklabels)
    ax.set(xlabel=grid.columns.name or "", ylabel=grid.index.name or "")
    if annot:
        _annotate(ax, mesh, values, fmt, annot_kws or {})
    if square:
        ax.set_aspect("equal")


def matplotlib_cmap(name: str, vmin: float, vmax: float, center: float | None):
    """The colour map ``name``; with a ``center``, the part of it that [vmin, vmax] covers when the
    whole map spans center +- max(vmax - center, center - vmin) (seaborn's recentring), as 256 colours."""
    base = colormaps[name]
    if center is None:
        return base
    spread = max(vmax - center, center - vmin)
    start, stop = Normalize(center - spread, center + spread)([vmin, vmax])
    bad = base(np.ma.masked_invalid([np.nan]))[0]
    return ListedColormap(base(np.linspace(start, stop, 256))).with_extremes(bad=bad)


def _heatmap_ticks(ax, grid: pd.DataFrame, xticklabels, yticklabels) -> None:
    """Tick labels at the cells' centres (``heatmap``'s rule)."""
    for axis, index, given in ((ax.xaxis, grid.columns, xticklabels), (ax.yaxis, grid.index, yticklabels)):
        labels = [str(label) for label in index] if given is True else [] if given is False else list(given)
        positions, shown = thinned(labels)
        vertical = axis is ax.xaxis and any(len(label) > 3 for label in shown)
        axis.set_ticks([p + 0.5 for p in positions], shown, rotation=90 if vertical else 0)


def _annotate(ax, mesh, values: np.ma.MaskedArray, fmt: str, annot_kws: Mapping) -> None:
    """Each unmasked cell's value, dark on light cells and white on dark ones."""
    mesh.update_scalarmappable()
    masked = np.ma.getmaskarray(values)
    for (row, column), colour in zip(np.ndindex(values.shape), mesh.get_facecolors()):
        if not masked[row, column]:
            text_colour = ".15" if relative_luminance(colour) > .408 else "w"
            ax.text(column + 0.5, row + 0.5, format(values[row, column], fmt),
                    **{"color": text_colour, "ha": "center", "va": "center", **annot_kws})


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
        heatmap(ax, grid, annot=n_heads <= 12, annot_kws={"size": 7}, square=True, cbar_kws={"shrink": 0.8},
                **scale)
        ax.set_title(column.replace("_", " "))
        if intervals and column in intervals:
            bounds = [table.pivot(index="layer", columns="head", values=bound).reindex(index=range(n_layers),
                                                                                       columns=range(n_heads))
                      for bound in intervals[column]]
            hatch_cells(ax, covers_zero(*bounds).to_numpy())
            ax.set_title(f"{column.replace('_', ' ')}\n(hatched: 95% interval contains 0)", fontsize=9)
    for ax in axes[len(columns):]:
        ax.set_visible(False)
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
    """Attention patterns side by side, token labels on both axes (at most ``MAX_TICK_LABELS`` a side:
    every k-th token's, ``thinned``), colour scale 0..``vmax``.

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
        ax.tick_params(labelsize=7, length=0)  # before the ticks exist: each is made so, not updated
        ticks, shown = thinned(labels)
        ax.set_xticks(ticks, shown, rotation=90)
        ax.set_yticks(ticks, shown)
        ax.set_title(title, fontsize=10, y=1.0)
        ax.set_xlabel("key")
        ax.set_ylabel("query")
    for ax in axes[n:]:
        ax.set_visible(False)
    if suptitle:
        figure.suptitle(suptitle)
    return figure
