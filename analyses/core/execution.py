"""How work runs, set once where an analysis is entered and read where it is used: the memory one
forward may add and whether progress is shown (architecture §4.0).

The current ``Execution`` lives in a context variable. A public entry point takes ``memory_mb=`` and
``progress=`` (None: the current one's) and runs its body inside ``executing(memory_mb, progress)``;
the functions below it take neither and read ``current()`` where they size a chunk
(``analyses.core.budget``) or open a bar (``analyses.core.progress``). A step that runs on another
budget or quietly (a quarter of the budget, the budget left after what a run holds, an inner sweep
without its own bar) says so with ``executing`` around that call. Outside every ``executing``, the
current execution is ``Execution()``: ``DEFAULT_MEMORY_MB`` and progress shown. A generator reads
the execution as it runs, so it is consumed inside the block that set it; a thread or a process
started inside a block (a study's Ray workers) starts from ``Execution()``, its settings passed to it
explicitly.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, replace
from numbers import Real
from typing import Iterator

from analyses.core.budget import DEFAULT_MEMORY_MB
from interp.errors import UserError


@dataclass(frozen=True)
class Execution:
    """memory_mb: the memory one forward may add beyond the weights (MB, > 0); progress: shown per
    ``analyses.core.progress`` (None or True: shown, False: none)."""

    memory_mb: float = DEFAULT_MEMORY_MB
    progress: bool | None = None


_CURRENT: ContextVar[Execution] = ContextVar("execution", default=Execution())


def current() -> Execution:
    """The execution the calling code runs under (``Execution()`` outside every ``executing``)."""
    return _CURRENT.get()


@contextmanager
def executing(memory_mb: float | None = None, progress: bool | None = None) -> Iterator[Execution]:
    """Run the block under the current execution with ``memory_mb`` and ``progress`` set where given
    (None leaves a field as it is), the one before restored on exit; yields the execution set.
    A ``memory_mb`` that is not a number above 0: a ``UserError`` naming it."""
    changes = {name: value for name, value in (("memory_mb", memory_mb), ("progress", progress)) if value is not None}
    if "memory_mb" in changes and (isinstance(memory_mb, bool) or not isinstance(memory_mb, Real) or memory_mb <= 0):
        raise UserError(f"memory_mb={memory_mb!r} must be a number of MB above 0")
    token = _CURRENT.set(replace(current(), **changes))
    try:
        yield current()
    finally:
        _CURRENT.reset(token)
