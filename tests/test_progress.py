"""Progress a batch job can see (issue 35.7): off a terminal a bar is plain lines on stderr (one per
step, one per interval within a long step, one at the end), on a terminal a tqdm bar, with
``--no-progress`` nothing; every command takes ``--progress/--no-progress``."""

from __future__ import annotations

import argparse
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from tqdm.std import tqdm

import analyses.cli
from analyses.cli import build_parser, main
from analyses.core import progress as progress_module
from analyses.core.progress import LineProgress, line_interval, progress_bar
from interp.errors import UserError

INTERP = str(Path(sys.executable).with_name("interp"))
LINE = re.compile(r"^( {2})*\S.* \d+(/\d+)? \w+( \w+)* \(\d\d:\d\d elapsed(, ~\d\d:\d\d left)?\)(, done)?$")


class FakeClock:
    """Seconds that move only when a test says so."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def lines(capsys) -> list[str]:
    return capsys.readouterr().err.splitlines()


def test_a_line_at_each_interval_and_at_the_end(capsys):
    clock = FakeClock()
    bar = LineProgress(total=10, desc="path patching", interval=30, clock=clock)
    for now in (10, 29):  # within the first 30 s: nothing
        clock.now = 1000 + now
        bar.update()
    assert lines(capsys) == []
    clock.now = 1030  # 30 s since the bar began
    bar.update()
    assert lines(capsys) == ["path patching 3/10 items (00:30 elapsed, ~01:10 left)"]  # 10 s per item, 7 to go
    clock.now = 1059  # 29 s since that line
    bar.update(2)
    assert lines(capsys) == []
    clock.now = 1125
    bar.update(5)  # the last: close says it
    assert lines(capsys) == []
    bar.close()
    bar.close()  # once only
    assert lines(capsys) == ["path patching 10/10 items (02:05 elapsed), done"]


def test_a_step_bar_writes_every_step_with_its_name(capsys):
    clock = FakeClock()
    with LineProgress(total=3, desc="report", unit="step", interval=30, clock=clock) as bar:
        bar.set_description_str("report: probe run", refresh=False)
        assert lines(capsys) == []
        bar.refresh()
        clock.now += 5
        bar.set_description_str("report: calibration", refresh=False)
        bar.update()
        clock.now += 65
        bar.update(0)  # no step done, but 65 s since the last line: the interval's line
        bar.update(2)
    assert lines(capsys) == ["report: probe run 0/3 steps (00:00 elapsed)",
                             "report: calibration 1/3 steps (00:05 elapsed)",
                             "report: calibration 1/3 steps (01:10 elapsed)",
                             "report: calibration 3/3 steps (01:10 elapsed), done"]


def test_a_short_bar_inside_another_ends_silently_a_long_one_does_not(capsys):
    clock = FakeClock()
    outer = LineProgress(total=2, desc="report", unit="step", interval=30, clock=clock)
    for item in LineProgress(range(4), desc="sweep", interval=30, clock=clock):
        clock.now += 1
    assert lines(capsys) == []  # 4 s inside a step: no line
    for item in LineProgress(range(2), desc="long sweep", interval=30, clock=clock):
        clock.now += 20
    assert lines(capsys) == ["  long sweep 2/2 items (00:40 elapsed), done"]
    outer.close()
    alone = LineProgress(range(1), desc="sweep", interval=30, clock=clock)
    assert list(alone) == [0]
    assert lines(capsys) == ["report 0/2 steps (00:44 elapsed), done", "sweep 1/1 items (00:00 elapsed), done"]


def test_a_bar_of_unknown_length_counts_alone(capsys):
    clock = FakeClock()
    bar = LineProgress(iter("abc"), desc="rows", unit="row", initial=2, interval=0, clock=clock)
    assert list(bar) == ["a", "b", "c"]
    assert lines(capsys) == [f"rows {n} rows (00:00 elapsed)" for n in (3, 4, 5)] + ["rows 5 rows (00:00 elapsed), done"]


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_bar_chosen_for_where_stderr_goes(monkeypatch):
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # a file or a pipe
    assert isinstance(progress_bar(range(2), progress=None), LineProgress)
    assert isinstance(progress_bar(range(2), progress=True), LineProgress)
    off = progress_bar(range(2), progress=False)
    assert isinstance(off, tqdm) and off.disable
    monkeypatch.setattr(sys, "stderr", Terminal())
    for progress in (None, True):
        bar = progress_bar(range(2), progress=progress)
        assert isinstance(bar, tqdm) and not bar.disable
    assert progress_bar(range(2), progress=False).disable


def test_the_interval_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv(progress_module.INTERVAL_ENV, raising=False)
    assert line_interval() == 30
    monkeypatch.setenv(progress_module.INTERVAL_ENV, "2.5")
    assert line_interval() == 2.5
    assert progress_bar(range(2), progress=None).interval == 2.5
    for bad in ("soon", "-1", "nan"):
        monkeypatch.setenv(progress_module.INTERVAL_ENV, bad)
        with pytest.raises(UserError, match=f"INTERP_PROGRESS_SECONDS='{bad}' must be a number of seconds >= 0"):
            line_interval()


def subcommand_parsers(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()):
    """(command words, parser) of every leaf command under ``parser``."""
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not actions:
        yield prefix, parser
    for action in actions:
        for name, sub in action.choices.items():
            yield from subcommand_parsers(sub, prefix + (name,))


def test_every_command_takes_progress_and_no_progress():
    """``--progress``/``--no-progress`` set ``progress`` True/False (argparse's BooleanOptionalAction),
    ``--quiet`` sets it False, and the default is None (a bar or lines), True for training."""
    commands = dict(subcommand_parsers(build_parser()))
    assert len(commands) >= 12 and ("study", "run") in commands
    for words, parser in commands.items():
        by_flag = {flag: action for action in parser._actions for flag in action.option_strings}
        toggle, quiet = by_flag.get("--no-progress"), by_flag.get("--quiet")
        assert isinstance(toggle, argparse.BooleanOptionalAction) and by_flag["--progress"] is toggle, words
        assert toggle.dest == quiet.dest == "progress" and quiet.const is False, words
        assert parser.get_default("progress") == (True if words == ("train",) else None), words


def run_ablate(gpt2_dir, out: Path, *flags: str) -> str:
    """``interp ablate`` on the tiny GPT-2 with stderr to a file (as nohup leaves it), a line allowed
    at every update (interval 0) -> that file's text."""
    log = out.with_suffix(".stderr")
    with open(log, "w") as stderr:
        done = subprocess.run([INTERP, "ablate", "--model", str(gpt2_dir), "--prompts", "4", "--seq-len", "16",
                               "--out", str(out), *flags], stdout=subprocess.PIPE, stderr=stderr, text=True,
                              timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1", "INTERP_PROGRESS_SECONDS": "0"})
    assert done.returncode == 0, log.read_text()
    assert "wrote" in done.stdout
    return log.read_text()


def test_a_command_with_stderr_to_a_file_writes_plain_lines(gpt2_dir, tmp_path):
    """One variant per chunk (--memory-mb 0.001), a line at every update (interval 0): lines with
    every count of heads done, then the last; with --no-progress, nothing."""
    every = run_ablate(gpt2_dir, tmp_path / "every", "--memory-mb", "0.001")
    assert "\r" not in every
    written = every.splitlines()
    assert all(LINE.match(line) for line in written), written
    counts = [int(line.split()[1].split("/")[0]) for line in written]
    assert counts == sorted(counts) and set(range(1, 9)) <= set(counts), written
    assert written[-1].startswith("ablate 8/8 items (") and written[-1].endswith(" elapsed), done")
    assert run_ablate(gpt2_dir, tmp_path / "none", "--no-progress") == ""


# every command, on the toy model with the smallest settings that run it (seconds each)
PROBES = ["--prompts", "2", "--seq-len", "16"]
QUIET_RUNS = {
    ("train",): ["train", "--preset", "short", "--steps", "2"],
    ("report",): ["report", "--model", "toy", *PROBES, "--intervention-prompts", "2"],
    ("attention-map",): ["attention-map", "--model", "toy", "--text", "abc abc", "--out", "{out}/map.png"],
    ("ablate",): ["ablate", "--model", "toy", *PROBES],
    ("patch",): ["patch", "--model", "toy", *PROBES],
    ("study", "run"): ["study", "run", "{out}.toml"],
    ("check",): ["check", "--model", "toy"],
    ("circuit",): ["circuit", "--model", "toy", *PROBES],
    ("compare",): ["compare", "toy", "toy", *PROBES],
    ("trace",): ["trace", "--model", "toy", "--prompt", "abc abc", "--subject", "abc", "--samples", "1"],
    ("task",): ["task", "induction-text", "--model", "toy", "--n", "4", "--top", "1", "--screen-top", "1"],
    ("explain",): ["explain", "induction-text", "--model", "toy", "--n", "2", "--top", "1", "--steps", "1", "--no-flow"],
    ("tracr",): ["tracr", "length", "--vocab", "a,b", "--max-seq-len", "3", "--prompts", "2"],
    ("qk",): ["qk", "--model", "toy", "--head", "1.5", *PROBES],
}


@pytest.mark.parametrize("words", list(QUIET_RUNS), ids=" ".join)
def test_no_progress_leaves_stderr_empty(words, tmp_path, monkeypatch, capsys):
    """Each command of ``analyses.cli._COMMANDS`` with ``--no-progress`` (issue 43.6: ``interp
    explain`` used to show its head-patching sweep) writes nothing to stderr, though a line would be
    allowed at every update (interval 0). In this process, so without the library quieting of
    ``analyses.cli.quiet_libraries`` (global log levels and warning filters): every line a command
    writes, its own or a library's, counts."""
    assert set(QUIET_RUNS) == {words for words, _ in subcommand_parsers(build_parser())}  # every command is here
    if words == ("tracr",):
        pytest.importorskip("tracr")  # the [tracr] extra
    monkeypatch.setattr(analyses.cli, "quiet_libraries", lambda: None)
    monkeypatch.setenv("INTERP_RETAIN_FREED_MEMORY", "0")
    monkeypatch.setenv(progress_module.INTERVAL_ENV, "0")
    out = tmp_path / "out"
    Path(f"{out}.toml").write_text('[model]\nspec = "toy"\n[prompts]\nn = 2\nseq_len = 16\n'
                                   '[ablation]\nmethod = "zero"\ntargets = "each_layer"\n')
    argv = [arg.format(out=out) for arg in QUIET_RUNS[words]]
    if words != ("check",) and "--out" not in argv:
        argv += ["--out", str(out)]
    capsys.readouterr()
    assert main([*argv, "--no-progress"]) == 0
    assert capsys.readouterr().err == ""
