"""Atomic file writes: a temporary name in the same directory, then a rename, so no output file is
ever seen half-written (DESIGN 5)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable


def write_atomic(target: str | os.PathLike, content: bytes | str | Callable[[Path], object]) -> Path:
    """Write ``content`` to ``target`` atomically: bytes, str (UTF-8), or a callable that writes a
    given temporary path (e.g. ``lambda tmp: frame.to_csv(tmp)``). Creates the parent directory."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        if callable(content):
            content(tmp)
        else:
            tmp.write_bytes(content.encode("utf-8") if isinstance(content, str) else content)
        os.chmod(tmp, 0o666 & ~_umask())  # a writer may create its file private (safetensors does)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
