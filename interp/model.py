"""``GPTModel``: one transformer, GPT-2's by default, every supported family by its config knobs.

Where things live (architecture §3.2, §3.4):

- ``GPTConfig``: the shape and the family knobs (norm, MLP kind, positions, key/value heads,
  parallel block, biases, tied unembedding, embedding scale); the defaults are GPT-2.
- attention, with grouped-query heads, RoPE, ALiBi and the sliding window:
  ``interp.attention.GroupedQueryAttention`` (one per block, built by ``_attention``);
- ``RMSNorm`` and ``MLP`` (plain, SwiGLU or GeGLU) below; ``TransformerBlock`` (sequential or
  parallel attention + MLP); ``GPTModel`` (embeddings, blocks, final norm, unembedding).
- the table of Hugging Face families whose rows set the knobs: ``interp.convert.CONVERTERS``.

GPT-2 (the defaults): token + learned position embeddings, pre-LayerNorm blocks of attention then
a GELU-tanh MLP (unless ``attn_only``), a final LayerNorm and an unembedding tied to the token
embedding. Hook names follow TransformerLens (architecture §2), so every analysis treats it like a
``TransformerBridge``:

    hook_embed, hook_pos_embed, blocks.{l}.hook_resid_pre          (batch, pos, d_model)
    blocks.{l}.attn.hook_q / hook_z                                (batch, pos, head, d_head)
    blocks.{l}.attn.hook_k / hook_v                                (batch, pos, kv_head, d_head)
    blocks.{l}.attn.hook_rot_q / hook_rot_k  (rotary only)         (batch, pos, head | kv_head, d_head)
    blocks.{l}.attn.hook_attn_scores / hook_pattern                (batch, head, q_pos, k_pos)
    blocks.{l}.hook_attn_out, hook_resid_mid, hook_mlp_out, hook_resid_post   (batch, pos, d_model)
    blocks.{l}.mlp.hook_post  (the MLP's hidden activation, one value per neuron)  (batch, pos, d_mlp)
    blocks.{l}.attn.hook_out, blocks.{l}.mlp.hook_out               (batch, pos, d_model)
        (only with ``use_normalization_before_and_after``: the outputs before the norm on them;
        ``hook_attn_out`` / ``hook_mlp_out`` are after it, what the residual receives)
    blocks.{l}.hook_q_input / hook_k_input / hook_v_input          (batch, pos, head, d_model)
        (only after ``set_use_split_qkv_input(True)``: each query head's own copy of resid_pre)

(``attn_only`` models have no ``hook_resid_mid`` / ``hook_mlp_out`` / ``mlp.hook_post``; parallel blocks no
``hook_resid_mid``; rotary and ALiBi models no ``hook_pos_embed``. Masked scores are -inf.
``hook_embed`` is after ``embed_scale`` and ``post_embedding_ln``, as the bridge places it.)
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from functools import partial
from typing import Literal, Sequence

import torch
import torch.nn.functional as F
from einops import repeat
from torch import nn
from transformer_lens.hook_points import HookPoint

from interp.attention import GroupedQueryAttention, LayerKV
from interp.hooked import HookedModule
from interp.precision import Linear, check_precision
from interp.weights import HeadWeights
from interp.tokenizer import ByteTokenizer, Tokenizer, check_token_ids, encode_texts
from interp.errors import UserError

ReturnType = Literal["logits", "loss", "both", None]


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    """GELU's tanh approximation written out, as GPT-2's and Phi's code computes it. ``gelu_tanh``
    is the same function fused by PyTorch (Gemma's ``gelu_pytorch_tanh``); they differ by rounding.
    Where no graph is recorded, the same operations run in place on one temporary: the same bits,
    without five more (rows, d_mlp) tensors to allocate (2-3x faster on a CPU at large batches)."""
    if torch.is_grad_enabled() and x.requires_grad:
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))
    inner = torch.pow(x, 3.0).mul_(0.044715).add_(x).mul_(math.sqrt(2.0 / math.pi)).tanh_().add_(1.0)
    return (0.5 * x).mul_(inner)


NORMS = ("LN", "RMS", None)  # None: no normalisation (Tracr's compiled models)
ACTIVATIONS = {"gelu_tanh": partial(F.gelu, approximate="tanh"), "gelu_new": gelu_new, "gelu": F.gelu,
               "silu": F.silu, "relu": F.relu}
POSITIONS = ("standard", "rotary", "alibi")
ATTN_TYPES = ("global", "local")  # a layer's attention: over the whole context, or a sliding window


@dataclass
class GPTConfig:
    """Shape of a ``GPTModel``; field names match TransformerLens's ``cfg`` where it has them.

    The family knobs default to GPT-2. What each family sets (``interp.convert.CONVERTERS``):
    Llama / Mistral / Qwen2: RMS norm, SwiGLU (``gated_mlp`` + silu), rotary, fewer key/value
    heads, no biases (Qwen2: qkv biases), an untied unembedding (Mistral: a sliding window).
    Gemma: as Llama with GeGLU (``gated_mlp`` + gelu_tanh), ``embed_scale = sqrt(d_model)``, its
    own ``d_head``, tied. Gemma 2: as Gemma with a norm on the attention and on the MLP output too
    (``use_normalization_before_and_after``), scores divided by ``attn_scale`` and soft-capped,
    soft-capped logits, a sliding window on every other layer (``attn_types``). Gemma 3: as Gemma 2
    with an RMSNorm on every query and key head (``use_qk_norm``), no score cap, and local layers
    with their own rotary base (``rotary_base_local``). GPT-NeoX: LayerNorm, exact GELU, partial rotary, parallel attention + MLP,
    biases, untied. Phi: as GPT-NeoX with ``gelu_new`` and an unembedding bias. BLOOM: ALiBi
    (``positional_embedding_type="alibi"``), a LayerNorm on the embeddings, GELU-tanh, biases, tied.
    """

    d_vocab: int
    n_ctx: int
    d_model: int
    n_heads: int
    n_layers: int
    d_mlp: int | None = None  # default 4 * d_model
    attn_only: bool = False
    qkv_bias: bool = True
    dropout: float = 0.0
    ln_eps: float = 1e-5
    model_name: str = "gpt"
    # where the model's weights live; kept in sync by GPTModel.to() and read by TransformerLens
    # utilities (its patching sweeps); not saved in checkpoints
    device: str = field(default="cpu", compare=False)
    # ---- family knobs (architecture §3.4); the defaults are GPT-2 -----------------------------------
    d_head: int | None = None  # width of a head; default d_model // n_heads
    n_key_value_heads: int | None = None  # None: n_heads; fewer: grouped-query (1: multi-query)
    normalization_type: str | None = "LN"  # "LN" (LayerNorm) | "RMS" (RMSNorm, float32) | None (no norm)
    act_fn: str = "gelu_tanh"  # "gelu_tanh" | "gelu_new" (both tanh-approximate) | "gelu" (erf) | "silu" | "relu"
    gated_mlp: bool = False  # proj(act(gate(x)) * fc(x)): SwiGLU with silu, GeGLU with gelu_tanh
    positional_embedding_type: str = "standard"  # "standard" (learned) | "rotary" | "alibi"
    rotary_dim: int | None = None  # rotated dims of each head (rotary only); default d_head
    rotary_base: float = 10_000.0
    # each rotary frequency divided by its own of these (rotary_dim // 2 floats, applied in float32):
    # Llama 3's scaled RoPE, a GGUF file's rope_freqs; None: the original RoPE
    rotary_divisors: tuple[float, ...] | None = None
    sliding_window: int | None = None  # a query sees only its last sliding_window positions (on "local" layers)
    # per layer "global" or "local": only local layers have the sliding_window and rotary_base_local (Gemma 2,
    # Gemma 3); None: every layer is local
    attn_types: list[str] | None = None
    rotary_base_local: float | None = None  # the rotary base of "local" layers; None: rotary_base
    use_attn_scale: bool = True  # scores times d_head ** -0.5; False: unscaled (GPT-2's scale_attn_weights=False)
    scale_attn_by_inverse_layer_idx: bool = False  # block l's scores also divided by l + 1 (GPT-2's option)
    attn_scale: float | None = None  # with use_attn_scale, what the scores are divided by; None: sqrt(d_head)
    attn_scores_soft_cap: float | None = None  # scaled scores -> cap * tanh(scores / cap), before the mask
    output_logits_soft_cap: float | None = None  # logits -> cap * tanh(logits / cap)
    use_qk_norm: bool = False  # an RMSNorm (over d_head) on every query and key head, before the rotation
    # a norm on the attention's and on the MLP's output too, before each is added to the residual
    # (ln1_post, ln2_post: Gemma 2 and 3's sandwich)
    use_normalization_before_and_after: bool = False
    parallel_attn_mlp: bool = False  # resid + attn(ln1(resid)) + mlp(ln2(resid))
    attn_out_bias: bool = True
    mlp_bias: bool = True
    tie_word_embeddings: bool = True  # unembed with embed.weight; False: a separate lm_head
    unembed_bias: bool = False  # the lm_head's bias (untied only)
    embed_scale: float = 1.0  # token embeddings are multiplied by it (Gemma: sqrt(d_model))
    post_embedding_ln: bool = False  # a norm on the token embeddings, before block 0 (BLOOM)
    causal: bool = True  # False: every position attends to every position (Tracr's non-causal programs)
    d_vocab_out: int | None = None  # width of the unembedding's output; None: d_vocab (a different one needs
    # an untied unembedding: Tracr's output space, 1 for a numerical output read as a value)
    # whether texts begin with the start token, in to_tokens (when not told) and in every analysis:
    # the tokenizer's own add_bos_token where it says, else the family's default (TransformerLens's
    # per-family convention: False for Qwen2, GPT-NeoX and Phi); interp.tokenizer.set_start_token
    default_prepend_bos: bool = True
    # per-head q/k/v inputs (``GPTModel.set_use_split_qkv_input``), a runtime switch as in
    # TransformerLens's cfg; not saved in checkpoints
    use_split_qkv_input: bool = field(default=False, compare=False)
    # "float32" or "mixed" (``GPTModel.set_precision``: the linear maps' products in bfloat16), a
    # runtime switch; not saved in checkpoints
    precision: str = field(default="float32", compare=False)

    def __post_init__(self):
        for name in ("d_vocab", "n_ctx", "d_model", "n_heads", "n_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise UserError(f"GPTConfig.{name}={value!r} must be a positive integer")
        if self.d_head is None:
            if self.d_model % self.n_heads:
                raise UserError(f"d_model={self.d_model} must be divisible by n_heads={self.n_heads} (or give d_head)")
            self.d_head = self.d_model // self.n_heads
        if not 0.0 <= self.dropout < 1.0:
            raise UserError(f"dropout={self.dropout} must be in [0, 1)")
        if self.d_mlp is None:
            self.d_mlp = 4 * self.d_model
        _check_choice("normalization_type", self.normalization_type, NORMS)
        _check_choice("act_fn", self.act_fn, tuple(ACTIVATIONS))
        _check_choice("positional_embedding_type", self.positional_embedding_type, POSITIONS)
        check_precision(self.precision)
        n_kv = self.n_key_value_heads
        if n_kv is not None and (n_kv <= 0 or self.n_heads % n_kv):
            raise UserError(f"n_key_value_heads={n_kv} must divide n_heads={self.n_heads}")
        if self.positional_embedding_type == "rotary" and self.rotary_dim is None:
            self.rotary_dim = self.d_head
        if self.rotary_divisors is not None:
            self.rotary_divisors = tuple(float(d) for d in self.rotary_divisors)  # a checkpoint's JSON list too
            if self.positional_embedding_type != "rotary" or len(self.rotary_divisors) != self.rotary_dim // 2 \
                    or not all(0 < d < math.inf for d in self.rotary_divisors):
                raise UserError(f"rotary_divisors of {len(self.rotary_divisors)} values must be rotary_dim // 2 = "
                                f"{(self.rotary_dim or 0) // 2} positive finite numbers, with rotary positions "
                                f"(positional_embedding_type={self.positional_embedding_type!r})")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise UserError(f"sliding_window={self.sliding_window} must be a positive number of positions (or None)")
        if self.attn_types is not None:
            self.attn_types = list(self.attn_types)
            if len(self.attn_types) != self.n_layers or not set(self.attn_types) <= set(ATTN_TYPES):
                raise UserError(f"attn_types={self.attn_types} must name one of {', '.join(ATTN_TYPES)} for each of "
                                f"the n_layers={self.n_layers} layers (or be None)")
        for name in ("attn_scale", "attn_scores_soft_cap", "output_logits_soft_cap", "rotary_base_local"):
            value = getattr(self, name)
            if value is not None and not 0 < value < math.inf:
                raise UserError(f"GPTConfig.{name}={value!r} must be a positive number (or None)")
        if self.unembed_bias and self.tie_word_embeddings:
            raise UserError("unembed_bias=True needs a separate unembedding (tie_word_embeddings=False)")
        if self.d_vocab_out is None:
            self.d_vocab_out = self.d_vocab
        if self.d_vocab_out <= 0 or self.d_vocab_out != self.d_vocab and self.tie_word_embeddings:
            raise UserError(f"d_vocab_out={self.d_vocab_out} must be positive, and differ from d_vocab={self.d_vocab} "
                            "only with a separate unembedding (tie_word_embeddings=False)")

    def is_local(self, layer: int) -> bool:
        """Whether block ``layer``'s attention is "local" (``attn_types``): it has the sliding window
        and the local rotary base, where the config sets them."""
        return self.attn_types is None or self.attn_types[layer] == "local"

    def to_json(self) -> str:
        fields = {k: v for k, v in dataclasses.asdict(self).items() if k not in _RUNTIME_FIELDS}
        return json.dumps(fields, indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, fields: dict) -> "GPTConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise UserError(f"unknown GPTConfig fields {unknown}; allowed: {sorted(known)}")
        required = {f.name for f in dataclasses.fields(cls)
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
        if required - set(fields):
            raise UserError(f"GPTConfig fields {sorted(required - set(fields))} are missing")
        return cls(**fields)


SPLIT_INPUTS = ("q", "k", "v")  # the inputs GPTModel.set_split_qkv_inputs can give each head its own copy of
_RUNTIME_FIELDS = ("device", "use_split_qkv_input", "precision")  # GPTConfig fields that describe a run, not the model


def _check_choice(name: str, value, allowed: tuple) -> None:
    if value not in allowed:
        raise UserError(f"GPTConfig.{name}={value!r} not supported; allowed: {', '.join(map(repr, allowed))}")


class RMSNorm(nn.Module):
    """(..., d_model) -> (..., d_model): ``weight * x / sqrt(mean(x^2) + eps)``, the statistics in
    float32 (Llama's; Gemma's ``(1 + weight)`` is folded into ``weight`` by its converter)."""

    def __init__(self, d_model: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d_model))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def _norm(cfg: GPTConfig) -> nn.Module:
    """The config's normalisation over d_model: LayerNorm, RMSNorm or none (the identity)."""
    if cfg.normalization_type is None:
        return nn.Identity()
    if cfg.normalization_type == "RMS":
        return RMSNorm(cfg.d_model, cfg.ln_eps)
    return nn.LayerNorm(cfg.d_model, eps=cfg.ln_eps)


class MLP(nn.Module):
    """(batch, pos, d_model) -> (batch, pos, d_model): ``proj(act(fc(x)))``, or with ``gated_mlp``
    ``proj(act(gate(x)) * fc(x))`` (SwiGLU with silu, GeGLU with gelu_tanh).

    ``hook_post`` sees the hidden activation that ``proj`` reads, (batch, pos, d_mlp): one value per
    neuron, TransformerLens's ``blocks.{l}.mlp.hook_post``. Neuron i writes ``hook_post[..., i]``
    times row i of ``proj.weight.T`` into the residual stream (through ``ln2_post`` where the block
    norms the MLP's output: then ``hook_out`` (batch, pos, d_model) sees the output before that norm,
    as the bridge's ``mlp.hook_out``)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = Linear(cfg.d_model, cfg.d_mlp, bias=cfg.mlp_bias)
        self.proj = Linear(cfg.d_mlp, cfg.d_model, bias=cfg.mlp_bias)
        self.gate = Linear(cfg.d_model, cfg.d_mlp, bias=cfg.mlp_bias) if cfg.gated_mlp else None
        self.act = ACTIVATIONS[cfg.act_fn]
        self.hook_post = HookPoint()
        self.hook_out = HookPoint() if cfg.use_normalization_before_and_after else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.act(self.fc(x)) if self.gate is None else self.act(self.gate(x)) * self.fc(x)
        out = self.proj(self.hook_post(hidden))
        return out if self.hook_out is None else self.hook_out(out)

    @property
    def W_out(self) -> torch.Tensor:
        """The output projection (d_mlp, d_model), TransformerLens's name and layout: row i is what
        neuron i writes into the residual stream per unit of its ``hook_post`` activation."""
        return self.proj.weight.T


def _attention(cfg: GPTConfig, layer: int) -> GroupedQueryAttention:
    """Block ``layer``'s attention, with the config's heads, biases, positions (the local ones on a
    local layer: ``GPTConfig.is_local``), score scale and cap, and query/key norms."""
    scale = (cfg.d_head ** -0.5 if cfg.attn_scale is None else 1.0 / cfg.attn_scale) if cfg.use_attn_scale else 1.0
    if cfg.scale_attn_by_inverse_layer_idx:
        scale /= float(layer + 1)
    local = cfg.is_local(layer)
    base = cfg.rotary_base_local if local and cfg.rotary_base_local is not None else cfg.rotary_base
    return GroupedQueryAttention(
        cfg.d_model, cfg.d_model, cfg.n_ctx, cfg.dropout, cfg.n_heads, cfg.n_key_value_heads or cfg.n_heads,
        cfg.qkv_bias, head_dim=cfg.d_head, out_bias=cfg.attn_out_bias,
        rotary_dim=cfg.rotary_dim if cfg.positional_embedding_type == "rotary" else 0, rotary_base=base,
        rotary_divisors=cfg.rotary_divisors,
        alibi=cfg.positional_embedding_type == "alibi", sliding_window=cfg.sliding_window if local else None,
        causal=cfg.causal, scale=scale, soft_cap=cfg.attn_scores_soft_cap,
        qk_norms=(RMSNorm(cfg.d_head, cfg.ln_eps), RMSNorm(cfg.d_head, cfg.ln_eps)) if cfg.use_qk_norm else None,
        out_hook=cfg.use_normalization_before_and_after,
    )


class TransformerBlock(nn.Module):
    """Pre-norm block. Sequential: resid_mid = resid_pre + attn(ln1(resid_pre)), resid_post =
    resid_mid + mlp(ln2(resid_mid)). Parallel (``parallel_attn_mlp``): resid_post = resid_pre +
    attn(ln1(resid_pre)) + mlp(ln2(resid_pre)), with no resid_mid. With
    ``use_normalization_before_and_after`` (Gemma 2 and 3) the outputs are normed too before they
    are added: attn -> ln1_post(attn), mlp -> ln2_post(mlp). ``hook_attn_out`` / ``hook_mlp_out``
    are then what is added to the residual (after the norm, as in TransformerLens and its bridge),
    and ``attn.hook_out`` / ``mlp.hook_out`` the outputs before it (the heads' z @ W_O plus b_O sum
    to ``attn.hook_out``).

    With ``split_inputs`` (none by default; ``GPTModel.set_split_qkv_inputs``) every query head
    reads its own copy of resid_pre for each of those inputs ("q", "k", "v"), hooked before ln1
    as ``hook_q_input``/``hook_k_input``/``hook_v_input`` (batch, pos, head, d_model), as in
    TransformerLens with all three (see ``GroupedQueryAttention.forward_split`` for grouped-query
    heads). ``layer``: the block's index (``scale_attn_by_inverse_layer_idx`` reads it).
    """

    def __init__(self, cfg: GPTConfig, layer: int):
        super().__init__()
        self.attn_only = cfg.attn_only
        self.parallel = cfg.parallel_attn_mlp
        self.ln1 = _norm(cfg)
        self.attn = _attention(cfg, layer)
        self.hook_resid_pre = HookPoint()
        self.hook_attn_out = HookPoint()
        self.hook_resid_post = HookPoint()
        self.split_inputs: tuple[str, ...] = ()
        self.hook_q_input = HookPoint()
        self.hook_k_input = HookPoint()
        self.hook_v_input = HookPoint()
        self.ln1_post = _norm(cfg) if cfg.use_normalization_before_and_after else None
        if not cfg.attn_only:
            self.ln2 = _norm(cfg)
            self.mlp = MLP(cfg)
            self.ln2_post = _norm(cfg) if cfg.use_normalization_before_and_after else None
            if not cfg.parallel_attn_mlp:
                self.hook_resid_mid = HookPoint()
            self.hook_mlp_out = HookPoint()
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, resid: torch.Tensor, past: LayerKV | None = None) -> torch.Tensor:
        resid = self.hook_resid_pre(resid)
        attn_out = self.hook_attn_out(self.dropout(self._attention(resid, past)))
        if self.attn_only:
            return self.hook_resid_post(resid + attn_out)
        if self.parallel:  # summed in GPT-NeoX's and Phi's order, so the floats agree to the bit
            return self.hook_resid_post(attn_out + self._mlp_out(resid) + resid)
        return self.forward_from_mid(resid + attn_out)

    def forward_from_mid(self, resid_mid: torch.Tensor) -> torch.Tensor:
        """The block after its attention: resid_mid (batch, pos, d_model) -> resid_post. A run may
        start here (``GPTModel.forward(..., start_at_resid_mid=True)``); sequential blocks with an
        MLP only (``has_resid_mid``)."""
        resid = self.hook_resid_mid(resid_mid)
        return self.hook_resid_post(resid + self._mlp_out(resid))

    @property
    def has_resid_mid(self) -> bool:
        """Whether a residual lies between the attention and the MLP (not parallel, not attn-only)."""
        return not (self.attn_only or self.parallel)

    def _attention(self, resid: torch.Tensor, past: LayerKV | None) -> torch.Tensor:
        """The attention's contribution to the residual (batch, pos, d_model), through ``ln1_post``
        where the block has it."""
        out = self._attention_output(resid, past)
        return out if self.ln1_post is None else self.ln1_post(out)

    def _attention_output(self, resid: torch.Tensor, past: LayerKV | None) -> torch.Tensor:
        if not self.split_inputs:
            return self.attn(self.ln1(resid), past)
        if past is not None:
            raise UserError("per-head q/k/v inputs (use_split_qkv_input) do not work with a key/value cache")
        shared = self.ln1(resid) if len(self.split_inputs) < 3 else None
        copies = repeat(resid, "b p d -> b p h d", h=self.attn.num_heads)  # a view: each hook gets its own copy
        hooks = {"q": self.hook_q_input, "k": self.hook_k_input, "v": self.hook_v_input}
        inputs = [self.ln1(hook(copies.clone())) if which in self.split_inputs else shared
                  for which, hook in hooks.items()]
        return self.attn.forward_split(*inputs)

    def _mlp_out(self, resid: torch.Tensor) -> torch.Tensor:
        out = self.mlp(self.ln2(resid))
        return self.hook_mlp_out(self.dropout(out if self.ln2_post is None else self.ln2_post(out)))


class GPTModel(HeadWeights, HookedModule):
    """A from-scratch GPT with TransformerLens hook points.

    ``model(tokens)`` returns logits (batch, pos, d_vocab). Inputs may be token ids (batch, pos),
    a string or a list of strings (tokenised with ``to_tokens``, BOS prepended), or -- with
    ``start_at_layer=l`` -- the residual stream entering block l, (batch, pos, d_model), or with
    ``start_at_resid_mid=True`` too, block l's ``resid_mid`` (the run starts after l's attention).
    """

    # ``model(resid, start_at_layer=l)`` computes only blocks l.. (a TransformerBridge reruns the
    # earlier ones), so interventions at layer l may start there; analyses read this capability.
    suffix_only_start = True

    @property
    def resid_mid_start(self) -> bool:
        """Whether a run may start at a block's ``resid_mid`` (``start_at_resid_mid``)."""
        return self.blocks[0].has_resid_mid
    impl = "scratch"  # which implementation runs it (``interp.provenance``)
    family = "interp-gpt"  # the architecture it was loaded as: a converter sets its model_type ("llama", ...)

    def __init__(self, cfg: GPTConfig, tokenizer: Tokenizer | None = None):
        super().__init__()
        self.cfg = dataclasses.replace(cfg)  # its own copy: _apply keeps cfg.device in sync with this model
        self.tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
        self.embed = nn.Embedding(cfg.d_vocab, cfg.d_model)
        if cfg.post_embedding_ln:
            self.ln_embed = _norm(cfg)
        self.hook_embed = HookPoint()
        if cfg.positional_embedding_type == "standard":  # learned; rotary and ALiBi live in the attention
            self.pos_embed = nn.Embedding(cfg.n_ctx, cfg.d_model)
            self.hook_pos_embed = HookPoint()
        self.drop_embed = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList([TransformerBlock(cfg, layer) for layer in range(cfg.n_layers)])
        self.ln_final = _norm(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.d_model, cfg.d_vocab_out, bias=cfg.unembed_bias)
        self.setup()
        self.set_use_split_qkv_input(cfg.use_split_qkv_input)
        self.set_precision(cfg.precision)

    def set_precision(self, precision: str) -> None:
        """``"float32"`` (the default) or ``"mixed"``: the products of the query, key, value and output
        projections and of the MLPs run in bfloat16 (float32 accumulation), on their float32
        weights cast to bfloat16 at each product; the residual stream, norms, rotary, attention
        scores and pattern, the embeddings, the unembedding and every hook stay float32
        (``interp.precision``). ``cfg.precision`` says which."""
        self.cfg.precision = check_precision(precision)
        for module in self.modules():
            if isinstance(module, Linear):
                module.mixed = precision == "mixed"

    def set_use_split_qkv_input(self, use_split_qkv_input: bool) -> None:
        """Give every query head its own hooked copies of the residual for its query, key and
        value (``blocks.{l}.hook_{q,k,v}_input``, (batch, pos, head, d_model), before ln1), as
        TransformerLens's switch of the same name; off by default (the forward is faster)."""
        self.set_split_qkv_inputs(SPLIT_INPUTS if use_split_qkv_input else ())

    def set_split_qkv_inputs(self, inputs: Sequence[str]) -> None:
        """Per-head copies for only ``inputs`` (some of "q", "k", "v"; empty: none), so an analysis
        that reads one input's hooks does not pay for all three. ``cfg.use_split_qkv_input`` says
        whether any is split; ``split_qkv_inputs`` which."""
        unknown = [which for which in inputs if which not in SPLIT_INPUTS]
        if unknown:
            raise UserError(f"unknown q/k/v inputs {unknown}; allowed: {', '.join(SPLIT_INPUTS)}")
        self.split_qkv_inputs = tuple(which for which in SPLIT_INPUTS if which in inputs)
        self.cfg.use_split_qkv_input = bool(self.split_qkv_inputs)
        for block in self.blocks:
            block.split_inputs = self.split_qkv_inputs

    def _apply(self, fn, *args, **kwargs):
        """Every .to()/.cuda()/.cpu() goes through here: keep ``cfg.device`` in sync."""
        module = super()._apply(fn, *args, **kwargs)
        self.cfg.device = str(self.embed.weight.device)
        return module

    # ------------------------------------------------------------------ tokens
    def to_tokens(self, text: str | Sequence[str], prepend_bos: bool | None = None) -> torch.Tensor:
        """Text -> token ids (batch, pos) by the one rule of ``interp.tokenizer.encode_texts``; the
        start token first when ``prepend_bos`` (None: ``cfg.default_prepend_bos``, as in
        TransformerLens). A list of texts must tokenise to equal lengths (``encode_texts`` pads
        ragged batches and returns their lengths)."""
        batch = encode_texts(self.tokenizer, text, self.cfg.n_ctx, prepend_bos=self.cfg.default_prepend_bos if prepend_bos is None else prepend_bos, equal_lengths=True)
        return batch.tokens.to(self.embed.weight.device)

    def to_string(self, tokens: torch.Tensor | Sequence[int]) -> str | list[str]:
        """Token ids -> text (BOS dropped). (pos,) -> str; (batch, pos) -> list of str."""
        tokens = torch.as_tensor(tokens)
        if tokens.ndim == 2:
            return [self.to_string(row) for row in tokens]
        return self.tokenizer.decode([int(t) for t in tokens if int(t) != self.tokenizer.bos_token_id])

    def to_str_tokens(self, text: str | torch.Tensor) -> list[str]:
        """One string per token (BOS included), for axis labels."""
        tokens = self.to_tokens(text)[0] if isinstance(text, str) else torch.as_tensor(text).flatten()
        return ["<bos>" if int(t) == self.tokenizer.bos_token_id else self.tokenizer.decode([int(t)]) for t in tokens]

    def _as_tokens(self, tokens) -> torch.Tensor:
        if isinstance(tokens, (str, list, tuple)):
            return self.to_tokens(tokens)
        return check_token_ids(tokens, self.cfg.d_vocab, self.cfg.n_ctx).to(self.embed.weight.device)

    # ----------------------------------------------------------------- forward
    def embed_tokens(self, tokens: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """tokens (batch, pos) -> residual stream entering block 0 (batch, pos, d_model)."""
        n_pos = tokens.shape[1]
        if offset + n_pos > self.cfg.n_ctx:
            raise UserError(f"sequence of {offset + n_pos} tokens exceeds the context n_ctx={self.cfg.n_ctx}")
        embeddings = self.embed(tokens)
        # the scale rounded once, straight to the embeddings' dtype, as Gemma does (a float32 buffer
        # would be rounded twice in bfloat16 and differ from Gemma's in float64)
        embeddings = embeddings * embeddings.new_tensor(self.cfg.embed_scale)
        if self.cfg.post_embedding_ln:
            embeddings = self.ln_embed(embeddings)
        resid = self.hook_embed(embeddings)  # as the token embeddings enter the residual stream
        if self.cfg.positional_embedding_type == "standard":
            positions = torch.arange(offset, offset + n_pos, device=tokens.device)
            # a tensor of its own for the hook (not a view expanded over the batch): an in-place edit of
            # one prompt or one position then changes that prompt or position alone
            resid = resid + self.hook_pos_embed(self.pos_embed(positions).expand_as(resid).clone())
        return self.drop_embed(resid)

    def unembed(self, resid: torch.Tensor) -> torch.Tensor:
        """Final residual (batch, pos, d_model) -> logits (batch, pos, d_vocab_out): the final norm, then
        ``embed.weight`` transposed (tied) or ``lm_head``, then ``cap * tanh(logits / cap)`` where
        ``output_logits_soft_cap`` sets a cap (Gemma 2 and 3)."""
        normed = self.ln_final(resid)
        logits = normed @ self.embed.weight.T if self.cfg.tie_word_embeddings else self.lm_head(normed)
        cap = self.cfg.output_logits_soft_cap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def forward(
        self,
        input,
        return_type: ReturnType = "logits",
        *,
        start_at_layer: int | None = None,
        stop_at_layer: int | None = None,
        tokens: torch.Tensor | None = None,
        past_kv: list[LayerKV] | None = None,
        loss_per_token: bool = False,
        start_at_resid_mid: bool = False,
    ):
        """Run the model.

        Args:
            input: token ids (batch, pos), text, or with ``start_at_layer`` the residual
                (batch, pos, d_model) entering that block.
            return_type: "logits" (batch, pos, d_vocab), "loss" (next-token cross-entropy: a
                scalar, or (batch, pos-1) with ``loss_per_token``), "both" or None.
            start_at_layer / stop_at_layer: run blocks [start, stop). With ``stop_at_layer`` the
                residual entering that block is returned, as in TransformerLens.
            tokens: the token ids, needed for a loss when ``input`` is a residual.
            past_kv: per-layer key/value caches from earlier positions (see ``generate``).
            start_at_resid_mid: with ``start_at_layer=l``, ``input`` is block l's ``resid_mid``
                and the run begins after l's attention (blocks with ``has_resid_mid`` only).
        """
        start = self._check_layer(start_at_layer, "start_at_layer", 0)
        stop = self._check_layer(stop_at_layer, "stop_at_layer", self.cfg.n_layers)
        if start_at_resid_mid:
            self._check_mid_start(start_at_layer, stop)
        if start_at_layer is None:
            tokens = self._as_tokens(input)
            offset = 0 if past_kv is None else past_kv[0].length
            resid = self.embed_tokens(tokens, offset)
        else:
            # the caller's tensor is never a hook's to edit: hooks at the start edit a copy
            resid = input.clone()
            if resid.ndim != 3 or resid.shape[-1] != self.cfg.d_model:
                raise UserError(f"with start_at_layer the input must be a residual (batch, pos, {self.cfg.d_model}), got {tuple(resid.shape)}")
        if start_at_resid_mid:
            resid, start = self.blocks[start].forward_from_mid(resid), start + 1
        for layer in range(start, stop):
            resid = self.blocks[layer](resid, None if past_kv is None else past_kv[layer])
        if stop_at_layer is not None:
            return resid
        if return_type is None:
            return None
        logits = self.unembed(resid)
        if return_type == "logits":
            return logits
        if tokens is None:
            raise UserError("a loss needs the token ids: pass tokens=... when input is a residual")
        if self.cfg.d_vocab_out != self.cfg.d_vocab:
            raise UserError(f"a next-token loss needs outputs over the input vocabulary; this model's d_vocab_out="
                            f"{self.cfg.d_vocab_out} differs from d_vocab={self.cfg.d_vocab} (return_type='logits')")
        loss = next_token_loss(logits, tokens, per_token=loss_per_token)
        return loss if return_type == "loss" else (logits, loss)

    def _check_mid_start(self, start_at_layer: int | None, stop: int) -> None:
        if start_at_layer is None or not start_at_layer < stop:
            raise UserError(f"start_at_resid_mid needs start_at_layer below stop_at_layer={stop} "
                            f"(got start_at_layer={start_at_layer})")
        if not self.blocks[start_at_layer].has_resid_mid:
            raise UserError("start_at_resid_mid needs blocks with a resid_mid; this model's blocks are "
                            f"{'attention-only' if self.cfg.attn_only else 'parallel'}")

    def _check_layer(self, layer: int | None, name: str, default: int) -> int:
        if layer is None:
            return default
        if not 0 <= layer <= self.cfg.n_layers:
            raise UserError(f"{name}={layer} out of range [0, {self.cfg.n_layers}]")
        return layer

    # -------------------------------------------------------------- generation
    @torch.no_grad()
    def generate(
        self,
        input,
        max_new_tokens: int = 20,
        *,
        use_kv_cache: bool = True,
        temperature: float = 0.0,
        seed: int | None = None,
    ) -> torch.Tensor:
        """Extend ``input`` (text or ids) by ``max_new_tokens`` tokens -> ids (batch, pos + new).

        Greedy when ``temperature == 0``, else sampled with a generator seeded by ``seed``. With
        the KV cache each step runs only the new token; the result is the same token for token.
        """
        tokens = self._as_tokens(input)
        require_causal(self, "generation")
        if max_new_tokens < 0:
            raise UserError(f"max_new_tokens={max_new_tokens} must be >= 0")
        if tokens.shape[1] + max_new_tokens > self.cfg.n_ctx:
            raise UserError(f"{tokens.shape[1]} + {max_new_tokens} new tokens exceed the context n_ctx={self.cfg.n_ctx}")
        generator = None
        if temperature > 0:
            generator = torch.Generator(device=tokens.device).manual_seed(0 if seed is None else seed)
        past = [LayerKV() for _ in self.blocks] if use_kv_cache else None
        step_input = tokens
        for _ in range(max_new_tokens):
            logits = self(step_input, past_kv=past)[:, -1]
            if temperature > 0:
                probs = torch.softmax(logits / temperature, dim=-1)
                next_token = torch.multinomial(probs, 1, generator=generator)
            else:
                next_token = logits.argmax(dim=-1, keepdim=True)
            tokens = torch.cat([tokens, next_token], dim=1)
            step_input = next_token if use_kv_cache else tokens
        return tokens

    def check_finite(self) -> None:
        """Raise if any weight is NaN or infinite (a corrupt checkpoint). Checked 4M values at a time:
        ``isfinite`` on a whole embedding makes temporaries of its size (at load, a second model)."""
        for name, param in self.state_dict().items():
            chunks = param.reshape(-1).split(1 << 22) if param.is_floating_point() else ()
            if not all(torch.isfinite(chunk).all() for chunk in chunks):
                raise UserError(f"weight {name!r} has non-finite values (NaN or inf); the checkpoint is corrupt")


def require_causal(model, what: str) -> None:
    """Refuse, in one line, a model whose attention is not causal (``cfg.causal=False``) for ``what``,
    an analysis that assumes a position sees only itself and earlier ones."""
    if not getattr(model.cfg, "causal", True):
        raise UserError(f"{what} assumes causal attention; this model attends both ways (cfg.causal=False, "
                        "e.g. a Tracr program compiled without causal=True)")


def next_token_loss(logits: torch.Tensor, tokens: torch.Tensor, per_token: bool = False) -> torch.Tensor:
    """Cross-entropy of predicting tokens[:, 1:] from logits[:, :-1]; scalar or (batch, pos-1)."""
    log_probs = logits[:, :-1].log_softmax(dim=-1)
    losses = -log_probs.gather(-1, tokens[:, 1:, None])[..., 0]
    return losses if per_token else losses.mean()
