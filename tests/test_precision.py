"""The mixed precision (``GPTModel.set_precision("mixed")``, ``interp.precision``): the linear maps'
products run in bfloat16 with float32 accumulation, everything the analyses read stays float32."""

from __future__ import annotations

import argparse

import pytest
import torch
import torch.nn.functional as F

from analyses.cli.args import add_model_args, load_cli_model
from analyses.components.decompose import decompose_residual
from analyses.core.hook_check import check_hooks
from analyses.report.meta import model_meta
from interp import GPTConfig, GPTModel, from_hf, load_model
from interp.errors import UserError
from interp.precision import Linear
from interp.random_models import random_hf_model, random_like

# a Llama-like and a GPT-2-like block: gated MLP, rotary, grouped keys and values, no biases; and
# LayerNorm, learned positions, biases, an untied unembedding
SHAPES = {
    "llama": dict(normalization_type="RMS", act_fn="silu", gated_mlp=True, positional_embedding_type="rotary",
                  n_key_value_heads=2, qkv_bias=False, attn_out_bias=False, mlp_bias=False),
    "gpt2": dict(tie_word_embeddings=False, unembed_bias=True),
}
TOLERANCE = 0.02  # the mixed logits' largest distance from float32's, relative to the logits' largest size


def tiny(shape: str, seed: int = 0) -> tuple[GPTModel, torch.Tensor]:
    """A random-init model (2 layers, d_model 64, 4 heads) in eval mode and 3 prompts of 12 tokens."""
    torch.manual_seed(seed)
    cfg = GPTConfig(d_vocab=300, n_ctx=16, d_model=64, n_heads=4, n_layers=2, **SHAPES[shape])
    model = GPTModel(cfg).eval()
    for param in model.parameters():  # larger than nn.Linear's init, so the logits spread out
        torch.nn.init.normal_(param, std=0.3 if param.ndim > 1 else 0.1)
    return model, torch.randint(0, cfg.d_vocab, (3, 12), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("shape", SHAPES)
def test_mixed_logits_are_near_float32_but_not_equal(shape):
    model, tokens = tiny(shape)
    with torch.no_grad():
        exact = model(tokens)
        model.set_precision("mixed")
        mixed = model(tokens)
        model.set_precision("float32")
        again = model(tokens)
    assert mixed.dtype == torch.float32
    distance = (mixed - exact).abs().max() / exact.abs().max()
    assert 0 < distance < TOLERANCE
    assert torch.equal(again, exact)  # back to float32: the same bits as before


def test_the_linear_maps_multiply_in_bfloat16_and_the_unembedding_in_float32(monkeypatch):
    model, tokens = tiny("gpt2")
    seen = []

    def spy(x, weight, bias=None):
        seen.append((x.dtype, weight.dtype, None if bias is None else bias.dtype))
        return linear(x, weight, bias)

    linear = F.linear
    monkeypatch.setattr(F, "linear", spy)
    model.set_precision("mixed")
    with torch.no_grad():
        model(tokens)
    low = (torch.bfloat16, torch.bfloat16, None)  # the bias is added in float32 after the product
    # per layer: query, key, value and output projections, the MLP's fc and proj; then the untied unembedding
    assert seen == [low] * (6 * model.cfg.n_layers) + [(torch.float32, torch.float32, torch.float32)]


def test_bfloat16_products_accumulate_in_float32():
    """4096 products of ones: a bfloat16 accumulator stalls at 256 (256 + 1 rounds to 256 with 8
    bits of mantissa); a float32 one reaches 4096, which bfloat16 represents exactly."""
    layer = Linear(4096, 3, bias=False)
    torch.nn.init.ones_(layer.weight)
    layer.mixed = True
    with torch.no_grad():
        out = layer(torch.ones(2, 4096))
    assert out.dtype == torch.float32
    assert torch.equal(out, torch.full((2, 3), 4096.0))


@pytest.mark.parametrize("shape", SHAPES)
def test_hooks_hand_float32_and_the_residual_is_not_rounded(shape):
    model, tokens = tiny(shape)
    with torch.no_grad():
        _, exact = model.run_with_cache(tokens)
        model.set_precision("mixed")
        _, cache = model.run_with_cache(tokens)
    assert set(cache.keys()) == set(exact.keys())
    assert {name: value.dtype for name, value in cache.items()} == {name: torch.float32 for name in cache.keys()}
    assert torch.equal(cache["blocks.0.hook_resid_pre"], exact["blocks.0.hook_resid_pre"])  # embeddings untouched
    assert not torch.equal(cache["blocks.0.attn.hook_q"], exact["blocks.0.attn.hook_q"])  # a bfloat16 product
    resid = cache["blocks.1.hook_resid_post"]
    assert not torch.equal(resid, resid.to(torch.bfloat16).float())  # the residual keeps float32's bits
    pattern = cache["blocks.1.attn.hook_pattern"]
    assert not torch.equal(pattern, pattern.to(torch.bfloat16).float())  # so do the scores and the softmax


def test_per_head_inputs_run_in_the_same_precision_as_the_shared_forward():
    model, tokens = tiny("llama")
    model.set_precision("mixed")
    with torch.no_grad():
        shared = model(tokens)
        model.set_use_split_qkv_input(True)
        split = model(tokens)
        model.set_precision("float32")
        exact = model(tokens)
    # equal copies give the shared forward's products, up to the order of the float32 sums
    assert (split - shared).abs().max() < (shared - exact).abs().max() / 10


def test_mixed_follows_an_in_place_edit_and_gradients_reach_the_float32_weights():
    model, tokens = tiny("llama")
    model.set_precision("mixed")
    with torch.no_grad():
        before = model(tokens)
        model.blocks[1].mlp.proj.weight.mul_(0.5)  # in place: the next products must see it
        after = model(tokens)
        model.set_precision("float32")
        exact = model(tokens)
    assert (after - before).abs().max() > 10 * (after - exact).abs().max()
    model.set_precision("mixed")
    model(tokens, return_type="loss").backward()
    weight = model.blocks[0].attn.W_query.weight
    assert weight.grad is not None and weight.grad.dtype == torch.float32 and weight.grad.abs().sum() > 0


def _zero_head_write(model, layer: int, head: int) -> None:
    """Zero head ``head``'s columns of layer ``layer``'s W_O through ``.data``, as an ablation script
    does (an edit that leaves the parameter's version counter as it was)."""
    width = model.cfg.d_model // model.cfg.n_heads
    model.blocks[layer].attn.out_proj.weight.data[:, head * width:(head + 1) * width] = 0.0


@pytest.mark.parametrize("edit", [
    lambda model: _zero_head_write(model, 1, 4),
    lambda model: model.blocks[0].attn.W_value.weight.data.mul_(0.5),
], ids=["W_O head zeroed", "W_V halved"])
def test_mixed_follows_a_weight_edit_through_data(edit):
    """The toy in mixed precision, run, edited through ``.data``, run again: the logits equal those of
    a model loaded fresh in mixed precision with the same edit, never run before it (and differ from
    the unedited logits)."""
    used = load_model("toy", precision="mixed")
    tokens = torch.randint(0, used.cfg.d_vocab, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = used(tokens)
        edit(used)
        after = used(tokens)
        fresh = load_model("toy", precision="mixed")
        edit(fresh)
        want = fresh(tokens)
    assert torch.equal(after, want)
    assert (after - before).abs().max() > 0.01


def test_the_precision_flag_reaches_the_model_and_mixed_is_float32_weights_only():
    parser = argparse.ArgumentParser()
    add_model_args(parser)
    model = load_cli_model(parser.parse_args(["--model", "toy", "--precision", "mixed"]))
    assert model.cfg.precision == "mixed"
    assert model.blocks[0].attn.W_query.mixed and model.blocks[1].attn.out_proj.mixed  # the toy: attention only
    assert model.embed.weight.dtype == torch.float32
    assert model_meta(model, "toy")["precision"] == "mixed"  # what every output's meta.json records
    assert load_cli_model(parser.parse_args(["--model", "toy"])).blocks[0].attn.W_query.mixed is False
    with pytest.raises(SystemExit):
        parser.parse_args(["--precision", "half"])
    with pytest.raises(UserError, match=r"dtype bfloat16") as refused:
        load_model("toy", dtype="bfloat16", precision="mixed")
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("options", [dict(impl="transformer_lens"), dict(device_map="auto")])
def test_a_bridge_refuses_mixed_in_one_line(options):
    with pytest.raises(UserError, match="only the from-scratch model") as refused:
        load_model("gpt2", precision="mixed", **options)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("shape", SHAPES)
def test_the_hook_self_test_passes_under_mixed_precision(shape):
    """The heads' z @ W_O summed in float32 differ from hook_attn_out, a bfloat16 product, by its
    rounding: the self-test allows it (before, it refused path patching on a mixed model)."""
    model, _ = tiny(shape)
    model.set_precision("mixed")
    check = check_hooks(model)
    assert check.ok, check.summary()


@pytest.mark.parametrize("shape", SHAPES)
def test_the_residual_decomposition_accepts_a_mixed_model(shape):
    """Its parts (the heads' z @ W_O summed in float32) add up to the final residual within the
    bfloat16 products' rounding (before, DLA and the report refused a mixed model)."""
    model, tokens = tiny(shape)
    model.set_precision("mixed")
    parts = decompose_residual(model, tokens)
    assert parts.components["component"].str.startswith("L1H").sum() == model.cfg.n_heads


def test_a_null_model_runs_in_the_models_precision():
    hf_model, tokenizer = random_hf_model("llama", n_ctx=16, hidden_size=64, num_attention_heads=4,
                                          num_key_value_heads=2, intermediate_size=128, num_hidden_layers=2)
    model = from_hf(hf_model, tokenizer)
    model.set_precision("mixed")
    null = random_like(model)
    assert null.cfg.precision == "mixed" and null.blocks[0].mlp.fc.mixed
