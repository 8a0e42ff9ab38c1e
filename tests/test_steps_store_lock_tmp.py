"""A run killed in the middle of an atomic write leaves its temporary beside the file; the next run of
the same directory, once it holds the directory's lock, removes it (a live writer's stays)."""

from __future__ import annotations

import os
import subprocess
import sys

from analyses.core.steps import directory_lock


def test_a_killed_writers_temporary_goes_when_the_next_run_takes_the_lock(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    stale = tmp_path / f".index.html.tmp-{dead_pid}-0badcafe"
    live = tmp_path / f".report.md.tmp-{os.getpid()}-12345678"
    page = tmp_path / "index.html"
    for path in (stale, live, page):
        path.write_text("x")
    with directory_lock(tmp_path, "task run"):
        assert not stale.exists()
        assert live.exists() and page.exists()


def test_a_killed_writers_temporary_below_the_directory_goes_too(tmp_path):
    """A page's figures are written atomically into ``figures/``: a kill there leaves its temporary
    one folder down, which the next run of the page's directory removes as well."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    figures = tmp_path / "figures"
    figures.mkdir()
    stale = figures / f".heads.png.tmp-{int(dead.stdout)}-0badcafe"
    live = figures / f".dla.png.tmp-{os.getpid()}-12345678"
    for path in (stale, live):
        path.write_text("x")
    with directory_lock(tmp_path, "task run"):
        assert not stale.exists()
        assert live.exists()
