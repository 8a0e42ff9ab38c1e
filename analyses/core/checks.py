"""The argument checks every room shares, each refusing a bad value in one line that names it and
what is allowed (architecture §5): a choice among named options (``check_choice``), heads and a
layer against the model's shape (``check_heads``, ``check_layer``)."""

from __future__ import annotations

from typing import Sequence

from analyses.core.heads import as_heads, head_label
from interp.errors import UserError


def check_choice(name: str, value, allowed: Sequence) -> None:
    """Refuse ``value`` where it is not one of ``allowed``; ``name`` says what it is ("edge method")."""
    if value not in allowed:
        raise UserError(f"unknown {name} {value!r}; allowed: {', '.join(map(str, allowed))}")


def check_heads(model, heads) -> list[tuple[int, int]]:
    """Heads (each ``(1, 4)``, ``"L1H4"`` or ``"1.4"``; or one string of them joined by commas:
    ``analyses.core.heads.as_heads``) -> [(layer, head), ...] validated against the model's shape."""
    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
    checked = []
    for layer, head in as_heads(heads):
        if not (0 <= layer < n_layers and 0 <= head < n_heads):
            raise UserError(
                f"head {head_label((layer, head))} out of range: layer must be in [0, {n_layers}), head in [0, {n_heads})"
            )
        checked.append((layer, head))
    return checked


def check_layer(model, layer: int) -> None:
    """Refuse a ``layer`` outside the model's blocks, [0, n_layers)."""
    if not 0 <= layer < model.cfg.n_layers:
        raise UserError(f"layer={layer} must be in [0, {model.cfg.n_layers})")
