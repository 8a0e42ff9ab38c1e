"""The Llama-layout converters: Llama, Mistral, Qwen2 and Gemma -> our ``GPTModel`` (DESIGN 3.4).

The four share one weight layout (``model.layers.{l}.self_attn.{q,k,v,o}_proj``,
``mlp.{gate,up,down}_proj``, ``input_layernorm``/``post_attention_layernorm``, ``model.norm``,
``lm_head``) and one architecture: pre-RMSNorm blocks of grouped-query attention with rotary
positions, then a gated MLP. They differ only in knobs:

- Llama: SwiGLU; biases only where ``attention_bias`` / ``mlp_bias`` say.
- Mistral: as Llama, with a sliding window over every layer; never biases.
- Qwen2: as Llama, with q/k/v biases (none on the output projection, none in the MLP), and a
  sliding window where ``use_sliding_window`` gives every layer one (some layers only: refused).
- Gemma: GeGLU (tanh GELU), embeddings times sqrt(d_model), a head width of its own, a tied
  unembedding, attention biases where ``attention_bias`` says (none in the MLP), and an RMSNorm
  that multiplies by ``1 + weight`` (folded here into the weight, so our norm computes
  ``(1 + weight) * x`` exactly as Gemma's does in float32).

Each reads a bias flag only where its Hugging Face code does (Mistral's ignores ``attention_bias``,
Qwen2's and Gemma's ``mlp_bias``), and all four rotate every dim of a head (``partial_rotary_factor``
is not read by their code, so not here).
"""

from __future__ import annotations

from interp.errors import UserError
from interp.convert.common import (HFWeights, activation, copy_params, module_names, refuse_options, rotary,
                              scratch_model, shape)
from interp.model import GPTConfig, GPTModel

_LAYER = {
    "ln1": "input_layernorm",
    "attn.W_query": "self_attn.q_proj",
    "attn.W_key": "self_attn.k_proj",
    "attn.W_value": "self_attn.v_proj",
    "attn.out_proj": "self_attn.o_proj",
    "ln2": "post_attention_layernorm",
    "mlp.gate": "mlp.gate_proj",
    "mlp.fc": "mlp.up_proj",
    "mlp.proj": "mlp.down_proj",
}
_NORMS = ("ln1", "ln2")


def llama_to_scratch(source, tokenizer=None) -> GPTModel:
    """A ``GPTModel`` with the weights of an in-memory ``LlamaForCausalLM``."""
    hf_cfg = source.config
    cfg = _llama_config(hf_cfg, "llama", qkv_bias=hf_cfg.attention_bias, attn_out_bias=hf_cfg.attention_bias,
                        mlp_bias=hf_cfg.mlp_bias)
    return _convert(source, tokenizer, cfg)


def mistral_to_scratch(source, tokenizer=None) -> GPTModel:
    """A ``GPTModel`` with the weights of an in-memory ``MistralForCausalLM`` (its sliding window
    over every layer included)."""
    hf_cfg = source.config
    cfg = _llama_config(hf_cfg, "mistral", sliding_window=_window(hf_cfg))
    return _convert(source, tokenizer, cfg)


def qwen2_to_scratch(source, tokenizer=None) -> GPTModel:
    """A ``GPTModel`` with the weights of an in-memory ``Qwen2ForCausalLM`` (q/k/v biases; its
    sliding window where every layer has it)."""
    hf_cfg = source.config
    sliding = [kind == "sliding_attention" for kind in hf_cfg.layer_types]
    window = _window(hf_cfg) if any(sliding) else None
    if window is not None and not all(sliding):
        raise UserError(f"qwen2 with a sliding window on some layers only (layer_types={hf_cfg.layer_types}, "
                        f"sliding_window={hf_cfg.sliding_window}) is not implemented from scratch; "
                        "use impl='transformer_lens'")
    return _convert(source, tokenizer, _llama_config(hf_cfg, "qwen2", qkv_bias=True, sliding_window=window,
                                                     default_prepend_bos=False))


def gemma_to_scratch(source, tokenizer=None) -> GPTModel:
    """A ``GPTModel`` with the weights of an in-memory ``GemmaForCausalLM``."""
    hf_cfg = source.config
    refuse_options(hf_cfg, "gemma", {"use_bidirectional_attention": None})
    cfg = _llama_config(hf_cfg, "gemma", embed_scale=hf_cfg.hidden_size ** 0.5, qkv_bias=hf_cfg.attention_bias,
                        attn_out_bias=hf_cfg.attention_bias)
    return _convert(source, tokenizer, cfg, norm_offset=1.0)


def _llama_config(hf_cfg, family: str, **knobs) -> GPTConfig:
    """The config every Llama-layout family shares (no biases); ``knobs`` are the family's own."""
    fields = shape(hf_cfg, family)
    defaults = dict(
        ln_eps=hf_cfg.rms_norm_eps,
        normalization_type="RMS",
        act_fn=activation(hf_cfg.hidden_act, family),
        gated_mlp=True,
        qkv_bias=False,
        attn_out_bias=False,
        mlp_bias=False,
        **rotary(hf_cfg, family, fields["d_head"]),
    )
    return GPTConfig(**fields, **(defaults | knobs))


def _window(hf_cfg) -> int | None:
    """The config's sliding window as our knob: None where there is none, or it spans the context."""
    window = hf_cfg.sliding_window
    return window if window is not None and window < hf_cfg.max_position_embeddings else None


def _convert(source, tokenizer, cfg: GPTConfig, norm_offset: float = 0.0) -> GPTModel:
    """``source``'s weights, mapped by name onto ``GPTModel(cfg)``; ``norm_offset`` is added to
    every RMSNorm weight (Gemma's 1)."""
    names = module_names(cfg, "model.embed_tokens", "model.norm", "model.layers.", _LAYER)
    hf = HFWeights(source.state_dict())
    state = copy_params(hf, names)
    for name in ["ln_final.weight", *(f"blocks.{l}.{norm}.weight" for l in range(cfg.n_layers) for norm in _NORMS)]:
        state[name] = state[name] + norm_offset
    return scratch_model(cfg, state, tokenizer, source.config.model_type, hf)
