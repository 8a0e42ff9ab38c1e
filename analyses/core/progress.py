"""Progress bars, with one meaning of ``progress`` across analyses.

Every long analysis takes ``progress: bool | None``: None (the default) shows a tqdm bar only when
its output goes to a terminal (tqdm's own ``disable=None``), True always, False never.
"""

from __future__ import annotations

from typing import Iterable

from tqdm.auto import tqdm


def progress_bar(iterable: Iterable | None = None, *, progress: bool | None, **options) -> tqdm:
    """A ``tqdm`` over ``iterable`` (or a manual one, with ``total=``), shown per ``progress``."""
    return tqdm(iterable, disable=None if progress is None else not progress, **options)
