"""Causal tracing over a fact set as Meng et al. (2022) do it: every token restored on its own (a
multi-token subject gives one curve per token, and a position class is the mean of its tokens'),
one-layer MLP / attention restores beside the windows, and the effects broken down by relation with
an interval over each relation's facts. The per-token values are checked against hand-written hooks
(the noised forward with the clean state written back at one (layer, token)), the groupings against
numpy and the intervals against a hand-written bootstrap."""

import json

import numpy as np
import pandas as pd
import pytest
import torch

from analyses.core.tokens import encode, model_tokenizer, ordinary_token_ids
from analyses.tasks.facts import Fact, read_facts
from analyses.tasks.tracing import (
    ALL_SUBJECT, CLASSES, GROUPS, draw_noise, fact_seed, relation_aie, relation_lines, single_layer_text,
    subject_positions, trace_facts,
)
from interp import UserError, from_hf, load_model
from interp.random_models import random_hf_model
from hand_checks import add_to_embed, bootstrap_by_hand

PROMPTS = [("Fr is in", "Fr", "capital"), ("Ann Lee is in", "Ann Lee", "capital"), ("Bo is in", "Bo", "capital"),
           ("Oslo has", "Oslo", "landmark")]
WINDOW = 3
SEED = 5


@pytest.fixture(scope="module")
def sharp():
    """A 4-layer random Llama (our GPTModel: cached keys, suffix runs) with its unembedding scaled 40x,
    so that the answer (its clean top token) is likely and the restores move its probability."""
    hf, tokenizer = random_hf_model("llama", num_hidden_layers=4, n_ctx=64, seed=4)
    with torch.no_grad():
        hf.lm_head.weight.mul_(40)
    return from_hf(hf, tokenizer)


def top_answer(model, prompt: str) -> str:
    """The model's likeliest next token after ``prompt`` among the letters (the answer it knows top-1
    where that is a letter, as the top-1 filter needs)."""
    tokenizer = model_tokenizer(model)
    letters = [i for i in ordinary_token_ids(model) if tokenizer.decode([i]).isalpha()
               and tokenizer.encode(tokenizer.decode([i])) == [i]]
    with torch.no_grad():
        logits = model(encode(model, prompt).tokens)[0, -1]
    return tokenizer.decode([letters[int(logits[letters].argmax())]])


@pytest.fixture(scope="module")
def facts(sharp):
    return [Fact(prompt, subject, top_answer(sharp, prompt), relation) for prompt, subject, relation in PROMPTS]


@pytest.fixture(scope="module")
def traced(sharp, facts):
    return trace_facts(sharp, facts, samples=3, window=WINDOW, seed=SEED, progress=False)


def hand_restored(model, trace, index: int, restores: list[tuple[str, int]]) -> float:
    """Fact ``index``'s answer probability, mean over its noise draws, each draw its own full forward
    with the noise added to the subject's embeddings and the clean run's ``restores`` (hook name,
    position) written back, by hooks written here."""
    row = trace.facts.iloc[index]
    ids = encode(model, row["prompt"]).tokens
    subject = subject_positions(model, row["prompt"], row["subject"])
    draws = draw_noise(model, trace.samples, len(subject), trace.noise_std, fact_seed(SEED, index))
    _, clean = model.run_with_cache(ids)

    def write_clean(name, pos):
        def hook(act, hook):
            act = act.clone()
            act[0, pos] = clean[name][0, pos]
            return act
        return name, hook

    probs = []
    for draw in draws:
        hooks = [("hook_embed", add_to_embed(draw, subject))] + [write_clean(name, pos) for name, pos in restores]
        with torch.no_grad():
            logits = model.run_with_hooks(ids, fwd_hooks=hooks)
        probs.append(logits[0, -1].float().softmax(-1)[int(row["answer_token"])].item())
    return float(np.mean(probs))


def token_value(trace, index, kind, window, layer, pos, column="restored_prob") -> float:
    rows = trace.tokens
    found = rows[(rows["fact"] == index) & (rows["kind"] == kind) & (rows["window"] == window)
                 & (rows["layer"] == layer) & (rows["pos"] == pos)]
    assert len(found) == 1, (index, kind, window, layer, pos)
    return float(found[column].iloc[0])


def test_a_tokens_restored_hidden_state_equals_a_hand_written_hook(sharp, traced):
    index = 3  # "Oslo": a subject of several tokens
    subject = subject_positions(sharp, traced.facts["prompt"][index], "Oslo")
    n_pos = int(traced.facts["n_tokens"][index])
    assert len(subject) >= 3
    noised = hand_restored(sharp, traced, index, [])
    assert traced.facts["corrupted_prob"][index] == pytest.approx(noised, abs=1e-6)
    moved = []
    for layer in (0, 2):
        for pos in [*subject, n_pos - 1]:
            hand = hand_restored(sharp, traced, index, [(f"blocks.{layer}.hook_resid_post", pos)])
            assert token_value(traced, index, "resid", 1, layer, pos) == pytest.approx(hand, abs=1e-5), (layer, pos)
            moved.append(abs(hand - noised))
    assert max(moved) > 1e-3  # the restores move the probability by 100x the tolerance and more


def test_one_layer_and_window_restores_differ_and_each_equals_its_hooks(sharp, traced):
    index, layer = 3, 2
    pos = subject_positions(sharp, traced.facts["prompt"][index], "Oslo")[-1]
    single = hand_restored(sharp, traced, index, [(f"blocks.{layer}.hook_mlp_out", pos)])
    window = hand_restored(sharp, traced, index, [(f"blocks.{at}.hook_mlp_out", pos) for at in (1, 2, 3)])  # 2 +- 1
    assert token_value(traced, index, "mlp", 1, layer, pos) == pytest.approx(single, abs=1e-5)
    assert token_value(traced, index, "mlp", WINDOW, layer, pos) == pytest.approx(window, abs=1e-5)
    assert abs(single - window) > 1e-3
    assert set(traced.aie["window"][traced.aie["kind"] == "mlp"]) == {1, WINDOW}
    assert set(traced.aie["window"][traced.aie["kind"] == "resid"]) == {1}


def test_a_multi_token_subject_gives_one_curve_per_token_and_the_classes_are_their_means(sharp, traced):
    rows = traced.tokens
    for index, (prompt, subject_text, _) in enumerate(PROMPTS):
        subject = subject_positions(sharp, traced.facts["prompt"][index], subject_text)
        mine = rows[(rows["fact"] == index) & (rows["kind"] == "attn") & (rows["window"] == WINDOW)]
        curves = {k: part.sort_values("layer")["effect"].to_numpy()
                  for k, part in mine[mine["subject_token"] >= 0].groupby("subject_token")}
        assert sorted(curves) == list(range(len(subject))) and all(len(c) == 4 for c in curves.values())
        curve = traced.curves.index(("attn", WINDOW))
        mean = np.mean(list(curves.values()), axis=0)
        assert traced.effects[index, curve, :, GROUPS.index(ALL_SUBJECT)] == pytest.approx(mean, abs=1e-12)
        assert traced.effects[index, curve, :, GROUPS.index("last subject token")] == pytest.approx(
            curves[len(subject) - 1], abs=1e-12)
        if len(subject) > 2:
            middle = np.mean([curves[k] for k in range(1, len(subject) - 1)], axis=0)
            assert traced.effects[index, curve, :, GROUPS.index("middle subject tokens")] == pytest.approx(middle)
            assert traced.effects[index, curve, :, GROUPS.index("first subject token")] == pytest.approx(curves[0])
    # a class is its tokens' restores averaged, not its tokens restored together (the joint restore differs)
    middle = subject_positions(sharp, traced.facts["prompt"][3], "Oslo")[1:-1]
    joint = hand_restored(sharp, traced, 3, [("blocks.0.hook_resid_post", pos) for pos in middle])
    got = traced.effects[3, traced.curves.index(("resid", 1)), 0, GROUPS.index("middle subject tokens")]
    assert abs(got - (joint - traced.facts["corrupted_prob"][3])) > 1e-3
    # the AIE of a group pools its tokens over the facts (ROME's add_all), here by hand from the curves
    subject_rows = rows[(rows["subject_token"] >= 0) & (rows["kind"] == "resid")]
    pooled = subject_rows.groupby("layer")["effect"].mean().to_numpy()
    aie = traced.aie[(traced.aie["kind"] == "resid") & (traced.aie["position"] == ALL_SUBJECT)].sort_values("layer")
    assert aie["aie"].to_numpy() == pytest.approx(pooled, abs=1e-12)
    assert (aie["n_tokens"] == len(subject_rows) // 4).all() and (aie["n_prompts"] == len(PROMPTS)).all()
    assert set(traced.aie["position"]) == set(GROUPS)


def test_the_effects_are_broken_down_by_relation_each_with_its_interval(traced):
    by_relation = relation_aie(traced, seed=0)
    assert list(by_relation["relation"].unique()) == ["capital", "landmark"]
    curve = traced.curves.index(("mlp", WINDOW))
    group = GROUPS.index("last subject token")
    capital = [0, 1, 2]
    for layer in range(4):
        effects = traced.effects[capital, curve, layer, group]
        low, high = bootstrap_by_hand(effects, np.ones(3))
        row = by_relation[(by_relation["relation"] == "capital") & (by_relation["kind"] == "mlp")
                          & (by_relation["window"] == WINDOW) & (by_relation["layer"] == layer)
                          & (by_relation["position"] == "last subject token")].iloc[0]
        assert (row["aie"], row["ci_low"], row["ci_high"]) == pytest.approx((effects.mean(), low, high), abs=1e-12)
        assert row["n_prompts"] == 3
    landmark = by_relation[by_relation["relation"] == "landmark"]
    assert (landmark["n_prompts"] == 1).all() and landmark["ci_low"].isna().all()  # one fact: no interval
    lines = relation_lines(traced)
    assert lines[0].startswith("capital (3 facts): total effect ") and "MLP window peaks at layer" in lines[0]
    assert lines[1].startswith("landmark (1 fact): total effect ") and lines[1].count("[no interval]") == 2


def test_the_one_layer_sentence_reads_layer_0_of_the_mlp_curve(traced):
    text = single_layer_text(traced)
    aie = traced.aie
    zero = aie[(aie["kind"] == "mlp") & (aie["window"] == 1) & (aie["layer"] == 0)
               & (aie["position"] == "last subject token")].iloc[0]
    assert text.startswith(f"one MLP layer restored at the last subject token: layer 0 {zero['aie']:+.4f} ")
    assert "extended embedding" in text


def test_refusals_are_one_line():
    toy = load_model("toy")  # attention only
    only_attention = trace_facts(toy, [Fact("Fr is in", "Fr", " x"), Fact("Bo is in", "Bo", " y")], samples=1,
                                 progress=False)
    with pytest.raises(UserError, match=r"^the one-layer restores read the MLPs' AIE; this model has no MLPs"):
        single_layer_text(only_attention)
    with pytest.raises(UserError, match=r"^window=0 must be at least 1$"):
        trace_facts(toy, [Fact("Fr is in", "Fr", " x"), Fact("Bo is in", "Bo", " y")], window=0, progress=False)


def test_the_command_writes_the_relations_and_the_token_curves(tmp_path, family_dir, capsys):
    from analyses.cli import main

    directory = family_dir("llama")
    model = load_model(str(directory))
    tokenizer, rows = model_tokenizer(model), []
    for prompt, subject, relation in [("Bo is in", "Bo", "capital"), ("Eva has", "Eva", "capital"),
                                      ("Ed has", "Ed", "capital"), ("Di has", "Di", "landmark"),
                                      ("Fr is in", "Fr", "landmark")]:
        with torch.no_grad():
            top = int(model(encode(model, prompt).tokens)[0, -1].argmax())
        if tokenizer.encode(tokenizer.decode([top])) == [top] and tokenizer.decode([top]).strip():  # an answer
            rows.append((prompt, subject, tokenizer.decode([top]), relation))
    assert len(rows) >= 3
    path = tmp_path / "facts.csv"
    pd.DataFrame(rows, columns=["prompt", "subject", "answer", "relation"]).to_csv(path, index=False)
    assert [fact.relation for fact in read_facts(path)] == [relation for *_, relation in rows]
    out = tmp_path / "out"
    assert main(["trace", "--model", str(directory), "--facts", str(path), "--samples", "2", "--window", "2",
                 "--out", str(out), "--quiet"]) == 0
    direct = trace_facts(model, read_facts(path), samples=2, window=2, progress=False)
    relations = pd.read_csv(out / "relations.csv")
    assert relations["aie"].to_numpy() == pytest.approx(relation_aie(direct)["aie"].to_numpy(), abs=1e-7)
    assert len(pd.read_csv(out / "tokens.csv")) == len(direct.tokens)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["relations"] == relation_lines(direct) and meta["single_layer_mlp"] == single_layer_text(direct)
    printed = capsys.readouterr().out
    assert single_layer_text(direct) in printed and relation_lines(direct)[-1] in printed
