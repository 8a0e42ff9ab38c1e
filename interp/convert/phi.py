"""The Phi converter: a ``PhiForCausalLM`` (Phi-1, Phi-1.5, Phi-2) -> our ``GPTModel`` (DESIGN 3.4).

Phi: LayerNorm, partial rotary (``partial_rotary_factor`` of each head's dims), attention and MLP
in parallel off one shared LayerNorm, GELU-tanh, biases everywhere, an untied unembedding with a
bias. Our parallel block has a norm per branch: both get the shared norm's weights, so they compute
the same normalised input Phi feeds to both. The unembedding is always converted untied (a tied
Phi's ``lm_head`` still has a bias of its own).
"""

from __future__ import annotations

from interp.convert.common import (HFWeights, activation, copy_params, module_names, refuse_options, rotary,
                              scratch_model, shape)
from interp.model import GPTConfig, GPTModel

_LAYER = {
    "ln1": "input_layernorm",
    "attn.W_query": "self_attn.q_proj",
    "attn.W_key": "self_attn.k_proj",
    "attn.W_value": "self_attn.v_proj",
    "attn.out_proj": "self_attn.dense",
    "ln2": "input_layernorm",  # the shared norm, again
    "mlp.fc": "mlp.fc1",
    "mlp.proj": "mlp.fc2",
}


def phi_to_scratch(source, tokenizer=None) -> GPTModel:
    """A ``GPTModel`` with the weights of an in-memory ``PhiForCausalLM``."""
    hf_cfg = source.config
    refuse_options(hf_cfg, "phi", {"qk_layernorm": False})
    fields = shape(hf_cfg, "phi") | dict(tie_word_embeddings=False)
    cfg = GPTConfig(
        **fields,
        ln_eps=hf_cfg.layer_norm_eps,
        act_fn=activation(hf_cfg.hidden_act, "phi"),
        parallel_attn_mlp=True,
        unembed_bias=True,
        **rotary(hf_cfg, "phi", fields["d_head"], partial=True),
        default_prepend_bos=False,
    )
    names = module_names(cfg, "model.embed_tokens", "model.final_layernorm", "model.layers.", _LAYER)
    hf = HFWeights(source.state_dict())
    return scratch_model(cfg, copy_params(hf, names), tokenizer, "phi", hf)
