"""Every research notebook runs top to bottom on a fresh machine, offline."""

import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))
EXPECTED = ["01_attention_from_scratch", "02_induction_heads", "03_gpt2_and_other_families", "04_ablation_study",
            "05_positions_and_heads", "06_ground_truth_tracr", "07_components", "08_tasks", "09_inside_smollm2"]


def test_the_notebooks_are_the_expected_ones():
    """A renamed or deleted notebook is caught here, not silently dropped from the runs below."""
    assert [path.stem for path in NOTEBOOKS] == EXPECTED


def test_the_notebooks_guide_lists_every_notebook_and_no_other():
    guide = (Path(__file__).parent.parent / "docs" / "guides" / "notebooks.md").read_text()
    assert re.findall(r"^\| `(\w+)` \|", guide, flags=re.M) == EXPECTED


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_without_error(path, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    notebook = nbformat.read(path, as_version=4)
    assert not any(cell.get("outputs") for cell in notebook.cells), f"{path.name} is committed with outputs"
    NotebookClient(notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
