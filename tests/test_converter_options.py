"""Every config field of every from-scratch family, flipped one at a time (architecture §3.4): the
converted ``GPTModel`` gives Hugging Face's eager logits (to 1e-4), or the conversion is refused in
one line naming the field and its value. Never a silent difference.

``OPTIONS`` is the table: (family, config overrides, outcome), one line a field. Outcomes:

- ``SAME``: our logits equal Hugging Face's, and the flip changes Hugging Face's forward (other
  weights, or other logits on the same weights by more than 1e-3), so the row tests something;
- ``INERT``: on the same weights Hugging Face's logits do not move beyond rounding (dropouts in
  eval mode, token ids, initialisation, an option only its training or another head reads, a key
  its code ignores, the same function computed in another order), and ours still equal them;
- a string: ``from_hf`` raises a one-line ``UserError`` starting with it (``{family}`` filled in).

``test_every_config_field_of_every_family_is_in_the_table`` reads each family's config class in
the installed transformers, so a field a new release adds fails until it has its line. Keys a
family's own code ignores but real configs carry (a Mistral ``attention_bias``, a Llama
``partial_rotary_factor``) have lines too. Tiny random models (2 layers, d_model 64), no network.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from interp import from_hf
from interp.convert import CONVERTERS
from interp.errors import UserError
from interp.loading import load_checkpoint, save_checkpoint
from interp.random_models import random_hf_model

SAME, INERT = "same", "inert"
SHARP = 0.2  # initializer_range: attention far from uniform, so a changed option shows in the logits


def rope(theta: float = 1e4, **keys) -> dict:
    return {"rope_type": "default", "rope_theta": theta, **keys}


# rope types other than the original, each with what transformers needs to build it
SCALED_ROPES = {
    "linear": dict(factor=2.0),
    "dynamic": dict(factor=2.0),
    "yarn": dict(factor=2.0),
    "longrope": dict(short_factor=[1.0] * 8, long_factor=[2.0] * 8, original_max_position_embeddings=64),
    "llama3": dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64),
    "proportional": dict(partial_rotary_factor=0.5),
}


def scaled_rope(kind: str) -> dict:
    return {"rope_type": kind, "rope_theta": 1e4, **SCALED_ROPES[kind]}


def refused(family: str, option: str) -> str:
    return f"{family} option {option} is not implemented from scratch"


def rows(families, *options) -> list[tuple]:
    return [(family, overrides, outcome) for family in families for overrides, outcome in options]


LLAMA_LAYOUT = ("llama", "mistral", "qwen2", "gemma")
ROTARY = (*LLAMA_LAYOUT, "gpt_neox", "phi")
SANDWICH = ("gemma2", "gemma3_text")  # Gemma's layout with norms after the attention and the MLP too

OPTIONS = [
    # every family: fields no forward reads
    *rows(CONVERTERS, ({"initializer_range": 0.5}, INERT), ({"use_cache": False}, INERT),
          ({"bos_token_id": 5}, INERT), ({"eos_token_id": 5}, INERT), ({"pad_token_id": 5}, INERT),
          ({"vocab_size": 300}, SAME)),
    # GPT-2
    ("gpt2", {"n_positions": 64}, SAME),
    ("gpt2", {"n_embd": 96}, SAME),
    ("gpt2", {"n_layer": 3}, SAME),
    ("gpt2", {"n_head": 8}, SAME),
    ("gpt2", {"n_inner": 96}, SAME),
    ("gpt2", {"activation_function": "gelu"}, SAME),
    ("gpt2", {"activation_function": "silu"}, SAME),
    ("gpt2", {"activation_function": "gelu_pytorch_tanh"}, INERT),  # gelu_new by another formula
    ("gpt2", {"activation_function": "relu"}, "gpt2 activation_function='relu' is not implemented from scratch"),
    ("gpt2", {"resid_pdrop": 0.5}, INERT),
    ("gpt2", {"embd_pdrop": 0.5}, INERT),
    ("gpt2", {"attn_pdrop": 0.5}, INERT),
    ("gpt2", {"layer_norm_epsilon": 0.5}, SAME),
    ("gpt2", {"summary_type": "mean"}, INERT),  # summary_*: GPT2DoubleHeadsModel's head
    ("gpt2", {"summary_use_proj": False}, INERT),
    ("gpt2", {"summary_activation": "tanh"}, INERT),
    ("gpt2", {"summary_proj_to_labels": False}, INERT),
    ("gpt2", {"summary_first_dropout": 0.5}, INERT),
    ("gpt2", {"scale_attn_weights": False}, SAME),
    ("gpt2", {"scale_attn_by_inverse_layer_idx": True}, SAME),
    ("gpt2", {"scale_attn_weights": False, "scale_attn_by_inverse_layer_idx": True}, SAME),
    ("gpt2", {"reorder_and_upcast_attn": True}, INERT),  # the same scores, computed in float32
    ("gpt2", {"add_cross_attention": True}, refused("gpt2", "add_cross_attention=True")),
    ("gpt2", {"tie_word_embeddings": False}, SAME),
    # the rotary families: the Llama layout, GPT-NeoX, Phi
    *rows(ROTARY, ({"hidden_size": 96}, SAME), ({"intermediate_size": 96}, SAME), ({"num_hidden_layers": 3}, SAME),
          ({"num_attention_heads": 8}, SAME), ({"max_position_embeddings": 256}, INERT),
          ({"attention_dropout": 0.5}, INERT), ({"rope_parameters": rope(100.0)}, SAME),
          ({"hidden_act": "relu"}, "{family} hidden_act='relu' is not implemented from scratch"),
          ({"rope_parameters": scaled_rope("linear")}, "{family} rope_type='linear' is not implemented"),
          ({"rope_parameters": scaled_rope("llama3")}, SAME)),
    # the Llama layout: Llama, Mistral, Qwen2, Gemma
    *rows(LLAMA_LAYOUT, ({"num_key_value_heads": 4}, SAME), ({"head_dim": 32}, SAME), ({"rms_norm_eps": 0.5}, SAME),
          ({"rope_parameters": rope(partial_rotary_factor=0.5)}, INERT),  # their code rotates whole heads
          *(({"rope_parameters": scaled_rope(kind)}, f"{{family}} rope_type='{kind}' is not implemented")
            for kind in SCALED_ROPES if kind not in ("linear", "llama3"))),
    ("llama", {"hidden_act": "gelu"}, SAME),
    ("llama", {"mlp_bias": True}, SAME),
    ("llama", {"num_key_value_heads": 1}, SAME),
    ("llama", {"pretraining_tp": 2}, INERT),
    ("llama", {"tie_word_embeddings": True}, SAME),
    ("llama", {"attention_bias": True}, SAME),
    ("mistral", {"hidden_act": "gelu"}, SAME),
    ("mistral", {"tie_word_embeddings": True}, SAME),
    ("mistral", {"sliding_window": 4}, SAME),
    ("mistral", {"attention_bias": True}, INERT),  # not read by Mistral's code
    ("mistral", {"mlp_bias": True}, INERT),
    ("qwen2", {"hidden_act": "gelu"}, SAME),
    ("qwen2", {"tie_word_embeddings": True}, SAME),
    ("qwen2", {"attention_bias": True}, INERT),  # Qwen2's q/k/v always have biases, its o never
    ("qwen2", {"mlp_bias": True}, INERT),
    ("qwen2", {"use_sliding_window": True}, INERT),  # the default window, 4096, spans the context
    ("qwen2", {"sliding_window": 4}, INERT),  # without use_sliding_window
    ("qwen2", {"max_window_layers": 0}, INERT),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 0}, SAME),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1},
     "qwen2 with a sliding window on some layers only"),
    ("qwen2", {"layer_types": ["full_attention", "full_attention"]}, INERT),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 4, "layer_types": ["full_attention", "sliding_attention"]},
     "qwen2 with a sliding window on some layers only"),
    ("gemma", {"hidden_act": "silu"}, SAME),
    ("gemma", {"tie_word_embeddings": False}, SAME),
    ("gemma", {"attention_bias": True}, SAME),
    ("gemma", {"mlp_bias": True}, INERT),
    ("gemma", {"num_key_value_heads": 2}, SAME),
    ("gemma", {"use_bidirectional_attention": True}, refused("gemma", "use_bidirectional_attention=True")),
    # Gemma 2 and 3 (interp.random_models: layer 0 local, layer 1 global)
    *rows(SANDWICH, ({"hidden_size": 96}, SAME), ({"intermediate_size": 96}, SAME), ({"num_hidden_layers": 3}, SAME),
          ({"num_attention_heads": 8}, SAME), ({"num_key_value_heads": 4}, SAME), ({"head_dim": 32}, SAME),
          ({"rms_norm_eps": 0.5}, SAME), ({"max_position_embeddings": 256}, INERT), ({"attention_dropout": 0.5}, INERT),
          ({"hidden_activation": "silu"}, SAME),
          ({"hidden_activation": "relu"}, "{family} hidden_activation='relu' is not implemented from scratch"),
          ({"tie_word_embeddings": False}, SAME), ({"attention_bias": True}, SAME),
          ({"query_pre_attn_scalar": 64}, SAME), ({"sliding_window": 4}, SAME),  # layer 0's window
          ({"sliding_window": 4, "layer_types": ["full_attention", "sliding_attention"]}, SAME),  # layer 1's
          ({"final_logit_softcapping": 3.0}, SAME),
          ({"use_bidirectional_attention": True}, refused("{family}", "use_bidirectional_attention=True"))),
    ("gemma2", {"final_logit_softcapping": None}, SAME),  # its default caps at 30
    ("gemma2", {"attn_logit_softcapping": 2.0}, SAME),
    ("gemma2", {"attn_logit_softcapping": None}, SAME),  # its default caps at 50
    ("gemma2", {"rope_parameters": rope(100.0)}, SAME),
    ("gemma2", {"rope_parameters": scaled_rope("linear")}, "gemma2 rope_type='linear' is not implemented"),
    ("gemma3_text", {"attn_logit_softcapping": 2.0}, INERT),  # Gemma 3's attention never reads it
    ("gemma3_text", {"sliding_window_pattern": 3}, SAME),  # both layers local: layer 1's RoPE base is 10,000
    ("gemma3_text", {"rope_parameters": {"sliding_attention": rope(100.0), "full_attention": rope(1e6)}}, SAME),
    ("gemma3_text", {"rope_parameters": {"sliding_attention": rope(1e4), "full_attention": rope(100.0)}}, SAME),
    ("gemma3_text", {"rope_parameters": {"sliding_attention": rope(1e4),
                                         "full_attention": {**scaled_rope("linear"), "rope_theta": 1e6}}},
     "gemma3_text rope_type='linear' is not implemented from scratch on its full_attention layers"),
    # GPT-NeoX and Phi
    *rows(("gpt_neox", "phi"), ({"layer_norm_eps": 0.5}, SAME), ({"tie_word_embeddings": True}, SAME),
          ({"rope_parameters": rope(partial_rotary_factor=1.0)}, SAME)),
    ("gpt_neox", {"hidden_act": "silu"}, SAME),
    ("gpt_neox", {"hidden_dropout": 0.5}, INERT),
    ("gpt_neox", {"classifier_dropout": 0.5}, INERT),
    ("gpt_neox", {"use_parallel_residual": False}, SAME),
    ("gpt_neox", {"attention_bias": False}, SAME),
    ("gpt_neox", {"is_decoder": True}, INERT),
    ("gpt_neox", {"head_dim": 8}, SAME),  # its code: the rotary dims only
    ("phi", {"num_key_value_heads": 2}, SAME),
    ("phi", {"resid_pdrop": 0.5}, INERT),
    ("phi", {"embd_pdrop": 0.5}, INERT),
    ("phi", {"hidden_act": "gelu"}, SAME),
    ("phi", {"qk_layernorm": True}, refused("phi", "qk_layernorm=True")),
    ("phi", {"head_dim": 32}, SAME),
    # BLOOM
    ("bloom", {"hidden_size": 96}, SAME),
    ("bloom", {"n_layer": 3}, SAME),
    ("bloom", {"n_head": 8}, SAME),
    ("bloom", {"n_head": 6, "hidden_size": 48}, SAME),  # ALiBi's slopes past a power of two
    ("bloom", {"layer_norm_epsilon": 0.5}, SAME),
    ("bloom", {"apply_residual_connection_post_layernorm": True},
     refused("bloom", "apply_residual_connection_post_layernorm=True")),
    ("bloom", {"hidden_dropout": 0.5}, INERT),
    ("bloom", {"attention_dropout": 0.5}, INERT),
    ("bloom", {"pretraining_tp": 2}, INERT),
    ("bloom", {"slow_but_exact": True}, INERT),
    ("bloom", {"pretraining_tp": 2, "slow_but_exact": True}, INERT),  # sliced projections, summed in turn
    ("bloom", {"tie_word_embeddings": False}, SAME),
]


def row_id(row: tuple) -> str:
    family, overrides, _ = row
    shown = {k: ",".join(str(x) for x in v.values() if not isinstance(x, list)) if isinstance(v, dict) else v
             for k, v in overrides.items()}
    return f"{family}-" + "-".join(f"{k}={v}" for k, v in shown.items())


def tiny(family: str, **overrides):
    """An eager Hugging Face model of ``family`` (``interp.random_models``' tiny shape; BLOOM, which
    it does not make, of the same size) with ``overrides`` in its config, seeded."""
    if family != "bloom":
        return random_hf_model(family, seed=0, **({"initializer_range": SHARP} | overrides))[0]
    config = AutoConfig.for_model("bloom", **({"vocab_size": 320, "hidden_size": 64, "n_layer": 2, "n_head": 4,
                                               "initializer_range": SHARP} | overrides))
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()


@functools.cache
def default(family: str):
    return tiny(family)


def tokens(vocab: int = 257) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(0))


def parameter_shapes(model) -> set:
    return {(name, tuple(p.shape)) for name, p in model.named_parameters()}  # a tied weight once


@torch.no_grad()
def moves_hugging_faces_forward(family: str, flipped) -> bool:
    """Whether a config change alters Hugging Face's model: other weights (names or shapes; an
    untied unembedding is one more), or other logits on the default model's weights (by more
    than 1e-3; less than 1e-4, the tolerance of every comparison here, is no change: rounding;
    in between is refused as unclear)."""
    base = default(family)
    if parameter_shapes(base) != parameter_shapes(flipped):
        return True
    torch.manual_seed(0)
    same_weights = AutoModelForCausalLM.from_config(flipped.config, attn_implementation="eager").eval()
    same_weights.load_state_dict(base.state_dict())
    moved = (same_weights(tokens()).logits - base(tokens()).logits).abs().max().item()
    assert not 1e-4 <= moved <= 1e-3, f"unclear whether the change moves the forward: {moved:.2e}"
    return moved > 1e-3


@pytest.mark.parametrize("family, overrides, outcome", OPTIONS, ids=[row_id(row) for row in OPTIONS])
@torch.no_grad()
def test_a_config_field_gives_hugging_faces_logits_or_a_one_line_refusal(family, overrides, outcome):
    hf = tiny(family, **overrides)
    if outcome not in (SAME, INERT):
        with pytest.raises(UserError) as refusal:
            from_hf(hf)
        message = str(refusal.value)
        assert message.startswith(outcome.format(family=family)) and "\n" not in message, message
        return
    torch.testing.assert_close(from_hf(hf)(tokens()), hf(tokens()).logits, atol=1e-4, rtol=0)
    assert moves_hugging_faces_forward(family, hf) == (outcome == SAME)


def config_fields(family: str) -> set[str]:
    """The fields the family's config class declares (not the ones every config shares)."""
    return set(type(AutoConfig.for_model(family)).__annotations__)


@pytest.mark.parametrize("family", sorted(CONVERTERS))
def test_every_config_field_of_every_family_is_in_the_table(family):
    covered = {field for row_family, overrides, _ in OPTIONS if row_family == family for field in overrides}
    assert config_fields(family) - covered == set(), "give each field its line in OPTIONS"
    if family in ROTARY:
        kinds = {o["rope_parameters"]["rope_type"] for f, o, _ in OPTIONS if f == family and "rope_parameters" in o}
        assert "default" in kinds and len(kinds) > 1, "the base and at least one scaled RoPE"
    if family == "llama":
        assert set(ROPE_INIT_FUNCTIONS) <= set(SCALED_ROPES), "every rope type transformers has is in the table"


@pytest.mark.parametrize("family", sorted(CONVERTERS))
def test_a_weight_the_converter_does_not_read_is_refused(family):
    """A tensor of the Hugging Face state dict that nothing maps onto our model (here a gain added
    to the first block) is refused in one line naming it, as a missing one is."""
    hf = tiny(family)
    block = next(name for name, _ in hf.named_modules() if name.endswith((".h.0", ".layers.0")))
    hf.get_submodule(block).register_parameter("gain", nn.Parameter(torch.ones(4)))
    with pytest.raises(UserError, match=rf"^{family} weights {block}\.gain have no place in the from-scratch model"):
        from_hf(hf)


def test_an_unembedding_called_tied_but_not_shared_is_refused():
    """A GPT-2 whose config says tied but whose lm_head is its own tensor runs Hugging Face's
    forward with that lm_head: reading only the embedding would silently differ."""
    hf = tiny("gpt2")
    hf.lm_head.weight = nn.Parameter(hf.lm_head.weight.detach().clone() * 2)
    with pytest.raises(UserError, match=r"^gpt2 weights lm_head\.weight have no place"):
        from_hf(hf)


def test_a_tied_unembedding_is_read_once():
    """Tied: lm_head is the embedding under a second name, so no refusal, and our model ties them."""
    hf = tiny("gpt2")
    assert hf.lm_head.weight.data_ptr() == hf.transformer.wte.weight.data_ptr()
    ours = from_hf(hf)
    assert ours.cfg.tie_word_embeddings and not hasattr(ours, "lm_head")


@torch.no_grad()
def test_gpt2_s_attention_scale_and_untied_unembedding_survive_a_checkpoint(tmp_path):
    """The knobs these options set are saved with our checkpoint: reloaded, the model still gives
    Hugging Face's logits (a knob lost on the way would be the same silent difference)."""
    hf = tiny("gpt2", tie_word_embeddings=False, scale_attn_weights=False, scale_attn_by_inverse_layer_idx=True)
    save_checkpoint(from_hf(hf), tmp_path)
    torch.testing.assert_close(load_checkpoint(tmp_path)(tokens()), hf(tokens()).logits, atol=1e-4, rtol=0)
