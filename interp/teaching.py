"""The five teaching modules of the classic "attention from scratch" progression, instrumented.

Each module is a small ``HookedRootModule`` (``interp.hooked.HookedModule``) with six ``HookPoint``s:

=====================  ====================================================
hook                   what it sees
=====================  ====================================================
``hook_q/k/v``         queries, keys, values
``hook_attn_scores``   scaled, causally masked (-inf), pre-softmax scores
``hook_pattern``       attention weights after softmax (before dropout)
``hook_z``             pattern @ values (before any output projection)
=====================  ====================================================

so ``module.run_with_cache(x)`` returns ``(output, cache)`` with the Q/K/V and pattern of the
call. Shapes: ``SelfAttentionV1/V2`` and ``CausalAttention`` keep the reference's layout
(q/k/v/z ``(..., pos, d_out)``, scores/pattern ``(..., q_pos, k_pos)``); ``MultiHeadAttention``
uses the TransformerLens layout (q/k/v/z ``(batch, pos, head, d_head)``, scores/pattern
``(batch, head, q_pos, k_pos)``). ``MultiHeadAttentionWrapper`` exposes its heads' hooks as
``heads.{i}.hook_*``.

Parameters are created in the reference order (query, key, value[, out_proj]) so that, under the
same ``torch.manual_seed``, each module reproduces the published reference outputs exactly.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn
from transformer_lens.hook_points import HookPoint

from interp.attention import LayerKV, _check_context, _Instrumented
from interp.errors import UserError
from interp.hooked import HookedModule

__all__ = [
    "SelfAttentionV1",
    "SelfAttentionV2",
    "CausalAttention",
    "MultiHeadAttentionWrapper",
    "MultiHeadAttention",
]


def _causal_mask(context_length: int) -> torch.Tensor:
    """(context_length, context_length) float buffer, 1 above the diagonal (masked), as in the reference."""
    return torch.triu(torch.ones(context_length, context_length), diagonal=1)


class SelfAttentionV1(_Instrumented):
    """Self-attention with raw ``nn.Parameter`` weights. x: (pos, d_in) -> (pos, d_out)."""

    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.W_query = nn.Parameter(torch.rand(d_in, d_out))
        self.W_key = nn.Parameter(torch.rand(d_in, d_out))
        self.W_value = nn.Parameter(torch.rand(d_in, d_out))
        self._add_hook_points()
        self.setup()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        queries = self.hook_q(x @ self.W_query)
        keys = self.hook_k(x @ self.W_key)
        values = self.hook_v(x @ self.W_value)
        scores = queries @ keys.T / math.sqrt(keys.shape[-1])
        return self.hook_z(self._attend(scores, values, dropout=None))


class SelfAttentionV2(_Instrumented):
    """Self-attention with ``nn.Linear`` projections. x: (pos, d_in) -> (pos, d_out)."""

    def __init__(self, d_in: int, d_out: int, qkv_bias: bool = False):
        super().__init__()
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self._add_hook_points()
        self.setup()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        queries = self.hook_q(self.W_query(x))
        keys = self.hook_k(self.W_key(x))
        values = self.hook_v(self.W_value(x))
        scores = queries @ keys.transpose(-2, -1) / math.sqrt(keys.shape[-1])
        return self.hook_z(self._attend(scores, values, dropout=None))


class CausalAttention(_Instrumented):
    """One causal head with dropout on the weights. x: (batch, pos, d_in) -> (batch, pos, d_out)."""

    def __init__(self, d_in: int, d_out: int, context_length: int, dropout: float, qkv_bias: bool = False):
        super().__init__()
        self.d_out = d_out
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("mask", _causal_mask(context_length), persistent=False)
        self._add_hook_points()
        self.setup()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n_tokens = _check_context(x.shape[1], self.mask.shape[0])
        queries = self.hook_q(self.W_query(x))
        keys = self.hook_k(self.W_key(x))
        values = self.hook_v(self.W_value(x))
        scores = queries @ keys.transpose(1, 2) / math.sqrt(keys.shape[-1])
        scores = scores.masked_fill(self.mask.bool()[:n_tokens, :n_tokens], -torch.inf)
        return self.hook_z(self._attend(scores, values, self.dropout))


class MultiHeadAttentionWrapper(HookedModule):
    """``num_heads`` independent ``CausalAttention`` heads, outputs concatenated.

    x: (batch, pos, d_in) -> (batch, pos, num_heads * d_out). Head i's hooks are ``heads.{i}.hook_*``.
    """

    def __init__(self, d_in: int, d_out: int, context_length: int, dropout: float, num_heads: int,
                 qkv_bias: bool = False):
        super().__init__()
        self.heads = nn.ModuleList(
            [CausalAttention(d_in, d_out, context_length, dropout, qkv_bias) for _ in range(num_heads)]
        )
        self.setup()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([head(x) for head in self.heads], dim=-1)


class MultiHeadAttention(_Instrumented):
    """Causal multi-head attention with heads split from shared projections, then ``out_proj``.

    x: (batch, pos, d_in) -> (batch, pos, d_out). Hooks use the TransformerLens layout:
    ``hook_q/k/v/z`` (batch, pos, head, d_head), ``hook_attn_scores/pattern`` (batch, head, q, k).

    When no hook is attached to the scores or pattern and no dropout is active, the forward
    uses ``scaled_dot_product_attention`` (the fast path) and never materialises the pattern.
    """

    def __init__(self, d_in: int, d_out: int, context_length: int, dropout: float, num_heads: int,
                 qkv_bias: bool = False):
        super().__init__()
        if num_heads <= 0 or d_out % num_heads != 0:
            raise UserError(f"d_out={d_out} must be divisible by num_heads={num_heads} (a positive divisor)")
        self.d_out = d_out
        self.num_heads = num_heads
        self.head_dim = d_out // num_heads
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("mask", _causal_mask(context_length), persistent=False)
        self._add_hook_points()
        self.setup()

    @property
    def W_O(self) -> torch.Tensor:
        """The output projection per head, (head, d_head, d_out), as TransformerLens names it:
        the layer's output is sum_h z[..., h, :] @ W_O[h] + b_O."""
        return self.out_proj.weight.T.reshape(self.num_heads, self.head_dim, self.d_out)

    @property
    def b_O(self) -> torch.Tensor:
        """The output projection's bias (d_out,)."""
        return self.out_proj.bias

    def _split(self, x: torch.Tensor, hook: HookPoint) -> torch.Tensor:
        """(batch, pos, d_out) -> hooked (batch, pos, head, d_head) -> (batch, head, pos, d_head)."""
        per_head = hook(rearrange(x, "b p (h d) -> b p h d", h=self.num_heads))
        return per_head.transpose(1, 2)

    def _masked_scores(self, queries: torch.Tensor, keys: torch.Tensor, offset: int) -> torch.Tensor:
        """queries (batch, head, q, d_head), keys (batch, head, k, d_head) -> scaled scores with
        -inf above the causal diagonal (batch, head, q, k). One ``baddbmm`` adds the mask as a bias
        while it scales and multiplies: the scores are the largest tensor here, and separate scale
        and mask passes over them cost about a third of the attention's time."""
        n_queries, n_keys = queries.shape[2], keys.shape[2]
        bias = torch.zeros(n_queries, n_keys, dtype=queries.dtype, device=queries.device)
        bias.masked_fill_(self.mask.bool()[offset:offset + n_queries, :n_keys], -torch.inf)
        scores = torch.baddbmm(
            bias,
            rearrange(queries, "b h q d -> (b h) q d"),
            rearrange(keys, "b h k d -> (b h) d k"),
            alpha=1 / math.sqrt(self.head_dim),
        )
        return rearrange(scores, "(b h) q k -> b h q k", h=self.num_heads)

    def forward(self, x: torch.Tensor, past: LayerKV | None = None) -> torch.Tensor:
        """x: (batch, new_pos, d_in); ``past`` (optional) holds earlier positions' keys/values
        and is extended in place, so the new queries attend to past + new keys."""
        n_new = x.shape[1]
        offset = 0 if past is None else past.length
        n_total = _check_context(offset + n_new, self.mask.shape[0])
        queries = self._split(self.W_query(x), self.hook_q)
        keys = self._split(self.W_key(x), self.hook_k)
        values = self._split(self.W_value(x), self.hook_v)
        if past is not None:
            keys, values = past.extend(keys, values)
        if self._needs_pattern():
            z = self._attend(self._masked_scores(queries, keys, offset), values, self.dropout)
        else:
            # several new tokens after cached ones need the offset slice of the mask
            offset_mask = ~self.mask.bool()[offset:n_total, :n_total] if offset and n_new > 1 else None
            z = F.scaled_dot_product_attention(
                queries, keys, values, attn_mask=offset_mask, is_causal=offset == 0 and n_new > 1
            )
        z = self.hook_z(z.transpose(1, 2))  # (batch, pos, head, d_head)
        return self.out_proj(rearrange(z, "b p h d -> b p (h d)"))
