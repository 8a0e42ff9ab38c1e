"""Heads as the library, the frames and the command line write them: ``(1, 4)``, ``"L1H4"``,
``"1.4"``. ``as_head`` reads any of the three, ``as_heads`` a list of them (or one string of them
joined by commas), and ``head_label`` prints the one form every output uses, ``"L1H4"``."""

from __future__ import annotations

import numbers
import re

from interp.errors import UserError

HEAD_TEXT = re.compile(r"[Ll](\d+)[Hh](\d+)|(\d+)\.(\d+)")
FORMS = "(1, 4), 'L1H4' or '1.4'"


def as_head(item) -> tuple[int, int]:
    """``(layer, head)`` from a pair of whole numbers, ``"L1H4"`` or ``"1.4"``; anything else (a
    float such as 1.4, which cannot tell head 1 from head 10) is refused in one line."""
    if isinstance(item, str):
        match = HEAD_TEXT.fullmatch(item.strip())
        if match is None:
            raise UserError(f"{item!r} is not a head; write a head as {FORMS}")
        return int(match[1] or match[3]), int(match[2] or match[4])
    if isinstance(item, (str, bytes)) or not hasattr(item, "__len__") or len(item) != 2 or not all(
            isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in item):
        raise UserError(f"{item!r} is not a head; write a head as {FORMS}")
    return int(item[0]), int(item[1])


def as_heads(items) -> list[tuple[int, int]]:
    """Heads (``as_head`` of each) from a list of them or one string of them joined by commas
    ("L1H4,1.5")."""
    if isinstance(items, str):
        items = [item for item in items.split(",") if item.strip()]
    return [as_head(item) for item in items]


def head_label(head) -> str:
    """The one printed form of a head: ``"L1H4"``."""
    layer, index = as_head(head)
    return f"L{layer}H{index}"
