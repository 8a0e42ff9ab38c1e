"""Atomic file writes: a temporary name in the same directory, then a rename, so no output file
is ever seen half-written (DESIGN 5)."""

from __future__ import annotations

import os
from pathlib import Path


def write_atomic(target: str | os.PathLike, data: bytes | str) -> Path:
    """Write ``data`` (bytes, or str as UTF-8) to ``target`` atomically."""
    target = Path(target)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        tmp.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target
