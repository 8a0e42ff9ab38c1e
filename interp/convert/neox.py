"""The GPT-NeoX (Pythia) converter: a ``GPTNeoXForCausalLM`` -> our ``GPTModel`` (DESIGN 3.4).

GPT-NeoX: LayerNorm, partial rotary (the first ``rotary_pct`` of each head's dims), attention and
MLP in parallel off the same residual (``use_parallel_residual``), each with its own LayerNorm,
exact-erf GELU, biases where ``attention_bias`` says (always in the MLP), an untied unembedding.
``query_key_value`` packs the three projections per head: its output axis is (head, [query, key,
value], d_head). A head is ``hidden_size / num_attention_heads`` wide; a ``head_dim`` in the
config only sets how many dims the rotary embedding spans, as in Hugging Face's code.
"""

from __future__ import annotations

from interp.convert.common import HFWeights, activation, copy_params, module_names, rotary, scratch_model, shape, unpack_qkv
from interp.model import GPTConfig, GPTModel

_LAYER = {
    "ln1": "input_layernorm",
    "attn.out_proj": "attention.dense",
    "ln2": "post_attention_layernorm",
    "mlp.fc": "mlp.dense_h_to_4h",
    "mlp.proj": "mlp.dense_4h_to_h",
}


def gpt_neox_to_scratch(source, tokenizer=None) -> GPTModel:
    """A ``GPTModel`` with the weights of an in-memory ``GPTNeoXForCausalLM``."""
    hf_cfg = source.config
    fields = shape(hf_cfg, "gpt_neox") | dict(d_head=hf_cfg.hidden_size // hf_cfg.num_attention_heads)
    rotary_head = getattr(hf_cfg, "head_dim", None) or fields["d_head"]
    cfg = GPTConfig(
        **fields,
        ln_eps=hf_cfg.layer_norm_eps,
        act_fn=activation(hf_cfg.hidden_act, "gpt_neox"),
        parallel_attn_mlp=hf_cfg.use_parallel_residual,
        qkv_bias=hf_cfg.attention_bias,
        attn_out_bias=hf_cfg.attention_bias,
        **rotary(hf_cfg, "gpt_neox", rotary_head, partial=True),
        default_prepend_bos=False,
    )
    hf = HFWeights(source.state_dict())
    names = module_names(cfg, "gpt_neox.embed_in", "gpt_neox.final_layer_norm", "gpt_neox.layers.", _LAYER)
    state = copy_params(hf, names) | unpack_qkv(hf, cfg, "gpt_neox.layers.{layer}.attention.query_key_value")
    return scratch_model(cfg, state, tokenizer, "gpt_neox", hf)

