"""``interp task`` resumable like a study: each step's result kept on disk with the fingerprint of
its inputs (``analyses.core.steps``), an interrupted run finished by ``--resume`` without redoing the
finished steps and with the very bytes of a run that was not interrupted; other inputs refused in
one line naming what changed."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import analyses.report.task_page as task_page
from analyses.cli import main
from analyses.core.steps import Steps, decode_value, directory_lock, encode_value
from interp import UserError

ROOT = Path(__file__).resolve().parents[1]


def task_args(model: Path, out: Path, *more: str) -> list[str]:
    return ["task", "ioi", "--model", str(model), "--n", "30", "--top", "2", "--out", str(out), "--quiet", *more]


def files(directory: Path) -> dict[str, bytes]:
    """Every file under ``directory`` (its path in meta.json's arguments put as OUT; meta.json without
    its cost record, which holds the seconds measured on this run: issue 45.3)."""
    found = {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}
    meta = json.loads(found["meta.json"].replace(json.dumps(str(directory)).encode(), b'"OUT"'))
    found["meta.json"] = json.dumps(meta | {"cost": None}, indent=2, sort_keys=True).encode()
    return found


@pytest.fixture(scope="module")
def whole(gpt2_dir, tmp_path_factory):
    """A task page made in one uninterrupted run (a GPT-2 model: it has MLPs, so every step runs)."""
    out = tmp_path_factory.mktemp("whole")
    assert main(task_args(gpt2_dir, out)) == 0
    return out


def counting(monkeypatch, calls: Counter) -> None:
    """Count the calls of each step's library function (each ``attribution`` method by its column)."""
    for name in ("patch_sweep", "task_dla", "edge_sweep", "measure_chosen"):
        function = getattr(task_page, name)
        monkeypatch.setattr(task_page, name, lambda *a, _f=function, _n=name, **k: calls.update([_n]) or _f(*a, **k))
    for column, method in task_page.ATTRIBUTIONS.items():
        monkeypatch.setitem(task_page.ATTRIBUTIONS, column,
                            lambda *a, _f=method, _n=column, **k: calls.update([_n]) or _f(*a, **k))


@pytest.mark.parametrize("stop", ["mlps_by_pos", "attribution_ig"])
def test_an_interrupted_task_resumes_with_only_the_unfinished_steps_and_the_same_bytes(
        stop, gpt2_dir, whole, tmp_path, monkeypatch):
    out = tmp_path / "page"
    # the step's function, and how many of its calls finish before it is interrupted
    interrupted = {"mlps_by_pos": ("patch_sweep", 3), "attribution_ig": ("attribution_ig", 0)}[stop]
    calls = Counter()
    with monkeypatch.context() as patched:
        counting(patched, calls)
        target, finished = interrupted
        host, key = (task_page.ATTRIBUTIONS, target) if target in task_page.ATTRIBUTIONS else (task_page, target)
        before = host[key] if isinstance(host, dict) else getattr(host, key)

        def interrupt(*args, **kwargs):
            if calls[target] == finished:
                raise KeyboardInterrupt  # as ctrl-C in the middle of the step
            return before(*args, **kwargs)

        (patched.setitem if isinstance(host, dict) else patched.setattr)(host, key, interrupt)
        with pytest.raises(KeyboardInterrupt):
            main(task_args(gpt2_dir, out))
    done = task_page.STEPS[: task_page.STEPS.index(stop)]
    assert sorted(p.stem for p in (out / "steps").glob("*.json")) == sorted(done)
    assert not list(out.rglob(".*.tmp-*"))  # nothing half-written
    # the page holds the steps that landed, each file as the uninterrupted run wrote it, the rest pending
    meta = json.loads((out / "meta.json").read_text())
    assert meta["steps"] == {"run": list(task_page.STEPS), "pending": list(task_page.STEPS[len(done):])}
    stopped, final = files(out), files(whole)
    landed = {"mlps_by_pos": {"heads.csv", "heads_by_pos.csv", "mlps.csv", "figures/heads.png",
                              "figures/heads_by_pos.png"},
              "attribution_ig": {"heads.csv", "heads_by_pos.csv", "mlps.csv", "mlps_by_pos.csv", "edges.csv",
                                 "figures/heads.png", "figures/heads_by_pos.png", "figures/mlps_by_pos.png",
                                 "figures/circuit.png"}}[stop]
    assert {name for name in stopped if not name.startswith("steps")} == {
        "index.html", "report.md", "meta.json", "metric.csv", ".lock", *landed}
    differ = {name for name in landed if stopped[name] != final[name]}
    assert differ == ({"edges.csv"} if stop == "attribution_ig" else set())  # edges.csv: without EAP-IG's column yet
    assert "## Chosen heads, measured (pending)" in (out / "report.md").read_text()

    assert main(task_args(gpt2_dir, out)) == 2  # without --resume: refused, as a study's results are
    calls.clear()
    with monkeypatch.context() as patched:
        counting(patched, calls)
        assert main(task_args(gpt2_dir, out, "--resume")) == 0
    step_calls = {"heads": "patch_sweep", "heads_by_pos": "patch_sweep", "mlps": "patch_sweep",
                  "mlps_by_pos": "patch_sweep", "dla": "task_dla", "path_patching": "edge_sweep",
                  "attribution": "attribution", "attribution_ig": "attribution_ig",
                  "measured": ("measure_chosen", "task_dla")}  # the DLA of the measurement split
    expected = Counter(call for s in task_page.STEPS[task_page.STEPS.index(stop):]
                       for call in ((step_calls[s],) if isinstance(step_calls[s], str) else step_calls[s]))
    assert calls == expected  # the finished steps were read, not computed
    assert files(out) == files(whole)  # the page, its tables, figures, meta and steps: the same bytes


def test_the_page_is_written_after_the_first_step_with_every_later_step_pending(gpt2_dir, whole, tmp_path,
                                                                                 monkeypatch, capsys):
    """Stopped as the first sweep begins, right after the clean and corrupted runs (the metric step):
    the directory already holds a whole page, the metric on it and every later step pending with
    its estimate; the terminal said where the page is. Resumed, the files equal an uninterrupted run's."""
    out = tmp_path / "page"

    def stop(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as patched:
        patched.setattr(task_page, "patch_sweep", stop)
        with pytest.raises(KeyboardInterrupt):
            main([arg for arg in task_args(gpt2_dir, out) if arg != "--quiet"])
    later = list(task_page.STEPS[1:])
    assert (f"task: the page is at {out / 'index.html'} ({len(later)} steps pending; rewritten as each lands)"
            in capsys.readouterr().err)
    assert sorted(name for name in files(out) if not name.startswith("steps")) == [
        ".lock", "index.html", "meta.json", "metric.csv", "report.md"]
    meta = json.loads((out / "meta.json").read_text())
    assert meta["steps"] == {"run": list(task_page.STEPS), "pending": later} and meta["performs_task"] is None
    page, markdown = (out / "index.html").read_text(), (out / "report.md").read_text()
    assert page.rstrip().endswith("</html>")
    pending = re.findall(r"^- `(\w+)`: (?:~|<= )[0-9.]+ FE, (?:~|<= )[0-9.]+ s$", markdown, flags=re.MULTILINE)
    assert pending == later  # each with its estimate in FE and seconds
    for title in ("Patching", "MLP patching", "Direct logit attribution", "Circuit", "Chosen heads, measured"):
        assert f"## {title} (pending)" in markdown and f"<h2>{title} (pending)</h2>" in page
    metric = pd.read_csv(out / "metric.csv")
    final = pd.read_csv(whole / "metric.csv")
    pd.testing.assert_frame_equal(metric, final[final["split"] == "selection"][metric.columns])  # the clean run's
    assert main(task_args(gpt2_dir, out, "--resume")) == 0
    assert files(out) == files(whole)
    assert "## Steps pending" not in (out / "report.md").read_text()


def test_a_killed_task_run_resumes_with_the_same_bytes(gpt2_dir, whole, tmp_path, monkeypatch):
    """SIGKILL of the process (no chance to clean up) once EAP is on disk and path patching has begun."""
    out = tmp_path / "page"
    code = ("import sys, time; import analyses.report.task_page as page; from analyses.cli import main\n"
            "slow = page.edge_sweep\n"
            "page.edge_sweep = lambda *a, **k: time.sleep(60) or slow(*a, **k)\n"
            "main(sys.argv[1:])")
    process = subprocess.Popen([sys.executable, "-c", code, *task_args(gpt2_dir, out)], cwd=ROOT,
                               env=os.environ | {"OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (out / "steps" / "attribution.json").exists():
            time.sleep(0.05)
        os.kill(process.pid, signal.SIGKILL)
    finally:
        process.wait()
    assert process.returncode == -signal.SIGKILL
    assert sorted(p.stem for p in (out / "steps").glob("*.json")) == sorted(task_page.STEPS[:7])
    calls = Counter()
    counting(monkeypatch, calls)
    assert main(task_args(gpt2_dir, out, "--resume")) == 0  # the kernel dropped the dead run's lock
    assert calls == Counter(["edge_sweep", "attribution_ig", "measure_chosen", "task_dla"])
    assert files(out) == files(whole)


def test_a_resumed_run_with_other_inputs_is_refused_naming_what_changed(gpt2_dir, whole, tmp_path, capsys):
    out = tmp_path / "page"
    out.mkdir()
    for name, data in files(whole).items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_bytes(data)
    capsys.readouterr()
    args = task_args(gpt2_dir, out, "--resume")
    assert main([a if a != "2" else "1" for a in args]) == 2
    assert "holds the steps of other inputs (arguments.top was 2, now 1; options.top was 2, now 1" in capsys.readouterr().err
    assert main([a if a != "30" else "32" for a in args]) == 2
    error = capsys.readouterr().err
    assert "(arguments.n was 30, now 32; " in error and error.count("\n") == 1
    assert main(task_args("toy", out, "--resume")) == 2  # another model
    error = capsys.readouterr().err
    assert "; model.family was 'gpt2', now 'interp-gpt'; " in error and "model.weights_hash was" in error
    calls = Counter()
    with pytest.MonkeyPatch.context() as patched:
        counting(patched, calls)
        assert main(args) == 0  # the same inputs: everything read back
    assert calls == Counter() and files(out) == files(whole)
    assert "reused 10 finished step(s)" in capsys.readouterr().out


def test_a_second_run_on_the_directory_is_refused_while_the_first_holds_it(tmp_path, capsys):
    with directory_lock(tmp_path, "task run"):
        assert main(["task", "ioi", "--n", "4", "--out", str(tmp_path), "--quiet"]) == 2
    assert f"{tmp_path} is in use by another task run" in capsys.readouterr().err


def test_a_step_is_stored_exactly_and_only_read_back_for_its_own_inputs(tmp_path):
    frame = pd.DataFrame({"layer": [0, 1], "head": pd.array([3, None], dtype="Int64"), "via": ["q", "logits"],
                          "effect": np.array([0.1 + 0.2, np.nan]), "score": np.array([1 / 3, 2.5], dtype=np.float32)},
                         index=[5, 7])
    value = {"frame": frame, "clean": 0.1 + 0.2, "refused": None, "heads": [(0, 1)]}
    back = decode_value(json.loads(json.dumps(encode_value(value))))
    pd.testing.assert_frame_equal(back["frame"], frame, check_exact=True)
    assert back["clean"] == 0.30000000000000004 and back["refused"] is None and back["heads"] == [[0, 1]]

    computed = []
    steps = Steps(tmp_path, {"model": {"weights_hash": "sha256:a"}})
    assert steps("x", lambda: computed.append(1) or 1.5) == 1.5
    again = Steps(tmp_path, {"model": {"weights_hash": "sha256:a"}}, resume=True)
    assert again("x", lambda: computed.append(2) or 9.0) == 1.5 and computed == [1] and again.reused == ["x"]
    with pytest.raises(UserError, match=r"other inputs \(model.weights_hash was 'sha256:a', now 'sha256:b'"):
        Steps(tmp_path, {"model": {"weights_hash": "sha256:b"}}, resume=True)
    with pytest.raises(UserError, match="pass --resume"):
        Steps(tmp_path, {"model": {"weights_hash": "sha256:a"}})
    with pytest.raises(TypeError, match="JSON data or a DataFrame"):
        steps("y", lambda: object())
