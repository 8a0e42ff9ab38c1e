"""The model's own input format (issue 44.6, architecture §4.11): whether texts and probes begin with the
start token follows the tokenizer (a Hugging Face directory's, a GGUF file's
``tokenizer.ggml.add_bos_token``), else the family's default; ``--prepend-bos/--no-prepend-bos``
overrides it and ``meta.json`` records it; probes without a start token score every role on the
right positions."""

from __future__ import annotations

import json

import pytest
import torch

from analyses.cli import main
from analyses.core.probes import probes_for
from analyses.core.tokens import chat_texts, encode, ordinary_token_ids
from analyses.roles.classify import classify_heads
from gguf_writer import write_gguf
from interp import load_model
from interp.errors import UserError
from interp.random_models import random_hf_model
from interp.tokenizer import set_start_token, start_token_setting

IMPLS = ("scratch", "transformer_lens")
TEXT = "ab c"


def hf_input_ids(tokenizer, text: str = TEXT) -> list[int]:
    """What the Hugging Face tokenizer itself hands the model for ``text``."""
    return tokenizer(text)["input_ids"]


def assert_begins_as_hf(model, hf_tokenizer, prepend: bool) -> None:
    """Texts and probes begin with the start token exactly when ``prepend``, and a text's tokens are
    the Hugging Face tokenizer's own for it."""
    bos = hf_tokenizer.bos_token_id
    ids = encode(model, TEXT).tokens[0].tolist()
    assert ids == hf_input_ids(hf_tokenizer)
    assert (ids[0] == bos) == prepend
    probes = probes_for(model, 4, 16, seed=0)
    assert bool((probes.tokens[:, 0] == bos).all()) == prepend
    ordinary = set(ordinary_token_ids(model))
    assert set(probes.tokens[:, int(prepend):].flatten().tolist()) <= ordinary


@pytest.fixture(scope="module")
def llama_gguf(tmp_path_factory):
    """add_bos_token -> a llama GGUF file whose tokenizer.ggml.add_bos_token says it."""
    made = {}

    def make(add_bos_token: bool):
        if add_bos_token not in made:
            hf, tokenizer = random_hf_model("llama", seed=2)
            path = tmp_path_factory.mktemp("gguf") / f"llama-bos-{add_bos_token}.gguf"
            made[add_bos_token] = write_gguf(hf, tokenizer, path, add_bos_token=add_bos_token)
        return made[add_bos_token]

    return make


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("add_bos_token", [False, True])
def test_a_gguf_file_says_whether_texts_begin_with_the_start_token(llama_gguf, impl, add_bos_token):
    from transformers import AutoTokenizer

    path = llama_gguf(add_bos_token)
    model = load_model(str(path), impl=impl)
    assert start_token_setting(model) == (add_bos_token, "gguf")
    hf_tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    assert_begins_as_hf(model, hf_tokenizer, add_bos_token)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """add_bos_token -> a saved llama directory whose tokenizer adds its BOS or not."""
    made = {}

    def make(add_bos_token: bool):
        if add_bos_token not in made:
            hf, tokenizer = random_hf_model("llama", seed=2)
            tokenizer.add_bos_token = add_bos_token
            directory = tmp_path_factory.mktemp(f"llama-bos-{add_bos_token}")
            hf.save_pretrained(directory)
            tokenizer.save_pretrained(directory)
            made[add_bos_token] = directory
        return made[add_bos_token]

    return make


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("add_bos_token", [False, True])
def test_a_hugging_face_tokenizer_says_whether_texts_begin_with_the_start_token(llama_dir, impl, add_bos_token):
    from transformers import AutoTokenizer

    directory = llama_dir(add_bos_token)
    model = load_model(str(directory), impl=impl)
    assert start_token_setting(model) == (add_bos_token, "tokenizer")
    assert_begins_as_hf(model, AutoTokenizer.from_pretrained(directory), add_bos_token)


@pytest.mark.parametrize("impl", IMPLS)
def test_a_tokenizer_without_a_bos_leaves_it_to_the_family(family_dir, impl):
    """Qwen2's tokenizer has no BOS to add; its family begins texts without a start token (its EOS
    would be the start token), in both implementations."""
    from transformers import AutoTokenizer

    model = load_model(str(family_dir("qwen2")), impl=impl)
    assert start_token_setting(model) == (False, "family default")
    hf_tokenizer = AutoTokenizer.from_pretrained(family_dir("qwen2"))
    assert encode(model, TEXT).tokens[0].tolist() == hf_input_ids(hf_tokenizer)


def run_meta(tmp_path, model: str, *flags: str) -> dict:
    out = tmp_path / "out"
    argv = ["ablate", "--model", model, "--prompts", "2", "--seq-len", "16", "--heads", "0.0", "--method", "zero",
            "--out", str(out), "--quiet", *flags]
    assert main(argv) == 0
    return json.loads((out / "meta.json").read_text())["start_token"]


def test_the_command_line_overrides_the_model_both_ways_and_meta_records_it(tmp_path, llama_gguf):
    assert run_meta(tmp_path, "toy") == {"prepend_bos": True, "source": "model config"}
    assert run_meta(tmp_path, "toy", "--no-prepend-bos") == {"prepend_bos": False, "source": "command line"}
    path = str(llama_gguf(False))
    assert run_meta(tmp_path, path) == {"prepend_bos": False, "source": "gguf"}
    assert run_meta(tmp_path, path, "--prepend-bos") == {"prepend_bos": True, "source": "command line"}


def twice_apart(row: list[int], token: int, distance: int) -> bool:
    """``token`` occurs exactly twice in ``row``, ``distance`` apart."""
    at = [k for k, t in enumerate(row) if t == token]
    return len(at) == 2 and at[1] - at[0] == distance


def naive_scores(patterns: list[torch.Tensor], tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """measure -> (layer, head): each role's attention mass pooled over its query positions, found by
    reading the tokens alone (no probe field): previous token, first position, and for a token whose
    one earlier occurrence is at j and that lies in the repeated segment's second copy (a segment is
    2 tokens or more, and every token from j to it occurs exactly twice, i - j apart), j (duplicate)
    and j + 1 (induction)."""
    n_layers, n_heads = len(patterns), patterns[0].shape[1]
    mass = {m: torch.zeros(n_layers, n_heads, dtype=torch.float64) for m in ("previous_token", "bos",
                                                                            "duplicate_token", "induction")}
    count = dict.fromkeys(mass, 0)
    for b, row in enumerate(tokens.tolist()):
        copy_queries = []
        for i in range(1, len(row)):
            earlier = [j for j in range(i) if row[j] == row[i]]
            if len(earlier) == 1 and i - earlier[0] >= 2 and all(twice_apart(row, t, i - earlier[0])
                                                                for t in row[earlier[0]:i]):
                copy_queries.append((i, earlier[0]))  # the segment's second copy: its tokens occur twice
            for layer, pattern in enumerate(patterns):
                attention = pattern[b].double()  # (head, q, k)
                mass["previous_token"][layer] += attention[:, i, i - 1]
                mass["bos"][layer] += attention[:, i, 0]
        count["previous_token"] += len(row) - 1
        count["bos"] += len(row) - 1
        for i, j in copy_queries:
            for layer, pattern in enumerate(patterns):
                mass["duplicate_token"][layer] += pattern[b].double()[:, i, j]
                mass["induction"][layer] += pattern[b].double()[:, i, j + 1]
        count["duplicate_token"] += len(copy_queries)
        count["induction"] += len(copy_queries)
    return {m: mass[m] / count[m] for m in mass}


def test_probes_without_a_start_token_score_roles_on_the_right_positions():
    model = load_model("toy")
    set_start_token(model, False, "command line")
    probes = probes_for(model, 6, 32, seed=4)
    bos = model.tokenizer.bos_token_id
    assert not (probes.tokens == bos).any()  # no start token anywhere: position 0 is the prefix's first token
    for row, start, period in zip(probes.tokens.tolist(), probes.segment_start.tolist(), probes.period.tolist()):
        assert row[start:start + period] == row[start + period:start + 2 * period]
    frame = classify_heads(model, probes=probes, n_boot=10, progress=False)
    with torch.no_grad():
        _, cache = model.run_with_cache(probes.tokens)
    patterns = [cache[f"blocks.{layer}.attn.hook_pattern"] for layer in range(model.cfg.n_layers)]
    expected = naive_scores(patterns, probes.tokens)
    for measure, scores in expected.items():
        found = frame[frame.measure == measure].sort_values(["layer", "head"])["score"].to_numpy()
        torch.testing.assert_close(torch.tensor(found, dtype=torch.float64), scores.flatten(), atol=1e-5, rtol=0)


def test_chat_wraps_texts_in_the_gguf_files_template_or_is_refused(tmp_path, capsys):
    """--chat: the file's tokenizer.chat_template (read by transformers into the tokenizer) wraps the
    text, with no start token added; a model without a template is refused in one line."""
    from transformers import AutoTokenizer

    hf, tokenizer = random_hf_model("llama", seed=2)
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] "
    path = write_gguf(hf, tokenizer, tmp_path / "chat.gguf", add_bos_token=True, chat_template=template)
    out = tmp_path / "map.png"
    assert main(["attention-map", "--model", str(path), "--text", "hi", "--chat", "--out", str(out), "--quiet"]) == 0
    model = load_model(str(path))
    wrapped = chat_texts(model, ["hi"])[0]
    assert wrapped == "[user] hi\n[assistant] "
    set_start_token(model, False, "chat template")
    hf_tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    assert encode(model, wrapped).tokens[0].tolist() == hf_tokenizer(wrapped, add_special_tokens=False)["input_ids"]
    assert main(["attention-map", "--model", "toy", "--text", "hi", "--chat", "--out", str(out), "--quiet"]) != 0
    assert "has no chat template; drop --chat" in capsys.readouterr().err
    with pytest.raises(UserError, match="no chat template"):
        chat_texts(load_model("toy"), ["hi"])
