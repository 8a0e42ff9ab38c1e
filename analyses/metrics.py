"""Metrics for ablation and patching: callables ``logits (batch, pos, d_vocab) -> scalar tensor``.

Every intervention here evaluates a metric on the logits of one batch of prompts, exactly as
TransformerLens's patching sweeps do, so any such callable works; these build the usual ones.
They stay differentiable, so attribution patching can take their gradient.

The metrics built here also say which positions' logits they read (``read_positions``): on a model
that can start mid-stream (GPTModel), an intervention then unembeds only those positions, the
costliest step of a suffix run when the vocabulary is large. Any other callable gets every position.
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
        if mask is None:
            log_probs = logits[:, :-1].log_softmax(dim=-1)
            return -log_probs.gather(-1, targets[..., None]).mean()
        log_probs = logits[:, :-1][mask].log_softmax(dim=-1)  # only the rows that count: (n, d_vocab)
        return -log_probs.gather(-1, targets[mask][:, None]).mean()

    metric.read_positions = None if mask is None else torch.nonzero(mask.any(dim=0))[:, 0].cpu()
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

    metric.read_positions = position
    return metric


def read_positions(metric: Metric, n_pos: int) -> torch.Tensor | None:
    """The sorted positions (n,) of logits (batch, ``n_pos``, d_vocab) that ``metric`` reads, as the
    metrics built here declare them; None for every position (any other callable)."""
    declared = getattr(metric, "read_positions", None)
    if declared is None:
        return None
    positions = torch.as_tensor(declared).reshape(-1) % n_pos  # a position may count from the end
    return torch.unique(positions)


def evaluate_metric(metric: Metric, logits: torch.Tensor) -> torch.Tensor:
    """``metric(logits)`` checked to be a scalar; returned as a 0-d float tensor."""
    value = torch.as_tensor(metric(logits))
    if value.ndim != 0:
        raise UserError(f"the metric must return a scalar, got a tensor of shape {tuple(value.shape)}")
    return value.float()
