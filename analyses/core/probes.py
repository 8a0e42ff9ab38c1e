"""Probe prompts with a repeated segment, the ground truth for head roles (architecture §4.1).

Each prompt is ``start token, prefix (a tokens), segment (p tokens), the same segment again,
filler``, all ``seq_len`` long; the start token is the model's BOS (else its EOS) and every other
token an ordinary one (never a special or added token, never an id of a padded vocabulary). A
model whose input format has no start token (``analyses.core.tokens.starts_with_start_token``)
gets probes without one: the prefix begins at position 0 and every later part one position earlier.
The period ``p`` and prefix length ``a`` vary per prompt, so a head that attends by a fixed
positional offset cannot pass as content-based. Segment tokens are distinct
and never appear in the prefix or filler, so each token of the second copy has exactly one
earlier occurrence, at ``i - p``, and the token after it (the induction target) is at ``i - p + 1``.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Sequence

import torch

from analyses.core.stats import MIN_INTERVAL_PROMPTS
from analyses.core.tokens import model_device, ordinary_token_ids, start_ids
from interp.errors import UserError

MIN_SEQ_LEN = 8  # the shortest probe: the start token, a prefix and two copies of a segment


@dataclass
class RepeatedProbes:
    """A batch of probe prompts.

    tokens: (batch, pos) token ids, the start token at position 0 where ``start_token``.
    period: (batch,) the segment length p of each prompt.
    segment_start: (batch,) position where the first copy starts (prefix length, plus 1 after a
        start token).
    vocab: (n,) the ids every token after the start token is drawn from (kept on the CPU).
    start_token: whether position 0 is the start token (else the prefix begins there).
    """

    tokens: torch.Tensor
    period: torch.Tensor
    segment_start: torch.Tensor
    vocab: torch.Tensor
    start_token: bool = True

    @property
    def n_prompts(self) -> int:
        return self.tokens.shape[0]

    @property
    def seq_len(self) -> int:
        return self.tokens.shape[1]

    def first(self, n: int) -> "RepeatedProbes":
        """The first ``n`` probes (all where there are fewer)."""
        if n < 1:
            raise UserError(f"first {n} probes: take at least one")
        return self.rows(slice(0, n))

    def after(self, n: int) -> "RepeatedProbes":
        """The probes after the first ``n`` (a set disjoint from ``first(n)``); refused where none is left."""
        if not 0 <= n < self.n_prompts:
            raise UserError(f"the probes after the first {n}: there are {self.n_prompts}, so none is left")
        return self.rows(slice(n, None))

    def rows(self, rows: slice) -> "RepeatedProbes":
        """The probes of ``rows`` (a slice of the batch)."""
        return RepeatedProbes(self.tokens[rows], self.period[rows], self.segment_start[rows], self.vocab,
                              self.start_token)

    def _positions(self) -> torch.Tensor:
        return torch.arange(self.seq_len, device=self.tokens.device)[None]

    @property
    def second_copy(self) -> torch.Tensor:
        """(batch, pos) bool: positions in the second copy of the segment."""
        start = (self.segment_start + self.period)[:, None]
        pos = self._positions()
        return (pos >= start) & (pos < start + self.period[:, None])

    @property
    def predictable(self) -> torch.Tensor:
        """(batch, pos) bool: tokens that an induction mechanism can predict: the second copy
        minus its first token (nothing announces that the repeat begins)."""
        start = (self.segment_start + self.period)[:, None]
        return self.second_copy & (self._positions() > start)

    @property
    def earlier_occurrence(self) -> torch.Tensor:
        """(batch, pos) long: for second-copy positions, i - p (the same token earlier); -1 elsewhere."""
        return torch.where(self.second_copy, self._positions() - self.period[:, None], -1)

    @property
    def places(self) -> torch.Tensor:
        """(batch, pos) long: the place of each position in the probe's structure, equal for two
        positions exactly when they are in the same region (start token, prefix, first copy, second
        copy, filler) at the same offset from that region's start: ``region * seq_len + offset``
        (without a start token, region 0 is empty and the prefix begins at position 0)."""
        pos = self._positions()
        first = self.segment_start[:, None]
        second = first + self.period[:, None]
        filler = second + self.period[:, None]
        prefix = torch.full_like(first, int(self.start_token))
        bounds = torch.stack([torch.zeros_like(first), prefix, first, second, filler])  # (5, batch, 1)
        region = (pos[None] >= bounds).sum(0) - 1  # (batch, pos) in 0..4
        offset = pos - bounds.squeeze(-1).T.gather(1, region)
        return region * self.seq_len + offset

    def to(self, device) -> "RepeatedProbes":
        return RepeatedProbes(self.tokens.to(device), self.period.to(device), self.segment_start.to(device), self.vocab,
                              self.start_token)


def repeated_probes(
    n_prompts: int,
    seq_len: int,
    vocab: Sequence[int],
    start_token_id: int | None,
    *,
    period_range: tuple[int, int] | None = None,
    prefix_range: tuple[int, int] | None = None,
    seed: int = 0,
) -> RepeatedProbes:
    """Draw ``n_prompts`` probes of length ``seq_len``: ``start_token_id`` (None: no start token),
    then ids from ``vocab``.

    Defaults: period in [seq_len // 8, seq_len // 3], prefix in [1, seq_len // 8]; the rest is filler.
    Deterministic in ``seed``.
    """
    if n_prompts < 1:
        raise UserError(f"n_prompts={n_prompts} must be >= 1")
    check_seq_len(seq_len, "seq_len=")
    p_low, p_high = period_range or (max(2, seq_len // 8), max(2, seq_len // 3))
    a_low, a_high = prefix_range or (1, max(1, seq_len // 8))
    start = [] if start_token_id is None else [start_token_id]
    if not 2 <= p_low <= p_high or not 0 <= a_low <= a_high or len(start) + a_high + 2 * p_high > seq_len:
        raise UserError(
            f"period_range={(p_low, p_high)} and prefix_range={(a_low, a_high)} do not fit seq_len={seq_len} "
            f"(need 2 <= period, {len(start)} + prefix + 2 * period <= seq_len)"
        )
    vocab = torch.as_tensor(list(vocab), dtype=torch.long)
    if len(vocab) < 2 * p_high:
        raise UserError(f"a vocabulary of {len(vocab)} ordinary tokens is too small for segments of {p_high} distinct tokens")
    generator = torch.Generator().manual_seed(seed)
    periods = torch.randint(p_low, p_high + 1, (n_prompts,), generator=generator)
    prefixes = torch.randint(a_low, a_high + 1, (n_prompts,), generator=generator)
    rows = []
    for period, prefix in zip(periods.tolist(), prefixes.tolist()):
        shuffled = vocab[torch.randperm(len(vocab), generator=generator)]
        segment, others = shuffled[:period], shuffled[period:]
        n_other = seq_len - len(start) - 2 * period
        fill = others[torch.randint(len(others), (n_other,), generator=generator)]
        rows.append(torch.cat([torch.tensor(start, dtype=torch.long), fill[:prefix], segment, segment, fill[prefix:]]))
    return RepeatedProbes(torch.stack(rows), periods, len(start) + prefixes, vocab, bool(start))


def probes_for(model, n_prompts: int, seq_len: int | None = None, seed: int = 0, **ranges) -> RepeatedProbes:
    """A ``RepeatedProbes`` value (``repeated_probes``) sized for a hooked model: its ordinary
    tokens and its start token (none where its input format has none), on its device. ``seq_len``
    defaults to min(n_ctx, 128); an ``n_prompts`` that is not a whole number is refused in one line."""
    check_whole(n_prompts, "n_prompts")
    seq_len = seq_len or min(model.cfg.n_ctx, 128)
    if seq_len > model.cfg.n_ctx:
        raise UserError(f"seq_len={seq_len} exceeds the model's context n_ctx={model.cfg.n_ctx}")
    start = start_ids(model)
    probes = repeated_probes(n_prompts, seq_len, ordinary_token_ids(model), start[0] if start else None, seed=seed,
                             **ranges)
    return probes.to(model_device(model))


def check_whole(value, name: str) -> None:
    """Refuse, in one line naming it, a count (``name``: the argument's name) that is not a whole number."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise UserError(f"{name}={value!r} is not a whole number")


def check_seq_len(seq_len: int | None, what: str) -> None:
    """Refuse, before any work, probes shorter than ``MIN_SEQ_LEN`` (None: the default length).
    ``what``: the setting that gave it, written before the value (``--seq-len ``, ``seq_len=``)."""
    if seq_len is not None and seq_len < MIN_SEQ_LEN:
        raise UserError(f"{what}{seq_len} must be >= {MIN_SEQ_LEN} to hold BOS, a prefix and two copies of a segment")


def check_prompt_count(n_prompts: int, what: str, why: str | None = None) -> None:
    """Refuse, before any work, a count of prompts that cannot serve: none, or fewer than
    ``MIN_INTERVAL_PROMPTS`` where the numbers compare prompts with each other. ``what``: the setting
    that gave the count (``--prompts 1``); ``why``: what compares the prompts (None: nothing does)."""
    if n_prompts < 1:
        raise UserError(f"{what}: at least 1 prompt is needed")
    if why is not None and n_prompts < MIN_INTERVAL_PROMPTS:
        raise UserError(f"{what}: at least {MIN_INTERVAL_PROMPTS} prompts are needed, since {why}")


def corrupt_first_copy(probes: RepeatedProbes, seed: int = 0) -> torch.Tensor:
    """The induction patching pair's corrupted side: the same prompts with the first copy of the
    segment replaced by other tokens of the probes' vocabulary (none already in the prompt), so the
    second copy is no longer predictable. Returns a tensor of tokens (batch, pos), as long as
    ``probes.tokens``."""
    generator = torch.Generator().manual_seed(seed)
    corrupted = probes.tokens.clone().cpu()
    for row, (start, period) in enumerate(zip(probes.segment_start.tolist(), probes.period.tolist())):
        used = set(corrupted[row].tolist())
        fresh = torch.tensor([t for t in probes.vocab.tolist() if t not in used])
        if len(fresh) < period:
            raise UserError(f"a vocabulary of {len(probes.vocab)} ordinary tokens is too small to corrupt a segment of {period} tokens")
        corrupted[row, start:start + period] = fresh[torch.randperm(len(fresh), generator=generator)[:period]]
    return corrupted.to(probes.tokens.device)


def shuffle_second_copy(probes: RepeatedProbes, seed: int = 0) -> RepeatedProbes:
    """Control probes for the content roles: the same prompts with each second copy permuted by a
    random cycle (Sattolo's algorithm), so no token of the second copy sits at ``i - p`` after its
    earlier occurrence. Positions, periods, the multiset of tokens and every positional relation
    are kept; "the token at i - p" (duplicate) and "the token after it" (induction) now mean nothing.
    """
    generator = torch.Generator().manual_seed(seed)
    tokens = probes.tokens.clone().cpu()
    for row, (start, period) in enumerate(zip(probes.segment_start.tolist(), probes.period.tolist())):
        second = slice(start + period, start + 2 * period)
        tokens[row, second] = tokens[row, second][random_cycle(period, generator)]
    return RepeatedProbes(tokens.to(probes.tokens.device), probes.period, probes.segment_start, probes.vocab,
                          probes.start_token)


def random_cycle(n: int, generator: torch.Generator) -> torch.Tensor:
    """(n,) a uniformly drawn cyclic permutation of 0..n-1 (Sattolo): no element stays in place."""
    order = list(range(n))
    for i in range(n - 1, 0, -1):
        j = int(torch.randint(i, (1,), generator=generator))
        order[i], order[j] = order[j], order[i]
    return torch.tensor(order)
