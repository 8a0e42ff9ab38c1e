"""Metrics for ablation and patching: a ``Metric`` maps logits (batch, pos, d_vocab) to a scalar tensor
and declares what an intervention may do with it.

Every intervention here evaluates a metric on the logits of one batch of prompts, exactly as
TransformerLens's patching sweeps do. A ``Metric`` is a drop-in callable and stays differentiable,
so attribution patching can take its gradient. It declares:

- ``read_positions``: the positions whose logits it reads (None: every position). On a model that
  can start mid-stream (GPTModel) an intervention unembeds only those, the costliest step of a suffix
  run when the vocabulary is large. ``positions(n_pos)`` resolves them.
- ``for_lengths(lengths)``: itself on a right-padded batch of prompts of those real lengths, never
  reading the padding (a logit difference at each prompt's own last real token, a loss over real
  tokens only); a position past a prompt's end is refused, never wrapped. ``metric_for_batch`` binds
  a batch's lengths.
- ``part(rows, read)``, where ``splits``: itself on a chunk of prompts, a ``MetricPart`` that also
  gives each prompt's numerator and count, so a batch is scored chunk by chunk and an effect gets its
  bootstrap interval over prompts (``analyses.core.stats``).
- ``rows(rows)``, where ``restricts``: itself on some prompts alone, as a metric of their own.

``loss_metric``, ``logit_diff_metric``, ``PromptMeanMetric`` (the task metrics) are Metrics. Any other
callable is wrapped once by ``as_metric`` into a ``CallableMetric``: it reads every position (or the
``read_positions`` it carries as an attribute), gets every prompt at once (no chunks of prompts, so
NaN intervals), and cannot be restricted to some prompts; asking it for a part or a restriction is
refused in one line. Guide: docs/guides/metrics.md.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable

import torch
from interp.errors import UserError
from interp.tokenizer import TokenBatch

Scores = Callable[[torch.Tensor], torch.Tensor]  # logits (rows, n, d_vocab) -> one score per prompt (rows,)


class MetricPart(ABC):
    """A metric on a chunk of prompts (``Metric.part``), for an intervention that runs a batch in
    chunks: the batch's value is the weight-averaged mean of its parts' values, exactly (up to float
    rounding). Its logits are (rows, n, d_vocab) of the read positions ``read`` the part was made
    with, or (rows, pos, d_vocab) without. ``counts`` (rows,): each prompt's denominator (1, or its
    counted tokens), summing to the part's weight. ``entries`` (rows, n) bool: where the part reads
    only some entries of the read positions (the loss: each prompt's counted tokens), which; it then
    also takes logits (m, d_vocab) of those m entries alone, row-major. None: every entry."""

    counts: torch.Tensor
    entries: torch.Tensor | None = None

    @abstractmethod
    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """The part's value, a 0-d tensor (differentiable)."""

    @abstractmethod
    def per_prompt(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the part's value, exactly ``part(logits)``; each prompt's numerator (rows,): its score,
        or the summed loss of its counted tokens), from one evaluation."""

    def evaluate(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``per_prompt`` as float32: (the value, 0-d; the numerators (rows,))."""
        value, numerators = self.per_prompt(logits)
        return value.float(), numerators.float()


class PromptMeanPart(MetricPart):
    """A part whose value is the mean of one score per prompt: ``scores`` maps the part's logits to
    (n_rows,) scores; each prompt counts once."""

    def __init__(self, scores: Scores, n_rows: int):
        self.scores, self.counts = scores, torch.ones(n_rows)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        return self.scores(logits).mean()

    def per_prompt(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        each = self.scores(logits)
        return each.mean(), each


class Metric(ABC):
    """logits (batch, pos, d_vocab) -> a scalar tensor, with what it declares (the module docstring).
    A subclass defines ``__call__`` and overrides what it can do beyond a plain callable."""

    read_positions: int | list | torch.Tensor | None = None  # declared; a negative one counts from the end
    splits: bool = False  # ``part`` gives its parts over chunks of prompts, each with a per-prompt form
    restricts: bool = False  # ``rows`` gives it on some prompts alone

    @abstractmethod
    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """logits (batch, pos, d_vocab) -> the metric, a 0-d tensor."""

    def positions(self, n_pos: int) -> torch.Tensor | None:
        """The sorted positions (n,) of logits (batch, ``n_pos``, d_vocab) it reads, from
        ``read_positions``; None for every position. A position past the end is refused, never wrapped."""
        if self.read_positions is None:
            return None
        positions = torch.as_tensor(self.read_positions).reshape(-1).long()
        beyond = [position for position in positions.tolist() if not -n_pos <= position < n_pos]
        if beyond:
            raise UserError(f"the metric reads position {beyond[0]}, but these prompts have {n_pos} tokens (allowed "
                            f"{-n_pos} .. {n_pos - 1}): it was built for other, longer prompts; build it from the "
                            "prompts you pass")
        return torch.unique(positions % n_pos)

    def for_lengths(self, lengths: torch.Tensor) -> Metric:
        """Itself on a right-padded batch whose prompts have ``lengths`` (batch,) real tokens, some
        fewer than the logits' positions. Here (a metric that knows no lengths): refused where it reads
        fixed positions, since those fall on padding; else itself, given the padded logits as they
        are (it must mask the padding)."""
        if self.read_positions is not None:
            raise UserError(f"the metric reads fixed positions ({_as_list(self.read_positions)}), but the prompts "
                            f"have unequal token lengths {sorted(set(lengths.tolist()))}, so those fall on padding; "
                            "pass prompts of equal length, or a metric of analyses.core.metrics built with lengths=")
        return self

    def part(self, rows: slice, read: torch.Tensor | None) -> tuple[MetricPart, float]:
        """Itself on the prompts ``rows`` (a slice start:stop of the batch) alone, taking logits of the
        read positions ``read`` (n,) (``positions``) or of every position (None) -> (the part, its
        weight: its prompts, or its counted tokens). Only where ``splits``."""
        raise UserError(f"the metric {self!r} cannot be split over chunks of prompts (only one with splits=True, "
                        "such as those of analyses.core.metrics, can); score it on every prompt at once")

    def rows(self, rows: slice) -> Metric:
        """Itself on the prompts ``rows`` alone as a metric of its own (its read positions and parts
        those of these prompts), for an analysis that keeps only some prompts. Only where ``restricts``."""
        raise UserError(f"the metric {self!r} cannot be restricted to prompts {rows.start}:{rows.stop} (only one with "
                        "restricts=True, such as those of analyses.core.metrics, can)")


class CallableMetric(Metric):
    """A plain callable ``fn`` logits -> scalar as a ``Metric`` (``as_metric``): it reads every
    position, or the ``read_positions`` given; it cannot be split over chunks of prompts (an
    intervention gives it every prompt at once, and its effects get NaN intervals) nor restricted."""

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor], read_positions=None):
        self.fn, self.read_positions = fn, read_positions

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        return self.fn(logits)

    def __repr__(self) -> str:
        return repr(self.fn)


def as_metric(metric) -> Metric:
    """``metric`` as a ``Metric``: itself where it is one, else a plain callable logits -> scalar
    wrapped (``CallableMetric``), keeping the ``read_positions`` it declares as an attribute."""
    if isinstance(metric, Metric):
        return metric
    if not callable(metric):
        raise UserError(f"a metric must be a callable logits (batch, pos, d_vocab) -> scalar, got {type(metric).__name__}")
    return CallableMetric(metric, getattr(metric, "read_positions", None))


class PromptMeanMetric(Metric):
    """The mean over prompts of one score per prompt: ``scores`` maps logits (batch, pos, d_vocab)
    to (batch,). ``read_positions``: as ``Metric``'s. ``part_scores(rows, read)``: the scores of the
    prompts ``rows`` alone on the part's logits (rows, len(read) or pos, d_vocab); without it the
    metric does not split."""

    def __init__(self, scores: Scores, read_positions=None,
                 part_scores: Callable[[slice, torch.Tensor | None], Scores] | None = None):
        self.scores, self.read_positions, self.part_scores = scores, read_positions, part_scores
        self.splits = part_scores is not None

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        return self.scores(logits).mean()

    def part(self, rows: slice, read: torch.Tensor | None) -> tuple[MetricPart, float]:
        if self.part_scores is None:
            return super().part(rows, read)
        n_rows = rows.stop - rows.start
        return PromptMeanPart(self.part_scores(rows, read), n_rows), float(n_rows)


class LossMetric(Metric):
    """Mean next-token cross-entropy of ``tokens`` (batch, pos) over the predicted tokens that
    ``counted`` (batch, pos) bool marks (None: all); see ``loss_metric``."""

    splits = restricts = True

    def __init__(self, tokens: torch.Tensor, counted: torch.Tensor | None = None):
        if counted is not None and tuple(counted.shape) != tuple(tokens.shape):
            raise UserError(f"loss positions have shape {tuple(counted.shape)} but the tokens {tuple(tokens.shape)}; "
                            "they must be equal (one flag per token)")
        self.tokens, self.counted = tokens, counted
        self.targets = tokens[:, 1:]
        self.mask = None if counted is None else counted[:, 1:].to(tokens.device)  # (batch, pos - 1)
        if self.mask is not None and not self.mask.any():
            raise UserError("loss positions select no predicted token (the mask is empty after position 0)")
        self.read_positions = None if self.mask is None else torch.nonzero(self.mask.any(dim=0))[:, 0].cpu()

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        _check_logits(logits, tuple(self.tokens.shape), "the loss metric's tokens")
        return _mean_loss(logits[:, :-1], self.targets, self.mask)

    def for_lengths(self, lengths: torch.Tensor) -> Metric:
        real = TokenBatch(self.tokens, lengths.to(self.tokens.device)).real
        return LossMetric(self.tokens, real if self.counted is None else real & self.counted.to(self.tokens.device))

    def part(self, rows: slice, read: torch.Tensor | None) -> tuple[MetricPart, float]:
        kept = torch.ones_like(self.targets, dtype=torch.bool) if self.mask is None else self.mask
        at = slice(None) if read is None else read.to(self.tokens.device)
        part = LossPart(self.targets[rows][:, at], kept[rows][:, at],
                        self.tokens.shape[1] if read is None else None)
        return part, float(part.mask.sum())

    def rows(self, rows: slice) -> Metric:
        return LossMetric(self.tokens[rows], None if self.counted is None else self.counted[rows])


class LossPart(MetricPart):
    """The loss on a chunk of prompts: ``targets`` (rows, n) the tokens predicted at the part's
    logits' places, ``mask`` (rows, n) bool those counted; ``n_pos``: the logits' positions where
    they are every position (the last predicting nothing), None where they are the read positions
    alone (then the part also takes the logits (m, d_vocab) of its m ``entries``, row-major)."""

    def __init__(self, targets: torch.Tensor, mask: torch.Tensor, n_pos: int | None):
        self.n_rows, self.mask, self.n_pos = len(targets), mask, n_pos
        self.width = mask.shape[1] if n_pos is None else n_pos  # the positions of its (rows, width, d_vocab) logits
        self.counted = targets[mask]  # (m,): the targets of the entries the part counts, row-major
        self.entry_rows = mask.nonzero()[:, 0]  # (m,): the prompt of each
        self.entries = mask if n_pos is None else None
        self.counts = mask.sum(dim=1)

    def losses(self, logits: torch.Tensor) -> torch.Tensor:
        """logits (rows, width, d_vocab), or with read positions (m, d_vocab) of the ``entries``
        alone -> each counted entry's loss (m,), row-major."""
        if self.n_pos is None and logits.ndim == 2:
            if logits.shape[0] != len(self.counted):
                raise UserError(f"the loss metric's part reads {len(self.counted)} entries, but got logits of "
                                f"shape {tuple(logits.shape)}")
            return _token_losses(logits, self.counted)
        _check_logits(logits, (self.n_rows, self.width), "the rows and positions the loss metric reads")
        return _token_losses((logits if self.n_pos is None else logits[:, :-1])[self.mask], self.counted)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        return self.losses(logits).mean()

    def per_prompt(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        losses = self.losses(logits)
        sums = torch.zeros(self.n_rows, dtype=losses.dtype, device=losses.device)
        return losses.mean(), sums.index_add_(0, self.entry_rows.to(losses.device), losses)


def loss_metric(tokens: torch.Tensor, positions: torch.Tensor | None = None) -> Metric:
    """Mean next-token cross-entropy of ``tokens`` (batch, pos) (a ``LossMetric``).

    ``positions`` (batch, pos) bool marks the *predicted* tokens that count (position i is
    predicted from the logits at i - 1; position 0 is never predicted). Default: all of them. On a
    right-padded batch, mark the real tokens (``TokenBatch.real``); the interventions do that for
    this metric themselves (``metric_for_batch``). The metric takes logits (batch, pos, d_vocab) of
    exactly these tokens; other shapes are refused.
    """
    return LossMetric(tokens, positions)


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


class LogitDiffMetric(Metric):
    """Mean over prompts of ``logits[b, at[b], correct[b]] - logits[b, at[b], incorrect[b]]``; see
    ``logit_diff_metric``."""

    splits = restricts = True

    def __init__(self, correct: torch.Tensor | int, incorrect: torch.Tensor | int, position: int = -1,
                 lengths: torch.Tensor | None = None):
        correct, incorrect = torch.as_tensor(correct), torch.as_tensor(incorrect)
        for name, ids in (("correct", correct), ("incorrect", incorrect)):
            if ids.ndim > 1 or ids.is_floating_point() or ids.dtype == torch.bool:
                raise UserError(f"logit_diff_metric: {name} must be a token id or one id per prompt (batch,), "
                                f"got {tuple(ids.shape)} {ids.dtype}")
        self.correct, self.incorrect, self.position, self.lengths = correct, incorrect, position, lengths
        self.at = None if lengths is None else _positions_within(position, torch.as_tensor(lengths))  # (batch,) CPU
        self.read_positions = position if self.at is None else torch.unique(self.at)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        batch, n_pos, d_vocab = logits.shape
        if self.at is None:
            _check_position(self.position, n_pos)
            rows_at = torch.full((batch,), self.position % n_pos)
        else:
            _check_logits(logits, (len(self.at), None), "the lengths logit_diff_metric was given")
            if int(self.at.max()) >= n_pos:  # ``at`` stays on the CPU: no device sync
                raise UserError(f"logit_diff_metric: its prompts have up to {int(self.at.max()) + 1} real tokens "
                                f"but the logits only {n_pos} positions")
            rows_at = self.at
        return _diffs(logits, rows_at, self.correct, self.incorrect).mean()

    def part(self, rows: slice, read: torch.Tensor | None) -> tuple[MetricPart, float]:
        part_ids = [ids[rows] if ids.ndim else ids for ids in (self.correct, self.incorrect)]
        n_rows = rows.stop - rows.start

        def diffs(logits: torch.Tensor) -> torch.Tensor:  # (rows, len(read) or pos, d_vocab) -> (rows,)
            n_pos = logits.shape[1]
            _check_logits(logits, (n_rows, None if read is None else len(read)), "the rows and positions the metric reads")
            if self.at is None and read is None:
                _check_position(self.position, n_pos)
            fixed = self.position % n_pos if read is None else int(read[0])  # a fixed position is the one read
            rows_at = torch.full((n_rows,), fixed) if self.at is None else self.at[rows]
            if read is None and int(rows_at.max()) >= n_pos:
                raise UserError(f"logit_diff_metric: its prompts have up to {int(rows_at.max()) + 1} real tokens "
                                f"but the logits only {n_pos} positions")
            return _diffs(logits, rows_at if read is None else torch.searchsorted(read, rows_at), *part_ids)

        return PromptMeanPart(diffs, n_rows), float(n_rows)

    def for_lengths(self, lengths: torch.Tensor) -> Metric:
        if self.lengths is not None and not torch.equal(torch.as_tensor(self.lengths).cpu(), lengths.cpu()):
            raise UserError(f"logit_diff_metric was built for prompt lengths {torch.as_tensor(self.lengths).tolist()}, "
                            f"but the batch has lengths {lengths.tolist()}")
        return LogitDiffMetric(self.correct, self.incorrect, self.position, lengths)

    def rows(self, rows: slice) -> Metric:
        return LogitDiffMetric(*(ids[rows] if ids.ndim else ids for ids in (self.correct, self.incorrect)),
                               self.position, None if self.lengths is None else torch.as_tensor(self.lengths)[rows])


def logit_diff_metric(correct: torch.Tensor | int, incorrect: torch.Tensor | int, position: int = -1, *,
                      lengths: torch.Tensor | None = None) -> Metric:
    """Mean over prompts of ``logits[b, at[b], correct[b]] - logits[b, at[b], incorrect[b]]`` (a
    ``LogitDiffMetric``).

    ``correct`` / ``incorrect``: a token id, or one per prompt (batch,). ``position`` counts from
    the start (0, 1, ...) or from the end (-1 = the last token) of each prompt. ``lengths`` (batch,):
    the prompts' real token counts in a right-padded batch (``TokenBatch.lengths``); then
    ``at[b]`` counts within prompt b's real tokens (-1: its last real token, not the padding).
    Without ``lengths`` every prompt is read at the same position of the logits. A position past a
    prompt's end is refused, never wrapped. The interventions bind ``lengths`` themselves when
    they pad texts of unequal lengths (``metric_for_batch``).
    """
    return LogitDiffMetric(correct, incorrect, position, lengths)


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


@dataclass(frozen=True)
class PromptScores:
    """A metric pooled over prompts, and what it pools: ``values`` (...) the metric (one per variant
    of an intervention, or a 0-d tensor for one run); ``numerators`` (..., batch) each prompt's
    numerator and ``counts`` (batch,) its denominator, so that a value is sum(numerators) /
    sum(counts) over the batch (up to float rounding), or both None for a metric that does not split
    (``Metric.splits``: a plain callable). A prompt that counts nothing has count 0."""

    values: torch.Tensor
    numerators: torch.Tensor | None
    counts: torch.Tensor | None


def prompt_scores(metric: Metric, logits: torch.Tensor) -> PromptScores:
    """``metric`` on the logits (batch, pos, d_vocab) of a whole batch -> ``PromptScores``: the value
    (0-d float, exactly ``evaluate_metric``'s) and, for a metric that splits, each prompt's numerator
    (batch,) and count (batch,) from the same logits; else both None."""
    metric = as_metric(metric)
    value = evaluate_metric(metric, logits)
    if not metric.splits:
        return PromptScores(value, None, None)
    part, _ = metric.part(slice(0, logits.shape[0]), None)
    return PromptScores(value, part.evaluate(logits)[1], part.counts)


def metric_for_batch(metric: Metric, lengths: torch.Tensor, n_pos: int) -> Metric:
    """``metric`` fitted to a right-padded batch (pos ``n_pos``) whose prompts have ``lengths``
    (batch,) real tokens, so it never reads the padding: unchanged when no prompt is padded, else
    ``Metric.for_lengths`` (a plain callable that declares fixed positions is refused; one that
    declares none is given the padded logits as they are)."""
    lengths = torch.as_tensor(lengths)
    if bool((lengths == n_pos).all()):
        return metric
    return as_metric(metric).for_lengths(lengths)


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
    """Refuse logits (batch, pos, d_vocab) whose leading dims differ from ``shape`` (None: any);
    ``what`` names, in the plural, what fixed that shape."""
    if logits.ndim != 3 or any(want is not None and got != want for got, want in zip(logits.shape, shape)):
        expected = ", ".join("*" if want is None else str(want) for want in shape)
        raise UserError(f"the metric got logits of shape {tuple(logits.shape)}, but {what} expect ({expected}, d_vocab): "
                        "it was built for other prompts; build it from the prompts you pass")


def _as_list(declared) -> list[int]:
    return torch.as_tensor(declared).reshape(-1).tolist()
