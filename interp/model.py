"""``GPTModel``: GPT-2's architecture built from ``interp.attention.MultiHeadAttention``.

Token + learned position embeddings, pre-LayerNorm blocks (attention, then a GELU-tanh MLP unless
``attn_only``), a final LayerNorm and an unembedding tied to the token embedding. Hook names follow
TransformerLens (DESIGN section 2), so every analysis treats it like a ``TransformerBridge``:

    hook_embed, hook_pos_embed, blocks.{l}.hook_resid_pre          (batch, pos, d_model)
    blocks.{l}.attn.hook_q / hook_k / hook_v / hook_z              (batch, pos, head, d_head)
    blocks.{l}.attn.hook_attn_scores / hook_pattern                (batch, head, q_pos, k_pos)
    blocks.{l}.hook_attn_out, hook_resid_mid, hook_mlp_out, hook_resid_post   (batch, pos, d_model)

(``attn_only`` models have no ``hook_resid_mid`` / ``hook_mlp_out``.)
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Literal, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from transformer_lens.hook_points import HookPoint

from interp.attention import LayerKV, MultiHeadAttention
from interp.hooked import HookedModule
from interp.tokenizer import ByteTokenizer, Tokenizer, check_token_ids, encode_texts
from interp.errors import UserError

ReturnType = Literal["logits", "loss", "both", None]


@dataclass
class GPTConfig:
    """Shape of a ``GPTModel``; field names match TransformerLens's ``cfg``."""

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

    def __post_init__(self):
        for name in ("d_vocab", "n_ctx", "d_model", "n_heads", "n_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise UserError(f"GPTConfig.{name}={value!r} must be a positive integer")
        if self.d_model % self.n_heads:
            raise UserError(f"d_model={self.d_model} must be divisible by n_heads={self.n_heads}")
        if not 0.0 <= self.dropout < 1.0:
            raise UserError(f"dropout={self.dropout} must be in [0, 1)")
        if self.d_mlp is None:
            self.d_mlp = 4 * self.d_model

    @property
    def d_head(self) -> int:
        return self.d_model // self.n_heads

    def to_json(self) -> str:
        fields = {k: v for k, v in dataclasses.asdict(self).items() if k != "device"}
        return json.dumps(fields, indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, fields: dict) -> "GPTConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise UserError(f"unknown GPTConfig fields {unknown}; allowed: {sorted(known)}")
        return cls(**fields)


class MLP(nn.Module):
    """(batch, pos, d_model) -> (batch, pos, d_model): Linear, GELU (tanh), Linear."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.d_mlp)
        self.proj = nn.Linear(cfg.d_mlp, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class TransformerBlock(nn.Module):
    """Pre-LayerNorm block: resid_mid = resid_pre + attn(ln1(resid_pre)); resid_post = resid_mid + mlp(ln2(.))."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.attn_only = cfg.attn_only
        self.ln1 = nn.LayerNorm(cfg.d_model, eps=cfg.ln_eps)
        self.attn = MultiHeadAttention(cfg.d_model, cfg.d_model, cfg.n_ctx, cfg.dropout, cfg.n_heads, cfg.qkv_bias)
        self.hook_resid_pre = HookPoint()
        self.hook_attn_out = HookPoint()
        self.hook_resid_post = HookPoint()
        if not cfg.attn_only:
            self.ln2 = nn.LayerNorm(cfg.d_model, eps=cfg.ln_eps)
            self.mlp = MLP(cfg)
            self.hook_resid_mid = HookPoint()
            self.hook_mlp_out = HookPoint()
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, resid: torch.Tensor, past: LayerKV | None = None) -> torch.Tensor:
        resid = self.hook_resid_pre(resid)
        resid = resid + self.hook_attn_out(self.dropout(self.attn(self.ln1(resid), past)))
        if not self.attn_only:
            resid = self.hook_resid_mid(resid)
            resid = resid + self.hook_mlp_out(self.dropout(self.mlp(self.ln2(resid))))
        return self.hook_resid_post(resid)


class GPTModel(HookedModule):
    """A from-scratch GPT with TransformerLens hook points.

    ``model(tokens)`` returns logits (batch, pos, d_vocab). Inputs may be token ids (batch, pos),
    a string or a list of strings (tokenised with ``to_tokens``, BOS prepended), or -- with
    ``start_at_layer=l`` -- the residual stream entering block l, (batch, pos, d_model).
    """

    # ``model(resid, start_at_layer=l)`` computes only blocks l.. (a TransformerBridge reruns the
    # earlier ones), so interventions at layer l may start there; analyses read this capability.
    suffix_only_start = True
    impl = "scratch"  # which implementation runs it (``interp.provenance``)
    family = "interp-gpt"  # the architecture it was loaded as; a converted GPT-2 says "gpt2"

    def __init__(self, cfg: GPTConfig, tokenizer: Tokenizer | None = None):
        super().__init__()
        self.cfg = dataclasses.replace(cfg)  # its own copy: _apply keeps cfg.device in sync with this model
        self.tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
        self.embed = nn.Embedding(cfg.d_vocab, cfg.d_model)
        self.pos_embed = nn.Embedding(cfg.n_ctx, cfg.d_model)
        self.hook_embed = HookPoint()
        self.hook_pos_embed = HookPoint()
        self.drop_embed = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList([TransformerBlock(cfg) for _ in range(cfg.n_layers)])
        self.ln_final = nn.LayerNorm(cfg.d_model, eps=cfg.ln_eps)
        self.setup()

    def _apply(self, fn, *args, **kwargs):
        """Every .to()/.cuda()/.cpu() goes through here: keep ``cfg.device`` in sync."""
        module = super()._apply(fn, *args, **kwargs)
        self.cfg.device = str(self.embed.weight.device)
        return module

    # ------------------------------------------------------------------ tokens
    def to_tokens(self, text: str | Sequence[str], prepend_bos: bool = True) -> torch.Tensor:
        """Text -> token ids (batch, pos), BOS first, by the one rule of ``interp.tokenizer.encode_texts``.
        A list of texts must tokenise to equal lengths (``encode_texts`` pads ragged batches and
        returns their lengths)."""
        batch = encode_texts(self.tokenizer, text, self.cfg.n_ctx, prepend_bos=prepend_bos, equal_lengths=True)
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
        positions = torch.arange(offset, offset + n_pos, device=tokens.device)
        resid = self.hook_embed(self.embed(tokens)) + self.hook_pos_embed(self.pos_embed(positions))[None]
        return self.drop_embed(resid)

    def unembed(self, resid: torch.Tensor) -> torch.Tensor:
        """Final residual (batch, pos, d_model) -> logits (batch, pos, d_vocab), tied to ``embed``."""
        return self.ln_final(resid) @ self.embed.weight.T

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
        """
        start = self._check_layer(start_at_layer, "start_at_layer", 0)
        stop = self._check_layer(stop_at_layer, "stop_at_layer", self.cfg.n_layers)
        if start_at_layer is None:
            tokens = self._as_tokens(input)
            offset = 0 if past_kv is None else past_kv[0].length
            resid = self.embed_tokens(tokens, offset)
        else:
            resid = input
            if resid.ndim != 3 or resid.shape[-1] != self.cfg.d_model:
                raise UserError(f"with start_at_layer the input must be a residual (batch, pos, {self.cfg.d_model}), got {tuple(resid.shape)}")
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
        loss = next_token_loss(logits, tokens, per_token=loss_per_token)
        return loss if return_type == "loss" else (logits, loss)

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
        """Raise if any weight is NaN or infinite (a corrupt checkpoint)."""
        for name, param in self.state_dict().items():
            if param.is_floating_point() and not torch.isfinite(param).all():
                raise UserError(f"weight {name!r} has non-finite values (NaN or inf); the checkpoint is corrupt")


def next_token_loss(logits: torch.Tensor, tokens: torch.Tensor, per_token: bool = False) -> torch.Tensor:
    """Cross-entropy of predicting tokens[:, 1:] from logits[:, :-1]; scalar or (batch, pos-1)."""
    log_probs = logits[:, :-1].log_softmax(dim=-1)
    losses = -log_probs.gather(-1, tokens[:, 1:, None])[..., 0]
    return losses if per_token else losses.mean()
