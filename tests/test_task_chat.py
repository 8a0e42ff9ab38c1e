"""``interp task --chat`` and ``interp explain --chat`` (issue 44.6): each prompt, clean and corrupted,
given as a user's message in the model's chat template, the pairs' token lengths kept equal (a
template that breaks them is refused in one line), the metric read at the reply's first token, and
meta.json saying so; checked against Hugging Face's model on prompts wrapped by hand."""

from __future__ import annotations

import json
import shutil

import pandas as pd
import pytest
import torch

from analyses.cli import main
from analyses.tasks.task import greater_than_task
from interp import load_model
from interp.random_models import random_hf_model

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TRIMMED = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] | trim }}\n{% endfor %}[assistant] "


@pytest.fixture(scope="module")
def chat_models(tmp_path_factory):
    """template name -> a directory holding one random Qwen2 model (its tokenizer has ChatML's
    markers) with that chat template, and the Hugging Face model itself."""
    hf, tokenizer = random_hf_model("qwen2", seed=4, n_ctx=256)
    made = {}
    for name, template in (("chatml", CHATML), ("trimmed", TRIMMED)):
        directory = tmp_path_factory.mktemp(name)
        hf.save_pretrained(directory)
        tokenizer.chat_template = template
        tokenizer.save_pretrained(directory)
        made[name] = directory
    return made, hf


def by_hand(prompt: str) -> str:
    """ChatML written out: the prompt as the user's message, then the assistant's turn opened."""
    return f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"


def hf_prob_diff(hf, tokenizer, texts, answers, distractors) -> list[float]:
    """Each text's sum p(answers) - sum p(distractors) at its last token, from Hugging Face's model
    on the tokenizer's own ids (no special tokens added: the template wrote its markers)."""
    found = []
    for text, good, bad in zip(texts, answers, distractors):
        ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            probs = hf(ids).logits[0, -1].float().softmax(-1)
        found.append((probs[list(good)].sum() - probs[list(bad)].sum()).item())
    return found


def test_task_with_chat_reads_the_replys_first_token_as_hugging_face_does(chat_models, tmp_path):
    from transformers import AutoTokenizer

    dirs, hf = chat_models
    out = tmp_path / "gt"
    assert main(["task", "greater-than", "--model", str(dirs["chatml"]), "--chat", "--n", "4", "--top", "1",
                 "--no-split", "--exact-all", "--out", str(out), "--quiet"]) == 0
    bare = greater_than_task(load_model(str(dirs["chatml"])), n=4)
    tokenizer = AutoTokenizer.from_pretrained(str(dirs["chatml"]))
    table = pd.read_csv(out / "metric.csv").set_index(["run", "measure"])
    for run, prompts in (("clean", bare.clean), ("corrupted", bare.corrupted)):
        expected = hf_prob_diff(hf, tokenizer, [by_hand(p) for p in prompts], bare.answers, bare.distractors)
        assert table.loc[(run, "prob_diff"), "metric"] == pytest.approx(sum(expected) / 4, abs=1e-5)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["arguments"]["chat"] is True
    assert meta["start_token"] == {"prepend_bos": False, "source": "chat template"}
    assert "chat template" in meta["note"]
    assert by_hand(bare.clean[0]) in (out / "report.md").read_text()  # the page shows the prompt as given
    # without --chat the same command measures the bare prompts
    plain = tmp_path / "plain"
    assert main(["task", "greater-than", "--model", str(dirs["chatml"]), "--n", "4", "--top", "1", "--no-split",
                 "--exact-all", "--out", str(plain), "--quiet"]) == 0
    expected = hf_prob_diff(hf, tokenizer, bare.clean, bare.answers, bare.distractors)
    plain_table = pd.read_csv(plain / "metric.csv").set_index(["run", "measure"])
    assert plain_table.loc[("clean", "prob_diff"), "metric"] == pytest.approx(sum(expected) / 4, abs=1e-5)
    assert json.loads((plain / "meta.json").read_text())["arguments"]["chat"] is False


def test_explain_takes_chat(chat_models, tmp_path):
    dirs, _ = chat_models
    out = tmp_path / "explain"
    assert main(["explain", "greater-than", "--model", str(dirs["chatml"]), "--chat", "--n", "2", "--heads", "0.0",
                 "--steps", "1", "--no-flow", "--out", str(out), "--quiet"]) == 0
    meta = json.loads((out / "meta.json").read_text())
    assert meta["arguments"]["chat"] is True and meta["start_token"]["source"] == "chat template"


def test_a_template_that_breaks_the_pairs_lengths_or_no_template_is_refused_in_one_line(chat_models, tmp_path,
                                                                                        capsys):
    """A template that trims its message turns "ab " (clean) and "xab" (corrupted), 3 tokens each,
    into texts one token apart: refused naming the pair; a model without a template: refused before
    any work."""
    dirs, _ = chat_models
    path = tmp_path / "pairs.jsonl"
    path.write_text('{"clean": "ab ", "corrupted": "xab", "answer": "c", "distractor": "d"}\n')
    out = tmp_path / "out"
    assert main(["task", str(path), "--model", str(dirs["trimmed"]), "--chat", "--out", str(out), "--quiet"]) == 2
    error = capsys.readouterr().err.strip()
    assert "prompt 0" in error and "chat template" in error and "\n" not in error
    shutil.rmtree(out, ignore_errors=True)
    assert main(["task", "ioi", "--model", "toy", "--chat", "--out", str(out), "--quiet"]) != 0
    assert "has no chat template; drop --chat" in capsys.readouterr().err
