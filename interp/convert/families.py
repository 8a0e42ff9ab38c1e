"""The table of Hugging Face families the from-scratch ``GPTModel`` implements (architecture §3.4): one
row (``interp.convert.common.Family``) per ``model_type`` (``CONVERTERS``): where its weights are and a small
function reading its config into ``GPTConfig`` knobs. ``interp.convert.common.convert`` reads any
row; a new family is a new row (and its lines in tests/test_converter_options.py).

- GPT-2: what ``GPTConfig``'s defaults describe. ``Conv1D`` weights are stored (in, out), and
  ``c_attn`` packs query, key and value side by side. The options that change the forward are read
  (an untied ``lm_head``, unscaled or layer-scaled attention scores); ``reorder_and_upcast_attn``
  only changes the order and precision Hugging Face computes the scores in, so it is read as the
  plain attention.
- The Llama layout (Llama, Mistral, Qwen2, Gemma): pre-RMSNorm blocks of grouped-query attention
  with rotary positions (every dim of a head: their code does not read ``partial_rotary_factor``),
  then a gated MLP. Llama: SwiGLU, biases only where ``attention_bias`` / ``mlp_bias`` say.
  Mistral: a sliding window over every layer, never biases. Qwen2: q/k/v biases (none on the
  output projection, none in the MLP), a sliding window where ``use_sliding_window`` gives every
  layer one (some layers only: refused). Gemma: GeGLU, embeddings times sqrt(d_model), its own head
  width, attention biases where ``attention_bias`` says, and an RMSNorm that multiplies by
  ``1 + weight`` (folded into the weight: ``norm_offset``). Each reads a bias flag only where its
  Hugging Face code does (Mistral's ignores ``attention_bias``, Qwen2's and Gemma's ``mlp_bias``).
- Gemma 2 and Gemma 3 (text: ``gemma3_text``, ``Gemma3ForCausalLM``): Gemma's layout with a norm on
  the attention's and on the MLP's output too (``post_attention_layernorm``,
  ``post_feedforward_layernorm``; the MLP's input norm is ``pre_feedforward_layernorm``), scores
  times ``query_pre_attn_scalar ** -0.5``, logits soft-capped by ``final_logit_softcapping``, and
  each layer global or local by ``layer_types`` (the config fills it: Gemma 2 every other layer,
  Gemma 3 by ``sliding_window_pattern``), the local ones with the sliding window. Gemma 2
  soft-caps its scores (``attn_logit_softcapping``; Gemma 3's code never reads that key). Gemma 3
  norms every query and key head (``q_norm``, ``k_norm``: ``1 + weight`` too) and gives each kind
  of layer its own RoPE (``rope_parameters`` per layer type: 10,000 local, 1,000,000 global); a
  scaled one is refused. Their activation is ``hidden_activation`` (Gemma's is ``hidden_act``).
- GPT-NeoX (Pythia): LayerNorm, partial rotary, attention and MLP in parallel
  (``use_parallel_residual``), exact GELU, biases where ``attention_bias`` says (always in the MLP),
  untied. ``query_key_value`` packs the projections per head. A head is ``hidden_size /
  num_attention_heads`` wide; a ``head_dim`` only sets how many dims the rotary embedding spans.
- Phi (1, 1.5, 2): as GPT-NeoX with one shared LayerNorm (both our branch norms get its weights),
  GELU-tanh, biases everywhere, an unembedding with a bias, always untied.
- BLOOM: ALiBi, a LayerNorm on the token embeddings, GELU-tanh (``gelu_new``: BLOOM's rounded
  constants are the same function), biases, tied; ``query_key_value`` packed per head as GPT-NeoX
  packs it. ``n_ctx`` is the 2048 tokens BLOOM was trained on (``seq_length`` where the config has
  it). ``slow_but_exact`` with ``pretraining_tp > 1`` only splits the output projections into
  slices summed in turn, so it is read as the plain projection.
"""

from __future__ import annotations

from interp.convert.common import Family, activation, rotary, shape
from interp.errors import UserError

# layer module names several rows share
_NORMS = {"ln1": "input_layernorm", "ln2": "post_attention_layernorm"}
_SELF_ATTN = {"attn.W_query": "self_attn.q_proj", "attn.W_key": "self_attn.k_proj", "attn.W_value": "self_attn.v_proj"}
_DENSE_MLP = {"mlp.fc": "mlp.dense_h_to_4h", "mlp.proj": "mlp.dense_4h_to_h"}
_BLOOM_CONTEXT = 2048


def _gpt2(c) -> dict:
    return dict(d_vocab=c.vocab_size, n_ctx=c.n_positions, d_model=c.n_embd, n_heads=c.n_head, n_layers=c.n_layer,
                d_mlp=c.n_inner or 4 * c.n_embd, ln_eps=c.layer_norm_epsilon,
                act_fn=activation(c, "activation_function"), use_attn_scale=c.scale_attn_weights,
                scale_attn_by_inverse_layer_idx=c.scale_attn_by_inverse_layer_idx,
                tie_word_embeddings=c.tie_word_embeddings)


def _llama_layout(c, **knobs) -> dict:
    """What the Llama-layout families share (no biases); ``knobs`` are a family's own."""
    fields = shape(c)
    return fields | dict(ln_eps=c.rms_norm_eps, normalization_type="RMS", act_fn=activation(c), gated_mlp=True,
                         qkv_bias=False, attn_out_bias=False, mlp_bias=False, **rotary(c, fields["d_head"])) | knobs


def _window(c) -> int | None:
    """The config's sliding window as our knob: None where there is none, or it spans the context."""
    return c.sliding_window if c.sliding_window is not None and c.sliding_window < c.max_position_embeddings else None


def _llama(c) -> dict:
    return _llama_layout(c, qkv_bias=c.attention_bias, attn_out_bias=c.attention_bias, mlp_bias=c.mlp_bias)


def _mistral(c) -> dict:
    return _llama_layout(c, sliding_window=_window(c))


def _qwen2(c) -> dict:
    sliding = [kind == "sliding_attention" for kind in c.layer_types]
    window = _window(c) if any(sliding) else None
    if window is not None and not all(sliding):
        raise UserError(f"qwen2 with a sliding window on some layers only (layer_types={c.layer_types}, "
                        f"sliding_window={c.sliding_window}) is not implemented from scratch; "
                        "use impl='transformer_lens'")
    return _llama_layout(c, qkv_bias=True, sliding_window=window, default_prepend_bos=False)


def _gemma(c) -> dict:
    return _llama_layout(c, embed_scale=c.hidden_size ** 0.5, qkv_bias=c.attention_bias,
                         attn_out_bias=c.attention_bias)


_LAYER_TYPES = {"full_attention": "global", "sliding_attention": "local"}  # Hugging Face's layer_types -> attn_types


def _gemma_sandwich(c, **knobs) -> dict:
    """What Gemma 2 and 3 share (the module docstring); ``knobs``: each one's own (positions, caps)."""
    unknown = sorted(set(c.layer_types) - set(_LAYER_TYPES))
    if unknown:
        raise UserError(f"{c.model_type} layer_types {unknown} are not implemented from scratch (only "
                        f"{', '.join(_LAYER_TYPES)}); use impl='transformer_lens'")
    return shape(c) | dict(ln_eps=c.rms_norm_eps, normalization_type="RMS", act_fn=activation(c, "hidden_activation"),
                           gated_mlp=True, qkv_bias=c.attention_bias, attn_out_bias=c.attention_bias, mlp_bias=False,
                           embed_scale=c.hidden_size ** 0.5, use_normalization_before_and_after=True,
                           attn_scale=c.query_pre_attn_scalar ** 0.5, output_logits_soft_cap=c.final_logit_softcapping,
                           sliding_window=_window(c), attn_types=[_LAYER_TYPES[kind] for kind in c.layer_types]) | knobs


def _gemma2(c) -> dict:
    return _gemma_sandwich(c, attn_scores_soft_cap=c.attn_logit_softcapping, **rotary(c, shape(c)["d_head"]))


def _gemma3(c) -> dict:
    """Gemma 3: its own RoPE base for each layer type (a scaled RoPE on either is refused)."""
    for kind, rope in c.rope_parameters.items():
        if rope.get("rope_type", "default") != "default":
            raise UserError(f"{c.model_type} rope_type={rope['rope_type']!r} is not implemented from scratch on its "
                            f"{kind} layers (only the default RoPE); use impl='transformer_lens'")
    return _gemma_sandwich(c, use_qk_norm=True, positional_embedding_type="rotary",
                           rotary_base=c.rope_parameters["full_attention"]["rope_theta"],
                           rotary_base_local=c.rope_parameters["sliding_attention"]["rope_theta"])


def _gpt_neox(c) -> dict:
    fields = shape(c) | dict(d_head=c.hidden_size // c.num_attention_heads)
    return fields | dict(ln_eps=c.layer_norm_eps, act_fn=activation(c), parallel_attn_mlp=c.use_parallel_residual,
                         qkv_bias=c.attention_bias, attn_out_bias=c.attention_bias, default_prepend_bos=False,
                         **rotary(c, getattr(c, "head_dim", None) or fields["d_head"], partial=True))


def _phi(c) -> dict:
    fields = shape(c) | dict(tie_word_embeddings=False)  # a tied Phi's lm_head still has a bias of its own
    return fields | dict(ln_eps=c.layer_norm_eps, act_fn=activation(c), parallel_attn_mlp=True, unembed_bias=True,
                         default_prepend_bos=False, **rotary(c, fields["d_head"], partial=True))


def _bloom(c) -> dict:
    return dict(d_vocab=c.vocab_size, n_ctx=getattr(c, "seq_length", _BLOOM_CONTEXT), d_model=c.hidden_size,
                n_heads=c.n_head, n_layers=c.n_layer, ln_eps=c.layer_norm_epsilon, act_fn="gelu_new",
                positional_embedding_type="alibi", post_embedding_ln=True,
                tie_word_embeddings=bool(c.tie_word_embeddings))


_LLAMA_LAYERS = _NORMS | _SELF_ATTN | {"attn.out_proj": "self_attn.o_proj", "mlp.gate": "mlp.gate_proj",
                                       "mlp.fc": "mlp.up_proj", "mlp.proj": "mlp.down_proj"}


def _llama_row(config, **options) -> Family:
    return Family(config, "model.embed_tokens", "model.norm", "model.layers.", _LLAMA_LAYERS, **options)


# Gemma 2 and 3: the norms around the attention and the MLP (ln1_post and ln2_post: TransformerLens's names)
_SANDWICH_LAYERS = _LLAMA_LAYERS | {"ln1_post": "post_attention_layernorm", "ln2": "pre_feedforward_layernorm",
                                   "ln2_post": "post_feedforward_layernorm"}
_QK_NORMS = {"attn.q_norm": "self_attn.q_norm", "attn.k_norm": "self_attn.k_norm"}

# model_types that impl='scratch' refuses with a reason (impl=None gives them the bridge)
NOT_FROM_SCRATCH = {
    "gemma3": "Gemma3ForConditionalGeneration, images and text; its text model alone, gemma3_text "
              "(Gemma3ForCausalLM), is implemented",
}


# Hugging Face model_type -> its row. Each passes tests/test_scratch_families.py (logits vs Hugging
# Face, every hook vs the TransformerLens bridge) and tests/test_converter_options.py (every config field).
CONVERTERS = {
    "gpt2": Family(_gpt2, "transformer.wte", "transformer.ln_f", "transformer.h.",
                   {"ln1": "ln_1", "attn.out_proj": "attn.c_proj", "ln2": "ln_2", "mlp.fc": "mlp.c_fc",
                    "mlp.proj": "mlp.c_proj"},
                   top_names={"pos_embed": "transformer.wpe"}, refused={"add_cross_attention": False},
                   packed_qkv="attn.c_attn", qkv_layout="three h d", conv1d=True),
    "llama": _llama_row(_llama),
    "mistral": _llama_row(_mistral),
    "qwen2": _llama_row(_qwen2),
    "gemma": _llama_row(_gemma, refused={"use_bidirectional_attention": None}, norm_offset=1.0),
    "gemma2": Family(_gemma2, "model.embed_tokens", "model.norm", "model.layers.", _SANDWICH_LAYERS,
                     refused={"use_bidirectional_attention": None}, norm_offset=1.0),
    "gemma3_text": Family(_gemma3, "model.embed_tokens", "model.norm", "model.layers.", _SANDWICH_LAYERS | _QK_NORMS,
                          refused={"use_bidirectional_attention": False}, norm_offset=1.0),
    "gpt_neox": Family(_gpt_neox, "gpt_neox.embed_in", "gpt_neox.final_layer_norm", "gpt_neox.layers.",
                       _NORMS | _DENSE_MLP | {"attn.out_proj": "attention.dense"},
                       packed_qkv="attention.query_key_value"),
    "phi": Family(_phi, "model.embed_tokens", "model.final_layernorm", "model.layers.",
                  _SELF_ATTN | {"ln1": "input_layernorm", "ln2": "input_layernorm",  # the shared norm, twice
                                "attn.out_proj": "self_attn.dense", "mlp.fc": "mlp.fc1", "mlp.proj": "mlp.fc2"},
                  refused={"qk_layernorm": False}),
    "bloom": Family(_bloom, "transformer.word_embeddings", "transformer.ln_f", "transformer.h.",
                    _NORMS | _DENSE_MLP | {"attn.out_proj": "self_attention.dense"},
                    top_names={"ln_embed": "transformer.word_embeddings_layernorm"},
                    refused={"apply_residual_connection_post_layernorm": False},
                    packed_qkv="self_attention.query_key_value"),
}
