"""The production attention: ``GroupedQueryAttention``, the module ``GPTModel`` builds every family
from, going past the classic "attention from scratch" progression (whose five teaching modules are
``interp.teaching``) to what current open models use:
``GroupedQueryAttention`` (query heads sharing key/value heads; multi-query attention is one
group), with rotary position embeddings (full or partial, any base; ``hook_rot_q``/``hook_rot_k``
see queries and keys after rotation), ALiBi, and a sliding-window mask. Its ``hook_k``/``hook_v``
carry the key/value heads, everything else all query heads.

It has the same six hooks as the teaching modules (``hook_q/k/v``, ``hook_attn_scores``,
``hook_pattern``, ``hook_z``), in the TransformerLens layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import einsum, rearrange, repeat
from torch import nn
from transformer_lens.hook_points import HookPoint
from interp.hooked import HookedModule
from interp.errors import UserError
from interp.precision import Linear, restore

__all__ = [
    "GroupedQueryAttention",
    "LayerKV",
]


class _Instrumented(HookedModule):
    """Adds the six attention hook points and the shared scores -> pattern -> z step."""

    def _add_hook_points(self) -> None:
        self.hook_q = HookPoint()
        self.hook_k = HookPoint()
        self.hook_v = HookPoint()
        self.hook_attn_scores = HookPoint()
        self.hook_pattern = HookPoint()
        self.hook_z = HookPoint()

    def _attend(self, scores: torch.Tensor, values: torch.Tensor, dropout: nn.Module | None):
        """scores (..., q, k) already scaled and masked; values (..., k, d) -> z (..., q, d)."""
        return self._pattern(scores, dropout) @ values

    def _needs_pattern(self) -> bool:
        """Whether a forward must materialise the pattern (modules with a fast path): dropout on
        it is active, or a hook reads the scores or the pattern."""
        dropping = self.training and self.dropout.p > 0
        return dropping or self.hook_attn_scores.has_hooks() or self.hook_pattern.has_hooks()

    def _pattern(self, scores: torch.Tensor, dropout: nn.Module | None) -> torch.Tensor:
        """Hooked scores (..., q, k) -> hooked softmax pattern, then dropout (training only)."""
        scores = self.hook_attn_scores(scores)
        pattern = self.hook_pattern(torch.softmax(scores, dim=-1))
        return pattern if dropout is None else dropout(pattern)


@dataclass
class LayerKV:
    """One layer's cached keys and values for incremental decoding, each (batch, kv_head, pos, d_head)."""

    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def extend(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append this step's keys/values and return the full ones."""
        if self.keys is not None:
            keys = torch.cat([self.keys, keys], dim=2)
            values = torch.cat([self.values, values], dim=2)
        self.keys, self.values = keys, values
        return keys, values


class Float32Buffers(nn.Module):
    """A module whose buffers named in ``FLOAT32_BUFFERS`` follow every ``.to()`` / ``.cuda()`` /
    ``.half()`` to the module's device but stay float32, whatever dtype the module is cast to:
    rotary frequencies and ALiBi slopes scale positions, and rounded to bfloat16 (8 bits of
    mantissa) the rotary angle at position 4000 is off by radians. (Hugging Face's ``.to()`` casts
    them; its ``from_pretrained(torch_dtype=...)`` keeps them float32, as here.)"""

    FLOAT32_BUFFERS: tuple[str, ...] = ()

    def _apply(self, fn, *args, **kwargs):
        kept = {name: self._buffers[name] for name in self.FLOAT32_BUFFERS
                if self._buffers.get(name) is not None and not self._buffers[name].is_meta}
        module = super()._apply(fn, *args, **kwargs)
        for name, value in kept.items():
            self._buffers[name] = value.to(device=self._buffers[name].device)  # the float32 values, moved
        return module


class GroupedQueryAttention(Float32Buffers, _Instrumented):
    """Causal attention whose ``num_heads`` query heads share ``num_kv_groups`` key/value heads.

    x: (batch, pos, d_in) -> (batch, pos, d_out). Query head h reads key/value head
    ``h // (num_heads // num_kv_groups)`` (Hugging Face's ``repeat_kv`` order); ``num_kv_groups ==
    num_heads`` is multi-head attention, ``num_kv_groups == 1`` multi-query attention. Layers are
    created in the reference order: ``W_query`` (d_in -> num_heads * head_dim), ``W_key`` and
    ``W_value`` (d_in -> num_kv_groups * head_dim), ``out_proj`` (num_heads * head_dim -> d_out).

    Positions, each optional:
    - ``rotary_dim``: rotary embeddings (RoPE) on the first ``rotary_dim`` dims of every query and
      key head (all of them: ``head_dim``; fewer: GPT-NeoX / Phi's partial rotary), in Hugging
      Face's rotate-half convention with frequencies ``rotary_base ** (-2i / rotary_dim)``, each
      divided by its ``rotary_divisors[i]`` where given (Llama 3's scaled RoPE; a GGUF file's
      ``rope_freqs``);
    - ``alibi``: ALiBi, added to the scores as BLOOM adds it: ``slope_h * key_position`` (equal,
      after the softmax, to the paper's ``-slope_h * distance``);
    - ``sliding_window``: each query sees only its last ``sliding_window`` positions (Mistral).

    ``scale``: what the scores q.k are multiplied by, ``head_dim ** -0.5`` when None (GPT-2 sets
    others: 1 without ``scale_attn_weights``, divided by layer + 1 with
    ``scale_attn_by_inverse_layer_idx``).

    ``causal=False`` drops the causal mask: every query sees every key (Tracr's programs compiled
    without ``causal=True``).

    ``soft_cap``: the scaled scores become ``soft_cap * tanh(scores / soft_cap)`` before the mask
    (Gemma 2; ``hook_attn_scores`` sees them capped). ``qk_norms``: two modules (a query's and a
    key's norm over head_dim, Gemma 3's ``q_norm``/``k_norm``) applied to every query and key head
    after ``hook_q``/``hook_k`` (which see the projections, as the bridge's do) and before the
    rotation. ``out_hook``: a ``hook_out`` (batch, pos, d_out) on the output, for a block that norms
    it before the residual (as the bridge's ``attn.hook_out``).

    Hooks: ``hook_q`` (batch, pos, head, head_dim) and ``hook_k``/``hook_v`` (batch, pos, kv_head,
    head_dim) as projected; with rotary, ``hook_rot_q``/``hook_rot_k`` after rotation (same shapes);
    ``hook_attn_scores``/``hook_pattern`` (batch, head, q, k); ``hook_z`` (batch, pos, head, head_dim).
    As in ``MultiHeadAttention``, the forward uses ``scaled_dot_product_attention`` when no hook
    needs the scores or the pattern.

    ``alibi_slopes`` stay float32 under ``.to()`` (``Float32Buffers``).
    """

    FLOAT32_BUFFERS = ("alibi_slopes",)

    def __init__(self, d_in: int, d_out: int, context_length: int, dropout: float, num_heads: int,
                 num_kv_groups: int, qkv_bias: bool = False, *, head_dim: int | None = None,
                 out_bias: bool = True, rotary_dim: int = 0, rotary_base: float = 10_000.0,
                 rotary_divisors: tuple[float, ...] | None = None, alibi: bool = False, sliding_window: int | None = None, causal: bool = True,
                 scale: float | None = None, soft_cap: float | None = None,
                 qk_norms: tuple[nn.Module, nn.Module] | None = None, out_hook: bool = False):
        super().__init__()
        if num_kv_groups <= 0 or num_heads % num_kv_groups:
            raise UserError(f"num_heads={num_heads} must be divisible by num_kv_groups={num_kv_groups} "
                            "(a positive divisor)")
        if head_dim is None and d_out % num_heads:
            raise UserError(f"d_out={d_out} must be divisible by num_heads={num_heads}, or give head_dim")
        self.num_heads, self.num_kv_groups = num_heads, num_kv_groups
        self.group_size = num_heads // num_kv_groups
        self.head_dim = head_dim or d_out // num_heads
        self.scale = self.head_dim ** -0.5 if scale is None else scale
        self.context_length = context_length
        self.sliding_window = sliding_window
        self.causal = causal
        self.soft_cap = soft_cap
        self.W_query = Linear(d_in, num_heads * self.head_dim, bias=qkv_bias)
        self.W_key = Linear(d_in, num_kv_groups * self.head_dim, bias=qkv_bias)
        self.W_value = Linear(d_in, num_kv_groups * self.head_dim, bias=qkv_bias)
        self.out_proj = Linear(num_heads * self.head_dim, d_out, bias=out_bias)
        self.dropout = nn.Dropout(dropout)
        self.rotary = Rotary(rotary_dim, self.head_dim, rotary_base, rotary_divisors) if rotary_dim else None
        self.register_buffer("alibi_slopes", alibi_slopes(num_heads) if alibi else None, persistent=False)
        self.q_norm, self.k_norm = qk_norms if qk_norms is not None else (None, None)
        self._add_hook_points()
        if self.rotary is not None:
            self.hook_rot_q = HookPoint()
            self.hook_rot_k = HookPoint()
        self.hook_out = HookPoint() if out_hook else None
        self.setup()

    @property
    def W_O(self) -> torch.Tensor:
        """The output projection per head, (head, head_dim, d_out): the layer's output is
        sum_h z[..., h, :] @ W_O[h] + b_O."""
        return rearrange(self.out_proj.weight, "o (h d) -> h d o", h=self.num_heads)

    @property
    def b_O(self) -> torch.Tensor | None:
        """The output projection's bias (d_out,), None where it has none."""
        return self.out_proj.bias

    def forward(self, x: torch.Tensor, past: LayerKV | None = None) -> torch.Tensor:
        """x: (batch, new_pos, d_in); ``past`` (optional) holds earlier positions' (rotated) keys
        and values and is extended in place, so the new queries attend to past + new keys."""
        queries = self._heads(self.W_query(x), self.hook_q)
        keys = self._heads(self.W_key(x), self.hook_k)
        values = self._heads(self.W_value(x), self.hook_v)
        return self._mix(queries, keys, values, past, self.group_size)

    def forward_split(self, q_in: torch.Tensor, k_in: torch.Tensor, v_in: torch.Tensor) -> torch.Tensor:
        """Per-head inputs (batch, pos, head, d_in) -> (batch, pos, d_out), as TransformerLens's
        ``use_split_qkv_input``: query head h's query, key and value are projected from its own
        copies ``q_in[:, :, h]``, ``k_in[:, :, h]``, ``v_in[:, :, h]``. With grouped-query attention
        each query head gets its own key and value, projected by its group's weights (equal to the
        shared ones while the copies are equal), so ``hook_k``/``hook_v`` carry all query heads and
        an edit of head h's key or value input changes head h's attention alone. An input given
        as (batch, pos, d_in) is shared by every head, as in ``forward``."""
        queries = self.hook_q(self._project(self.W_query, q_in, 1))
        keys = self.hook_k(self._project(self.W_key, k_in, self.group_size))
        values = self.hook_v(self._project(self.W_value, v_in, self.group_size))
        if keys.shape[2] == values.shape[2]:
            return self._mix(queries, keys, values, None, queries.shape[2] // keys.shape[2])
        per_query_head = [repeat(t, "b p kv d -> b p (kv g) d", g=self.group_size) if t.shape[2] < queries.shape[2]
                          else t for t in (keys, values)]  # one split, one shared: each query head its own copy
        return self._mix(queries, *per_query_head, None, 1)

    def _project(self, linear: Linear, x: torch.Tensor, group_size: int) -> torch.Tensor:
        """x shared (batch, pos, d_in) or per query head (batch, pos, head, d_in) -> (batch, pos,
        heads, head_dim): the layer's own heads, or one per query head."""
        if x.ndim == 3:
            return rearrange(linear(x), "b p (h d) -> b p h d", d=self.head_dim)
        return self._per_head(linear, x, group_size)

    def _per_head(self, linear: Linear, x: torch.Tensor, group_size: int) -> torch.Tensor:
        """x (batch, pos, head, d_in) -> (batch, pos, head, head_dim): head h's copy through its own
        rows of ``linear`` (key/value rows repeated ``group_size`` times, one per query head), in
        ``linear``'s precision (mixed: a bfloat16 product, as its shared forward)."""
        weight = linear.low_weight() if linear.mixed else linear.weight
        per_head = repeat(weight, "(kv d) i -> (kv g) d i", d=self.head_dim, g=group_size)
        out = einsum(x.to(weight.dtype), per_head, "b p h i, h d i -> b p h d")
        bias = None if linear.bias is None else repeat(linear.bias, "(kv d) -> (kv g) d", d=self.head_dim, g=group_size)
        return restore(out, x.dtype, bias)

    def _mix(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, past: LayerKV | None,
             group_size: int) -> torch.Tensor:
        """Hooked queries (batch, pos, head, d) and keys/values (batch, pos, head // group_size, d)
        -> rotated, attended, hooked z, projected: (batch, pos, d_out)."""
        offset = 0 if past is None else past.length
        _check_context(offset + queries.shape[1], self.context_length)
        if self.q_norm is not None:
            queries, keys = self.q_norm(queries), self.k_norm(keys)
        if self.rotary is not None:
            cos, sin = self.rotary.cos_sin(offset, queries.shape[1], like=queries)
            queries = self.hook_rot_q(apply_rotary(queries, cos, sin))
            keys = self.hook_rot_k(apply_rotary(keys, cos, sin))
        queries, keys, values = (t.transpose(1, 2) for t in (queries, keys, values))  # (batch, head, pos, d)
        if past is not None:
            keys, values = past.extend(keys, values)
        if self._needs_pattern():
            z = self._grouped_attend(self._masked_scores(queries, keys, offset, group_size), values, group_size)
        else:
            mask, is_causal = self._sdpa_mask(offset, queries, keys)
            z = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, is_causal=is_causal,
                                               scale=self.scale, enable_gqa=group_size > 1)
        z = self.hook_z(z.transpose(1, 2))  # (batch, pos, head, head_dim)
        out = self.out_proj(rearrange(z, "b p h d -> b p (h d)"))
        return out if self.hook_out is None else self.hook_out(out)

    def _needs_pattern(self) -> bool:
        """As ``_Instrumented``'s, and always with soft-capped scores (the fast path cannot cap them)."""
        return self.soft_cap is not None or super()._needs_pattern()

    def _heads(self, x: torch.Tensor, hook: HookPoint) -> torch.Tensor:
        """(batch, pos, heads * head_dim) -> hooked (batch, pos, heads, head_dim)."""
        return hook(rearrange(x, "b p (h d) -> b p h d", d=self.head_dim))

    def _blocked(self, offset: int, n_queries: int, n_keys: int, device) -> torch.Tensor:
        """(q, k) bool, True where query ``offset + i`` may not see key j: a later key (causal
        only), or one ``sliding_window`` or more positions back."""
        query_pos = torch.arange(offset, offset + n_queries, device=device)[:, None]
        key_pos = torch.arange(n_keys, device=device)[None, :]
        blocked = key_pos > query_pos if self.causal else torch.zeros(n_queries, n_keys, dtype=torch.bool, device=device)
        if self.sliding_window is not None:
            blocked |= key_pos <= query_pos - self.sliding_window
        return blocked

    def _score_bias(self, offset: int, queries: torch.Tensor, n_keys: int) -> torch.Tensor:
        """What is added to the scaled scores: -inf where blocked, plus ALiBi's ``slope_h * key
        position`` -> (q, k), or (head, q, k) with ALiBi."""
        blocked = self._blocked(offset, queries.shape[2], n_keys, queries.device)
        bias = torch.zeros(blocked.shape, dtype=queries.dtype, device=queries.device)
        bias.masked_fill_(blocked, -torch.inf)
        if self.alibi_slopes is None:
            return bias
        key_pos = torch.arange(n_keys, device=queries.device)
        return (self.alibi_slopes[:, None, None] * key_pos).to(queries.dtype) + bias

    def _masked_scores(self, queries: torch.Tensor, keys: torch.Tensor, offset: int, group_size: int) -> torch.Tensor:
        """queries (batch, head, q, d), keys (batch, head // group_size, k, d) -> scaled scores plus
        the bias of ``_score_bias`` (batch, head, q, k). The query heads of a group are stacked on
        the query axis, so one ``bmm`` serves the group without repeating its keys. The product is
        scaled by ``scale`` after it is rounded, as Hugging Face's eager attention does, so the
        scores agree with it to the bit; one ``add`` scales and adds the bias (with ``soft_cap``, the
        scaled scores are capped first, in Gemma 2's order: divided by the cap, tanh, times the cap)."""
        stacked = torch.bmm(rearrange(queries, "b (kv g) q d -> (b kv) (g q) d", g=group_size),
                            rearrange(keys, "b kv k d -> (b kv) d k"))
        raw = rearrange(stacked, "(b kv) (g q) k -> b (kv g) q k", b=queries.shape[0], g=group_size)
        bias = self._score_bias(offset, queries, keys.shape[2])
        if self.soft_cap is None:
            return torch.add(bias, raw, alpha=self.scale)
        return torch.tanh(raw * self.scale / self.soft_cap) * self.soft_cap + bias

    def _grouped_attend(self, scores: torch.Tensor, values: torch.Tensor, group_size: int) -> torch.Tensor:
        """scores (batch, head, q, k), values (batch, head // group_size, k, d) -> z (batch, head, q, d)."""
        pattern = self._pattern(scores, self.dropout)
        stacked = rearrange(pattern, "b (kv g) q k -> (b kv) (g q) k", g=group_size)
        z = torch.bmm(stacked, rearrange(values, "b kv k d -> (b kv) k d"))
        return rearrange(z, "(b kv) (g q) d -> b (kv g) q d", b=scores.shape[0], g=group_size)

    def _sdpa_mask(self, offset: int, queries: torch.Tensor, keys: torch.Tensor):
        """(attn_mask, is_causal) for ``scaled_dot_product_attention``: its own causal flag when
        the plain causal mask is all there is, else the mask (a float bias with ALiBi)."""
        n_queries, n_keys = queries.shape[2], keys.shape[2]
        if self.alibi_slopes is not None:
            return self._score_bias(offset, queries, n_keys), False
        if self.sliding_window is None and (offset == 0 or n_queries == 1 or not self.causal):
            return None, self.causal and offset == 0 and n_queries > 1  # one new token sees every cached key
        return ~self._blocked(offset, n_queries, n_keys, queries.device), False


class Rotary(Float32Buffers):
    """Rotary position embeddings (RoPE) as Hugging Face computes them: ``inv_freq`` in float32 on
    the CPU at creation (and float32 after any ``.to()``: ``Float32Buffers``), angles ``position *
    inv_freq`` in float32, each frequency used for a dim of the first half and its twin in the
    second half of the rotated dims (``rotate_half``). ``divisors`` (rotary_dim // 2,), optional:
    each frequency divided by its own, in float32 (Llama 3's scaled RoPE, llama.cpp's
    ``rope_freqs``)."""

    FLOAT32_BUFFERS = ("inv_freq",)

    def __init__(self, rotary_dim: int, head_dim: int, base: float, divisors: tuple[float, ...] | None = None):
        super().__init__()
        if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
            raise UserError(f"rotary_dim={rotary_dim} must be even and in (0, head_dim={head_dim}]")
        self.rotary_dim = rotary_dim
        inv_freq = rotary_frequencies(rotary_dim, base)
        if divisors is not None:
            inv_freq = inv_freq / torch.tensor(divisors, dtype=torch.float32)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def cos_sin(self, offset: int, n_pos: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (pos, rotary_dim) for positions offset.., in ``like``'s dtype and device."""
        positions = torch.arange(offset, offset + n_pos, device=like.device)
        freqs = positions[:, None].float() * self.inv_freq.float()
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos().to(like.dtype), angles.sin().to(like.dtype)


def rotary_frequencies(rotary_dim: int, base: float) -> torch.Tensor:
    """RoPE's unscaled frequencies (rotary_dim // 2,) in float32, ``base ** (-2i / rotary_dim)``,
    computed as Hugging Face computes them."""
    return 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(..., d) -> (..., d): (x1, x2) -> (-x2, x1) on the two halves of the last dim."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (batch, pos, head, d); cos, sin (pos, rotary_dim) -> x with its first ``rotary_dim`` dims
    rotated, the rest passed through."""
    rotary_dim = cos.shape[-1]
    cos, sin = cos[:, None], sin[:, None]  # broadcast over heads
    rotated = x[..., :rotary_dim] * cos + rotate_half(x[..., :rotary_dim]) * sin
    if rotary_dim == x.shape[-1]:
        return rotated
    return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """ALiBi's per-head slopes (head,) in float32, as BLOOM computes them: the geometric series
    2^(-8/n), 2^(-16/n), ... for the largest power of two n <= num_heads, then every other term of
    the series for 2n for the remaining heads."""
    closest = 2 ** math.floor(math.log2(num_heads))

    def series(n: int, powers: torch.Tensor) -> torch.Tensor:
        base = torch.tensor(2 ** (-(2 ** -(math.log2(n) - 3))), dtype=torch.float32)
        return torch.pow(base, powers)

    slopes = series(closest, torch.arange(1, 1 + closest, dtype=torch.int32))
    remaining = min(closest, num_heads - closest)
    if remaining:
        slopes = torch.cat([slopes, series(2 * closest, torch.arange(1, 1 + 2 * remaining, 2, dtype=torch.int32))])
    return slopes


def _check_context(n_tokens: int, context_length: int) -> int:
    if n_tokens > context_length:
        raise UserError(f"sequence of {n_tokens} tokens exceeds the context length {context_length}")
    return n_tokens
