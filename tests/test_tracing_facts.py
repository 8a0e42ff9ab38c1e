"""Causal tracing over a fact set (issue 47.4): the batched window restores equal hand-written hooks,
the noise scale equals numpy's over the subject embeddings, the position classes and the top-1 filter
equal hand computations, and ``interp trace --facts`` writes its files and refuses bad input in one line."""

import json

import numpy as np
import pandas as pd
import pytest
import torch

from analyses.core.tokens import encode, model_tokenizer
from analyses.tasks.facts import Fact, builtin_facts, read_facts, top1_facts
from analyses.tasks.tracing import (
    draw_noise, fact_seed, position_classes, state_name, subject_embedding_std, subject_positions,
    trace_facts, trace_verdict, window_layers,
)
from interp import UserError, from_hf, load_model
from interp.random_models import random_hf_model
from hand_checks import add_to_embed

FACTS = [Fact("The capital of Fr is", "Fr", "x"), Fact("Big Ben stands in", "Big Ben", "y")]


@pytest.fixture(scope="module")
def llama12():
    """A 12-layer random Llama (rotary, grouped-query) as our GPTModel: windows of 10 fit inside it."""
    return from_hf(*random_hf_model("llama", num_hidden_layers=12, n_ctx=64, seed=4))


def naive_effects(model, fact, index, samples, std, seed, layers, window=10):
    """(token, kind, width, layer) by hand, at the subject's first, second and last tokens and the
    prompt's last, at ``layers``: for each noise draw one full forward with the noise added to the
    subject's embeddings and the clean MLP / attention outputs of the layers l-5 .. l+4 (clipped) or
    of layer l alone, or the clean hidden state of layer l, put back at that one token; restored -
    noised probability."""
    ids = encode(model, fact.prompt).tokens
    subject = subject_positions(model, fact.prompt, fact.subject)
    answer = model_tokenizer(model).encode(fact.answer)[0]  # one byte: its own token after the prompt
    draws = draw_noise(model, samples, len(subject), std, fact_seed(seed, index))
    _, clean = model.run_with_cache(ids)

    def noised_prob(extra):
        probs = []
        for draw in draws:
            with torch.no_grad():
                logits = model.run_with_hooks(ids, fwd_hooks=[("hook_embed", add_to_embed(draw, subject)), *extra])
            probs.append(logits[0, -1].softmax(-1)[answer].item())
        return sum(probs) / len(probs)

    corrupted = noised_prob([])
    found = {}
    n_layers = model.cfg.n_layers
    for pos in sorted({*subject[:2], subject[-1], ids.shape[1] - 1}):
        for kind, width in (("resid", 1), ("mlp", window), ("attn", window), ("mlp", 1), ("attn", 1)):
            for layer in layers:
                lows = range(max(0, layer - width // 2), min(n_layers, layer + (width + 1) // 2))
                hooks = []
                for at in lows:
                    hook_name = {"resid": f"blocks.{at}.hook_resid_post", "mlp": f"blocks.{at}.hook_mlp_out",
                                 "attn": f"blocks.{at}.hook_attn_out"}[kind]

                    def restore(act, hook, hook_name=hook_name, pos=pos):
                        act = act.clone()
                        act[0, pos] = clean[hook_name][0, pos]
                        return act

                    hooks.append((hook_name, restore))
                found[pos, kind, width, layer] = noised_prob(hooks) - corrupted
    return found


@pytest.mark.parametrize("which", ["llama12", "bridge_gpt2"])
def test_window_restores_equal_hand_written_hooks(request, which):
    model = request.getfixturevalue(which)
    if which == "llama12":  # rows of one variant split over chunks would miss their draws' cached keys
        with pytest.raises(UserError, match="memory_mb=0.05 holds fewer than the 3 rows \\(noise draws\\)"):
            trace_facts(model, FACTS, samples=3, memory_mb=0.05, progress=False)
    trace = trace_facts(model, FACTS, samples=3, seed=7, memory_mb=0.5, progress=False)  # a variant or two a chunk
    assert trace.curves == (("resid", 1), ("mlp", 10), ("attn", 10), ("mlp", 1), ("attn", 1))
    effects = trace.tokens.set_index(["fact", "pos", "kind", "window", "layer"])["effect"]
    differences, largest = [], effects.abs().max()
    layers = sorted({0, 1, model.cfg.n_layers // 2, model.cfg.n_layers - 1})  # windows clipped at each end, and not
    for index, fact in enumerate(FACTS):
        naive = naive_effects(model, fact, index, 3, trace.noise_std, 7, layers)
        for (pos, kind, width, layer), value in naive.items():
            got = effects.loc[index, pos, kind, width, layer]
            assert got == pytest.approx(value, abs=1e-5), (fact.prompt, pos, kind, width, layer)
            differences.append(abs(got - value))
    assert largest > 1e-5 and max(differences) < 1e-3 * largest  # the restores do something, and match closely


def test_windows_are_centred_on_the_layer_and_clipped_as_rome_does():
    assert list(window_layers(0, 12, 10)) == [0, 1, 2, 3, 4]
    assert list(window_layers(6, 12, 10)) == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert list(window_layers(11, 12, 10)) == [6, 7, 8, 9, 10, 11]
    assert list(window_layers(3, 12, 1)) == [3]


def test_the_noise_is_three_stds_of_the_subject_token_embeddings():
    toy = load_model("toy")  # byte tokens after a start token; hook_embed is the embedding row
    prompts, subjects = ["When Mary met Tom", "Then Bob left"], ["Mary", "Bob"]
    ids = list(b" Mary") + list(b" Bob")  # each subject with the space before it
    expected = np.std(toy.W_E.detach().numpy()[ids], ddof=1)
    assert subject_embedding_std(toy, prompts, subjects) == pytest.approx(expected, rel=1e-5)
    trace = trace_facts(toy, [Fact(p + " is", s, " x") for p, s in zip(prompts, subjects)], samples=2,
                        progress=False)
    assert trace.noise_std == pytest.approx(3 * expected, rel=1e-5)


def test_position_classes_on_a_known_tokenisation():
    toy = load_model("toy")
    prompt = "The capital of France is"  # bytes after the start token: " France" at 15..21, " is" at 22..24
    subject = subject_positions(toy, prompt, "France")
    assert subject == list(range(15, 22))
    assert position_classes(25, subject) == {
        "first subject token": [15], "middle subject tokens": [16, 17, 18, 19, 20], "last subject token": [21],
        "first subsequent token": [22], "further tokens": [23], "last token": [24]}
    assert position_classes(5, [3]) == {"last subject token": [3], "last token": [4]}  # one token each
    toy.cfg.default_prepend_bos = False  # no start token: every position one earlier
    assert subject_positions(toy, prompt, "France") == list(range(14, 21))
    with pytest.raises(UserError, match="the subject must end before the prompt's last token"):
        position_classes(5, [3, 4])


def test_the_top1_filter_keeps_exactly_what_a_hand_argmax_keeps(scratch_gpt2):
    tokenizer = model_tokenizer(scratch_gpt2)

    def top(prompt):  # one prompt at a time, no padding
        with torch.no_grad():
            return int(scratch_gpt2(encode(scratch_gpt2, prompt).tokens)[0, -1].argmax())

    prompts = ["The capital of Fr is", "Big Ben stands", "A", "Paris is in the country of", "Tokyo is in", "Rome"]
    facts = [Fact(prompt, prompt.split()[0], tokenizer.decode([top(prompt) + (i % 2)]))  # every other: not the top
             for i, prompt in enumerate(prompts)]
    hand = [fact for fact in facts
            if tokenizer.encode(fact.prompt + fact.answer)[len(tokenizer.encode(fact.prompt))] == top(fact.prompt)]
    for memory_mb in (100, 0.01):  # one right-padded batch; a prompt per batch
        kept, frame = top1_facts(scratch_gpt2, facts, memory_mb=memory_mb, progress=False)
        assert kept == hand and 0 < len(kept) < len(facts)
        assert frame["kept"].tolist() == [fact in hand for fact in facts]


def test_the_shipped_fact_set_is_well_formed():
    facts = builtin_facts()
    assert len(facts) >= 500 and len(set(facts)) == len(facts)
    assert all(fact.subject in fact.prompt and fact.answer.startswith(" ") for fact in facts)
    assert {fact.relation for fact in facts} >= {"capital", "language", "currency", "founder", "company_country"}


def write_facts(path, rows, header="prompt,subject,answer"):
    path.write_text(header + "\n" + "\n".join(",".join(row) for row in rows) + "\n")
    return path


def test_trace_facts_command_writes_the_table_the_panels_and_the_verdict(tmp_path, family_dir, capsys):
    from analyses.cli import main

    directory = family_dir("llama")
    model = load_model(str(directory))
    tokenizer, rows = model_tokenizer(model), []
    for prompt, subject in [("The capital of Fr is", "Fr"), ("Big Ben stands in", "Big Ben"), ("Hamlet was by", "Hamlet"),
                            ("Oslo lies in", "Oslo"), ("Mars is a", "Mars"), ("Ada wrote the", "Ada")]:
        with torch.no_grad():
            top = int(model(encode(model, prompt).tokens)[0, -1].argmax())
        if tokenizer.encode(tokenizer.decode([top])) == [top] and len(rows) < 3:  # an ordinary token: the answer
            rows.append((prompt, subject, tokenizer.decode([top])))
    rows.append(("Rome is in", "Rome", "\u00e9"))  # not the top token: filtered out
    path = tmp_path / "facts.csv"
    pd.DataFrame(rows, columns=["prompt", "subject", "answer"]).to_csv(path, index=False)
    out = tmp_path / "out"
    assert main(["trace", "--model", str(directory), "--facts", str(path), "--samples", "2", "--out", str(out),
                 "--quiet"]) == 0
    aie = pd.read_csv(out / "aie.csv")
    direct = trace_facts(model, read_facts(path)[:3], samples=2, noise_facts=read_facts(path), progress=False)
    assert list(aie.columns) == list(direct.aie.columns)
    assert aie["aie"].to_numpy() == pytest.approx(direct.aie["aie"].to_numpy(), abs=1e-7)
    assert set(aie["kind"]) == {"resid", "mlp", "attn"} and len(aie) == 5 * 2 * aie["position"].nunique()
    facts = pd.read_csv(out / "facts.csv")
    assert facts["kept"].tolist() == [True, True, True, False] and facts["traced"].tolist() == [True, True, True, False]
    meta = json.loads((out / "meta.json").read_text())
    assert meta["kept_top1"] == 3 and meta["verdict"] == trace_verdict(direct).text
    assert (out / "tracing.png").read_bytes()[:4] == b"\x89PNG"
    assert "3 of 4 facts answered top-1" in capsys.readouterr().out


@pytest.mark.parametrize("rows, header, message", [
    ([("The capital of Fr is", "Fr")], "prompt,subject", "facts file f.csv: the header lacks answer; it needs "
                                                          "prompt, subject, answer, and has 'prompt', 'subject'"),
    ([("The capital of Fr is", "Germany", " x")], "prompt,subject,answer",
     "facts file f.csv, row 1: subject 'Germany' does not occur in the prompt 'The capital of Fr is'"),
    ([("The capital of Fr is", "", " x")], "prompt,subject,answer", "facts file f.csv, row 1: empty subject"),
])
def test_bad_facts_files_are_one_line_errors(tmp_path, capsys, rows, header, message):
    from analyses.cli import main

    path = write_facts(tmp_path / "f.csv", rows, header)
    assert main(["trace", "--facts", str(path), "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err.strip() == f"interp trace: error: {message}"


def test_a_trace_needs_facts_or_a_prompt_and_a_subject_the_model_can_trace(tmp_path, capsys):
    from analyses.cli import main

    assert main(["trace", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == ("interp trace: error: give --facts FILE|builtin, or --prompt and "
                                               "--subject for a single trace")
    toy = load_model("toy")
    with pytest.raises(UserError, match=r"^fact 2 \('Rome is Rome'\): the subject must end before"):
        trace_facts(toy, [Fact("Oslo is in", "Oslo", " x"), Fact("Rome is Rome", "is Rome", "x")], samples=1,
                    progress=False)


def test_the_verdict_words_its_intervals_as_every_command_does():
    """The verdict's numbers read as every other effect with its interval (signed, the interval in
    brackets): ``+0.2570 [+0.2240, +0.2900]``."""
    from types import SimpleNamespace

    rows = [("last subject token", 5, 0.257, 0.224, 0.290), ("last subject token", 6, 0.08, 0.06, 0.10),
            ("first subject token", 5, 0.015, -0.005, 0.027)]
    aie = pd.DataFrame([dict(kind="mlp", window=10, position=position, layer=layer, aie=value, ci_low=low,
                             ci_high=high, n_prompts=104) for position, layer, value, low, high in rows])
    verdict = trace_verdict(SimpleNamespace(aie=aie, window=10, n_layers=30))
    assert "with AIE +0.2570 [+0.2240, +0.2900]; at that layer first subject token +0.0150 [-0.0050, +0.0270]: " \
           "separated" in verdict.text
