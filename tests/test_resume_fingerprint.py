"""``interp task --resume`` reuses finished steps only under the setting they were computed in: its
fingerprint (``OUT/steps.json``) holds every option but where the run writes and whether it shows
progress (``analyses.cli.args.NOT_FINGERPRINTED``), the tokens the model reads and how the model
runs, so a resume that would mix numbers of two settings is refused in one line naming what
changed, and one that changes only how progress shows reuses every step."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from analyses.cli import build_parser, main
from analyses.cli.args import NOT_FINGERPRINTED, fingerprinted_arguments


def task_args(out: Path, *more: str) -> list[str]:
    return ["task", "ioi", "--model", "toy", "--n", "6", "--top", "1", "--no-split", "--out", str(out), *more]


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A task run through with the default settings (float32, the model's own start-token rule)."""
    out = tmp_path_factory.mktemp("finished")
    assert main(task_args(out, "--quiet")) == 0
    return out


def copy_of(finished: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    return out


@pytest.mark.parametrize("changed, named", [
    (["--no-prepend-bos"], ["arguments.prepend_bos was None, now False",
                            "model.start_token.prepend_bos was True, now False"]),
    (["--precision", "mixed"], ["arguments.precision was 'float32', now 'mixed'",
                                "model.precision was 'float32', now 'mixed'"]),
    (["--memory-mb", "0.05"], ["arguments.memory_mb was 1024, now 0.05"]),
])
def test_a_resume_under_another_setting_is_refused_in_one_line_naming_it(changed, named, finished, tmp_path, capsys):
    out = copy_of(finished, tmp_path)
    steps = {p.name: p.read_bytes() for p in (out / "steps").iterdir()}
    capsys.readouterr()
    assert main(task_args(out, "--quiet", "--resume", *changed)) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "holds the steps of other inputs" in error
    assert all(text in error for text in named), error
    assert "resume with the inputs it began with, or use a new --out" in error
    assert {p.name: p.read_bytes() for p in (out / "steps").iterdir()} == steps  # nothing recomputed or mixed


def test_a_resume_that_changes_only_how_progress_shows_reuses_every_step(finished, tmp_path, capsys):
    out = copy_of(finished, tmp_path)
    capsys.readouterr()
    assert main(task_args(out, "--progress", "--resume")) == 0
    assert f"reused {len(list((out / 'steps').iterdir()))} finished step(s)" in capsys.readouterr().out


def test_every_option_of_interp_task_is_fingerprinted_but_where_it_writes_and_how_it_shows_progress():
    """Read off the parser, so an option added later is in the fingerprint unless listed as left out."""
    args = build_parser().parse_args(task_args(Path("out")))
    options = set(vars(args)) - {"func", "command"}
    assert set(fingerprinted_arguments(args)) == options - set(NOT_FINGERPRINTED)
    assert set(NOT_FINGERPRINTED) == {"out", "resume", "progress"}


def study_spec(path: Path, memory_mb: float) -> Path:
    path.write_text(f"""
[run]
memory_mb = {memory_mb}
[model]
spec = "toy"
[prompts]
n = 6
seq_len = 24
[ablation]
method = "mean"
targets = "each_layer"
""")
    return path


def test_a_study_resumed_with_another_memory_budget_is_refused(tmp_path, capsys):
    """The budget cuts the prompts into chunks, whose sums round differently: the rows' baseline
    differs in its last digits (measured on the toy model, 1024 against 0.02 MB), so rows of two
    budgets are not mixed."""
    out = tmp_path / "out"
    assert main(["study", "run", str(study_spec(tmp_path / "a.toml", 1024)), "--out", str(out), "--quiet"]) == 0
    capsys.readouterr()
    assert main(["study", "run", str(study_spec(tmp_path / "b.toml", 0.02)), "--out", str(out), "--quiet",
                 "--resume"]) == 2
    error = capsys.readouterr().err
    assert "holds a study of a different spec or prompt file (memory_mb was 1024.0, now 0.02; " in error
    assert error.count("\n") == 1


def test_a_study_resumed_on_another_device_is_refused(tmp_path, capsys):
    """As if the rows on disk had been computed on a GPU: resuming them on the CPU would mix devices."""
    spec, out = study_spec(tmp_path / "a.toml", 1024), tmp_path / "out"
    assert main(["study", "run", str(spec), "--out", str(out), "--quiet"]) == 0
    record = json.loads((out / "provenance.json").read_text())
    assert record["device"] == "cpu" and record["dtype"] == "float32" and record["precision"] == "float32"
    (out / "provenance.json").write_text(json.dumps(record | {"device": "cuda:0"}))
    capsys.readouterr()
    assert main(["study", "run", str(spec), "--out", str(out), "--quiet", "--resume"]) == 2
    error = capsys.readouterr().err
    assert "came from device 'cuda:0', but the model loaded now has 'cpu'; use a new --out" in error
