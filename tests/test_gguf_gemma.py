"""Gemma 2 and 3 GGUF files with the metadata llama.cpp's converter writes beyond what transformers'
GGUF reader maps (tests/test_gguf.py writes only the keys transformers reads): Gemma 2's soft caps,
Gemma 3's local RoPE base (``rope.freq_base_swa``), its layer pattern and its global layers' RoPE
scaling. Where the file's value is what the config transformers builds holds (as in Google's Gemma
2 and the text-only Gemma 3 files), the file loads from scratch with transformers' logits; where it
is not, transformers' load and ours would both run another model than llama.cpp's, and the file
is refused in one line. The score scale no file holds (``query_pre_attn_scalar``) is llama.cpp's,
derived from the file's shapes: the published models' own, and the very model a file was written
from where that model's scale is llama.cpp's. Tiny random models, no network."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import gguf_writer
from interp import load_model
from interp.convert import gguf as gguf_module
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


# the random models' head width and score scale (random_hf_model), which llama.cpp derives from their
# files (and transformers' GGUF load, without it, takes as its default 256)
RANDOM_HEAD_WIDTH = 16
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
    theirs = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, attn_implementation="eager",
                                                  query_pre_attn_scalar=RANDOM_HEAD_WIDTH).eval()
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


# Google's Gemma 2 and 3 (their config.json): llama.cpp architecture, layers, d_model, query heads,
# head width (attention.key_length), and the query_pre_attn_scalar each was trained with
PUBLISHED = {
    "gemma-2-2b": ("gemma2", 26, 2304, 8, 256, 256), "gemma-2-9b": ("gemma2", 42, 3584, 16, 256, 256),
    "gemma-2-27b": ("gemma2", 46, 4608, 32, 128, 144),
    "gemma-3-270m": ("gemma3", 18, 640, 4, 256, 256), "gemma-3-1b": ("gemma3", 26, 1152, 4, 256, 256),
    "gemma-3-4b": ("gemma3", 34, 2560, 8, 256, 256), "gemma-3-12b": ("gemma3", 48, 3840, 16, 256, 256),
    "gemma-3-27b": ("gemma3", 62, 5376, 32, 128, 168),
}


def derived_scalar(arch: str, layers: int, d_model: int, heads: int, d_head: int | None) -> int:
    metadata = {f"{arch}.block_count": layers, f"{arch}.embedding_length": d_model, f"{arch}.attention.head_count": heads}
    if d_head is not None:
        metadata[f"{arch}.attention.key_length"] = d_head
    return gguf_module.DERIVED[arch]["query_pre_attn_scalar"](metadata, arch)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_the_score_scale_derived_from_a_published_gemmas_shapes_is_the_one_it_was_trained_with(name):
    arch, layers, d_model, heads, d_head, trained = PUBLISHED[name]
    assert derived_scalar(arch, layers, d_model, heads, d_head) == trained


@pytest.mark.parametrize("arch, layers_of_27b", [("gemma2", 46), ("gemma3", 62)])
def test_the_score_scale_follows_llama_cpps_rule_on_any_shape(arch, layers_of_27b):
    """llama.cpp (``llama_model::load_hparams``): 1/sqrt(n_embd / n_head) for the model it types
    27B by its layer count, 1/sqrt(n_embd_head_k) for every other, the key width defaulting to
    n_embd / n_head where the file has no ``attention.key_length``."""
    assert derived_scalar(arch, layers_of_27b, 96, 4, 8) == 24  # d_model // heads, not the head width
    assert derived_scalar(arch, layers_of_27b + 1, 96, 4, 8) == 8
    assert derived_scalar(arch, 2, 96, 4, None) == 24


# family -> the random model's shape; each one's query_pre_attn_scalar is what llama.cpp derives
# from it: its head width, or d_model // heads at the layer count llama.cpp takes as the 27B model's
# (head width 8 there: 64 // 4 = 16 is not it). Gemma 3's layer pattern is the one transformers
# assumes of a file that states none (a period of 6: both layers, or 5 of each 6, local).
AS_LLAMA_CPP_RUNS = {
    "gemma2": dict(),
    "gemma3_text": dict(sliding_window_pattern=6),
    "gemma2-27b-shaped": dict(num_hidden_layers=46, head_dim=8, query_pre_attn_scalar=16),
    "gemma3_text-27b-shaped": dict(num_hidden_layers=62, head_dim=8, query_pre_attn_scalar=16,
                                   sliding_window_pattern=6),
}


@pytest.mark.parametrize("case, impl", [(case, None) for case in sorted(AS_LLAMA_CPP_RUNS)] + [
    ("gemma2", "transformer_lens"), ("gemma3_text", "transformer_lens")])  # the bridge: a minute per 50 layers
@torch.no_grad()
def test_a_gemma_file_scores_as_llama_cpp_does_and_holds_the_model_it_was_written_from(tmp_path, case, impl):
    """The random models' scale is not transformers' default (256), which a load that took it would
    divide scores by (several logits off)."""
    family = case.split("-")[0]
    model, tokenizer = random_hf_model(family, seed=3, initializer_range=0.2, **AS_LLAMA_CPP_RUNS[case])
    assert model.config.query_pre_attn_scalar != 256
    path = gguf_writer.write_gguf(model, tokenizer, tmp_path / f"{case}.gguf", "F32", name=family)
    ours = load_model(path, impl=impl)
    torch.testing.assert_close(ours(PROBE), model(PROBE).logits, atol=1e-4, rtol=0)
