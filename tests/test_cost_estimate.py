"""The report's cost estimate (issue 45.3): each step's forward-equivalents, estimated from the shapes
before the first sweep, against the FE counted while the report runs (block rows, as
``benchmarks/bench_report.py`` counts them: ``tests/forward_count.py``); the estimate printed before
the first step's progress line; meta.json's estimate and measured seconds for every step."""

from __future__ import annotations

import pytest
import torch

from analyses.core.probes import probes_for
from analyses.report import build, split
from forward_count import StepForwardCounter
from interp import GPTConfig, GPTModel, load_model


def tiny_llama() -> GPTModel:
    torch.manual_seed(0)
    return GPTModel(GPTConfig(d_vocab=300, n_ctx=64, d_model=32, n_heads=4, n_layers=3, d_mlp=64,
                              normalization_type="RMS", gated_mlp=True, act_fn="silu",
                              positional_embedding_type="rotary", n_key_value_heads=2, qkv_bias=False,
                              attn_out_bias=False, mlp_bias=False, tie_word_embeddings=False)).eval()


@pytest.mark.parametrize("make", [lambda: load_model("toy").eval(), tiny_llama], ids=["toy", "llama"])
def test_each_step_estimate_matches_the_counted_forwards(make, monkeypatch, capsys):
    model = make()
    drawn, counter = [], StepForwardCounter(1, model.cfg.n_layers)

    def probes(*args, **kwargs):  # the report's probe batch: its rows are one FE
        found = probes_for(*args, **kwargs)
        drawn.append(found)
        counter.unit = found.tokens.numel() * model.cfg.n_layers
        return found

    begin = build.ReportSteps.begin

    def counted_begin(self, step):
        counter.step = step
        begin(self, step)

    monkeypatch.setattr(split, "probes_for", probes)
    monkeypatch.setattr(build.ReportSteps, "begin", counted_begin)
    monkeypatch.setenv("INTERP_PROGRESS_SECONDS", "1000")
    monkeypatch.setattr(split, "LIST_PROMPTS", 2)  # the lists chosen on fewer selection rows than the 4 measuring
    with counter:
        report = build.build_report(model, model_name="tiny", n_prompts=8, seq_len=32, intervention_prompts=4)
    cost = report.meta["cost"]["steps"]
    assert list(cost) == list(build.ReportSteps.STEPS)
    for step, record in cost.items():
        counted = counter.fe.get(step, 0.0)
        if record["at_most"]:  # work that follows from the roles found: an upper bound
            assert counted <= record["estimated_fe"] + 1e-9, step
        else:
            assert record["estimated_fe"] == pytest.approx(counted, rel=0.1, abs=1e-9), step
        assert record["estimated_s"] == pytest.approx(record["estimated_fe"] * report.meta["cost"]["seconds_per_fe"])
        assert record["actual_s"] > 0, step
    # the probes' forward, the selection rows' the lists are chosen on (2 of the 12 drawn)
    # and the pattern views' two (the display probe's, the display text's), all 12 x 32 rows being one FE
    views = (len(build.display_probe(drawn[0])[:build.DISPLAY_TOKENS])
             + len(build.leading_tokens(model, build.DISPLAY_TEXT, build.DISPLAY_TOKENS)))
    assert counter.fe["calibration"] > 0 and cost["probe run"]["estimated_fe"] == pytest.approx(1.0 + 2 / 12 + views / 384)
    lines = capsys.readouterr().err.splitlines()
    probe_run = next(i for i, line in enumerate(lines) if line.startswith("report: probe run"))
    first_sweep = next(i for i, line in enumerate(lines) if line.startswith("report: roles"))
    estimate = next(i for i, line in enumerate(lines) if line.startswith("report cost estimate:"))
    assert probe_run < estimate < first_sweep  # timed by the probe run, said before the first sweep


def test_quiet_report_prints_no_estimate(capsys):
    build.build_report(load_model("toy").eval(), model_name="toy", n_prompts=4, seq_len=24, intervention_prompts=2,
                       progress=False)
    assert "cost estimate" not in capsys.readouterr().err
