"""Scripted studies: the spec's checks, and a killed-and-resumed run giving exactly the rows of an
uninterrupted one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from analyses.ablation import ablation_sweep
from analyses.metrics import logit_diff_metric, loss_metric
from analyses.probes import probes_for
from analyses.study import run_study
from analyses.study_spec import load_spec
from interp import load_model

ROOT = Path(__file__).resolve().parents[1]


def write_spec(directory: Path, model_dir, targets='"each_head"', method="mean", extra="") -> Path:
    path = directory / "spec.toml"
    path.write_text(f"""
[model]
spec = "{model_dir}"
impl = "scratch"
[prompts]
kind = "repeated"
n = 6
seed = 3
seq_len = 24
[ablation]
method = "{method}"
targets = {targets}
{extra}
[metric]
kind = "repeat_loss"
""")
    return path


class Interrupt(Exception):
    pass


def interrupt_after(k):
    def on_row(index):
        if index + 1 == k:
            raise Interrupt

    return on_row


def test_rows_match_an_independent_sweep(tmp_path, gpt2_dir):
    results = run_study(write_spec(tmp_path, gpt2_dir), tmp_path / "out", progress=False)
    frame = pd.read_csv(results)
    model = load_model(str(gpt2_dir)).eval()
    probes = probes_for(model, 6, 24, seed=3)
    expected = ablation_sweep(model, probes.tokens, "each_head", "mean",
                              loss_metric(probes.tokens, probes.predictable), progress=False)
    assert list(frame["target"]) == list(expected["target"]) and list(frame["row"]) == list(range(8))
    assert frame["metric"].to_numpy() == pytest.approx(expected["metric"].to_numpy(), abs=1e-5)
    assert (tmp_path / "out" / "results.png").stat().st_size > 0


@pytest.mark.parametrize("targets", ['"each_head"', '"cumulative"', "[[1, 2], [0, 3]]"])
def test_interrupted_and_resumed_equals_uninterrupted(tmp_path, gpt2_dir, targets):
    spec = write_spec(tmp_path, gpt2_dir, targets, method="resample")
    clean = run_study(spec, tmp_path / "clean", progress=False).read_bytes()
    with pytest.raises(Interrupt):
        run_study(spec, tmp_path / "resumed", progress=False, on_row=interrupt_after(2))
    partial = (tmp_path / "resumed" / "results.csv").read_bytes()
    assert partial.count(b"\n") == 3  # header + the 2 rows written before the failure
    with open(tmp_path / "resumed" / "results.csv", "ab") as handle:
        handle.write(b"2,L0H2,0,2,1,4.7")  # a row torn by the kill, mid-write
    resumed = run_study(spec, tmp_path / "resumed", resume=True, progress=False).read_bytes()
    assert resumed == clean
    assert run_study(spec, tmp_path / "resumed", resume=True, progress=False).read_bytes() == clean  # nothing twice


def test_killed_subprocess_resumes_without_duplicates(tmp_path, gpt2_dir):
    spec = write_spec(tmp_path, gpt2_dir, '"each_head"', extra="preserve_patterns = true")
    clean = run_study(spec, tmp_path / "clean", progress=False).read_bytes()
    out = tmp_path / "killed"
    results = out / "results.csv"
    # a row every half second at least, so the kill lands mid-run
    code = ("import sys, time; from analyses.study import run_study; "
            "run_study(sys.argv[1], sys.argv[2], progress=False, on_row=lambda i: time.sleep(0.5))")
    process = subprocess.Popen([sys.executable, "-c", code, str(spec), str(out)], cwd=ROOT)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and (not results.exists() or results.read_bytes().count(b"\n") < 3):
            time.sleep(0.05)
        os.kill(process.pid, signal.SIGKILL)
    finally:
        process.wait()
    assert process.returncode == -signal.SIGKILL
    lines = results.read_bytes().count(b"\n")
    assert 3 <= lines < 9  # killed mid-run: some rows, not all
    assert run_study(spec, out, resume=True, progress=False).read_bytes() == clean


def test_existing_results_need_resume_and_same_spec(tmp_path, gpt2_dir):
    spec = write_spec(tmp_path, gpt2_dir, '"each_layer"')
    run_study(spec, tmp_path / "out", progress=False)
    with pytest.raises(ValueError, match="already exists; pass --resume"):
        run_study(spec, tmp_path / "out", progress=False)
    other = write_spec(tmp_path, gpt2_dir, '"each_layer"', method="zero")
    with pytest.raises(ValueError, match="different spec"):
        run_study(other, tmp_path / "out", resume=True, progress=False)


@pytest.mark.parametrize(
    "body, message",
    [
        ('[ablation]\nmethod = "shuffle"', r"\[ablation\].method is 'shuffle'; allowed: zero, mean, resample"),
        ("[ablation]\ntargets = \"each_head\"", r"\[ablation\].method is missing"),
        ('[ablation]\nmethod = "zero"\ntargets = "each_neuron"', r"\[ablation\].targets is 'each_neuron'"),
        ('[ablation]\nmethod = "zero"\ntargets = [[1]]', r"\[ablation\].targets has \[1\]"),
        ('[ablation]\nmethod = "zero"\nmethd = 1', r"\[ablation\].methd is not a known key"),
        ('[prompts]\nn = "many"\n[ablation]\nmethod = "zero"', r"\[prompts\].n must be an integer, got 'many'"),
        ('[prompts]\nkind = "text"\n[ablation]\nmethod = "zero"', r"\[prompts\].file is missing"),
        ('[modle]\nspec = "toy"', r"\[modle\] is not a known section"),
        ('[ablation\nmethod = "zero"', "is not valid TOML"),
        ('[ablation]\nmethod = "zero"\n[metric]\nkind = "logit_diff"', r"\[metric\].correct is missing"),
    ],
)
def test_malformed_spec_names_the_key(tmp_path, body, message):
    path = tmp_path / "bad.toml"
    path.write_text(body)
    with pytest.raises(ValueError, match=message) as error:
        load_spec(path)
    assert "\n" not in str(error.value)


def test_targets_out_of_range_name_the_key(tmp_path, gpt2_dir):
    spec = write_spec(tmp_path, gpt2_dir, "[[5, 0]]")
    with pytest.raises(ValueError, match=r"\[ablation\].targets: head \(5, 0\) out of range"):
        run_study(spec, tmp_path / "out", progress=False)


def test_example_spec_parses():
    spec = load_spec(ROOT / "examples" / "studies" / "induction_ablation.toml")
    assert (spec.model, spec.method, spec.targets, spec.metric) == ("toy", "mean", "each_head", "repeat_loss")


def test_text_prompts_with_logit_diff(tmp_path, gpt2_dir):
    (tmp_path / "prompts.txt").write_text("The cat sat on the mat\n\nA dog ran in the park today\n")
    spec = tmp_path / "text.toml"
    spec.write_text(f'[model]\nspec = "{gpt2_dir}"\n[prompts]\nkind = "text"\nfile = "prompts.txt"\n'
                    '[ablation]\nmethod = "zero"\ntargets = "each_layer"\n'
                    '[metric]\nkind = "logit_diff"\ncorrect = "a"\nincorrect = "b"\n')
    frame = pd.read_csv(run_study(spec, tmp_path / "out", progress=False))
    model = load_model(str(gpt2_dir)).eval()
    tokens = model.to_tokens(["The cat sat on the mat", "A dog ran in the park "])  # cut to the shorter
    a, b = model.to_tokens("a", prepend_bos=False)[0, 0], model.to_tokens("b", prepend_bos=False)[0, 0]
    expected = ablation_sweep(model, tokens, "each_layer", "zero", logit_diff_metric(a, b), progress=False)
    assert frame["metric"].to_numpy() == pytest.approx(expected["metric"].to_numpy(), abs=1e-5)
    bad = tmp_path / "bad.toml"
    bad.write_text(spec.read_text().replace('correct = "a"', 'correct = "ab"'))
    with pytest.raises(ValueError, match=r"\[metric\].correct = 'ab' is 2 tokens"):
        run_study(bad, tmp_path / "bad_out", progress=False)
