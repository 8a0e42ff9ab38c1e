"""What a trace measures: the answer token, taken by one rule for one prompt and for a fact set (on a
byte tokenizer the answer's first letter, never the space before it); the fewest facts an interval is
printed for; and a noise scale over the whole fact set, so a fact's numbers do not depend on which
others are traced."""

import json

import numpy as np
import pandas as pd
import pytest
import torch

from analyses.core.tokens import encode
from analyses.tasks.facts import Fact, answer_token, builtin_facts, top1_facts
from analyses.tasks.tracing import causal_trace, trace_facts
from interp import UserError, load_model
from test_tasks import bpe_model  # noqa: F401 (the fixture: a BPE trained on names, " Mary" one token)

SUBJECTS = [("The capital of France is", "France"), ("Big Ben stands in", "Big Ben"), ("Oslo lies in", "Oslo"),
            ("When Mary met Tom, Mary said hi to", "Mary")]


@pytest.fixture(scope="module")
def toy():
    return load_model("toy")  # byte tokens after a start token: " Paris" is " ", "P", "a", ...


def next_byte(model, text: str) -> int:
    """The model's top next token after ``text``, one prompt, no padding."""
    with torch.no_grad():
        return int(model(encode(model, text).tokens)[0, -1].argmax())


def known_facts(model) -> list[Fact]:
    """Facts the toy answers top-1 by construction: the answer is a space and the toy's top byte after
    the prompt and a space (a letter or digit in each of ``SUBJECTS``)."""
    facts = [Fact(prompt, subject, " " + chr(next_byte(model, prompt + " "))) for prompt, subject in SUBJECTS]
    assert all(fact.answer[1:].isalnum() for fact in facts)
    return facts


def test_a_fact_on_a_byte_tokenizer_is_traced_at_its_first_letter_not_the_space(toy):
    facts = builtin_facts()
    kept, frame = top1_facts(toy, facts, progress=False)
    assert (frame["answer_token"] != ord(" ")).all()  # the old rule: every answer token was the space
    assert frame["answer_token"].tolist() == [ord(fact.answer[1]) for fact in facts]  # " Paris": "P"
    assert frame["prompt"].tolist() == [fact.prompt + " " for fact in facts]
    hand = [fact for fact in facts if next_byte(toy, fact.prompt + " ") == ord(fact.answer[1])]
    assert kept == hand and len(kept) < 50  # the toy knows few capitals' first letters; the space it always knew


def test_one_prompt_and_a_fact_set_take_the_same_answer_token(toy):
    prompt, subject = SUBJECTS[3]
    one = causal_trace(toy, prompt, subject, " Mary", samples=2, kinds=("resid",), progress=False)
    assert one.answer == ord("M") and one.tokens[-1] == " "  # the space moved onto the prompt
    with torch.no_grad():
        hand = toy(encode(toy, prompt + " ").tokens)[0, -1].softmax(-1)[ord("M")].item()
    assert one.clean_prob == pytest.approx(hand, rel=1e-5)
    found = trace_facts(toy, [Fact(prompt, subject, " Mary"), Fact(*SUBJECTS[0], " Paris")], samples=2,
                        kinds=("resid",), progress=False)
    assert found.facts["answer_token"].tolist() == [ord("M"), ord("P")]
    assert found.facts["clean_prob"][0] == pytest.approx(one.clean_prob, rel=1e-6)
    assert answer_token(toy, prompt, " ") == (prompt, ord(" "))  # an answer of whitespace alone is itself


def test_an_answer_that_merges_into_the_prompt_is_refused_for_both(bpe_model):
    """On a BPE, " st" + "ore" is one token " store": no token of the answer's own follows the prompt."""
    prompt = "When Mary and John went to the st"
    assert answer_token(bpe_model, "When Mary and John went to the store, John gave a drink to", " Mary")[0].endswith(
        " to")  # a one-token answer: the prompt as it is
    with pytest.raises(UserError) as refused:
        answer_token(bpe_model, prompt, "ore")
    assert str(refused.value) == ("answer 'ore' does not continue the prompt 'When Mary and John went to the st' as "
                                  "tokens of its own: the prompt ends in the tokens [' st'], prompt + answer in "
                                  "[' store']; end the prompt where a token ends, or give the answer with what it "
                                  "merges with")
    with pytest.raises(UserError, match=r"^the answer to 'x' is empty; give the exact continuation, e.g. ' Paris'$"):
        answer_token(bpe_model, "x", "")


def test_a_single_trace_says_how_the_tokenizer_splits_its_answer(toy, tmp_path, capsys):
    from analyses.cli import main

    prompt, subject = SUBJECTS[0]
    assert main(["trace", "--model", "toy", "--prompt", prompt, "--subject", subject, "--answer", " Paris",
                 "--samples", "1", "--out", str(tmp_path / "t"), "--quiet"]) == 0
    assert ("answer ' Paris' continues the prompt as 5 token(s) ['P', 'a', 'r', 'i', 's'] (its leading ' ' is a token "
            "of its own here, so it moves onto the prompt); the trace reads the first, 'P'\n") in capsys.readouterr().out


def test_a_fact_trace_of_one_fact_is_refused_before_any_model_work(toy, tmp_path, capsys, monkeypatch):
    from analyses.cli import main
    import analyses.cli.tasks as command

    with pytest.raises(UserError, match=r"^1 fact\(s\) to trace: an interval over facts needs at least 2 facts"):
        trace_facts(toy, known_facts(toy)[:1], samples=2, progress=False)
    monkeypatch.setattr(command, "load_cli_model", lambda args: pytest.fail("the model loaded"))
    assert main(["trace", "--facts", "builtin", "--limit", "1", "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err.strip() == (
        "interp trace: error: --limit 1: an interval over facts needs at least 2 facts, since one fact's resamples "
        "are all that fact (a zero-width interval)")


def test_the_toy_knows_too_few_builtin_facts_to_trace(tmp_path, capsys):
    from analyses.cli import main

    assert main(["trace", "--facts", "builtin", "--out", str(tmp_path / "o"), "--quiet"]) == 2
    assert capsys.readouterr().err.strip().startswith(
        "interp trace: error: 1 of 595 facts answered top-1 by this model: an interval over facts needs at least 2")


def test_a_facts_numbers_do_not_depend_on_which_others_are_traced(toy, tmp_path, capsys):
    from analyses.cli import main

    facts = known_facts(toy)
    path = tmp_path / "facts.csv"
    pd.DataFrame([(f.prompt, f.subject, f.answer) for f in facts], columns=["prompt", "subject", "answer"]).to_csv(
        path, index=False)
    written = {}
    for limit in (2, 3):
        out = tmp_path / f"limit{limit}"
        assert main(["trace", "--facts", str(path), "--limit", str(limit), "--samples", "2", "--out", str(out),
                     "--quiet"]) == 0
        written[limit] = pd.read_csv(out / "facts.csv"), json.loads((out / "meta.json").read_text())
    (two, meta2), (three, meta3) = written[2], written[3]
    assert two["traced"].tolist() == [True, True, False, False] and three["traced"].tolist() == [True] * 3 + [False]
    for column in ("clean_prob", "corrupted_prob"):
        assert two[column][:2].tolist() == three[column][:2].tolist()
    printed = capsys.readouterr().out
    assert "4 of 4 facts answered top-1 (0 dropped: their answer token is not the model's top next token)" in printed
    assert meta2["noise_std"] == meta3["noise_std"] and meta2["noise_std_over"] == "the subject tokens of 4 facts"
    spans = []  # every subject's bytes with the space before it, where one is: the noised embeddings
    for prompt, subject in SUBJECTS:
        start = prompt.index(subject)
        spans += list(prompt[start - (start > 0): start + len(subject)].encode())
    assert meta2["noise_std"] == pytest.approx(3 * np.std(toy.W_E.detach().numpy()[spans], ddof=1), rel=1e-5)
    short = trace_facts(toy, facts[:2], samples=2, noise_facts=facts, progress=False)
    longer = trace_facts(toy, facts[:3], samples=2, noise_facts=facts, progress=False)
    assert np.array_equal(short.effects, longer.effects[:2], equal_nan=True)
