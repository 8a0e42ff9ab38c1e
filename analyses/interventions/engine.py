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
``TransformerBridge``'s ``start_at_layer`` still runs the earlier blocks (DESIGN 7), so there the
full forward runs.

The linearised counterpart (``metric_gradients``, ``linear_effects``; ``activation_gradients`` for
any hooks) serves attribution patching, edge attribution and Michel et al.'s head importance: the
first-order change of the metric for moving an activation, from one forward and backward.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Mapping, Sequence, Union

import torch
from einops import einsum, repeat

from analyses.core.budget import DEFAULT_MEMORY_MB, rows_within
from analyses.core.hook_names import layer_of, resid_mid_name, resid_pre_name, z_name, z_names
from analyses.core.metrics import Metric, evaluate_metric, read_positions
from analyses.core.progress import progress_bar
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
    ``suffix_only_start``; a TransformerBridge reruns the earlier blocks, DESIGN 7)."""
    return getattr(model, "suffix_only_start", False)


def check_choice(name: str, value, allowed: Sequence) -> None:
    if value not in allowed:
        raise UserError(f"unknown {name} {value!r}; allowed: {', '.join(map(str, allowed))}")


def check_heads(model, heads) -> list[tuple[int, int]]:
    """[(layer, head), ...] validated against the model's shape."""
    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
    checked = []
    for item in heads:
        try:
            layer, head = (int(v) for v in item)
        except (TypeError, ValueError):
            raise UserError(f"a head is a (layer, head) pair, got {item!r}") from None
        if not (0 <= layer < n_layers and 0 <= head < n_heads):
            raise UserError(
                f"head ({layer}, {head}) out of range: layer must be in [0, {n_layers}), head in [0, {n_heads})"
            )
        checked.append((layer, head))
    return checked


def head_cells(heads: Sequence[tuple[int, int]]) -> list[Edit]:
    """The edits that replace each head's output at every position."""
    return [Edit(z_name(layer), (slice(None), head)) for layer, head in heads]


class _Collected(Exception):
    """Raised once every wanted activation is stored, to skip the rest of the forward."""


def cache_run(model, tokens: torch.Tensor, names: Sequence[str], *, logits: bool = True):
    """One plain forward -> (logits (batch, pos, d_vocab), {name: activation} for ``names``).

    With ``logits=False`` the forward stops as soon as the last wanted activation is stored
    (the layers after it and the unembedding are skipped) and the logits are None.
    """
    wanted, kept = set(names), {}

    def keeper(name):
        def keep(activation, hook):  # the name is bound here: hook.name may be a backend alias
            kept[name] = activation.detach()
            if not logits and len(kept) == len(wanted):
                raise _Collected

        return keep

    output = None
    try:
        with torch.no_grad(), model.hooks(fwd_hooks=[(name, keeper(name)) for name in wanted]):
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
                     positions: torch.Tensor | None = None):
    """One forward of ``tokens`` repeated once per variant (variant-major) under ``hooks``; with
    ``starts`` it begins at the variants' earliest edit (``start_of``) and, given ``positions``,
    unembeds only those (``partial_logits``)."""
    k = len(variants)
    with torch.no_grad(), model.hooks(fwd_hooks=hooks):
        if starts is None:
            return model(repeat(tokens, "b p -> (k b) p", k=k))
        layer, after_attention = min(start_of(variant) for variant in variants)
        mid = after_attention and resid_mid_name(layer) in starts
        resid = repeat(starts[resid_mid_name(layer) if mid else resid_pre_name(layer)], "b p d -> (k b) p d", k=k)
        if positions is None:
            return model(resid, start_at_layer=layer, start_at_resid_mid=mid)
        final = model(resid, start_at_layer=layer, start_at_resid_mid=mid, stop_at_layer=model.cfg.n_layers)
        return partial_logits(model, final, positions)


def partial_logits(model, final: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The residual leaving the last block (rows, pos, d_model) -> logits (rows, pos, d_vocab) at
    ``positions`` only, NaN at every other position (so a metric that reads one of those shows it;
    ``evaluate_variants`` refuses a NaN value)."""
    read = model.unembed(final[:, positions])  # its width is the output space's (d_vocab_out where it differs)
    logits = final.new_full((*final.shape[:2], read.shape[-1]), torch.nan)
    logits[:, positions] = read
    return logits


def run_variants(
    model, tokens, variants: Sequence[Variant], sources: Mapping[str, torch.Tensor], starts: Mapping | None = None,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Logits (variants, batch, pos, d_vocab) of ``tokens`` under each variant, in one forward.

    ``sources`` maps every edited hook name to its source (batch, ...). With ``starts`` (from
    ``base_run``) the forward begins at the chunk's earliest edited layer, and ``positions`` (n,),
    if given, are the only ones unembedded (NaN elsewhere).
    """
    logits = _forward_variants(model, tokens, variants, edit_hooks(variants, sources), starts, positions)
    return logits.unflatten(0, (len(variants), -1))


def rows_per_chunk(model, batch: int, n_pos: int, memory_mb: float, *, logits: bool = True) -> int:
    """How many variants of ``batch`` prompts fit one forward within ``memory_mb``."""
    return max(1, rows_within(model, n_pos, memory_mb, logits=logits) // batch)


def variant_chunks(model, tokens: torch.Tensor, variants: Sequence[Variant], memory_mb: float,
                   *, logits: bool = True) -> list[list[int]]:
    """The variants' indices grouped by where their runs may start (``start_of``, so a suffix run
    starts as late as it can), each group cut into chunks that fit ``memory_mb``."""
    if any(len(variant) == 0 for variant in variants):
        raise UserError("every intervention needs at least one cell to edit")
    by_start = defaultdict(list)
    for v, variant in enumerate(variants):
        by_start[start_of(variant)].append(v)
    chunk = rows_per_chunk(model, tokens.shape[0], tokens.shape[1], memory_mb, logits=logits)
    return [members[i:i + chunk] for _, members in sorted(by_start.items()) for i in range(0, len(members), chunk)]


def evaluate_variants(
    model,
    tokens: torch.Tensor,
    variants: Sequence[Variant],
    sources: Mapping[str, torch.Tensor],
    metric: Metric,
    *,
    starts: Mapping | None = None,
    memory_mb: float = DEFAULT_MEMORY_MB,
    progress: bool | None = None,
    desc: str = "interventions",
) -> torch.Tensor:
    """``metric`` under each variant -> (n_variants,) float tensor, in the order given.

    Variants run in the chunks of ``variant_chunks``. ``starts``: see ``run_variants``; with them, only
    the positions the metric reads (``analyses.core.metrics.read_positions``) are unembedded.
    ``progress``: see ``analyses.core.progress``. Deterministic in its inputs.
    """
    values = torch.empty(len(variants))
    positions = read_positions(metric, tokens.shape[1]) if starts is not None else None
    with progress_bar(total=len(variants), progress=progress, desc=desc, leave=False) as bar:
        for members in variant_chunks(model, tokens, variants, memory_mb):
            logits = run_variants(model, tokens, [variants[v] for v in members], sources, starts, positions)
            for v, variant_logits in zip(members, logits):
                values[v] = evaluate_metric(metric, variant_logits)
            bar.update(len(members))
    if positions is not None and values.isnan().any():
        raise UserError(f"the metric gave NaN: it reads logits outside the positions it declares "
                        f"({positions.tolist()}; give it the right read_positions, or none), or the model's "
                        "output is not finite")
    return values


def collect_variants(
    model,
    tokens: torch.Tensor,
    variants: Sequence[Variant],
    sources: Mapping[str, torch.Tensor],
    names: Sequence[str],
    *,
    starts: Mapping | None = None,
    memory_mb: float = DEFAULT_MEMORY_MB,
) -> dict[str, torch.Tensor]:
    """The activations ``names`` under each variant -> {name: (n_variants, batch, ...)}, in the order
    given. Each forward stops once they are stored, so a chunk runs only up to the last of them
    (from its earliest edited layer where ``starts`` allows). ``names`` must come at or after
    every variant's edits."""
    wanted, collected = list(dict.fromkeys(names)), defaultdict(dict)
    for members in variant_chunks(model, tokens, variants, memory_mb, logits=False):
        chunk = [variants[v] for v in members]
        kept = {}

        def keeper(name):
            def keep(activation, hook):  # the name is bound here: hook.name may be a backend alias
                kept[name] = activation.detach().unflatten(0, (len(chunk), -1))
                if len(kept) == len(wanted):
                    raise _Collected

            return keep

        try:
            hooks = [*edit_hooks(chunk, sources), *((name, keeper(name)) for name in wanted)]
            _forward_variants(model, tokens, chunk, hooks, starts)
        except _Collected:
            pass
        for name in wanted:
            collected[name].update(zip(members, kept[name]))
    return {name: torch.stack([collected[name][v] for v in range(len(variants))]) for name in wanted}


def activation_gradients(model, tokens: torch.Tensor, metric: Metric, names: Sequence[str],
                         also_keep: Sequence[str] = ()) -> tuple[float, dict, dict]:
    """One forward and backward -> (metric value, {name: activation} for ``names`` and
    ``also_keep``, {name: dmetric/dactivation} for ``names``). Only the gradients asked for are
    computed (no weight grads; the backward stops at the earliest of ``names``)."""
    kept = {}

    def start_graph(embed, hook):  # a graph even when the weights do not require grad
        return embed.detach().requires_grad_(True)

    def keeper(name):
        def keep(activation, hook):  # hook.name may be the backend's own alias, so the name is bound here
            kept[name] = activation.view_as(activation)  # returned, so this very tensor is what the model uses next
            return kept[name]

        return keep

    kept_names = list(dict.fromkeys([*names, *also_keep]))
    hooks = [("hook_embed", start_graph)] + [(name, keeper(name)) for name in kept_names]
    with torch.enable_grad():
        value = evaluate_metric(metric, model.run_with_hooks(tokens, fwd_hooks=hooks))
        silent = [name for name in kept_names if name not in kept]
        if silent:
            raise UserError(f"{type(model).__name__} never fired {', '.join(silent)}, which this analysis needs")
        grads = torch.autograd.grad(value, [kept[name] for name in names])
    return value.item(), {name: kept[name].detach() for name in kept_names}, dict(zip(names, grads))


def metric_gradients(model, tokens: torch.Tensor, metric: Metric) -> tuple[float, list, list]:
    """One forward and backward -> (metric value, z per layer, dmetric/dz per layer); each z and
    gradient is (batch, pos, head, d_head). Only activation gradients are computed (no weight grads)."""
    names = z_names(model)
    value, z, grads = activation_gradients(model, tokens, metric, names)
    return value, [z[name] for name in names], [grads[name] for name in names]


def linear_effects(grads: list, z: list, z_target: list, keep: str = "p h") -> torch.Tensor:
    """First-order change of the metric moving each head's z to ``z_target`` (each per layer,
    (batch, pos, head, d_head)), summed over every axis not in ``keep`` -> [n_layers, *keep],
    e.g. ``keep="p h"`` -> [n_layers, pos, n_heads]."""
    return torch.stack([
        einsum(g.float(), (target - current).float(), f"b p h d, b p h d -> {keep}")  # float32 sums
        for g, current, target in zip(grads, z, z_target)
    ])
