"""Causal tracing: the batched trace equals a naive one-restoration-per-run implementation, on the
from-scratch model (suffix runs) and on a TransformerLens bridge (full forwards)."""

import json

import pandas as pd
import pytest
import torch

from analyses.tasks.tracing import (
    KINDS, causal_trace, draw_noise, embedding_std, state_name, subject_positions, trace_figure,
)
from analyses.core.tokens import encode
from interp import UserError, load_model
from hand_checks import add_to_embed

PROMPT = "When Mary met Tom, Mary said hi to"


@pytest.fixture(scope="module")
def toy():
    return load_model("toy")


def naive_trace(model, prompt, subject, answer, samples, noise, seed, state):
    """Every (kind, layer, pos) and every noise sample as its own forward with two hooks: the noise
    added to the subject's embeddings, and the clean state put back at that one position."""
    ids = encode(model, prompt).tokens
    positions = subject_positions(model, prompt, subject)
    draws = draw_noise(model, samples, len(positions), noise * embedding_std(model), seed)
    kinds = [kind for kind in KINDS if state_name(kind, 0, state) in model.hook_dict]
    _, clean = model.run_with_cache(ids)
    found = {}
    for kind in kinds:
        for layer in range(model.cfg.n_layers):
            name = state_name(kind, layer, state)
            for pos in range(ids.shape[1]):
                probs = []
                for draw in draws:
                    def restore(act, hook, name=name, pos=pos):
                        act = act.clone()
                        act[0, pos] = clean[name][0, pos]
                        return act

                    with torch.no_grad():
                        hooks = [("hook_embed", add_to_embed(draw, positions)), (name, restore)]
                        logits = model.run_with_hooks(ids, fwd_hooks=hooks)
                    probs.append(logits[0, -1].softmax(-1)[answer].item())
                found[kind, layer, pos] = sum(probs) / len(probs)
    return found


@pytest.mark.parametrize("which, state", [("toy", "resid_post"), ("scratch", "resid_pre"), ("bridge", "resid_post")])
def test_the_batched_trace_equals_one_restoration_per_run(request, toy, which, state):
    model = {"toy": toy, "scratch": None, "bridge": None}[which]
    if which == "scratch":
        model = request.getfixturevalue("scratch_gpt2")  # has MLPs
    if which == "bridge":
        model = request.getfixturevalue("bridge_gpt2")
    trace = causal_trace(model, PROMPT, "Mary", samples=3, seed=5, state=state, memory_mb=1,  # many small chunks
                         noise_from="vocabulary")
    naive = naive_trace(model, PROMPT, "Mary", trace.answer, samples=3, noise=3.0, seed=5, state=state)
    assert set(trace.kinds) == ({"resid", "attn"} if which == "toy" else set(KINDS))
    got = {(row.kind, row.layer, row.pos): row.prob for row in trace.frame.itertuples()}
    assert got.keys() == naive.keys()
    for key, value in naive.items():
        assert got[key] == pytest.approx(value, abs=1e-6), key
    if state == "resid_post":  # the whole last-layer state at the last position: the clean run exactly
        assert got["resid", model.cfg.n_layers - 1, len(trace.tokens) - 1] == pytest.approx(trace.clean_prob, abs=1e-6)
    else:  # a first-layer input outside the subject is the noised run's own: restoring it changes nothing
        outside = sorted(set(range(len(trace.tokens))) - set(trace.subject))
        assert len(outside) > 3 and any(abs(got["resid", 0, pos] - trace.corrupted_prob) > 1e-5 for pos in trace.subject)
        for pos in outside:
            assert got["resid", 0, pos] == pytest.approx(trace.corrupted_prob, abs=1e-6), pos


def test_each_restoration_costs_at_most_one_row_batch_and_suffix_runs_skip_early_blocks(toy):
    seen = {"first": 0, "last": 0}

    def count(key):
        def hook(act, hook):
            seen[key] += act.shape[0]
        return hook

    last = toy.cfg.n_layers - 1
    hooks = [("blocks.0.attn.hook_z", count("first")), (f"blocks.{last}.hook_resid_post", count("last"))]
    with toy.hooks(fwd_hooks=hooks):
        trace = causal_trace(toy, PROMPT, "Mary", samples=4)
    n_variants = len(trace.frame)
    assert seen["last"] == 1 + 4 * (1 + n_variants)  # the clean run, the noised run, one row batch per restoration
    assert seen["first"] < seen["last"]  # restorations at layer 1 never run block 0


def test_the_noise_is_three_embedding_stds_over_the_vocabulary_and_seeded(toy):
    assert embedding_std(toy) == pytest.approx(toy.W_E[:256].std().item(), rel=1e-5)
    one = causal_trace(toy, PROMPT, "Mary", samples=2, seed=1, noise_from="vocabulary")
    again = causal_trace(toy, PROMPT, "Mary", samples=2, seed=1, noise_from="vocabulary")
    other = causal_trace(toy, PROMPT, "Mary", samples=2, seed=2, noise_from="vocabulary")
    assert one.noise_std == pytest.approx(3 * embedding_std(toy))
    assert one.frame.equals(again.frame) and not one.frame["prob"].equals(other.frame["prob"])
    assert one.subject == [5, 6, 7, 8, 9]  # " Mary" after BOS and "When"
    fig = trace_figure(one)
    assert len(fig.axes) == 4  # two heatmaps (no MLPs) and their colour bars


def test_bad_subjects_and_options_are_one_line_errors(toy):  # answers: test_tracing_answers.py
    with pytest.raises(UserError, match="subject 'Bob' does not occur in the prompt"):
        causal_trace(toy, PROMPT, "Bob")
    with pytest.raises(UserError, match="unknown state 'resid_mid'; allowed: resid_post, resid_pre"):
        causal_trace(toy, PROMPT, "Mary", state="resid_mid")
    with pytest.raises(UserError, match="samples=0 must be at least 1"):
        causal_trace(toy, PROMPT, "Mary", samples=0)


def test_the_trace_command_writes_the_table_the_heatmaps_and_the_probabilities(tmp_path, capsys):
    from analyses.cli import main

    out = tmp_path / "trace"
    assert main(["trace", "--prompt", PROMPT, "--subject", "Mary", "--answer", " ", "--samples", "2",
                 "--out", str(out), "--quiet"]) == 0
    meta = json.loads((out / "meta.json").read_text())
    trace = causal_trace(load_model("toy"), PROMPT, "Mary", " ", samples=2, progress=False)
    written = pd.read_csv(out / "trace.csv", keep_default_na=False)
    assert written["prob"].to_numpy() == pytest.approx(trace.frame["prob"].to_numpy(), abs=1e-7)
    assert meta["clean_prob"] == trace.clean_prob and meta["noised_prob"] == trace.corrupted_prob
    assert (out / "trace.png").read_bytes()[:4] == b"\x89PNG"
    assert main(["trace", "--prompt", "abc", "--subject", "zz", "--out", str(out)]) == 2
    assert capsys.readouterr().err.strip() == "interp trace: error: subject 'zz' does not occur in the prompt 'abc'"
