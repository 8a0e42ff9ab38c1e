"""Many interventions in one forward: the hook-editing mechanism behind ablation and patching.

An intervention (a *variant*) is a list of edits ``Edit(hook, index)``: the part ``index`` of that
activation (indexed without its batch dim) takes its value from a *source* activation of the same
name, shape (batch, ...). An ``Edit(hook, index, value)`` carries its own value instead
(batch, *the indexed part's shape): path patching gives every variant a different one. (A plain
tuple ``(hook, index[, value])`` is read as the same edit.) Ablation's
sources are zero / mean / resampled head outputs; patching's are the other run's cache. ``k``
variants run as one forward of ``k * batch`` rows (variant-major: row ``v * batch + b`` is prompt b
under variant v), chunked to a memory budget; ``collect_variants`` returns activations instead of
a metric, stopping each forward once they are stored.

On ``GPTModel`` a chunk runs only the blocks from its earliest edited layer on, starting from
the cached residual stream of the unedited run (``start_at_layer``); a chunk whose earliest edits
are all of that layer's ``hook_resid_mid`` starts after the layer's attention. A
``TransformerBridge``'s ``start_at_layer`` still runs the earlier blocks (architecture §7), so there the
full forward runs.

The linearised counterpart (``activation_gradients``, ``linear_effects``) serves attribution
patching, edge attribution and Michel et al.'s head importance: the first-order change of the
metric for moving an activation, from one forward and backward, over chunks of prompts
(``gradient_parts``; the other run's part: ``scored_cache``).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Mapping, Sequence, Union

import torch
from einops import einsum, repeat

from analyses.core.budget import rows_within
from analyses.core.execution import current
from analyses.core.hook_names import final_resid_name, layer_of, resid_mid_name, resid_pre_name, z_name
from analyses.core.metrics import Metric, MetricPart, PromptScores, as_metric, evaluate_metric
from analyses.core.progress import progress_bar
from analyses.core.tokens import accumulator
from interp.errors import UserError


@dataclass(frozen=True)
class Edit:
    """One edit of an intervention: the part ``index`` (a tuple indexing the activation without its
    batch dim; () for all of it) of the activation ``hook`` ("blocks.{l}....") takes ``value``
    (batch, *the indexed part's shape), or where that is None the source activation of that name."""

    hook: str
    index: tuple = ()
    value: torch.Tensor | None = None


Cell = Union[Edit, tuple]  # an Edit, or the tuple (hook, index[, value]) read as one
Variant = Sequence[Cell]


def as_edit(cell: Cell) -> Edit:
    """An ``Edit``, also from the tuple ``(hook, index[, value])``."""
    return cell if isinstance(cell, Edit) else Edit(*cell)


def runs_suffix_only(model) -> bool:
    """Whether ``model(resid, start_at_layer=l)`` computes only blocks l.. (GPTModel's
    ``suffix_only_start``; a TransformerBridge reruns the earlier blocks, architecture §7)."""
    return getattr(model, "suffix_only_start", False)


def head_cells(heads: Sequence[tuple[int, int]]) -> list[Edit]:
    """The edits that replace each head's output at every position."""
    return [Edit(z_name(layer), (slice(None), head)) for layer, head in heads]


class _Collected(Exception):
    """Raised once every wanted activation is stored, to skip the rest of the forward."""


def capture_hooks(names: Sequence[str], kept: dict, *, stop: bool = False, graph: bool = False) -> list:
    """Forward hooks storing the activation of each of ``names`` (distinct) in ``kept`` under that
    name (a hook's own name may be a backend's alias): detached, and with ``stop`` raising
    ``_Collected`` once every one is stored (``kept`` starts empty); with ``graph`` a view that the
    hook returns, so the tensor stored is the one the model uses next (a gradient may be taken with
    respect to it)."""
    def keeper(name):
        def keep(activation, hook):
            if graph:
                kept[name] = activation.view_as(activation)
                return kept[name]
            kept[name] = activation.detach()
            if stop and len(kept) == len(names):
                raise _Collected

        return keep

    return [(name, keeper(name)) for name in names]


def cache_run(model, tokens: torch.Tensor, names: Sequence[str], *, logits: bool = True):
    """One plain forward -> (logits (batch, pos, d_vocab), {name: activation} for ``names``).

    With ``logits=False`` the forward stops as soon as the last wanted activation is stored
    (the layers after it and the unembedding are skipped) and the logits are None.
    """
    kept, output = {}, None
    try:
        with torch.no_grad(), model.hooks(fwd_hooks=capture_hooks(set(names), kept, stop=not logits)):
            output = model(tokens)
    except _Collected:
        pass
    return output, kept


def start_names(model) -> list[str]:
    """Where a run of ``model`` may start and compute only the rest: every layer's
    ``hook_resid_pre`` on GPTModel (``suffix_only_start``), and its ``hook_resid_mid`` where blocks
    have one (``resid_mid_start``); none on a TransformerBridge."""
    if not runs_suffix_only(model):
        return []
    mids = getattr(model, "resid_mid_start", False)
    return [name for layer in range(model.cfg.n_layers)
            for name in (resid_pre_name(layer), *([resid_mid_name(layer)] if mids else []))]


def base_run(model, tokens: torch.Tensor, names: Sequence[str] = ()) -> tuple[torch.Tensor, dict, dict | None]:
    """The unedited run -> (logits (batch, pos, d_vocab), {name: activation} for ``names``, starts).

    ``starts`` maps each ``start_names`` hook to the unedited residual (batch, pos, d_model) there,
    where the model can start and compute only the rest (GPTModel); None elsewhere.
    """
    resid_names = start_names(model)
    logits, cache = cache_run(model, tokens, [*names, *resid_names])
    starts = {name: cache[name] for name in resid_names} if resid_names else None
    return logits, {name: cache[name] for name in names}, starts


def _edit_hook(mask: torch.Tensor | None, source: torch.Tensor | None, n_variants: int, valued: Sequence = ()):
    """Hook writing ``source`` (batch, ...) where ``mask`` (variants, ...) is True, per variant,
    then each valued cell's ``(variant, index, value)``."""

    def hook(activation, hook):
        grouped = activation.unflatten(0, (n_variants, -1))  # (variants, batch, ...)
        if mask is not None:
            grouped = torch.where(mask[:, None], source[None].to(activation.dtype), grouped)
        elif valued:
            grouped = grouped.clone()
        for v, index, value in valued:
            grouped[v][(slice(None), *index)] = value.to(activation.dtype)
        return grouped.flatten(0, 1)

    return hook


def edit_hooks(variants: Sequence[Variant], sources: Mapping[str, torch.Tensor]) -> list[tuple[str, object]]:
    """One forward hook per edited activation, covering every variant of the expanded batch.
    ``sources`` needs an entry for every name edited by a cell without its own value."""
    cells_by_name, valued_by_name = defaultdict(list), defaultdict(list)
    for v, variant in enumerate(variants):
        for edit in map(as_edit, variant):
            if edit.value is not None:
                valued_by_name[edit.hook].append((v, edit.index, edit.value))
            else:
                cells_by_name[edit.hook].append((v, edit.index))
    hooks = []
    for name in dict.fromkeys([*cells_by_name, *valued_by_name]):
        mask = source = None
        if name in cells_by_name:
            source = sources[name]
            mask = torch.zeros((len(variants), *source.shape[1:]), dtype=torch.bool, device=source.device)
            for v, index in cells_by_name[name]:
                mask[v][index] = True
        hooks.append((name, _edit_hook(mask, source, len(variants), valued_by_name.get(name, ()))))
    return hooks


def start_of(variant: Variant) -> tuple[int, bool]:
    """Where a run serving ``variant`` may start -> (its earliest edited layer, whether every edit
    there is of that layer's ``hook_resid_mid``, so the layer's attention may be skipped)."""
    hooks = [as_edit(cell).hook for cell in variant]
    layer = min(layer_of(hook) for hook in hooks)
    return layer, all(hook == resid_mid_name(layer) for hook in hooks if layer_of(hook) == layer)


def _forward_variants(model, tokens, variants: Sequence[Variant], hooks: list, starts: Mapping | None,
                     positions: torch.Tensor | None = None, *, compact: bool = False,
                     entries: torch.Tensor | None = None):
    """One forward of ``tokens`` repeated once per variant (variant-major) under ``hooks``; with
    ``starts`` it begins at the variants' earliest edit (``start_of``) and, given ``positions``,
    unembeds only those: logits (rows, len(positions), d_vocab) with ``compact``, and with
    ``entries`` (batch, len(positions)) bool too, only those entries of each variant (variants x m,
    d_vocab), variant-major; else ``partial_logits``."""
    k = len(variants)
    with torch.no_grad(), model.hooks(fwd_hooks=hooks):
        if starts is None:
            return model(repeat(tokens, "b p -> (k b) p", k=k))
        start = nearest_start(starts, *min(start_of(variant) for variant in variants))
        if start is None:  # none kept before the edits: from the tokens
            resid, at = repeat(tokens, "b p -> (k b) p", k=k), {}
        else:
            name, layer, mid = start
            resid, at = repeat(starts[name], "b p d -> (k b) p d", k=k), {"start_at_layer": layer,
                                                                          "start_at_resid_mid": mid}
        if positions is None:
            return model(resid, **at)
        final = model(resid, **at, stop_at_layer=model.cfg.n_layers)
        if not compact:
            return partial_logits(model, final, positions)
        read = final[:, positions]
        return model.unembed(read if entries is None else read[entries.repeat(k, 1)])


def nearest_start(starts: Mapping, layer: int, after_attention: bool = False) -> tuple[str, int, bool] | None:
    """The latest of ``starts`` (``start_names`` hooks, some of them) at or before block ``layer``'s
    ``hook_resid_pre`` (its ``hook_resid_mid`` with ``after_attention``) -> (its name, its layer,
    whether it is a ``hook_resid_mid``); None where there is none. A run from an earlier start
    recomputes the blocks in between (a ``Run`` keeps fewer starts where all would not fit its budget)."""
    for at in range(layer, -1, -1):
        for mid in (True, False):
            name = resid_mid_name(at) if mid else resid_pre_name(at)
            if (at < layer or after_attention or not mid) and name in starts:
                return name, at, mid
    return None


def partial_logits(model, final: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The residual leaving the last block (rows, pos, d_model) -> logits (rows, pos, d_vocab) at
    ``positions`` only, NaN at every other position (so a metric that reads one of those shows it;
    ``score_variants`` refuses a NaN value). Only for a metric that cannot take the read
    positions alone (one that does not split, ``analyses.core.metrics.Metric.part``): it allocates every position."""
    read = model.unembed(final[:, positions])  # its width is the output space's (d_vocab_out where it differs)
    logits = final.new_full((*final.shape[:2], read.shape[-1]), torch.nan)
    logits[:, positions] = read
    return logits


def unembed_read(model, final: torch.Tensor, positions: torch.Tensor | None,
                 entries: torch.Tensor | None = None) -> torch.Tensor:
    """The residual leaving the last block (batch, pos, d_model) unembedded at ``positions`` (n,)
    alone -> (batch, n, d_vocab), or at the ``entries`` (batch, n) bool of those alone -> (m,
    d_vocab); at every position where ``positions`` is None (batch, pos, d_vocab). What a
    ``MetricSums.score`` chunk returns where the forward stops before the unembedding."""
    if positions is None:
        return model.unembed(final)
    read = final[:, positions.to(final.device)]
    return model.unembed(read if entries is None else read[entries.to(final.device)])


def run_variants(
    model, tokens, variants: Sequence[Variant], sources: Mapping[str, torch.Tensor], starts: Mapping | None = None,
    positions: torch.Tensor | None = None, *, compact: bool = False, entries: torch.Tensor | None = None,
) -> torch.Tensor:
    """Logits (variants, batch, pos, d_vocab) of ``tokens`` under each variant, in one forward.

    ``sources`` maps every edited hook name to its source (batch, ...). With ``starts`` (from
    ``base_run``) the forward begins at the chunk's earliest edited layer, and ``positions`` (n,),
    if given, are the only ones unembedded: (variants, batch, n, d_vocab) with ``compact``, NaN
    elsewhere without; with ``compact`` and ``entries`` (batch, n) bool, only those entries:
    (variants, m, d_vocab), row-major (a metric part's ``entries``, ``analyses.core.metrics.MetricPart``).
    """
    logits = _forward_variants(model, tokens, variants, edit_hooks(variants, sources), starts, positions,
                               compact=compact, entries=entries)
    return logits.unflatten(0, (len(variants), -1))


def rows_per_chunk(model, batch: int, n_pos: int, memory_mb: float, *, logits: bool = True) -> int:
    """How many variants of ``batch`` prompts fit one forward within ``memory_mb``."""
    return max(1, rows_within(model, n_pos, memory_mb, logits=logits) // batch)


@dataclass(frozen=True)
class Chunk:
    """One forward of a sweep: the variants ``members`` (their indices) over the prompts ``rows``
    (a slice start:stop of the batch)."""

    members: list
    rows: slice


def variant_chunks(model, tokens: torch.Tensor, variants: Sequence[Variant], memory_mb: float,
                   *, logits: bool = True, read: int | None = None, split_rows: bool = True,
                   by_prompts: bool = False) -> list[Chunk]:
    """The forwards of a sweep within ``memory_mb``: the variants grouped by where their runs may
    start (``start_of``, so a suffix run starts as late as it can), each group cut into chunks of
    variants over every prompt; where even one variant over every prompt exceeds the budget (and
    ``split_rows``), one variant over as many prompts as fit, each variant's prompts one after
    another, or with ``by_prompts`` a group's variants one after another on the same prompts before
    the next prompts (so that what a chunk keeps of its prompts serves the whole group). ``read``:
    positions unembedded per row (None: all, see ``analyses.core.budget.row_bytes``)."""
    if any(len(variant) == 0 for variant in variants):
        raise UserError("every intervention needs at least one cell to edit")
    by_start = defaultdict(list)
    for v, variant in enumerate(variants):
        by_start[start_of(variant)].append(v)
    batch = tokens.shape[0]
    fit = rows_within(model, tokens.shape[1], memory_mb, logits=logits, read=read)
    if fit < batch and split_rows:
        starts = range(0, batch, fit)
        groups = [members for _, members in sorted(by_start.items())]
        cells = ([(v, start) for members in groups for start in starts for v in members] if by_prompts
                 else [(v, start) for members in groups for v in members for start in starts])
        return [Chunk([v], slice(start, min(start + fit, batch))) for v, start in cells]
    chunk = max(1, fit // batch)
    return [Chunk(members[i:i + chunk], slice(0, batch))
            for _, members in sorted(by_start.items()) for i in range(0, len(members), chunk)]


def rows_of(tensor: torch.Tensor, rows: slice, batch: int) -> torch.Tensor:
    """The prompts ``rows`` of a tensor (batch, ...); one of batch 1 (broadcast to every prompt) as it is."""
    return tensor[rows] if tensor.shape[0] == batch else tensor


def chunk_edits(variants: Sequence[Variant], sources: Mapping[str, torch.Tensor], starts: Mapping | None,
                rows: slice, batch: int) -> tuple[list[list[Edit]], dict, dict | None]:
    """The variants, sources and starts of a sweep restricted to the prompts ``rows``."""
    edits = [[Edit(edit.hook, edit.index, None if edit.value is None else rows_of(edit.value, rows, batch))
              for edit in map(as_edit, variant)] for variant in variants]
    return (edits, {name: rows_of(source, rows, batch) for name, source in sources.items()},
            None if starts is None else {name: start[rows] for name, start in starts.items()})


def score_variants(
    model,
    tokens: torch.Tensor,
    variants: Sequence[Variant],
    sources: Mapping[str, torch.Tensor],
    metric: Metric,
    *,
    starts: Mapping | None = None,
    desc: str = "interventions",
) -> PromptScores:
    """``metric`` under each variant -> ``PromptScores``: values (n_variants,) float, in the order
    given, and, for a metric that splits (``analyses.core.metrics.Metric.splits``), each
    prompt's numerator (n_variants, batch) and count (batch,) from the same forwards.

    Variants run in the chunks of ``variant_chunks``: several variants over every prompt per
    forward, or where one variant over every prompt exceeds the current execution's memory
    (``analyses.core.execution``), one variant over a chunk
    of prompts, the parts' values combined as ``analyses.core.metrics.Metric.part`` says (a metric
    that cannot be split gets every prompt at once). ``starts``: see ``run_variants``; with them,
    only the positions the metric reads (``analyses.core.metrics.Metric.positions``) are unembedded,
    and only those positions' logits are made (for a metric that cannot take them alone, the
    others are NaN). Its bar (``desc``) is shown per the current execution's progress
    (``analyses.core.execution``). Deterministic in its inputs.
    """
    def chunk_logits(members: list, rows: slice, positions: torch.Tensor | None, compact: bool,
                     entries: torch.Tensor | None) -> torch.Tensor:
        edits, part_sources, part_starts = chunk_edits([variants[v] for v in members], sources, starts, rows,
                                                       tokens.shape[0])
        return run_variants(model, tokens[rows], edits, part_sources, part_starts, positions, compact=compact,
                            entries=entries)

    return score_chunks(model, tokens, variants, metric, chunk_logits, read_only=starts is not None, desc=desc)


def score_chunks(model, tokens: torch.Tensor, variants: Sequence[Variant], metric: Metric, chunk_logits, *,
                 read_only: bool, desc: str = "interventions",
                 by_prompts: bool = False) -> PromptScores:
    """``metric`` under each variant -> ``PromptScores`` (as ``score_variants``'), however a chunk's
    logits are made: ``chunk_logits(members, rows, positions, compact, entries)`` gives the logits of the
    variants ``members`` (indices) on the prompts ``rows`` -> (len(members), rows, n, d_vocab), ``n``
    being ``positions`` (n,) with ``compact``, else every position (NaN off ``positions`` where
    given); where the metric's part reads only some entries of those positions (``entries``
    (rows, n) bool, not None), those alone -> (len(members), m, d_vocab), row-major.
    The chunks are ``variant_chunks``' within the current execution's memory (``by_prompts``: see
    there), scored by ``MetricSums``
    (the metric's parts and their weighting); with ``read_only`` the logits are asked for at the
    metric's read positions only."""
    batch, n_pos = tokens.shape
    metric = as_metric(metric)
    positions = metric.positions(n_pos) if read_only else None
    chunks = variant_chunks(model, tokens, variants, current().memory_mb, read=None if positions is None or not metric.splits
                            else len(positions), split_rows=metric.splits, by_prompts=by_prompts)
    scores = MetricSums(model, metric, len(variants), batch, positions).score(chunks, chunk_logits, desc=desc)
    values = scores.values.float()
    if positions is not None and values.isnan().any():
        raise UserError(f"the metric gave NaN: it reads logits outside the positions it declares "
                        f"({positions.tolist()}; give it the right read_positions, or none), or the model's "
                        "output is not finite")
    return PromptScores(values, scores.numerators, scores.counts)


class MetricSums:
    """A metric pooled over chunks of (variants x prompts), each chunk scored as its logits come, so
    that no more than a chunk's logits exist at once: for a metric that splits
    (``analyses.core.metrics.Metric.splits``) each variant's value is the weighted mean of its parts'
    values (``Metric.part``) and each prompt's numerator and count are kept from the same logits
    (``MetricPart.evaluate``); one that does not is scored once per variant on the logits of
    every prompt (its chunks' joined, in row order).

    n_variants, batch: the values' and the prompts' number; positions (n,): the positions the logits
    of a chunk are at (None: every position; a part then reads its own from them)."""

    def __init__(self, model, metric: Metric, n_variants: int, batch: int, positions: torch.Tensor | None = None):
        self.metric, self.batch, self.positions = as_metric(metric), batch, positions
        self.split = self.metric.splits
        self.sums, self.weights = accumulator(model, n_variants), accumulator(model, n_variants)
        self.numerators = accumulator(model, n_variants, batch) if self.split else None
        self.counts = accumulator(model, batch) if self.split else None
        self.unsplit: dict[int, list[torch.Tensor]] = defaultdict(list)  # variant -> its chunks' logits so far

    def part(self, rows: slice) -> tuple[Metric | MetricPart, float]:
        """The metric on the prompts ``rows`` (a slice start:stop of the batch) -> (its part, the
        part's weight), or for a metric that does not split (itself, 1.0). A part of weight 0 counts
        no token: scoring it adds nothing."""
        return self.metric.part(rows, self.positions) if self.split else (self.metric, 1.0)

    def add(self, members: Sequence[int], rows: slice, part: Metric | MetricPart, weight: float,
            logits: torch.Tensor) -> None:
        """Score the logits (len(members), ...) of the variants ``members`` (indices) on the prompts
        ``rows``, as ``part`` (from ``part(rows)``, with its ``weight``) takes them: (rows, n,
        d_vocab), n the positions, or (m, d_vocab) at the part's ``entries``."""
        for v, variant_logits in zip(members, logits):
            if self.split:
                value, each = part.evaluate(variant_logits)
                self.numerators[v, rows] = each.to(self.numerators.dtype)
            else:
                self.unsplit[v].append(variant_logits)
                if rows.stop < self.batch:  # scored once its last prompts are in
                    continue
                chunks = self.unsplit.pop(v)
                value = evaluate_metric(self.metric, chunks[0] if len(chunks) == 1 else torch.cat(chunks))
            self.sums[v] += weight * value.to(self.sums.dtype)
            self.weights[v] += weight
        if self.split:
            self.counts[rows] = part.counts.to(self.counts.device, self.counts.dtype)

    def score(self, chunks: Sequence[Chunk], chunk_logits, *, desc: str = "interventions") -> PromptScores:
        """Score each of ``chunks`` in turn from ``chunk_logits(members, rows, positions, compact,
        entries)`` (as ``score_chunks`` says; ``compact`` where the metric splits), asked for only
        where the chunk's part has a weight -> ``scores()``. The progress bar counts variants, each
        done once its last prompts are scored, shown per the current execution's progress."""
        variants = {v for chunk in chunks for v in chunk.members}
        with progress_bar(total=len(variants), desc=desc, leave=False) as bar:
            for chunk in chunks:
                part, weight = self.part(chunk.rows)
                if weight > 0:
                    logits = chunk_logits(chunk.members, chunk.rows, self.positions, self.split,
                                          part.entries if self.split else None)
                    self.add(chunk.members, chunk.rows, part, weight, logits)
                if chunk.rows.stop >= self.batch:
                    bar.update(len(chunk.members))
        return self.scores()

    def scores(self) -> PromptScores:
        """Every value (n_variants,) in the accumulators' dtype (``analyses.core.tokens.accumulator``),
        and where the metric splits each prompt's numerator (n_variants, batch) and count (batch,)."""
        return PromptScores(self.sums / self.weights, self.numerators, self.counts)


def collect_variants(
    model,
    tokens: torch.Tensor,
    variants: Sequence[Variant],
    sources: Mapping[str, torch.Tensor],
    names: Sequence[str],
    *,
    starts: Mapping | None = None,
) -> dict[str, torch.Tensor]:
    """The activations ``names`` under each variant -> {name: (n_variants, batch, ...)}, in the order
    given. Each forward stops once they are stored, so a chunk runs only up to the last of them
    (from its earliest edited layer where ``starts`` allows); a chunk is several variants over
    every prompt, or one variant over as many prompts as fit the current execution's memory
    (``variant_chunks``). ``names`` must come at or after every variant's edits."""
    wanted, collected = list(dict.fromkeys(names)), defaultdict(lambda: defaultdict(list))
    batch = tokens.shape[0]
    for chunk in variant_chunks(model, tokens, variants, current().memory_mb, logits=False):
        edits, part_sources, part_starts = chunk_edits([variants[v] for v in chunk.members], sources, starts,
                                                       chunk.rows, batch)
        kept = {}
        try:
            hooks = [*edit_hooks(edits, part_sources), *capture_hooks(wanted, kept, stop=True)]
            _forward_variants(model, tokens[chunk.rows], edits, hooks, part_starts)
        except _Collected:
            pass
        for name in wanted:
            for v, activation in zip(chunk.members, kept[name].unflatten(0, (len(edits), -1))):
                collected[name][v].append(activation)  # the chunks of one variant come in row order
    return {name: torch.stack([torch.cat(collected[name][v]) for v in range(len(variants))]) for name in wanted}


@dataclass(frozen=True)
class GradientPart:
    """One chunk of prompts of a linearised analysis: the prompts ``rows`` (a slice start:stop),
    the metric on them alone (``analyses.core.metrics.Metric.part``) and its ``share`` of the
    batch's metric (weight / the batch's weight), so the batch's gradient is the sum over parts of
    share x the part's gradient."""

    rows: slice
    metric: Metric | MetricPart
    share: float


def gradient_parts(model, tokens: torch.Tensor, metric: Metric, memory_mb: float,
                   per_position: int = 0) -> tuple[list[GradientPart], torch.Tensor | None]:
    """The chunks of prompts whose forward and backward (every layer's activations kept for it,
    and ``per_position`` more floats per position) fit ``memory_mb`` -> (parts, the positions to
    unembed: those the metric reads on a model that can stop before its unembedding, else None).
    A metric that cannot be split is one part of every prompt."""
    batch, n_pos = tokens.shape
    metric = as_metric(metric)
    positions = metric.positions(n_pos) if runs_suffix_only(model) else None
    if not metric.splits:
        return [GradientPart(slice(0, batch), metric, 1.0)], None
    fit = rows_within(model, n_pos, memory_mb, logits=True, read=None if positions is None else len(positions),
                      layers=model.cfg.n_layers, per_position=per_position)
    parts = [(rows, *metric.part(rows, positions))
             for rows in (slice(start, min(start + fit, batch)) for start in range(0, batch, fit))]
    total = sum(weight for *_, weight in parts)
    return [GradientPart(rows, part, weight / total) for rows, part, weight in parts if weight > 0], positions


def activation_gradients(model, tokens: torch.Tensor, metric: Metric, names: Sequence[str],
                         also_keep: Sequence[str] = (),
                         positions: torch.Tensor | None = None) -> tuple[float, dict, dict]:
    """One forward and backward -> (metric value, {name: activation} for ``names`` and
    ``also_keep``, {name: dmetric/dactivation} for ``names``). Only the gradients asked for are
    computed (no weight grads; the backward stops at the earliest of ``names``). ``positions``
    (n,): on a model that can stop before its unembedding, only those are unembedded and the
    metric takes logits (batch, n, d_vocab) (``gradient_parts``)."""
    kept = {}

    def start_graph(embed, hook):  # a graph even when the weights do not require grad
        return embed.detach().requires_grad_(True)

    kept_names = list(dict.fromkeys([*names, *also_keep]))
    hooks = [("hook_embed", start_graph), *capture_hooks(kept_names, kept, graph=True)]
    with torch.enable_grad():
        if positions is None:
            value = evaluate_metric(metric, model.run_with_hooks(tokens, fwd_hooks=hooks))
        else:
            final = model.run_with_hooks(tokens, fwd_hooks=hooks, stop_at_layer=model.cfg.n_layers)
            value = evaluate_metric(metric, model.unembed(final[:, positions]))
        silent = [name for name in kept_names if name not in kept]
        if silent:
            raise UserError(f"{type(model).__name__} never fired {', '.join(silent)}, which this analysis needs")
        grads = torch.autograd.grad(value, [kept[name] for name in names])
    return value.item(), {name: kept[name].detach() for name in kept_names}, dict(zip(names, grads))


def scored_cache(model, tokens: torch.Tensor, names: Sequence[str], metric: Metric | None,
                 positions: torch.Tensor | None = None) -> tuple[float | None, dict]:
    """One plain forward of a part's prompts ``tokens`` (rows, pos) -> (``metric`` on its logits, or
    None without one, {name: activation} for ``names``): the other run of a linearised analysis
    beside ``activation_gradients`` of the same part. ``positions`` as there (``gradient_parts``):
    only those are unembedded, from the residual leaving the last block. Without a metric the
    forward stops once the last of ``names`` is stored (no unembedding)."""
    if metric is None:
        return None, cache_run(model, tokens, names, logits=False)[1]
    if positions is None:
        logits, cache = cache_run(model, tokens, names)
        return evaluate_metric(metric, logits).item(), cache
    final = final_resid_name(model)
    _, cache = cache_run(model, tokens, [*names, final], logits=False)
    with torch.no_grad():
        value = evaluate_metric(metric, model.unembed(cache[final][:, positions])).item()
    return value, {name: cache[name] for name in names}


def linear_effects(grads: list, z: list, z_target: list, keep: str = "p h") -> torch.Tensor:
    """First-order change of the metric moving each head's z to ``z_target`` (each per layer,
    (batch, pos, head, d_head)), summed over every axis not in ``keep`` -> [n_layers, *keep],
    e.g. ``keep="p h"`` -> [n_layers, pos, n_heads]."""
    return torch.stack([
        einsum(g.float(), (target - current).float(), f"b p h d, b p h d -> {keep}")  # float32 sums
        for g, current, target in zip(grads, z, z_target)
    ])
