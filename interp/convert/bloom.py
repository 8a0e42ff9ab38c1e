"""The BLOOM converter: a ``BloomForCausalLM`` -> our ``GPTModel`` (DESIGN 3.4).

BLOOM: ALiBi in place of position embeddings, a LayerNorm on the token embeddings, pre-LayerNorm
sequential blocks, GELU-tanh (BLOOM writes the approximation with rounded constants; we use
``gelu_new``, equal to rounding), biases everywhere, a tied unembedding. ``query_key_value`` packs
the projections per head as GPT-NeoX does. ALiBi needs no context limit; ``n_ctx`` is the 2048
tokens BLOOM was trained on (``seq_length`` where the config has it). ``slow_but_exact`` with
``pretraining_tp > 1`` only splits Hugging Face's output projections into slices summed in turn
(the same function in float32), so it is read as the plain projection.
"""

from __future__ import annotations

from interp.convert.common import HFWeights, copy_params, module_names, refuse_options, scratch_model, unpack_qkv
from interp.model import GPTConfig, GPTModel

_LAYER = {
    "ln1": "input_layernorm",
    "attn.out_proj": "self_attention.dense",
    "ln2": "post_attention_layernorm",
    "mlp.fc": "mlp.dense_h_to_4h",
    "mlp.proj": "mlp.dense_4h_to_h",
}
_TRAINED_CONTEXT = 2048


def bloom_to_scratch(source, tokenizer=None) -> GPTModel:
    """A ``GPTModel`` with the weights of an in-memory ``BloomForCausalLM``."""
    hf_cfg = source.config
    refuse_options(hf_cfg, "bloom", {"apply_residual_connection_post_layernorm": False})
    cfg = GPTConfig(
        d_vocab=hf_cfg.vocab_size,
        n_ctx=getattr(hf_cfg, "seq_length", _TRAINED_CONTEXT),
        d_model=hf_cfg.hidden_size,
        n_heads=hf_cfg.n_head,
        n_layers=hf_cfg.n_layer,
        ln_eps=hf_cfg.layer_norm_epsilon,
        act_fn="gelu_new",
        positional_embedding_type="alibi",
        post_embedding_ln=True,
        tie_word_embeddings=bool(hf_cfg.tie_word_embeddings),
        model_name=getattr(hf_cfg, "name_or_path", "") or "bloom",
    )
    hf = HFWeights(source.state_dict())
    names = module_names(cfg, "transformer.word_embeddings", "transformer.ln_f", "transformer.h.", _LAYER)
    names["ln_embed"] = "transformer.word_embeddings_layernorm"
    state = copy_params(hf, names) | unpack_qkv(hf, cfg, "transformer.h.{layer}.self_attention.query_key_value")
    return scratch_model(cfg, state, tokenizer, "bloom", hf)
