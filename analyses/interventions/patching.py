"""Exact activation patching (DESIGN 4.3), in TransformerLens's convention and result shapes.

Denoising (the default) runs the corrupted prompts and patches in activations from the clean run
(is this component sufficient to restore the clean behaviour?); noising runs the clean prompts
and patches in the corrupted activations (is it necessary?). Each cell is the metric of the
patched run, as in ``transformer_lens.patching.get_act_patch_*``:

    patch_heads                    [n_layers, n_heads]        hook_z of one head, all positions
    patch_heads(by_position=True)  [n_layers, pos, n_heads]   hook_z of one head at one position
    patch_residual                 [n_layers, pos]            hook_resid_pre at one position
    patch_mlps                     [n_layers]                 hook_mlp_out of one MLP, all positions
    patch_mlps(by_position=True)   [n_layers, pos]            hook_mlp_out at one position
    patch_patterns                 [n_layers, n_heads]        hook_pattern of one head

``normalize=True`` rescales to (value - corrupted) / (clean - corrupted): 0 = the corrupted
run's metric, 1 = the clean run's. All patches go through ``evaluate_variants`` (batched,
chunked to ``memory_mb``; on ``GPTModel`` only the layers from the patched one on are rerun).
"""

from __future__ import annotations

from itertools import product

import pandas as pd
import torch

from analyses.core.hook_check import require_edit
from analyses.core.hook_names import (mlp_out_name, pattern_name, pattern_names, resid_pre_name, resid_pre_names, z_name,
                                 z_names)
from analyses.interventions.engine import Edit, Variant, check_choice, head_cells
from analyses.core.metrics import Metric
from analyses.interventions.run import Contrast, Options, Run
from analyses.core.tokens import as_tokens
from interp.errors import UserError

DIRECTIONS = ("denoise", "noise")


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
    when noising (its metric value is read from its last block where its metric is another)."""
    base, source = base_and_source(model, clean_tokens, corrupted_tokens, direction)
    if clean_run is not None and direction == "noise":
        base_run = clean_run
    if clean_run is not None and direction == "denoise":
        clean_run.check_tokens(source)
        source_cache, source_value = clean_run.read(names), clean_run.value(metric)
    else:
        source_run = Run.make(model, source, metric, names, starts=False)
        source_cache, source_value = source_run.cache, source_run.baseline
    if base_run is None:
        base_run = Run.make(model, base, metric)
    base_run.check_tokens(base)
    return Contrast(base_run, metric, source_cache, base_run.value(metric), source_value, direction)


def _sweep(contrast: Contrast, variants: list[Variant], shape, options: Options, desc: str) -> torch.Tensor:
    values = contrast.evaluate(variants, options, desc).reshape(shape)
    return contrast.normalize(values) if options.normalize else values


def patch_heads(
    model,
    clean_tokens,
    corrupted_tokens,
    metric: Metric,
    *,
    by_position: bool = False,
    options: Options | None = None,
    clean_run: Run | None = None,
    **keywords,
) -> torch.Tensor:
    """Patch each head's output (``hook_z``) -> [n_layers, n_heads], or with ``by_position``
    [n_layers, pos, n_heads]. Equals TransformerLens's ``get_act_patch_attn_head_out_all_pos`` /
    ``..._by_pos`` (denoising, unnormalised). ``options`` (``Options``: direction, normalize,
    memory_mb, progress), or the same as keywords (``direction="noise"``); ``clean_run``: a ``Run``
    of the clean prompts made already (see ``prepare``), so they are not run again."""
    require_edit(model, "hook_z", "patch_heads")
    options = Options.of(options, keywords)
    contrast = prepare(model, clean_tokens, corrupted_tokens, metric, z_names(model), options.direction,
                       clean_run=clean_run)
    return head_patches(contrast, options, by_position=by_position)


def head_patches(contrast: Contrast, options: Options, *, by_position: bool = False) -> torch.Tensor:
    """``patch_heads`` on a ``Contrast`` made already (its sources hold every ``hook_z``)."""
    n_layers, n_heads = contrast.model.cfg.n_layers, contrast.model.cfg.n_heads
    if by_position:
        n_pos = contrast.tokens.shape[1]
        cells = product(range(n_layers), range(n_pos), range(n_heads))
        variants = [[Edit(z_name(layer), (pos, head))] for layer, pos, head in cells]
        shape = (n_layers, n_pos, n_heads)
    else:
        variants = [head_cells([cell]) for cell in product(range(n_layers), range(n_heads))]
        shape = (n_layers, n_heads)
    return _sweep(contrast, variants, shape, options, "patch heads")


def patch_residual(
    model,
    clean_tokens,
    corrupted_tokens,
    metric: Metric,
    *,
    options: Options | None = None,
    **keywords,
) -> torch.Tensor:
    """Patch the residual stream entering each block at each position -> [n_layers, pos].
    Equals TransformerLens's ``get_act_patch_resid_pre``. ``options``: see ``patch_heads``."""
    options = Options.of(options, keywords)
    n_layers = model.cfg.n_layers
    names = resid_pre_names(model)
    contrast = prepare(model, clean_tokens, corrupted_tokens, metric, names, options.direction)
    n_pos = contrast.tokens.shape[1]
    variants = [[Edit(resid_pre_name(layer), (pos,))] for layer, pos in product(range(n_layers), range(n_pos))]
    return _sweep(contrast, variants, (n_layers, n_pos), options, "patch resid")


def mlp_out_names(model) -> list[str]:
    """Every layer's ``hook_mlp_out``; a one-line refusal for a model without MLPs."""
    names = [mlp_out_name(layer) for layer in range(model.cfg.n_layers)]
    if any(name not in model.hook_dict for name in names):
        raise UserError("this model has no MLP outputs (blocks.L.hook_mlp_out): it is attention-only")
    return names


def patch_mlps(
    model,
    clean_tokens,
    corrupted_tokens,
    metric: Metric,
    *,
    by_position: bool = False,
    options: Options | None = None,
    clean_run: Run | None = None,
    **keywords,
) -> torch.Tensor:
    """Patch each MLP's output (``hook_mlp_out``) -> [n_layers], or with ``by_position``
    [n_layers, pos] (TransformerLens's ``get_act_patch_mlp_out``). ``options``, ``clean_run``: see
    ``patch_heads``."""
    options = Options.of(options, keywords)
    names = mlp_out_names(model)
    contrast = prepare(model, clean_tokens, corrupted_tokens, metric, names, options.direction, clean_run=clean_run)
    n_layers, n_pos = model.cfg.n_layers, contrast.tokens.shape[1]
    if by_position:
        variants = [[Edit(mlp_out_name(layer), (pos,))] for layer, pos in product(range(n_layers), range(n_pos))]
        shape = (n_layers, n_pos)
    else:
        variants = [[Edit(mlp_out_name(layer), (slice(None),))] for layer in range(n_layers)]
        shape = (n_layers,)
    return _sweep(contrast, variants, shape, options, "patch MLPs")


def patch_patterns(
    model,
    clean_tokens,
    corrupted_tokens,
    metric: Metric,
    *,
    options: Options | None = None,
    **keywords,
) -> torch.Tensor:
    """Patch each head's whole attention pattern (``hook_pattern``) -> [n_layers, n_heads].
    Equals TransformerLens's ``get_act_patch_attn_head_pattern_all_pos``. ``options``: see ``patch_heads``."""
    require_edit(model, "hook_pattern", "patch_patterns")
    options = Options.of(options, keywords)
    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
    names = pattern_names(model)
    contrast = prepare(model, clean_tokens, corrupted_tokens, metric, names, options.direction)
    variants = [[Edit(pattern_name(layer), (head,))] for layer, head in product(range(n_layers), range(n_heads))]
    return _sweep(contrast, variants, (n_layers, n_heads), options, "patch patterns")


def patch_specific_heads(contrast: Contrast, heads, options: Options = Options()) -> torch.Tensor:
    """Exact patch of each of ``heads`` [(layer, head), ...] alone -> (len(heads),), with a
    ``Contrast`` already made (its sources must hold every ``hook_z``)."""
    return contrast.evaluate([head_cells([cell]) for cell in heads], options, "patch heads")


def patching_frame(result: torch.Tensor, dims: tuple[str, ...], value: str = "metric") -> pd.DataFrame:
    """A patching tensor -> tidy DataFrame with one column per dim (e.g. ``("layer", "head")``) and ``value``."""
    if result.ndim != len(dims):
        raise UserError(f"result has {result.ndim} dims but {len(dims)} names were given: {dims}")
    index = pd.MultiIndex.from_product([range(n) for n in result.shape], names=list(dims))
    return pd.DataFrame({value: result.detach().cpu().flatten().numpy()}, index=index).reset_index()
