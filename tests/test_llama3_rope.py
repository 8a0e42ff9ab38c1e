"""Llama 3's scaled RoPE (issue 43, item 2): ``rope_type="llama3"`` in a Hugging Face config and
llama.cpp's ``rope_freqs.weight`` in a GGUF file (the only place a GGUF keeps it) both divide the
rotary frequencies, so a Llama 3.x model runs from scratch with Hugging Face's logits; a file
without the tensor runs the original RoPE, and transformers' own GGUF load, which drops the
tensor, is refused under the bridge."""

from __future__ import annotations

import gguf
import pytest
import torch
from gguf_writer import write_gguf
from transformers import AutoModelForCausalLM

from interp import UserError, from_hf, load_model
from interp.loading import load_checkpoint, save_checkpoint
from interp.provenance import model_impl
from interp.random_models import random_hf_model, random_like, save_random_model

# the scaling of Llama 3.1 with the original context shrunk to 64 positions, so that the 8
# frequencies of a 16-dim head fall in all three bands: 1 kept, 2 blended, 5 divided by 8
LLAMA3 = dict(rope_type="llama3", rope_theta=1e4, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=64)
PROBE = torch.tensor([[3, *range(40, 120, 2), 17]])  # 42 positions: the long wavelengths turn visibly
SHARP = dict(initializer_range=0.2)  # attention far from uniform, so the positions show in the logits


def hf_logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(PROBE).logits


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(PROBE)


def rope_freqs(path) -> torch.Tensor | None:
    found = [t for t in gguf.GGUFReader(path).tensors if t.name == "rope_freqs.weight"]
    return torch.from_numpy(found[0].data.copy()) if found else None


def with_rope(model, rope: dict):
    """A Hugging Face Llama with ``model``'s weights and the RoPE ``rope``."""
    config = model.config.__class__.from_dict({**model.config.to_dict(), "rope_parameters": rope})
    other = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    other.load_state_dict(model.state_dict())
    return other.eval()


def test_a_llama3_directory_loads_from_scratch_with_hugging_face_logits(tmp_path):
    directory = save_random_model("llama", tmp_path, rope_parameters=LLAMA3, **SHARP)
    ours = load_model(directory)
    theirs = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager").eval()
    assert ours.impl == "scratch"
    torch.testing.assert_close(ours.blocks[0].attn.rotary.inv_freq, theirs.model.rotary_emb.inv_freq,
                               atol=0, rtol=1e-6)
    torch.testing.assert_close(logits(ours), hf_logits(theirs), atol=1e-4, rtol=0)
    plain = with_rope(theirs, dict(rope_type="default", rope_theta=1e4))
    assert (hf_logits(plain) - hf_logits(theirs)).abs().max() > 1e-2  # the scaling shows at these positions
    save_checkpoint(from_hf(theirs), tmp_path / "ours")  # the divisors are saved with our checkpoint
    torch.testing.assert_close(logits(load_checkpoint(tmp_path / "ours")), hf_logits(theirs), atol=1e-4, rtol=0)


def test_a_gguf_files_rope_freqs_divide_the_frequencies_as_llama3_does(tmp_path):
    model, tokenizer = random_hf_model("llama", rope_parameters=LLAMA3, **SHARP)
    scaled = write_gguf(model, tokenizer, tmp_path / "llama3.gguf")
    plain_model = with_rope(model, dict(rope_type="default", rope_theta=1e4))
    plain = write_gguf(plain_model, tokenizer, tmp_path / "llama.gguf")
    divisors = rope_freqs(scaled)
    unscaled = 1.0 / 1e4 ** (torch.arange(0, 16, 2) / 16)
    torch.testing.assert_close(divisors, unscaled / model.model.rotary_emb.inv_freq, atol=0, rtol=1e-6)  # as HF's
    assert divisors[0] == 1 and divisors[-1] == 8 and rope_freqs(plain) is None

    ours = load_model(scaled)
    torch.testing.assert_close(logits(ours), hf_logits(model), atol=1e-4, rtol=0)
    without = load_model(plain)  # the same weights, no rope_freqs: the original RoPE, as before
    assert (logits(without) - logits(ours)).abs().max() > 1e-2
    torch.testing.assert_close(logits(without), hf_logits(plain_model), atol=1e-4, rtol=0)
    assert random_like(ours).cfg.rotary_divisors == ours.cfg.rotary_divisors  # its null model scales them too


def test_transformers_gguf_load_is_refused_where_it_would_drop_rope_freqs(tmp_path):
    model, tokenizer = random_hf_model("llama", rope_parameters=LLAMA3, **SHARP)
    scaled = write_gguf(model, tokenizer, tmp_path / "llama3.gguf")
    with pytest.raises(UserError) as error:
        load_model(scaled, impl="transformer_lens")
    assert "\n" not in str(error.value)
    assert "rope_freqs.weight, divisors 1 to 8), which transformers' GGUF load drops" in str(error.value)
    # divisors all 1 (a factor of 1 scales nothing): nothing dropped, the bridge runs it
    ones_model, _ = random_hf_model("llama", rope_parameters=LLAMA3 | dict(factor=1.0), **SHARP)
    ones = write_gguf(ones_model, tokenizer, tmp_path / "ones.gguf")
    assert torch.equal(rope_freqs(ones), torch.ones(8))
    bridge = load_model(ones, impl="transformer_lens")
    assert model_impl(bridge) == "transformer_lens"
    torch.testing.assert_close(logits(bridge), hf_logits(ones_model), atol=1e-4, rtol=0)
