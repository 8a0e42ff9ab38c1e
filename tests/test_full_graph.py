"""Circuits on the full graph (``analyses.circuits.full_graph``) against a brute-force evaluation written
here: a forward pass by hand in which every receiver input is the literal sum of the input, each earlier
sender's output (this run's where the edge is kept, the corrupted run's where not) and the output
biases, and each head's attention is computed from its own three inputs."""

from __future__ import annotations

import itertools

import numpy as np
import pandas as pd
import pytest
import torch

from analyses.circuits.full_graph import (circuit_faithfulness, circuit_from_edges, circuit_from_nodes, circuit_scores,
                                          completeness, curve_areas, faithfulness_curve, full_graph, full_graph_figure,
                                          minimality)
from analyses.core.metrics import logit_diff_metric, loss_metric
from analyses.core.stats import bootstrap_ratio
from interp import UserError
from interp.model import GPTConfig, GPTModel
from interp.weights import expand_kv_heads

CONFIGS = {"layernorm": {}, "rms_gqa": {"normalization_type": "RMS", "n_key_value_heads": 1, "act_fn": "silu",
                                        "gated_mlp": True}}


def tiny(n_layers: int = 3, seed: int = 0, **knobs) -> GPTModel:
    torch.manual_seed(seed)
    model = GPTModel(GPTConfig(d_vocab=300, n_ctx=16, d_model=16, n_heads=2, n_layers=n_layers, **knobs)).eval()
    with torch.no_grad():  # larger weights than the default init, so that corrupting an edge moves the logits
        for block in model.blocks:
            for linear in (block.attn.W_query, block.attn.W_key):
                linear.weight.mul_(3.0)
    return model


def prompts(n: int = 6, n_pos: int = 7, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randint(1, 300, (n, n_pos), generator=generator),
            torch.randint(1, 300, (n, n_pos), generator=generator))


# ---------------------------------------------------------------- the brute force
def naive_logits(model, tokens: torch.Tensor, kept: set | None = None, corrupted: dict | None = None):
    """A hand-written forward -> (logits (batch, pos, d_vocab), {sender node: its output}). Every
    receiver input is the sum over the senders that compute before it of their output in this run
    where the edge (sender, receiver node, via) is in ``kept`` (None: every edge), else their output in
    ``corrupted`` (a run of this function), plus the output biases of the layers before it."""
    cfg = model.cfg
    H, d_head = cfg.n_heads, cfg.d_head
    w_q, b_q, w_o, b_o = model.W_Q, model.b_Q, model.W_O, model.b_O
    w_k, w_v = expand_kv_heads(model.W_K, H), expand_kv_heads(model.W_V, H)
    b_k, b_v = expand_kv_heads(model.b_K, H), expand_kv_heads(model.b_V, H)
    n_pos = tokens.shape[1]
    outputs = {("input", -1, -1): model.W_E[tokens] * cfg.embed_scale + model.W_pos[:n_pos]}
    bias = torch.zeros(cfg.d_model)

    def receive(receiver, via):
        total = bias.clone()
        for sender, output in outputs.items():
            keep = kept is None or (*sender, *receiver, via) in kept
            total = total + (output if keep else corrupted[sender])
        return total

    causal = torch.ones(n_pos, n_pos).tril().bool()
    for layer, block in enumerate(model.blocks):
        writes = {}
        for h in range(H):
            node = ("head", layer, h)
            q = block.ln1(receive(node, "q")) @ w_q[layer, h] + b_q[layer, h]
            k = block.ln1(receive(node, "k")) @ w_k[layer, h] + b_k[layer, h]
            v = block.ln1(receive(node, "v")) @ w_v[layer, h] + b_v[layer, h]
            scores = (q @ k.transpose(-1, -2) / d_head ** 0.5).masked_fill(~causal, float("-inf"))
            writes[node] = scores.softmax(-1) @ v @ w_o[layer, h]
        outputs.update(writes)  # after every head of the layer has read its inputs
        bias = bias + b_o[layer]
        mlp = ("mlp", layer, -1)
        outputs[mlp] = block.mlp(block.ln2(receive(mlp, "mlp")))
    return model.unembed(receive(("logits", cfg.n_layers, -1), "logits")), outputs


def naive_run(model, clean, corrupted, kept_rows: pd.DataFrame | None):
    """Logits of the clean prompts with only the edges ``kept_rows`` (rows of ``graph.edges``) kept."""
    with torch.no_grad():
        _, source = naive_logits(model, corrupted)
        kept = None if kept_rows is None else set(kept_rows.itertuples(index=False, name=None))
        return naive_logits(model, clean, kept, source)[0]


def per_prompt_losses(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Each prompt's summed next-token loss (batch,): the loss metric's per-prompt numerators."""
    losses = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten(), reduction="none")
    return losses.view(len(tokens), -1).sum(1)


# ---------------------------------------------------------------- tests
def test_edge_count_and_receivers_by_hand():
    """L layers of H heads and an MLP: layer l's 3H q/k/v inputs read 1 + l(H + 1) senders, its MLP
    those and its own H heads, the logits all 1 + L(H + 1)."""
    model = tiny(n_layers=3)
    graph = full_graph(model)
    L, H = 3, 2
    expected = sum(3 * H * (1 + l * (H + 1)) + 1 + l * (H + 1) + H for l in range(L)) + 1 + L * (H + 1)
    assert graph.n_edges == expected == len(graph.edges) == 100
    into_mlp1 = graph.edges[(graph.edges.receiver_kind == "mlp") & (graph.edges.receiver_layer == 1)]
    assert set(zip(into_mlp1.sender_kind, into_mlp1.sender_layer)) == {("input", -1), ("head", 0), ("mlp", 0),
                                                                       ("head", 1)}
    attn_only = full_graph(tiny(n_layers=2, attn_only=True))
    assert attn_only.n_edges == 3 * H * 1 + 3 * H * (1 + H) + 1 + 2 * H


@pytest.mark.parametrize("config", CONFIGS)
def test_random_circuits_match_the_brute_force(config):
    model = tiny(**CONFIGS[config])
    clean, corrupted = prompts()
    graph = full_graph(model)
    rng = np.random.default_rng(0)
    masks = [rng.random(graph.n_edges) < p for p in (0.2, 0.5, 0.8, 0.95)]
    masks.append(circuit_from_nodes(graph, [("head", 0, 1), ("mlp", 1, -1), ("head", 2, 0)]))
    scores = circuit_scores(model, clean, corrupted, loss_metric(clean), masks, progress=False)
    naive = torch.stack([per_prompt_losses(naive_run(model, clean, corrupted, graph.edges[mask]), clean)
                         for mask in masks])
    torch.testing.assert_close(scores.numerators.float(), naive, atol=1e-5, rtol=1e-5)
    assert (naive - naive[:1]).abs().max() > 1e-2  # the circuits differ enough for the check to bite
    # chunked one prompt at a time: the same numbers
    chunked = circuit_scores(model, clean, corrupted, loss_metric(clean), masks, memory_mb=1e-3, progress=False)
    torch.testing.assert_close(chunked.numerators, scores.numerators, atol=1e-5, rtol=1e-5)


def test_node_circuit_keeps_the_edges_between_its_nodes():
    graph = full_graph(tiny(n_layers=2))
    mask = circuit_from_nodes(graph, [("head", 0, 0), ("mlp", 1, -1)])
    kept = set(graph.edges[mask].itertuples(index=False, name=None))
    nodes = {("input", -1, -1), ("head", 0, 0), ("mlp", 1, -1), ("logits", 2, -1)}
    expected = {row for row in graph.edges.itertuples(index=False, name=None)
                if tuple(row[:3]) in nodes and tuple(row[3:6]) in nodes}
    assert kept == expected and len(kept) == 3 + 2 + 3  # input->L0H0 q/k/v; into MLP1; into the logits
    assert (circuit_from_edges(graph, graph.edges[mask]) == mask).all()


@pytest.mark.parametrize("config", CONFIGS)
def test_the_ends_are_the_clean_and_the_corrupted_runs(config):
    model = tiny(**CONFIGS[config])
    clean, corrupted = prompts()
    graph = full_graph(model)
    answers = torch.arange(len(clean)) + 5
    metric = logit_diff_metric(answers, answers + 1)
    scores = circuit_scores(model, clean, corrupted, metric, [np.ones(graph.n_edges, bool),
                                                              np.zeros(graph.n_edges, bool)], progress=False)
    with torch.no_grad():
        for row, tokens in enumerate((clean, corrupted)):
            logits = model(tokens)[:, -1]
            expected = logits[torch.arange(len(tokens)), answers] - logits[torch.arange(len(tokens)), answers + 1]
            torch.testing.assert_close(scores.numerators[row].float(), expected, atol=1e-5, rtol=1e-5)
    assert (scores.numerators[0] - scores.numerators[1]).abs().max() > 1e-2


def test_faithfulness_and_its_interval_from_the_brute_force():
    model = tiny()
    clean, corrupted = prompts(n=8)
    graph = full_graph(model)
    mask = np.random.default_rng(3).random(graph.n_edges) < 0.6
    frame = circuit_faithfulness(model, clean, corrupted, loss_metric(clean), [mask], progress=False)
    losses = [per_prompt_losses(naive_run(model, clean, corrupted, rows), clean).double()
              for rows in (None, graph.edges.iloc[:0], graph.edges[mask])]
    full, empty, kept = losses
    expected, low, high = bootstrap_ratio((kept - empty)[:, None], full - empty)
    assert frame.faithfulness[0] == pytest.approx(float(expected[0]), abs=1e-4)
    assert (frame.ci_low[0], frame.ci_high[0]) == pytest.approx((float(low[0]), float(high[0])), abs=1e-3)
    n_counted = clean.shape[1] - 1
    assert frame.attrs["full"] == pytest.approx(float(full.mean()) / n_counted, abs=1e-5)
    assert frame.attrs["empty"] == pytest.approx(float(empty.mean()) / n_counted, abs=1e-5)
    assert frame.n_edges[0] == mask.sum() and frame.attrs["graph_edges"] == graph.n_edges


def test_curve_areas_by_hand():
    cpr, cmd = curve_areas([0.1, 0.5, 1.0], np.array([0.0, 0.5, 1.0]))
    assert cpr == pytest.approx(0.4 * 0.25 + 0.5 * 0.75)
    assert cmd == pytest.approx(0.4 * 0.75 + 0.5 * 0.25)
    cpr, cmd = curve_areas([0.2, 1.0], np.array([1.5, -0.5]))  # |1 - f| counts overshoot and undershoot alike
    assert (cpr, cmd) == pytest.approx((0.8 * 0.5, 0.8 * 1.0))


def test_curve_keeps_the_top_edges_by_absolute_score():
    model = tiny(n_layers=2)
    clean, corrupted = prompts()
    graph = full_graph(model)
    scores = np.random.default_rng(1).normal(size=graph.n_edges)
    fractions = (0.1, 0.3, 0.6, 1.0)
    curve = faithfulness_curve(model, clean, corrupted, loss_metric(clean), scores, fractions, progress=False)
    full, empty = (per_prompt_losses(naive_run(model, clean, corrupted, rows), clean).sum()
                   for rows in (None, graph.edges.iloc[:0]))
    ranked = np.argsort(-np.abs(scores))
    for row in curve.itertuples():
        k = int(round(row.fraction * graph.n_edges))
        assert k == row.n_edges == round(fractions[row.Index] * graph.n_edges)
        top = graph.edges.iloc[np.sort(ranked[:k])]
        value = per_prompt_losses(naive_run(model, clean, corrupted, top), clean).sum()
        assert row.faithfulness == pytest.approx(float((value - empty) / (full - empty)), abs=1e-4)
        assert row.ci_low <= row.faithfulness <= row.ci_high
    x, y = curve.fraction.to_numpy(), curve.faithfulness.to_numpy()
    assert curve.attrs["cpr"] == pytest.approx(float(np.sum(np.diff(x) * (y[1:] + y[:-1]) / 2)))
    assert curve.attrs["cmd"] == pytest.approx(float(np.sum(np.diff(x) * (abs(1 - y[1:]) + abs(1 - y[:-1])) / 2)))
    assert curve.attrs["cpr_ci"][0] <= curve.attrs["cpr"] <= curve.attrs["cpr_ci"][1]
    figure = full_graph_figure(curve, title="t")
    ax = figure.axes[0]
    assert ax.get_xscale() == "log" and min(ax.get_xlim()) > 0 and len(ax.lines[0].get_xdata()) == len(fractions)


def naive_restricted(model, clean, corrupted, graph, mask, removed: set) -> float:
    """The brute-force metric (summed loss) of ``mask`` without every edge out of ``removed``."""
    rows = graph.edges[mask]
    rows = rows[[(k, l, h) not in removed for k, l, h in zip(rows.sender_kind, rows.sender_layer, rows.sender_head)]]
    return float(per_prompt_losses(naive_run(model, clean, corrupted, rows), clean).sum())


def names_to_nodes(names: str) -> set:
    nodes = set()
    for name in filter(None, names.split(", ")):
        nodes.add(("mlp", int(name[3:]), -1) if name.startswith("MLP") else ("head", *map(int, name[1:].split("H"))))
    return nodes


def restricted_f(model, prompts_and_metric, graph, mask):
    """F(mask without K) by the brute force on one set of prompts, as a function of K: the summed
    loss, normalised between the fully corrupted and the clean run of those prompts."""
    clean, corrupted = prompts_and_metric[:2]
    every = np.ones(graph.n_edges, bool)
    full = naive_restricted(model, clean, corrupted, graph, every, set())
    empty = naive_restricted(model, clean, corrupted, graph, ~every, set())
    return lambda removed: (naive_restricted(model, clean, corrupted, graph, mask, set(removed)) - empty) / (full - empty)


def two_prompt_sets() -> tuple[tuple, tuple]:
    """Selection and measurement prompts (disjoint draws), each with its loss metric."""
    selection, measurement = prompts(seed=1), prompts(seed=2)
    return (*selection, loss_metric(selection[0])), (*measurement, loss_metric(measurement[0]))


def test_completeness_greedy_on_selection_measured_on_measurement():
    model = tiny(n_layers=2)
    selection, measurement = two_prompt_sets()
    graph = full_graph(model)
    nodes = [("head", 0, 1), ("mlp", 0, -1), ("head", 1, 0)]
    circuit = circuit_from_nodes(graph, nodes)
    every = np.ones(graph.n_edges, bool)
    frame = completeness(model, selection, measurement, circuit, greedy_steps=2, n_random=2, progress=False)
    assert list(frame.search) == ["greedy", "greedy", "random", "random"] and list(frame.step) == [1, 2, 0, 0]
    assert frame.attrs["chosen_on"] == "selection" and frame.attrs["measured_on"] == "measurement"
    # the greedy path, searched by the brute force on the selection prompts
    f_c, f_m = restricted_f(model, selection, graph, circuit), restricted_f(model, selection, graph, every)
    chosen = set()
    for step in (0, 1):
        gaps = {u: abs(f_c(chosen | {u}) - f_m(chosen | {u})) for u in nodes if u not in chosen}
        pick = max(gaps, key=gaps.get)
        chosen = chosen | {pick}
        assert names_to_nodes(frame.removed[step]) == chosen
        assert frame.selection_gap[step] == pytest.approx(gaps[pick], abs=1e-4)
    # every K measured on the measurement prompts
    f_c, f_m = restricted_f(model, measurement, graph, circuit), restricted_f(model, measurement, graph, every)
    for row in frame.itertuples():
        removed = names_to_nodes(row.removed)
        assert row.f_circuit == pytest.approx(f_c(removed), abs=1e-4)
        assert row.f_model == pytest.approx(f_m(removed), abs=1e-4)
        assert row.difference == pytest.approx(row.f_circuit - row.f_model)
        assert row.gap == pytest.approx(abs(row.difference))
        assert row.ci_low <= row.difference <= row.ci_high
    # the whole model is complete: C\K = M\K for every K
    whole = completeness(model, selection, measurement, every, greedy_steps=1, n_random=2, progress=False)
    assert np.allclose(whole.gap, 0.0, atol=1e-6)


def test_minimality_searches_k_per_node_and_scores_its_absolute_value():
    model = tiny(n_layers=2)
    selection, measurement = two_prompt_sets()
    graph = full_graph(model)
    nodes = [("head", 0, 0), ("head", 1, 1), ("mlp", 1, -1)]
    circuit = circuit_from_nodes(graph, nodes)
    frame = minimality(model, selection, measurement, circuit, greedy_steps=2, progress=False)
    assert list(frame.node) == ["L0H0", "L1H1", "MLP1"]
    f_sel, f_meas = restricted_f(model, selection, graph, circuit), restricted_f(model, measurement, graph, circuit)
    for row, v in zip(frame.itertuples(), nodes):
        # with two other nodes u, w, two greedy steps visit: the empty K, the better of {u} and {w}, {u, w}
        others = [u for u in nodes if u != v]

        def score(k):
            return abs(f_sel(k) - f_sel(k | {v}))

        single = max(({u} for u in others), key=score)
        best = max([set(), single, set(others)], key=score)
        assert names_to_nodes(row.removed) == best and row.size == len(best)
        assert row.selection_score == pytest.approx(score(best), abs=1e-4)
        assert row.difference == pytest.approx(f_meas(best) - f_meas(best | {v}), abs=1e-4)
        assert row.score == pytest.approx(abs(row.difference))
        assert row.ci_low <= row.difference <= row.ci_high
    assert (frame.difference < 0).any() and (frame.difference > 0).any()  # the absolute value is what is ranked


def copy_head(model, layer: int, source: int, target: int) -> None:
    """Make head ``target`` of ``layer`` an exact copy of head ``source`` (its q, k, v and output maps)."""
    attn, d = model.blocks[layer].attn, model.cfg.d_head
    into, out = slice(target * d, (target + 1) * d), slice(source * d, (source + 1) * d)
    with torch.no_grad():
        for linear in (attn.W_query, attn.W_key, attn.W_value):
            linear.weight[into] = linear.weight[out]
            if linear.bias is not None:
                linear.bias[into] = linear.bias[out]
        attn.out_proj.weight[:, into] = attn.out_proj.weight[:, out]


def saturating_metric(model, graph, clean, corrupted, mask, backed_up: list[set]):
    """A planted backup: each prompt's logit difference (clean top token - corrupted top token at the
    last position), capped at its smallest value over the node sets ``backed_up`` (brute force), so
    the metric is the same for all of them -> (metric, {frozenset(removed): its value by the brute force})."""
    with torch.no_grad():
        target = naive_run(model, clean, corrupted, None)[:, -1].argmax(-1)
        other = naive_run(model, clean, corrupted, graph.edges.iloc[:0])[:, -1].argmax(-1)
    rows = torch.arange(len(clean))

    def differences(logits):
        return logits[rows, -1, target] - logits[rows, -1, other]

    def run(removed):
        kept = graph.edges[mask]
        kept = kept[[(k, l, h) not in removed for k, l, h in zip(kept.sender_kind, kept.sender_layer, kept.sender_head)]]
        return differences(naive_run(model, clean, corrupted, kept))

    cap = torch.stack([run(removed) for removed in backed_up]).min(0).values

    def metric(logits):
        return torch.minimum(differences(logits), cap).mean()

    return metric, lambda removed: float(torch.minimum(run(set(removed)), cap).mean())


def test_minimality_finds_the_backup_a_node_alone_hides():
    """Heads a = L0H0 and b = L0H1 are copies, and the metric saturates once either is present: removing
    a alone changes nothing (F(C) - F(C\\a) = 0, the old K-empty score), removing it once b is gone does.
    Expected values from the brute-force forward on the measurement prompts."""
    model = tiny(n_layers=2)
    with torch.no_grad():  # layer 0's writes large, so that the two copies carry the answer
        model.blocks[0].attn.out_proj.weight.mul_(6.0)
    copy_head(model, 0, 0, 1)
    graph = full_graph(model)
    a, b, w = ("head", 0, 0), ("head", 0, 1), ("head", 1, 0)
    circuit = circuit_from_nodes(graph, [a, b, w])
    every, none = np.ones(graph.n_edges, bool), np.zeros(graph.n_edges, bool)
    sets = []
    for seed in (1, 2):
        clean, corrupted = prompts(n=8, seed=seed)
        backed_up = [set(), {a}, {b}, {w}, {a, w}, {b, w}]
        metric, value = saturating_metric(model, graph, clean, corrupted, circuit, backed_up)
        _, whole = saturating_metric(model, graph, clean, corrupted, every, [set()])
        sets.append(((clean, corrupted, metric), value))
    (selection, _), (measurement, value) = sets
    with torch.no_grad():
        clean, corrupted = measurement[:2]
        m_full = float(measurement[2](naive_run(model, clean, corrupted, None)))
        m_empty = float(measurement[2](naive_run(model, clean, corrupted, graph.edges[none])))

    def f(removed):
        return (value(removed) - m_empty) / (m_full - m_empty)

    assert abs(f(set()) - f({a})) < 1e-6  # the backup hides a from the K-empty test
    expected = f({b}) - f({a, b})
    assert abs(expected) > 0.2  # and a is needed once b is gone
    frame = minimality(model, selection, measurement, circuit, greedy_steps=1, progress=False).set_index("node")
    assert frame.removed["L0H0"] == "L0H1" and frame.removed["L0H1"] == "L0H0"
    assert frame.difference["L0H0"] == pytest.approx(expected, abs=1e-4)
    assert frame.score["L0H0"] == pytest.approx(abs(expected), abs=1e-4)


def test_k_is_chosen_on_the_selection_prompts_only():
    model = tiny(n_layers=2)
    selection, measurement = two_prompt_sets()
    other = (*prompts(seed=3), loss_metric(prompts(seed=3)[0]))
    graph = full_graph(model)
    circuit = circuit_from_nodes(graph, [("head", 0, 0), ("head", 0, 1), ("mlp", 0, -1), ("head", 1, 1)])
    every = np.ones(graph.n_edges, bool)
    first = minimality(model, selection, measurement, circuit, greedy_steps=2, progress=False)
    second = minimality(model, selection, other, circuit, greedy_steps=2, progress=False)
    assert list(first.removed) == list(second.removed)
    pd.testing.assert_series_equal(first.selection_score, second.selection_score)
    for row in first.itertuples():  # the numbers are the measurement prompts'
        k = names_to_nodes(row.removed)
        v = names_to_nodes(row.node)
        direct = circuit_faithfulness(model, *measurement, [graph.without(circuit, k), graph.without(circuit, k | v)],
                                      progress=False)
        assert row.difference == pytest.approx(direct.faithfulness[0] - direct.faithfulness[1], abs=1e-5)
    complete = [completeness(model, selection, m, circuit, greedy_steps=3, n_random=0, progress=False)
                for m in (measurement, other)]
    assert list(complete[0].removed) == list(complete[1].removed)
    for row in complete[1].itertuples():
        k = names_to_nodes(row.removed)
        direct = circuit_faithfulness(model, *other, [graph.without(circuit, k), graph.without(every, k)],
                                      progress=False)
        assert (row.f_circuit, row.f_model) == pytest.approx(tuple(direct.faithfulness), abs=1e-5)


@pytest.mark.parametrize("steps", [0, -1, 1.5, True])
def test_search_refuses_bad_greedy_steps(steps):
    model = tiny(n_layers=2)
    selection, measurement = two_prompt_sets()
    circuit = circuit_from_nodes(full_graph(model), [("head", 0, 0)])
    for search in (completeness, minimality):
        with pytest.raises(UserError, match="greedy_steps must be an integer >= 1") as error:
            search(model, selection, measurement, circuit, greedy_steps=steps, progress=False)
        assert "\n" not in str(error.value)


def test_search_refuses_the_same_prompts_for_selection_and_measurement():
    model = tiny(n_layers=2)
    selection, _ = two_prompt_sets()
    copy = (selection[0].clone(), selection[1].clone(), selection[2])
    circuit = circuit_from_nodes(full_graph(model), [("head", 0, 0)])
    for search in (completeness, minimality):
        for measurement in (selection, copy):
            with pytest.raises(UserError, match="same clean prompts") as error:
                search(model, selection, measurement, circuit, progress=False)
            assert "\n" not in str(error.value)


def test_tracr_true_circuit_is_faithful_on_the_full_graph():
    pytest.importorskip("tracr", reason="needs the [tracr] extra")
    from analyses.circuits.circuit_eval import output_metric, task_pairs
    from analyses.circuits.ground_truth import compile_with_graph, ground_truth
    from interp import from_tracr
    from interp.tracr import encode_inputs
    compilation = compile_with_graph("sort_unique", list("abc"), 5)
    model = from_tracr(compilation.assembled)
    nodes, edges = ground_truth(compilation, model)
    clean, corrupted = task_pairs(encode_inputs(model, [list(r) for r in itertools.product("abc", repeat=4)]), seed=0)
    with torch.no_grad():
        metric = output_metric(model(clean))
    graph = full_graph(model)
    true_nodes = {(k, l, h) for k, l, h, t in zip(nodes.kind, nodes.layer, nodes["head"], nodes.true) if t}
    # the compiler's edges, and the input (tokens, indices) into every true component's inputs and the logits
    receivers = true_nodes | {("logits", model.cfg.n_layers, -1)}
    into_true = np.array([r in receivers for r in zip(graph.edges.receiver_kind, graph.edges.receiver_layer,
                                                       graph.edges.receiver_head)])
    reads = graph.edges[(graph.edges.sender_kind == "input").to_numpy() & into_true]
    true_edges = edges[list(graph.edges.columns)]
    circuit = circuit_from_edges(graph, pd.concat([true_edges, reads]))
    frame = circuit_faithfulness(model, clean, corrupted, metric,
                                 [circuit, ~circuit, circuit_from_nodes(graph, true_nodes)], progress=False)
    assert frame.attrs["full"] == pytest.approx(0.0, abs=1e-9) and frame.attrs["empty"] < -1e-2
    assert frame.faithfulness[0] == pytest.approx(1.0, abs=1e-4)
    assert frame.faithfulness[2] == pytest.approx(1.0, abs=1e-4)
    assert frame.faithfulness[1] < 0.5
    assert np.isnan(frame.ci_low).all()  # a metric without a per-prompt form: no interval


def test_refusals():
    parallel = tiny(n_layers=2, parallel_attn_mlp=True)
    with pytest.raises(UserError, match="parallel"):
        full_graph(parallel)
    model = tiny(n_layers=2)
    graph = full_graph(model)
    clean, corrupted = prompts()
    with pytest.raises(UserError, match=r"boolean mask of shape \(46,\)"):
        circuit_scores(model, clean, corrupted, loss_metric(clean), [np.ones(5, bool)])
    with pytest.raises(UserError, match="no edge of the graph"):
        circuit_from_edges(graph, graph.edges.iloc[:1].assign(receiver_layer=5))
    with pytest.raises(UserError, match="no node of the graph"):
        circuit_from_nodes(graph, [("head", 2, 0)])
    with pytest.raises(UserError, match="fractions"):
        faithfulness_curve(model, clean, corrupted, loss_metric(clean), np.ones(graph.n_edges), [0.5, 0.2])
    with pytest.raises(UserError, match="one per edge"):
        faithfulness_curve(model, clean, corrupted, loss_metric(clean), np.ones(3))
