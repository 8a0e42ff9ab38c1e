"""The final norm and unembedding of a ``GPTModel`` split into a linear map and a per-row scale, so
that the logits of ``final + change`` for many small changes cost less than one full unembedding each.

For the norms ``GPTModel`` has (architecture §2), with ``x`` a final residual (d_model,):

- LayerNorm: ``logits(x) = s(x) * (centre(x) * w) @ W_U^T + (b @ W_U^T + b_U)``, ``s = rsqrt(var(x) + eps)``;
- RMSNorm:   ``logits(x) = s(x) * (x * w) @ W_U^T + b_U``, ``s = rsqrt(mean(x^2) + eps)``;
- no norm:   ``logits(x) = x @ W_U^T + b_U``, ``s = 1``.

The part ``linear(x) = normed(x) @ W_U^T``, ``normed(x) = centre(x) * w`` (centring for LayerNorm
only), is linear in ``x``, so
``linear(clean + change) = linear(clean) + linear(change)``: the clean part is made once per
position and shared by every change, and a head's change ``dz @ W_O[head]`` (dz: (n, d_head)) has
``linear = dz @ normed(W_O[head]) @ W_U^T``, a product of depth d_head instead of d_model once
the (d_head, d_vocab) matrix is made. ``W_U`` is the model's own (a float32 model's weight read in
place, not copied), so the split holds only the heads' (d_head, d_vocab) readouts. Only ``s`` needs
the whole changed residual, which costs d_model per row. A final soft cap (``output_logits_soft_cap``: Gemma 2's ``logits -> cap * tanh(logits /
cap)``) is elementwise on the logits, so it is applied to them last, as ``model.unembed`` applies
it. The result equals ``model.unembed(clean + change)`` up to float rounding (a different order of
the same sums); ``exact_for`` says where that holds to float32 precision.
"""

from __future__ import annotations

import torch

from analyses.core.hook_check import logit_soft_cap


class FinalReadout:
    """``model.unembed`` of a ``GPTModel`` as ``scale(x) * linear(x) + offset`` (see the module)."""

    def __init__(self, model):
        norm, cfg = model.ln_final, model.cfg
        W_U = (model.embed.weight if cfg.tie_word_embeddings else model.lm_head.weight).detach().float()  # (vocab, d_model)
        weight = getattr(norm, "weight", None)
        weight = torch.ones(cfg.d_model, device=W_U.device) if weight is None else weight.detach().float()
        self.centred = cfg.normalization_type == "LN"  # GPTModel's norms (interp.model.NORMS): "LN", "RMS", None
        self.rms = cfg.normalization_type == "RMS"
        self.eps = getattr(norm, "eps", 0.0)
        self.weight = weight  # (d_model,): the norm's weight, applied by ``normed``
        self.readout = W_U.T  # (d_model, vocab): the unembedding as the model holds it (float32: no copy)
        offset = torch.zeros(W_U.shape[0], device=W_U.device)
        if self.centred and norm.bias is not None:
            offset = offset + W_U @ norm.bias.detach().float()
        if not cfg.tie_word_embeddings and model.lm_head.bias is not None:
            offset = offset + model.lm_head.bias.detach().float()
        self.offset = offset  # (vocab,)
        self.cap = logit_soft_cap(model)  # None: the logits are not capped

    @staticmethod
    def exact_for(model) -> bool:
        """Whether this split reproduces ``model.unembed`` of a ``GPTModel`` to float32 precision:
        where its weights are float32 or float64 (a lower precision rounds the normed residual, which
        the split does not). Every norm a ``GPTModel`` can have (LayerNorm, RMSNorm, none) is split."""
        return model.embed.weight.dtype in (torch.float32, torch.float64)

    @staticmethod
    def held_mb(model) -> float:
        """What the split holds while it works, in MB: the (d_head, vocab) float32 readouts of one
        layer's heads (the unembedding it reads is the model's own)."""
        cfg = model.cfg
        return cfg.n_heads * cfg.d_head * cfg.d_vocab * 4 / 2 ** 20

    def normed(self, x: torch.Tensor) -> torch.Tensor:
        """(..., d_model) -> (..., d_model) float32: the norm without its scale, ``centre(x) * w``
        (minus the mean over the last axis for LayerNorm only); ``normed(x) @ self.readout`` is
        ``linear(x)``."""
        x = x.float()
        return (x - x.mean(-1, keepdim=True) if self.centred else x) * self.weight

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """Final residuals (..., d_model) -> their linear part (..., vocab), float32."""
        return self.normed(x) @ self.readout

    def head_readout(self, W_O: torch.Tensor) -> torch.Tensor:
        """A head's output projection (d_head, d_model) -> (d_head, vocab): ``linear`` of its write
        ``dz @ W_O`` is ``dz @`` this."""
        return self.normed(W_O.detach()) @ self.readout

    def scale(self, x: torch.Tensor) -> torch.Tensor:
        """Final residuals (..., d_model) -> the norm's scale (..., 1), float32."""
        x = x.float()
        if self.rms:
            return torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.centred:
            return torch.rsqrt(x.var(-1, unbiased=False, keepdim=True) + self.eps)
        return torch.ones_like(x[..., :1])

    def logits(self, base: torch.Tensor, change: torch.Tensor, readout: torch.Tensor, scale: torch.Tensor,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """The logits ``scale * (base + change @ readout) + offset`` (..., vocab), then capped where the
        model caps its logits (``cap * tanh(logits / cap)``), written into ``out``
        where given: ``base`` (..., vocab) the clean residual's ``linear``, ``change`` (..., k) what a
        change feeds ``readout`` (k, vocab) (a head's z change and its ``head_readout``, or a residual
        change through ``normed`` and ``self.readout``), ``scale`` (..., 1) the changed residual's. One
        elementwise pass and one product (the scale multiplies ``change`` before it: equal up to float
        rounding)."""
        out = torch.addcmul(self.offset, base, scale, out=out)
        out.view(-1, out.shape[-1]).addmm_((change * scale).reshape(-1, change.shape[-1]), readout)
        if self.cap is not None:
            out.div_(self.cap).tanh_().mul_(self.cap)
        return out
