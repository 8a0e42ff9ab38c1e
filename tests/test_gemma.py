"""Gemma 2 and Gemma 3 (text) from scratch, beyond what tests/test_scratch_families.py checks on every
family (logits against Hugging Face eager, every hook against the bridge, generation, the fast path)
and tests/test_converter_options.py on every config field: what these two add to the block (a norm
on the attention's and the MLP's output), where their hooks sit, their embedding scale in bfloat16,
and the refusal of Gemma 3's image-and-text model. Tiny random models, no network.
"""

from __future__ import annotations

import json

import pytest
import torch
from einops import einsum
from transformers import AutoModelForCausalLM

import analyses.core.hook_check as hook_check
from analyses.core.hook_check import HEAD_CONTRIBUTIONS, HEAD_WRITES, check_hooks
from interp import from_hf, load_model
from interp.bridge import boot_bridge
from interp.errors import UserError
from interp.random_models import random_hf_model, save_random_model

SANDWICH = ("gemma2", "gemma3_text")


def tokens(batch: int = 2, pos: int = 20) -> torch.Tensor:
    return torch.randint(4, 300, (batch, pos), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("family", SANDWICH)
@torch.no_grad()
def test_the_attention_hooks_of_a_block_that_norms_its_output(family):
    """hook_attn_out / hook_mlp_out are what the residual receives (after the norm on each output);
    attn.hook_out / mlp.hook_out the outputs before it, where the heads' z @ W_O and b_O add up;
    Hugging Face's own post-norms map the one onto the other."""
    hf, tokenizer = random_hf_model(family, seed=2, initializer_range=0.2, attention_bias=True, sliding_window=4)
    ours = from_hf(hf, tokenizer)
    _, cache = ours.run_with_cache(tokens())
    for layer, hf_layer in enumerate(hf.model.layers):
        block = f"blocks.{layer}"
        attn_out, pre_norm = cache[f"{block}.hook_attn_out"], cache[f"{block}.attn.hook_out"]
        torch.testing.assert_close(attn_out, cache[f"{block}.hook_resid_mid"] - cache[f"{block}.hook_resid_pre"],
                                   atol=1e-5, rtol=0)
        torch.testing.assert_close(attn_out, hf_layer.post_attention_layernorm(pre_norm), atol=1e-6, rtol=0)
        attention = ours.blocks[layer].attn
        heads = einsum(cache[f"{block}.attn.hook_z"], attention.W_O, "b p h d, h d o -> b p o") + attention.b_O
        torch.testing.assert_close(heads, pre_norm, atol=1e-5, rtol=0)
        assert not torch.allclose(heads, attn_out, atol=1e-2), "the norm on the output changes it"
        torch.testing.assert_close(cache[f"{block}.hook_mlp_out"],
                                   hf_layer.post_feedforward_layernorm(cache[f"{block}.mlp.hook_out"]), atol=1e-6, rtol=0)


@pytest.mark.parametrize("family", SANDWICH)
@torch.no_grad()
def test_bfloat16_loads_as_hugging_face_loads_it(tmp_path, family):
    """sqrt(d_model) rounded to bfloat16 once, as Gemma's scaled embedding is when made in bfloat16
    (sqrt(48) = 6.93 -> 6.9375): the embeddings equal Hugging Face's bit for bit. The logits of the
    hooked path (eager attention, as Hugging Face's) agree to less than a bfloat16 step (equal, as
    measured); the fast path (SDPA) rounds its scores otherwise, and is within a few steps."""
    directory = save_random_model(family, tmp_path, seed=1, hidden_size=48, head_dim=12, initializer_range=0.2)
    ours = load_model(directory, dtype="bfloat16")
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16, attn_implementation="eager").eval()
    _, cache = ours.run_with_cache(tokens(), names_filter="hook_embed")
    assert torch.equal(cache["hook_embed"], hf.model.embed_tokens(tokens()))
    expected = hf(tokens()).logits.float()
    hooked = ours.run_with_hooks(tokens(), fwd_hooks=[(lambda name: name.endswith("hook_pattern"), lambda x, hook: x)])
    torch.testing.assert_close(hooked.float(), expected, atol=1e-2, rtol=0)
    torch.testing.assert_close(ours(tokens()).float(), expected, atol=0.15, rtol=0)


def test_gemma3s_image_and_text_model_is_refused_from_scratch_in_one_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma3", "architectures":
                                                      ["Gemma3ForConditionalGeneration"]}))
    with pytest.raises(UserError) as refusal:
        load_model(tmp_path, impl="scratch")
    message = str(refusal.value)
    assert "'gemma3'" in message and "gemma3_text" in message and "\n" not in message, message


def with_norm_weights(family: str):
    """(eager Hugging Face model, tokenizer) whose norm weights are drawn away from Gemma's zero
    initialisation, so that a norm's 1 + weight differs from 1 and counts."""
    hf, tokenizer = random_hf_model(family, seed=4, initializer_range=0.2)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "norm" in name:
                param.copy_(0.5 * torch.randn(param.shape, generator=generator))
    return hf, tokenizer


@pytest.mark.parametrize("impl", ["scratch", "transformer_lens"])
@pytest.mark.parametrize("family", SANDWICH)
def test_the_hook_self_test_states_what_holds_where_the_attention_output_is_normed(family, impl):
    """Heads + b_O give the output before the norm (attn.hook_out); hook_attn_out is weight * (heads
    + b_O) / scale with the clean run's scale, on both backends. An analysis taking a head's write
    to be z @ W_O is refused in one line."""
    hf, tokenizer = with_norm_weights(family)
    model = from_hf(hf, tokenizer) if impl == "scratch" else boot_bridge(hf, tokenizer)
    check = check_hooks(model)
    assert check.ok and check.output_normed, check.summary()
    assert check.sum_error < 1e-5 and check.norm_error < 1e-5
    assert "heads + b_O = attn.hook_out" in check.summary()
    reason = check.refusal(HEAD_WRITES, "edge attribution")
    assert reason.startswith(f"edge attribution needs each head's write to the residual to be its z @ W_O, "
                             f"and on this {family} model ({impl}) a norm lies between them"), reason
    assert "\n" not in reason
    assert check.refusal(HEAD_CONTRIBUTIONS, "direct logit attribution") is None  # it applies the frozen norm


def test_the_frozen_norm_check_fails_with_another_norm_s_weight(monkeypatch):
    """Read with the MLP's input norm in place of the attention output's (another weight), the
    post-norm output is not the heads' sum so mapped: the check can fail."""
    hf, tokenizer = with_norm_weights("gemma2")
    model = from_hf(hf, tokenizer)
    monkeypatch.setattr(hook_check, "output_norm", lambda model, layer: model.blocks[layer].ln2)
    check = check_hooks(model)
    assert check.sum_error < 1e-5 and check.norm_error > 1e-2 and not check.ok


def with_trained_sizes():
    """(Hugging Face model, our model) of a random Gemma 3 whose attention outputs are as large as a
    trained Gemma's: the norms on the attention output multiply by up to 1000, so hook_attn_out
    reaches the thousands (trained Gemma 3 270M: an absolute error of 1.2e-3 in float32)."""
    hf, tokenizer = random_hf_model("gemma3_text", seed=4, initializer_range=0.2)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in hf.model.layers:
            weight = layer.post_attention_layernorm.weight
            weight.copy_(1000 * torch.rand(weight.shape, generator=generator))
    return hf, from_hf(hf, tokenizer)


@torch.no_grad()
def test_the_frozen_norm_check_holds_on_attention_outputs_as_large_as_a_trained_gemmas():
    """Recomputed in float64 from the clean run (Hugging Face's own norm weight and eps), the
    post-norm output is the pre-norm one so mapped to float32 rounding relative to its size, while
    its absolute error is beyond the 1e-4 a fixed tolerance allowed: the check holds."""
    hf, model = with_trained_sizes()
    _, cache = model.run_with_cache(hook_check.probe_tokens(model))
    largest, absolute, relative = 0.0, 0.0, 0.0
    for layer, hf_layer in enumerate(hf.model.layers):
        pre = cache[f"blocks.{layer}.attn.hook_out"].double()
        out = cache[f"blocks.{layer}.hook_attn_out"].double()
        rms = (pre.pow(2).mean(-1, keepdim=True) + hf.config.rms_norm_eps).sqrt()
        error = ((1 + hf_layer.post_attention_layernorm.weight.double()) * pre / rms - out).abs().max()
        largest, absolute = max(largest, float(out.abs().max())), max(absolute, float(error))
        relative = max(relative, float(error / out.abs().max()))
    assert largest > 1000 and absolute > 1e-4 and relative < 1e-6, (largest, absolute, relative)
    check = check_hooks(model)
    assert check.ok and check.norm_ok and check.sums_ok, check.summary()
    assert check.norm_error < 1e-6
    assert "(frozen): yes (max error" in check.summary()


def scaled_output_projection(monkeypatch, model, factor: float) -> None:
    """The self-test reads every block's W_O times ``factor``; the model computes with its own."""
    attention = type(model.blocks[0].attn)
    weights = attention.W_O.fget
    monkeypatch.setattr(attention, "W_O", property(lambda attn: factor * weights(attn)))


@pytest.mark.parametrize("gap", ["W_O", "norm weight"])
def test_a_gap_of_a_thousandth_of_the_output_is_caught_on_attention_outputs_as_large(monkeypatch, gap):
    """The tolerance is relative, not loosened: the heads' sum or the frozen norm off by about 0.1%
    of the output fails the check, on outputs in the thousands as on small ones."""
    _, model = with_trained_sizes()
    if gap == "W_O":
        scaled_output_projection(monkeypatch, model, 1.001)
    else:
        weight = hook_check.norm_weight  # every other dimension's: a factor common to all the fitted scale absorbs
        monkeypatch.setattr(hook_check, "norm_weight",
                            lambda norm: weight(norm) * torch.tensor([1.002, 1.0]).repeat(model.cfg.d_model // 2))
    check = check_hooks(model)
    assert not check.ok, check.summary()
    if gap == "W_O":
        assert check.sums_ok is False and 5e-4 < check.sum_error < 2e-3
    else:
        assert check.sums_ok and check.norm_ok is False and 5e-4 < check.norm_error < 2e-3
        assert "(frozen): NO (max error" in check.summary()
