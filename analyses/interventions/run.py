"""The spine (architecture §4.0): one run of one model on one batch, made once and read by every analysis.

A ``Run`` holds the model, the token batch (batch, pos), the metric and its value on the unedited
run (``baseline``), the activations later steps read (``cache``: hook name -> (batch, ...)) and,
on a model that can start a forward part-way (``GPTModel``), the residual stream where it may start
(``starts``: see ``analyses.interventions.engine.start_names``). It is made by ONE forward of the batch
(``Run.make``; chunked over prompts only where ``memory_mb`` asks, still one pass), which may also
feed *streaming consumers*: hooks that reduce an activation as the forward runs (classification's
per-prompt pattern sums), so the whole activation need never be stored.

Each analysis says what it reads as a small function returning hook names (``ablation_reads``,
``direct_effect_reads``, ...), so a caller running several of them (the report) takes the union
before the one forward. An activation a step asks for later (``Run.read``) is computed by a
forward of only the blocks it needs, from the latest cached start before it.

Interventions run on a ``Run``: the base run is the one that gets patched (its tokens, starts and
baseline), the sources what gets written in (``analyses.interventions.engine.score_variants``).
Options shared by the intervention functions are one ``Options`` object; the memory and progress
of their forwards are the current execution's (``analyses.core.execution``). Beside each pooled value a
run and a sweep keep each prompt's numerator and count (``PromptScores``), from which
``analyses.core.stats.effect_intervals`` bootstraps every effect's interval over prompts (architecture §4.12).
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, field, replace
from typing import Callable, Mapping, Sequence

import torch

from analyses.core.budget import DEFAULT_MEMORY_MB, held_mb, rows_within, tensors_within
from analyses.core.execution import current, executing
from analyses.core.hook_names import layer_of, resid_pre_name
from analyses.interventions.engine import (MetricSums, _Collected, capture_hooks, nearest_start, runs_suffix_only,
                                           score_variants, start_names)
from analyses.core.metrics import Metric, PromptScores, as_metric
from analyses.core.progress import progress_bar
from analyses.core.stats import effect_intervals
from interp.errors import UserError

Consumer = Callable[[torch.Tensor, slice], None]  # (activation of a chunk of prompts, its rows) -> None
STARTS_SHARE = 1 / 4
"""The share of its ``memory_mb`` a ``Run``'s starts may take (``kept_starts``): they stay held while
the run lives, and every step that reads the run gets what they leave (``Run.held_mb``,
``analyses.core.budget.left_after``), so three quarters stay for those steps."""


@dataclass(frozen=True)
class Options:
    """What the intervention functions share beyond their inputs and the execution
    (``analyses.core.execution``: the memory and progress every forward reads).

    direction: "denoise" (run the corrupted prompts, patch in the clean run's activations) or
    "noise" (the reverse); normalize: rescale a metric to (value - corrupted) / (clean - corrupted)."""

    direction: str = "denoise"
    normalize: bool = False

    def but(self, **changes) -> "Options":
        """A copy with ``changes`` (a name that is not an option: a TypeError naming it)."""
        return replace(self, **changes)

    @classmethod
    def of(cls, options: "Options | None", keywords: Mapping) -> "Options":
        """``options`` (default ``Options()``) with the keyword arguments ``keywords`` (``direction=``,
        ``normalize=``) on top: how a public function takes both."""
        return (options or cls()).but(**keywords)


@dataclass
class Run:
    """One model on one batch, run once (see the module docstring); every field after ``tokens`` is
    keyword-only.

    tokens: (batch, pos); metric: logits -> scalar, or None; baseline: the metric on this run (None
    without one); cache: hook name -> activation (batch, ...); starts: ``start_names`` hook ->
    residual (batch, pos, d_model) on a model that can start there, None elsewhere; reduced: what
    streaming consumers left, by the key they were given; silent: asked-for hooks the model never
    fired, left out of ``read`` as ``run_with_cache`` leaves them out of its cache; stored: how many
    of the first prompts the cache and starts hold where ``Run.make`` kept fewer than all (then
    only ``first`` up to that many reads them), None where they hold every prompt."""

    model: object
    tokens: torch.Tensor
    _: KW_ONLY
    metric: Metric | None = None
    baseline: float | None = None
    cache: dict = field(default_factory=dict)
    starts: dict | None = None
    reduced: dict = field(default_factory=dict)
    silent: frozenset = frozenset()
    memory_mb: float = DEFAULT_MEMORY_MB
    stored: int | None = None
    scored: list = field(default_factory=list)  # [(metric, its PromptScores on this run)], by identity

    @classmethod
    def make(cls, model, tokens: torch.Tensor, metric: Metric | None = None, names: Sequence[str] = (), *,
             consumers: Sequence[tuple[str, Consumer]] = (), reducers: Mapping[str, object] | None = None,
             starts: bool = True, keep_rows: int | None = None,
             memory_mb: float | None = None, progress: bool | None = False, desc: str = "run") -> "Run":
        """One forward of ``tokens`` (batch, pos), in chunks of prompts that fit ``memory_mb`` (None:
        the current execution's, ``analyses.core.execution``),
        keeping ``names`` (and with ``starts`` the ``start_names`` residuals), calling each
        consumer ``(hook name, fn(activation (chunk, ...), rows))`` as the forward passes the hook,
        and evaluating ``metric`` on the logits. ``reducers``: key -> an object with ``hooks()``
        (consumers) and ``result()``, left in ``reduced[key]``. Without a metric the forward stops
        once the last wanted hook has fired (no unembedding). ``keep_rows``: keep ``names`` and the
        starts for the first ``keep_rows`` prompts only (the consumers and the metric still see every
        prompt), so what the run holds does not grow with the batch; read them through ``first``.
        In order: the prompts stored (``_stored_rows``), the hooks kept and fed (``kept_starts``,
        ``_consumers_by_name``), the prompts per forward (``chunk_rows``), the one pass
        (``_forward_chunks``) and what the run holds (``_cache_and_starts``)."""
        memory_mb = current().memory_mb if memory_mb is None else memory_mb
        keep_rows = _stored_rows(keep_rows, len(tokens))
        reducers = dict(reducers or {})
        by_name = _consumers_by_name([*consumers, *(hook for reducer in reducers.values() for hook in reducer.hooks())])
        resid_names = kept_starts(model, tokens[:keep_rows], memory_mb) if starts else []
        kept_names = list(dict.fromkeys([*names, *resid_names]))
        scored = MetricParts(model, metric, tokens, set(kept_names) | set(by_name))
        size = chunk_rows(model, tokens.shape[1], memory_mb, scored, by_name)
        with executing(progress=progress):
            kept = _forward_chunks(model, tokens, scored, kept_names, by_name, keep_rows, size, desc=desc)
        # a hook the model never fires (a bridge's hook_pos_embed on a rotary model) is left out, as
        # run_with_cache's names_filter leaves it out, and remembered as silent
        silent = frozenset(name for name, parts in kept.items() if not parts)
        cache, run_starts = _cache_and_starts({name: _joined(parts) for name, parts in kept.items() if parts},
                                              names, resid_names)
        scores = [(metric, scored.scores())] if metric is not None else []
        return cls(model, tokens, metric=metric, baseline=float(scores[0][1].values) if scores else None, cache=cache,
                   starts=run_starts, reduced={key: reducer.result() for key, reducer in reducers.items()},
                   silent=silent, memory_mb=memory_mb, stored=keep_rows, scored=scores)

    def read(self, names: Sequence[str]) -> dict[str, torch.Tensor]:
        """{name: activation (batch, ...)} for ``names``: from the cache, and what is missing from one
        forward of only the blocks it needs, starting at the latest cached start at or before the
        earliest missing hook (the whole model where there is none), kept in the cache after."""
        self._refuse_partial("read")
        missing = [name for name in dict.fromkeys(names)
                   if name not in self.cache and name not in (self.starts or {}) and name not in self.silent]
        if missing:
            self.cache |= self._suffix_cache(missing)
        return {name: self.cache[name] if name in self.cache else self.starts[name]
                for name in names if name not in self.silent}

    def _suffix_cache(self, names: Sequence[str]) -> dict[str, torch.Tensor]:
        start = None if self.starts is None else nearest_start(self.starts, min(layer_of(name) for name in names))
        kept = {}
        try:
            with torch.no_grad(), self.model.hooks(fwd_hooks=capture_hooks(set(names), kept, stop=True)):
                if start is None:
                    self.model(self.tokens)
                else:
                    name, layer, mid = start
                    self.model(self.starts[name], start_at_layer=layer, start_at_resid_mid=mid)
        except _Collected:
            pass
        return kept

    def _refuse_partial(self, what: str) -> None:
        if self.stored is not None:
            raise UserError(f"this run stores its first {self.stored} of {len(self.tokens)} prompts, so it cannot "
                            f"{what} them all; use run.first(n) for n <= {self.stored}")

    def held_mb(self) -> float:
        """MB the run's cache, starts and reduced tensors hold (a budget's share that stays taken
        while it lives)."""
        reduced = [value for result in self.reduced.values()
                   for value in (result.values() if isinstance(result, dict) else [result])]
        return held_mb([*self.cache.values(), *(self.starts or {}).values(),
                        *(value for value in reduced if isinstance(value, torch.Tensor))])

    def first(self, n: int) -> "Run":
        """This run restricted to its first ``n`` prompts, nothing run again: the tokens, cache and
        starts sliced; no metric, so ``value`` computes any from the last block."""
        if not 0 < n <= (self.stored or len(self.tokens)):
            raise UserError(f"a run of {len(self.tokens)} prompts storing {self.stored or len(self.tokens)} "
                            f"has no first {n}")
        return Run(self.model, self.tokens[:n], cache={name: value[:n] for name, value in self.cache.items()},
                   starts=None if self.starts is None else {name: value[:n] for name, value in self.starts.items()},
                   silent=self.silent, memory_mb=self.memory_mb)

    def check_tokens(self, tokens: torch.Tensor) -> None:
        """Refuse, in one line, ``tokens`` (batch, pos) other than this run's."""
        if tokens.shape != self.tokens.shape or not torch.equal(tokens.to(self.tokens.device), self.tokens):
            raise UserError(f"the prompts {tuple(tokens.shape)} are not those this run was made of "
                            f"{tuple(self.tokens.shape)}; make a Run of them")

    def value(self, metric: Metric) -> float:
        """The metric on this run: the baseline for the run's own metric; another one's from the
        logits of a forward of the last block only (the whole model where it cannot start there)."""
        if metric is self.metric:
            return self.baseline
        return float(self.scores(metric).values)

    def scores(self, metric: Metric) -> PromptScores:
        """The metric on this run with each prompt's numerator and count (``PromptScores``, values
        0-d): kept from ``make`` for the run's own metric, else scored as ``value`` says once and
        kept (by the metric's identity)."""
        for known, scores in self.scored:
            if known is metric:
                return scores
        self._refuse_partial("score another metric on")
        last = resid_pre_name(self.model.cfg.n_layers - 1)
        from_last = self.starts is not None and last in self.starts
        scored = MetricParts(self.model, metric, self.tokens)
        size = rows_within(self.model, self.tokens.shape[1], self.memory_mb, logits=True, read=scored.read)
        with torch.no_grad():
            for start in range(0, len(self.tokens), size):
                rows = slice(start, min(start + size, len(self.tokens)))
                scored.add(rows, self.starts[last][rows] if from_last else None, self.model.cfg.n_layers - 1)
        self.scored.append((metric, scored.scores()))
        return self.scored[-1][1]


def _stored_rows(keep_rows: int | None, batch: int) -> int | None:
    """``Run.make``'s ``keep_rows`` checked (at least 1, or None) -> None where it keeps every one of
    the ``batch`` prompts anyway."""
    if keep_rows is not None and not 1 <= keep_rows:
        raise UserError(f"keep_rows={keep_rows}: keep at least the first prompt, or None for all")
    return None if keep_rows is None or keep_rows >= batch else keep_rows


def _consumers_by_name(consumers: Sequence[tuple[str, Consumer]]) -> dict[str, list[Consumer]]:
    """(hook name, consumer) pairs -> hook name -> its consumers, in the order given."""
    by_name: dict[str, list[Consumer]] = {}
    for name, consumer in consumers:
        by_name.setdefault(name, []).append(consumer)
    return by_name


def chunk_rows(model, n_pos: int, memory_mb: float, scored: "MetricParts", consumed: Sequence[str]) -> int:
    """How many prompts of ``n_pos`` tokens one forward of ``Run.make`` runs at once within
    ``memory_mb`` (``analyses.core.budget.rows_within``; at least one). What a row costs there
    (``row_bytes``): a block's activations in flight; the logits only where a metric is scored
    (without one the forward stops before the unembedding), at the ``scored.read`` positions alone
    where only those are unembedded; and one attention pattern (head, pos, pos) for each
    ``hook_pattern`` among the ``consumed`` hooks, since a consumer may hold its layer's pattern of
    the chunk until the forward ends (``FirstRows`` keeps it). What the run stores (the kept names,
    the starts) is not in this bound: it grows by chunk and is bounded by ``keep_rows`` and
    ``kept_starts``, and later steps subtract it (``Run.held_mb``)."""
    n_patterns = sum(1 for name in consumed if name.endswith("hook_pattern"))
    return rows_within(model, n_pos, memory_mb, logits=scored.metric is not None, kept_patterns=n_patterns,
                       read=scored.read)


def _forward_chunks(model, tokens: torch.Tensor, scored: "MetricParts", names: Sequence[str],
                    consumers: Mapping[str, list[Consumer]], keep_rows: int | None, size: int, *,
                    desc: str) -> dict[str, list[torch.Tensor]]:
    """``Run.make``'s one pass over ``tokens`` (batch, pos) in chunks of ``size`` prompts: each chunk
    scored by ``scored`` (``MetricParts.add``), each hook of ``consumers`` fed its activation (chunk,
    ...) and rows as the forward passes it, and ``names`` kept for the first ``keep_rows`` prompts
    (None: all) -> name -> its chunks' activations in row order (empty for a hook that never fired).
    Without a metric a chunk's forward stops once every wanted hook has fired. Its bar (``desc``) is
    shown per the current execution's progress."""
    wanted = set(names) | set(consumers)
    kept: dict[str, list[torch.Tensor]] = {name: [] for name in names}
    for start in progress_bar(range(0, len(tokens), size), desc=desc, unit="chunk"):
        rows = slice(start, min(start + size, len(tokens)))
        fired = set()

        def hook_for(name):
            def hook(activation, hook):  # the name is bound here: hook.name may be a backend alias
                fired.add(name)
                if name in kept and (keep_rows is None or rows.start < keep_rows):
                    kept[name].append(_first_rows(activation.detach(), rows, keep_rows))
                for consumer in consumers.get(name, ()):
                    consumer(activation.detach(), rows)
                if scored.metric is None and len(fired) == len(wanted):
                    raise _Collected

            return hook

        try:
            with torch.no_grad(), model.hooks(fwd_hooks=[(name, hook_for(name)) for name in wanted]):
                scored.add(rows)
        except _Collected:
            pass
    return kept


def _cache_and_starts(stored: dict[str, torch.Tensor], names: Sequence[str],
                      resid_names: Sequence[str]) -> tuple[dict[str, torch.Tensor], dict | None]:
    """What a ``Run`` stored (name -> (rows, ...)) split into its cache (``names``) and its starts
    (``resid_names``; None where it keeps none): a start that is also asked for is in both, one
    tensor; one that is not leaves the cache."""
    if not resid_names:
        return stored, None
    starts = {name: stored.pop(name) for name in resid_names if name not in names}
    return stored, starts | {name: stored[name] for name in resid_names if name in names}


def _first_rows(activation: torch.Tensor, rows: slice, keep_rows: int | None) -> torch.Tensor:
    """The rows of a chunk's ``activation`` (chunk, ...) below ``keep_rows`` (None: all), copied when
    fewer than the chunk, so the chunk itself is not held through a view."""
    if keep_rows is None or rows.stop <= keep_rows:
        return activation
    return activation[:keep_rows - rows.start].clone()


def kept_starts(model, tokens: torch.Tensor, memory_mb: float) -> list[str]:
    """The ``start_names`` a ``Run`` of ``tokens`` (batch, pos) keeps: all where they fit
    ``STARTS_SHARE`` of ``memory_mb`` (float32 (batch, pos, d_model) each), else every k-th layer's ``hook_resid_pre``
    from layer 0 (as many as fit, at least layer 0's), a run from a dropped one starting at the
    nearest before it (``analyses.interventions.engine.nearest_start``)."""
    names = start_names(model)
    fit = tensors_within(memory_mb * STARTS_SHARE, 4 * tokens.numel() * model.cfg.d_model)
    if fit >= len(names):
        return names
    stride = -(-model.cfg.n_layers // max(1, fit))
    return [resid_pre_name(layer) for layer in range(0, model.cfg.n_layers, stride)]


class MetricParts:
    """A metric over a batch scored one chunk of prompts at a time as ``MetricSums`` pools it (one
    variant: the run itself), so no more than a chunk's logits ever exist; on a model that can stop
    before its unembedding (GPTModel), only the positions the metric reads are unembedded. A metric
    that cannot be split is scored on every chunk's logits at once.

    tokens: the batch (batch, pos); hooked: the hooks the forwards carry (one of the final norm's
    needs every position unembedded); read: how many positions a row unembeds (None: all)."""

    def __init__(self, model, metric: Metric | None, tokens: torch.Tensor, hooked: Sequence[str] = ()):
        self.model, self.metric, self.tokens = model, None if metric is None else as_metric(metric), tokens
        unembeds = not runs_suffix_only(model) or any(name.startswith("ln_final") for name in hooked)
        positions = self.metric.positions(tokens.shape[1]) if self.metric is not None and not unembeds else None
        self.positions = positions if self.metric is not None and self.metric.splits else None
        self.read = None if self.positions is None else len(self.positions)
        self.stop = {} if unembeds else {"stop_at_layer": model.cfg.n_layers}  # without a metric: no logits
        self.sums = None if self.metric is None else MetricSums(model, self.metric, 1, len(tokens), self.positions)

    def add(self, rows: slice, resid: torch.Tensor | None = None, layer: int = 0) -> None:
        """Run the prompts ``rows`` (a slice start:stop of the batch), from their tokens or from
        ``resid`` (rows, pos, d_model) entering block ``layer``, and score them."""
        def run(**stop):
            return self.model(self.tokens[rows], **stop) if resid is None else self.model(resid, start_at_layer=layer,
                                                                                              **stop)

        if self.metric is None:
            run(**self.stop)
            return
        if self.positions is None:
            logits = run()
        else:
            logits = self.model.unembed(run(stop_at_layer=self.model.cfg.n_layers)[:, self.positions])
        part, weight = self.sums.part(rows)
        if weight > 0:  # a part with no token the metric counts adds nothing
            self.sums.add([0], rows, part, weight, logits[None])

    def scores(self) -> PromptScores:
        """The metric over every prompt added (values 0-d float64 on the CPU) with each prompt's
        numerator and count (batch,) where the metric splits."""
        scores = self.sums.scores()
        numerators = None if scores.numerators is None else scores.numerators[0]
        return PromptScores(scores.values[0].to("cpu", torch.float64), numerators, scores.counts)


class FirstRows:
    """A reducer for ``Run.make(reducers=...)`` keeping only the first ``n_rows`` prompts of each of
    ``names`` (an analysis of a sample of the batch, e.g. head similarities). ``result()``:
    {name: (min(n_rows, batch), ...)}."""

    def __init__(self, names: Sequence[str], n_rows: int):
        self.names, self.n_rows = list(names), n_rows
        self.parts: dict[str, list] = {name: [] for name in self.names}

    def hooks(self) -> list[tuple[str, Consumer]]:
        def keeper(name):
            def keep(activation, rows):
                if rows.start < self.n_rows:
                    self.parts[name].append(_first_rows(activation, rows, self.n_rows))

            return keep

        return [(name, keeper(name)) for name in self.names]

    def result(self) -> dict[str, torch.Tensor]:
        return {name: _joined(parts) for name, parts in self.parts.items()}


def normalize_values(values: torch.Tensor, clean_value: float, corrupted_value: float) -> torch.Tensor:
    """(values - corrupted) / (clean - corrupted): 0 = the corrupted run's metric, 1 = the clean run's."""
    if clean_value == corrupted_value:
        raise UserError(f"cannot normalise: the metric is {clean_value} on both clean and corrupted prompts")
    return (values - corrupted_value) / (clean_value - corrupted_value)


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)


@dataclass
class Contrast:
    """What every intervention sweep runs on: the ``base`` run that gets edited and the ``sources``
    its edits write (hook name -> (batch or 1, ...)): the other run's activations for patching
    (corrupted when noising, clean when denoising), replacements for ablation.

    metric: what each edited run is scored by; baseline: its value on the unedited base run;
    source_value: its value on the source run, where there is one (patching); direction: "denoise"
    (the base run is the corrupted one) or "noise" (the base run is the clean one); source_scores
    (keyword only): the source run's ``PromptScores``, for the intervals of normalised effects."""

    base: Run
    metric: Metric
    sources: dict
    baseline: float
    source_value: float | None = None
    direction: str = "denoise"
    source_scores: PromptScores | None = field(default=None, kw_only=True)

    @property
    def model(self):
        return self.base.model

    @property
    def tokens(self) -> torch.Tensor:
        """The base run's tokens (batch, pos): what every edited run processes."""
        return self.base.tokens

    @property
    def starts(self) -> dict | None:
        return self.base.starts

    @property
    def clean_value(self) -> float:
        return self.source_value if self.direction == "denoise" else self.baseline

    @property
    def corrupted_value(self) -> float:
        return self.baseline if self.direction == "denoise" else self.source_value

    def normalize(self, values: torch.Tensor) -> torch.Tensor:
        """``normalize_values`` with this contrast's clean and corrupted values."""
        return normalize_values(values, self.clean_value, self.corrupted_value)

    def score(self, variants, desc: str = "interventions") -> PromptScores:
        """The metric under each variant with each prompt's numerator and count
        (``analyses.interventions.engine.score_variants`` on the base run, from its starts), within the
        current execution's memory, its bar per its progress: values (len(variants),)."""
        return score_variants(self.model, self.tokens, variants, self.sources, self.metric, starts=self.starts,
                              desc=desc)

    def baseline_scores(self) -> PromptScores:
        """The metric on the unedited base run, per prompt (``Run.scores``; no forward where the base
        run was made with this metric or has scored it already)."""
        return self.base.scores(self.metric)

    def intervals(self, scores: PromptScores, *, normalize: bool = False,
                  seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The 95% intervals of the effects ``scores.values - baseline`` -> (ci_low, ci_high), each of
        ``scores.values``' shape, float64 on the CPU, and n_prompts (see ``effect_intervals``). With
        ``normalize`` the effects are in the units of ``normalize``: (value - baseline) / (clean - corrupted)."""
        baseline, scale = self.baseline_scores(), None
        if normalize:
            if self.source_scores is None:
                raise UserError("this contrast was made without its source run's scores (source_scores), so its "
                                "normalised effects have no interval; make it with analyses.interventions.patching.prepare")
            clean, corrupted = ((self.source_scores, baseline) if self.direction == "denoise"
                                else (baseline, self.source_scores))
            if clean.numerators is not None and corrupted.numerators is not None:
                scale = clean.numerators - corrupted.numerators
        return effect_intervals(scores, baseline, len(self.tokens), scale=scale, seed=seed)

