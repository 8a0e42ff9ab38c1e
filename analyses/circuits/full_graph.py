"""Circuits evaluated on the full graph (architecture §4.12), as Wang et al. (2022), ACDC (Conmy et
al. 2023), Hanna et al. (2024, EAP-IG's ``evaluate_graph``) and MIB (Mueller et al. 2025) do.

**The graph.** Nodes: the input (the token embeddings with the positional ones: what enters block
0), every head, every MLP, and the logits. Edges: each sender (the input, a head, an MLP) into
every input of a later receiver -- a head's query, key or value input (per query head: with
grouped-query attention each query head reads its own copy of its group's key and value input, as
EAP-IG's graphs ungroup them), an MLP's input (a head of the same layer comes before it), and the
final residual that the unembedding reads ("logits"). A head's output is its z through its
``W_O`` (the output bias, the same in every run, belongs to no edge); an MLP's is ``hook_mlp_out``;
the input's is the residual entering block 0. ``full_graph(model).n_edges`` counts them (SmolLM2-135M:
301 senders, 123,211 edges). A *circuit* is a boolean mask over ``Graph.edges`` (``circuit_from_edges``;
``circuit_from_nodes``: every edge between kept nodes, the input and the logits always kept).

**Evaluation** (``circuit_scores``): one forward of the clean prompts in which every receiver
input gets, for each edge outside the circuit, (the corrupted run's sender output - the sender's
output in this same forward) added; circuit edges carry the sender's current output, so an edit
upstream reaches them (Hanna et al.'s formulation). Keeping every edge is the clean run; keeping
none is the corrupted run. The senders' current outputs are kept as differences from the corrupted
run's, per sender (senders, batch, pos, d_model) float32, and each receiver layer's correction is
one product of a (senders so far x receivers) 0/1 matrix with them (over the senders with a
corrupted edge there, or, where fewer senders keep one, the sum of all minus the kept ones' product);
chunked over prompts within ``memory_mb``. An MLP's input is edited by adding its correction to
``resid_mid`` and taking it back out of ``resid_post``, so the MLP alone sees it (exact with a pre-norm too: the MLP norms the
edited residual); parallel attention/MLP blocks have no such point and are refused, as is any
model whose hook self-test (``analyses.core.hook_check``) finds the q/k/v or z edits, or the heads'
writes, not as this needs. A ``GPTModel`` only (its per-head q/k/v inputs).

**Faithfulness** of a circuit C: (m(C) - m(empty)) / (m(full) - m(empty)), m the metric's mean
over prompts, empty the circuit of no edge (every edge corrupted: the corrupted run), full the
whole graph (the clean run); a ratio of means with its 95% percentile bootstrap interval over
prompts (the per-prompt numerators of ``analyses.core.metrics``, prompts resampled together for
every number of one call, as ``analyses.core.stats``), NaN intervals for a metric without a
per-prompt form.

**Curves** (``faithfulness_curve``): the top-k edges by |score| at MIB's fractions of the graph's
edges, with MIB's CPR (area under the faithfulness curve) and CMD (area under |1 - faithfulness|),
each by the trapezoidal rule over the fraction of edges kept (``curve_areas``).

**Completeness and minimality** (Wang et al. 2022, section 4): F(X) is the metric with the model
restricted to the node set X -- every edge out of a node outside X corrupted -- normalised as
faithfulness is. Both search for sets K of the circuit's nodes on *selection* prompts and measure
what they found on disjoint *measurement* prompts, so that the search's pick of the largest of many
does not inflate the reported numbers. ``completeness``: F(C\\K) - F(M\\K), C the circuit and M the
whole model; a complete circuit keeps it near 0 for every K. K is drawn at random (each node kept
with probability 1/2) and grown greedily on the selection prompts (each step adds the node that
most widens |F(C\\K) - F(M\\K)|; every step's K is reported). ``minimality``: a node v of C is needed
when some K of C's other nodes gives a large |F(C\\(K+v)) - F(C\\K)|; K is searched per node,
greedily from the empty set on the selection prompts, so a node that another node backs up (its
removal alone changes nothing) is found needed once K holds the backup.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Iterable, Sequence

import numpy as np
import pandas as pd
import torch
from einops import einsum

from analyses.circuits.circuit_eval import GRAPH_EDGE_COLUMNS
from analyses.circuits.edge_attribution import split_qkv_inputs
from analyses.circuits.edges import QKV
from analyses.circuits.path_patching import path_needs
from analyses.core.execution import executing
from analyses.core.budget import rows_within
from analyses.core.hook_check import require
from analyses.core.hook_names import (has_mlps, mlp_out_name, qkv_input_name, resid_mid_name,
                                      resid_pre_name, z_name)
from analyses.core.metrics import Metric, PromptScores, as_metric
from analyses.core.plots import new_figure
from analyses.core.stats import N_BOOT, percentile_bounds, resample_weights
from analyses.interventions.engine import Chunk, MetricSums, cache_run, runs_suffix_only, unembed_read
from analyses.interventions.patching import base_and_source
from interp.errors import UserError

Node = tuple[str, int, int]  # (kind, layer, head): ("input", -1, -1), ("head", l, h), ("mlp", l, -1), ("logits", L, -1)
INPUT: Node = ("input", -1, -1)
Prompts = tuple  # (clean, corrupted, metric): prompts as ``circuit_faithfulness`` takes them, and their metric
NEEDED_BY = "full-graph circuit evaluation"
# MIB's circuit sizes: these fractions of the graph's edges (Mueller et al. 2025)
MIB_FRACTIONS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)


def node_name(node: Node) -> str:
    """("head", 3, 1) -> "L3H1", ("mlp", 2, -1) -> "MLP2", "input", "logits"."""
    kind, layer, head = node
    return {"head": f"L{layer}H{head}", "mlp": f"MLP{layer}"}.get(kind, kind)


@dataclass(frozen=True)
class Graph:
    """The full graph of a model of ``n_layers`` blocks of ``n_heads`` heads (and an MLP each where
    ``mlps``). Senders in the order they compute: the input, then per layer its heads and its MLP.
    Receivers: per layer the q inputs of its heads, their k inputs, their v inputs, then its MLP;
    last the logits. ``valid`` (senders, receivers) marks the edges; edge i of ``edges`` is the
    i-th True of ``valid`` in row-major order (sender-major), and a circuit mask (n_edges,) bool
    follows that order."""

    n_layers: int
    n_heads: int
    mlps: bool

    @property
    def layer_width(self) -> int:
        """Senders per layer."""
        return self.n_heads + self.mlps

    def first_sender(self, layer: int) -> int:
        """The index of layer ``layer``'s first head; every sender before it has computed when the
        layer's attention reads its inputs (``layer = n_layers``: every sender)."""
        return 1 + layer * self.layer_width

    def first_receiver(self, layer: int) -> int:
        """The index of layer ``layer``'s first q input (``layer = n_layers``: the logits)."""
        return layer * (3 * self.n_heads + self.mlps)

    @cached_property
    def senders(self) -> list[Node]:
        layers = [[("head", layer, h) for h in range(self.n_heads)] + [("mlp", layer, -1)] * self.mlps
                  for layer in range(self.n_layers)]
        return [INPUT, *(node for nodes in layers for node in nodes)]

    @cached_property
    def receivers(self) -> list[tuple[Node, str]]:
        """(node, via) per receiver input."""
        layers = [[(("head", layer, h), via) for via in QKV for h in range(self.n_heads)]
                  + [(("mlp", layer, -1), "mlp")] * self.mlps for layer in range(self.n_layers)]
        return [*(r for inputs in layers for r in inputs), (("logits", self.n_layers, -1), "logits")]

    @cached_property
    def valid(self) -> np.ndarray:
        """(senders, receivers) bool: a sender feeds every receiver input that computes after it."""
        valid = np.zeros((len(self.senders), len(self.receivers)), dtype=bool)
        for layer in range(self.n_layers):
            start = self.first_receiver(layer)
            valid[:self.first_sender(layer), start:start + 3 * self.n_heads] = True
            if self.mlps:  # the MLP also reads its own layer's heads
                valid[:self.first_sender(layer) + self.n_heads, start + 3 * self.n_heads] = True
        valid[:, -1] = True  # the logits read every sender
        return valid

    @property
    def n_edges(self) -> int:
        return int(self.valid.sum())

    @cached_property
    def edges(self) -> pd.DataFrame:
        """One row per edge, in mask order: ``GRAPH_EDGE_COLUMNS`` (``sender_kind, sender_layer,
        sender_head, receiver_kind, receiver_layer, receiver_head, via``; the input is ("input",
        -1, -1), the logits ("logits", n_layers, -1))."""
        senders, receivers = np.nonzero(self.valid)
        rows = [(*self.senders[s], *self.receivers[r][0], self.receivers[r][1]) for s, r in zip(senders, receivers)]
        return pd.DataFrame(rows, columns=GRAPH_EDGE_COLUMNS)

    @property
    def nodes(self) -> list[Node]:
        """The heads and MLPs, in sender order (the nodes a circuit may leave out)."""
        return self.senders[1:]

    def kept_matrix(self, mask: np.ndarray) -> np.ndarray:
        """A circuit mask (n_edges,) -> (senders, receivers) bool, True on its edges."""
        kept = np.zeros_like(self.valid)
        kept[self.valid] = mask
        return kept

    def without(self, mask: np.ndarray, removed: Iterable[Node]) -> np.ndarray:
        """The circuit ``mask`` with every edge out of the ``removed`` nodes dropped (corrupted)."""
        index = {node: i for i, node in enumerate(self.senders)}
        gone = np.zeros(len(self.senders), dtype=bool)
        gone[[index[node] for node in removed]] = True
        return mask & ~np.broadcast_to(gone[:, None], self.valid.shape)[self.valid]


def full_graph(model) -> Graph:
    """The full graph of ``model`` (see the module docstring), a ``Graph`` value, refused in one line where the
    evaluation cannot be carried out on it: not a ``GPTModel``, parallel attention and MLP blocks,
    or edits the hook self-test finds do not work (``path_needs``: z, q, k and v edits, each head's
    write its z @ W_O)."""
    if not (runs_suffix_only(model) and hasattr(model, "set_split_qkv_inputs")):
        raise UserError(f"{NEEDED_BY} edits a GPTModel's per-head q/k/v inputs; got {type(model).__name__}")
    if model.cfg.parallel_attn_mlp:
        raise UserError(f"{NEEDED_BY} edits an MLP's input between the attention and the MLP (resid_mid), "
                        "which parallel attention/MLP blocks do not have")
    for need in path_needs(QKV):
        require(model, need, NEEDED_BY)
    return Graph(model.cfg.n_layers, model.cfg.n_heads, has_mlps(model))


def circuit_from_edges(graph: Graph, edges: pd.DataFrame) -> np.ndarray:
    """The circuit of the edges listed in ``edges`` (``GRAPH_EDGE_COLUMNS``, e.g. rows of
    ``graph.edges``) -> its mask (n_edges,) bool; an edge the graph lacks is refused."""
    missing = [c for c in GRAPH_EDGE_COLUMNS if c not in edges.columns]
    if missing:
        raise UserError(f"the circuit's edges lack columns {missing}; they need {', '.join(GRAPH_EDGE_COLUMNS)}")
    index = {key: i for i, key in enumerate(graph.edges[GRAPH_EDGE_COLUMNS].itertuples(index=False, name=None))}
    mask = np.zeros(graph.n_edges, dtype=bool)
    for key in edges[GRAPH_EDGE_COLUMNS].itertuples(index=False, name=None):
        if key not in index:
            raise UserError(f"{key} is no edge of the graph (senders: input, heads, MLPs; receivers: later heads' "
                            "q/k/v inputs, later MLPs, logits)")
        mask[index[key]] = True
    return mask


def circuit_from_nodes(graph: Graph, nodes: Iterable[Node]) -> np.ndarray:
    """The circuit of every edge between ``nodes`` (heads ("head", l, h) and MLPs ("mlp", l, -1)),
    the input and the logits -> its mask (n_edges,) bool."""
    kept = {INPUT, ("logits", graph.n_layers, -1)}
    for node in nodes:
        node = tuple(node)
        if node not in graph.nodes:
            raise UserError(f"{node} is no node of the graph: ('head', layer, head) or ('mlp', layer, -1) with "
                            f"layer in [0, {graph.n_layers}), head in [0, {graph.n_heads})")
        kept.add(node)
    senders = np.array([s in kept for s in graph.senders])
    receivers = np.array([node in kept for node, _ in graph.receivers])
    return (senders[:, None] & receivers[None, :])[graph.valid]


def _check_masks(graph: Graph, circuits: Sequence[np.ndarray]) -> list[np.ndarray]:
    masks = [np.asarray(mask) for mask in circuits]
    for mask in masks:
        if mask.dtype != bool or mask.shape != (graph.n_edges,):
            raise UserError(f"a circuit must be a boolean mask of shape ({graph.n_edges},), one per edge of the "
                            f"graph; got dtype {mask.dtype}, shape {mask.shape}")
    return masks


@dataclass
class _Source:
    """The corrupted run of a chunk of prompts: the input (batch, pos, d_model), each layer's z
    (batch, pos, head, d_head) and MLP output (batch, pos, d_model)."""

    input: torch.Tensor
    z: list[torch.Tensor]
    mlp: list[torch.Tensor]


def _source_run(model, graph: Graph, tokens: torch.Tensor) -> _Source:
    mlps = [mlp_out_name(layer) for layer in range(graph.n_layers)] if graph.mlps else []
    zs = [z_name(layer) for layer in range(graph.n_layers)]
    _, cache = cache_run(model, tokens, [resid_pre_name(0), *zs, *mlps], logits=False)
    return _Source(cache[resid_pre_name(0)], [cache[name] for name in zs], [cache[name] for name in mlps])


def _edit_hooks(model, graph: Graph, corrupt: torch.Tensor, source: _Source, diff: torch.Tensor) -> list:
    """The hooks of one evaluation forward. ``corrupt`` (senders, receivers) float32 is 1 on each
    edge outside the circuit; ``diff`` (senders, batch, pos, d_model) float32 receives each sender's
    corrupted-minus-current output as it computes; a receiver input gets ``corrupt[:, r] @ diff``
    over the senders before it (the module docstring)."""
    H, last = graph.n_heads, graph.n_layers - 1
    pending: dict = {}
    total = torch.zeros(diff.shape[1:], dtype=diff.dtype, device=diff.device)  # diff summed over the senders so far

    def correction(receivers: slice, n_senders: int) -> torch.Tensor | None:  # -> (receivers, batch, pos, d_model)
        """sum over the first ``n_senders`` (every one an edge into each of ``receivers``) of
        corrupt * diff: over the senders with a corrupted edge there, or where fewer senders keep an
        edge, the running sum over all (``total``: the senders so far are exactly the first
        ``n_senders``) minus that over the kept ones (the cost follows the smaller set)."""
        block = corrupt[:n_senders, receivers]
        corrupted_rows, kept_rows = block.any(1), (block < 1).any(1)
        if not bool(corrupted_rows.any()):
            return None
        flat = diff[:n_senders].flatten(1)  # (senders, batch * pos * d_model)
        by_kept = int(kept_rows.sum()) < int(corrupted_rows.sum())
        weights, rows = (1 - block, kept_rows.nonzero()[:, 0]) if by_kept else (block, corrupted_rows.nonzero()[:, 0])
        # a gathered copy of the rows only where they are at most half of them (``_floats_per_position``)
        product = weights.T @ flat if 2 * len(rows) > n_senders else weights[rows].T @ flat[rows]
        change = total.flatten()[None] - product if by_kept else product
        return change.view(-1, *diff.shape[1:])

    def at_resid_pre(layer):
        def hook(resid, hook):
            if layer == 0:
                diff[0] = source.input - resid
                total.copy_(diff[0])
            start = graph.first_receiver(layer)
            pending["qkv"] = correction(slice(start, start + 3 * H), graph.first_sender(layer))
        return hook

    def at_input(which):
        def hook(inputs, hook):  # (batch, pos, head, d_model)
            change = pending["qkv"]
            if change is None:
                return inputs
            return inputs + change[which * H:(which + 1) * H].permute(1, 2, 0, 3).to(inputs.dtype)
        return hook

    def at_z(layer):
        first, w_o = graph.first_sender(layer), model.blocks[layer].attn.W_O.detach()
        def hook(z, hook):
            diff[first:first + H] = einsum(source.z[layer] - z, w_o.to(z.dtype), "b p h e, h e d -> h b p d")
            total.add_(diff[first:first + H].sum(0))
        return hook

    def at_resid_mid(layer):
        def hook(resid, hook):
            start = graph.first_receiver(layer) + 3 * H
            change = correction(slice(start, start + 1), graph.first_sender(layer) + H)
            pending["mlp"] = None if change is None else change[0].to(resid.dtype)
            return resid if change is None else resid + pending["mlp"]
        return hook

    def at_mlp_out(layer):
        def hook(out, hook):
            diff[graph.first_sender(layer) + H] = source.mlp[layer] - out
            total.add_(diff[graph.first_sender(layer) + H])
        return hook

    def at_resid_post(layer):
        def hook(resid, hook):
            if graph.mlps and pending["mlp"] is not None:
                resid = resid - pending["mlp"]
            if layer == last:
                change = correction(slice(graph.first_receiver(graph.n_layers), None), len(graph.senders))
                resid = resid if change is None else resid + change[0].to(resid.dtype)
            return resid
        return hook

    hooks = []
    for layer in range(graph.n_layers):
        hooks += [(resid_pre_name(layer), at_resid_pre(layer)), (z_name(layer), at_z(layer))]
        hooks += [(qkv_input_name(layer, which), at_input(i)) for i, which in enumerate(QKV)]
        if graph.mlps:
            hooks += [(resid_mid_name(layer), at_resid_mid(layer)), (mlp_out_name(layer), at_mlp_out(layer))]
        hooks.append((f"blocks.{layer}.hook_resid_post", at_resid_post(layer)))
    return hooks


def _split_kinds(graph: Graph, corrupt: np.ndarray) -> list[str]:
    """The q/k/v inputs that some corrupted edge enters (only those are split per head)."""
    heads = np.array([via for _, via in graph.receivers])
    return [which for which in QKV if corrupt[:, heads == which].any()]


def _final_residual(model, graph: Graph, tokens: torch.Tensor, corrupt: np.ndarray, source: _Source,
                    diff: torch.Tensor) -> torch.Tensor:
    """The residual leaving the last block (batch, pos, d_model) of the clean ``tokens`` with every
    edge marked in ``corrupt`` (senders, receivers) bool carrying its corrupted output."""
    n_layers = model.cfg.n_layers
    if not corrupt.any():
        return model(tokens, stop_at_layer=n_layers)
    weights = torch.as_tensor(corrupt, dtype=torch.float32, device=diff.device)
    hooks = _edit_hooks(model, graph, weights, source, diff)
    with split_qkv_inputs(model, _split_kinds(graph, corrupt)), model.hooks(fwd_hooks=hooks):
        return model(tokens, stop_at_layer=n_layers)


def _floats_per_position(model, graph: Graph) -> int:
    """What one position of one prompt holds beyond a plain forward: the senders' differences (and
    a gathered copy of up to half of them), the corrupted run's input, z and MLP outputs, and the
    per-head q/k/v copies and their correction."""
    cfg = model.cfg
    source = cfg.d_model + cfg.n_layers * (cfg.n_heads * cfg.d_head + cfg.d_model)
    return 3 * len(graph.senders) * cfg.d_model // 2 + source + 6 * cfg.n_heads * cfg.d_model


@torch.no_grad()
def circuit_scores(model, clean, corrupted, metric: Metric, circuits: Sequence[np.ndarray], *,
                   memory_mb: float | None = None, progress: bool | None = None) -> PromptScores:
    """The metric with only each circuit's edges keeping their signal, every other edge of the full
    graph carrying the corrupted run's (the module docstring) -> ``PromptScores``: values
    (len(circuits),) and, for a metric that splits (``Metric.splits``), each prompt's numerator
    (len(circuits), batch) and count (batch,). ``circuits``: masks (n_edges,) bool over
    ``full_graph(model).edges``. ``clean`` / ``corrupted``: token ids (batch, pos) or texts of equal
    token lengths. Per chunk of prompts (within ``memory_mb``): one corrupted forward, then one
    forward per circuit, unembedding only the positions the metric reads. ``memory_mb``,
    ``progress``: the execution's (``analyses.core.execution``; None: the current one's)."""
    with executing(memory_mb, progress) as execution:
        graph = full_graph(model)
        masks = _check_masks(graph, circuits)
        clean, corrupted = base_and_source(model, clean, corrupted, "noise")
        batch, n_pos = clean.shape
        metric = as_metric(metric)
        positions, split = metric.positions(n_pos), metric.splits
        fit = rows_within(model, n_pos, execution.memory_mb, logits=True,
                          read=None if positions is None else len(positions),
                          per_position=_floats_per_position(model, graph)) if split else batch
        corrupt = [graph.valid & ~graph.kept_matrix(mask) for mask in masks]
        chunks = [Chunk([i], slice(start, min(start + fit, batch))) for start in range(0, batch, fit)
                  for i in range(len(masks))]
        held = {}  # the prompts of the latest chunk -> their corrupted run and the senders' differences

        def chunk_logits(members: list, rows: slice, positions: torch.Tensor, compact: bool,
                         entries: torch.Tensor | None) -> torch.Tensor:
            if held.get("rows") != rows:  # one corrupted forward per chunk of prompts, before its first circuit
                source = _source_run(model, graph, corrupted[rows])
                diff = torch.empty((len(graph.senders), *source.input.shape), dtype=torch.float32,
                                   device=source.input.device)
                held.update(rows=rows, source=source, diff=diff)
            final = _final_residual(model, graph, clean[rows], corrupt[members[0]], held["source"], held["diff"])
            return unembed_read(model, final, positions if compact else None, entries)[None]

        scores = MetricSums(model, metric, len(masks), batch, positions).score(chunks, chunk_logits,
                                                                               desc="full-graph circuits")
        return PromptScores(scores.values.float(), scores.numerators, scores.counts)


@dataclass(frozen=True)
class Faithfulness:
    """Each circuit's faithfulness, from one call's ``PromptScores`` of (full, empty, *circuits):
    ``values`` (circuits,) the metric; ``estimates`` (circuits,) faithfulness; ``resampled``
    (n_boot, circuits) the faithfulness of each bootstrap resample of prompts (the same resamples
    for every circuit), None for a metric without a per-prompt form; ``full``, ``empty``: the ends;
    ``n_prompts``: the prompts counted."""

    values: np.ndarray
    estimates: np.ndarray
    resampled: np.ndarray | None
    full: float
    empty: float
    n_prompts: int

    @classmethod
    def of(cls, scores: PromptScores, n_batch: int) -> "Faithfulness":
        values = scores.values.cpu().double().numpy()
        full, empty = values[0], values[1]
        estimates = (values[2:] - empty) / (full - empty)
        if scores.numerators is None:
            return cls(values[2:], estimates, None, full, empty, n_batch)
        counted = (scores.counts > 0).cpu()
        numerators = scores.numerators.cpu().double()[:, counted]  # (2 + circuits, n)
        weights = resample_weights(numerators.shape[1], N_BOOT)  # (n_boot, n)
        drawn = weights @ numerators.T  # (n_boot, 2 + circuits)
        resampled = (drawn[:, 2:] - drawn[:, 1:2]) / (drawn[:, :1] - drawn[:, 1:2])
        return cls(values[2:], estimates, resampled.cpu().numpy(), full, empty, int(counted.sum()))

    def interval(self, combination: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The estimate and 95% interval of ``combination`` (k, circuits) times the faithfulnesses
        (None: each faithfulness itself) -> (estimate, ci_low, ci_high), each (k,)."""
        combination = np.eye(len(self.estimates)) if combination is None else combination
        estimate = combination @ self.estimates
        if self.resampled is None:
            return estimate, np.full(len(estimate), np.nan), np.full(len(estimate), np.nan)
        low, high = percentile_bounds(torch.as_tensor(self.resampled @ combination.T))
        return estimate, low.cpu().numpy(), high.cpu().numpy()


def evaluate_faithfulness(model, clean, corrupted, metric: Metric, circuits: Sequence[np.ndarray]) -> Faithfulness:
    """``circuit_scores`` of the full graph, the empty circuit and ``circuits`` -> their ``Faithfulness``,
    within the current execution (``analyses.core.execution``)."""
    graph = full_graph(model)
    ends = [np.ones(graph.n_edges, dtype=bool), np.zeros(graph.n_edges, dtype=bool)]
    scores = circuit_scores(model, clean, corrupted, metric, [*ends, *circuits])
    return Faithfulness.of(scores, len(base_and_source(model, clean, corrupted, "noise")[0]))


def circuit_faithfulness(model, clean, corrupted, metric: Metric, circuits: Sequence[np.ndarray], *,
                         memory_mb: float | None = None, progress: bool | None = None) -> pd.DataFrame:
    """Each circuit (a mask over ``full_graph(model).edges``) on the full graph -> frame ``circuit``
    (its index), ``n_edges``, ``value`` (the metric), ``faithfulness`` with ``ci_low, ci_high``
    (95%, bootstrap over prompts) and ``n_prompts``; ``attrs``: ``full``, ``empty`` (the metric of
    the clean and of the fully corrupted model) and ``graph_edges``. ``memory_mb``, ``progress``: the
    execution's (``analyses.core.execution``; None: the current one's)."""
    with executing(memory_mb, progress):
        found = evaluate_faithfulness(model, clean, corrupted, metric, circuits)
    estimate, low, high = found.interval()
    frame = pd.DataFrame({"circuit": range(len(circuits)), "n_edges": [int(np.sum(c)) for c in circuits],
                          "value": found.values, "faithfulness": estimate, "ci_low": low, "ci_high": high,
                          "n_prompts": found.n_prompts})
    frame.attrs.update(full=found.full, empty=found.empty, graph_edges=full_graph(model).n_edges)
    return frame


def curve_areas(fractions: Sequence[float], faithfulness: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """MIB's areas: CPR, the area under the faithfulness curve, and CMD, the area under |1 -
    faithfulness|, each by the trapezoidal rule over ``fractions`` (points,), the fraction of the
    graph's edges kept, from the smallest fraction to the largest (no point added at 0: a curve
    from 0.001 to 1 spans 0.999). ``faithfulness``: (points,) or (..., points) -> areas (...)."""
    x = np.asarray(fractions, dtype=float)
    y = np.asarray(faithfulness, dtype=float)
    width = np.diff(x)
    cpr = (width * (y[..., 1:] + y[..., :-1]) / 2).sum(-1)
    gap = np.abs(1 - y)
    cmd = (width * (gap[..., 1:] + gap[..., :-1]) / 2).sum(-1)
    return cpr, cmd


def faithfulness_curve(model, clean, corrupted, metric: Metric, scores, fractions: Sequence[float] = MIB_FRACTIONS, *,
                       memory_mb: float | None = None, progress: bool | None = None) -> pd.DataFrame:
    """The circuits of the top-k edges of the full graph by |``scores``| (n_edges,), in
    ``full_graph(model).edges`` order, ties broken by edge order), k = round(fraction * n_edges) for
    each of ``fractions`` (increasing, in (0, 1]; MIB's by default) -> frame ``fraction`` (k /
    n_edges, the fraction actually kept), ``n_edges``, ``value``, ``faithfulness``, ``ci_low``,
    ``ci_high``, ``n_prompts``. ``attrs``: ``cpr`` and ``cmd`` (``curve_areas`` over ``fraction``)
    with their 95% intervals ``cpr_ci``, ``cmd_ci`` (the same bootstrap resamples), ``full``,
    ``empty``, ``graph_edges``. ``memory_mb``, ``progress``: the execution's
    (``analyses.core.execution``; None: the current one's)."""
    graph = full_graph(model)
    circuits = top_edge_circuits(graph, scores, check_fractions(fractions))
    sizes = np.array([int(c.sum()) for c in circuits])
    with executing(memory_mb, progress):
        found = evaluate_faithfulness(model, clean, corrupted, metric, circuits)
    estimate, low, high = found.interval()
    kept = sizes / graph.n_edges
    frame = pd.DataFrame({"fraction": kept, "n_edges": sizes, "value": found.values, "faithfulness": estimate,
                          "ci_low": low, "ci_high": high, "n_prompts": found.n_prompts})
    cpr, cmd = curve_areas(kept, estimate)
    frame.attrs.update(cpr=float(cpr), cmd=float(cmd), **area_intervals(kept, found.resampled), full=found.full,
                       empty=found.empty, graph_edges=graph.n_edges)
    return frame


def check_fractions(fractions: Sequence[float]) -> np.ndarray:
    """MIB-style circuit sizes -> (points,) float, refused unless two or more increasing in (0, 1]."""
    fractions = np.asarray(fractions, dtype=float)
    if len(fractions) < 2 or (np.diff(fractions) <= 0).any() or fractions[0] <= 0 or fractions[-1] > 1:
        raise UserError(f"fractions must be two or more increasing numbers in (0, 1]; got {fractions.tolist()}")
    return fractions


def top_edge_circuits(graph: Graph, scores, fractions: Sequence[float]) -> list[np.ndarray]:
    """The circuits of the top-k edges by |``scores``| (n_edges,), in ``graph.edges`` order, ties
    broken by edge order), k = round(fraction * n_edges) for each of ``fractions`` -> masks (n_edges,)."""
    scores = scores.detach().cpu().double().numpy() if torch.is_tensor(scores) else np.asarray(scores, dtype=float)
    if scores.shape != (graph.n_edges,):
        raise UserError(f"scores must be one per edge of the full graph ({graph.n_edges},); got shape {scores.shape}")
    order = np.argsort(-np.abs(scores), kind="stable")
    circuits = []
    for k in np.rint(np.asarray(fractions, dtype=float) * graph.n_edges).astype(int):
        mask = np.zeros(graph.n_edges, dtype=bool)
        mask[order[:k]] = True
        circuits.append(mask)
    return circuits


def area_intervals(kept: np.ndarray, resampled: np.ndarray | None) -> dict[str, tuple[float, float]]:
    """95% intervals of CPR and CMD (``curve_areas`` over ``kept`` (points,)) from the bootstrap
    resamples of the faithfulness ``resampled`` (n_boot, points) -> {"cpr_ci": (low, high),
    "cmd_ci": (low, high)}; NaN without resamples."""
    intervals = {"cpr_ci": (np.nan, np.nan), "cmd_ci": (np.nan, np.nan)}
    if resampled is not None:
        for name, areas in zip(("cpr_ci", "cmd_ci"), curve_areas(kept, resampled)):
            bounds = percentile_bounds(torch.as_tensor(areas))
            intervals[name] = (float(bounds[0]), float(bounds[1]))
    return intervals


def circuit_nodes(graph: Graph, circuit: np.ndarray) -> list[Node]:
    """The heads and MLPs that send an edge of ``circuit`` (its nodes, in sender order)."""
    sends = graph.kept_matrix(circuit).any(axis=1)
    return [node for node, kept in zip(graph.senders, sends) if kept and node != INPUT]



def _random_sets(nodes: Sequence[Node], n_sets: int, seed: int) -> list[frozenset]:
    """``n_sets`` random subsets of ``nodes``, each node in each with probability 1/2 (seeded)."""
    draws = np.random.default_rng(seed).random((n_sets, len(nodes))) < 0.5
    return [frozenset(n for n, kept in zip(nodes, row) if kept) for row in draws]


def _names(graph: Graph, nodes: frozenset) -> str:
    """A set of nodes as "L0H1, MLP2", in sender order ("" for none)."""
    return ", ".join(node_name(node) for node in graph.senders if node in nodes)


def _check_search(model, selection: Prompts, measurement: Prompts, greedy_steps: int) -> None:
    """Refuse, in one line, a greedy search of no step, or selection and measurement prompts that
    are the same (the search would choose K on the prompts it reports)."""
    if isinstance(greedy_steps, bool) or not isinstance(greedy_steps, (int, np.integer)) or greedy_steps < 1:
        raise UserError(f"greedy_steps must be an integer >= 1; got {greedy_steps!r}")
    for name, prompts in (("selection", selection), ("measurement", measurement)):
        if not isinstance(prompts, (tuple, list)) or len(prompts) != 3:
            raise UserError(f"{name} must be (clean, corrupted, metric); got {type(prompts).__name__}")
    chosen_on = base_and_source(model, selection[0], selection[1], "noise")[0]
    reported_on = base_and_source(model, measurement[0], measurement[1], "noise")[0]
    if chosen_on.shape == reported_on.shape and bool(torch.equal(chosen_on.cpu(), reported_on.cpu())):
        raise UserError("selection and measurement are the same clean prompts; K is chosen on the selection "
                        "prompts and measured on the measurement prompts, so pass two disjoint sets")


def _search_nodes(graph: Graph, circuit: np.ndarray) -> list[Node]:
    """The circuit's nodes (``circuit_nodes``), refused in one line when it has none to remove."""
    nodes = circuit_nodes(graph, circuit)
    if not nodes:
        raise UserError("the circuit has no head or MLP that sends an edge, so there is no node to remove")
    return nodes


class _Restricted:
    """F on one set of prompts: the faithfulness of ``bases`` (masks over the graph's edges) with
    every edge out of a set K of nodes corrupted, for many K in one ``evaluate_faithfulness`` call."""

    def __init__(self, model, graph: Graph, bases: Sequence[np.ndarray]):
        self.model, self.graph, self.bases = model, graph, list(bases)

    def __call__(self, prompts: Prompts, sets: Sequence[frozenset]) -> Faithfulness:
        """-> the ``Faithfulness`` of each base without each K of ``sets``, K-major: circuit i of it
        is base ``i % len(bases)`` without ``sets[i // len(bases)]``; within the current execution."""
        masks = [self.graph.without(base, k) for k in sets for base in self.bases]
        return evaluate_faithfulness(self.model, *prompts, masks)


def completeness(model, selection: Prompts, measurement: Prompts, circuit: np.ndarray, *, greedy_steps: int = 3,
                 n_random: int = 8, seed: int = 0, memory_mb: float | None = None,
                 progress: bool | None = None) -> pd.DataFrame:
    """Wang et al.'s completeness of ``circuit`` (a mask over ``full_graph(model).edges``): for sets
    K of its nodes (``circuit_nodes``), the incompleteness F(C\\K) - F(M\\K) (the circuit, and the
    whole model, with every edge out of K corrupted; faithfulness-normalised), a complete circuit's
    near 0 for every K. ``selection`` and ``measurement``: (clean, corrupted, metric) on disjoint
    prompts. The greedy K is grown on the selection prompts -- step i adds to step i-1's K the node
    that most widens |F(C\\K) - F(M\\K)| there -- for ``greedy_steps`` steps (at most the circuit's
    nodes); every step's K and ``n_random`` random K (each node in with probability 1/2, seeded) are
    then measured on the measurement prompts, where nothing is chosen.

    -> frame, one row per K: ``search`` ("greedy" or "random"), ``step`` (the greedy step, 1...; 0
    for random), ``removed`` (K's node names), ``size``, ``selection_gap`` (the greedy pick's
    |difference| on the selection prompts, the largest of the step's candidates; NaN for random),
    then on the measurement prompts ``f_circuit``, ``f_model``, ``difference`` with ``ci_low,
    ci_high`` (95%, bootstrap over prompts), ``gap`` (|difference|), ``n_prompts``. ``attrs``:
    ``chosen_on`` ("selection"), ``measured_on`` ("measurement"), ``n_selection`` (the selection
    prompts counted). Cost: 2 x nodes evaluations per greedy step on the selection prompts, 2 x
    (steps + n_random) on the measurement prompts."""
    with executing(memory_mb, progress):
        graph = full_graph(model)
        circuit = _check_masks(graph, [circuit])[0]
        _check_search(model, selection, measurement, greedy_steps)
        nodes = _search_nodes(graph, circuit)
        restricted = _Restricted(model, graph, [circuit, np.ones(graph.n_edges, dtype=bool)])
        chosen, path, selection_gaps, n_selection = frozenset(), [], [], 0
        for _ in range(min(greedy_steps, len(nodes))):
            tries = [chosen | {node} for node in nodes if node not in chosen]
            found = restricted(selection, tries)
            gaps = np.abs(found.estimates[0::2] - found.estimates[1::2])
            best = int(np.argmax(gaps))
            chosen, n_selection = tries[best], found.n_prompts
            path.append(chosen)
            selection_gaps.append(gaps[best])
        randoms = _random_sets(nodes, n_random, seed)
        sets = [*path, *randoms]
        frame = pd.DataFrame({"search": ["greedy"] * len(path) + ["random"] * len(randoms),
                              "step": [*range(1, len(path) + 1), *[0] * len(randoms)],
                              "removed": [_names(graph, k) for k in sets], "size": [len(k) for k in sets],
                              "selection_gap": [*selection_gaps, *[np.nan] * len(randoms)]})
        if sets:
            found = restricted(measurement, sets)
            difference, low, high = found.interval(np.kron(np.eye(len(sets)), [[1.0, -1.0]]))  # F(C\K) - F(M\K)
            frame = frame.assign(f_circuit=found.estimates[0::2], f_model=found.estimates[1::2], difference=difference,
                                 ci_low=low, ci_high=high, gap=np.abs(difference), n_prompts=found.n_prompts)
        frame.attrs.update(chosen_on="selection", measured_on="measurement", n_selection=n_selection)
        return frame


def _greedy_minimality_sets(nodes: Sequence[Node], restricted: _Restricted, selection: Prompts,
                            greedy_steps: int) -> tuple[dict[Node, frozenset], dict[Node, float], int]:
    """Per node v, the K of Wang et al.'s minimality searched on the selection prompts: from K =
    empty, each of ``greedy_steps`` steps adds the node u (of the circuit, not v, not in K) that
    maximises |F(C\\(K+u)) - F(C\\(K+u+v))|; kept: the K of the largest score seen, the empty one
    included -> ({v: K}, {v: its |score| on the selection prompts}, the selection prompts counted). One ``evaluate_faithfulness``
    call per step for every node at once (the distinct sets among the K+u and K+u+v)."""
    current = {v: frozenset() for v in nodes}
    found = restricted(selection, [frozenset(), *({v} for v in nodes)])
    best = {v: (abs(found.estimates[0] - found.estimates[1 + i]), frozenset()) for i, v in enumerate(nodes)}
    n_selection = found.n_prompts
    for _ in range(greedy_steps):
        tries = {v: [current[v] | {u} for u in nodes if u != v and u not in current[v]] for v in nodes}
        sets = list(dict.fromkeys(s for v in nodes for k in tries[v] for s in (k, k | {v})))
        if not sets:
            break
        found = restricted(selection, sets)
        value = dict(zip(sets, found.estimates))
        for v in nodes:
            if tries[v]:
                scores = [abs(value[k] - value[k | {v}]) for k in tries[v]]
                pick = int(np.argmax(scores))
                current[v] = tries[v][pick]
                if scores[pick] > best[v][0]:
                    best[v] = (scores[pick], current[v])
    return {v: k for v, (_, k) in best.items()}, {v: score for v, (score, _) in best.items()}, n_selection


def minimality(model, selection: Prompts, measurement: Prompts, circuit: np.ndarray, *, greedy_steps: int = 1,
               memory_mb: float | None = None, progress: bool | None = None) -> pd.DataFrame:
    """Wang et al.'s minimality of ``circuit`` (a mask over ``full_graph(model).edges``): a node v of
    C is needed when some K of C's other nodes gives a large |F(C\\(K+v)) - F(C\\K)| -- a node that
    another backs up scores near 0 with K empty and large once K holds its backup. ``selection``
    and ``measurement``: (clean, corrupted, metric) on disjoint prompts. K is searched per node on
    the selection prompts (``_greedy_minimality_sets``: greedy from the empty set for
    ``greedy_steps`` steps, the best K seen kept, the empty one included) and measured on the
    measurement prompts.

    -> frame, one row per node in sender order: ``node``, ``removed`` (K's node names), ``size``,
    ``selection_score`` (the chosen K's score on the selection prompts), then on the measurement
    prompts ``difference`` = F(C\\K) - F(C\\(K+v)) (positive: v helps the metric) with ``ci_low,
    ci_high`` (95%, bootstrap over prompts), ``score`` = |difference| (Wang et al.'s criterion),
    ``n_prompts``. ``attrs``: ``chosen_on``, ``measured_on``, ``n_selection``. Cost: on the
    selection prompts 1 + nodes evaluations, then per step at most 2 x nodes x (nodes - 1), about
    nodes^2 / 2 at the first step (the sets {u} and {u, v} are shared by all v), all in one call per
    step; 2 x nodes on the measurement prompts."""
    with executing(memory_mb, progress):
        graph = full_graph(model)
        circuit = _check_masks(graph, [circuit])[0]
        _check_search(model, selection, measurement, greedy_steps)
        nodes = _search_nodes(graph, circuit)
        restricted = _Restricted(model, graph, [circuit])
        chosen, selection_scores, n_selection = _greedy_minimality_sets(nodes, restricted, selection, greedy_steps)
        sets = list(dict.fromkeys(s for v in nodes for s in (chosen[v], chosen[v] | {v})))
        index = {s: i for i, s in enumerate(sets)}
        found = restricted(measurement, sets)
        combination = np.zeros((len(nodes), len(sets)))
        for row, v in enumerate(nodes):  # F(C\K) - F(C\(K+v))
            combination[row, index[chosen[v]]] += 1.0
            combination[row, index[chosen[v] | {v}]] -= 1.0
        difference, low, high = found.interval(combination)
        frame = pd.DataFrame({"node": [node_name(v) for v in nodes],
                              "removed": [_names(graph, chosen[v]) for v in nodes],
                              "size": [len(chosen[v]) for v in nodes],
                              "selection_score": [selection_scores[v] for v in nodes], "difference": difference,
                              "ci_low": low, "ci_high": high, "score": np.abs(difference),
                              "n_prompts": found.n_prompts})
        frame.attrs.update(chosen_on="selection", measured_on="measurement", n_selection=n_selection)
        return frame


def full_graph_figure(curve: pd.DataFrame, title: str = "", x: str = "fraction"):
    """``faithfulness_curve``'s frame drawn: faithfulness (with its 95% band) against ``x``
    ("fraction" of the graph's edges kept, log scale, or "n_edges"), both positive; 0 and 1 (the
    corrupted and the clean model) marked, CPR and CMD in the legend."""
    if x not in ("fraction", "n_edges"):
        raise UserError(f"x must be 'fraction' or 'n_edges'; got {x!r}")
    figure = new_figure(figsize=(5, 3.5))
    ax = figure.subplots()
    label = f"CPR {curve.attrs.get('cpr', np.nan):.2f}, CMD {curve.attrs.get('cmd', np.nan):.2f}"
    ax.plot(curve[x], curve.faithfulness, marker="o", label=label)
    ax.fill_between(curve[x], curve.ci_low, curve.ci_high, alpha=0.25, linewidth=0)
    for level in (0.0, 1.0):
        ax.axhline(level, color="grey", linewidth=0.8, linestyle="--")
    ax.set_xscale("log")
    ax.set(xlabel="fraction of the graph's edges kept (top-k by |score|)" if x == "fraction" else
           "edges kept (top-k by |score|)", ylabel="faithfulness (0 corrupted, 1 clean)", title=title)
    ax.legend(loc="lower right")
    return figure
