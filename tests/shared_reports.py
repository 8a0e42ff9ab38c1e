"""One small toy report for the whole test run, written once and read by several modules.

``TOY_REPORT_ARGS`` are ``interp report``'s arguments (without ``--out``); ``shared_toy_report``
writes the report under a directory of the run (shared by pytest-xdist's workers, who take turns
through a file lock, so exactly one of them computes it) and returns it with what the command
printed on stdout. Its readers must not write into it: copy it first (``shutil.copytree``).
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

from filelock import FileLock

TOY_REPORT_ARGS = ["--model", "toy", "--prompts", "4", "--seq-len", "32", "--intervention-prompts", "2"]


def shared_toy_report(root: Path) -> tuple[Path, str]:
    """``interp report *TOY_REPORT_ARGS --out root/toy-report`` (progress on stderr, as a command run
    off a terminal shows it), computed by the first caller, the others waiting for it -> (the report
    directory, what the command printed on stdout). The stdout file, written last, marks it done."""
    from analyses.cli import main

    out, printed = root / "toy-report", root / "toy-report.stdout"
    with FileLock(str(root / "toy-report.lock")):
        if not printed.exists():
            buffer = io.StringIO()
            with contextlib.redirect_stdout(buffer):
                code = main(["report", *TOY_REPORT_ARGS, "--out", str(out)])
            assert code == 0, f"interp report {' '.join(TOY_REPORT_ARGS)} exited {code}"
            printed.write_text(buffer.getvalue())
    return out, printed.read_text()
