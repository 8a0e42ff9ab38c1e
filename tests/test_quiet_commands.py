"""Commands print their own lines only: Hugging Face's per-load progress bars and the libraries'
warnings stay off the terminal, and so does any warning our own code would provoke."""

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


def test_patch_with_attribution_prints_only_its_own_lines(tmp_path):
    """No torch warning (a tensor made over the read-only array a DataFrame column gives) and, with
    --quiet, no progress of the attribution pass: stderr stays empty."""
    out = tmp_path / "patch"
    done = subprocess.run([sys.executable, "-m", "analyses", "patch", "--model", "toy", "--prompts", "4", "--seq-len",
                           "16", "--attribution", "--quiet", "--out", str(out)], capture_output=True, text=True,
                          timeout=300, cwd=Path(__file__).resolve().parents[1], env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    agreement, wrote = done.stdout.splitlines()
    assert agreement.startswith("attribution vs exact: pearson ")
    assert wrote == f"wrote {out / 'patching.csv'} and {out / 'patching.png'}"
