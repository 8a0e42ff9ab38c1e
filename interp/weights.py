"""Stacked per-head weights under TransformerLens's names, for ``GPTModel`` (``HeadWeights``).

A ``TransformerBridge`` exposes every layer's attention weights stacked, in the row-vector
convention ``q = x @ W_Q[l, h] + b_Q[l, h]`` and ``attn_out = sum_h z[..., h, :] @ W_O[l, h] + b_O[l]``;
this mixin gives ``GPTModel`` the same properties, read from its blocks' ``GroupedQueryAttention``
modules, so a weight-based analysis (``analyses.composition_scores``) reads either model alike:

    W_Q                (n_layers, n_heads,    d_model, d_head)
    W_K, W_V           (n_layers, n_kv_heads, d_model, d_head)
    W_O                (n_layers, n_heads,    d_head,  d_model)
    b_Q                (n_layers, n_heads,    d_head)
    b_K, b_V           (n_layers, n_kv_heads, d_head)
    b_O                (n_layers, d_model)
    W_E                (d_vocab, d_model)       the token embedding, as stored
    W_pos              (n_ctx, d_model)         learned positions only
    W_U, b_U           (d_model, d_vocab_out), (d_vocab_out,)   the unembedding
    W_out              (n_layers, d_mlp, d_model)   each MLP's output projection: row i is what
                       neuron i (``blocks.{l}.mlp.hook_post[..., i]``) writes per unit of activation

As on the bridge (checked on TransformerLens 4.3), ``W_K``/``W_V`` of a grouped-query model keep
their ``n_key_value_heads`` heads; ``expand_kv_heads`` repeats them onto the query heads that read
them (query head h reads key/value head ``h // (n_heads // n_kv_heads)``), which is what
TransformerLens's ``QK``/``OV`` and ``all_composition_scores`` do. One difference: the bridge
raises ``AttributeError`` for a bias the checkpoint lacks; here a missing bias is zeros (the
projection adds nothing), as TransformerLens's old ``HookedTransformer`` had it.

These are the weights as they are, with no LayerNorm folded in and no centring: the same tensors
a default (non-compatibility-mode) bridge returns on the same checkpoint. Rotary embeddings are
not part of ``W_Q``/``W_K`` (they act between the projection and the dot product).
"""

from __future__ import annotations

import torch
from einops import rearrange


def expand_kv_heads(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """(n_layers, n_kv_heads, ...) -> (n_layers, n_heads, ...): each key/value head repeated for
    the query heads of its group; returned unchanged when it already has ``n_heads`` heads."""
    n_kv_heads = weight.shape[1]
    if n_kv_heads == n_heads:
        return weight
    return weight.repeat_interleave(n_heads // n_kv_heads, dim=1)


def _head_weight(linear: torch.nn.Linear, d_head: int) -> torch.Tensor:
    """An ``nn.Linear(d_model, heads * d_head)`` -> its weight per head (heads, d_model, d_head)."""
    return rearrange(linear.weight, "(h d) m -> h m d", d=d_head)


def _head_bias(linear: torch.nn.Linear, d_head: int) -> torch.Tensor:
    """An ``nn.Linear(d_model, heads * d_head)`` -> its bias per head (heads, d_head); zeros if it has none."""
    if linear.bias is None:
        return linear.weight.new_zeros(linear.out_features // d_head, d_head)
    return rearrange(linear.bias, "(h d) -> h d", d=d_head)


def _zero_bias(attn) -> torch.Tensor:
    return attn.out_proj.weight.new_zeros(attn.out_proj.out_features)


def _stacked(read, shape: str) -> property:
    """A property stacking ``read(block.attn)`` over the blocks: a new tensor each time, in the
    parameters' autograd graph (nothing is cached, so it always shows the current weights)."""
    return property(lambda self: torch.stack([read(block.attn) for block in self.blocks]), doc=shape)


class HeadWeights:
    """Mixin for a model whose ``self.blocks[l].attn`` are ``GroupedQueryAttention`` modules:
    TransformerLens-named stacked attention weights (shapes in the module docstring)."""

    W_Q = _stacked(lambda attn: _head_weight(attn.W_query, attn.head_dim), "(n_layers, n_heads, d_model, d_head)")
    W_K = _stacked(lambda attn: _head_weight(attn.W_key, attn.head_dim), "(n_layers, kv_heads, d_model, d_head)")
    W_V = _stacked(lambda attn: _head_weight(attn.W_value, attn.head_dim), "(n_layers, kv_heads, d_model, d_head)")
    W_O = _stacked(lambda attn: attn.W_O, "(n_layers, n_heads, d_head, d_model)")
    b_Q = _stacked(lambda attn: _head_bias(attn.W_query, attn.head_dim), "(n_layers, n_heads, d_head)")
    b_K = _stacked(lambda attn: _head_bias(attn.W_key, attn.head_dim), "(n_layers, n_kv_heads, d_head)")
    b_V = _stacked(lambda attn: _head_bias(attn.W_value, attn.head_dim), "(n_layers, n_kv_heads, d_head)")
    b_O = _stacked(lambda attn: _zero_bias(attn) if attn.b_O is None else attn.b_O, "(n_layers, d_model)")

    # the embedding and unembedding, as the bridge names them (``self.embed``, and ``self.lm_head`` when untied)
    @property
    def W_E(self) -> torch.Tensor:
        """The token embedding (d_vocab, d_model) as stored (before any ``embed_scale``)."""
        return self.embed.weight

    @property
    def W_pos(self) -> torch.Tensor:
        """The learned position embedding (n_ctx, d_model); AttributeError for rotary or ALiBi positions."""
        if "pos_embed" not in self._modules:
            raise AttributeError("W_pos: this model has no learned position embeddings")
        return self.pos_embed.weight

    @property
    def W_U(self) -> torch.Tensor:
        """The unembedding (d_model, d_vocab_out): ``embed.weight`` transposed (tied) or ``lm_head``'s."""
        return (self.embed.weight if self.cfg.tie_word_embeddings else self.lm_head.weight).T

    @property
    def b_U(self) -> torch.Tensor:
        """The unembedding bias (d_vocab_out,); zeros where the model has none."""
        head = getattr(self, "lm_head", None)
        if head is None or head.bias is None:
            return self.W_U.new_zeros(self.W_U.shape[1])
        return head.bias

    @property
    def W_out(self) -> torch.Tensor:
        """The MLPs' output projections (n_layers, d_mlp, d_model), as the bridge stacks them;
        AttributeError for an attention-only model."""
        if self.cfg.attn_only:
            raise AttributeError("W_out: this model is attention-only (no MLPs)")
        return torch.stack([block.mlp.W_out for block in self.blocks])
