"""Components (DESIGN 4.8): the final residual as the sum of its parts, direct logit attribution and
the logit lens, read from one clean cache.

The residual stream leaving the last block is a sum of writes:

    resid_final = embed + pos_embed + sum_l ( sum_h z[l, h] @ W_O[l, h]  +  b_O[l]  +  mlp_out[l] )

(``pos_embed`` with learned positions only; ``mlp_out`` where blocks have an MLP, parallel or not).
``decompose_residual`` returns these parts, one per component: ``embed``, ``pos_embed``, each head
``L{l}H{h}`` (its ``hook_z`` slice through its ``W_O``), each layer's ``L{l} attn bias`` (zeros where
the model has none) and ``L{l} MLP`` (its ``hook_mlp_out``). The parts are checked to add up to the
cached final residual; a model that writes anywhere else is refused, never mis-decomposed.

Direct logit attribution follows TransformerLens's convention (``ActivationCache.apply_ln_to_stack``
then ``logit_attrs``): the final norm is ``y = w * centre(x) / s + b`` (LayerNorm centres, RMSNorm does
not; no norm is ``s = 1, w = 1, b = 0``) with ``s`` the clean run's scale at each prompt and position.
Frozen at that scale the logits are linear in the parts:

    logit_t = sum_parts  centre(part) / s . (w * W_U[:, t])   +   b . W_U[:, t] + b_U[t]

so a part's direct contribution is its term, and the last term (component ``unembed bias``) closes
the sum: the contributions add up to the logit (or to the logit difference, answer minus
distractor). TransformerLens folds ``w`` into ``W_U`` and ``b`` into ``b_U`` (compatibility mode);
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
from analyses.roles.dormant import head_outputs, output_projection
from analyses.core.hook_names import final_resid_name, mlp_out_name, resid_pre_name, z_name
from analyses.interventions.engine import cache_run, check_choice
from analyses.interventions.patching import patch_heads, patch_mlps
from analyses.core.plots import new_figure
from interp.errors import UserError

EMBED, POS_EMBED = "hook_embed", "hook_pos_embed"
UNEMBED_BIAS = "unembed bias"
COMPONENT_COLUMNS = ["component", "kind", "layer", "head"]


def component_hooks(model, *, lens: bool = False) -> list[str]:
    """The hooks the decomposition reads: the embeddings, every ``hook_z``, every ``hook_mlp_out`` the
    model has, the final residual; with ``lens``, every block's ``hook_resid_pre`` too."""
    hooks = getattr(model, "hook_dict", {})
    names = [EMBED, *([POS_EMBED] if POS_EMBED in hooks else [])]
    for layer in range(model.cfg.n_layers):
        names += [z_name(layer), *([mlp_out_name(layer)] if mlp_out_name(layer) in hooks else [])]
    if lens:
        names += [resid_pre_name(layer) for layer in range(model.cfg.n_layers)]
    return [*names, final_resid_name(model)]


def components_cache(model, tokens: torch.Tensor, *, lens: bool = False) -> Mapping[str, torch.Tensor]:
    """One forward of ``tokens`` (batch, pos) caching only ``component_hooks(model, lens=lens)``,
    stopped once they are stored (no logits: at a 128k vocabulary those would be the largest tensor)."""
    _, cache = cache_run(model, tokens, component_hooks(model, lens=lens), logits=False)
    return cache


def _cache(model, source, *, lens: bool = False) -> Mapping[str, torch.Tensor]:
    """``source`` as a cache: a cache is used as it is, token ids get one ``components_cache`` run."""
    cache = components_cache(model, source, lens=lens) if isinstance(source, torch.Tensor) else source
    names = set(cache.keys())
    required = [EMBED, *map(z_name, range(model.cfg.n_layers)), final_resid_name(model),
                *(map(resid_pre_name, range(model.cfg.n_layers)) if lens else ())]
    missing = [name for name in required if name not in names]
    if missing:
        raise UserError(f"the cache lacks {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}; cache "
                        "analyses.component_hooks(model) (or pass the token ids)")
    return cache


def _positions(cache: Mapping[str, torch.Tensor], model, positions: Sequence[int] | None) -> torch.Tensor:
    """The absolute positions (n,) that ``positions`` names (negative ones count from the end; None: all)."""
    n_pos = cache[final_resid_name(model)].shape[1]
    if positions is None:
        return torch.arange(n_pos)
    index = torch.as_tensor(list(positions), dtype=torch.long)
    if index.ndim != 1 or len(index) == 0 or ((index < -n_pos) | (index >= n_pos)).any():
        raise UserError(f"positions={list(positions)} must be a non-empty list of positions in [-{n_pos}, {n_pos})")
    return index % n_pos


def _label(component: str, kind: str, layer: int | None = None, head: int | None = None) -> dict:
    return {"component": component, "kind": kind, "layer": layer, "head": head}


def _part_groups(model, cache: Mapping[str, torch.Tensor], index: torch.Tensor,
                 reader: torch.Tensor | None = None) -> Iterator[tuple[list[dict], torch.Tensor]]:
    """The parts of the final residual at positions ``index``, a group at a time in residual order:
    (labels, parts (k, batch, n, d_model) float32), or with ``reader`` (batch, n, d_model) each part
    dotted with it, (k, batch, n): heads then go through ``W_O @ reader`` and never make their
    d_model-wide outputs (a layer's heads hold n_heads times its ``hook_z``). After the last group,
    checks that the parts add up to the cached final residual."""
    final = cache[final_resid_name(model)][:, index].float()
    total = torch.zeros_like(final)

    def read(name: str) -> torch.Tensor:
        return cache[name][:, index].float()

    def project(parts: torch.Tensor) -> torch.Tensor:
        return parts if reader is None else einops.einsum(parts, reader, "k b n m, b n m -> k b n")

    def layer_heads(layer: int) -> torch.Tensor:
        nonlocal total
        z, w_o = read(z_name(layer)), output_projection(model, layer).float()
        total = total + einops.einsum(z, w_o, "b n h d, h d m -> b n m")
        if reader is None:
            return einops.rearrange(head_outputs(model, layer, z), "b n h m -> h b n m")
        read_back = einops.einsum(w_o, reader, "h d m, b n m -> b n h d")
        return einops.einsum(z, read_back, "b n h d, b n h d -> h b n")

    def parts(group: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total = total + group.sum(0)
        return project(group)

    yield [_label("embed", "embed")], parts(read(EMBED)[None])
    if POS_EMBED in cache.keys():
        yield [_label("pos_embed", "pos_embed")], parts(read(POS_EMBED)[None])
    for layer in range(model.cfg.n_layers):
        yield ([_label(f"L{layer}H{head}", "head", layer, head) for head in range(model.cfg.n_heads)],
               layer_heads(layer))
        bias = model.blocks[layer].attn.b_O
        bias = final.new_zeros(final.shape[-1]) if bias is None else bias.detach().float()
        yield [_label(f"L{layer} attn bias", "attn_bias", layer)], parts(bias.expand_as(final)[None])
        if mlp_out_name(layer) in cache.keys():
            yield [_label(f"L{layer} MLP", "mlp", layer)], parts(read(mlp_out_name(layer))[None])
    gap = float((final - total).abs().max())
    tolerance = max(1e-4, 32 * torch.finfo(cache[final_resid_name(model)].dtype).eps) * max(1.0, float(final.abs().max()))
    if gap > tolerance:
        raise UserError(f"the embeddings, heads, attention biases and MLPs add up to {final_resid_name(model)} only "
                        f"within {gap:.3g} (allowed {tolerance:.2g}): this model writes to its residual stream "
                        "elsewhere, or the cache lacks a part (see `interp check`)")


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
def decompose_residual(model, source, *, positions: Sequence[int] | None = None) -> Decomposition:
    """The final residual stream as the sum of its parts (module docstring), at ``positions`` (None:
    all). ``source``: a cache or token ids (batch, pos)."""
    cache = _cache(model, source)
    index = _positions(cache, model, positions)
    labels, stacks = [], []
    for group_labels, parts in _part_groups(model, cache, index):
        labels += group_labels
        stacks.append(parts)
    return Decomposition(torch.cat(stacks), _components_frame(labels), index)


@dataclass
class FinalNorm:
    """The final norm at the clean run, as the affine map ``y = weight * centre(x) / scale + bias``:
    weight, bias (d_model,), scale (batch, n, 1), ``centre`` whether it subtracts the mean."""

    weight: torch.Tensor
    bias: torch.Tensor
    scale: torch.Tensor
    centre: bool


def final_norm(model, final: torch.Tensor) -> FinalNorm:
    """The final norm's affine map at the residuals ``final`` (batch, n, d_model) it was applied to in
    the clean run (module docstring: the scale by least squares, checked against the norm's output)."""
    norm = model.ln_final
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
        raise UserError(f"the final norm is not weight * centre(x) / scale + bias within {gap:.3g}; direct logit "
                        "attribution needs a LayerNorm, an RMSNorm or no final norm")
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


@torch.no_grad()
def direct_logit_attribution(model, source, answers, distractors=None, *,
                             positions: Sequence[int] | None = None) -> pd.DataFrame:
    """Each part's direct contribution to the logit of ``answers`` (minus that of ``distractors``).

    ``source``: a cache or token ids (batch, pos). ``answers``/``distractors``: token ids (batch, n)
    read at ``positions`` (n of them; None: every position, n = pos) or (batch,) read at one position
    (``positions``, default the last). Returns one row per component, prompt and position:
    ``component, kind, layer, head, prompt, position, dla``; per prompt and position the rows add up
    to the logit (difference), the ``unembed bias`` row included.
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
    norm = final_norm(model, cache[final_name][:, index])
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
    return _frame(labels, torch.cat(values), index, "dla")


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
def logit_lens(model, source, answers, *, positions: Sequence[int] | None = None,
               memory_mb: float = DEFAULT_MEMORY_MB) -> pd.DataFrame:
    """The logit lens: each stage of ``accumulated_residual`` through the final norm (recomputed on
    it) and the unembedding, read at ``answers`` (as in ``direct_logit_attribution``). One row per
    stage, prompt and position: ``stage, layer, prompt, position, answer, logit, log_prob, rank``
    (rank 0: the answer is the top token). Full logits are made for ``memory_mb`` worth of rows at a
    time, never for the whole stack."""
    cache = _cache(model, source, lens=True)
    n_batch, n_pos = cache[final_resid_name(model)].shape[:2]
    answers, positions = _targets(answers, n_batch, n_pos, positions)
    _check_tokens(model, answers, "answers")
    stack, stages = accumulated_residual(model, cache, positions=positions)
    index = _positions(cache, model, positions)
    W_U, b_U = model.W_U.detach(), model.b_U.detach().float()  # W_U as stored, made float32 a slice at a time
    rows = stack.flatten(0, 2)  # (stage * batch * n, d_model)
    targets = answers.reshape(-1).repeat(len(stages))
    # per logit: the slices' products and their join (4 + 4 bytes), the exponentials logsumexp makes
    # (4) and the rank's comparison (1), with room for the float32 slice of W_U (a quarter, below)
    chunk = max(1, int(0.75 * memory_mb * 2**20 // (16 * W_U.shape[1])))
    step = max(1, int(memory_mb * 2**20 // (4 * 4 * W_U.shape[0])))  # vocabulary columns of W_U per slice
    logit, log_prob, rank = [], [], []
    for start in range(0, len(rows), chunk):
        normed = model.ln_final(rows[start:start + chunk][:, None]).float()[:, 0]
        parts = [normed @ W_U[:, at:at + step].float() for at in range(0, W_U.shape[1], step)]
        logits = parts[0] if len(parts) == 1 else torch.cat(parts, -1)  # one slice: no copy to join
        logits += b_U  # in place: the product is ours
        target = targets[start:start + chunk, None]
        picked = logits.gather(-1, target)[:, 0]
        logit.append(picked)
        log_prob.append(picked - logits.logsumexp(-1))
        rank.append((logits > picked[:, None]).sum(-1))
    n_rows = n_batch * len(index)
    return pd.DataFrame({
        "stage": stages["stage"].repeat(n_rows).to_numpy(), "layer": stages["layer"].repeat(n_rows).to_numpy(),
        "prompt": torch.arange(n_batch).repeat_interleave(len(index)).repeat(len(stages)).cpu().numpy(),
        "position": index.repeat(n_batch * len(stages)).cpu().numpy(), "answer": targets.cpu().numpy(),
        "logit": torch.cat(logit).cpu().numpy(), "log_prob": torch.cat(log_prob).cpu().numpy(),
        "rank": torch.cat(rank).cpu().numpy(),
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
    """Layer x head heatmap (plus each layer's MLP) of the mean DLA of a ``direct_logit_attribution`` frame."""
    grid = head_grid(frame)
    figure = new_figure(figsize=(0.6 * grid.shape[1] + 2.2, 0.5 * grid.shape[0] + 1.5))
    ax = figure.subplots()
    sns.heatmap(grid.astype(float), ax=ax, center=0.0, cmap="RdBu_r", annot=grid.shape[1] <= 14, fmt=".2f",
                annot_kws={"size": 7}, cbar_kws={"shrink": 0.8})
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_title(title)
    figure.tight_layout()
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
    figure.tight_layout()
    return figure


# ---- MLPs next to heads: ablation, and the attention-vs-MLP view ---------------------------------------

MLP_METHODS = ("zero", "mean")


def mlp_ablation(model, tokens: torch.Tensor, metric=None, *, method: str = "zero", by_position: bool = False,
                 memory_mb: float = DEFAULT_MEMORY_MB, progress: bool | None = None) -> pd.DataFrame:
    """Ablate each MLP's output (``hook_mlp_out``) alone, at every position or (``by_position``) at one
    -> one row per layer (and position): ``layer, [position,] value, baseline, effect`` (value -
    baseline). ``method``: ``zero``, or ``mean`` (its mean at the same position over the other prompts,
    as head ablation's leave-one-out mean). ``metric`` defaults to the mean next-token loss. The
    ``each_mlp`` / ``each_mlp_by_position`` sweep of ``analyses.interventions.ablation.ablation_sweep``
    (which also takes ``mean_aligned`` and ``resample``, and MLPs grouped with heads)."""
    check_choice("MLP ablation method", method, MLP_METHODS)
    frame = ablation_sweep(model, tokens, "each_mlp_by_position" if by_position else "each_mlp", method, metric,
                           memory_mb=memory_mb, progress=progress)
    where = frame[["layer", "position"] if by_position else ["layer"]].astype("int64")
    return where.assign(value=frame["metric"], baseline=frame["baseline"], effect=frame["effect"])


def attention_vs_mlp(model, clean_tokens: torch.Tensor, corrupted_tokens: torch.Tensor, metric, answers,
                     distractors=None, *, positions: Sequence[int] | None = None, cache=None, clean_run=None,
                     memory_mb: float = DEFAULT_MEMORY_MB, progress: bool | None = None) -> pd.DataFrame:
    """Each head and each MLP, its direct and its total effect: one row per component with
    ``component, kind, layer, head, direct`` (its mean direct logit attribution to ``answers`` (minus
    ``distractors``) on the clean run, ``direct_logit_attribution``) and ``total`` (exact denoising
    patch of its output from the clean into the corrupted run, normalised: 0 = corrupted, 1 = clean;
    ``patch_heads`` / ``patch_mlps``). A component with a large total and a small direct effect acts
    through later components. ``cache``: the clean run's (``components_cache``), else one is made;
    ``clean_run``: a ``Run`` of the clean prompts, which the patching reads instead of running them again."""
    dla = direct_logit_attribution(model, clean_tokens if cache is None else cache, answers, distractors,
                                   positions=positions)
    direct = dla[dla["kind"].isin(["head", "mlp"])].groupby("component", sort=False).agg(
        kind=("kind", "first"), layer=("layer", "first"), head=("head", "first"), direct=("dla", "mean")).reset_index()
    options = dict(normalize=True, memory_mb=memory_mb, progress=progress, clean_run=clean_run)
    heads = patch_heads(model, clean_tokens, corrupted_tokens, metric, **options)
    has_mlps = (direct["kind"] == "mlp").any()
    mlps = patch_mlps(model, clean_tokens, corrupted_tokens, metric, **options) if has_mlps else None
    totals = [float(heads[layer, head]) if kind == "head" else float(mlps[layer])
              for kind, layer, head in zip(direct["kind"], direct["layer"], direct["head"])]
    return direct.assign(total=totals)


def attention_vs_mlp_figure(frame: pd.DataFrame) -> Figure:
    """Direct (x) against total (y) effect of every head and MLP of a frame with ``component, kind,
    layer, direct, total`` (``attention_vs_mlp``'s, or ``direct_and_total_effects(..., mlps=True)``'s as
    the report draws it), labelled, with each layer's heads summed beside its MLP on the right."""
    figure = new_figure(figsize=(10, 4))
    left, right = figure.subplots(1, 2)
    sns.scatterplot(frame, x="direct", y="total", hue="kind", style="kind", ax=left)
    for row in frame.itertuples():
        left.annotate(row.component, (row.direct, row.total), fontsize=7, xytext=(2, 2), textcoords="offset points")
    left.axhline(0.0, color="grey", lw=0.5)
    left.axvline(0.0, color="grey", lw=0.5)
    left.set_title("each head and MLP")
    per_layer = frame.assign(part=frame["kind"].map({"head": "attention (heads summed)", "mlp": "MLP"}))
    per_layer = per_layer.groupby(["layer", "part"])["direct"].sum().reset_index()
    sns.barplot(per_layer, x="layer", y="direct", hue="part", ax=right)
    right.set_title("direct effect per layer")
    figure.tight_layout()
    return figure
