"""Keep freed activation memory in the process instead of handing it back to the kernel.

A full ``run_with_cache`` keeps every activation alive until the cache is dropped: on a
GPT-2-small shape at batch 4 x 128 tokens that is about 250 MB in blocks of 1.5-6 MB. With
glibc's defaults, freeing those blocks returns them to the kernel (``munmap``, or trimming the
top of the heap), so the next cache faults every page in again, zero-filled: about 60k minor
page faults and a fifth more wall time than the forward itself. The analyses pay the same on
every chunk.

``retain_freed_memory`` tells glibc to serve blocks up to 32 MB from its heap and to keep up to
``limit_mb`` of freed memory at the top of the heap for the next allocation. The price is that
the process's resident size stays at its high-water mark, up to that limit, after a cache is
dropped (as PyTorch's CUDA caching allocator does on the GPU; ``release_freed_memory`` is this
module's ``torch.cuda.empty_cache``). It retunes the whole process, so the library never applies
it on its own (inside a notebook kernel or a server the process is not ours): the ``interp``
commands apply it once at start (``retain_freed_memory_once``; ``INTERP_RETAIN_FREED_MEMORY=0`` opts
out), and a script or notebook that wants it calls ``retain_freed_memory()`` itself. The commands
keep a quarter of their ``--memory-mb`` (``BUDGET_SHARE``): freed memory held for reuse is resident
on top of what an analysis holds, and a quarter stays within the 25% over its budget that an
analysis may grow (the GPT-2-small report's logit lens, at a 554 MB budget, grew 1.2 GB with 1 GB
kept, 0.7 GB with a quarter of the budget, 0.6 GB with glibc's defaults).
"""

from __future__ import annotations

import ctypes
import os
import platform
from interp.errors import UserError

DEFAULT_LIMIT_MB = 1024
BUDGET_SHARE = 0.25  # of a command's --memory-mb, kept for reuse
MAX_LIMIT_MB = 2047  # mallopt takes a C int of bytes
OPT_OUT_VARIABLE = "INTERP_RETAIN_FREED_MEMORY"

# mallopt parameters and defaults from glibc's <malloc.h> and mallopt(3)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -2, -3, -4
_DEFAULT_MMAP_MAX = 65536
_MMAP_THRESHOLD_MAX = 32 * 2**20  # the largest value glibc accepts on 64-bit systems

_applied = False


def retain_freed_memory(limit_mb: int | None = DEFAULT_LIMIT_MB) -> bool:
    """Keep up to ``limit_mb`` MB of freed memory for reuse; returns whether the allocator took it.

    With a limit, blocks up to 32 MB come from the heap and freed memory beyond ``limit_mb`` at
    its top goes back to the kernel; glibc still maps each larger block fresh. ``None`` keeps
    everything: every block comes from the heap and nothing freed is returned, so repeated
    caches of any size reuse the last one's pages, at the price of a resident size that never
    shrinks. (Every block from the heap with a limit faults far less, but fragments: the GPT-2-small
    report at its defaults peaked at 6.0 GB that way, 3.7 GB this way; ``benchmarks/README.md``.)
    A no-op returning False where the C library is not glibc (macOS, Windows, musl).
    """
    if limit_mb is None:
        settings = {_M_MMAP_MAX: 0, _M_TRIM_THRESHOLD: -1}  # -1 is SIZE_MAX to glibc: never trim
    elif isinstance(limit_mb, int) and not isinstance(limit_mb, bool) and 0 <= limit_mb <= MAX_LIMIT_MB:
        limit = limit_mb * 2**20
        settings = {_M_MMAP_MAX: _DEFAULT_MMAP_MAX, _M_MMAP_THRESHOLD: _MMAP_THRESHOLD_MAX,
                    _M_TRIM_THRESHOLD: limit, _M_TOP_PAD: limit}
    else:
        raise UserError(f"limit_mb={limit_mb!r}: expected whole megabytes from 0 to {MAX_LIMIT_MB}, or None to keep all")
    global _applied
    _applied = True
    libc = _glibc()
    return libc is not None and all([libc.mallopt(param, value) == 1 for param, value in settings.items()])


def release_freed_memory() -> bool:
    """Hand every freed page back to the kernel now; returns whether any was released."""
    libc = _glibc()
    return libc is not None and libc.malloc_trim(0) == 1


def _glibc() -> ctypes.CDLL | None:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    return ctypes.CDLL(None)


def retain_freed_memory_once(limit_mb: int | None = DEFAULT_LIMIT_MB) -> None:
    """Apply ``retain_freed_memory(limit_mb)`` once per process unless it ran already or
    ``INTERP_RETAIN_FREED_MEMORY=0`` opts out; the ``interp`` commands call it at start with
    ``command_limit_mb`` of their budget."""
    if not _applied and os.environ.get(OPT_OUT_VARIABLE, "1") != "0":
        retain_freed_memory(limit_mb)


def command_limit_mb(memory_mb: float) -> int:
    """What a command with budget ``memory_mb`` keeps for reuse: ``BUDGET_SHARE`` of it, in whole MB
    (at most what mallopt takes)."""
    return min(MAX_LIMIT_MB, int(memory_mb * BUDGET_SHARE))
