"""Components (architecture §4.8): the final residual as the sum of its parts, direct logit attribution and
the logit lens, read from one clean cache.

The residual stream leaving the last block is a sum of writes:

    resid_final = embed + pos_embed + sum_l ( sum_h z[l, h] @ W_O[l, h]  +  b_O[l]  +  mlp_out[l] )

(``pos_embed`` with learned positions only; ``mlp_out`` where blocks have an MLP, parallel or not).
``decompose_residual`` returns these parts, one per component: ``embed``, ``pos_embed``, each head
``L{l}H{h}`` (its ``hook_z`` slice through its ``W_O``), each layer's ``L{l} attn bias`` (zeros where
the model has none) and ``L{l} MLP`` (its ``hook_mlp_out``). The parts are checked to add up to the
cached final residual; a model that writes anywhere else is refused, never mis-decomposed.

A block that norms its attention output before the residual (Gemma 2 and 3's ``ln1_post``) adds
``hook_attn_out = weight * attn_out / s``, ``s`` that output's RMS at each prompt and position. With
``s`` frozen at the clean run's (``analyses.core.hook_check.frozen_output_norm``, read off the cached
``attn.hook_out`` and ``hook_attn_out`` as the final norm's scale is, below), a head's part is
``weight * z[l, h] @ W_O[l, h] / s`` and the bias's ``weight * b_O[l] / s``: they add up to
``hook_attn_out`` on the clean run (docs/guides/families.md). Its MLP's part is ``hook_mlp_out``,
already after the norm on the MLP's output.

Direct logit attribution follows TransformerLens's convention (``ActivationCache.apply_ln_to_stack``
then ``logit_attrs``): the final norm is ``y = w * centre(x) / s + b`` (LayerNorm centres, RMSNorm does
not; no norm is ``s = 1, w = 1, b = 0``) with ``s`` the clean run's scale at each prompt and position.
Frozen at that scale the logits are linear in the parts:

    logit_t = sum_parts  centre(part) / s . (w * W_U[:, t])   +   b . W_U[:, t] + b_U[t]

so a part's direct contribution is its term, and the last term (component ``unembed bias``) closes
the sum: the contributions add up to the logit (or to the logit difference, answer minus
distractor). A model that caps its final logits (``cap * tanh(logit / cap)``: Gemma 2) is attributed
onto the logits before the cap, which the parts add up to; the frames say so (column ``logits``:
``"before the soft cap"``, else ``"as output"``). The cap is elementwise and increasing, so it keeps
each position's ranking of tokens, while no split of a capped logit difference into parts adds up
(TransformerLens has no convention for it; a first-order split by the cap's slope at the clean logit
would add up only approximately and would weigh a part by the other parts' sum). TransformerLens folds ``w`` into ``W_U`` and ``b`` into ``b_U`` (compatibility mode);
its ``logit_attrs`` then gives the same numbers.

The scale ``s`` is read off the clean run without a second forward and without the norm's eps: the
model's own final norm applied to the cached final residual gives ``y``; with ``a = w * centre(x)``,
``y - b = a / s``, so ``s = <a, a> / <a, y - b>`` per row, and the reconstruction is checked
against ``y`` (a norm this does not describe is refused). ``b`` is the norm of a zero vector. A row
whose residual is exactly zero (a zero start-token embedding in a model without biases) has no
scale to read; it is normalised to ``b``, so its parts, all zero or cancelling, contribute nothing.

The logit lens decodes the residual entering each block, and the final one, through the final norm
(its statistics recomputed on that residual, as TransformerLens's ``accumulated_resid(apply_ln=True)``)
and the unembedding: the last stage is the model's own logits.

Every function takes either a cache (a TransformerLens ``ActivationCache`` or a dict holding the
hooks of ``component_hooks``) or token ids (batch, pos), for which it makes one ``run_with_cache``
caching only those hooks. Values are float32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Mapping, Sequence

import einops
import pandas as pd
import seaborn as sns
import torch
from matplotlib.figure import Figure

from analyses.interventions.ablation import ablation_sweep
from analyses.core.budget import DEFAULT_MEMORY_MB
from analyses.core.execution import executing
from analyses.core.hook_check import frozen_output_norm, logit_soft_cap, output_norm_reads
from analyses.roles.dormant import head_outputs, output_projection
from analyses.core.hook_names import final_resid_name, mlp_out_name, resid_pre_name, z_name
from analyses.core.checks import check_choice, check_layer
from analyses.interventions.engine import cache_run
from analyses.interventions.patching import patch_effects
from analyses.core.plots import covers_zero, effect_error_bars, hatch_cells, heatmap, new_figure
from analyses.core.stats import N_BOOT, bootstrap_ratio
from analyses.core.tokens import accumulator
from interp.errors import UserError
from interp.precision import rounded_dtype

EMBED, POS_EMBED = "hook_embed", "hook_pos_embed"
UNEMBED_BIAS = "unembed bias"
COMPONENT_COLUMNS = ["component", "kind", "layer", "head"]


def component_hooks(model, *, lens: bool = False, layer: int | None = None) -> list[str]:
    """The hooks the decomposition reads: the embeddings, every ``hook_z``, every ``hook_mlp_out`` the
    model has, the final residual, and where blocks norm their attention output what freezes that norm
    (``output_norm_reads``: ``attn.hook_out``, ``hook_attn_out``); with ``lens``, every block's
    ``hook_resid_pre`` too. With ``layer``: those of the blocks before ``layer`` only, and that
    block's ``hook_resid_pre`` (the residual they add up to) instead of the final residual."""
    hooks = getattr(model, "hook_dict", {})
    blocks = range(model.cfg.n_layers if layer is None else layer)
    names = [EMBED, *([POS_EMBED] if POS_EMBED in hooks else [])]
    for block in blocks:
        names += [z_name(block), *([mlp_out_name(block)] if mlp_out_name(block) in hooks else [])]
    names += output_norm_reads(model, blocks)
    if lens:
        names += [resid_pre_name(block) for block in range(model.cfg.n_layers)]
    return [*names, _target_name(model, layer)]


def _target_name(model, layer: int | None) -> str:
    """The residual the parts add up to: the final one (``layer`` None) or the one entering block ``layer``."""
    if layer is None:
        return final_resid_name(model)
    check_layer(model, layer)
    return resid_pre_name(layer)


def components_cache(model, tokens: torch.Tensor, *, lens: bool = False,
                     layer: int | None = None) -> Mapping[str, torch.Tensor]:
    """One forward of ``tokens`` (batch, pos) caching only ``component_hooks(model, lens=lens,
    layer=layer)``, stopped once they are stored (no logits: at a 128k vocabulary those would be the
    largest tensor)."""
    _, cache = cache_run(model, tokens, component_hooks(model, lens=lens, layer=layer), logits=False)
    return cache


def _cache(model, source, *, lens: bool = False, layer: int | None = None) -> Mapping[str, torch.Tensor]:
    """``source`` as a cache: a cache is used as it is, token ids get one ``components_cache`` run."""
    cache = components_cache(model, source, lens=lens, layer=layer) if isinstance(source, torch.Tensor) else source
    names = set(cache.keys())
    blocks = range(model.cfg.n_layers if layer is None else layer)
    required = [EMBED, *map(z_name, blocks), _target_name(model, layer), *output_norm_reads(model, blocks),
                *(map(resid_pre_name, range(model.cfg.n_layers)) if lens else ())]
    missing = [name for name in required if name not in names]
    if missing:
        raise UserError(f"the cache lacks {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}; cache "
                        f"analyses.component_hooks(model{'' if layer is None else f', layer={layer}'}) "
                        "(or pass the token ids)")
    return cache


def _positions(cache: Mapping[str, torch.Tensor], model, positions: Sequence[int] | None) -> torch.Tensor:
    """The absolute positions (n,) that ``positions`` names (negative ones count from the end; None: all)."""
    n_pos = cache[EMBED].shape[1]
    if positions is None:
        return torch.arange(n_pos)
    index = torch.as_tensor(list(positions), dtype=torch.long)
    if index.ndim != 1 or len(index) == 0 or ((index < -n_pos) | (index >= n_pos)).any():
        raise UserError(f"positions={list(positions)} must be a non-empty list of positions in [-{n_pos}, {n_pos})")
    return index % n_pos


def _label(component: str, kind: str, layer: int | None = None, head: int | None = None) -> dict:
    return {"component": component, "kind": kind, "layer": layer, "head": head}


def _part_groups(model, cache: Mapping[str, torch.Tensor], index: torch.Tensor,
                 reader: torch.Tensor | None = None, layer: int | None = None) -> Iterator[tuple[list[dict], torch.Tensor]]:
    """The parts of the final residual (with ``layer``: of the residual entering block ``layer``, the
    parts written by the blocks before it) at positions ``index``, a group at a time in residual order:
    (labels, parts (k, batch, n, d_model) float32), or with ``reader`` (batch, n, d_model) each part
    dotted with it, (k, batch, n): heads then go through ``W_O @ reader`` and never make their
    d_model-wide outputs (a layer's heads hold n_heads times its ``hook_z``). After the last group,
    checks that the parts add up to the cached residual they decompose."""
    target = _target_name(model, layer)
    final = cache[target][:, index].float()
    total = torch.zeros_like(final)

    def read(name: str) -> torch.Tensor:
        return cache[name][:, index].float()

    def project(parts: torch.Tensor) -> torch.Tensor:
        return parts if reader is None else einops.einsum(parts, reader, "k b n m, b n m -> k b n")

    def layer_heads(layer: int, norm) -> torch.Tensor:
        nonlocal total
        z, w_o = read(z_name(layer)), output_projection(model, layer).float()
        total = total + through(norm, einops.einsum(z, w_o, "b n h d, h d m -> b n m"))
        if reader is None:
            outputs = einops.rearrange(head_outputs(model, layer, z), "b n h m -> h b n m")
            return outputs if norm is None else norm.weight * outputs / norm.scale
        # part . reader = z . (W_O @ (weight * reader / scale)): the frozen norm moves onto the reader
        read_back = einops.einsum(w_o, through(norm, reader), "h d m, b n m -> b n h d")
        return einops.einsum(z, read_back, "b n h d, b n h d -> h b n")

    def parts(group: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total = total + group.sum(0)
        return project(group)

    yield [_label("embed", "embed")], parts(read(EMBED)[None])
    if POS_EMBED in cache.keys():
        yield [_label("pos_embed", "pos_embed")], parts(read(POS_EMBED)[None])
    for block in range(model.cfg.n_layers if layer is None else layer):
        norm = frozen_output_norm(model, block, cache, at=index)  # None: the block adds its attention output as it is
        yield ([_label(f"L{block}H{head}", "head", block, head) for head in range(model.cfg.n_heads)],
               layer_heads(block, norm))
        bias = model.blocks[block].attn.b_O
        bias = final.new_zeros(final.shape[-1]) if bias is None else bias.detach().float()
        yield [_label(f"L{block} attn bias", "attn_bias", block)], parts(through(norm, bias.expand_as(final))[None])
        if mlp_out_name(block) in cache.keys():
            yield [_label(f"L{block} MLP", "mlp", block)], parts(read(mlp_out_name(block))[None])
    gap = float((final - total).abs().max())
    rounded = rounded_dtype(model, cache[target].dtype)  # mixed precision: bfloat16 products
    tolerance = max(1e-4, 32 * torch.finfo(rounded).eps) * max(1.0, float(final.abs().max()))
    if gap > tolerance:
        raise UserError(f"the embeddings, heads, attention biases and MLPs add up to {target} only "
                        f"within {gap:.3g} (allowed {tolerance:.2g}): this model writes to its residual stream "
                        "elsewhere, or the cache lacks a part (see `interp check`)")


def through(norm, x: torch.Tensor) -> torch.Tensor:
    """x (batch, n, d_model) through a block's frozen norm on its attention output (``FrozenNorm``),
    or as it is where the block has none (``norm`` None)."""
    return x if norm is None else norm(x)


@dataclass
class Decomposition:
    """The final residual's parts. ``parts``: (component, batch, position, d_model) float32, summing
    to the final residual over ``component``; ``components``: one row per component (component,
    kind, layer, head; layer/head empty where they do not apply); ``positions``: the absolute
    positions (position,) the parts are taken at."""

    parts: torch.Tensor
    components: pd.DataFrame
    positions: torch.Tensor


def _components_frame(labels: list[dict]) -> pd.DataFrame:
    frame = pd.DataFrame(labels, columns=COMPONENT_COLUMNS)
    return frame.astype({"layer": "Int64", "head": "Int64"})


@torch.no_grad()
def decompose_residual(model, source, *, positions: Sequence[int] | None = None,
                       layer: int | None = None) -> Decomposition:
    """The final residual stream as the sum of its parts, a ``Decomposition`` value (module
    docstring), at ``positions`` (None: all); with ``layer``, the residual entering block ``layer``
    (``blocks.{layer}.hook_resid_pre``), the parts the blocks before it write. ``source``: a cache
    (``component_hooks(model, layer=layer)``) or token ids (batch, pos)."""
    cache = _cache(model, source, layer=layer)
    index = _positions(cache, model, positions)
    labels, stacks = [], []
    for group_labels, parts in _part_groups(model, cache, index, layer=layer):
        labels += group_labels
        stacks.append(parts)
    return Decomposition(torch.cat(stacks), _components_frame(labels), index)


@dataclass
class FinalNorm:
    """A norm (the final one, or a block's on its input) at the clean run, as the affine map ``y =
    weight * centre(x) / scale + bias``: weight, bias (d_model,), scale (batch, n, 1), ``centre``
    whether it subtracts the mean."""

    weight: torch.Tensor
    bias: torch.Tensor
    scale: torch.Tensor
    centre: bool

    def linear(self, part: torch.Tensor) -> torch.Tensor:
        """part (..., batch, n, d_model) -> its share of the normed output, ``weight * centre(part) /
        scale`` float32 (the parts' shares plus ``bias`` give the norm's output)."""
        part = part.float()
        if self.centre:
            part = part - part.mean(-1, keepdim=True)
        return self.weight * part / self.scale


def final_norm(model, final: torch.Tensor) -> FinalNorm:
    """The final norm's affine map at the residuals ``final`` (batch, n, d_model) it was applied to in
    the clean run (module docstring: the scale by least squares, checked against the norm's output)."""
    return frozen_affine_norm(model, model.ln_final, final, "the final norm", "direct logit attribution")


def frozen_affine_norm(model, norm, final: torch.Tensor, what: str, needed_by: str) -> FinalNorm:
    """``norm``'s affine map (``FinalNorm``) at the residuals ``final`` (batch, n, d_model) it was
    applied to in the clean run: the scale by least squares (module docstring), checked against the
    norm's own output; refused in one line naming ``what`` and ``needed_by`` where it is no LayerNorm,
    RMSNorm or identity."""
    d_model = final.shape[-1]
    normed = norm(final)
    output = normed.float()
    bias = norm(final.new_zeros(1, 1, d_model)).float().reshape(d_model)
    weight = getattr(norm, "weight", None)
    weight = final.new_ones(d_model, dtype=torch.float32) if weight is None else weight.detach().float()
    if getattr(norm, "uses_weight_offset", False):  # a bridge's Gemma norm stores weight - 1
        weight = 1.0 + weight
    centre = getattr(model.cfg, "normalization_type", None) in ("LN", "LNPre")
    x = final.float()
    written = weight * (x - x.mean(-1, keepdim=True) if centre else x)
    shifted = output - bias
    squares = (written * written).sum(-1, keepdim=True)
    # a zero residual (e.g. a zero start-token embedding, no biases) is normalised to the bias: its parts
    # (zero, or cancelling) contribute nothing, and the infinite scale says so
    scale = torch.where(squares > 0, squares / (written * shifted).sum(-1, keepdim=True), torch.inf)
    gap = float((written / scale - shifted).abs().max())
    # float32: 1e-4 of the output's scale; a narrower dtype: the output's own rounding (4 epsilons)
    if not gap <= max(1e-4, 4 * torch.finfo(normed.dtype).eps) * max(1.0, float(output.abs().max())):
        raise UserError(f"{what} is not weight * centre(x) / scale + bias within {gap:.3g}; {needed_by} "
                        "needs a LayerNorm, an RMSNorm or no norm there")
    return FinalNorm(weight, bias, scale, centre)


def _targets(answers, n_batch: int, n_pos: int, positions: Sequence[int] | None) -> tuple[torch.Tensor, Sequence[int] | None]:
    """``answers`` as (batch, n) token ids and the positions they are read at: (batch, pos) reads
    every position (or ``positions``); (batch,) one position (``positions``, default the last)."""
    answers = torch.as_tensor(answers, dtype=torch.long)
    if answers.ndim == 1:
        answers = answers[:, None]
        positions = [-1] if positions is None else positions
    if answers.ndim != 2 or answers.shape[0] != n_batch:
        raise UserError(f"answers of shape {tuple(answers.shape)} must be (batch={n_batch},) or (batch, positions)")
    if positions is None and answers.shape[1] != n_pos:
        raise UserError(f"answers have {answers.shape[1]} columns for {n_pos} positions; pass positions=[...] naming them")
    if positions is not None and len(positions) != answers.shape[1]:
        raise UserError(f"answers have {answers.shape[1]} columns for {len(positions)} positions {list(positions)}")
    return answers, positions


def _check_tokens(model, tokens: torch.Tensor, name: str) -> None:
    n_vocab = model.W_U.shape[1]
    if ((tokens < 0) | (tokens >= n_vocab)).any():
        raise UserError(f"{name} must be token ids in [0, {n_vocab})")


def next_token_answers(tokens: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """For attributing each position's prediction of the next token: (answers (batch, pos - 1),
    positions 0..pos-2)."""
    return tokens[:, 1:], list(range(tokens.shape[1] - 1))


def _frame(labels: list[dict], values: torch.Tensor, index: torch.Tensor, value: str) -> pd.DataFrame:
    """values (component, batch, n) -> tidy rows: component, kind, layer, head, prompt, position, ``value``."""
    n_comp, n_batch, n = values.shape
    frame = _components_frame(labels).loc[[c for c in range(n_comp) for _ in range(n_batch * n)]].reset_index(drop=True)
    frame["prompt"] = torch.arange(n_batch).repeat_interleave(n).repeat(n_comp).cpu().numpy()
    frame["position"] = index.repeat(n_comp * n_batch).cpu().numpy()
    frame[value] = values.reshape(-1).cpu().numpy()
    return frame


def _direct_values(model, cache: Mapping[str, torch.Tensor], index: torch.Tensor, direction: torch.Tensor,
                   constant: torch.Tensor) -> tuple[list[dict], torch.Tensor]:
    """Each part's direct contribution along ``direction`` (batch, n, d_model) float32, a combination
    of unembedding columns, whose logit is ``direction . normed + constant`` (constant (batch, n): the
    same combination of ``b_U``), at positions ``index`` (n,), the final norm frozen at the clean run's
    scale -> (labels, values (component, batch, n)); the last component, ``unembed bias``, holds
    what no part writes (the constant and the norm's bias), so the components add up to the logit."""
    norm = final_norm(model, cache[final_resid_name(model)][:, index])
    constant = constant + direction @ norm.bias
    reader = direction * norm.weight
    if norm.centre:  # centre(part) . u == part . centre(u)
        reader = reader - reader.mean(-1, keepdim=True)
    reader = reader / norm.scale
    labels, values = [], []
    for group_labels, group_values in _part_groups(model, cache, index, reader):
        labels += group_labels
        values.append(group_values)
    labels.append(_label(UNEMBED_BIAS, "unembed_bias"))
    values.append(constant[None])
    return labels, torch.cat(values)


def logits_read(model) -> str:
    """Which logits direct logit attribution splits (the frames' ``logits`` column): ``"before the
    soft cap"`` on a model that caps its final logits (module docstring), else ``"as output"``."""
    return "as output" if logit_soft_cap(model) is None else "before the soft cap"


@torch.no_grad()
def direct_logit_attribution(model, source, answers, distractors=None, *,
                             positions: Sequence[int] | None = None) -> pd.DataFrame:
    """Each part's direct contribution to the logit of ``answers`` (minus that of ``distractors``),
    per prompt and position (``dla_effects``: as a task measures it, a mean over prompts with its interval).

    ``source``: a cache or token ids (batch, pos). ``answers``/``distractors``: token ids (batch, n)
    read at ``positions`` (n of them; None: every position, n = pos) or (batch,) read at one position
    (``positions``, default the last). Returns a tidy frame, one row per component, prompt and position:
    ``component, kind, layer, head, prompt, position, dla, logits``; per prompt and position the rows
    add up to the logit (difference), the ``unembed bias`` row included: before the final soft cap
    where the model has one (``logits``: ``logits_read``).
    """
    cache = _cache(model, source)
    final_name = final_resid_name(model)
    n_batch, n_pos = cache[final_name].shape[:2]
    answers, positions = _targets(answers, n_batch, n_pos, positions)
    index = _positions(cache, model, positions)
    W_U, b_U = model.W_U.detach(), model.b_U.detach()  # as stored: only the answers' columns are made float32
    _check_tokens(model, answers, "answers")
    direction, constant = W_U.T[answers].float(), b_U[answers].float()  # (batch, n, d_model), (batch, n)
    if distractors is not None:
        distractors, _ = _targets(distractors, n_batch, n_pos, positions)
        if distractors.shape != answers.shape:
            raise UserError(f"distractors of shape {tuple(distractors.shape)} must match answers {tuple(answers.shape)}")
        _check_tokens(model, distractors, "distractors")
        direction, constant = direction - W_U.T[distractors].float(), constant - b_U[distractors].float()
    labels, values = _direct_values(model, cache, index, direction, constant)
    return _frame(labels, values, index, "dla").assign(logits=logits_read(model))


# ---- DLA as a task measures it: a mean over prompts with its interval --------------------------------

DLA_ONTO = ("logit_diff", "centred_logit")  # with distractors; without
DLA_PARTS = {"logit_diff": ("dla_answer", "dla_distractor"), "centred_logit": ("dla_answer", "dla_vocab_mean")}


def _id_sets(ids, n_batch: int, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-prompt token-id sets (a sequence of ``n_batch`` sequences of ids, ragged) -> (ids (batch, k),
    weights (batch, k)): each set's ids, padded with its first, weighted 1 / its size (its mean), 0 on
    the padding."""
    sets = [list(s) for s in ids]
    if len(sets) != n_batch or any(len(s) == 0 for s in sets):
        raise UserError(f"{name}: {len(sets)} id sets for {n_batch} prompts; each prompt needs a non-empty set")
    width = max(map(len, sets))
    padded = torch.tensor([s + s[:1] * (width - len(s)) for s in sets], dtype=torch.long)
    weights = torch.tensor([[1 / len(s)] * len(s) + [0.0] * (width - len(s)) for s in sets])
    return padded, weights


def _read_targets(ids, n_batch: int, n_pos: int, positions: Sequence[int] | None, at: torch.Tensor | None,
                  name: str) -> tuple[torch.Tensor, torch.Tensor, Sequence[int] | None]:
    """``ids`` (a tensor (batch,) / (batch, n) as ``direct_logit_attribution`` reads, or per-prompt id
    sets read at one position) -> (ids (batch, n, k), weights (batch, n, k), positions): each entry's
    logit is the weighted sum of its ids' logits. With ``at``, the n positions are ``at``'s distinct
    values and every entry reads the same ids."""
    if isinstance(ids, torch.Tensor) or (len(ids) and not isinstance(ids[0], Sequence)):
        if at is not None and torch.as_tensor(ids).ndim != 1:
            raise UserError(f"with at=, {name} must be (batch,) ids or one id set per prompt")
        ids, positions = _targets(ids, n_batch, n_pos, positions if at is None else [-1])
        ids, weights = ids[..., None], torch.ones(*ids.shape, 1)
    else:
        ids, weights = _id_sets(ids, n_batch, name)
        ids, weights = ids[:, None], weights[:, None]
        positions = [-1] if positions is None and at is None else positions
        if positions is not None and len(positions) != 1:
            raise UserError(f"{name} given as id sets are read at one position per prompt, not {list(positions)}")
    if at is not None:
        positions = torch.unique(at).tolist()
        ids, weights = ids.expand(-1, len(positions), -1), weights.expand(-1, len(positions), -1)
    return ids, weights, positions


def _vocab_mean(model, memory_mb: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The unembedding's mean column (d_model,) and bias, float32: the direction and constant of the
    mean logit over the vocabulary. Summed ``memory_mb`` worth of float32 columns at a time (a 128k
    vocabulary's W_U is never made float32 whole)."""
    W_U = model.W_U.detach()
    step = max(1, int(memory_mb * 2**20 // (4 * W_U.shape[0])))
    total = accumulator(model, W_U.shape[0])
    for start in range(0, W_U.shape[1], step):
        total += W_U[:, start:start + step].to(total.dtype).sum(1)
    return (total / W_U.shape[1]).float(), model.b_U.detach().to(total).mean().float()


@torch.no_grad()
def dla_effects(model, source, answers, distractors=None, *, positions: Sequence[int] | None = None,
                at: torch.Tensor | None = None, counted: torch.Tensor | None = None, n_boot: int = N_BOOT,
                seed: int = 0, memory_mb: float = DEFAULT_MEMORY_MB) -> pd.DataFrame:
    """Each component's direct logit attribution as a task measures it: a mean over prompts with its
    95% interval (architecture §4.12).

    Onto (``onto``) the logit difference, the answers' mean logit minus the distractors', where
    ``distractors`` are given, split into ``dla_answer`` (onto the answers' mean logit) and
    ``dla_distractor`` (onto minus the distractors'); else onto the centred logit, the answer's logit
    minus the mean logit over the vocabulary (a write that lifts every logit alike moves no
    probability and scores 0), split into ``dla_answer`` and ``dla_vocab_mean`` (onto minus the mean
    logit). Each part is a ``direct_logit_attribution`` (final norm frozen at the clean run's scale),
    and per prompt ``dla`` is exactly their sum.

    ``source``: a cache or token ids (batch, pos). ``answers`` / ``distractors``: a tensor of ids
    (batch, n) read at ``positions`` or (batch,) read at one position, as ``direct_logit_attribution``
    reads them; or per prompt a set of ids (a sequence of ``batch`` sequences, ragged: a task's
    answers), whose logits are averaged, read at one position. ``at``: (batch,) each prompt's own read
    position instead of ``positions`` (a task's last real tokens). ``counted``: (batch, n) bool, the
    entries that count (None: all; with ``at``, each prompt's own position). A prompt's value is the
    sum over its counted entries; the mean pools them over prompts (``analyses.core.stats.bootstrap_ratio``,
    ``n_boot`` resamples of the prompts with at least one counted entry, seeded by ``seed``).

    Returns one row per component (``component, kind, layer, head``), with ``onto``, ``logits``
    (``logits_read``: before the final soft cap where the model has one), ``dla``,
    ``ci_low``, ``ci_high``, ``n_prompts`` and, per part, the part and ``{part}_ci_low``,
    ``{part}_ci_high``. Over the components (``unembed bias`` included) ``dla`` adds up to the mean
    logit difference (centred logit) over the counted entries, the parts to the answers' mean logit and
    minus the distractors' (the mean logit).
    """
    cache = _cache(model, source)
    n_batch, n_pos = cache[final_resid_name(model)].shape[:2]
    if at is not None:
        if positions is not None or counted is not None:
            raise UserError("pass at= (each prompt's position) or positions=/counted=, not both")
        at = torch.as_tensor(at, dtype=torch.long).cpu()
        if at.shape != (n_batch,) or ((at < 0) | (at >= n_pos)).any():
            raise UserError(f"at= must be (batch={n_batch},) positions in [0, {n_pos}), got shape {tuple(at.shape)}")
    ids, weights, read_positions = _read_targets(answers, n_batch, n_pos, positions, at, "answers")
    index = _positions(cache, model, read_positions)
    _check_tokens(model, ids, "answers")
    W_U, b_U = model.W_U.detach(), model.b_U.detach()
    device = cache[final_resid_name(model)].device

    def combination(ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights = weights.to(device)
        return (einops.einsum(W_U.T[ids.to(W_U.device)].float().to(device), weights, "b n k m, b n k -> b n m"),
                (b_U[ids.to(b_U.device)].float().to(device) * weights).sum(-1))

    answer = combination(ids, weights)
    if distractors is not None:
        other_ids, other_weights, _ = _read_targets(distractors, n_batch, n_pos, positions, at, "distractors")
        if other_ids.shape[:2] != ids.shape[:2]:
            raise UserError(f"distractors are read at {other_ids.shape[1]} positions for the answers' {ids.shape[1]}")
        _check_tokens(model, other_ids, "distractors")
        onto, against = "logit_diff", combination(other_ids, other_weights)
    else:
        onto, (mean_column, mean_bias) = "centred_logit", _vocab_mean(model, memory_mb)
        against = (mean_column.to(device).expand_as(answer[0]), mean_bias.to(device).expand_as(answer[1]))
    labels, plus = _direct_values(model, cache, index, *answer)
    _, minus = _direct_values(model, cache, index, -against[0], -against[1])
    if at is not None:
        counted = index[None].to(at.device) == at[:, None]
    counted = torch.ones(n_batch, len(index), dtype=torch.bool) if counted is None else torch.as_tensor(counted).cpu()
    if counted.shape != (n_batch, len(index)):
        raise UserError(f"counted= of shape {tuple(counted.shape)} must be (batch={n_batch}, positions={len(index)})")
    prompts = counted.any(1)
    if not prompts.any():
        raise UserError("counted= counts no entry")
    mask = counted.to(plus.device, plus.dtype)
    parts = torch.stack([plus + minus, plus, minus], dim=-1)  # (component, batch, n, 3)
    sums = einops.einsum(parts, mask, "c b n p, b n -> b c p")[prompts.to(plus.device)]
    estimate, low, high = bootstrap_ratio(sums, counted.sum(1)[prompts].double(), n_boot=n_boot, seed=seed)
    frame = _components_frame(labels).assign(onto=onto, logits=logits_read(model))
    for column, part in enumerate(("dla", *DLA_PARTS[onto])):
        prefix = "" if part == "dla" else f"{part}_"
        frame[part] = estimate[:, column].cpu().numpy()
        frame[f"{prefix}ci_low"], frame[f"{prefix}ci_high"] = low[:, column].cpu().numpy(), high[:, column].cpu().numpy()
        if part == "dla":
            frame["n_prompts"] = int(prompts.sum())
    return frame


@torch.no_grad()
def accumulated_residual(model, source, *, positions: Sequence[int] | None = None) -> tuple[torch.Tensor, pd.DataFrame]:
    """The residual entering each block and the final one: (stack (stage, batch, n, d_model) in the
    cache's dtype, stages: one row per stage with ``stage`` ("{l}_pre", "final_post", as
    TransformerLens labels them) and ``layer`` (l; n_layers for the final residual))."""
    cache = _cache(model, source, lens=True)
    index = _positions(cache, model, positions)
    names = [*map(resid_pre_name, range(model.cfg.n_layers)), final_resid_name(model)]
    stack = torch.stack([cache[name][:, index] for name in names])
    stages = pd.DataFrame({"stage": [*(f"{layer}_pre" for layer in range(model.cfg.n_layers)), "final_post"],
                           "layer": range(model.cfg.n_layers + 1)})
    return stack, stages


@torch.no_grad()
def logit_lens(model, source, answers, *, positions: Sequence[int] | None = None, where: torch.Tensor | None = None,
               memory_mb: float | None = None) -> pd.DataFrame:
    """The logit lens: each stage of ``accumulated_residual`` through the final norm (recomputed on
    it) and the unembedding, read at ``answers`` (as in ``direct_logit_attribution``). A tidy frame,
    one row per stage, prompt and position: ``stage, layer, prompt, position, answer, logit, log_prob, rank``
    (rank 0: the answer is the top token). ``where``: (batch, n) bool over the positions read, the
    (prompt, position) entries to read (None: all); only those are unembedded, which is most of the
    work (a vocabulary-sized product per row). Full logits are made for ``memory_mb`` (None: the
    current execution's, ``analyses.core.execution``) worth of rows at a time, never for the whole stack."""
    cache = _cache(model, source, lens=True)
    n_batch, n_pos = cache[final_resid_name(model)].shape[:2]
    answers, positions = _targets(answers, n_batch, n_pos, positions)
    _check_tokens(model, answers, "answers")
    stack, stages = accumulated_residual(model, cache, positions=positions)
    index = _positions(cache, model, positions)
    if where is None:
        where = torch.ones(n_batch, len(index), dtype=torch.bool)
    elif tuple(where.shape) != (n_batch, len(index)) or where.dtype != torch.bool:
        raise UserError(f"where of shape {tuple(where.shape)} and dtype {where.dtype} must be bool (batch={n_batch}, "
                        f"positions={len(index)})")
    where = where.to(stack.device)
    W_U, b_U = model.W_U.detach(), model.b_U.detach().float()  # W_U as stored, made float32 a slice at a time
    rows = stack[:, where].flatten(0, 1)  # (stage * entries, d_model)
    targets = answers.to(where.device)[where].repeat(len(stages))
    # per logit: the chunk's logits (4 bytes), the exponentials logsumexp makes (4) and the rank's
    # comparison (1), with room for a float32 slice of a lower-precision W_U (a quarter, below)
    with executing(memory_mb) as execution:
        chunk = max(1, min(len(rows), int(0.75 * execution.memory_mb * 2**20 // (16 * W_U.shape[1]))))
        step = max(1, int(execution.memory_mb * 2**20 // (4 * 4 * W_U.shape[0])))  # vocabulary columns of W_U per slice
    # one buffer for every chunk's logits and the outputs made once: a fresh (chunk, vocab) block per
    # chunk between small kept pieces fragments glibc's heap (14 GB resident at a 262k vocabulary)
    buffer = rows.new_empty((chunk, W_U.shape[1]), dtype=torch.float32)
    logit, log_prob = rows.new_empty(len(rows), dtype=torch.float32), rows.new_empty(len(rows), dtype=torch.float32)
    rank = rows.new_empty(len(rows), dtype=torch.long)
    for start in range(0, len(rows), chunk):
        at_rows = slice(start, min(start + chunk, len(rows)))
        normed = model.ln_final(rows[at_rows][:, None]).float()[:, 0]
        logits = buffer[:len(normed)]
        if W_U.dtype == torch.float32:
            torch.mm(normed, W_U, out=logits)
        else:
            for at in range(0, W_U.shape[1], step):
                torch.mm(normed, W_U[:, at:at + step].float(), out=logits[:, at:at + step])
        logits += b_U
        picked = logits.gather(-1, targets[at_rows, None])[:, 0]
        logit[at_rows] = picked
        log_prob[at_rows] = picked - logits.logsumexp(-1)
        rank[at_rows] = (logits > picked[:, None]).sum(-1)
    prompt, column = where.nonzero(as_tuple=True)  # the entries read, prompt-major as the rows
    n_rows = len(prompt)
    return pd.DataFrame({
        "stage": stages["stage"].repeat(n_rows).to_numpy(), "layer": stages["layer"].repeat(n_rows).to_numpy(),
        "prompt": prompt.repeat(len(stages)).cpu().numpy(),
        "position": index.to(column.device)[column].repeat(len(stages)).cpu().numpy(), "answer": targets.cpu().numpy(),
        "logit": logit.cpu().numpy(), "log_prob": log_prob.cpu().numpy(), "rank": rank.cpu().numpy(),
    })


def head_grid(frame: pd.DataFrame, value: str = "dla") -> pd.DataFrame:
    """The heads' mean ``value`` over prompts and positions as a layer x head table, with one more
    column, ``MLP``, for each layer's MLP where the frame has them."""
    means = frame.groupby(["kind", "layer", "head"], dropna=False)[value].mean().reset_index()
    grid = means[means["kind"] == "head"].pivot(index="layer", columns="head", values=value)
    grid.columns = [str(head) for head in grid.columns]
    mlp = means[means["kind"] == "mlp"].set_index("layer")[value]
    if len(mlp):
        grid["MLP"] = mlp
    grid.index = grid.index.astype(int)
    return grid


def dla_heatmap(frame: pd.DataFrame, title: str = "direct logit attribution") -> Figure:
    """Layer x head heatmap (plus each layer's MLP) of the mean DLA of a ``direct_logit_attribution``
    frame; for a ``dla_effects`` frame (one row per component, with ``ci_low``/``ci_high``), the cells
    whose 95% interval contains 0 hatched."""
    grid = head_grid(frame)
    figure = new_figure(figsize=(0.6 * grid.shape[1] + 2.2, 0.5 * grid.shape[0] + 1.5))
    ax = figure.subplots()
    heatmap(ax, grid.astype(float), center=0.0, cmap="RdBu_r", annot=grid.shape[1] <= 14,
            annot_kws={"size": 7}, cbar_kws={"shrink": 0.8})
    if {"ci_low", "ci_high"} <= set(frame.columns):
        covers = frame.assign(covers=covers_zero(frame["ci_low"], frame["ci_high"]).astype(float))
        hatch_cells(ax, head_grid(covers, "covers").to_numpy() == 1)
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_title(title)
    return figure


def logit_lens_figure(lens: pd.DataFrame) -> Figure:
    """The answer's mean log-probability and how often it is the top token, at each stage of a
    ``logit_lens`` frame."""
    summary = lens.assign(top=lens["rank"] == 0).groupby(["layer", "stage"], sort=True)[["log_prob", "top"]].mean()
    summary = summary.reset_index()
    figure = new_figure(figsize=(8, 3))
    left, right = figure.subplots(1, 2)
    for ax, column, label in ((left, "log_prob", "mean log-prob of the answer"), (right, "top", "answer is top-1")):
        sns.lineplot(summary, x="stage", y=column, marker="o", ax=ax, sort=False)
        ax.set_ylabel(label)
        ax.tick_params(axis="x", rotation=45)
    figure.suptitle("logit lens")
    return figure


# ---- MLPs next to heads: ablation, and the attention-vs-MLP view ---------------------------------------

MLP_METHODS = ("zero", "mean")


def mlp_ablation(model, tokens: torch.Tensor, metric=None, *, method: str = "zero", by_position: bool = False,
                 memory_mb: float | None = None, progress: bool | None = None) -> pd.DataFrame:
    """Ablate each MLP's output (``hook_mlp_out``) alone, at every position or (``by_position``) at one
    -> one row per layer (and position): ``layer, [position,] value, baseline, effect`` (value -
    baseline) and its 95% interval over prompts ``ci_low, ci_high, n_prompts`` (the sweep's). ``method``: ``zero``, or ``mean`` (its mean at the same position over the other prompts,
    as head ablation's leave-one-out mean). ``metric`` defaults to the mean next-token loss. The
    ``each_mlp`` / ``each_mlp_by_position`` sweep of ``analyses.interventions.ablation.ablation_sweep``
    (which also takes ``mean_aligned`` and ``resample``, and MLPs grouped with heads). ``memory_mb``,
    ``progress``: the execution's (``analyses.core.execution``; None: the current one's)."""
    check_choice("MLP ablation method", method, MLP_METHODS)
    with executing(memory_mb, progress):
        frame = ablation_sweep(model, tokens, "each_mlp_by_position" if by_position else "each_mlp", method, metric)
    where = frame[["layer", "position"] if by_position else ["layer"]].astype("int64")
    return where.assign(value=frame["metric"], baseline=frame["baseline"], effect=frame["effect"],
                        ci_low=frame["ci_low"], ci_high=frame["ci_high"], n_prompts=frame["n_prompts"])


def attention_vs_mlp(model, clean_tokens: torch.Tensor, corrupted_tokens: torch.Tensor, metric, answers,
                     distractors=None, *, positions: Sequence[int] | None = None, cache=None, clean_run=None,
                     memory_mb: float | None = None, progress: bool | None = None) -> pd.DataFrame:
    """Each head and each MLP, its direct and its total effect: one row per component with
    ``component, kind, layer, head, direct, direct_ci_low, direct_ci_high, n_prompts`` (its direct
    logit attribution on the clean run, a mean over prompts with its interval, ``dla_effects``: onto
    the logit difference with ``distractors``, onto the centred logit of ``answers`` without) and
    ``total`` (exact denoising patch of its output from the clean into the corrupted run, normalised:
    0 = corrupted, 1 = clean; ``patch_effects``, with ``total_ci_low``, ``total_ci_high``). A component with a large total and a small direct effect acts through later
    components. ``cache``: the clean run's (``components_cache``), else one is made; ``clean_run``: a
    ``Run`` of the clean prompts, which the patching reads instead of running them again. ``memory_mb``,
    ``progress``: the patching's execution (``analyses.core.execution``; None: the current one's)."""
    dla = dla_effects(model, clean_tokens if cache is None else cache, answers, distractors, positions=positions)
    direct = dla[dla["kind"].isin(["head", "mlp"])].rename(
        columns={"dla": "direct", "ci_low": "direct_ci_low", "ci_high": "direct_ci_high"})
    direct = direct[[*COMPONENT_COLUMNS, "direct", "direct_ci_low", "direct_ci_high", "n_prompts"]].reset_index(drop=True)
    kinds = ["heads", *(["mlps"] if (direct["kind"] == "mlp").any() else [])]
    with executing(memory_mb, progress):
        totals = pd.concat([patch_effects(model, clean_tokens, corrupted_tokens, metric, kind, normalize=True,
                                          clean_run=clean_run).assign(kind=kind[:-1]) for kind in kinds],
                           ignore_index=True)  # normalised denoising: the baseline is 0
    totals = totals.rename(columns={"metric": "total", "ci_low": "total_ci_low", "ci_high": "total_ci_high"})
    if "head" not in totals:
        totals["head"] = pd.NA
    totals = totals.astype({"layer": "Int64", "head": "Int64"})[["kind", "layer", "head", "total", "total_ci_low",
                                                                  "total_ci_high"]]
    return direct.merge(totals, on=["kind", "layer", "head"], how="left")


def attention_vs_mlp_figure(frame: pd.DataFrame) -> Figure:
    """Direct (x) against total (y) effect of every head and MLP of a frame with ``component, kind,
    layer, direct, total`` (``attention_vs_mlp``'s, or ``direct_and_total_effects(..., mlps=True)``'s as
    the report draws it), labelled, each with its 95% intervals as error bars where the frame has them
    (``direct_ci_low``, ..., ``effect_error_bars``), with each layer's heads summed beside its MLP on the right."""
    figure = new_figure(figsize=(10, 4))
    left, right = figure.subplots(1, 2)
    effect_error_bars(left, frame, "direct", "total")
    sns.scatterplot(frame, x="direct", y="total", hue="kind", style="kind", ax=left, zorder=3)
    for row in frame.itertuples():
        left.annotate(row.component, (row.direct, row.total), fontsize=7, xytext=(2, 2), textcoords="offset points")
    left.axhline(0.0, color="grey", lw=0.5)
    left.axvline(0.0, color="grey", lw=0.5)
    left.set_title("each head and MLP")
    per_layer = frame.assign(part=frame["kind"].map({"head": "attention (heads summed)", "mlp": "MLP"}))
    per_layer = per_layer.groupby(["layer", "part"])["direct"].sum().reset_index()
    sns.barplot(per_layer, x="layer", y="direct", hue="part", ax=right)
    right.set_title("direct effect per layer")
    return figure
