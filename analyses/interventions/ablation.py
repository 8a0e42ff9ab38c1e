"""Head and MLP ablation at ``hook_z`` and ``hook_mlp_out`` (architecture §4.2): zero, mean and resample,
optionally pattern-preserving.

A head's output (its slice of ``hook_z``, (batch, pos, d_head)), or an MLP's (``hook_mlp_out``,
(batch, pos, d_model), at every position or at one: ``MLP(layer, position)``), is replaced by
- ``zero``: zeros;
- ``mean``: its mean at the same position over the *other* prompts (leave-one-out: a prompt's own
  output never leaks into its replacement), or over a separate ``reference`` batch as given;
- ``mean_aligned``: its mean over the other prompts at the same place in the probes' structure
  (``RepeatedProbes.places``: the same region -- start, prefix, first copy, second copy, filler --
  at the same offset in it), so the second copy of one prompt is replaced by second copies of
  others even where periods and prefixes differ; a place no other prompt has falls back to the
  leave-one-out mean at that position. Needs the prompts as ``RepeatedProbes``;
- ``resample``: its output on another prompt of the reference batch (seeded; never the prompt itself
  when the reference is the prompts);
- ``mean_corrupted`` (for tasks: clean prompts paired with corrupted ones, each of a template): its
  mean over the corrupted prompts of the prompt's template, position by position (Wang et al.
  2022's ABC means: the mean of the corrupted distribution at matched template positions), the
  reference a ``CorruptedReference``. Plain ``mean`` over prompts of different templates averages
  unrelated tokens at each absolute position; this is the reference a task's ablations use.
With ``preserve_patterns`` every attention pattern is frozen at its value in the unablated run
(Olsson et al. 2022), so later heads cannot react to the ablation through where they attend: only
what they read (values) changes, which isolates the ablated head's direct role.

Sweeps (each a tidy DataFrame; all ablations go through ``score_variants``: batched, chunked,
suffix-only on ``GPTModel``): every single head, every layer, every MLP (at all positions, or at
each position), named groups of heads and MLPs, and the cumulative pruning curve of Michel et al.
(2019), heads removed in increasing order of importance. Each effect carries its 95% interval over
prompts (``effect_columns``: a bootstrap of the per-prompt effects the same forwards give).

Prompts are token ids (batch, pos), texts, or ``RepeatedProbes``; texts of unequal lengths are
right-padded, and the padding is kept out of the metric (``analyses.core.metrics.metric_for_batch``: a
logit difference reads each prompt's last real token) and of the mean replacement (a
position where no other prompt is real takes the mean over every real position of the others;
resample needs equal lengths).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from itertools import product
from typing import Mapping, NamedTuple, Sequence, Union

import pandas as pd
import torch

from analyses.core.execution import current, executing
from analyses.core.hook_check import require_edit
from analyses.core.hook_names import layer_of, mlp_out_name, pattern_name, pattern_names, z_names
from analyses.core.checks import check_choice, check_heads
from analyses.interventions.engine import (
    Edit,
    Variant,
    activation_gradients,
    cache_run,
    gradient_parts,
    head_cells,
    linear_effects,
    rows_of,
)
from analyses.core.metrics import Metric, PromptScores, loss_metric, metric_for_batch
from analyses.core.probes import RepeatedProbes
from analyses.core.stats import EFFECT_COLUMNS
from analyses.interventions.patching import mlp_out_names
from analyses.interventions.run import Contrast, Run
from analyses.core.tokens import accumulator, as_batch
from analyses.core.heads import FORMS, HEAD_TEXT, as_head
from interp.errors import UserError
from interp.tokenizer import TokenBatch

METHODS = ("zero", "mean", "mean_aligned", "resample")
# the methods whose reference is a task's corrupted prompts (a ``CorruptedReference``), not in the
# commands' and studies' choices: their prompts have no corrupted twins
PAIRED_METHODS = ("mean_corrupted",)
# the methods that replace a prompt's head outputs with other prompts' (without a reference batch,
# they need at least 2 prompts): what each takes from them, for a refusal
FROM_OTHER_PROMPTS = {
    "mean": "mean ablation replaces a prompt's head outputs by their mean over the other prompts",
    "mean_aligned": "mean_aligned ablation replaces a prompt's head outputs by their mean over the other prompts",
    "resample": "resample ablation gives each prompt another prompt's head outputs",
}


class MLP(NamedTuple):
    """An MLP as an ablation target: layer ``layer``'s ``hook_mlp_out`` at every position, or at
    ``position`` only. Written ``mlp3`` (``mlp3@5`` at position 5) in target lists and specs."""

    layer: int
    position: int | None = None

    @property
    def label(self) -> str:
        return f"L{self.layer} MLP" + ("" if self.position is None else f"@{self.position}")


Component = Union[tuple[int, int], MLP]  # a head (layer, head), or an MLP
MLP_TEXT = re.compile(r"mlp(\d+)(?:@(\d+))?")


def as_component(item) -> Component:
    """A target's component: an ``MLP``, ``"mlp3"`` / ``"mlp3@5"`` (an MLP, at a position), or a
    head (``(1, 4)``, ``"L1H4"``, ``"1.4"``: ``analyses.core.heads.as_head``; not yet range-checked:
    see ``check_components``)."""
    if isinstance(item, MLP):
        return item
    match = MLP_TEXT.fullmatch(item.strip()) if isinstance(item, str) else None
    if match is not None:
        return MLP(int(match[1]), None if match[2] is None else int(match[2]))
    if isinstance(item, str) and not HEAD_TEXT.fullmatch(item.strip()):
        raise UserError(f"a component is a head ({FORMS}) or mlpL (mlpL@P at position P), got {item!r}")
    return as_head(item)


def check_components(model, items, n_pos: int | None = None) -> list[Component]:
    """Heads and MLPs (anything ``as_component`` reads) validated against the model's shape (and
    positions against ``n_pos``, the prompts' length, where given)."""
    components = [as_component(item) for item in items]
    heads = check_heads(model, [c for c in components if not isinstance(c, MLP)])
    mlps = [c for c in components if isinstance(c, MLP)]
    if mlps:
        mlp_out_names(model)  # a one-line refusal for an attention-only model
    for mlp in mlps:
        if not 0 <= mlp.layer < model.cfg.n_layers:
            raise UserError(f"MLP {mlp.layer} out of range: layer must be in [0, {model.cfg.n_layers})")
        if mlp.position is not None and not (mlp.position >= 0 and (n_pos is None or mlp.position < n_pos)):
            raise UserError(f"MLP {mlp.layer} at position {mlp.position}: the position must be in "
                            f"[0, {n_pos if n_pos is not None else 'the prompt length'})")
    checked = iter(heads)
    return [c if isinstance(c, MLP) else next(checked) for c in components]


def component_label(component: Component) -> str:
    """``L{l}H{h}`` for a head, ``L{l} MLP`` (``L{l} MLP@{p}``) for an MLP."""
    return component.label if isinstance(component, MLP) else f"L{component[0]}H{component[1]}"


def component_cells(components: Sequence[Component]) -> list[Edit]:
    """The edits that ablate each component: a head's ``hook_z`` slice at every position, an
    MLP's ``hook_mlp_out`` at every position or at its one."""
    heads = [c for c in components if not isinstance(c, MLP)]
    mlps = [Edit(mlp_out_name(c.layer), (slice(None),) if c.position is None else (c.position,))
            for c in components if isinstance(c, MLP)]
    return head_cells(heads) + mlps


def component_layer(component: Component) -> int:
    return component.layer if isinstance(component, MLP) else component[0]


def target_location(components: Sequence[Component]) -> tuple[int | None, int | None]:
    """(the layer of every component, if one; the head, if the target is one head)."""
    layers = set(map(component_layer, components))
    single_head = len(components) == 1 and not isinstance(components[0], MLP)
    return (next(iter(layers)) if len(layers) == 1 else None), (components[0][1] if single_head else None)


@dataclass
class Ablation(Contrast):
    """Everything an ablation sweep needs, computed once: a ``Contrast`` whose base is the
    unablated ``Run`` of the prompts and whose sources replace ``hook_z`` (batch or 1, pos, head,
    d_head), prepared with ``mlps`` also ``hook_mlp_out`` (batch or 1, pos, d_model), with
    ``preserve_patterns`` also each ``hook_pattern`` of the unablated run.
    baseline: the metric unablated.
    """

    preserve_patterns: bool = False

    def variant(self, components: Sequence[Component]) -> Variant:
        """Cells ablating ``components`` (heads and ``MLP``s); patterns are frozen from the first
        ablated layer on (earlier ones see unchanged inputs), so a suffix run still starts there."""
        cells = component_cells(components)
        missing = {cell.hook for cell in cells} - set(self.sources)
        if missing:
            raise UserError(f"this ablation was prepared without {sorted(missing)[0]}; MLP targets need "
                            "prepare_ablation(..., mlps=True)")
        if self.preserve_patterns:
            first = min(layer_of(cell.hook) for cell in cells)
            cells += [(pattern_name(layer), ()) for layer in range(first, self.model.cfg.n_layers)]
        return cells

    def run(self, head_sets: Sequence[Sequence[Component]], *, desc="ablations") -> torch.Tensor:
        """The metric with each set of components (heads, and ``MLP``s where prepared with
        ``mlps``) ablated together -> (len(head_sets),) float64, as the baseline is kept: a table's
        metric and baseline columns then print alike, and an empty set (which gives the baseline)
        has an effect of exactly 0, also once read back from a CSV. Its forwards run within the
        current execution's memory, its bar per its progress (``analyses.core.execution``). The
        values of ``scores``."""
        return self.scores(head_sets, desc=desc).values

    def scores(self, head_sets: Sequence[Sequence[Component]], *, desc="ablations") -> PromptScores:
        """``run``'s values with each prompt's numerator (len(head_sets), batch) and count (batch,)
        from the same forwards (``Contrast.score``; an empty set's are the baseline's), for
        ``Contrast.intervals``; None for a metric without a per-prompt form."""
        values = accumulator(self.model, len(head_sets)) + self.baseline
        baseline = self.baseline_scores()
        numerators = (None if baseline.numerators is None
                      else baseline.numerators.expand(len(head_sets), -1).clone())  # (sets, batch)
        todo = [i for i, heads in enumerate(head_sets) if heads]
        if todo:
            scored = self.score([self.variant(head_sets[i]) for i in todo], desc)
            values[todo] = scored.values.to(values.dtype)
            numerators = None if scored.numerators is None or numerators is None else numerators.index_copy(
                0, torch.tensor(todo, device=numerators.device), scored.numerators.to(numerators.dtype))
        return PromptScores(values, numerators, None if numerators is None else baseline.counts)

    def importance(self) -> torch.Tensor:
        """Michel et al. (2019) head importance -> [n_layers, n_heads]: per prompt, the first-order
        change of the metric when the head is ablated, |dM/dz . (replacement - z)| (for zero
        ablation exactly their |dL/d gate|), summed over prompts. One forward and backward. With
        ``preserve_patterns`` every attention pattern is held constant in the derivative too (no
        gradient flows through where heads attend), the linearisation of the pattern-preserving
        ablation this object runs, so a pruning order follows the same ablation it prunes by.

        The forward and backward go in chunks of prompts that fit the current execution's memory
        (``gradient_parts``): a prompt's gradient of the batch's metric is its chunk's, times the
        chunk's share of the metric."""
        model, names, batch = self.model, z_names(self.model), len(self.tokens)
        frozen = [(name, _constant) for name in pattern_names(model)] if self.preserve_patterns else []
        # per position: every layer's gradient, and one layer's float32 product
        width = model.cfg.n_heads * model.cfg.d_head
        parts, positions = gradient_parts(model, self.tokens, self.metric, current().memory_mb,
                                          per_position=(len(names) + 2) * width)
        importance = 0.0
        with model.hooks(fwd_hooks=frozen):
            for part in parts:
                _, z, grads = activation_gradients(model, self.tokens[part.rows], part.metric, names,
                                                   positions=positions)
                targets = [rows_of(self.sources[name], part.rows, batch).expand_as(z[name]) for name in names]
                per_prompt = linear_effects([grads[name] for name in names], [z[name] for name in names], targets,
                                            keep="b h")
                importance = importance + part.share * per_prompt.abs().sum(dim=1)
        return importance


def _constant(pattern: torch.Tensor, hook) -> torch.Tensor:
    """A hook that keeps an activation's value and cuts its gradient."""
    return pattern.detach()


@dataclass(frozen=True)
class CorruptedReference:
    """The reference of ``mean_corrupted`` ablation: ``prompts``, the corrupted twins of the prompts
    ablated (ids (batch, pos) or texts, twin i of prompt i, of equal token length), and
    ``templates``, one label per pair (batch,): the template both of pair i come from (one label
    for all where the prompts have no templates)."""

    prompts: object
    templates: Sequence


def template_mean(z: torch.Tensor, real: torch.Tensor, templates: Sequence, wanted: torch.Tensor) -> torch.Tensor:
    """z (batch, pos, ...) of the reference prompts -> (batch, pos, ...): for prompt i and position p,
    the mean of ``z`` at p over the reference prompts of prompt i's template that are real at p
    (``real`` (batch, pos) bool; ``templates`` one label per prompt). A position where prompt i is
    real (``wanted`` (batch, pos) bool) but none of its template's reference prompts is, is refused."""
    labels = {label: index for index, label in enumerate(dict.fromkeys(templates))}
    group = torch.tensor([labels[label] for label in templates], device=z.device)  # (batch,)
    one_hot = torch.nn.functional.one_hot(group, len(labels)).to(z.dtype)  # (batch, templates)
    mask = real.to(z.dtype)
    totals = torch.einsum("bt,bp,bp...->tp...", one_hot, mask, z)  # (templates, pos, ...)
    counts = torch.einsum("bt,bp->tp", one_hot, mask)  # (templates, pos)
    missing = wanted.to(counts.device) & (counts[group] == 0)
    if missing.any():
        i, p = (int(v) for v in missing.nonzero()[0])
        raise UserError(f"mean_corrupted ablation: prompt {i} is real at position {p} but no corrupted prompt of its "
                        f"template {templates[i]!r} is; pair each prompt with a corrupted one of equal token length")
    means = totals / counts.clamp(min=1).reshape(*counts.shape, *[1] * (z.ndim - 2))
    return means[group]


def replacements(model, batch: TokenBatch, method: str, names: Sequence[str], reference=None, seed: int = 0,
                 places: torch.Tensor | None = None, run: Run | None = None) -> dict[str, torch.Tensor]:
    """{name: what replaces that activation}, (batch or 1, pos, ...), for ``names`` among every
    ``hook_z`` ((..., head, d_head): the heads' outputs) and ``hook_mlp_out`` ((..., d_model)).

    ``places`` (batch, pos): the probes' structure, for ``mean_aligned`` (see the module docstring);
    ``run``: a ``Run`` of ``batch`` whose activations serve when the replacement comes from the
    prompts themselves (no forward of its own then); ``reference``: for ``mean_corrupted`` a
    ``CorruptedReference`` (and only then)."""
    check_choice("ablation method", method, (*METHODS, *PAIRED_METHODS))
    if (method in PAIRED_METHODS) != isinstance(reference, CorruptedReference):
        raise UserError(f"reference=CorruptedReference(...) is for mean_corrupted ablation, not {method}"
                        if method not in PAIRED_METHODS else
                        "mean_corrupted ablation needs reference=CorruptedReference(corrupted prompts, templates): "
                        "each prompt's corrupted twin and its template")
    if method == "mean_corrupted":
        twins = as_batch(model, reference.prompts)
        if twins.tokens.shape != batch.tokens.shape or len(reference.templates) != len(twins.tokens):
            raise UserError(f"mean_corrupted ablation: {len(twins.tokens)} corrupted prompts of {twins.tokens.shape[1]} "
                            f"tokens and {len(reference.templates)} templates for {len(batch.tokens)} prompts of "
                            f"{batch.tokens.shape[1]} tokens; give one corrupted twin and template per prompt")
        cache = cache_run(model, twins.tokens, names, logits=False)[1]
        return {name: template_mean(cache[name], twins.real, list(reference.templates), batch.real) for name in names}
    if method == "zero":
        heads, mlp = (model.cfg.n_heads, model.cfg.d_head), (model.cfg.d_model,)
        return {name: torch.zeros((1, batch.tokens.shape[1], *(heads if name.endswith("hook_z") else mlp)),
                                  device=batch.tokens.device) for name in names}
    if method == "mean_aligned" and (places is None or reference is not None):
        raise UserError("mean_aligned ablation needs the prompts as RepeatedProbes (their structure says which "
                        "positions align) and no reference batch; use mean for other prompts")
    ref = batch if reference is None else as_batch(model, reference)
    if ref.tokens.shape[1] != batch.tokens.shape[1]:
        raise UserError(f"reference prompts are {ref.tokens.shape[1]} tokens long but the prompts are "
                        f"{batch.tokens.shape[1]}; mean and resample ablation need equal lengths")
    cache = (run.read(names) if run is not None and reference is None
             else cache_run(model, ref.tokens, names, logits=False)[1])  # activations only: no unembedding
    if method == "mean" and reference is not None:
        weights = ref.real / ref.real.sum(dim=0).clamp(min=1)  # (batch, pos): each position's real rows
        return {name: torch.einsum("bp,bphd->phd", weights.to(cache[name].dtype), cache[name])[None] for name in names}
    if method == "mean":
        return {name: leave_one_out_mean(cache[name], batch.real) for name in names}
    if method == "mean_aligned":
        return {name: aligned_mean(cache[name], places) for name in names}
    if not (batch.real.all() and ref.real.all()):
        raise UserError("resample ablation needs prompts of equal token length (a prompt would receive "
                        "another's padding); pass texts of equal length or use mean ablation")
    index = resample_index(batch.tokens.shape[0], ref.tokens.shape[0], reference is None, seed)
    return {name: cache[name][index] for name in names}


def leave_one_out_mean(z: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """z (batch, pos, ...) -> (batch, pos, ...): for each prompt and position, the mean of ``z`` at
    that position over the *other* prompts that are real there (``real`` (batch, pos) bool); where
    no other prompt is real, the mean over every real position of the other prompts."""
    n_prompts = z.shape[0]
    if n_prompts < 2:
        raise UserError("mean ablation over the prompts themselves needs at least 2 prompts (a prompt's own output "
                        "is left out of its mean); pass more prompts or a reference batch")
    mask = real.to(z.dtype).reshape(*real.shape, *[1] * (z.ndim - 2))
    kept = z * mask
    others_sum = kept.sum(0, keepdim=True) - kept  # (batch, pos, ...)
    others_n = mask.sum(0, keepdim=True) - mask
    anywhere_sum = kept.sum((0, 1), keepdim=True) - kept.sum(1, keepdim=True)  # (batch, 1, ...)
    anywhere_n = mask.sum((0, 1), keepdim=True) - mask.sum(1, keepdim=True)
    return torch.where(others_n > 0, others_sum / others_n.clamp(min=1), anywhere_sum / anywhere_n.clamp(min=1))


def aligned_mean(z: torch.Tensor, places: torch.Tensor) -> torch.Tensor:
    """z (batch, pos, ...) -> (batch, pos, ...): for each prompt and position, the mean of ``z`` over
    the other prompts' positions at the same place (``places`` (batch, pos) long, each place at most
    once per prompt); the leave-one-out mean at that position where no other prompt has the place."""
    flat_places = places.flatten()
    flat_z = z.flatten(0, 1)
    totals = torch.zeros(int(flat_places.max()) + 1, *z.shape[2:], dtype=z.dtype, device=z.device)
    totals.index_add_(0, flat_places, flat_z)
    counts = torch.bincount(flat_places, minlength=totals.shape[0])
    others_n = (counts[places] - 1).reshape(*places.shape, *[1] * (z.ndim - 2)).to(z.dtype)
    aligned = (totals[places] - z) / others_n.clamp(min=1)
    fallback = leave_one_out_mean(z, torch.ones(places.shape, dtype=torch.bool, device=z.device))
    return torch.where(others_n > 0, aligned, fallback)


def resample_index(n_prompts: int, n_reference: int, same_batch: bool, seed: int) -> torch.Tensor:
    """(n_prompts,) reference prompt per prompt, seeded; a derangement when the reference is the
    prompts themselves (a prompt never receives its own output)."""
    generator = torch.Generator().manual_seed(seed)
    if not same_batch:
        return torch.randint(n_reference, (n_prompts,), generator=generator)
    if n_prompts < 2:
        raise UserError("resample ablation needs at least 2 prompts (or a reference batch) to draw others from")
    order = torch.randperm(n_prompts, generator=generator)
    index = torch.empty(n_prompts, dtype=torch.long)
    index[order] = order.roll(-1)  # each prompt takes the next one in a random cycle
    return index


def ablated_names(model, mlps: bool = False) -> list[str]:
    """The activations an ablation replaces: every ``hook_z``, with ``mlps`` every ``hook_mlp_out``."""
    return [*z_names(model), *(mlp_out_names(model) if mlps else [])]


def ablation_reads(model, method: str, *, reference=None, preserve_patterns: bool = False,
                   mlps: bool = False) -> list[str]:
    """The hooks an ablation reads from a ``Run`` of its prompts (``prepare_ablation(run=...)``):
    every ``hook_z`` (with ``mlps`` every ``hook_mlp_out``) where the replacement comes from the
    prompts themselves, every ``hook_pattern`` with ``preserve_patterns``."""
    own = method != "zero" and reference is None
    return [*(ablated_names(model, mlps) if own else []), *(pattern_names(model) if preserve_patterns else [])]


def prompts_run(model, prompts, names, metric: Metric | None = None) -> Run:
    """A ``Run`` of ``prompts`` (ids, texts or ``RepeatedProbes``) keeping ``names``, for the
    ablations that read it (``prepare_ablation(run=...)``), in chunks of prompts within the current
    execution's memory."""
    batch = as_batch(model, prompts.tokens if isinstance(prompts, RepeatedProbes) else prompts)
    return Run.make(model, batch.tokens, metric, names)


def prepare_ablation(model, tokens, method: str = "zero", metric: Metric | None = None, *, reference=None,
                     preserve_patterns: bool = False, seed: int = 0, run: Run | None = None,
                     mlps: bool = False) -> Ablation:
    """Cache what ablations of ``tokens`` (ids, texts or ``RepeatedProbes``) need: one forward (two with a separate
    reference). ``metric`` defaults to the mean next-token loss over all real positions (the run's
    metric where ``run`` has one). ``run``: a ``Run`` of these tokens (``Run.make``, reading at least
    ``ablation_reads``) that serves instead of a forward of its own. ``mlps``: also replace every
    ``hook_mlp_out`` (by the same method), so ``MLP`` targets can be ablated. That forward runs
    within the current execution's memory (``Run.make``)."""
    require_edit(model, "hook_z", "head ablation")
    if preserve_patterns:
        require_edit(model, "hook_pattern", "preserve_patterns=True")
    places = tokens.places if isinstance(tokens, RepeatedProbes) else None
    batch = as_batch(model, tokens.tokens if isinstance(tokens, RepeatedProbes) else tokens)
    if run is not None:
        run.check_tokens(batch.tokens)
        metric = run.metric if metric is None and run.metric is not None else metric
    metric = loss_metric(batch.tokens, batch.real) if metric is None else metric
    metric = metric_for_batch(metric, batch.lengths, batch.tokens.shape[1])  # never reads the padding
    if run is None:
        run = Run.make(model, batch.tokens, metric, ablation_reads(model, method, reference=reference,
                                                                   preserve_patterns=preserve_patterns, mlps=mlps))
    sources = replacements(model, batch, method, ablated_names(model, mlps), reference, seed, places, run)
    pattern_cache = run.read(pattern_names(model)) if preserve_patterns else {}
    return Ablation(run, metric, sources | pattern_cache, run.value(metric), preserve_patterns=preserve_patterns)


def ablate_heads(model, tokens, heads, method: str = "zero", metric: Metric | None = None, *, reference=None,
                 preserve_patterns: bool = False, seed: int = 0, memory_mb: float | None = None) -> float:
    """The metric with all of ``heads`` [(layer, head), ...] ablated together, within ``memory_mb``
    (None: the current execution's, ``analyses.core.execution``), without a bar: a value, not an
    effect. The effect with its interval over prompts is ``ablation_sweep``'s row for the same group
    (``ablation_sweep(model, tokens, [heads], ...)``)."""
    heads = check_heads(model, heads)
    with executing(memory_mb, progress=False):
        ablation = prepare_ablation(model, tokens, method, metric, reference=reference,
                                    preserve_patterns=preserve_patterns, seed=seed)
        return ablation.run([heads]).item()


TARGET_KINDS = ("each_head", "each_layer", "each_mlp", "each_mlp_by_position")


def sweep_targets(model, targets, n_pos: int | None = None) -> list[tuple[str, list[Component]]]:
    """``"each_head"`` | ``"each_layer"`` | ``"each_mlp"`` | ``"each_mlp_by_position"`` (needs
    ``n_pos``, the prompts' length) | {name: components} | [components, ...] -> [(name, components),
    ...]; a component is a (layer, head) pair or an MLP (``MLP``, or ``"mlp3"``, ``"mlp3@5"``)."""
    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
    if targets == "each_head":
        return [(f"L{l}H{h}", [(l, h)]) for l, h in product(range(n_layers), range(n_heads))]
    if targets == "each_layer":
        return [(f"L{l}", [(l, h) for h in range(n_heads)]) for l in range(n_layers)]
    if targets in ("each_mlp", "each_mlp_by_position"):
        mlp_out_names(model)  # a one-line refusal for an attention-only model
        if targets == "each_mlp":
            return [(MLP(l).label, [MLP(l)]) for l in range(n_layers)]
        if n_pos is None:
            raise UserError("each_mlp_by_position needs the prompts' length (n_pos)")
        return [(MLP(l, p).label, [MLP(l, p)]) for l, p in product(range(n_layers), range(n_pos))]
    if isinstance(targets, str):
        raise UserError(f"unknown targets {targets!r}; allowed: {', '.join(TARGET_KINDS)}, a mapping name -> "
                        "components, or a list of component lists")
    items = targets.items() if isinstance(targets, Mapping) else ((None, group) for group in targets)
    named = []
    for name, group in items:
        group = check_components(model, group, n_pos)
        named.append((name or "+".join(map(component_label, group)), group))
    return named


def ablation_sweep(model, tokens, targets="each_head", method: str = "zero", metric: Metric | None = None, *,
                   reference=None, preserve_patterns: bool = False, seed: int = 0,
                   memory_mb: float | None = None, progress: bool | None = None) -> pd.DataFrame:
    """Ablate each target (see ``sweep_targets``: heads, layers, MLPs, groups) separately -> a tidy
    frame, one row per target: ``target`` (name), ``layer`` (where every component is of one layer), ``head``
    (for a single head), ``position`` (for a single MLP at one position), ``n_heads`` and
    ``n_mlps`` (how many of each it ablates), ``metric`` (ablated), ``baseline`` (unablated),
    ``effect`` (metric - baseline) and its interval over prompts (``effect_columns``: ``ci_low``,
    ``ci_high``, ``n_prompts``; the bootstrap seeded by ``seed``). ``memory_mb``, ``progress``: the
    execution's (``analyses.core.execution``; None: the current one's)."""
    n_pos = as_batch(model, tokens.tokens if isinstance(tokens, RepeatedProbes) else tokens).tokens.shape[1]
    named = sweep_targets(model, targets, n_pos)
    with executing(memory_mb, progress):
        ablation = prepare_ablation(model, tokens, method, metric, reference=reference,
                                    preserve_patterns=preserve_patterns, seed=seed,
                                    mlps=any(isinstance(c, MLP) for _, group in named for c in group))
        scores = ablation.scores([group for _, group in named], desc="ablate")
    return target_frame(named, scores.values, ablation.baseline).assign(**effect_columns(ablation, scores, seed))


def effect_columns(ablation: Ablation, scores: PromptScores, seed: int = 0) -> dict:
    """The columns beside an ablation frame's ``effect`` (``analyses.core.stats.EFFECT_COLUMNS``):
    ``ci_low``, ``ci_high``, its 95% interval over prompts (a percentile bootstrap seeded by
    ``seed``, ``analyses.core.stats.effect_intervals``; NaN for a metric that does not split,
    such as a plain callable: ``analyses.core.metrics.Metric.splits``), and ``n_prompts``, the prompts the
    metric counts. ``scores``: ``Ablation.scores`` of the frame's rows."""
    low, high, n_prompts = ablation.intervals(scores, seed=seed)
    return dict(zip(EFFECT_COLUMNS, (low.cpu().numpy(), high.cpu().numpy(), n_prompts)))


def target_frame(named: list[tuple[str, list]], values: torch.Tensor, baseline: float) -> pd.DataFrame:
    located = [target_location(group) for _, group in named]
    mlps = [[c for c in group if isinstance(c, MLP)] for _, group in named]
    frame = pd.DataFrame({
        "target": [name for name, _ in named],
        "layer": pd.array([layer for layer, _ in located], dtype="Int64"),
        "head": pd.array([head for _, head in located], dtype="Int64"),
        "position": pd.array([ms[0].position if len(group) == 1 and ms else None
                              for (_, group), ms in zip(named, mlps)], dtype="Int64"),
        "n_heads": [len(group) - len(ms) for (_, group), ms in zip(named, mlps)],
        "n_mlps": [len(ms) for ms in mlps],
        "metric": values.cpu().numpy(),
    })
    frame["baseline"] = baseline
    frame["effect"] = frame["metric"] - baseline
    return frame


def head_importance(model, tokens, method: str = "zero", metric: Metric | None = None, *, reference=None,
                    preserve_patterns: bool = False, seed: int = 0,
                    memory_mb: float | None = None) -> torch.Tensor:
    """Michel et al. (2019) head importance -> a tensor [n_layers, n_heads] (see ``Ablation.importance``); with
    ``preserve_patterns`` that of the pattern-preserving ablation, the order ``pruning_curve`` then
    prunes by. ``memory_mb``: the budget of the unablated run and of the forward and backward (None:
    the current execution's, ``analyses.core.execution``)."""
    with executing(memory_mb):
        return prepare_ablation(model, tokens, method, metric, reference=reference,
                                preserve_patterns=preserve_patterns, seed=seed).importance()


def pruning_order(importance: torch.Tensor) -> list[tuple[int, int]]:
    """Head importance [n_layers, n_heads] -> every head as (layer, head), the least important
    first (ties in index order): the order in which ``pruning_curve`` and cumulative studies prune."""
    return [divmod(int(i), importance.shape[1]) for i in importance.flatten().argsort(stable=True)]


def pruning_curve(model, tokens, method: str = "zero", metric: Metric | None = None, *, order=None,
                  reference=None, preserve_patterns: bool = False, seed: int = 0,
                  memory_mb: float | None = None, progress: bool | None = None) -> pd.DataFrame:
    """Cumulative ablation: step i ablates the first i heads of ``order`` (default: increasing
    ``head_importance``, the least important pruned first) -> a tidy frame, rows ``step`` (0 = nothing
    ablated), ``layer``, ``head`` (the head added at that step), ``importance``, ``n_heads``,
    ``fraction`` (of all heads), ``metric``, ``baseline``, ``effect`` and its interval
    (``effect_columns``). ``memory_mb``, ``progress``: the execution's (``analyses.core.execution``;
    None: the current one's)."""
    with executing(memory_mb, progress):
        ablation = prepare_ablation(model, tokens, method, metric, reference=reference,
                                    preserve_patterns=preserve_patterns, seed=seed)
        importance = ablation.importance()
        order = check_heads(model, pruning_order(importance) if order is None else order)
        scores = ablation.scores([order[:i] for i in range(len(order) + 1)], desc="prune")
    n_total = model.cfg.n_layers * model.cfg.n_heads
    frame = pd.DataFrame({
        "step": range(len(order) + 1),
        "layer": pd.array([None] + [l for l, _ in order], dtype="Int64"),
        "head": pd.array([None] + [h for _, h in order], dtype="Int64"),
        "importance": [float("nan")] + [importance[l, h].item() for l, h in order],
        "n_heads": range(len(order) + 1),
    })
    frame["fraction"] = frame["n_heads"] / n_total
    frame["metric"] = scores.values.cpu().numpy()
    frame["baseline"] = ablation.baseline
    frame["effect"] = frame["metric"] - ablation.baseline
    return frame.assign(**effect_columns(ablation, scores, seed))
