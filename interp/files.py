"""Atomic file writes: a temporary name in the same directory, then a rename, so no output file is
ever seen half-written (architecture §5)."""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path
from typing import Callable


def write_atomic(target: str | os.PathLike, content: bytes | str | Callable[[Path], object]) -> Path:
    """Write ``content`` to ``target`` atomically: bytes, str (UTF-8), or a callable that writes a
    given temporary path (e.g. ``lambda tmp: frame.to_csv(tmp)``). Creates the parent directory.
    The file gets the mode of any newly created file (0o666 less the umask)."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        mode = _create(tmp)
        if callable(content):
            content(tmp)
        else:
            tmp.write_bytes(content.encode("utf-8") if isinstance(content, str) else content)
        os.chmod(tmp, mode)  # a writer may re-create its file private (safetensors does)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def remove_stale_temporaries(directory: str | os.PathLike) -> None:
    """Delete the temporaries ``write_atomic`` left in ``directory`` and below it (a page's
    ``figures/``) when their writer was killed mid-write: those whose process (the pid in their name)
    is gone. A live writer's stay."""
    for tmp in Path(directory).rglob(".*.tmp-*-*"):
        pid = tmp.name.rsplit(".tmp-", 1)[1].split("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            tmp.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _create(path: Path) -> int:
    """Create ``path`` empty (it must not exist) -> its permission bits: 0o666 less the umask, as
    the kernel applies it. Reading the umask with ``os.umask`` would change it for every thread."""
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
    try:
        return stat.S_IMODE(os.fstat(fd).st_mode)
    finally:
        os.close(fd)
