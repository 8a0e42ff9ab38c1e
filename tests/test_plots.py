"""analyses.core.plots: heatmaps without a draw per call, thinned tick labels, cheap PNGs that
show the same pixels."""

from __future__ import annotations

import io

import numpy as np
import pandas as pd
import pytest
import seaborn as sns
import torch
from matplotlib.figure import Figure
from PIL import Image

from analyses.core.plots import (DPI, MAX_TICK_LABELS, attention_grid, heatmap, new_figure, png_bytes, role_heatmaps,
                                 token_label)


def head_table(n_layers: int = 3, n_heads: int = 4) -> pd.DataFrame:
    rng = np.random.default_rng(0)
    rows = [(layer, head, rng.random(), rng.normal()) for layer in range(n_layers) for head in range(n_heads)]
    return pd.DataFrame(rows, columns=["layer", "head", "induction", "ablation_effect"])


def test_an_attention_grid_of_200_tokens_labels_every_4th_token():
    """200 tokens: at most MAX_TICK_LABELS labels a side, those of tokens 0, 4, ..., 196 at their
    own positions (every token's label was laid out before)."""
    tokens = [f"t{i}" for i in range(200)]
    figure = attention_grid(torch.rand(1, 200, 200), tokens, ["L0H0"])
    ax = figure.axes[0]
    expected = [f"t{i}" for i in range(0, 200, 4)]
    assert len(expected) <= MAX_TICK_LABELS
    for axis in (ax.xaxis, ax.yaxis):
        assert [label.get_text() for label in axis.get_ticklabels()] == expected
        assert list(axis.get_ticklocs()) == list(range(0, 200, 4))


def test_a_short_attention_grid_labels_every_token():
    tokens = ["a", " b", "$c"]
    ax = attention_grid(torch.rand(2, 3, 3), tokens, ["x", "y"]).axes[0]
    assert [label.get_text() for label in ax.get_xticklabels()] == [token_label(t) for t in tokens]


def test_role_heatmaps_never_draw_the_figure_while_building_it(monkeypatch):
    """seaborn.heatmap renders the whole figure once per panel (to choose its labels' rotation); the
    heatmaps are drawn only when saved."""
    draws = []
    original = Figure.draw
    monkeypatch.setattr(Figure, "draw", lambda self, renderer: draws.append(1) or original(self, renderer))
    figure = role_heatmaps(head_table(), ["induction", "ablation_effect"])
    assert draws == []
    png_bytes(figure)
    assert draws  # the monkeypatch sees the saving draw


@pytest.mark.parametrize("options", [{"cmap": "viridis", "vmin": 0.0, "vmax": 1.0},
                                     {"cmap": "RdBu_r", "center": 0.0},
                                     {"cmap": "RdBu_r", "center": 0.0, "vmin": -3.0, "vmax": 3.0}])
def test_heatmap_colours_and_annotations_are_seaborns(options):
    """Against seaborn.heatmap on the same grid (a NaN cell included): the same cell colours, the same
    annotations in the same colours, the same colour bar range, ticks and axis names."""
    grid = head_table().pivot(index="layer", columns="head", values="ablation_effect")
    grid.iloc[1, 2] = np.nan
    ours, theirs = new_figure().subplots(), new_figure().subplots()
    heatmap(ours, grid, annot=True, annot_kws={"size": 7}, **options)
    sns.heatmap(grid, ax=theirs, annot=True, fmt=".2f", annot_kws={"size": 7}, **options)
    for ax in (ours, theirs):
        ax.collections[0].update_scalarmappable()
    np.testing.assert_allclose(ours.collections[0].get_facecolors(), theirs.collections[0].get_facecolors())
    assert [(t.get_text(), t.get_color(), t.get_position()) for t in ours.texts] == \
           [(t.get_text(), t.get_color(), t.get_position()) for t in theirs.texts]
    assert ours.collections[0].get_clim() == pytest.approx(theirs.collections[0].get_clim())
    assert [t.get_text() for t in ours.get_xticklabels()] == [t.get_text() for t in theirs.get_xticklabels()]
    assert list(ours.get_yticks()) == list(theirs.get_yticks())
    assert (ours.get_xlabel(), ours.get_ylabel()) == (theirs.get_xlabel(), theirs.get_ylabel()) == ("head", "layer")


def test_png_bytes_is_a_valid_png_of_the_laid_out_figure():
    """A valid PNG at DPI with the pixels of matplotlib's own PNG of the laid-out figure; saving again
    gives the same bytes (constrained layout run again would move the colour bars)."""
    figure = role_heatmaps(head_table(), ["induction", "ablation_effect"])
    ours = png_bytes(figure)
    default = io.BytesIO()
    figure.savefig(default, format="png", dpi=DPI, metadata={"Software": None})
    Image.open(io.BytesIO(ours)).verify()  # chunks and checksums
    with Image.open(io.BytesIO(ours)) as image, Image.open(default) as reference:
        assert image.format == "PNG"
        assert image.size == tuple(int(round(side * DPI)) for side in figure.get_size_inches())
        assert np.array_equal(np.asarray(image), np.asarray(reference))
    assert png_bytes(figure) == ours


def test_png_bytes_draws_the_figure_once_with_savefigs_pixels(monkeypatch):
    """One draw lays the figure out and renders it (``savefig`` with constrained layout draws it twice:
    once unrendered for the layout), and the PNG has the pixels and size of matplotlib's own
    ``savefig`` of the same figure built afresh, constrained layout on."""
    columns = ["induction", "ablation_effect"]
    reference = io.BytesIO()
    role_heatmaps(head_table(), columns).savefig(reference, format="png", dpi=DPI, metadata={"Software": None})
    draws = []
    original = Figure.draw
    monkeypatch.setattr(Figure, "draw", lambda self, renderer: draws.append(1) or original(self, renderer))
    ours = png_bytes(role_heatmaps(head_table(), columns))
    assert len(draws) == 1
    with Image.open(io.BytesIO(ours)) as image, Image.open(reference) as theirs:
        assert image.size == theirs.size
        assert np.array_equal(np.asarray(image), np.asarray(theirs))
