"""Metrics for ablation and patching: callables ``logits (batch, pos, d_vocab) -> scalar tensor``.

Every intervention here evaluates a metric on the logits of one batch of prompts, exactly as
TransformerLens's patching sweeps do, so any such callable works; these build the usual ones.
They stay differentiable, so attribution patching can take their gradient.

The metrics built here also say which positions' logits they read (``read_positions``): on a model
that can start mid-stream (GPTModel), an intervention then unembeds only those positions, the
costliest step of a suffix run when the vocabulary is large. Any other callable gets every position.

On a right-padded batch of texts of unequal lengths the metrics built here never read the padding:
the interventions bind the batch's lengths to them (``metric_for_batch``), so a logit difference is
read at each prompt's own last real token and a loss counts real tokens only; a position past a
prompt's end is refused, never wrapped. Guide: docs/guides/metrics.md.

The metrics built here are pooled means over prompts, and their parts also give each prompt's
numerator and count (``metric_part``, ``evaluate_part``, ``PromptScores``), from which an effect
gets its bootstrap interval over prompts (``analyses.core.stats``); any other callable gets none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from interp.errors import UserError
from interp.tokenizer import TokenBatch

Metric = Callable[[torch.Tensor], torch.Tensor]


def loss_metric(tokens: torch.Tensor, positions: torch.Tensor | None = None) -> Metric:
    """Mean next-token cross-entropy of ``tokens`` (batch, pos).

    ``positions`` (batch, pos) bool marks the *predicted* tokens that count (position i is
    predicted from the logits at i - 1; position 0 is never predicted). Default: all of them. On a
    right-padded batch, mark the real tokens (``TokenBatch.real``); the interventions do that for
    this metric themselves (``metric_for_batch``). The metric takes logits (batch, pos, d_vocab) of
    exactly these tokens; other shapes are refused.
    """
    if positions is not None and tuple(positions.shape) != tuple(tokens.shape):
        raise UserError(f"loss positions have shape {tuple(positions.shape)} but the tokens {tuple(tokens.shape)}; "
                        "they must be equal (one flag per token)")
    targets = tokens[:, 1:]
    mask = None if positions is None else positions[:, 1:].to(tokens.device)
    if mask is not None and not mask.any():
        raise UserError("loss positions select no predicted token (the mask is empty after position 0)")

    def metric(logits: torch.Tensor) -> torch.Tensor:
        _check_logits(logits, tuple(tokens.shape), "the loss metric's tokens")
        return _mean_loss(logits[:, :-1], targets, mask)

    def for_lengths(lengths: torch.Tensor) -> Metric:
        real = TokenBatch(tokens, lengths.to(tokens.device)).real
        return loss_metric(tokens, real if positions is None else real & positions.to(tokens.device))

    def part(rows: slice, read: torch.Tensor | None) -> tuple[Metric, float]:
        kept = torch.ones_like(targets, dtype=torch.bool) if mask is None else mask
        at = slice(None) if read is None else read.to(tokens.device)
        part_targets, part_mask = targets[rows][:, at], kept[rows][:, at]

        def entry_losses(logits: torch.Tensor) -> torch.Tensor:
            """logits (rows, len(read) or pos, d_vocab), or with ``read`` (m, d_vocab): those of the
            m entries of ``part_metric.entries`` alone, in row-major order -> each counted entry's
            loss (m,), row-major."""
            if read is not None and logits.ndim == 2:
                if logits.shape[0] != len(counted):
                    raise UserError(f"the loss metric's part reads {len(counted)} entries, but got logits of "
                                    f"shape {tuple(logits.shape)}")
                return _token_losses(logits, counted)
            _check_logits(logits, (len(part_targets), tokens.shape[1] if read is None else len(read)),
                          "the loss metric's part")
            return _token_losses((logits if read is not None else logits[:, :-1])[part_mask], counted)

        def part_metric(logits: torch.Tensor) -> torch.Tensor:
            return entry_losses(logits).mean()

        def per_prompt(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            losses = entry_losses(logits)
            sums = torch.zeros(len(part_targets), dtype=losses.dtype, device=losses.device)
            return losses.mean(), sums.index_add_(0, entry_rows.to(losses.device), losses)

        counted = part_targets[part_mask]  # (m,): the targets of the entries the part counts
        entry_rows = part_mask.nonzero()[:, 0]  # (m,): the prompt of each, row-major
        if read is not None:
            part_metric.entries = part_mask  # (rows, n) bool: an intervention may unembed these alone
        part_metric.per_prompt, part_metric.counts = per_prompt, part_mask.sum(dim=1)
        return part_metric, float(part_mask.sum())

    metric.read_positions = None if mask is None else torch.nonzero(mask.any(dim=0))[:, 0].cpu()
    metric.for_lengths = for_lengths
    metric.part = part
    metric.rows = lambda rows: loss_metric(tokens[rows], None if positions is None else positions[rows])
    return metric


def _mean_loss(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Mean -log p(target) over the ``mask``ed places (all where None): ``logits`` (batch, n,
    d_vocab) each predicting ``targets`` (batch, n) at the same place."""
    if mask is None:
        return _mean_loss_rows(logits, targets)
    return _mean_loss_rows(logits[mask], targets[mask])  # only the rows that count: (m, d_vocab)


def _mean_loss_rows(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean -log p(target): ``logits`` (..., d_vocab), each row predicting its ``targets`` (...)."""
    return _token_losses(logits, targets).mean()


def _token_losses(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """-log p(target) (...) in float32: ``logits`` (..., d_vocab), each row predicting its ``targets`` (...)."""
    if int(targets.max()) >= logits.shape[-1]:  # e.g. a Tracr model's own output space
        raise UserError(f"the loss metric needs logits over the input vocabulary, but these have {logits.shape[-1]} "
                        f"outputs and the tokens reach id {int(targets.max())}; use a metric on the model's outputs")
    log_probs = logits.log_softmax(dim=-1, dtype=torch.float32)  # float32 whatever the model's
    return -log_probs.gather(-1, targets[..., None])[..., 0]


def logit_diff_metric(correct: torch.Tensor | int, incorrect: torch.Tensor | int, position: int = -1, *,
                      lengths: torch.Tensor | None = None) -> Metric:
    """Mean over prompts of ``logits[b, at[b], correct[b]] - logits[b, at[b], incorrect[b]]``.

    ``correct`` / ``incorrect``: a token id, or one per prompt (batch,). ``position`` counts from
    the start (0, 1, ...) or from the end (-1 = the last token) of each prompt. ``lengths`` (batch,):
    the prompts' real token counts in a right-padded batch (``TokenBatch.lengths``); then
    ``at[b]`` counts within prompt b's real tokens (-1: its last real token, not the padding).
    Without ``lengths`` every prompt is read at the same position of the logits. A position past a
    prompt's end is refused, never wrapped. The interventions bind ``lengths`` themselves when
    they pad texts of unequal lengths (``metric_for_batch``).
    """
    correct, incorrect = torch.as_tensor(correct), torch.as_tensor(incorrect)
    for name, ids in (("correct", correct), ("incorrect", incorrect)):
        if ids.ndim > 1 or ids.is_floating_point() or ids.dtype == torch.bool:
            raise UserError(f"logit_diff_metric: {name} must be a token id or one id per prompt (batch,), "
                            f"got {tuple(ids.shape)} {ids.dtype}")
    at = None if lengths is None else _positions_within(position, torch.as_tensor(lengths))

    def metric(logits: torch.Tensor) -> torch.Tensor:
        batch, n_pos, d_vocab = logits.shape
        if at is None:
            _check_position(position, n_pos)
            rows_at = torch.full((batch,), position % n_pos)
        else:
            _check_logits(logits, (len(at), None), "the lengths logit_diff_metric was given")
            if int(at.max()) >= n_pos:  # ``at`` stays on the CPU: no device sync
                raise UserError(f"logit_diff_metric: its prompts have up to {int(at.max()) + 1} real tokens "
                                f"but the logits only {n_pos} positions")
            rows_at = at
        return _mean_diff(logits, rows_at, correct, incorrect)

    def part(rows: slice, read: torch.Tensor | None) -> tuple[Metric, float]:
        part_ids = [ids[rows] if ids.ndim else ids for ids in (correct, incorrect)]

        def diffs(logits: torch.Tensor) -> torch.Tensor:  # (rows, len(read) or pos, d_vocab) -> (rows,)
            n_rows, n_pos = rows.stop - rows.start, logits.shape[1]
            _check_logits(logits, (n_rows, None if read is None else len(read)), "the metric's part")
            if at is None and read is None:
                _check_position(position, n_pos)
            fixed = position % n_pos if read is None else int(read[0])  # a fixed position is the one read
            rows_at = torch.full((n_rows,), fixed) if at is None else at[rows]
            if read is None and int(rows_at.max()) >= n_pos:
                raise UserError(f"logit_diff_metric: its prompts have up to {int(rows_at.max()) + 1} real tokens "
                                f"but the logits only {n_pos} positions")
            return _diffs(logits, rows_at if read is None else torch.searchsorted(read, rows_at), *part_ids)

        return prompt_mean_part(diffs, rows.stop - rows.start)

    metric.part = part

    def for_lengths(new_lengths: torch.Tensor) -> Metric:
        if lengths is not None and not torch.equal(torch.as_tensor(lengths).cpu(), new_lengths.cpu()):
            raise UserError(f"logit_diff_metric was built for prompt lengths {torch.as_tensor(lengths).tolist()}, "
                            f"but the batch has lengths {new_lengths.tolist()}")
        return logit_diff_metric(correct, incorrect, position, lengths=new_lengths)

    metric.read_positions = position if at is None else torch.unique(at)
    metric.for_lengths = for_lengths
    metric.rows = lambda rows: logit_diff_metric(*(ids[rows] if ids.ndim else ids for ids in (correct, incorrect)),
                                                 position, lengths=None if lengths is None else torch.as_tensor(lengths)[rows])
    return metric


def _mean_diff(logits: torch.Tensor, rows_at: torch.Tensor, correct: torch.Tensor,
               incorrect: torch.Tensor) -> torch.Tensor:
    """The mean over rows of ``_diffs``."""
    return _diffs(logits, rows_at, correct, incorrect).mean()


def _diffs(logits: torch.Tensor, rows_at: torch.Tensor, correct: torch.Tensor,
           incorrect: torch.Tensor) -> torch.Tensor:
    """(batch,) ``logits[b, rows_at[b], correct[b]] - logits[b, rows_at[b], incorrect[b]]``
    (logits (batch, n, d_vocab); rows_at (batch,) on the CPU; ids one or one per row), in float32."""
    batch, _, d_vocab = logits.shape
    rows = torch.arange(batch, device=logits.device)
    good_ids, bad_ids = (_ids_per_prompt(ids, name, batch, d_vocab).to(logits.device)
                         for name, ids in (("correct", correct), ("incorrect", incorrect)))
    last = logits[rows, rows_at.to(logits.device)]  # (batch, d_vocab)
    return last[rows, good_ids].float() - last[rows, bad_ids].float()  # float32 whatever the model's


def metric_part(metric: Metric, rows: slice, read: torch.Tensor | None) -> tuple[Metric, float] | None:
    """``metric`` on the prompts ``rows`` (a slice start:stop of the batch) alone, for an
    intervention that runs a batch in chunks of prompts -> (the part's metric, its weight), or None
    for a metric that does not say how to split (any callable not built here: it gets every prompt
    at once). The metrics built here are means (a logit difference over prompts, a loss over
    predicted tokens), so the batch's value is the weight-averaged mean of its parts' values,
    exactly (up to float rounding). With ``read`` (n,), the positions ``read_positions`` gave, the
    part's metric takes logits (rows, n, d_vocab) of only those positions; otherwise (rows, pos,
    d_vocab). A part that reads only some entries of those positions (the loss: each prompt's own
    counted tokens) says which in ``part.entries`` (rows, n) bool, and also takes logits (m, d_vocab)
    of those m entries alone, row-major. The weight: the part's prompts (logit difference) or
    counted tokens (loss).

    The part also has a per-prompt form, so an effect can get an interval over prompts from the
    same logits: ``part.per_prompt(logits)`` -> (the part's value, exactly ``part(logits)``; each
    prompt's numerator (rows,): its difference, or the summed loss of its counted tokens), and
    ``part.counts`` (rows,): each prompt's denominator (1, or its counted tokens), summing to the
    weight. See ``evaluate_part``."""
    part = getattr(metric, "part", None)
    return None if part is None else part(rows, read)


def prompt_mean_part(scores: Callable[[torch.Tensor], torch.Tensor], n_rows: int) -> tuple[Metric, float]:
    """A metric part whose value is the mean of one score per prompt: ``scores`` maps the part's
    logits to (n_rows,) scores; returns (the part's metric, with the per-prompt form intervals need,
    each prompt counting once; its weight ``n_rows``)."""

    def part_metric(logits: torch.Tensor) -> torch.Tensor:
        return scores(logits).mean()

    def per_prompt(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        each = scores(logits)
        return each.mean(), each

    part_metric.per_prompt, part_metric.counts = per_prompt, torch.ones(n_rows)
    return part_metric, float(n_rows)


@dataclass(frozen=True)
class PromptScores:
    """A metric pooled over prompts, and what it pools: ``values`` (...) the metric (one per variant
    of an intervention, or a 0-d tensor for one run); ``numerators`` (..., batch) each prompt's
    numerator and ``counts`` (batch,) its denominator, so that a value is sum(numerators) /
    sum(counts) over the batch (up to float rounding), or both None for a metric without a
    per-prompt form (any callable not built here). A prompt that counts nothing has count 0."""

    values: torch.Tensor
    numerators: torch.Tensor | None
    counts: torch.Tensor | None


def evaluate_part(part: Metric, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A metric part (``metric_part``) on its logits -> (its value, a 0-d float tensor, exactly what
    ``evaluate_metric`` gives; each prompt's numerator (rows,) float32, or None for a part without a
    per-prompt form), from one evaluation."""
    per_prompt = getattr(part, "per_prompt", None)
    if per_prompt is None:
        return evaluate_metric(part, logits), None
    value, numerators = per_prompt(logits)
    return value.float(), numerators.float()


def prompt_scores(metric: Metric, logits: torch.Tensor) -> PromptScores:
    """``metric`` on the logits (batch, pos, d_vocab) of a whole batch -> ``PromptScores``: the value
    (0-d float, exactly ``evaluate_metric``'s) and, for a metric with a per-prompt form (those built
    here), each prompt's numerator (batch,) and count (batch,) from the same logits; else both None."""
    value = evaluate_metric(metric, logits)
    split = metric_part(metric, slice(0, logits.shape[0]), None)
    part = None if split is None else split[0]
    numerators = None if part is None else evaluate_part(part, logits)[1]
    return PromptScores(value, numerators, None if numerators is None else part.counts)


def metric_rows(metric: Metric, rows: slice) -> Metric | None:
    """``metric`` on the prompts ``rows`` alone as a metric of its own (its read positions and parts
    those of these prompts), for an analysis that keeps only some prompts; None for a metric that
    does not say how (any callable not built here). Unlike ``metric_part``, whose part takes the
    logits of the whole batch's read positions and splits no further."""
    restrict = getattr(metric, "rows", None)
    return None if restrict is None else restrict(rows)


def metric_for_batch(metric: Metric, lengths: torch.Tensor, n_pos: int) -> Metric:
    """``metric`` fitted to a right-padded batch (pos ``n_pos``) whose prompts have ``lengths``
    (batch,) real tokens, so it never reads the padding: unchanged when no prompt is padded; a
    metric built here gets the lengths (``for_lengths``: the loss counts real tokens only, a logit
    difference reads each prompt's own position); any other callable that declares the positions
    it reads (``read_positions``) is refused, since fixed positions land on padding; an undeclared
    callable is given the padded logits as they are (it must mask the padding itself)."""
    lengths = torch.as_tensor(lengths)
    if bool((lengths == n_pos).all()):
        return metric
    fit = getattr(metric, "for_lengths", None)
    if fit is not None:
        return fit(lengths)
    if getattr(metric, "read_positions", None) is not None:
        raise UserError(f"the metric reads fixed positions ({_as_list(metric.read_positions)}), but the prompts have "
                        f"unequal token lengths {sorted(set(lengths.tolist()))}, so those fall on padding; pass "
                        "prompts of equal length, or a metric of analyses.core.metrics built with lengths=")
    return metric


def read_positions(metric: Metric, n_pos: int) -> torch.Tensor | None:
    """The sorted positions (n,) of logits (batch, ``n_pos``, d_vocab) that ``metric`` reads, as the
    metrics built here declare them (a negative one counts from the end); None for every position
    (any other callable). A position past the end is refused, never wrapped."""
    declared = getattr(metric, "read_positions", None)
    if declared is None:
        return None
    positions = torch.as_tensor(declared).reshape(-1).long()
    beyond = [position for position in positions.tolist() if not -n_pos <= position < n_pos]
    if beyond:
        raise UserError(f"the metric reads position {beyond[0]}, but these prompts have {n_pos} tokens (allowed "
                        f"{-n_pos} .. {n_pos - 1}): it was built for other, longer prompts; build it from the prompts "
                        "you pass")
    return torch.unique(positions % n_pos)


def evaluate_metric(metric: Metric, logits: torch.Tensor) -> torch.Tensor:
    """``metric(logits)`` checked to be a scalar; returned as a 0-d float tensor."""
    value = torch.as_tensor(metric(logits))
    if value.ndim != 0:
        raise UserError(f"the metric must return a scalar, got a tensor of shape {tuple(value.shape)}")
    return value.float()


def _check_position(position: int, n_pos: int) -> None:
    """Refuse a position outside prompts of ``n_pos`` tokens: allowed -n_pos .. n_pos - 1."""
    if not -n_pos <= position < n_pos:
        raise UserError(f"position {position} is past the end of prompts of {n_pos} tokens "
                        f"(allowed {-n_pos} .. {n_pos - 1})")


def _positions_within(position: int, lengths: torch.Tensor) -> torch.Tensor:
    """``position`` in each prompt of ``lengths`` (batch,) real tokens -> (batch,) positions from
    the start; refused where a prompt is too short for it."""
    if lengths.ndim != 1 or len(lengths) == 0 or int(lengths.min()) < 1:
        raise UserError(f"lengths must be one positive token count per prompt (batch,), got {lengths.tolist()}")
    at = torch.where(torch.as_tensor(position) < 0, lengths + position, torch.full_like(lengths, position))
    bad = ((at < 0) | (at >= lengths)).nonzero()[:, 0]
    if len(bad):
        b = int(bad[0])
        raise UserError(f"position {position} is past the end of prompt {b}, which has {int(lengths[b])} real tokens "
                        f"(allowed {-int(lengths[b])} .. {int(lengths[b]) - 1})")
    return at.long()


def _ids_per_prompt(ids: torch.Tensor, name: str, batch: int, d_vocab: int) -> torch.Tensor:
    """A token id, or one per prompt, -> (batch,) ids, checked against the batch and vocabulary."""
    if ids.ndim == 1 and len(ids) != batch:
        raise UserError(f"logit_diff_metric: {len(ids)} {name} ids for {batch} prompts; pass one id, or one per prompt")
    if int(ids.min()) < 0 or int(ids.max()) >= d_vocab:
        raise UserError(f"logit_diff_metric: {name} token ids {ids.tolist()} are outside the vocabulary [0, {d_vocab})")
    return ids.expand(batch)


def _check_logits(logits: torch.Tensor, shape: tuple, what: str) -> None:
    """Refuse logits (batch, pos, d_vocab) whose leading dims differ from ``shape`` (None: any)."""
    if logits.ndim != 3 or any(want is not None and got != want for got, want in zip(logits.shape, shape)):
        expected = ", ".join("*" if want is None else str(want) for want in shape)
        raise UserError(f"the metric got logits of shape {tuple(logits.shape)}, but {what} are for ({expected}, d_vocab)")


def _as_list(declared) -> list[int]:
    return torch.as_tensor(declared).reshape(-1).tolist()
