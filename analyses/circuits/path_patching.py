"""Path patching (architecture §4.6; Wang et al. 2022): how much of a metric flows along one edge, exactly
or estimated for every edge at once (``path_patch(method="eap" | "eap_ig")``: edge attribution).

An edge joins a *sender* head to a *receiver*: a later head's query, key or value input, or the
unembedding ("logits"). Denoising (the default) runs the corrupted prompts and adds the sender's
clean-minus-corrupted *write* -- its ``hook_z`` slice times its ``W_O``, i.e. what it adds to the
residual stream -- to that one input alone, before the receiver's norm; every other reader keeps
the corrupted residual. Noising swaps clean and corrupted. This is TransformerLens's
``patching.get_act_patch_direct_path`` (which has no "logits" and does only denoising), and it
equals it to float precision where that runs.

How it runs, with no model internals but ``W_O`` (``blocks.{l}.attn.W_O``, (head, d_head,
d_model)) and the hooks of architecture §2, every step batched through the intervention engine:

1. for each (sender, receiver layer L, input q/k/v): one partial forward from layer L whose
   residual entering L is the base one plus the sender's write, with the two other inputs'
   ``hook_q/k/v`` of L held at their base values, stopping at L's ``hook_z``: that is the z of
   every head of L when only its query (key, value) input moved, since heads of one layer are
   independent given their q, k and v;
2. for each edge, one forward with only the receiver's ``hook_z`` slice replaced by its step-1
   value. On ``GPTModel`` that is a run from L's ``resid_mid``, the base one plus the receiver's
   moved z through its ``W_O`` (what replacing the slice adds there), so only L's MLP and the
   blocks after it run; a bridge edits ``hook_z`` in a full forward. A "logits" edge adds the
   write to the residual leaving the last block (what ``ln_final`` and the unembedding read).

Grouped-query attention: a key/value head is shared by the query heads of its group. A
receiver's key (value) input is its own copy of the residual that its group's key (value)
projection reads: patching receiver r gives r's z computed with its own query and the
path-patched key (value), and leaves the other heads of the group on the base key (value). (This
is what ``GPTModel.set_use_split_qkv_input`` computes; TransformerLens refuses k/v paths there.)

A block that norms its attention output before the residual (Gemma 2 and 3's ``ln1_post``): a
sender's write is its contribution as docs/guides/families.md defines it, the change of its
``z @ W_O`` through that norm frozen at the base run's scale (``head_writes``); a receiver's moved z
goes through its own block as the model runs it (its ``hook_z`` edited, the norm recomputed: step 2
never starts from ``resid_mid`` there). Exact path patching then needs ``HEAD_CONTRIBUTIONS`` of the
hook self-test; edge attribution, which takes a write to be ``z @ W_O``, is refused there.

Cost per edge: step 2 is one suffix forward (on a 12-layer model, from the receiver's layer's MLP
on); step 1 is about one block's attention per (sender, receiver layer, input), shared by that
layer's receivers.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import pandas as pd
import torch
from einops import einsum, rearrange

from analyses.core.execution import current, executing
from analyses.core.hook_check import (HEAD_CONTRIBUTIONS, HEAD_WRITES, frozen_output_norm, output_norm, output_norm_reads,
                                      require)
from analyses.core.hook_names import final_resid_name, qkv_name, resid_mid_name, resid_pre_name, z_name, z_names
from analyses.circuits.edge_attribution import eap_scores
from analyses.circuits.edges import KEY_COLUMNS, QKV, VIAS, Edge, Edges, Head, edges_of, output_weights
from analyses.core.checks import check_choice
from analyses.interventions.engine import collect_variants, rows_per_chunk, runs_suffix_only, score_variants
from analyses.core.metrics import Metric, PromptScores
from analyses.core.tokens import accumulator
from analyses.interventions.attribution import Screen
from analyses.interventions.patching import base_and_source
from analyses.interventions.run import Contrast, Options, Run, normalize_values
from analyses.core.progress import progress_bar
from interp.errors import UserError

def head_writes(model, senders: Sequence[Head], z_to: Sequence[torch.Tensor], z_from: Sequence[torch.Tensor],
                base: dict) -> dict[Head, torch.Tensor]:
    """What moving each of ``senders``' z from ``z_from`` to ``z_to`` (per layer from layer 0 up to
    the last sender's, (batch, pos, head, d_head)) adds to the residual stream -> {sender:
    (batch, pos, d_model)}, only the senders asked for: the change of its ``z @ W_O``, and in a
    block that norms its attention output that change through the norm frozen at the base run's
    scale (``base``: the base run's activations holding ``output_norm_reads``), the change of the
    head's contribution (docs/guides/families.md). Refused as ``output_weights`` says."""
    w_o = output_weights(model, len(z_to), HEAD_CONTRIBUTIONS)
    writes = {}
    for layer, head in senders:
        write = einsum(z_to[layer][:, :, head] - z_from[layer][:, :, head], w_o[layer][head].to(z_to[layer].dtype),
                       "b p e, e d -> b p d")
        norm = frozen_output_norm(model, layer, base)
        writes[layer, head] = write if norm is None else norm(write).to(write.dtype)
    return writes


@dataclass
class PathSetup(Contrast):
    """The two runs of a path-patching experiment: a ``Contrast`` whose base run is the one every
    patched run processes (corrupted when denoising), plus what is path patching's own:
    ``cache``, what the edges' patched runs read of the base run (``path_reads``), and
    ``writes``, each sender's source-minus-base write, {(layer, head): (batch, pos, d_model)}."""

    cache: dict | None = None
    writes: dict | None = None


def path_reads(model, edges: Edges) -> list[str]:
    """The hooks of the base run that path patching of ``edges`` reads: every ``hook_z``, the
    receivers' layers' ``hook_resid_pre`` and q/k/v, the final residual for "logits" edges, and
    where the senders' blocks norm their attention output what freezes that norm
    (``output_norm_reads``)."""
    logits = edges.table[:, 4] == VIAS.index("logits")
    layers = np.unique(edges.table[~logits, 2]).tolist()
    names = [name for layer in layers for name in (resid_pre_name(layer), *(qkv_name(layer, w) for w in QKV))]
    norms = output_norm_reads(model, np.unique(edges.table[:, 0]).tolist())
    return [*z_names(model), *names, *([final_resid_name(model)] if logits.any() else []), *norms]


def sender_reads(model, edges: Edges) -> list[str]:
    """The hooks of the source run that path patching of ``edges`` reads: the ``hook_z`` of every
    layer up to the last sender's (the senders' writes)."""
    return z_names(model)[:int(edges.table[:, 0].max()) + 1]


def prepare_paths(model, clean, corrupted, metric: Metric, edges: Edges, direction: str, *,
                  base_run: Run | None = None, source_run: Run | None = None) -> PathSetup:
    """Run clean and corrupted once each (in chunks of prompts within the current execution's
    memory, ``analyses.core.execution``); cache what
    the edges' patched runs read (``base_run``: a ``Run`` of the base prompts, corrupted when
    denoising, that serves instead of a forward; what it lacks is read by a forward of only the
    blocks it needs) and the writes of the edges' senders only. ``source_run``: a ``Run`` of the
    source prompts that serves instead of a forward (what it lacks of ``sender_reads`` is read as
    ``base_run``'s is)."""
    base, source = base_and_source(model, clean, corrupted, direction)
    names = path_reads(model, edges)
    senders = sorted({(layer, head) for layer, head in edges.table[:, :2].tolist()})
    sender_z = sender_reads(model, edges)
    if source_run is None:
        source_run = Run.make(model, source, metric, sender_z, starts=False)
    source_run.check_tokens(source)
    if base_run is None:
        base_run = Run.make(model, base, metric, names)
    base_run.check_tokens(base)
    cache = base_run.read(names)
    source_z = source_run.read(sender_z)
    writes = head_writes(model, senders, [source_z[n] for n in sender_z], [cache[n] for n in sender_z], cache)
    source_scores = source_run.scores(metric)
    return PathSetup(base_run, metric, {}, base_run.value(metric), float(source_scores.values), direction, cache,
                     writes, source_scores=source_scores)


def _write(setup: PathSetup, head: Head) -> torch.Tensor:
    return setup.writes[head]


def receiver_z(model, setup: PathSetup, layer: int, paths: Sequence[tuple[Head, str]]) -> dict:
    """Step 1: for each (sender, "q" | "k" | "v"), layer ``layer``'s z (batch, pos, head, d_head)
    with only that input of each head moved by the sender's write -> {(sender, via): z}."""
    return dict(zip(paths, receiver_activations(model, setup, layer, paths, z_name(layer))))


def receiver_activations(model, setup: PathSetup, layer: int, paths: Sequence[tuple[Head, str]],
                         name: str) -> torch.Tensor:
    """Step 1's runs, reading the activation ``name`` of layer ``layer`` at or before its ``hook_z``
    (its ``hook_z``, or ``hook_pattern``: where the heads attend when only their query input moved)
    -> (len(paths), batch, ...), path i with only its input (sender, "q" | "k" | "v") of each head
    moved by the sender's write. Within the current execution's memory (``collect_variants``)."""
    resid = resid_pre_name(layer)
    variants = [
        [(resid, (), setup.cache[resid] + _write(setup, sender)), *((qkv_name(layer, w), ()) for w in QKV if w != via)]
        for sender, via in paths
    ]
    sources = {qkv_name(layer, w): setup.cache[qkv_name(layer, w)] for w in QKV}
    return collect_variants(model, setup.tokens, variants, sources, [name], starts=setup.starts)[name]


def edge_variants(model, setup: PathSetup, edges: Sequence[Edge], z: dict) -> list[list]:
    """Step 2: the one edit that patches each edge (its receivers all in one layer, or "logits")."""
    if edges[0].via == "logits":
        final = final_resid_name(model)
        return [[(final, (), setup.cache[final] + _write(setup, edge.sender))] for edge in edges]
    layer = edges[0].receiver[0]
    moved = [z[edge.sender, edge.via][:, :, edge.receiver[1]] for edge in edges]  # each (batch, pos, d_head)
    mid = resid_mid_name(layer)
    # from resid_mid only where the receiver's z @ W_O is what reaches it (no norm on the attention output to
    # recompute): elsewhere its z is edited and the run recomputes that norm
    if setup.starts is None or mid not in setup.starts or output_norm(model, layer) is not None:
        return [[(z_name(layer), (slice(None), edge.receiver[1]), value)] for edge, value in zip(edges, moved)]
    heads = [edge.receiver[1] for edge in edges]
    change = torch.stack(moved) - rearrange(setup.cache[z_name(layer)][:, :, heads], "b p k e -> k b p e")
    writes = einsum(change, model.blocks[layer].attn.W_O.detach()[heads], "k b p e, k e d -> k b p d")
    return [[(mid, (), setup.starts[mid] + write)] for write in writes]


def path_values(model, setup: PathSetup, metric: Metric, edges: Edges) -> PromptScores:
    """The metric with each edge path-patched -> ``PromptScores``: values (len(edges),) float32 and,
    for a metric with a per-prompt form, each prompt's numerator (len(edges), batch) and count
    (batch,) from the same forwards (``score_variants``); receiver layer by receiver layer (so step
    1's values live for one layer at a time), step 2's edits made one forward's chunk at a time, within
    the current execution's memory; one bar over the edges, shown per its progress."""
    listed, by_layer = list(edges), defaultdict(list)
    for i, edge in enumerate(listed):
        by_layer[edge.receiver[0]].append(i)
    values = torch.empty(len(edges))
    numerators, counts = accumulator(model, len(edges), len(setup.tokens)), None
    per_prompt = True
    chunk = rows_per_chunk(model, *setup.tokens.shape, current().memory_mb)
    with progress_bar(total=len(edges), desc="path patching", leave=False) as bar:
        for layer, members in sorted(by_layer.items()):
            paths = list(dict.fromkeys((listed[i].sender, listed[i].via) for i in members if listed[i].via in QKV))
            z = receiver_z(model, setup, layer, paths) if paths else {}
            for start in range(0, len(members), chunk):
                part = members[start:start + chunk]
                variants = edge_variants(model, setup, [listed[i] for i in part], z)
                with executing(progress=False):
                    scored = score_variants(model, setup.tokens, variants, {}, metric, starts=setup.starts)
                values[part] = scored.values
                per_prompt = per_prompt and scored.numerators is not None
                if per_prompt:
                    numerators[part], counts = scored.numerators.to(numerators), scored.counts
                bar.update(len(part))
    return PromptScores(values, numerators if per_prompt else None, counts if per_prompt else None)


def path_needs(vias: Sequence[str], exact_only: bool = False) -> list[str]:
    """What path patching through ``vias`` needs of a model (``analyses.core.hook_check.NEEDS``):
    edits of ``hook_z`` and of the receivers' q/k/v hooks reaching the output, and each sender's
    write being its z @ W_O (``HEAD_WRITES``, as edge attribution takes it, which screens the
    circuits the commands path-patch), or with ``exact_only`` (exact path patching alone) its
    contribution known (``HEAD_CONTRIBUTIONS``: through the frozen norm on the attention output where
    a block has one). A command plans its circuit from this list, and ``require_path_edits`` refuses
    by it."""
    return ["hook_z", *(f"hook_{via}" for via in QKV if via in vias), HEAD_CONTRIBUTIONS if exact_only else HEAD_WRITES]


def require_path_edits(model, edges: Edges, needed_by: str, exact_only: bool = False) -> None:
    """Refuse, in one line, path patching that this model cannot take (``path_needs``: the hook
    self-test)."""
    for need in path_needs([VIAS[rank] for rank in np.unique(edges.table[:, 4])], exact_only):
        require(model, need, needed_by)


METHODS = ("exact", "eap", "eap_ig")
DEFAULT_IG_STEPS = 5


def path_patch(
    model,
    clean,
    corrupted,
    metric: Metric,
    *,
    senders=None,
    receivers=None,
    via: str | Sequence[str] = VIAS,
    method: str = "exact",
    steps: int | None = None,
    options: Options | None = None,
    base_run: Run | None = None,
    source_run: Run | None = None,
    memory_mb: float | None = None,
    progress: bool | None = None,
    **keywords,
) -> pd.DataFrame:
    """Path patching of every edge (see the module docstring) -> a tidy frame, one row per edge, sorted by
    sender, receiver, via: ``sender_layer, sender_head, receiver_layer, receiver_head, via`` (a
    "logits" edge: ``receiver_layer = n_layers``, ``receiver_head = -1``), then

    - ``method="exact"``: ``value`` (the metric of the path-patched run; with ``normalize``,
      (value - corrupted) / (clean - corrupted) as in ``patch_heads``) and ``effect`` (``value``
      minus the unpatched base run's, on the same scale), a mean over prompts with its 95%
      interval ``ci_low, ci_high`` (a percentile bootstrap over prompts of the per-prompt effects,
      ``analyses.core.stats.effect_intervals``; NaN for a metric without a per-prompt form)
      and ``n_prompts``. Equals TransformerLens's ``get_act_patch_direct_path`` (denoising, q/k/v)
      to float precision;
    - ``method="eap"`` (``edge_attribution``): ``attribution``, every edge's first-order
      ``effect`` from three passes (``analyses.circuits.edge_attribution``): an estimate, without an
      interval;
    - ``method="eap_ig"`` (``eap_ig``): the same with the gradient integrated over ``steps``
      points (default 5) from the base run's input embeddings to the source run's (Hanna et al.
      2024 use 5-50; a ``GPTModel`` only). ``steps`` with another method is refused.

    ``clean`` / ``corrupted``: token ids (batch, pos) or texts of equal token lengths; ``metric``:
    logits -> scalar (``analyses.core.metrics``); ``senders`` / ``receivers``: [(layer, head), ...] or
    None for all heads; ``via``: "q", "k", "v", "logits" or a sequence of them; ``direction``:
    "denoise" (run corrupted, add clean-minus-corrupted) or "noise" (the reverse); it and ``normalize``
    come as ``options`` (``analyses.interventions.run.Options``) or as keywords; ``memory_mb``,
    ``progress``: the execution's (``analyses.core.execution``; None: the current one's).
    ``base_run`` / ``source_run``: ``Run``s of the base / source prompts (see ``prepare_paths``),
    exact only.
    """
    check_choice("method", method, METHODS)
    if steps is not None and method != "eap_ig":
        raise UserError(f"steps={steps!r} is for method='eap_ig' (the integrated gradients), not method={method!r}")
    steps = DEFAULT_IG_STEPS if steps is None else steps
    if method == "eap_ig" and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise UserError(f"steps={steps!r} must be a positive integer")
    if method == "eap_ig" and not runs_suffix_only(model):
        raise UserError(f"EAP-IG interpolates the residual entering block 0, which needs a GPTModel; got {type(model).__name__}")
    options = Options.of(options, keywords)
    edges = edges_of(model, senders, receivers, via)
    with executing(memory_mb, progress) as execution:
        if method != "exact":
            base, source = base_and_source(model, clean, corrupted, options.direction)
            scores = eap_scores(model, edges, base, source, metric, steps if method == "eap_ig" else None,
                                execution.memory_mb)
            return edges.frame(attribution=scores.float())
        require_path_edits(model, edges, "path_patch", exact_only=True)
        setup = prepare_paths(model, clean, corrupted, metric, edges, options.direction, base_run=base_run,
                              source_run=source_run)
        values = path_values(model, setup, metric, edges)
    return path_frame(setup, edges, values, options.normalize)


def edge_attribution(model, clean, corrupted, metric: Metric, *, steps: int | None = None,
                     **keywords) -> pd.DataFrame:
    """EAP: ``path_patch(..., method="eap")``, a tidy frame of the ``attribution`` of every edge (the predicted
    ``effect`` of exact path patching with the same arguments); with ``steps``, EAP-IG
    (``method="eap_ig"``)."""
    method = "eap" if steps is None else "eap_ig"
    return path_patch(model, clean, corrupted, metric, method=method, steps=steps, **keywords)


def eap_ig(model, clean, corrupted, metric: Metric, *, steps: int = 5, **keywords) -> pd.DataFrame:
    """EAP-IG: ``path_patch(..., method="eap_ig", steps=steps)``, a tidy frame (default 5 points on the path)."""
    return path_patch(model, clean, corrupted, metric, method="eap_ig", steps=steps, **keywords)


def screen_edges(model, clean, corrupted, metric: Metric, *, screen: Screen, senders=None, receivers=None,
                 via: str | Sequence[str] = VIAS, options: Options | None = None) -> pd.DataFrame:
    """The edges ``screen`` chooses on these prompts: every edge's EAP ``attribution``
    (``edge_attribution``, unnormalised) and ``exact``, ``screen.chosen`` of the attributions against
    |clean - corrupted| of ``metric`` on these prompts -> the key columns, ``attribution``, ``exact``,
    one row per edge in ``edges_of``'s order. ``senders``, ``receivers``, ``via`` and ``options`` as
    ``path_patch`` takes them; within the current execution."""
    options = (options or Options()).but(normalize=False)
    found = edge_attribution(model, clean, corrupted, metric, senders=senders, receivers=receivers, via=via,
                             options=options)
    base, source = base_and_source(model, clean, corrupted, options.direction)
    gap = Run.make(model, source, metric).value(metric) - Run.make(model, base, metric).value(metric)
    exact = screen.chosen(torch.tensor(found["attribution"].to_numpy(), dtype=torch.float32), gap)
    return found[[*KEY_COLUMNS, "attribution"]].assign(exact=exact.cpu().numpy())


def screened_path_patch(model, clean, corrupted, metric: Metric, *, screen: Screen = Screen(),
                        attribution: torch.Tensor | np.ndarray | None = None, base_run: Run | None = None,
                        source_run: Run | None = None, screen_on: tuple | None = None, memory_mb: float | None = None,
                        progress: bool | None = None, **keywords) -> pd.DataFrame:
    """Path patching screened by edge attribution: every edge's effect estimated (EAP,
    ``edge_attribution``; or ``attribution``, the estimated effects given in ``edges_of``'s order),
    the edges ``screen`` chooses (``analyses.interventions.attribution.Screen``) path-patched
    exactly, the others left at their estimate -> ``path_patch``'s frame of every edge (unnormalised)
    with ``attribution`` and ``exact`` beside ``value`` and ``effect`` (exact where ``exact``, the
    base run's metric plus the estimate elsewhere) and ``ci_low, ci_high, n_prompts`` (the 95%
    interval of an exact effect; NaN for an estimate). ``screen_on``: other prompts ``(clean,
    corrupted, metric)`` on which the screen chooses (``screen_edges`` there: their attribution
    against their own gap), so the prompts measured here do not choose which edges they measure
    exactly; None: the screen chooses on these prompts' attribution. ``keywords``: ``senders``,
    ``receivers``, ``via`` and the options, as ``path_patch`` takes them; ``base_run``,
    ``source_run``, ``memory_mb`` and ``progress`` as there."""
    selection = {key: keywords.pop(key) for key in ("senders", "receivers", "via") if key in keywords}
    options = Options.of(keywords.pop("options", None), keywords)
    with executing(memory_mb, progress):
        every_edge = edges_of(model, **selection)
        require_path_edits(model, every_edge, "screened_path_patch")
        if attribution is None:
            attribution = edge_attribution(model, clean, corrupted, metric, **selection, options=options)["attribution"]
        estimate = torch.from_numpy(np.array(attribution, dtype=np.float32))
        if estimate.shape != (len(every_edge),):
            raise UserError(f"{tuple(estimate.shape)} attributions for {len(every_edge)} edges")
        base, source = base_and_source(model, clean, corrupted, options.direction)
        if base_run is None:
            base_run = Run.make(model, base, metric)
        if source_run is None:
            source_run = Run.make(model, source, metric, sender_reads(model, every_edge), starts=False)
        source_run.check_tokens(source)
        if screen_on is None:
            gap = source_run.value(metric) - base_run.value(metric)
            exact = screen.chosen(estimate, gap)  # |gap|: either direction
        else:
            exact = torch.tensor(screen_edges(model, *screen_on, screen=screen, **selection,
                                              options=options)["exact"].to_numpy())
        chosen = exact.nonzero()[:, 0].cpu().numpy()
        baseline = base_run.value(metric)
        values = baseline + estimate.double()
        low, high = torch.full_like(values, torch.nan), torch.full_like(values, torch.nan)
        n_prompts = len(base)
        if len(chosen):
            edges = every_edge.take(chosen)
            setup = prepare_paths(model, clean, corrupted, metric, edges, options.direction, base_run=base_run,
                                  source_run=source_run)
            scores = path_values(model, setup, metric, edges)
            values[chosen] = scores.values.double()
            low[chosen], high[chosen], n_prompts = setup.intervals(scores)
        return every_edge.frame(value=values.float(), effect=(values - baseline).float(), attribution=estimate,
                                exact=exact, ci_low=low, ci_high=high, n_prompts=np.full(len(values), n_prompts))


def shortlist_path_patch(model, clean, corrupted, metric: Metric, *, top_k: int = 20, **keywords) -> pd.DataFrame:
    """Edge attribution ranks every edge; exact path patching confirms the ``top_k`` by
    |attribution| (``screened_path_patch`` with ``Screen(top_k, math.inf)``) -> those edges,
    strongest attribution first: the key columns, ``attribution``, and ``path_patch``'s ``value``
    and ``effect`` (unnormalised). ``keywords``: ``senders``, ``receivers``, ``via`` and the
    options, as ``path_patch`` takes them."""
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise UserError(f"top_k={top_k!r} must be a positive integer")
    every = screened_path_patch(model, clean, corrupted, metric, screen=Screen(top_k, math.inf), **keywords)
    order = every["attribution"].abs().sort_values(ascending=False, kind="stable").index[:top_k]
    return every.loc[order].reset_index(drop=True)[[*every.columns[:5], "attribution", "value", "effect", "ci_low",
                                                    "ci_high", "n_prompts"]]


def path_frame(setup: PathSetup, edges: Edges, scores: PromptScores, normalize: bool) -> pd.DataFrame:
    """Edges and their path-patched metric (``path_values``) -> the frame ``path_patch`` returns."""
    values, base = scores.values, torch.tensor(setup.baseline)
    if normalize:
        values = normalize_values(values, setup.clean_value, setup.corrupted_value)
        base = normalize_values(base, setup.clean_value, setup.corrupted_value)
    low, high, n_prompts = setup.intervals(scores, normalize=normalize)
    return edges.frame(value=values, effect=values - base, ci_low=low, ci_high=high,
                       n_prompts=np.full(len(edges), n_prompts))
