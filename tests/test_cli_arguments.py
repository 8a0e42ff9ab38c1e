"""Every numeric option of every command is checked while the command line is parsed (issue 43.5):
a bad value is refused in one line naming the option, the value and what is allowed, before any
model loads; the bounds that depend on the model (``--top`` beyond its heads) are refused right
after it loads, before any sweep."""

from __future__ import annotations

import pytest

import analyses.cli
import analyses.cli.args
import analyses.cli.interventions
import analyses.cli.tasks
from analyses.cli import main


@pytest.fixture
def no_load(monkeypatch):
    """Loading a model fails the test: a refusal must come before it."""
    def load_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the bad value was refused")
    monkeypatch.setattr(analyses.cli.args, "load_model", load_model)


@pytest.fixture
def in_process(monkeypatch):
    """``main`` run in this process without touching its global state (library log levels and
    warning filters, glibc's allocator)."""
    monkeypatch.setattr(analyses.cli, "quiet_libraries", lambda: None)
    monkeypatch.setenv("INTERP_RETAIN_FREED_MEMORY", "0")


OUT = ("--out", "unused")
REFUSED = [  # (command line, the option, the line's "VALUE is not ALLOWED")
    (["task", "ioi", "--top", "-1", *OUT], "--top", "-1 is not a whole number >= 1"),
    (["task", "ioi", "--top", "0", *OUT], "--top", "0 is not a whole number >= 1"),
    (["task", "ioi", "--top", "two", *OUT], "--top", "two is not a whole number >= 1"),
    (["task", "ioi", "--n", "0", *OUT], "--n", "0 is not a whole number >= 1"),
    (["task", "ioi", "--screen-top", "-1", *OUT], "--screen-top", "-1 is not a whole number >= 0"),
    (["task", "ioi", "--screen-share", "0", *OUT], "--screen-share", "0 is not a number above 0, or inf"),
    (["task", "ioi", "--screen-share", "nan", *OUT], "--screen-share", "nan is not a number above 0, or inf"),
    (["task", "ioi", "--seed", "-1", *OUT], "--seed", "-1 is not a whole number in [0, 4294967295]"),
    (["explain", "ioi", "--top", "-1", *OUT], "--top", "-1 is not a whole number >= 1"),
    (["explain", "ioi", "--steps", "0", *OUT], "--steps", "0 is not a whole number >= 1"),
    (["explain", "ioi", "--n", "-3", *OUT], "--n", "-3 is not a whole number >= 1"),
    (["trace", "--prompt", "a b", "--subject", "a", "--samples", "0", *OUT], "--samples",
     "0 is not a whole number >= 1"),
    (["trace", "--prompt", "a b", "--subject", "a", "--noise", "-3", *OUT], "--noise",
     "-3 is not a finite number above 0"),
    (["trace", "--prompt", "a b", "--subject", "a", "--noise", "inf", *OUT], "--noise",
     "inf is not a finite number above 0"),
    (["ablate", "--prompts", "0", *OUT], "--prompts", "0 is not a whole number >= 1"),
    (["ablate", "--seq-len", "7", *OUT], "--seq-len", "7 is not a whole number >= 8"),
    (["ablate", "--memory-mb", "inf", *OUT], "--memory-mb", "inf is not a finite number above 0"),
    (["ablate", "--memory-mb", "nan", *OUT], "--memory-mb", "nan is not a finite number above 0"),
    (["patch", "--shortlist", "0", *OUT], "--shortlist", "0 is not a whole number >= 1"),
    (["circuit", "--seed", "-2", *OUT], "--seed", "-2 is not a whole number in [0, 4294967295]"),
    (["circuit", "--top", "0", *OUT], "--top", "0 is not a whole number >= 1"),
    (["compare", "toy", "toy", "--threshold", "nan"], "--threshold", "nan is not a number in [0, 1]"),
    (["compare", "toy", "toy", "--threshold", "7"], "--threshold", "7 is not a number in [0, 1]"),
    (["report", "--fdr", "1.5"], "--fdr", "1.5 is not a number in (0, 1), or none"),
    (["report", "--fdr", "0"], "--fdr", "0 is not a number in (0, 1), or none"),
    (["report", "--threshold", "nan"], "--threshold", "nan is not a number in [0, 1], or none"),
    (["report", "--threshold", "7"], "--threshold", "7 is not a number in [0, 1], or none"),
    (["report", "--threshold", "-0.5"], "--threshold", "-0.5 is not a number in [0, 1], or none"),
    (["report", "--prompts", "0"], "--prompts", "0 is not a whole number >= 1"),
    (["report", "--intervention-prompts", "0"], "--intervention-prompts", "0 is not a whole number >= 1"),
    (["attention-map", "--text", "a b", "--layer", "-1", *OUT], "--layer", "-1 is not a whole number >= 0"),
    (["study", "run", "spec.toml", "--workers", "0", *OUT], "--workers", "0 is not a whole number >= 1"),
    (["tracr", "length", "--prompts", "1", *OUT], "--prompts", "1 is not a whole number >= 2"),
    (["tracr", "length", "--ig-steps", "0", *OUT], "--ig-steps", "0 is not a whole number >= 1"),
    (["tracr", "length", "--max-seq-len", "0", *OUT], "--max-seq-len", "0 is not a whole number >= 1"),
]


@pytest.mark.parametrize("argv, option, problem", REFUSED, ids=[" ".join(a[:1] + a[-4:-2]) for a, _, _ in REFUSED])
def test_a_bad_number_is_refused_by_the_parser(argv, option, problem, no_load, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    last = capsys.readouterr().err.splitlines()[-1]
    assert last == f"interp {' '.join(argv[:2]) if argv[0] == 'study' else argv[0]}: error: argument {option}: {problem}"


@pytest.mark.parametrize("option, accepted, refused", [("--fdr", "none", "1"), ("--fdr", "0.999", "1"),
                                                     ("--threshold", "none", "inf"), ("--threshold", "0", "-0.01"),
                                                     ("--threshold", "1", "1.01")])
def test_the_bounds_are_where_they_say(option, accepted, refused):
    parser = analyses.cli.build_parser()
    value = parser.parse_args(["report", option, accepted]).__dict__[option[2:]]
    assert value == (None if accepted == "none" else float(accepted))
    with pytest.raises(SystemExit):
        parser.parse_args(["report", option, refused])
    argv = ["task", "ioi", "--screen-share", "inf", "--seed", "4294967295", *OUT]
    assert parser.parse_args(argv).screen_share == float("inf")
    with pytest.raises(SystemExit):
        parser.parse_args([*argv, "--seed", "4294967296"])


def test_a_screen_that_measures_nothing_is_refused_before_the_model_loads(tmp_path, no_load, in_process, capsys):
    assert main(["task", "ioi", "--screen-top", "0", "--screen-share", "inf", "--out", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err == ("interp task: error: --screen-top 0 with --screen-share inf measures no cell "
                                       "exactly; give --screen-top >= 1, a finite --screen-share, or --exact-all\n")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("argv", [["task", "induction-text", "--top", "17"],
                                  ["explain", "induction-text", "--top", "17"],
                                  ["patch", "--shortlist", "17"]])
def test_more_heads_than_the_model_has_are_refused_before_any_sweep(argv, tmp_path, in_process, monkeypatch, capsys):
    """The toy model has 2 x 8 heads: 17 would silently be all 16."""
    def sweep(*args, **kwargs):
        raise AssertionError("a sweep ran before the bad count was refused")
    for module, name in ((analyses.cli.tasks, "make_task"), (analyses.cli.tasks, "patch_heads"),
                         (analyses.cli.interventions, "_patch_pair")):
        monkeypatch.setattr(module, name, sweep)
    assert main([*argv, "--model", "toy", "--out", str(tmp_path)]) == 2
    option = argv[-2]
    assert capsys.readouterr().err == (f"interp {argv[0]}: error: {option} 17 is more than the model's 16 heads; "
                                       "allowed: 1 to 16\n")
