"""The copying roles' score and its null (architecture §4.7): each head's OV circuit read for copying,
against the same architecture at random initialisation.

A head's full OV circuit on the tokens (Elhage et al. 2021) is the (vocab x vocab) matrix
``M_h = W_E W_V[h] W_O[h] W_U``; its ``copying`` score is sum(Re eig) / sum(|eig|) of M_h, in [-1, 1]
(``copy_suppression`` its negative). The nonzero eigenvalues are those of the (d_head x d_head)
``W_O W_U W_E W_V``, so no vocab x vocab matrix is made (``ov_eigenvalues``). ``meaning_nulls`` tests
both roles of every head against the random-initialisation null of ``analyses.roles.nulls``; the
role calibration puts them in one false-discovery family with the attention roles
(``analyses.roles.calibration.role_calibration``). The scores' other readings (top-k copying, QK
positional scores, the calibrated roles alone) are ``analyses.components.meaning``'s.
"""

from __future__ import annotations

import math
from typing import Sequence

import pandas as pd
import torch

from analyses.core.budget import DEFAULT_MEMORY_MB, left_after, model_mb
from analyses.core.execution import executing
from analyses.core.tokens import accumulator_dtype
from analyses.roles.classify import MEANING_ROLES
from analyses.roles.nulls import (BAND_Z, DEFAULT_NULL_SEEDS, check_null_seeds, head_frame, layer_null, score_random_models,
                                  t_log_upper_tail, t_upper_tail, z_score)
from interp.errors import UserError
from interp.weights import expand_kv_heads


def ov_eigenvalues(model, *, memory_mb: float = DEFAULT_MEMORY_MB) -> torch.Tensor:
    """The nonzero eigenvalues of every head's ``W_E W_V W_O W_U`` -> (layer, head, d_head) complex
    (complex128; complex64 on mps), from the (d_head x d_head) ``W_O W_U W_E W_V``. ``W_U W_E``
    (d_model, d_model) is summed in the accumulators' dtype (float64; float32 on mps) over slices
    of the vocabulary that fit ``memory_mb`` (no wide copy of either matrix)."""
    W_E, W_U = embed_unembed(model)
    W_O, W_V = model.W_O.detach(), expand_kv_heads(model.W_V.detach(), model.cfg.n_heads)
    d_model, n_vocab = W_U.shape
    wide = accumulator_dtype(W_U.device)
    step = max(1, int(memory_mb * 2**20 // (2 * 8 * d_model)))
    unembed_embed = sum(W_U[:, start:start + step].to(wide) @ W_E[start:start + step].to(wide)
                        for start in range(0, n_vocab, step))  # (d_model, d_model)
    small = [W_O[layer].to(wide) @ unembed_embed @ W_V[layer].to(wide)  # (head, d_head, d_head): a layer at a time
             for layer in range(W_O.shape[0])]
    return torch.linalg.eigvals(torch.stack(small))


def embed_unembed(model) -> tuple[torch.Tensor, torch.Tensor]:
    """(W_E (vocab, d_model), W_U (d_model, vocab)) as stored (the model's dtype), refused where the
    unembedding's outputs are not the input vocabulary."""
    W_E, W_U = model.W_E.detach(), model.W_U.detach()
    if W_U.shape[1] != W_E.shape[0]:
        raise UserError(f"copying scores need the unembedding over the input vocabulary; this model maps "
                        f"{W_E.shape[0]} input tokens to {W_U.shape[1]} outputs")
    return W_E, W_U


def copying_from_eigenvalues(eigenvalues: torch.Tensor) -> torch.Tensor:
    """(..., n) complex eigenvalues -> (...) sum(Re) / sum(|.|) (0 where all are 0)."""
    total = eigenvalues.abs().sum(-1)
    return torch.where(total > 0, eigenvalues.real.sum(-1) / total.clamp(min=1e-300), torch.zeros_like(total))


def meaning_nulls(model, null_seeds: Sequence[int] = DEFAULT_NULL_SEEDS, progress: bool | None = None, *,
                  memory_mb: float | None = None, null_scores: torch.Tensor | None = None) -> pd.DataFrame:
    """``copying`` and ``copy_suppression`` against the random-initialisation null: a tidy frame,
    one row per (layer, head, role) with the columns of ``analyses.roles.nulls.role_nulls`` (``score, null,
    null_center, null_spread, null_low, null_high, z, p, log10_p``). One null model is alive at a
    time, counted in ``memory_mb`` (its eigenvalues get what it leaves). ``null_scores``: the null
    models' ``null_copying`` at ``null_seeds``, (seeds, layer, head), measured here where None.
    ``memory_mb``, ``progress``: the execution's (``analyses.core.execution``; None: the current one's)."""
    check_null_seeds(null_seeds)
    with torch.no_grad(), executing(memory_mb, progress) as execution:
        observed = copying_from_eigenvalues(ov_eigenvalues(model, memory_mb=execution.memory_mb))
        if null_scores is None:
            null_scores = torch.stack(score_random_models(model, null_seeds,
                                                          lambda null: null_copying(null, execution.memory_mb)))
    frames = []
    for role, sign in zip(MEANING_ROLES, (1.0, -1.0)):
        score = sign * observed
        center, spread, dof = layer_null(sign * null_scores)
        z = z_score(score - center, spread)
        frames.append(head_frame(score, {
            "role": role, "score": score, "null": "random_init", "null_center": center, "null_spread": spread,
            "null_low": center - BAND_Z * spread, "null_high": center + BAND_Z * spread, "z": z, "p": t_upper_tail(z, dof),
            "log10_p": t_log_upper_tail(z, dof) / math.log(10),
        }))
    return pd.concat(frames, ignore_index=True)


def null_copying(null, memory_mb: float = DEFAULT_MEMORY_MB) -> torch.Tensor:
    """(layer, head) copying scores of one null model (``random_like``'s); ``memory_mb`` counts the
    null model itself (its eigenvalues get what it leaves)."""
    with torch.no_grad():
        return copying_from_eigenvalues(ov_eigenvalues(null, memory_mb=left_after(memory_mb, model_mb(null))))
