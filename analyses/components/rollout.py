"""Attention rollout (Abnar & Zuidema 2020, "Quantifying Attention Flow in Transformers").

Each layer's attention, averaged over its heads, is mixed with the identity to stand for the
residual connection and its rows renormalised; the mixed matrices are multiplied through the
layers:

    Â_l = normalise_rows(w A_l + (1 - w) I),   A_l = mean over heads of the layer's pattern
    R_0 = Â_0,   R_l = Â_l R_{l-1}

so R_l[i, j] is how much of token j's information reaches position i after layer l, if the
only thing a layer did were to mix positions by its attention weights (w = 0.5 in the paper).

Attention flow (the paper's second method) reads the same mixed matrices as a graph: a node per
(layer, position), from each position before layer l to each after it an edge whose capacity is
Â_l[i, j]; F_l[i, j] is the maximum flow from token j at the input to position i after layer l.
Where rollout multiplies (every path counts, scaled by all its edges), flow is bounded by the
narrowest cut, so a token reached through many weak paths is not discounted to nothing; it costs a
max-flow per (layer, query, key), solved here by Edmonds-Karp (seconds for 64 tokens and 2 layers;
it grows with pos^2 x layers^2 max-flows, so keep prompts short).

What rollout and flow cannot tell: it ignores the value vectors and the output projection (a head that
attends strongly but writes nothing counts fully), the MLPs and layer norms, and it averages
heads, so one decisive head is diluted by the others. It is a description of where attention
*could* route information, not a measurement of what the model uses: for that, ablate or patch.
"""

from __future__ import annotations

import einops
import numpy as np
import torch
from matplotlib.figure import Figure

from analyses.core.hook_names import pattern_names
from analyses.core.plots import attention_grid
from analyses.core.execution import executing
from analyses.core.progress import progress_bar
from analyses.interventions.engine import cache_run
from interp.errors import UserError

ROLLOUT_NOTE = (
    "Attention rollout (Abnar & Zuidema 2020) multiplies each layer's head-averaged attention, mixed "
    "half-and-half with the identity for the residual stream, through the layers: entry (i, j) is how much "
    "of token j reaches position i if layers only moved information along attention weights. It ignores "
    "the value vectors, the output projections and the MLPs, and averages the heads, so it shows where "
    "information could flow, not what the model uses (ablation and patching measure that)."
)


def all_patterns(model, tokens: torch.Tensor) -> torch.Tensor:
    """tokens (pos,) -> every layer's attention (layer, head, q, k), from one forward that stops
    after the last layer's pattern."""
    names = pattern_names(model)
    _, cache = cache_run(model, tokens[None], names, logits=False)
    return torch.stack([cache[name][0] for name in names]).cpu()


def mixed_attention(patterns: torch.Tensor, attention_weight: float = 0.5) -> torch.Tensor:
    """patterns (..., layer, head, q, k) post-softmax attention -> Â (..., layer, q, k): the head-averaged
    attention mixed with the identity, ``w A + (1 - w) I`` (w = ``attention_weight``, the paper's 0.5),
    rows renormalised."""
    if not 0.0 <= attention_weight <= 1.0:
        raise UserError(f"attention_weight={attention_weight} must be in [0, 1]")
    mean = einops.reduce(patterns.float(), "... l h q k -> ... l q k", "mean")
    eye = torch.eye(mean.shape[-1], dtype=mean.dtype, device=mean.device)
    mixed = attention_weight * mean + (1 - attention_weight) * eye
    return mixed / mixed.sum(dim=-1, keepdim=True)


def attention_rollout(patterns: torch.Tensor, attention_weight: float = 0.5) -> torch.Tensor:
    """patterns (..., layer, head, q, k) post-softmax attention -> rollout (..., layer, q, k):
    entry [l] is the product through layers 0..l of ``mixed_attention``."""
    mixed = mixed_attention(patterns, attention_weight)
    layers = [mixed[..., 0, :, :]]
    for layer in range(1, mixed.shape[-3]):
        layers.append(mixed[..., layer, :, :] @ layers[-1])
    return torch.stack(layers, dim=-3)


def attention_flow(patterns: torch.Tensor, attention_weight: float = 0.5, *, progress: bool | None = None) -> torch.Tensor:
    """patterns (layer, head, q, k) post-softmax attention of one prompt -> flow (layer, q, k): entry
    [l, i, j] is the maximum flow from token j at the input to position i after layer l through the
    graph whose capacities are ``mixed_attention`` (module docstring). ``progress``: the execution's
    (``analyses.core.execution``; None: the current one's)."""
    if patterns.ndim != 4:
        raise UserError(f"attention flow takes one prompt's patterns (layer, head, q, k), got {tuple(patterns.shape)}")
    mixed = mixed_attention(patterns, attention_weight).cpu().double().numpy()
    n_layers, n_pos = mixed.shape[0], mixed.shape[-1]
    flow = np.zeros((n_layers, n_pos, n_pos))
    with executing(progress=progress):
        for layer in progress_bar(range(n_layers), desc="attention flow", unit="layer"):
            capacity = _layered_capacity(mixed[:layer + 1])
            for query in range(n_pos):
                for key in range(n_pos):
                    flow[layer, query, key] = max_flow(capacity, key, (layer + 1) * n_pos + query)
    return torch.from_numpy(flow).float()


def flow_into(patterns: torch.Tensor, query: int, attention_weight: float = 0.5) -> torch.Tensor:
    """patterns (layer, head, q, k) of one prompt -> (k,): the maximum flow from each token at the input
    to position ``query`` after the last layer, ``attention_flow(patterns)[-1, query]`` without the
    other layers and queries (one max-flow per key instead of layer x q x k)."""
    if patterns.ndim != 4 or not 0 <= query < patterns.shape[-1]:
        raise UserError(f"flow_into takes one prompt's patterns (layer, head, q, k) and a query in range, got "
                        f"{tuple(patterns.shape)} and query {query}")
    mixed = mixed_attention(patterns, attention_weight).cpu().double().numpy()
    n_layers, n_pos = mixed.shape[0], mixed.shape[-1]
    capacity = _layered_capacity(mixed)
    return torch.tensor([max_flow(capacity, key, n_layers * n_pos + query) for key in range(n_pos)]).float()


def _layered_capacity(mixed: np.ndarray) -> np.ndarray:
    """mixed (layer, q, k) -> the (V, V) capacity matrix of the attention graph, V = (layer + 1) * pos:
    node t * pos + p is position p before layer t (t = layer: after the last); the edge from
    (t, k) to (t + 1, q) carries mixed[t, q, k]."""
    n_layers, n_pos = mixed.shape[0], mixed.shape[-1]
    capacity = np.zeros(((n_layers + 1) * n_pos, (n_layers + 1) * n_pos))
    for t in range(n_layers):
        capacity[t * n_pos:(t + 1) * n_pos, (t + 1) * n_pos:(t + 2) * n_pos] = mixed[t].T
    return capacity


def max_flow(capacity: np.ndarray, source: int, sink: int, tolerance: float = 1e-12) -> float:
    """The maximum flow from ``source`` to ``sink`` through a graph of edge capacities ``capacity``
    (V, V) (Edmonds-Karp: shortest augmenting paths, found by breadth-first search)."""
    residual = capacity.copy()
    total = 0.0
    while True:
        parent = np.full(len(residual), -1)
        parent[source] = source
        frontier = [source]
        while frontier and parent[sink] < 0:
            reached = []
            for node in frontier:
                step = np.nonzero((residual[node] > tolerance) & (parent < 0))[0]
                parent[step] = node
                reached.extend(step.tolist())
            frontier = reached
        if parent[sink] < 0:
            return total
        path, node = [], sink
        while node != source:
            path.append((parent[node], node))
            node = parent[node]
        bottleneck = min(residual[u, v] for u, v in path)
        for u, v in path:
            residual[u, v] -= bottleneck
            residual[v, u] += bottleneck
        total += bottleneck


def model_rollout(model, tokens: torch.Tensor, attention_weight: float = 0.5) -> torch.Tensor:
    """Attention rollout of a hooked model on tokens (pos,) -> (layer, q, k)."""
    return attention_rollout(all_patterns(model, tokens), attention_weight)


def model_flow(model, tokens: torch.Tensor, attention_weight: float = 0.5) -> torch.Tensor:
    """Attention flow of a hooked model on tokens (pos,) -> (layer, q, k)."""
    return attention_flow(all_patterns(model, tokens), attention_weight)


def rollout_figure(rolled: torch.Tensor, str_tokens: list[str], kind: str = "attention rollout") -> Figure:
    """rolled (layer, q, k) -> the rollout (or, with ``kind="attention flow"``, the flow) after the
    first, a middle and the last layer."""
    n_layers = rolled.shape[0]
    layers = sorted({0, n_layers // 2, n_layers - 1})
    shown = rolled[layers]
    # the identity mixing makes the diagonal dominate: the colour scale stops at the largest
    # off-diagonal value (the diagonal saturates), so the flow between tokens stays visible
    off_diagonal = float((shown * (1 - torch.eye(shown.shape[-1]))).max())
    titles = [f"{kind.split()[-1]} after layer {layer}" for layer in layers]
    return attention_grid(shown, str_tokens, titles, vmax=off_diagonal if off_diagonal > 0 else 1.0,
                          suptitle=f"{kind} (colour scale capped at the largest off-diagonal value)")
