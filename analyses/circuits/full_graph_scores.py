"""Rankings of the full graph's edges and nodes, and the circuits each finds compared as Hanna et al.
(2024) compare them: by the full-graph faithfulness of each method's circuits over circuit sizes.

**EAP and EAP-IG on every edge** (``full_graph_edge_scores``). The graph is ``full_graph(model)``'s
(the input, heads, MLPs -> later heads' q/k/v inputs, later MLPs' inputs, the logits). An edge
s -> r is scored as Hanna et al. score it:

    score(s -> r) = sum over batch, pos of (corrupted - clean output of s) . d metric / d (r's input)

the metric the mean over prompts, so the score is the first-order estimate of what removing that
edge alone from the full circuit does in ``full_graph.circuit_scores`` (the edge carries the
corrupted run's output of s, every other edge its current one): m(full minus the edge) - m(full),
the same sign and direction (noising). EAP takes the gradient at the clean run; EAP-IG (``steps``)
averages it over ``steps`` runs whose input (the residual entering block 0: the token and position
embeddings) lies on the line from the corrupted run's to the clean run's, at corrupted + k / steps
(clean - corrupted) for k = 0 .. steps - 1: Hanna et al.'s "inputs" variant (their
``get_scores_eap_ig``; the other senders' outputs are the clean and corrupted runs' own, not
interpolated). Each run is one forward and one backward with every query head's q, k and v input
its own copy (``GPTModel.set_split_qkv_inputs``); an MLP's input gets its own gradient by adding a
zero tensor to ``resid_mid`` and taking it back out of ``resid_post`` (the MLP alone reads it, as the
full-graph evaluation edits it); the logits' input is the residual leaving the last block. Each
receiver input's gradient is multiplied into the senders' differences as the backward reaches it
(a (senders x receivers) table per chunk), so no gradient is kept. Chunked over prompts within
``memory_mb`` (``gradient_parts``; the chunks' tables weighted by their share of the metric).

**Exact node patching** (``node_patching``): each head's and MLP's output replaced by the corrupted
run's (``patch_effects``, noising), which is exactly removing every edge out of that node from the
full circuit (``Graph.without``); one forward per node. ``NodeRanking`` turns it into circuits of the
top-n nodes by |effect| (``circuit_from_nodes``), n the largest whose circuit has at most the size
asked. Exact single-edge removal is not used for a ranking: it costs one full-graph forward per edge
(SmolLM2-135M: 123,211 edges, about 0.5 s of one CPU thread per prompt each).

**The comparison** (``compare_circuit_methods``): for each method's ranking, its circuits at MIB's
fractions of the graph's edges (``EdgeRanking``: the top-k edges by |score|; ``NodeRanking``: the
top nodes), all evaluated in one full-graph call on the same prompts (the same bootstrap resamples),
faithfulness with its 95% interval, CPR and CMD with theirs, and the smallest evaluated circuit whose
interval's lower bound reaches ``threshold`` (optionally refined by ``refine`` sizes between the last
curve point below it and the first above).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations
from typing import Mapping, Sequence

import numpy as np
import pandas as pd
import torch
from einops import einsum

from analyses.circuits.edge_attribution import split_qkv_inputs
from analyses.circuits.edges import QKV
from analyses.circuits.full_graph import (MIB_FRACTIONS, Graph, Node, area_intervals, check_fractions,
                                          circuit_from_nodes, curve_areas, evaluate_faithfulness, full_graph,
                                          node_name, top_edge_circuits)
from analyses.core.execution import executing
from analyses.core.hook_names import mlp_out_name, qkv_input_name, resid_mid_name, resid_pre_name, z_name
from analyses.core.metrics import Metric, evaluate_metric
from analyses.core.plots import new_figure
from analyses.core.progress import progress_bar
from analyses.interventions.engine import cache_run, gradient_parts
from analyses.interventions.patching import base_and_source, patch_effects
from interp.errors import UserError

THRESHOLD = 0.7  # the target: the smallest circuit whose faithfulness interval's lower bound reaches it
IG_STEPS = 5  # Hanna et al. (2024) find 5 steps enough for EAP-IG (inputs)


# ---------------------------------------------------------------- EAP and EAP-IG on the full graph
def sender_outputs(model, graph: Graph, tokens: torch.Tensor) -> torch.Tensor:
    """Every sender's output in the plain run of ``tokens`` (batch, pos) -> (senders, batch, pos,
    d_model) float32, in ``graph.senders`` order: the residual entering block 0, each head's z
    through its ``W_O``, each MLP's ``hook_mlp_out``."""
    zs = [z_name(layer) for layer in range(graph.n_layers)]
    mlps = [mlp_out_name(layer) for layer in range(graph.n_layers)] if graph.mlps else []
    _, cache = cache_run(model, tokens, [resid_pre_name(0), *zs, *mlps], logits=False)
    outputs = [cache[resid_pre_name(0)].float()[None]]
    for layer in range(graph.n_layers):
        w_o = model.blocks[layer].attn.W_O.detach().float()
        outputs.append(einsum(cache[zs[layer]].float(), w_o, "b p h e, h e d -> h b p d"))
        if graph.mlps:
            outputs.append(cache[mlps[layer]].float()[None])
    return torch.cat(outputs)


def _gradient_hooks(graph: Graph, start: torch.Tensor, diff: torch.Tensor, table: torch.Tensor) -> tuple[list, list]:
    """The hooks of one scoring forward -> (hooks, leaves to differentiate). The residual entering
    block 0 becomes ``start`` (batch, pos, d_model), a leaf; each receiver input registers a gradient
    hook that adds (its senders' rows of ``diff`` (senders, batch, pos, d_model)) . (its gradient),
    summed over batch and positions, into its column of ``table`` (senders, receivers) float32."""
    H, last = graph.n_heads, graph.n_layers - 1
    leaf = start.detach().clone().requires_grad_(True)
    leaves, deltas = [leaf], {}

    def absorb(first_receiver: int, n_senders: int):
        def on_grad(grad):  # (batch, pos, head, d_model) for q/k/v inputs, (batch, pos, d_model) otherwise
            grad = grad.float().reshape(*grad.shape[:2], -1, grad.shape[-1])
            receivers = slice(first_receiver, first_receiver + grad.shape[2])
            table[:n_senders, receivers] += diff[:n_senders].flatten(1) @ grad.permute(2, 0, 1, 3).flatten(1).T
        return on_grad

    def enter(resid, hook):
        return leaf.to(resid.dtype)

    def at_input(layer, which):
        def hook(inputs, hook):
            inputs.register_hook(absorb(graph.first_receiver(layer) + which * H, graph.first_sender(layer)))
        return hook

    def at_resid_mid(layer):
        def hook(resid, hook):  # a zero the MLP alone reads: its gradient is the MLP input's
            deltas[layer] = torch.zeros_like(resid, requires_grad=True)
            deltas[layer].register_hook(absorb(graph.first_receiver(layer) + 3 * H, graph.first_sender(layer) + H))
            leaves.append(deltas[layer])
            return resid + deltas[layer]
        return hook

    def at_resid_post(layer):
        def hook(resid, hook):
            if layer in deltas:
                resid = resid - deltas[layer]
            if layer == last:
                resid = resid.view_as(resid)
                resid.register_hook(absorb(graph.first_receiver(graph.n_layers), len(graph.senders)))
            return resid
        return hook

    hooks = [(resid_pre_name(0), enter)]
    for layer in range(graph.n_layers):
        hooks += [(qkv_input_name(layer, which), at_input(layer, i)) for i, which in enumerate(QKV)]
        if graph.mlps:
            hooks.append((resid_mid_name(layer), at_resid_mid(layer)))
        hooks.append((f"blocks.{layer}.hook_resid_post", at_resid_post(layer)))
    return hooks, leaves


def _scored_run(model, graph: Graph, tokens: torch.Tensor, metric: Metric, positions: torch.Tensor | None,
                start: torch.Tensor, diff: torch.Tensor, table: torch.Tensor) -> None:
    """One forward of ``tokens`` from the input ``start`` and its backward, every edge's
    diff . gradient added into ``table`` (``_gradient_hooks``)."""
    hooks, leaves = _gradient_hooks(graph, start, diff, table)
    with torch.enable_grad(), split_qkv_inputs(model, QKV), model.hooks(fwd_hooks=hooks):
        final = model(tokens, stop_at_layer=graph.n_layers)
        value = evaluate_metric(metric, model.unembed(final if positions is None else final[:, positions]))
        torch.autograd.grad(value, leaves)


def _per_position(model, graph: Graph) -> int:
    """What one position holds beyond a plain forward and backward: the senders' differences (and
    both runs' outputs while they are made) and the per-head q/k/v copies with their norms and gradients."""
    cfg = model.cfg
    return 3 * len(graph.senders) * cfg.d_model + 4 * 3 * cfg.n_heads * cfg.d_model * cfg.n_layers


def full_graph_edge_scores(model, clean, corrupted, metric: Metric, *, steps: int | None = None,
                           memory_mb: float | None = None, progress: bool | None = None) -> pd.DataFrame:
    """EAP (``steps=None``) or EAP-IG (``steps`` points, Hanna et al.'s inputs variant) score of
    every edge of ``full_graph(model)`` (the module docstring) -> ``graph.edges`` (one row per edge,
    in mask order) with ``score``: the first-order estimate of m(full circuit minus that edge) -
    m(full) in the metric's units; ``attrs["method"]`` "EAP" or "EAP-IG", ``attrs["steps"]``. Its
    ``score`` column is what ``faithfulness_curve`` and ``EdgeRanking`` take. ``clean`` /
    ``corrupted``: token ids (batch, pos) or texts of equal token lengths. Cost per chunk of prompts:
    the clean and the corrupted forward, then one forward and backward per point (EAP: one)."""
    with executing(memory_mb, progress) as execution:
        if steps is not None and (not isinstance(steps, int) or steps < 1):
            raise UserError(f"steps must be a positive integer (EAP-IG's points) or None (EAP); got {steps!r}")
        graph = full_graph(model)
        clean, corrupted = base_and_source(model, clean, corrupted, "noise")
        alphas = [1.0] if steps is None else [k / steps for k in range(steps)]  # 0: the corrupted input, 1: the clean
        parts, positions = gradient_parts(model, clean, metric, execution.memory_mb,
                                          per_position=_per_position(model, graph))
        total = torch.zeros(len(graph.senders), len(graph.receivers), dtype=torch.float64)
        method = "EAP" if steps is None else "EAP-IG"
        with progress_bar(total=len(parts) * len(alphas), progress=execution.progress,
                          desc=f"{method} on the full graph", leave=False) as bar:
            for part in parts:
                clean_out = sender_outputs(model, graph, clean[part.rows])
                diff = sender_outputs(model, graph, corrupted[part.rows]) - clean_out
                table = torch.zeros(len(graph.senders), len(graph.receivers), dtype=torch.float32, device=diff.device)
                for alpha in alphas:
                    start = torch.lerp(clean_out[0] + diff[0], clean_out[0], alpha)
                    _scored_run(model, graph, clean[part.rows], part.metric, positions, start, diff, table)
                    bar.update(1)
                total += part.share * table.cpu().double() / len(alphas)
        frame = graph.edges.copy()
        frame["score"] = total.cpu().numpy()[graph.valid]
        frame.attrs.update(method=method, steps=steps)
        return frame


# ---------------------------------------------------------------- exact node patching
def node_patching(model, clean, corrupted, metric: Metric, *, memory_mb: float | None = None,
                  progress: bool | None = None, seed: int = 0) -> pd.DataFrame:
    """Each head's and MLP's exact removal from the full circuit: the clean run with that node's
    output taken from the corrupted run (``patch_effects``, noising) -> frame ``node`` ("L3H1",
    "MLP2"), ``kind, layer, head`` (the graph's node: head -1 for an MLP), ``effect`` (the patched
    metric minus the clean one) with ``ci_low, ci_high, n_prompts``, sorted by |effect|, largest first.
    ``memory_mb``, ``progress``: the execution's (``analyses.core.execution``; None: the current one's)."""
    graph = full_graph(model)
    with executing(memory_mb, progress):
        frames = [patch_effects(model, clean, corrupted, metric, "heads", direction="noise", seed=seed).assign(
            kind="head")]
        if graph.mlps:
            frames.append(patch_effects(model, clean, corrupted, metric, "mlps", direction="noise", seed=seed).assign(
                kind="mlp", head=-1))
    frame = pd.concat(frames, ignore_index=True)
    frame["node"] = [node_name((k, int(l), int(h))) for k, l, h in zip(frame.kind, frame.layer, frame["head"])]
    frame = frame.iloc[np.argsort(-frame.effect.abs().to_numpy(), kind="stable")].reset_index(drop=True)
    return frame[["node", "kind", "layer", "head", "effect", "ci_low", "ci_high", "n_prompts"]]


# ---------------------------------------------------------------- rankings -> circuits
@dataclass(frozen=True)
class EdgeRanking:
    """Edges ranked by |``scores``| (n_edges,), in ``full_graph(model).edges`` order."""

    scores: np.ndarray

    def circuits(self, graph: Graph, fractions: Sequence[float]) -> list[np.ndarray]:
        """The top-k edges, k = round(fraction * n_edges) for each of ``fractions``."""
        return top_edge_circuits(graph, self.scores, fractions)


@dataclass(frozen=True)
class NodeRanking:
    """Heads and MLPs ranked, most important first (``node_patching``'s order): circuits of the top nodes."""

    nodes: tuple[Node, ...]

    @classmethod
    def of(cls, frame: pd.DataFrame) -> "NodeRanking":
        """From ``node_patching``'s frame (its rows in rank order)."""
        return cls(tuple((k, int(l), int(h)) for k, l, h in zip(frame.kind, frame.layer, frame["head"])))

    def circuits(self, graph: Graph, fractions: Sequence[float]) -> list[np.ndarray]:
        """For each of ``fractions``: every edge among the top n nodes, the input and the logits
        (``circuit_from_nodes``), n the largest whose circuit has at most round(fraction * n_edges) edges."""
        nested = [circuit_from_nodes(graph, self.nodes[:n]) for n in range(len(self.nodes) + 1)]
        sizes = np.array([mask.sum() for mask in nested])
        limits = np.rint(np.asarray(fractions, dtype=float) * graph.n_edges)
        return [nested[int(np.flatnonzero(sizes <= limit).max(initial=0))] for limit in limits]


Ranking = EdgeRanking | NodeRanking


# ---------------------------------------------------------------- the comparison
def _evaluate(model, clean, corrupted, metric: Metric, circuits: list[np.ndarray]):
    """``evaluate_faithfulness`` of the distinct masks among ``circuits``, within the current
    execution -> (Faithfulness, index of each circuit's mask in it)."""
    unique: dict[bytes, int] = {}
    index = [unique.setdefault(np.packbits(mask).tobytes(), len(unique)) for mask in circuits]
    distinct = [None] * len(unique)
    for mask, i in zip(circuits, index):
        distinct[i] = mask
    return evaluate_faithfulness(model, clean, corrupted, metric, distinct), np.array(index)


def _rows(found, index: np.ndarray, methods: list[str], targets: list[float], circuits: list[np.ndarray],
          n_edges: int, on_curve: bool) -> pd.DataFrame:
    estimate, low, high = found.interval()
    sizes = np.array([int(mask.sum()) for mask in circuits])
    return pd.DataFrame({"method": methods, "target": targets, "fraction": sizes / n_edges, "n_edges": sizes,
                         "value": found.values[index], "faithfulness": estimate[index], "ci_low": low[index],
                         "ci_high": high[index], "n_prompts": found.n_prompts, "on_curve": on_curve})


def _smallest(rows: pd.DataFrame, threshold: float) -> pd.Series | None:
    """The row of fewest edges whose ``ci_low`` reaches ``threshold`` (None if none does)."""
    passing = rows[rows.ci_low >= threshold]
    return None if passing.empty else passing.sort_values(["n_edges", "fraction"], kind="stable").iloc[0]


def compare_circuit_methods(model, clean, corrupted, metric: Metric, rankings: Mapping[str, Ranking],
                            fractions: Sequence[float] = MIB_FRACTIONS, *, threshold: float = THRESHOLD,
                            refine: int = 0, memory_mb: float | None = None,
                            progress: bool | None = None) -> pd.DataFrame:
    """Each ranking's circuits at ``fractions`` of ``full_graph(model)``'s edges evaluated on the
    full graph (one call for all: the same prompts and bootstrap resamples) -> frame ``method``,
    ``target`` (the fraction asked), ``fraction`` (the fraction kept), ``n_edges``, ``value`` (the
    metric), ``faithfulness`` with ``ci_low, ci_high`` (95%, over prompts), ``n_prompts``,
    ``on_curve`` (False for the ``refine`` extra sizes, geometric between the last curve point whose
    ``ci_low`` is below ``threshold`` and the first at or above it, evaluated in a second call).
    ``attrs["summary"]``: per method ``cpr``, ``cpr_low``, ``cpr_high``, ``cmd``, ``cmd_low``,
    ``cmd_high`` (MIB's areas over the curve points, ``curve_areas``, with their intervals) and the
    smallest evaluated circuit with ``ci_low >= threshold``: ``smallest_edges``, ``smallest_share`` (of
    the graph's edges), ``smallest_faithfulness``, ``smallest_ci_low``, ``smallest_ci_high`` (NaN where
    none reaches it); ``attrs``: ``full``, ``empty`` (the clean and corrupted metric), ``graph_edges``,
    ``threshold``, ``paired`` (``paired_differences``: each two methods' faithfulness at each curve
    point, a's minus b's, with the interval of that difference)."""
    if not rankings:
        raise UserError("compare_circuit_methods needs at least one ranking (EdgeRanking or NodeRanking)")
    for name, ranking in rankings.items():
        if not isinstance(ranking, (EdgeRanking, NodeRanking)):
            raise UserError(f"ranking {name!r} must be an EdgeRanking or a NodeRanking; got {type(ranking).__name__}")
    if refine < 0:
        raise UserError(f"refine must be 0 or more extra sizes; got {refine}")
    with executing(memory_mb, progress):
        graph = full_graph(model)
        fractions = check_fractions(fractions)
        names = list(rankings)
        circuits = [mask for name in names for mask in rankings[name].circuits(graph, fractions)]
        methods = [name for name in names for _ in fractions]
        targets = [float(f) for _ in names for f in fractions]
        found, index = _evaluate(model, clean, corrupted, metric, circuits)
        curve = _rows(found, index, methods, targets, circuits, graph.n_edges, True)
        summary = []
        extra: dict[str, np.ndarray] = {}
        for name in names:
            rows = curve[curve.method == name]
            estimate = rows.faithfulness.to_numpy()
            cpr, cmd = curve_areas(rows.fraction.to_numpy(), estimate)
            of_name = index[(curve.method == name).to_numpy()]
            resampled = None if found.resampled is None else found.resampled[:, of_name]
            areas = area_intervals(rows.fraction.to_numpy(), resampled)
            summary.append({"method": name, "cpr": float(cpr), "cpr_low": areas["cpr_ci"][0],
                            "cpr_high": areas["cpr_ci"][1], "cmd": float(cmd), "cmd_low": areas["cmd_ci"][0],
                            "cmd_high": areas["cmd_ci"][1]})
            passing = np.flatnonzero(rows.ci_low.to_numpy() >= threshold)
            if refine and len(passing) and passing[0] > 0:
                extra[name] = np.geomspace(fractions[passing[0] - 1], fractions[passing[0]], refine + 2)[1:-1]
        frame = curve
        if extra:
            more = [mask for name, points in extra.items() for mask in rankings[name].circuits(graph, points)]
            found_more, more_index = _evaluate(model, clean, corrupted, metric, more)
            frame = pd.concat([curve, _rows(found_more, more_index, [n for n, p in extra.items() for _ in p],
                                            [float(f) for p in extra.values() for f in p], more, graph.n_edges, False)],
                              ignore_index=True)
        for row in summary:
            best = _smallest(frame[frame.method == row["method"]], threshold)
            row.update(smallest_edges=np.nan if best is None else int(best.n_edges),
                       smallest_share=np.nan if best is None else float(best.fraction),
                       smallest_faithfulness=np.nan if best is None else float(best.faithfulness),
                       smallest_ci_low=np.nan if best is None else float(best.ci_low),
                       smallest_ci_high=np.nan if best is None else float(best.ci_high),
                       n_prompts=found.n_prompts)
        frame.attrs.update(summary=pd.DataFrame(summary), full=found.full, empty=found.empty, graph_edges=graph.n_edges,
                           threshold=threshold, paired=paired_differences(found, index, names, fractions))
        return frame


def paired_differences(found, index: np.ndarray, names: list[str], fractions: Sequence[float]) -> pd.DataFrame:
    """Each two rankings' faithfulness at each curve point compared on the same prompts: one row per
    (``a``, ``b``, ``target``) with ``difference`` (a's minus b's) and the 95% interval of that
    difference (``ci_low``, ``ci_high``) from the one set of prompt resamples both were measured on
    (``Faithfulness.interval`` of +1 / -1), not from the two marginal intervals; NaN without a
    per-prompt metric. ``index``: each (method, fraction) circuit's column in ``found``, method-major."""
    columns = index.reshape(len(names), len(fractions))
    rows, combination = [], []
    for (i, a), (j, b) in combinations(enumerate(names), 2):
        for k, target in enumerate(fractions):
            weights = np.zeros(len(found.estimates))
            weights[columns[i, k]] += 1.0
            weights[columns[j, k]] -= 1.0
            rows.append({"a": a, "b": b, "target": float(target)})
            combination.append(weights)
    frame = pd.DataFrame(rows, columns=["a", "b", "target"])
    if not rows:
        return frame.assign(difference=[], ci_low=[], ci_high=[])
    difference, low, high = found.interval(np.array(combination))
    return frame.assign(difference=difference, ci_low=low, ci_high=high)


def method_comparison_figure(frame: pd.DataFrame, title: str = ""):
    """``compare_circuit_methods``' frame drawn: each method's faithfulness (with its 95% band) against
    the fraction of the graph's edges kept (log scale), the curve points joined and the refinement
    points as open markers; 0, 1 and the threshold marked; CPR, CMD in the legend."""
    summary = frame.attrs.get("summary")
    figure = new_figure(figsize=(6, 4))
    ax = figure.subplots()
    for i, (name, rows) in enumerate(frame.groupby("method", sort=False)):
        colour = f"C{i}"
        curve = rows[rows.on_curve].sort_values("fraction")
        label = name
        if summary is not None:
            found = summary.set_index("method").loc[name]
            label = f"{name}: CPR {found.cpr:.2f}, CMD {found.cmd:.2f}"
        ax.plot(curve.fraction, curve.faithfulness, marker="o", ms=3, color=colour, label=label)
        ax.fill_between(curve.fraction, curve.ci_low, curve.ci_high, color=colour, alpha=0.2, linewidth=0)
        extra = rows[~rows.on_curve]
        if len(extra):
            ax.errorbar(extra.fraction, extra.faithfulness, yerr=[extra.faithfulness - extra.ci_low,
                                                                  extra.ci_high - extra.faithfulness],
                        fmt="o", mfc="none", color=colour, ms=4, linewidth=0.8)
    for level in (0.0, 1.0):
        ax.axhline(level, color="grey", linewidth=0.8, linestyle="--")
    ax.axhline(frame.attrs.get("threshold", THRESHOLD), color="grey", linewidth=0.8, linestyle=":")
    ax.set_xscale("log")
    ax.set(xlabel="fraction of the full graph's edges kept", ylabel="faithfulness (0 corrupted, 1 clean)",
           title=title)
    ax.legend(loc="best", fontsize=8)
    return figure


def rankings_for(model, clean, corrupted, metric: Metric, *, steps: int = IG_STEPS,
                 memory_mb: float | None = None, progress: bool | None = None) -> dict[str, Ranking]:
    """The three rankings Hanna et al. compare, on these prompts: "exact" (``node_patching``'s
    nodes), "EAP" and "EAP-IG" (``full_graph_edge_scores``, ``steps`` points). ``memory_mb``,
    ``progress``: the execution's (``analyses.core.execution``; None: the current one's)."""
    with executing(memory_mb, progress):
        nodes = node_patching(model, clean, corrupted, metric)
        eap = full_graph_edge_scores(model, clean, corrupted, metric)
        eap_ig = full_graph_edge_scores(model, clean, corrupted, metric, steps=steps)
    return {"exact": NodeRanking.of(nodes), "EAP": EdgeRanking(eap.score.to_numpy()),
            "EAP-IG": EdgeRanking(eap_ig.score.to_numpy())}

