"""Circuit discovery measured against a known circuit (architecture §4.10): a Tracr-compiled program, whose
true nodes and edges ``analyses.circuits.ground_truth`` reads from the compiler.

The task: every input of the program's length (or a seeded sample) is a clean prompt; its
corrupted twin is another clean prompt, drawn by a seeded derangement. The metric
(``output_metric``) is minus the mean squared distance of the outputs (positions 1.., every
output logit, or the value of a numerical program) from the clean run's: 0 on the clean run,
negative elsewhere, differentiable for the attribution methods.

Scores, each compared with the truth by ROC AUC (``roc_auc``: the probability that a true
component or edge outscores a false one, ties counting half; NaN where either class is empty):

- nodes (every head and every MLP): activation patching (``component_scores(method="patch")``,
  the corrupted run with one component's output from the clean run), mean and zero ablation (the
  clean run with one component's output replaced by its mean over the clean prompts, or zeros),
  each scored by the absolute change of the metric;
- edges between heads (q, k, v) and from heads to the logits, the edges ``analyses.path_patch``
  and ``analyses.circuits.edge_attribution`` define: exact path patching, EAP and EAP-IG
  (``analyses.circuits.path_patching.eap_ig``), scored by absolute effect. Edges into or out of MLPs are not scored by
  those tools; their truth is in ``ground_truth``'s frame, and the node scores cover MLPs.

Faithfulness (``faithfulness``): the metric with every component outside a circuit mean-ablated,
as a fraction of the way from everything ablated (0) to nothing ablated (1); the complement's is
the same with the circuit itself ablated (completeness asks it to be near 0). ``size_curve`` gives
it for each node method's top-k components, k = 0..all.
"""

from __future__ import annotations

import itertools
import time
from typing import Callable, Sequence

import numpy as np
import pandas as pd
import torch

from analyses.core.checks import check_choice
from analyses.core.metrics import Metric, PromptMeanMetric
from analyses.circuits.edges import KEY_COLUMNS
from analyses.circuits.path_patching import eap_ig, edge_attribution, path_patch
from analyses.core.plots import new_figure
from interp.errors import UserError
from interp.tracr import encode_inputs

Component = tuple[str, int, int]  # (kind, layer, head); an MLP's head is -1
NODE_METHODS = ("patch", "mean_ablate", "zero_ablate")
QKV = ("q", "k", "v")
GRAPH_EDGE_COLUMNS = ["sender_kind", "sender_layer", "sender_head", "receiver_kind", "receiver_layer", "receiver_head", "via"]
GRAPH_METHODS = {"patch": "edge patching (all)", "eap": "EAP (all)", "eap_ig": "EAP-IG (all)"}
EDGE_METHODS = {"path patching": path_patch, "EAP": edge_attribution, "EAP-IG": eap_ig}
PAIRINGS = ("every", "one")  # task_pairs(every=True) or one seeded derangement
METRIC_NAME = "minus the mean squared distance of the outputs from the clean run's (output_metric)"


def output_metric(clean_logits: torch.Tensor, per_row: bool = False) -> Metric | Callable[[torch.Tensor], torch.Tensor]:
    """logits (batch, pos, d_vocab_out) -> minus their mean squared distance from ``clean_logits``
    (same shape) over positions 1.. (position 0 is the start token's): a scalar (a
    ``PromptMeanMetric``, reading every position, not split), or with ``per_row`` one value per
    prompt (batch,), whose mean is the scalar."""
    clean = clean_logits.detach()

    def rows(logits: torch.Tensor) -> torch.Tensor:
        if logits.shape != clean.shape:
            raise UserError(f"output_metric: logits {tuple(logits.shape)} but the clean run's are {tuple(clean.shape)}")
        return -(logits[:, 1:] - clean[:, 1:]).pow(2).flatten(1).mean(1)

    return rows if per_row else PromptMeanMetric(rows)


def program_inputs(vocab: Sequence, length: int, max_prompts: int = 128, seed: int = 0) -> list[list]:
    """Every input of ``length`` tokens over ``vocab``, in order, or a seeded sample of
    ``max_prompts`` of them (kept in order) where there are more."""
    inputs = [list(row) for row in itertools.product(vocab, repeat=length)]
    if len(inputs) <= max_prompts:
        return inputs
    chosen = np.sort(np.random.default_rng(seed).choice(len(inputs), max_prompts, replace=False))
    return [inputs[i] for i in chosen]


def curve_figure(curves: pd.DataFrame, title: str = ""):
    """Faithfulness against circuit size, one line per node method (``evaluate_discovery``'s curves)."""
    import seaborn as sns
    figure = new_figure(figsize=(5, 3.5))
    ax = figure.subplots()
    sns.lineplot(data=curves, x="size", y="faithfulness", hue="method", marker="o", ax=ax)
    ax.set(xlabel="components kept (top-k by score)", ylabel="faithfulness", title=title)
    return figure


def task_pairs(tokens: torch.Tensor, seed: int = 0, every: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens (batch, pos) -> (clean, corrupted). One pair per prompt (``every`` False): the
    corrupted row i is clean row perm[i] of a seeded permutation with no fixed point (every
    prompt gets another one). Every ordered pair of two different prompts (``every``: batch *
    (batch - 1) rows, clean-major): the strongest corruption the prompts allow, since a component
    whose output differs between any two prompts differs in some pair."""
    if len(tokens) < 2:
        raise UserError("a patching task needs at least two prompts")
    if every:
        first, second = torch.cartesian_prod(torch.arange(len(tokens)), torch.arange(len(tokens))).T
        keep = first != second
        return tokens[first[keep]], tokens[second[keep]]
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(tokens), generator=generator)
    partner = torch.empty_like(order)
    partner[order] = order.roll(1)  # a cycle through the shuffled rows: nobody is their own partner
    return tokens, tokens[partner]


CONSTANT_TOLERANCE = 1e-5  # the converted model's own agreement with Tracr


def invisible_components(model, tokens: torch.Tensor, nodes: pd.DataFrame) -> pd.DataFrame:
    """The true components (``ground_truth``'s ``nodes``) whose output is the same on every prompt
    of ``tokens`` (batch, pos) -> frame ``kind, layer, head, component, op, constant, zero``: one row
    per true component, ``constant`` where its output (batch, pos, ...) equals the first prompt's
    on every prompt to ``CONSTANT_TOLERANCE`` (patching from another prompt and mean ablation
    cannot see it: the value put in is the value already there), ``zero`` where it is also zero
    (zero ablation cannot see it either). In Tracr: ``length`` and what is computed from it alone,
    on inputs of one length."""
    activations, rows = _activations(model, tokens), []
    for row in nodes[nodes.true].itertuples(index=False):
        act = activations[_hook((row.kind, row.layer, row.head))]
        act = act[:, :, row.head] if row.kind == "head" else act
        constant = bool((act - act[:1]).abs().max() <= CONSTANT_TOLERANCE)
        zero = constant and bool(act.abs().max() <= CONSTANT_TOLERANCE)
        rows.append((row.kind, row.layer, row.head, row.component, row.op, constant, zero))
    return pd.DataFrame(rows, columns=["kind", "layer", "head", "component", "op", "constant", "zero"])


def auc_bound(labels: Sequence[bool], invisible: Sequence[bool]) -> float:
    """The largest ROC AUC a method scoring |effect| can reach when the ``invisible`` true items
    score exactly 0 (their effect is nil): each ties at best with a false item scoring 0, so the
    bound is the AUC of the score 1 on the visible true items and 0 elsewhere."""
    labels, invisible = np.asarray(labels, dtype=bool), np.asarray(invisible, dtype=bool)
    return roc_auc((labels & ~invisible).astype(float), labels)


def components(model) -> list[Component]:
    """Every head, then the layer's MLP, layer by layer."""
    return [c for layer in range(model.cfg.n_layers)
            for c in [("head", layer, h) for h in range(model.cfg.n_heads)] + [("mlp", layer, -1)]]


def _hook(component: Component) -> str:
    kind, layer, _ = component
    return f"blocks.{layer}.attn.hook_z" if kind == "head" else f"blocks.{layer}.hook_mlp_out"


def _replace(component: Component, value: torch.Tensor):
    """A hook putting ``value`` (the hook's whole activation shape) in the component's slice."""
    def hook(activation, hook):
        if component[0] == "mlp":
            return value.expand_as(activation)
        activation = activation.clone()
        activation[:, :, component[2]] = value.expand_as(activation)[:, :, component[2]]
        return activation
    return hook


def _run(model, tokens: torch.Tensor, metric: Metric,
         replaced: Sequence[tuple[Component, torch.Tensor]]) -> torch.Tensor:
    """The metric (a scalar, or (batch,)) with each component's output replaced by its value."""
    return _run_hooks(model, tokens, metric, [(_hook(c), _replace(c, v)) for c, v in replaced])


def _effect(value: torch.Tensor, reference: torch.Tensor) -> float:
    """The change of a scalar metric (signed), or of a per-prompt metric the mean absolute change
    per prompt: changes of opposite sign in different pairs must not cancel (measured: on
    ``sort_freq`` over every pair of inputs, patching ``hist`` helps some pairs as much as it hurts
    others, and the change of the mean is exactly 0)."""
    change = value - reference
    return float(change) if change.ndim == 0 else float(change.abs().mean())


def _activations(model, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens)
    return {name: cache[name] for name in {_hook(c) for c in components(model)}}


def component_scores(model, clean: torch.Tensor, corrupted: torch.Tensor, metric: Metric,
                     method: str = "patch") -> pd.DataFrame:
    """|metric change| when one component's output is patched from the clean run into the
    corrupted one ("patch"), or replaced on the clean run by its mean over the clean prompts
    ("mean_ablate") or by zeros ("zero_ablate") -> frame ``kind, layer, head, score``, one row
    per component; for a per-prompt ``metric`` (batch,), the mean |change| per prompt (``_effect``). Patching and mean ablation cannot see a component whose output is the same on
    every prompt (in Tracr, ``length`` on inputs of one length); zero ablation can."""
    check_choice("node method", method, NODE_METHODS)
    clean_acts = _activations(model, clean)
    if method == "patch":
        base, values = corrupted, clean_acts
    else:
        scale = 0.0 if method == "zero_ablate" else 1.0
        base, values = clean, {name: scale * act.mean(0, keepdim=True) for name, act in clean_acts.items()}
    reference = _run(model, base, metric, [])
    rows = [(*c, abs(_effect(_run(model, base, metric, [(c, values[_hook(c)])]), reference)))
            for c in components(model)]
    return pd.DataFrame(rows, columns=["kind", "layer", "head", "score"])


def faithfulness(model, clean: torch.Tensor, metric: Metric, circuit: set[Component]) -> float:
    """The metric with every component outside ``circuit`` mean-ablated (over the clean prompts),
    from everything ablated (0) to nothing ablated (1); NaN where ablating everything leaves the
    metric where it was (the program's output is the same on every prompt, e.g. ``length`` on
    inputs of one length: there is nothing to be faithful to)."""
    means = {name: act.mean(0, keepdim=True) for name, act in _activations(model, clean).items()}
    everything = [(c, means[_hook(c)]) for c in components(model)]
    full, empty = float(_run(model, clean, metric, [])), float(_run(model, clean, metric, everything))
    if full == empty:
        return float("nan")
    kept = float(_run(model, clean, metric, [(c, v) for c, v in everything if c not in circuit]))
    return (kept - empty) / (full - empty)


def graph_edges(model) -> list[tuple[Component, Component, str]]:
    """Every edge of the full component graph, as ``ground_truth`` names them: (sender, receiver,
    via) for a head or MLP sender and a later head's q/k/v input, a later (or, for a head, the
    same layer's) MLP ("mlp"), or the unembedding (receiver ("logits", n_layers, -1))."""
    every, edges = components(model), []
    for sender in every:
        for receiver in every:
            later = receiver[1] > sender[1] or (receiver[1] == sender[1] and sender[0] == "head" and receiver[0] == "mlp")
            if later:
                edges += [(sender, receiver, via) for via in (QKV if receiver[0] == "head" else ("mlp",))]
        edges.append((sender, ("logits", model.cfg.n_layers, -1), "logits"))
    return edges


def _writes(model, clean: torch.Tensor, base: torch.Tensor) -> dict[Component, torch.Tensor]:
    """Each component's clean-minus-base write to the residual (batch, pos, d_model)."""
    clean_acts, base_acts = _activations(model, clean), _activations(model, base)
    writes = {}
    for component in components(model):
        kind, layer, head = component
        moved = clean_acts[_hook(component)] - base_acts[_hook(component)]
        writes[component] = moved[:, :, head] @ model.blocks[layer].attn.W_O[head].detach() if kind == "head" else moved
    return writes


def _input_hooks(model, deltas: dict[tuple[Component, str], torch.Tensor]) -> list:
    """Hooks adding ``deltas[(receiver, via)]`` (batch, pos, d_model) to that one input: a head's
    own q/k/v input (per-head inputs must be on), an MLP's input (added to ``resid_mid``, taken
    back out of ``resid_post``: with no norm the MLP alone sees it), or the unembedding's."""
    hooks = []
    for (receiver, via), delta in deltas.items():
        kind, layer, head = receiver
        if kind == "head":
            def add_to_head(inputs, hook, head=head, delta=delta):
                return inputs + torch.nn.functional.one_hot(torch.tensor(head), inputs.shape[2]).to(inputs)[:, None] * delta[:, :, None]
            hooks.append((f"blocks.{layer}.hook_{via}_input", add_to_head))
        elif kind == "mlp":
            hooks.append((f"blocks.{layer}.hook_resid_mid", lambda resid, hook, delta=delta: resid + delta))
            hooks.append((f"blocks.{layer}.hook_resid_post", lambda resid, hook, delta=delta: resid - delta))
        else:
            hooks.append((f"blocks.{model.cfg.n_layers - 1}.hook_resid_post", lambda resid, hook, delta=delta: resid + delta))
    return hooks


def graph_edge_scores(model, clean: torch.Tensor, corrupted: torch.Tensor, metric: Metric, method: str = "patch",
                      steps: int = 5) -> pd.DataFrame:
    """Every edge of ``graph_edges`` scored on the corrupted run (denoising) -> frame
    ``sender_kind, sender_layer, sender_head, receiver_kind, receiver_layer, receiver_head, via,
    score``. "patch": the metric change when the sender's clean-minus-corrupted write is added
    to that one receiver input (exact; one forward per edge; for head edges it is what
    ``path_patch`` computes; for a per-prompt ``metric`` (batch,), the mean |change| per prompt,
    ``_effect``). "eap": that write dotted with the metric's gradient at the input (a per-prompt
    metric's mean), on the corrupted run (as ``edge_attribution``). "eap_ig": the gradient averaged over
    ``steps`` runs with input embeddings between the corrupted and clean ones (as ``eap_ig``).
    Requires a model without normalisation (a Tracr model): an MLP's input is edited through
    its residual."""
    if model.cfg.normalization_type is not None:
        raise UserError("graph_edge_scores edits an MLP's input through the residual, which needs a model without "
                        f"normalisation (a Tracr model); this one has {model.cfg.normalization_type}")
    check_choice("edge method", method, ("patch", "eap", "eap_ig"))
    edges, writes = graph_edges(model), _writes(model, clean, corrupted)
    saved = model.split_qkv_inputs
    model.set_split_qkv_inputs(QKV)
    try:
        if method == "patch":
            reference = _run_hooks(model, corrupted, metric, [])
            scores = [_effect(_run_hooks(model, corrupted, metric, _input_hooks(model, {(r, v): writes[s]})), reference)
                      for s, r, v in edges]
        else:
            grads = _input_gradients(model, clean, corrupted, metric, {(r, v) for _, r, v in edges},
                                     steps if method == "eap_ig" else 0)
            scores = [float((grads[(r, v)] * writes[s]).sum()) for s, r, v in edges]
    finally:
        model.set_split_qkv_inputs(saved)
    rows = [(*s, *r, v, score) for (s, r, v), score in zip(edges, scores)]
    return pd.DataFrame(rows, columns=GRAPH_EDGE_COLUMNS + ["score"])


def _run_hooks(model, tokens: torch.Tensor, metric: Metric, hooks: list) -> torch.Tensor:
    with torch.no_grad():
        return metric(model.run_with_hooks(tokens, fwd_hooks=hooks)).detach()


def _input_gradients(model, clean, corrupted, metric, inputs, steps: int) -> dict:
    """d metric / d (each receiver input) on the corrupted run (``steps=0``), or averaged over
    ``steps`` runs whose input embeddings are interpolated towards the clean ones."""
    first = "blocks.0.hook_resid_pre"
    _, clean_cache = model.run_with_cache(clean, names_filter=first)
    _, base_cache = model.run_with_cache(corrupted, names_filter=first)
    total = {key: 0.0 for key in inputs}
    for alpha in ([k / steps for k in range(1, steps + 1)] if steps else [0.0]):
        deltas = {key: torch.zeros_like(base_cache[first], requires_grad=True) for key in inputs}
        interpolate = (first, lambda resid, hook: torch.lerp(base_cache[first], clean_cache[first], alpha))
        with torch.enable_grad():
            value = metric(model.run_with_hooks(corrupted, fwd_hooks=[interpolate, *_input_hooks(model, deltas)])).mean()
            grads = torch.autograd.grad(value, list(deltas.values()), allow_unused=True)
        for key, grad in zip(deltas, grads):
            total[key] = total[key] + (0.0 if grad is None else grad) / max(steps, 1)
    return {key: grad if torch.is_tensor(grad) else torch.zeros_like(base_cache[first]) for key, grad in total.items()}


def roc_auc(scores: Sequence[float], labels: Sequence[bool]) -> float:
    """P(a true item outscores a false one), ties counting half (the Mann-Whitney form of the ROC
    AUC); NaN where there is no true or no false item."""
    scores, labels = np.asarray(scores, dtype=float), np.asarray(labels, dtype=bool)
    positive, negative = scores[labels], scores[~labels]
    if not len(positive) or not len(negative):
        return float("nan")
    wins = (positive[:, None] > negative[None, :]).sum() + 0.5 * (positive[:, None] == negative[None, :]).sum()
    return float(wins / (len(positive) * len(negative)))


def size_curve(model, clean: torch.Tensor, metric: Metric, scores: pd.DataFrame) -> pd.DataFrame:
    """Faithfulness of each top-k circuit by ``scores`` (``component_scores``'s frame; ties in
    component order) -> frame ``size, faithfulness``, k = 0..number of components."""
    ranked = scores.sort_values("score", ascending=False, kind="stable")
    order = list(zip(ranked.kind, ranked.layer, ranked["head"]))
    return pd.DataFrame([(k, faithfulness(model, clean, metric, set(order[:k]))) for k in range(len(order) + 1)],
                        columns=["size", "faithfulness"])


def evaluate_discovery(model, nodes: pd.DataFrame, edges: pd.DataFrame, clean: torch.Tensor,
                       corrupted: torch.Tensor, *, steps: int = 5) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Every method against the truth (``ground_truth``'s ``nodes`` and ``edges``) -> (scores:
    ``method, level, auc, bound, n_true, n_items, seconds, faithfulness, note``: a row per
    method, a method that refuses the model (``note`` "refused: ...", AUC NaN), then rows "true
    circuit" and "complement" with their ``faithfulness``; curves: ``method, size,
    faithfulness``). ``bound`` is the AUC no method of that row can beat on these prompts
    (``auc_bound``): the true components that ``invisible_components`` finds constant over the
    distinct clean prompts (for zero ablation: zero), and the true edges they send, score 0."""
    with torch.no_grad():
        clean_logits = model(clean)
    metric, row_metric = output_metric(clean_logits), output_metric(clean_logits, per_row=True)
    truth_nodes = {(k, l, h) for k, l, h, t in zip(nodes.kind, nodes.layer, nodes["head"], nodes.true) if t}
    hidden = invisible_components(model, torch.unique(clean, dim=0), nodes)
    constant = set(zip(hidden.kind[hidden.constant], hidden.layer[hidden.constant], hidden["head"][hidden.constant]))
    zero = set(zip(hidden.kind[hidden.zero], hidden.layer[hidden.zero], hidden["head"][hidden.zero]))
    rows, curves = [], []
    for method in NODE_METHODS:
        start = time.perf_counter()
        scores = component_scores(model, clean, corrupted, row_metric, method)
        seconds = time.perf_counter() - start
        keys = list(zip(scores.kind, scores.layer, scores["head"]))
        labels = [c in truth_nodes for c in keys]
        bound = auc_bound(labels, [c in (zero if method == "zero_ablate" else constant) for c in keys])
        rows.append((method, "node", roc_auc(scores.score, labels), bound, sum(labels), len(labels), seconds, np.nan, ""))
        curves.append(size_curve(model, clean, metric, scores).assign(method=method))
    head_edges = edges[(edges.sender_kind == "head") & edges.receiver_kind.isin(["head", "logits"])]
    true_edges = set(map(tuple, head_edges[KEY_COLUMNS].itertuples(index=False)))
    for name, method in EDGE_METHODS.items():
        start = time.perf_counter()
        options = {"steps": steps} if name == "EAP-IG" else {}
        try:
            frame = method(model, clean, corrupted, metric, **options)
        except UserError as refusal:  # e.g. the hook self-test finds a q/k edit that reaches no output
            rows.append((name, "edge", np.nan, np.nan, len(true_edges), np.nan, np.nan, np.nan, f"refused: {refusal}"))
            continue
        seconds = time.perf_counter() - start
        score = frame["effect"] if "effect" in frame else frame["attribution"]
        labels = [key in true_edges for key in map(tuple, frame[KEY_COLUMNS].itertuples(index=False))]
        bound = auc_bound(labels, [("head", *sender) in constant for sender in zip(frame.sender_layer, frame.sender_head)])
        rows.append((name, "edge", roc_auc(score.abs(), labels), bound, sum(labels), len(labels), seconds, np.nan, ""))
    truth_all = set(map(tuple, edges[GRAPH_EDGE_COLUMNS].itertuples(index=False)))
    for method, name in GRAPH_METHODS.items():
        start = time.perf_counter()
        frame = graph_edge_scores(model, clean, corrupted, row_metric, method, steps)
        seconds = time.perf_counter() - start
        labels = [key in truth_all for key in map(tuple, frame[GRAPH_EDGE_COLUMNS].itertuples(index=False))]
        bound = auc_bound(labels, [s in constant for s in zip(frame.sender_kind, frame.sender_layer, frame.sender_head)])
        rows.append((name, "edge (all)", roc_auc(frame.score.abs(), labels), bound, sum(labels), len(labels), seconds,
                     np.nan, ""))
    every = set(components(model))
    for name, circuit in (("true circuit", truth_nodes), ("complement", every - truth_nodes)):
        value = faithfulness(model, clean, metric, circuit)
        note = "undefined: the output is the same on every prompt" if np.isnan(value) else ""
        rows.append((name, "circuit", np.nan, np.nan, len(circuit), len(every), np.nan, value, note))
    columns = ["method", "level", "auc", "bound", "n_true", "n_items", "seconds", "faithfulness", "note"]
    return pd.DataFrame(rows, columns=columns), pd.concat(curves, ignore_index=True)[["method", "size", "faithfulness"]]


def known_task(model, truth) -> tuple[torch.Tensor, torch.Tensor]:
    """The (clean, corrupted) prompts (batch, pos) of a stored truth's task
    (``analyses.circuits.ground_truth.KnownTruth``): its inputs, paired as ``task["pairs"]`` says."""
    task = truth.task
    if task["pairs"] not in PAIRINGS:
        raise UserError(f"the stored task pairs its inputs as {task['pairs']!r}; allowed: {', '.join(PAIRINGS)}")
    grid = {(k, l, h) for k, l, h in zip(truth.nodes.kind, truth.nodes.layer, truth.nodes["head"])}
    if grid != set(components(model)):
        raise UserError(f"the stored truth names {len(grid)} components, not the {len(components(model))} heads and "
                        f"MLPs of this {model.cfg.n_layers}-layer, {model.cfg.n_heads}-head model")
    return task_pairs(encode_inputs(model, task["inputs"]), task["seed"], every=task["pairs"] == "every")


def evaluate_known(model, truth) -> tuple[pd.DataFrame, pd.DataFrame]:
    """``evaluate_discovery`` of ``model`` against a stored truth, on its stored task (``known_task``,
    EAP-IG with ``task["ig_steps"]``) -> (scores, curves) as ``evaluate_discovery`` returns them."""
    clean, corrupted = known_task(model, truth)
    return evaluate_discovery(model, truth.nodes, truth.edges, clean, corrupted, steps=truth.task["ig_steps"])
