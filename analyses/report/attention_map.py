"""The attention map (``interp attention-map`` draws it): every head of one layer on one text, in one figure (the classic
multi-head attention map), token labels on both axes.

A map shows at most the first ``MAX_MAP_TOKENS`` tokens, and fewer where the heads' grid would pass
``MAX_MAP_PIXELS`` on a side (matplotlib refuses an image of 2^16 pixels, and long before that a
map's labels are unreadable); the title then says how many of the text's tokens it shows. The
weights shown are the model's on the whole text (among the first tokens: a causal model's whole
rows)."""

from __future__ import annotations

from matplotlib.figure import Figure

from analyses.components.rollout import all_patterns
from analyses.core.checks import check_layer
from analyses.core.plots import DPI, attention_grid
from analyses.core.tokens import encode
from interp.errors import UserError

MAX_MAP_TOKENS = 128  # a map shows at most this many tokens (beyond it the labels cannot be read)
MAX_MAP_PIXELS = 2 ** 15  # nor more pixels than this on either side (matplotlib's limit is 2 ** 16)


def check_text(text: str) -> str:
    if not text or not text.strip():
        raise UserError("text is empty; pass --text with at least one non-space character")
    return text


def attention_map(model, text: str, layer: int = 0) -> Figure:
    """The ``Figure`` of every head of ``layer`` attending over ``text``: its first tokens only where
    the text is longer than a readable map that fits the image size limit (the title says so)."""
    check_layer(model, layer)
    tokens = encode(model, check_text(text)).tokens[0]
    patterns = all_patterns(model, tokens)[layer]
    labels = model.to_str_tokens(tokens)
    titles = [f"L{layer}H{head}" for head in range(model.cfg.n_heads)]
    shown = min(len(labels), MAX_MAP_TOKENS)
    while True:
        title = f"layer {layer}" + ("" if shown == len(labels) else
                                    f": the first {shown} of the text's {len(labels)} tokens (a map of more "
                                    f"would pass the image size limit)")
        figure = attention_grid(patterns[:, :shown, :shown], labels[:shown], titles, suptitle=title)
        largest = max(figure.get_size_inches()) * DPI
        if largest <= MAX_MAP_PIXELS or shown == 1:
            return figure
        shown = max(1, min(shown - 1, int(shown * MAX_MAP_PIXELS / largest)))
