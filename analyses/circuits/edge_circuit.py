"""Circuits of edges evaluated on a CANDIDATE SET (architecture §4.6): the metric when only some of the
candidate edges keep their signal, and the faithfulness of the top-k candidate edges of a ranking.

This is not the papers' evaluation. Wang et al., ACDC, MIB and Hanna et al. corrupt every edge of the
model outside the circuit (heads, MLPs, embeddings, into the logits); here only the candidates can be
corrupted and everything else stays clean, so "empty" is a partly clean model and the faithfulness
here is not comparable with theirs. For the papers' standard use ``analyses.circuits.full_graph``
(``circuit_faithfulness``, ``faithfulness_curve`` with MIB's CPR and CMD, ``completeness``,
``minimality``); this module stays for ranking edges within a candidate set.

The edges are those of ``analyses.circuits.edges``: a head's write (its z through its ``W_O``)
into a later head's query, key or value input, or into the unembedding ("logits"). A *circuit*
is a subset of a chosen set of *candidate* edges. Its value is Hanna et al. (2024)'s evaluation,
restricted to the candidates: the clean run in which every candidate edge outside the circuit
carries its sender's write from the corrupted run instead of the write the sender makes in this
run -- the receiver's input gets (corrupted write - current write) added, where "current" is the
sender's output in this same edited forward, so an edit upstream reaches it. Circuit edges, and
every edge that is not a candidate (the embeddings, the MLPs, heads outside the candidates), keep
the values this run gives them, and everything downstream of an edit recomputes.

Every candidate kept gives the clean run; none kept, every candidate edge corrupted (``empty``).
Removing one edge alone is path patching by noising (``path_patch(..., direction="noise")``), so
an edge's exact ``effect`` there is the change its removal makes here, and edge attribution with
``direction="noise"`` is its first-order estimate. Faithfulness of a circuit C is

    (value(C) - value(empty)) / (value(all candidates) - value(empty)),

and of its complement, the same with every candidate but C kept. Each is a ratio of means over
prompts, with its 95% interval: a percentile bootstrap over prompts of the ratio of the per-prompt
differences (``analyses.core.stats.bootstrap_ratio``), for a metric with a per-prompt form.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Mapping, Sequence

import numpy as np
import pandas as pd
import torch

from analyses.circuits.edge_attribution import split_kinds, split_qkv_inputs
from analyses.circuits.edges import VIAS, Edges, output_weights
from analyses.circuits.path_patching import require_path_edits
from analyses.core.execution import executing
from analyses.core.hook_names import final_resid_name, qkv_input_name, z_name, z_names
from analyses.core.budget import rows_within
from analyses.core.metrics import Metric, PromptScores, as_metric
from analyses.core.plots import new_figure
from analyses.core.stats import bootstrap_ratio
from analyses.core.tokens import as_tokens
from analyses.interventions.engine import Chunk, MetricSums, cache_run, runs_suffix_only, unembed_read
from analyses.interventions.patching import base_and_source
from interp.errors import UserError


def _input_name(model, receiver_layer: int, rank: int) -> str:
    return final_resid_name(model) if VIAS[rank] == "logits" else qkv_input_name(receiver_layer, VIAS[rank])


def removal_hooks(model, removed: Edges, corrupted_z: dict[int, torch.Tensor]) -> list:
    """Forward hooks that make each of ``removed`` carry its sender's corrupted write: ``hook_z``
    of the senders' layers records the current z (batch, pos, head, d_head); each receiver input
    (``blocks.{l}.hook_{q,k,v}_input`` (batch, pos, head, d_model), or the final residual (batch,
    pos, d_model)) gets, per edge, (corrupted z - current z) of its sender through the sender's
    ``W_O`` added at its receiver head. ``corrupted_z``: {sender layer: corrupted run's z}."""
    w_o = output_weights(model, int(removed.table[:, 0].max()) + 1)
    current: dict[int, torch.Tensor] = {}

    def record(layer):
        def keep(z, hook):
            current[layer] = z

        return keep

    by_input = defaultdict(list)  # input hook name -> [(sender layer, sender head, receiver head)]
    for s_layer, s_head, r_layer, r_head, rank in removed.table.tolist():
        by_input[_input_name(model, r_layer, rank)].append((s_layer, s_head, r_head))

    def add_corrupted(edges):
        def edit(resid, hook):
            change = torch.stack([(corrupted_z[l][:, :, h] - current[l][:, :, h]) @ w_o[l][h].to(resid.dtype)
                                  for l, h, _ in edges], dim=2)  # (batch, pos, edge, d_model)
            if resid.ndim == 3:  # the final residual: every edge adds to it
                return resid + change.sum(2)
            heads = torch.tensor([r for _, _, r in edges], device=resid.device)
            return resid.index_add(2, heads, change)

        return edit

    layers = sorted(set(removed.table[:, 0].tolist()))
    return [*((z_name(layer), record(layer)) for layer in layers),
            *((name, add_corrupted(edges)) for name, edges in by_input.items())]


def circuit_values(model, clean, corrupted, metric: Metric, candidates: Edges, kept: Sequence[np.ndarray], *,
                   memory_mb: float | None = None, progress: bool | None = False) -> torch.Tensor:
    """The metric with only the circuit ``kept[i]`` of ``candidates`` keeping its edges -> (len(kept),):
    the values of ``circuit_scores`` (which see)."""
    return circuit_scores(model, clean, corrupted, metric, candidates, kept, memory_mb=memory_mb,
                          progress=progress).values


@torch.no_grad()
def circuit_scores(model, clean, corrupted, metric: Metric, candidates: Edges, kept: Sequence[np.ndarray], *,
                   memory_mb: float | None = None, progress: bool | None = False) -> PromptScores:
    """The metric with only the circuit ``kept[i]`` of ``candidates`` keeping its edges (see the
    module docstring) -> ``PromptScores``: values (len(kept),) and, for a metric that splits
    (``Metric.splits``), each prompt's numerator (len(kept), batch) and count (batch,) from the same
    logits. ``kept``: boolean masks over ``candidates`` (len(candidates),). ``clean`` / ``corrupted``:
    token ids (batch, pos) or texts of equal token lengths. Per chunk of prompts (within
    ``memory_mb``; every prompt at once for a metric that does not split): one corrupted forward to
    the last sender's z, then one clean forward per circuit, unembedding only the positions the
    metric reads, pooled by ``MetricSums``; ``memory_mb`` (None: the current execution's) and
    ``progress`` (default: none shown): the execution's (``analyses.core.execution``). A
    ``GPTModel`` only (it edits the per-head q/k/v inputs that ``GPTModel.set_split_qkv_inputs`` gives)."""
    if not runs_suffix_only(model):
        raise UserError(f"circuit_values edits per-head q/k/v inputs of a GPTModel; got {type(model).__name__}")
    masks = [np.asarray(mask) for mask in kept]
    for mask in masks:
        if mask.dtype != bool or mask.shape != (len(candidates),):
            raise UserError(f"each circuit must be a boolean mask of shape ({len(candidates)},), one per candidate "
                            f"edge; got dtype {mask.dtype}, shape {mask.shape}")
    require_path_edits(model, candidates, "circuit_values")
    with executing(memory_mb, progress) as execution:
        clean, corrupted = base_and_source(model, clean, corrupted, "noise")
        batch, n_pos = clean.shape
        metric = as_metric(metric)
        positions = metric.positions(n_pos)
        fit = rows_within(model, n_pos, execution.memory_mb, logits=True,
                          read=None if positions is None else len(positions),
                          per_position=_floats_per_position(model, candidates)) if metric.splits else batch
        removed = [candidates.take(np.flatnonzero(~mask)) for mask in masks]
        chunks = [Chunk([i], slice(start, min(start + fit, batch))) for start in range(0, batch, fit)
                  for i in range(len(masks))]
        senders = z_names(model)[:int(candidates.table[:, 0].max()) + 1]
        held = {}  # the prompts of the latest chunk -> the corrupted run's z of every sender layer

        def chunk_logits(members: list, rows: slice, positions: torch.Tensor | None, compact: bool,
                         entries: torch.Tensor | None) -> torch.Tensor:
            if held.get("rows") != rows:  # one corrupted forward per chunk of prompts, before its first circuit
                _, cache = cache_run(model, corrupted[rows], senders, logits=False)
                held.update(rows=rows, z={layer: cache[name] for layer, name in enumerate(senders)})
            edges = removed[members[0]]
            hooks = removal_hooks(model, edges, held["z"]) if len(edges) else []
            with split_qkv_inputs(model, split_kinds([name for name, _ in hooks])), model.hooks(fwd_hooks=hooks):
                final = model(clean[rows], stop_at_layer=model.cfg.n_layers)
            return unembed_read(model, final, positions if compact else None, entries)[None]

        scores = MetricSums(model, metric, len(masks), batch, positions).score(chunks, chunk_logits,
                                                                               desc="candidate circuits")
        return PromptScores(scores.values.float(), scores.numerators, scores.counts)


def _floats_per_position(model, candidates: Edges) -> int:
    """What one position of one prompt holds beyond a plain forward in ``circuit_scores``: the
    corrupted and the current z of every sender layer, the per-head q/k/v inputs, and the
    per-edge changes stacked for the input that the most candidate edges enter."""
    cfg = model.cfg
    sender_layers = int(candidates.table[:, 0].max()) + 1
    into_one = max(Counter(_input_name(model, r_layer, rank) for _, _, r_layer, _, rank
                           in candidates.table.tolist()).values())
    return 2 * sender_layers * cfg.n_heads * cfg.d_head + 3 * cfg.n_heads * cfg.d_model + into_one * cfg.d_model


def faithfulness_curve(model, clean, corrupted, metric: Metric, candidates: Edges, order: Sequence[int],
                       sizes: Sequence[int], *, memory_mb: float | None = None,
                       progress: bool | None = False) -> pd.DataFrame:
    """The candidate-set evaluation (the module docstring; ``full_graph.faithfulness_curve`` is the
    papers'): the circuits of the top ``k`` edges of ``order`` (indices into ``candidates``, strongest
    first), for each ``k`` in ``sizes`` -> frame ``size, value, faithfulness, complement_value,
    complement``: the metric with only those edges kept, its faithfulness (0: every candidate
    edge corrupted, 1: none), and the same for every candidate edge but those kept (see the
    module docstring), with the 95% intervals over prompts of both faithfulnesses
    (``faithfulness_ci_low, faithfulness_ci_high, complement_ci_low, complement_ci_high``; NaN for a
    metric without a per-prompt form) and ``n_prompts``. The frame's ``attrs`` hold ``full`` and
    ``empty``, the two ends. ``memory_mb``, ``progress``: ``circuit_scores``'."""
    order = np.asarray(order, dtype=np.int64)
    if sorted(order.tolist()) != list(range(len(candidates))):
        raise UserError(f"order must rank every one of the {len(candidates)} candidate edges once; "
                        f"got {len(order)} indices")
    bad = [k for k in sizes if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 0 <= k <= len(order)]
    if bad:
        raise UserError(f"sizes must be integers from 0 to {len(order)} (the candidate edges); got {bad[0]!r}")
    circuits = []
    for k in sizes:
        mask = np.zeros(len(candidates), dtype=bool)
        mask[order[:k]] = True
        circuits += [mask, ~mask]
    full_empty = [np.ones(len(candidates), dtype=bool), np.zeros(len(candidates), dtype=bool)]
    scores = circuit_scores(model, clean, corrupted, metric, candidates, [*full_empty, *circuits], memory_mb=memory_mb,
                            progress=progress)
    values = scores.values
    full, empty, kept, complement = values[0].item(), values[1].item(), values[2::2], values[3::2]
    span = full - empty
    frame = pd.DataFrame({"size": list(sizes), "value": kept.cpu().numpy(), "faithfulness": ((kept - empty) / span).cpu().numpy(),
                          "complement_value": complement.cpu().numpy(),
                          "complement": ((complement - empty) / span).cpu().numpy()})
    frame.attrs.update(full=full, empty=empty)
    return frame.assign(**faithfulness_intervals(scores, len(sizes), len(as_tokens(model, clean))))


def faithfulness_intervals(scores: PromptScores, n_sizes: int, n_batch: int) -> dict:
    """The 95% intervals of ``faithfulness_curve``'s faithfulnesses from its ``circuit_scores`` (full,
    empty, then each size's circuit and complement): per prompt, (circuit - empty) over (full -
    empty) numerators, resampled together (``bootstrap_ratio``; prompts that count nothing left out)
    -> {column: (n_sizes,) array}, with ``n_prompts`` (``n_batch`` where there are no intervals)."""
    if scores.numerators is None:
        nan = np.full(n_sizes, np.nan)
        return {"faithfulness_ci_low": nan, "faithfulness_ci_high": nan, "complement_ci_low": nan,
                "complement_ci_high": nan, "n_prompts": n_batch}
    counted = (scores.counts > 0).cpu()
    numerators = scores.numerators.cpu().double()[:, counted]  # (circuits, n)
    full, empty = numerators[0], numerators[1]
    _, low, high = bootstrap_ratio((numerators[2:] - empty).T, full - empty)  # (n, 2 * n_sizes) over (n,)
    return {"faithfulness_ci_low": low[0::2].cpu().numpy(), "faithfulness_ci_high": high[0::2].cpu().numpy(),
            "complement_ci_low": low[1::2].cpu().numpy(), "complement_ci_high": high[1::2].cpu().numpy(),
            "n_prompts": int(counted.sum())}


def faithfulness_figure(curves: Mapping[str, pd.DataFrame], n_candidates: int, title: str = ""):
    """``faithfulness_curve`` frames, one per ranking (name -> frame), in two panels that share the
    y axis: the circuit of the top k edges kept against k (left), and its complement, every
    candidate but those k, against the k edges removed (right); each with its 95% band where the
    frame has intervals. x from 0 to ``n_candidates`` (symlog: 0 and 1 apart, then log), 0.8 and 5%
    of the candidates marked. Returns the ``Figure``."""
    figure = new_figure(figsize=(11, 4.5))
    kept_ax, removed_ax = figure.subplots(1, 2, sharey=True)
    panels = ((kept_ax, "faithfulness", "-o", "edges kept: the top k", "the circuit: the top k kept"),
              (removed_ax, "complement", "--o", "edges removed: the top k", "its complement: all but the top k"))
    for ax, column, style, xlabel, panel_title in panels:
        for (method, curve), colour in zip(curves.items(), ("black", "tab:blue", "tab:orange", "tab:green",
                                                             "tab:red", "tab:purple")):
            ax.plot(curve["size"], curve[column], style, ms=3, color=colour, label=method)
            low, high = curve.get(f"{column}_ci_low"), curve.get(f"{column}_ci_high")
            if low is not None and high is not None and np.isfinite(low).any():
                ax.fill_between(curve["size"], low, high, color=colour, alpha=0.15, linewidth=0)
        ax.axvline(0.05 * n_candidates, color="0.6", lw=0.8)
        ax.axhline(0.8, color="0.6", lw=0.8)
        ax.set_xscale("symlog", linthresh=1)
        ax.set_xlim(0, n_candidates)
        ax.set(xlabel=f"{xlabel} (of {n_candidates} candidate edges; grey line: 5%)", title=panel_title)
    kept_ax.set_ylabel("faithfulness (0: every candidate edge corrupted, 1: clean)")
    kept_ax.legend(fontsize=8, frameon=False)
    if title:
        figure.suptitle(title)
    return figure
