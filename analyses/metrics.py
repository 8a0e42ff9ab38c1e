"""Metrics for ablation and patching: callables ``logits (batch, pos, d_vocab) -> scalar tensor``.

Every intervention here evaluates a metric on the logits of one batch of prompts, exactly as
TransformerLens's patching sweeps do, so any such callable works; these build the usual ones.
They stay differentiable, so attribution patching can take their gradient.
"""

from __future__ import annotations

from typing import Callable

import torch
from interp.errors import UserError

Metric = Callable[[torch.Tensor], torch.Tensor]


def loss_metric(tokens: torch.Tensor, positions: torch.Tensor | None = None) -> Metric:
    """Mean next-token cross-entropy of ``tokens`` (batch, pos).

    ``positions`` (batch, pos) bool marks the *predicted* tokens that count (position i is
    predicted from the logits at i - 1; position 0 is never predicted). Default: all of them.
    """
    targets = tokens[:, 1:]
    mask = None if positions is None else positions[:, 1:].to(tokens.device)
    if mask is not None and not mask.any():
        raise UserError("loss positions select no predicted token (the mask is empty after position 0)")

    def metric(logits: torch.Tensor) -> torch.Tensor:
        log_probs = logits[:, :-1].log_softmax(dim=-1)
        losses = -log_probs.gather(-1, targets[..., None])[..., 0]  # (batch, pos - 1)
        return losses.mean() if mask is None else losses[mask].mean()

    return metric


def logit_diff_metric(correct: torch.Tensor | int, incorrect: torch.Tensor | int, position: int = -1) -> Metric:
    """Mean over prompts of ``logits[b, position, correct[b]] - logits[b, position, incorrect[b]]``.

    ``correct`` / ``incorrect``: a token id, or one per prompt (batch,).
    """
    correct, incorrect = torch.as_tensor(correct), torch.as_tensor(incorrect)

    def metric(logits: torch.Tensor) -> torch.Tensor:
        last = logits[:, position]  # (batch, d_vocab)
        rows = torch.arange(last.shape[0], device=last.device)
        good = last[rows, correct.to(last.device).expand(last.shape[0])]
        bad = last[rows, incorrect.to(last.device).expand(last.shape[0])]
        return (good - bad).mean()

    return metric


def evaluate_metric(metric: Metric, logits: torch.Tensor) -> torch.Tensor:
    """``metric(logits)`` checked to be a scalar; returned as a 0-d float tensor."""
    value = torch.as_tensor(metric(logits))
    if value.ndim != 0:
        raise UserError(f"the metric must return a scalar, got a tensor of shape {tuple(value.shape)}")
    return value.float()
