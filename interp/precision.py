"""Mixed precision for ``GPTModel``: the linear maps' products in bfloat16, everything else float32.

``GPTModel.set_precision("mixed")`` (``load_model(..., precision="mixed")``, ``--precision mixed``)
runs the products of the query, key, value and output projections and of the MLP's matrices with
bfloat16 inputs and weights; the CPU's bfloat16 instructions (AVX-512 BF16, AMX) make them several
times faster than float32 products. torch's bfloat16 matrix product accumulates in float32 (on the
CPU: oneDNN's bf16 gemm, OpenBLAS's sbgemm into a float C, or ATen's own kernel with
``opmath_type<BFloat16> = float``; ``aten/src/ATen/native/cpu/BlasKernel.cpp``, ``cpublas::gemm``),
and only its result is rounded to bfloat16; ``tests/test_precision.py`` checks the accumulation.

What stays float32 (measured on SmolLM2, ``benchmarks/bench_precision.py``): the weights themselves
(each linear map's weight is cast to bfloat16 for each product, no copy held), the residual
stream, every norm, the rotary angles, the attention scores, softmax and pattern, the attention's
mix of values, the unembedding (tied or not), the embeddings, and every hook: each product's input
is cast to bfloat16 just before it and its output back to float32 (the bias added in float32) just
after it, so ``hook_q``, ``hook_z``, ``hook_attn_out``, ``mlp.hook_post`` ... hand float32 tensors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from interp.errors import UserError

PRECISIONS = ("float32", "mixed")  # GPTConfig.precision, load_model(precision=...), --precision
LOW = torch.bfloat16  # the dtype of the mixed products' inputs and weights


def check_precision(precision: str) -> str:
    """``precision`` if it is one of ``PRECISIONS``, else a one-line error naming the allowed ones."""
    if precision not in PRECISIONS:
        raise UserError(f"precision {precision!r} not supported; allowed: {', '.join(PRECISIONS)}")
    return precision


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, same state dict) whose product runs in bfloat16 while
    ``mixed`` is set (``GPTModel.set_precision``): x (..., in) -> (..., out) in x's dtype, from
    ``x`` and the weight rounded to bfloat16, accumulated in float32, the result rounded to
    bfloat16, cast back and the bias added in x's dtype.

    The weight is cast to bfloat16 at every product, never held: a held copy goes stale when the
    float32 weight is edited through ``.data`` (as ablation scripts do), an edit that leaves no
    trace on the parameter (its version counter, its storage, its identity) to check against. The
    cast reads the weight once per product, a small part of the product's own cost from tens of
    token rows up (``benchmarks/README.md``, "Mixed precision's bfloat16 weights"); gradients reach
    the float32 weight through it."""

    mixed: bool = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.mixed:
            return super().forward(x)
        return restore(F.linear(x.to(LOW), self.low_weight()), x.dtype, self.bias)

    def low_weight(self) -> torch.Tensor:
        """The weight (out, in) cast to bfloat16 now, from its float32 values as they are."""
        return self.weight.to(LOW)


def restore(product: torch.Tensor, dtype: torch.dtype, bias: torch.Tensor | None) -> torch.Tensor:
    """A bfloat16 product -> ``dtype``, plus ``bias`` (added in the wider dtype: bfloat16 plus a
    float32 bias is computed and returned in float32)."""
    out = product if bias is None else product + bias
    return out.to(dtype)


def rounded_dtype(model, dtype: torch.dtype) -> torch.dtype:
    """The dtype a model's linear products were rounded to, for outputs it hands in ``dtype``:
    ``LOW`` under mixed precision (its float32 outputs carry bfloat16 rounding), else ``dtype``."""
    return LOW if getattr(model.cfg, "precision", "float32") == "mixed" else dtype
