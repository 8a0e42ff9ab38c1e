"""The GPT-2 converter: a ``transformers`` ``GPT2LMHeadModel`` -> our ``GPTModel`` (DESIGN 3.4).

GPT-2 is what ``GPTConfig``'s defaults describe. HF's ``Conv1D`` stores weights as (in, out);
``nn.Linear`` as (out, in), hence the transposes. ``c_attn`` packs query, key and value side by
side on the output axis. The options that change the forward are read (an untied ``lm_head``,
unscaled or layer-scaled attention scores); ``reorder_and_upcast_attn`` only changes the order
and precision Hugging Face computes the scores in (the same function in float32), so it is read
as the plain attention.
"""

from __future__ import annotations

import torch

from interp.convert.common import HFWeights, activation, refuse_options, scratch_model
from interp.model import GPTConfig, GPTModel

# GPT-2 options our architecture does not implement: refuse rather than silently differ.
_UNSUPPORTED = {"add_cross_attention": False}


def gpt2_to_scratch(source, tokenizer=None) -> GPTModel:
    """A ``GPTModel`` with the weights of ``source``, an in-memory ``GPT2LMHeadModel``
    (``interp.load_model`` reads directories and hub ids); ``tokenizer``: its HF tokenizer."""
    hf_cfg = source.config
    refuse_options(hf_cfg, "gpt2", _UNSUPPORTED)
    cfg = GPTConfig(
        d_vocab=hf_cfg.vocab_size,
        n_ctx=hf_cfg.n_positions,
        d_model=hf_cfg.n_embd,
        n_heads=hf_cfg.n_head,
        n_layers=hf_cfg.n_layer,
        d_mlp=hf_cfg.n_inner or 4 * hf_cfg.n_embd,
        ln_eps=hf_cfg.layer_norm_epsilon,
        act_fn=activation(hf_cfg.activation_function, "gpt2", "activation_function"),
        use_attn_scale=hf_cfg.scale_attn_weights,
        scale_attn_by_inverse_layer_idx=hf_cfg.scale_attn_by_inverse_layer_idx,
        tie_word_embeddings=hf_cfg.tie_word_embeddings,
        model_name=getattr(hf_cfg, "name_or_path", "") or "gpt2",
    )
    hf = HFWeights(source.state_dict())
    return scratch_model(cfg, _convert_state_dict(hf, cfg), tokenizer, "gpt2", hf)


def _convert_state_dict(hf: HFWeights, cfg: GPTConfig) -> dict[str, torch.Tensor]:
    ours = {
        "embed.weight": hf["transformer.wte.weight"],
        "pos_embed.weight": hf["transformer.wpe.weight"],
        "ln_final.weight": hf["transformer.ln_f.weight"],
        "ln_final.bias": hf["transformer.ln_f.bias"],
    }
    for layer in range(cfg.n_layers):
        src, dst = f"transformer.h.{layer}.", f"blocks.{layer}."
        q_w, k_w, v_w = hf[src + "attn.c_attn.weight"].T.chunk(3, dim=0)
        q_b, k_b, v_b = hf[src + "attn.c_attn.bias"].chunk(3, dim=0)
        for name, weight, bias in (("W_query", q_w, q_b), ("W_key", k_w, k_b), ("W_value", v_w, v_b)):
            ours[dst + f"attn.{name}.weight"] = weight
            ours[dst + f"attn.{name}.bias"] = bias
        ours[dst + "attn.out_proj.weight"] = hf[src + "attn.c_proj.weight"].T
        ours[dst + "attn.out_proj.bias"] = hf[src + "attn.c_proj.bias"]
        for ln_src, ln_dst in (("ln_1", "ln1"), ("ln_2", "ln2")):
            ours[dst + f"{ln_dst}.weight"] = hf[src + f"{ln_src}.weight"]
            ours[dst + f"{ln_dst}.bias"] = hf[src + f"{ln_src}.bias"]
        ours[dst + "mlp.fc.weight"] = hf[src + "mlp.c_fc.weight"].T
        ours[dst + "mlp.fc.bias"] = hf[src + "mlp.c_fc.bias"]
        ours[dst + "mlp.proj.weight"] = hf[src + "mlp.c_proj.weight"].T
        ours[dst + "mlp.proj.bias"] = hf[src + "mlp.c_proj.bias"]
    if not cfg.tie_word_embeddings:
        ours["lm_head.weight"] = hf["lm_head.weight"]
    return ours
