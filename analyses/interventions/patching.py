"""Activation patching (architecture §4.3), in TransformerLens's convention and result shapes.

Denoising (the default) runs the corrupted prompts and patches in activations from the clean run
(is this component sufficient to restore the clean behaviour?); noising runs the clean prompts
and patches in the corrupted activations (is it necessary?). Each cell is the metric of the
patched run, as in ``transformer_lens.patching.get_act_patch_*``. One function,
``patch_components``, patches every kind of component (``COMPONENTS``: heads, MLPs, the residual
stream, attention patterns), exactly or by its first-order estimate (attribution patching);
``patch_heads``, ``patch_mlps``, ``patch_residual`` and ``patch_patterns`` are its shortcuts.

``normalize=True`` rescales to (value - corrupted) / (clean - corrupted): 0 = the corrupted
run's metric, 1 = the clean run's. Exact patches go through ``score_variants`` (batched,
chunked to ``memory_mb``; on ``GPTModel`` only the layers from the patched one on are rerun).
``patch_effects`` gives exact patching as a tidy frame with each effect's 95% interval over prompts
(architecture §4.12); the tensors stay TransformerLens's.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product
from typing import Callable

import pandas as pd
import torch

from analyses.core.execution import current, executing
from analyses.core.hook_check import require_edit
from analyses.core.hook_names import mlp_out_name, pattern_names, resid_pre_names, z_names
from analyses.core.progress import progress_bar
from analyses.core.checks import check_choice
from analyses.interventions.engine import (Edit, Variant, activation_gradients, gradient_parts, head_cells,
                                           linear_effects, scored_cache)
from analyses.core.metrics import Metric
from analyses.interventions.run import Contrast, Options, Run, normalize_values
from analyses.core.tokens import as_tokens
from interp.errors import UserError

DIRECTIONS = ("denoise", "noise")
METHODS = ("exact", "attribution")


def check_pair(clean: torch.Tensor, corrupted: torch.Tensor) -> None:
    if clean.shape[1] != corrupted.shape[1]:
        raise UserError(
            f"clean prompts are {clean.shape[1]} tokens long but corrupted prompts are {corrupted.shape[1]}; "
            "patching needs equal token lengths"
        )
    if clean.shape[0] != corrupted.shape[0]:
        raise UserError(f"{clean.shape[0]} clean prompts but {corrupted.shape[0]} corrupted; they must pair up")


def base_and_source(model, clean_tokens, corrupted_tokens, direction: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Checked token pair ordered as (run that gets patched, run patched from)."""
    check_choice("direction", direction, DIRECTIONS)
    clean, corrupted = as_tokens(model, clean_tokens), as_tokens(model, corrupted_tokens)
    check_pair(clean, corrupted)
    return (corrupted, clean) if direction == "denoise" else (clean, corrupted)


def prepare(model, clean_tokens, corrupted_tokens, metric: Metric, names, direction: str = "denoise", *,
            base_run: Run | None = None, clean_run: Run | None = None) -> Contrast:
    """Run clean and corrupted once each, caching ``names`` from the source side -> the ``Contrast``
    whose base is the run that gets patched. ``base_run``: a ``Run`` of the base prompts (the
    corrupted ones when denoising) that serves instead of a forward of its own; ``clean_run``: a
    ``Run`` of the clean prompts, which serves as the source run when denoising and as the base run
    when noising (its metric value is read from its last block where its metric is another). Those
    forwards run within the current execution's memory (``Run.make``)."""
    base, source = base_and_source(model, clean_tokens, corrupted_tokens, direction)
    if clean_run is not None and direction == "noise":
        base_run = clean_run
    if clean_run is not None and direction == "denoise":
        clean_run.check_tokens(source)
        source_cache, source_scores = clean_run.read(names), clean_run.scores(metric)
    else:
        source_run = Run.make(model, source, metric, names, starts=False)
        source_cache, source_scores = source_run.cache, source_run.scores(metric)
    if base_run is None:
        base_run = Run.make(model, base, metric)
    base_run.check_tokens(base)
    return Contrast(base_run, metric, source_cache, base_run.value(metric), float(source_scores.values), direction,
                    source_scores=source_scores)


def _sweep(contrast: Contrast, variants: list[Variant], shape, options: Options, desc: str) -> torch.Tensor:
    values = contrast.score(variants, desc).values.reshape(shape)
    return contrast.normalize(values) if options.normalize else values


@dataclass(frozen=True)
class Component:
    """A kind of component patching edits: one hook per layer (``names``), split into ``units``
    per layer (the heads of ``hook_z``), or edited whole where ``units`` is None (an MLP's output).
    ``heads_first``: the hook holds (head, query, key) (``hook_pattern``), so a unit is indexed
    before a position and results are [n_layers, n_heads, pos] as TransformerLens's; elsewhere
    (batch, pos, [unit,] ...) and [n_layers, pos, n_heads]. ``by_position_only``: a whole-layer
    patch would replace everything downstream (the residual stream)."""

    kind: str
    names: Callable  # model -> [hook name per layer]
    units: Callable | None = None  # model -> how many units each layer's hook holds
    heads_first: bool = False
    by_position_only: bool = False

    def check(self, by_position: bool) -> None:
        if self.by_position_only and not by_position:
            raise UserError(f"patching {self.kind} is by position only (by_position=True)")

    def variants(self, model, n_pos: int, by_position: bool) -> tuple[list[Variant], tuple[int, ...]]:
        """One single-edit variant per (layer, position, unit) cell, positions left out unless
        ``by_position`` -> (variants, shape)."""
        self.check(by_position)
        axes = {"pos": range(n_pos) if by_position else [slice(None)],
                "unit": range(self.units(model)) if self.units else [None]}
        order = ("unit", "pos") if self.heads_first else ("pos", "unit")
        names = self.names(model)
        variants = [[Edit(name, tuple(i for i in cell if i is not None))]
                    for name, *cell in product(names, *(axes[axis] for axis in order))]
        sizes = {"pos": n_pos if by_position else None, "unit": len(axes["unit"]) if self.units else None}
        return variants, (len(names), *(sizes[axis] for axis in order if sizes[axis] is not None))

    def dims(self, by_position: bool) -> tuple[str, ...]:
        """The names of the dims of this component's results (``variants``' shape), e.g. ("layer", "head")."""
        self.check(by_position)
        unit = ("head",) if self.units else ()
        pos = ("pos",) if by_position else ()
        return ("layer", *unit, *pos) if self.heads_first else ("layer", *pos, *unit)

    def as_units(self, activation: torch.Tensor) -> torch.Tensor:
        """An activation of this component's hook viewed as (batch, pos, unit, d): a whole MLP output
        as one unit (a pattern's layout has no such view: refused)."""
        if self.heads_first:
            raise UserError(f"attribution patching takes heads, MLPs or the residual, not {self.kind}")
        return activation if self.units else activation[:, :, None]


def mlp_out_names(model) -> list[str]:
    """Every layer's ``hook_mlp_out``; a one-line refusal for a model without MLPs."""
    names = [mlp_out_name(layer) for layer in range(model.cfg.n_layers)]
    if any(name not in model.hook_dict for name in names):
        raise UserError("this model has no MLP outputs (blocks.L.hook_mlp_out): it is attention-only")
    return names


def _edited(names_of: Callable, hook: str, kind: str) -> Callable:
    """``names_of`` after the self-test's check that edits of ``hook`` reach the model's output."""
    def names(model) -> list[str]:
        require_edit(model, hook, f"patching {kind}")
        return names_of(model)
    return names


COMPONENTS = {
    "heads": Component("heads", _edited(z_names, "hook_z", "heads"), lambda model: model.cfg.n_heads),
    "mlps": Component("mlps", mlp_out_names),
    "residual": Component("residual", resid_pre_names, by_position_only=True),
    "patterns": Component("patterns", _edited(pattern_names, "hook_pattern", "patterns"), lambda model: model.cfg.n_heads,
                          heads_first=True),
}


def patch_components(
    model,
    clean_tokens,
    corrupted_tokens,
    metric: Metric,
    component: str = "heads",
    *,
    by_position: bool = False,
    method: str = "exact",
    options: Options | None = None,
    clean_run: Run | None = None,
    memory_mb: float | None = None,
    progress: bool | None = None,
    **keywords,
) -> torch.Tensor:
    """Patch each ``component`` at every position at once or, with ``by_position``, at one position
    at a time; equal to TransformerLens's ``get_act_patch_*`` (denoising, unnormalised):

        heads     hook_z          [n_layers, n_heads]   by position [n_layers, pos, n_heads]
        mlps      hook_mlp_out    [n_layers]            by position [n_layers, pos]
        residual  hook_resid_pre                        by position [n_layers, pos]
        patterns  hook_pattern    [n_layers, n_heads]   by position [n_layers, n_heads, query pos]

    ``method``: "exact" (one suffix run per cell) or "attribution" (the first-order estimate of
    every cell from one forward and one backward: ``linearised_patches``). ``options``
    (``Options``: direction, normalize), or the same as keywords (``direction="noise"``);
    ``memory_mb``, ``progress``: the execution's (``analyses.core.execution``; None: the current
    one's); ``clean_run``: a ``Run`` of the clean prompts made already (see ``prepare``), so exact
    patching does not run them again."""
    check_choice("component", component, COMPONENTS)
    check_choice("method", method, METHODS)
    options, kind = Options.of(options, keywords), COMPONENTS[component]
    with executing(memory_mb, progress):
        if method == "attribution":
            return linearised_patches(model, clean_tokens, corrupted_tokens, metric, kind, by_position, options)
        contrast = prepare(model, clean_tokens, corrupted_tokens, metric, kind.names(model), options.direction,
                           clean_run=clean_run)
        return component_patches(contrast, component, options, by_position=by_position)


def component_patches(contrast: Contrast, component: str, options: Options, *, by_position: bool = False) -> torch.Tensor:
    """Exact ``patch_components`` on a ``Contrast`` made already (its sources hold the component's
    hooks), within the current execution."""
    variants, shape = COMPONENTS[component].variants(contrast.model, contrast.tokens.shape[1], by_position)
    return _sweep(contrast, variants, shape, options, f"patch {component}")


def patch_effects(model, clean_tokens, corrupted_tokens, metric: Metric, component: str = "heads", *,
                  by_position: bool = False, options: Options | None = None, clean_run: Run | None = None,
                  seed: int = 0, memory_mb: float | None = None, progress: bool | None = None,
                  **keywords) -> pd.DataFrame:
    """Exact patching of each ``component`` (as ``patch_components``: the same cells, values and
    options) as a tidy frame with each effect's interval over prompts: one row per cell, its dims
    (``Component.dims``: ``layer, head``; ``layer, pos, head``; ``layer, pos``; ...), ``metric``
    (the patched run's, normalised with ``normalize``: the ``patch_components`` value), ``baseline``
    (the unpatched run's, in the same units: 0 denoising and 1 noising when normalised), ``effect``
    (metric - baseline), ``ci_low``, ``ci_high`` (its 95% interval, a percentile bootstrap over
    prompts seeded by ``seed``: ``analyses.core.stats.effect_intervals``) and ``n_prompts``.
    A metric that does not split (a plain callable, ``analyses.core.metrics.Metric.splits``) gets
    NaN intervals. Attribution patching has no intervals (it is a first-order estimate)."""
    check_choice("component", component, COMPONENTS)
    options = Options.of(options, keywords)
    with executing(memory_mb, progress):
        contrast = prepare(model, clean_tokens, corrupted_tokens, metric, COMPONENTS[component].names(model),
                           options.direction, clean_run=clean_run)
        return component_effects(contrast, component, options, by_position=by_position, seed=seed)


def component_effects(contrast: Contrast, component: str, options: Options, *, by_position: bool = False,
                      seed: int = 0) -> pd.DataFrame:
    """``patch_effects`` on a ``Contrast`` made already (``prepare``: its sources hold the component's
    hooks), within the current execution."""
    kind = COMPONENTS[component]
    variants, shape = kind.variants(contrast.model, contrast.tokens.shape[1], by_position)
    scores = contrast.score(variants, f"patch {component}")
    values, baseline = scores.values.reshape(shape), torch.tensor(contrast.baseline, dtype=torch.float64)
    if options.normalize:  # as patch_components normalises
        values, baseline = contrast.normalize(values), contrast.normalize(baseline)
    low, high, n_prompts = contrast.intervals(scores, normalize=options.normalize, seed=seed)
    frame = patching_frame(values, kind.dims(by_position))
    frame["baseline"] = baseline.item()
    frame["effect"] = frame["metric"] - frame["baseline"]
    frame["ci_low"], frame["ci_high"] = low.cpu().numpy(), high.cpu().numpy()
    frame["n_prompts"] = n_prompts
    return frame


def linearised_patches(model, clean_tokens, corrupted_tokens, metric: Metric, kind: Component, by_position: bool,
                       options: Options) -> torch.Tensor:
    """Attribution patching (Nanda 2023; Syed et al. 2023): patching a unit moves its activation
    from ``a`` (the run being patched) to ``a'`` (the other run); to first order the metric becomes
    ``M + sum(dM/da * (a' - a))`` over prompts, positions and the unit's width. One forward caching
    the other run and one forward and backward of the patched run (gradients wrt the activations
    only) give every cell: about three forward-equivalents. Same shapes and convention as exact
    patching (the patched metric), so the two compare cell for cell.

    Both runs go in chunks of prompts whose forward and backward fit the current execution's memory
    (``gradient_parts``; only the rows the metric reads are unembedded where the model can stop
    before its unembedding): the batch's gradient is the sum of the chunks', each weighted by its
    share of the metric, and so are its sums and the metric values."""
    kind.check(by_position)
    names = kind.names(model)
    base, source = base_and_source(model, clean_tokens, corrupted_tokens, options.direction)
    width = model.cfg.n_heads * model.cfg.d_head if kind.units else model.cfg.d_model
    # per position: every layer's source activation and gradient, and one layer's float32 product
    execution = current()
    parts, positions = gradient_parts(model, base, metric, execution.memory_mb,
                                      per_position=(2 * len(names) + 2) * width)
    value, source_value, effects = 0.0, 0.0, 0.0
    for part in progress_bar(parts, progress=execution.progress, desc=f"attribution {kind.kind}", unit="chunk"):
        scored, source_cache = scored_cache(model, source[part.rows], names, part.metric if options.normalize else None,
                                            positions)  # the source's metric: normalising only
        part_value, acts, grads = activation_gradients(model, base[part.rows], part.metric, names, positions=positions)
        moved = linear_effects(*([kind.as_units(values[name]) for name in names]
                                 for values in (grads, acts, source_cache)))
        effects = effects + part.share * moved
        value += part.share * part_value
        if options.normalize:
            source_value += part.share * scored
    estimate = value + (effects if by_position else effects.sum(dim=1))
    estimate = estimate if kind.units else estimate[..., 0]  # the one unit each whole-layer component was given
    if not options.normalize:
        return estimate
    clean_value, corrupted_value = (source_value, value) if options.direction == "denoise" else (value, source_value)
    return normalize_values(estimate, clean_value, corrupted_value)


def patch_heads(model, clean_tokens, corrupted_tokens, metric: Metric, **keywords) -> torch.Tensor:
    """``patch_components(..., "heads")``: a tensor [n_layers, n_heads], or with ``by_position=True``
    [n_layers, pos, n_heads]."""
    return patch_components(model, clean_tokens, corrupted_tokens, metric, "heads", **keywords)


def patch_mlps(model, clean_tokens, corrupted_tokens, metric: Metric, **keywords) -> torch.Tensor:
    """``patch_components(..., "mlps")``: a tensor [n_layers], or with ``by_position=True`` [n_layers, pos]."""
    return patch_components(model, clean_tokens, corrupted_tokens, metric, "mlps", **keywords)


def patch_residual(model, clean_tokens, corrupted_tokens, metric: Metric, **keywords) -> torch.Tensor:
    """``patch_components(..., "residual", by_position=True)``: the residual stream entering each
    block, at each position -> a tensor [n_layers, pos] (TransformerLens's ``get_act_patch_resid_pre``)."""
    return patch_components(model, clean_tokens, corrupted_tokens, metric, "residual", by_position=True, **keywords)


def patch_patterns(model, clean_tokens, corrupted_tokens, metric: Metric, **keywords) -> torch.Tensor:
    """``patch_components(..., "patterns")``: each head's whole attention pattern -> a tensor [n_layers, n_heads]
    (TransformerLens's ``get_act_patch_attn_head_pattern_all_pos``)."""
    return patch_components(model, clean_tokens, corrupted_tokens, metric, "patterns", **keywords)


def patch_specific_heads(contrast: Contrast, heads) -> torch.Tensor:
    """Exact patch of each of ``heads`` [(layer, head), ...] alone -> (len(heads),), with a
    ``Contrast`` already made (its sources must hold every ``hook_z``), within the current execution."""
    return contrast.score([head_cells([cell]) for cell in heads], "patch heads").values


def patching_frame(result: torch.Tensor, dims: tuple[str, ...], value: str = "metric") -> pd.DataFrame:
    """A patching tensor -> tidy DataFrame with one column per dim (e.g. ``("layer", "head")``) and ``value``."""
    if result.ndim != len(dims):
        raise UserError(f"result has {result.ndim} dims but {len(dims)} names were given: {dims}")
    index = pd.MultiIndex.from_product([range(n) for n in result.shape], names=list(dims))
    return pd.DataFrame({value: result.detach().flatten().cpu().numpy()}, index=index).reset_index()
