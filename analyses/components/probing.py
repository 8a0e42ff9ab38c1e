"""Linear probes on any hook, with a control task (architecture §4.8).

A probe is a multinomial logistic regression (float32, features standardised on the training rows,
an L2 penalty, fit by full-batch L-BFGS from zeros: deterministic) from an activation to a label,
at every labelled (prompt, position). Prompts, not positions, are split into training and held-out
sets (seeded), so no prompt is seen on both sides.

Accuracy alone says little: a wide enough probe can memorise anything keyed on the token itself.
Hewitt and Liang (2019, "Designing and Interpreting Probes with Control Tasks") pair each property
with a *control task*: every token type gets a random label, drawn from the property's own label
distribution, the same at each of its occurrences. A probe that reaches the control's accuracy
only reflects the token identity; **selectivity** = held-out accuracy on the property minus that on
the control is what the activation adds.

Properties that need no labelled corpus (each a (batch, pos) long tensor, -1 where undefined):

- ``seen_before(tokens)``: 1 where the token already occurred earlier in its prompt, else 0;
- ``repeat_offset(probes)``: in the second copy of a repeated segment, the offset into it (0, 1, ...);
- ``bracket_depth(tokens, open_id, close_id)``: the nesting depth after each token (with
  ``bracket_prompts`` to draw prompts of brackets and filler).

``linear_probe`` probes every layer's residual (or any hooks), optionally each head of a
(batch, pos, head, d) hook separately, from one forward that caches only those hooks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import pandas as pd
import torch

from analyses.core.hook_names import final_resid_name, resid_pre_name
from analyses.core.probes import RepeatedProbes
from analyses.core.execution import executing
from analyses.core.progress import progress_bar
from analyses.core.tokens import ordinary_token_ids, single_token_id, start_ids
from interp.errors import UserError


# ---- properties --------------------------------------------------------------------------------------

def seen_before(tokens: torch.Tensor) -> torch.Tensor:
    """(batch, pos) -> (batch, pos) long: 1 where the token occurred at an earlier position of its
    prompt, 0 where not; -1 at position 0 (nothing precedes it)."""
    n_pos = tokens.shape[1]
    earlier = torch.ones(n_pos, n_pos, dtype=torch.bool, device=tokens.device).tril(-1)
    seen = ((tokens[:, :, None] == tokens[:, None, :]) & earlier).any(-1).long()
    seen[:, 0] = -1
    return seen


def repeat_offset(probes: RepeatedProbes) -> torch.Tensor:
    """(batch, pos) long: the offset into the second copy of the segment (0 at its first token), -1
    outside it."""
    start = (probes.segment_start + probes.period)[:, None]
    offset = torch.arange(probes.seq_len, device=probes.tokens.device)[None] - start
    return torch.where(probes.second_copy, offset, torch.full_like(offset, -1))


def bracket_depth(tokens: torch.Tensor, open_id: int, close_id: int) -> torch.Tensor:
    """(batch, pos) long: the nesting depth after each token (an opening bracket raises it, a
    closing one lowers it, never below 0)."""
    depth = torch.zeros_like(tokens)
    current = torch.zeros(tokens.shape[0], dtype=tokens.dtype, device=tokens.device)
    for pos in range(tokens.shape[1]):
        current = current + (tokens[:, pos] == open_id).long()
        current = (current - (tokens[:, pos] == close_id).long()).clamp(min=0)
        depth[:, pos] = current
    return depth


def bracket_prompts(model, n_prompts: int, seq_len: int, *, max_depth: int = 4, seed: int = 0
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts of "(" and ")" among filler tokens -> (tokens (batch, seq_len), depth (batch, seq_len),
    -1 at the start token, where the model's texts have one). Brackets stay balanced-or-open (never close below 0, never deeper than
    ``max_depth``); each position is an opening bracket, a closing one or filler with equal odds
    where allowed. Seeded."""
    open_id, close_id = single_token_id(model, "("), single_token_id(model, ")")
    filler = torch.tensor([t for t in ordinary_token_ids(model) if t not in (open_id, close_id)])
    generator = torch.Generator().manual_seed(seed)
    tokens = filler[torch.randint(len(filler), (n_prompts, seq_len), generator=generator)]
    choice = torch.randint(3, (n_prompts, seq_len), generator=generator)
    depth = torch.zeros(n_prompts, dtype=torch.long)
    for pos in range(1, seq_len):
        opens = (choice[:, pos] == 0) & (depth < max_depth)
        closes = (choice[:, pos] == 1) & (depth > 0)
        tokens[opens, pos], tokens[closes, pos] = open_id, close_id
        depth = depth + opens.long() - closes.long()
    start = start_ids(model)  # none where the model's texts begin without a start token
    tokens[:, :len(start)] = torch.tensor(start, dtype=torch.long)
    labels = bracket_depth(tokens, open_id, close_id)
    labels[:, :len(start)] = -1
    return tokens, labels


def control_labels(tokens: torch.Tensor, labels: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """Hewitt and Liang's control task: every token type that carries a label gets one random label,
    drawn from the labelled positions' label distribution (seeded), at all its labelled occurrences."""
    defined = labels >= 0
    types = tokens[defined].unique()
    pool = labels[defined]
    generator = torch.Generator().manual_seed(seed)
    drawn = pool[torch.randint(len(pool), (len(types),), generator=generator)]
    lookup = torch.full((int(tokens.max()) + 1,), -1, dtype=torch.long)
    lookup[types] = drawn
    return torch.where(defined, lookup[tokens], labels)


# ---- the probe ---------------------------------------------------------------------------------------

@dataclass
class ProbeFit:
    """A fitted probe: ``logits = ((x - mean) / std) @ weight + bias`` over ``classes``."""

    weight: torch.Tensor  # (d, n_classes)
    bias: torch.Tensor  # (n_classes,)
    mean: torch.Tensor  # (d,)
    std: torch.Tensor  # (d,)
    classes: torch.Tensor  # (n_classes,) the label of each output

    def predict(self, features: torch.Tensor) -> torch.Tensor:
        """features (n, d) -> predicted labels (n,)."""
        return self.classes[(((features.float() - self.mean) / self.std) @ self.weight + self.bias).argmax(-1)]


def probe_loss(weight: torch.Tensor, bias: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
               weight_decay: float) -> torch.Tensor:
    """Mean cross-entropy of ``x @ weight + bias`` against class indices ``y``, plus
    ``weight_decay * |weight|^2 / 2``: what ``fit_probe`` minimises."""
    return torch.nn.functional.cross_entropy(x @ weight + bias, y) + 0.5 * weight_decay * weight.pow(2).sum()


def fit_probe(features: torch.Tensor, labels: torch.Tensor, *, weight_decay: float = 1e-3, steps: int = 100) -> ProbeFit:
    """Fit a probe to ``features`` (n, d) and ``labels`` (n,) (see the module docstring)."""
    if weight_decay < 0 or steps < 1:
        raise UserError(f"weight_decay={weight_decay} must be >= 0 and steps={steps} >= 1")
    x = features.float()
    mean, std = x.mean(0), x.std(0, unbiased=False).clamp(min=1e-6)
    x = (x - mean) / std
    classes, y = labels.unique(return_inverse=True)
    weight = torch.zeros(x.shape[1], len(classes), requires_grad=True)
    bias = torch.zeros(len(classes), requires_grad=True)
    optimizer = torch.optim.LBFGS([weight, bias], max_iter=steps, tolerance_grad=1e-6, line_search_fn="strong_wolfe")

    def closure():
        optimizer.zero_grad()
        loss = probe_loss(weight, bias, x, y, weight_decay)
        loss.backward()
        return loss

    with torch.enable_grad():
        optimizer.step(closure)
    return ProbeFit(weight.detach(), bias.detach(), mean, std, classes)


def prompt_split(n_prompts: int, test_fraction: float, seed: int) -> torch.Tensor:
    """(n_prompts,) bool: the held-out prompts, a seeded ``test_fraction`` of them (at least one on each side)."""
    if n_prompts < 2:
        raise UserError(f"a held-out split needs at least 2 prompts, got {n_prompts}")
    if not 0 < test_fraction < 1:
        raise UserError(f"test_fraction={test_fraction} must be in (0, 1)")
    n_test = min(n_prompts - 1, max(1, math.ceil(test_fraction * n_prompts)))
    held_out = torch.zeros(n_prompts, dtype=torch.bool)
    held_out[torch.randperm(n_prompts, generator=torch.Generator().manual_seed(seed))[:n_test]] = True
    return held_out


def _accuracies(features: torch.Tensor, labels: torch.Tensor, held_out: torch.Tensor, **fit) -> tuple[float, float]:
    """(train accuracy, held-out accuracy) of a probe fit on the training rows. features (n, d);
    labels, held_out (n,)."""
    probe = fit_probe(features[~held_out], labels[~held_out], **fit)
    correct = probe.predict(features) == labels
    return correct[~held_out].float().mean().item(), correct[held_out].float().mean().item()


def default_probe_hooks(model) -> list[str]:
    """Every block's ``hook_resid_pre`` and the final residual: the residual after each layer."""
    return [*(resid_pre_name(layer) for layer in range(model.cfg.n_layers)), final_resid_name(model)]


@torch.no_grad()
def linear_probe(model, tokens: torch.Tensor, labels: torch.Tensor, hooks: Sequence[str] | None = None, *,
                 per_head: bool = False, test_fraction: float = 0.25, seed: int = 0, weight_decay: float = 1e-3,
                 steps: int = 100, cache=None, progress: bool | None = None) -> pd.DataFrame:
    """Probe each of ``hooks`` (default ``default_probe_hooks``) for ``labels`` (batch, pos) long
    (-1: not probed) on ``tokens`` (batch, pos), with the control task.

    ``per_head``: the hooks are (batch, pos, head, d) (e.g. ``hook_z``) and each head gets its own
    probe. ``cache``: a clean cache holding the hooks (None: one forward caching only them). Returns a
    tidy frame, one row per hook (and head): ``hook, head, accuracy_train, accuracy, control_accuracy,
    selectivity, majority`` (the held-out share of the commonest training label), ``n_train, n_test``.
    ``progress``: the execution's (``analyses.core.execution``; None: the current one's).
    """
    if labels.shape != tokens.shape:
        raise UserError(f"labels of shape {tuple(labels.shape)} must match the tokens {tuple(tokens.shape)}")
    hooks = list(default_probe_hooks(model) if hooks is None else hooks)
    if cache is None:
        _, cache = model.run_with_cache(tokens, names_filter=hooks)
    defined = (labels >= 0).cpu()
    if not defined.any():
        raise UserError("labels define no position (every label is -1)")
    held_out = prompt_split(tokens.shape[0], test_fraction, seed)[:, None].expand_as(defined)[defined]
    if labels.cpu()[defined][~held_out].unique().numel() < 2:
        raise UserError("the training prompts carry a single label: there is nothing to probe")
    targets = labels.cpu()[defined]
    controls = control_labels(tokens.cpu(), labels.cpu(), seed)[defined]
    train_labels = targets[~held_out]
    majority = (targets[held_out] == train_labels.mode().values).float().mean().item()
    fit = dict(weight_decay=weight_decay, steps=steps)
    rows = []
    with executing(progress=progress):
        for hook in progress_bar(hooks, desc="linear probes", unit="hook"):
            activation = cache[hook].cpu().float()[defined]  # (n, d) or (n, head, d)
            if per_head and activation.ndim != 3:
                raise UserError(f"per_head probes need a (batch, pos, head, d) hook; {hook} is {tuple(cache[hook].shape)}")
            for head, features in (enumerate(activation.unbind(1)) if per_head else [(None, activation.flatten(1))]):
                train, test = _accuracies(features, targets, held_out, **fit)
                _, control = _accuracies(features, controls, held_out, **fit)
                rows.append({"hook": hook, "head": head, "accuracy_train": train, "accuracy": test,
                             "control_accuracy": control, "selectivity": test - control, "majority": majority,
                             "n_train": int((~held_out).sum()), "n_test": int(held_out.sum())})
    return pd.DataFrame(rows).astype({"head": "Int64"})
