"""Commands print their own lines only: Hugging Face's per-load progress bars and the libraries'
warnings stay off the terminal (issue 23.4)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

INTERP = str(Path(sys.executable).with_name("interp"))


@pytest.mark.parametrize("impl", ["scratch", "transformer_lens"])
def test_check_prints_only_its_own_lines(family_dir, impl):
    directory = family_dir("llama")
    done = subprocess.run([INTERP, "check", "--model", str(directory), "--impl", impl], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert done.stdout.splitlines()[0] == f"{directory}: llama ({impl})"
    assert all(not line.startswith(("Loading weights", "Warning", "WARNING")) for line in done.stdout.splitlines())


def test_library_warnings_are_not_silenced_outside_commands():
    """The filters are the commands' business: importing the library leaves a notebook's warnings alone."""
    done = subprocess.run([sys.executable, "-c", "import warnings, analyses, interp; "
                           "warnings.warn('still here', UserWarning)"], capture_output=True, text=True, timeout=300)
    assert "still here" in done.stderr
