"""Gemma 2 and 3 GGUF files with the metadata llama.cpp's converter writes beyond what transformers'
GGUF reader maps (tests/test_gguf.py writes only the keys transformers reads): Gemma 2's soft caps,
Gemma 3's local RoPE base (``rope.freq_base_swa``), its layer pattern and its global layers' RoPE
scaling. Where the file's value is what the config transformers builds holds (as in Google's Gemma
2 and the text-only Gemma 3 files), the file loads from scratch with transformers' logits; where it
is not, transformers' load and ours would both run another model than llama.cpp's, and the file
is refused in one line. Tiny random models, no network."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import gguf_writer
from interp import load_model
from interp.errors import UserError
from interp.random_models import random_hf_model

PROBE = torch.tensor([[5, 70, 71, 72, 90, 91, 100, 101]])


def write(tmp_path, monkeypatch, family: str, extra: dict) -> object:
    """A GGUF file of a tiny random ``family`` model, with the metadata ``extra`` ({key after the
    architecture: value}) written beside the keys transformers reads."""
    model, tokenizer = random_hf_model(family, seed=3, initializer_range=0.2)
    write_config = gguf_writer._write_config

    def with_extra(writer, arch, config):
        write_config(writer, arch, config)
        for key, value in extra.items():
            name = f"{arch}.{key}"
            if isinstance(value, str):
                writer.add_string(name, value)
            elif isinstance(value, list):
                writer.add_array(name, value)
            elif isinstance(value, int):
                writer.add_uint32(name, value)
            else:
                writer.add_float32(name, value)

    monkeypatch.setattr(gguf_writer, "_write_config", with_extra)
    return gguf_writer.write_gguf(model, tokenizer, tmp_path / f"{family}.gguf", "F32", name=family)


AS_LLAMA_CPP_WRITES = {  # the values of the random models' configs (Gemma 2's default caps, Gemma 3's 10,000)
    "gemma2": {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
    "gemma3_text": {"rope.freq_base_swa": 10_000.0, "rope.scaling.type": "none"},
}


@pytest.mark.parametrize("family", sorted(AS_LLAMA_CPP_WRITES))
@torch.no_grad()
def test_metadata_transformers_drops_is_accepted_where_its_config_holds_the_same(tmp_path, monkeypatch, family):
    path = write(tmp_path, monkeypatch, family, AS_LLAMA_CPP_WRITES[family])
    ours = load_model(path)
    assert ours.impl == "scratch" and ours.family == family
    theirs = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                  attn_implementation="eager").eval()
    torch.testing.assert_close(ours(PROBE), theirs(PROBE).logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family, extra, key", [
    ("gemma2", {"final_logit_softcapping": 5.0}, "gemma2.final_logit_softcapping=5.0"),
    ("gemma2", {"attn_logit_softcapping": 20.0}, "gemma2.attn_logit_softcapping=20.0"),
    ("gemma3_text", {"rope.freq_base_swa": 5_000.0}, "gemma3.rope.freq_base_swa=5000.0"),
    ("gemma3_text", {"rope.scaling.type": "linear", "rope.scaling.factor": 8.0}, "gemma3.rope.scaling.type='linear'"),
    ("gemma3_text", {"attention.sliding_window_pattern": [True, False]},
     "gemma3.attention.sliding_window_pattern=[True, False]"),
])
@pytest.mark.parametrize("impl", [None, "transformer_lens"])
def test_metadata_transformers_drops_and_would_misread_is_refused_in_one_line(tmp_path, monkeypatch, family, extra,
                                                                              key, impl):
    path = write(tmp_path, monkeypatch, family, extra)
    with pytest.raises(UserError) as refusal:
        load_model(path, impl=impl)
    message = str(refusal.value)
    assert f"its metadata {key}, which transformers' GGUF reader drops" in message and "\n" not in message, message


@torch.no_grad()
def test_gemma3_s_layer_pattern_as_a_period_is_read_as_hugging_face_reads_it(tmp_path, monkeypatch):
    """A period of 2: local, global (the random model's layers); transformers' reader, which
    drops the key, assumes 6 (both local), so the file is refused; the period it assumes passes."""
    with pytest.raises(UserError, match="sliding_window_pattern=2"):
        load_model(write(tmp_path, monkeypatch, "gemma3_text", {"attention.sliding_window_pattern": 2}))
    model, _ = random_hf_model("gemma3_text", sliding_window_pattern=6)
    assert model.config.layer_types == ["sliding_attention", "sliding_attention"]
    assert load_model(write(tmp_path, monkeypatch, "gemma3_text", {"attention.sliding_window_pattern": 6})).impl == "scratch"
