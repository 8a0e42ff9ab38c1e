"""``interp task``'s cost estimate (issue 45.3): each step's forward-equivalents, estimated from the
shapes and the options, against the FE counted while the analysis runs (block rows, as
``benchmarks/bench_report.py`` counts them: ``tests/forward_count.py``), with and without a split,
screened and with every cell exact; the estimate printed after the clean run and before the first
sweep; meta.json's estimate and measured seconds for every step; a resumed run marks the steps it
read back."""

from __future__ import annotations

import json
import math

import pytest
import torch

import analyses.report.task_page as task_page
from analyses.cli import main
from analyses.interventions.attribution import DEFAULT_SCREEN, Screen
from analyses.interventions.cost import StepClock
from analyses.tasks.task import make_task, task_batch, task_split
from forward_count import StepForwardCounter
from interp import GPTConfig, GPTModel, load_model


def toy() -> GPTModel:
    return load_model("toy").eval()  # attention-only: no MLP steps


def tiny_llama() -> GPTModel:
    """RMS norm, gated MLP, rotary, grouped-query attention; the toy's byte tokenizer."""
    torch.manual_seed(0)
    model = GPTModel(GPTConfig(d_vocab=257, n_ctx=64, d_model=32, n_heads=4, n_layers=3, d_mlp=64,
                               normalization_type="RMS", gated_mlp=True, act_fn="silu",
                               positional_embedding_type="rotary", n_key_value_heads=2, qkv_bias=False,
                               attn_out_bias=False, mlp_bias=False, tie_word_embeddings=False)).eval()
    model.tokenizer = load_model("toy").tokenizer
    return model


CIRCUIT = ["attribution", "path_patching", "attribution_ig", "measured"]
CASES = {  # model, split, screen, the steps that run
    "toy-split-screened": (toy, True, DEFAULT_SCREEN, ["metric", "heads", "heads_by_pos", "dla", *CIRCUIT]),
    "toy-in-sample-top-k": (toy, False, Screen(3, math.inf), ["metric", "heads", "heads_by_pos", "dla", *CIRCUIT]),
    "llama-split-exact-all": (tiny_llama, True, None,
                              ["metric", "heads", "heads_by_pos", "mlps", "mlps_by_pos", "dla", *CIRCUIT]),
    "llama-in-sample-screened": (tiny_llama, False, DEFAULT_SCREEN,
                                 ["metric", "heads", "heads_by_pos", "mlps", "mlps_by_pos", "dla", *CIRCUIT]),
}


def task_rows(model, task, split) -> int:
    """One FE's rows: every prompt of the task, each split tokenised as the analysis does."""
    parts = [task] if split is None else [task.subset(split.selection), task.subset(split.measurement)]
    return sum(task_batch(model, part).clean.numel() for part in parts)


@pytest.mark.parametrize("case", list(CASES))
def test_each_step_estimate_matches_the_counted_forwards(case, tmp_path, monkeypatch, capsys):
    make, with_split, screen, steps = CASES[case]
    model = make()
    task = make_task(model, "ioi", n=22)
    split = task_split(task, 0) if with_split else None
    counter = StepForwardCounter(task_rows(model, task, split), model.cfg.n_layers)
    begin = StepClock.begin

    def counted_begin(self, step):  # every forward from here to the next step's begin is this step's
        counter.step = step
        begin(self, step)

    monkeypatch.setattr(StepClock, "begin", counted_begin)
    monkeypatch.setenv("INTERP_PROGRESS_SECONDS", "0")  # a line at every update of every sweep
    with counter:
        analysis = task_page.analyse_task(model, task, top=3, screen=screen, split=split or False)
    task_page.write_task_page(analysis, tmp_path, {"model": "tiny"})
    cost = json.loads((tmp_path / "meta.json").read_text())["cost"]
    assert sorted(cost["steps"]) == sorted(steps)
    for step, record in cost["steps"].items():
        counted = counter.fe.get(step, 0.0)
        assert counted > 0, step
        if record["at_most"]:  # the cells and edges the screen measures exactly: a bound
            assert counted <= record["estimated_fe"] + 1e-9, step
        else:
            assert record["estimated_fe"] == pytest.approx(counted, rel=0.1), step
        assert record["estimated_s"] == pytest.approx(record["estimated_fe"] * cost["seconds_per_fe"])
        assert record["actual_s"] > 0 and record["reused"] is False, step
    if screen is None:  # --exact-all: once the heads are chosen, every step's count is known
        assert not any(record["at_most"] for record in cost["steps"].values())
    else:
        assert cost["steps"]["heads_by_pos"]["at_most"]
    assert counter.fe["before"] < 0.2  # the hook self-test's and the reference's small runs: no step's
    lines = capsys.readouterr().err.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("task cost estimate:"))
    first_sweep = next(i for i, line in enumerate(lines) if line.startswith(("attribution heads", "patch heads")))
    assert "timed by the clean run" in lines[head]
    assert [line.split(":")[0].strip() for line in lines[head + 1:head + 1 + len(steps)]] == steps
    assert head + len(steps) < first_sweep  # every step costed before the first sweep


def test_a_resumed_task_marks_the_steps_it_read_back(tmp_path, monkeypatch, capsys):
    out = tmp_path / "page"
    args = ["task", "ioi", "--model", "toy", "--n", "22", "--top", "2", "--out", str(out), "--quiet"]
    with monkeypatch.context() as patched:
        def interrupt(*args, **kwargs):
            raise KeyboardInterrupt  # as ctrl-C as path patching begins

        patched.setattr(task_page, "edge_sweep", interrupt)
        with pytest.raises(KeyboardInterrupt):
            main(args)
    assert main([*args, "--resume"]) == 0
    cost = json.loads((out / "meta.json").read_text())["cost"]["steps"]
    finished = ["metric", "heads", "heads_by_pos", "dla", "attribution"]
    assert {step for step, record in cost.items() if record["reused"]} == set(finished)
    assert set(cost) == {*finished, "path_patching", "attribution_ig", "measured"}
    assert all(record["estimated_fe"] > 0 and record["actual_s"] > 0 for record in cost.values())
    assert "cost estimate" not in capsys.readouterr().err  # --quiet
