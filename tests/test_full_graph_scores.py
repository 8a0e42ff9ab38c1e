"""EAP and EAP-IG on the full graph, exact node patching and the method comparison
(``analyses.circuits.full_graph_scores``), against a gradient taken with hand-written hooks (the MLP
input's gradient by a vector-Jacobian product of the block's own MLP), against the full-graph
evaluation itself (single-edge and single-node removal), and against the head-only EAP and EAP-IG
of ``edge_attribution``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from analyses.circuits.full_graph import (circuit_faithfulness, circuit_from_nodes, circuit_scores, curve_areas,
                                          full_graph)
from analyses.circuits.full_graph_scores import (EdgeRanking, NodeRanking, compare_circuit_methods,
                                                 full_graph_edge_scores, method_comparison_figure, node_patching)
from analyses.circuits.path_patching import edge_attribution
from analyses.core.metrics import logit_diff_metric
from analyses.core.stats import paired_difference
from interp import UserError
from test_full_graph import CONFIGS, prompts, tiny


def last_token_metric(n: int):
    answers = torch.arange(n) + 5
    return logit_diff_metric(answers, answers + 1)


# ---------------------------------------------------------------- the naive gradient
def naive_scores(model, clean, corrupted, metric, alphas) -> np.ndarray:
    """Every edge's diff . gradient with hooks written here: each q/k/v input (split per head) and
    each block's output get a zero added, whose gradient autograd gives; an MLP input's gradient is
    the vector-Jacobian product of x -> mlp(ln2(x)) at resid_mid with the gradient of resid_post.
    The input at each alpha: corrupted + alpha (clean - corrupted); the gradients averaged over alphas."""
    graph, cfg = full_graph(model), model.cfg
    with torch.no_grad():
        runs = [model.run_with_cache(tokens)[1] for tokens in (clean, corrupted)]

    def outputs(cache):  # sender node -> its output (batch, pos, d_model)
        found = {("input", -1, -1): cache["blocks.0.hook_resid_pre"]}
        for layer in range(cfg.n_layers):
            for h in range(cfg.n_heads):
                found[("head", layer, h)] = cache[f"blocks.{layer}.attn.hook_z"][:, :, h] @ model.W_O[layer, h]
            found[("mlp", layer, -1)] = cache[f"blocks.{layer}.hook_mlp_out"]
        return found

    clean_out, corrupted_out = outputs(runs[0]), outputs(runs[1])
    grads: dict = {}
    model.set_use_split_qkv_input(True)
    try:
        for alpha in alphas:
            start = corrupted_out[("input", -1, -1)] + alpha * (clean_out[("input", -1, -1)] - corrupted_out[("input", -1, -1)])
            probes, mids = {}, {}

            def add(name, shape):
                probes[name] = torch.zeros(shape, requires_grad=True)
                return lambda x, hook: x + probes[name]

            hooks = [("blocks.0.hook_resid_pre", lambda x, hook: start.clone())]
            batch, n_pos = clean.shape
            for layer in range(cfg.n_layers):
                for which in "qkv":
                    hooks.append((f"blocks.{layer}.hook_{which}_input",
                                  add((layer, which), (batch, n_pos, cfg.n_heads, cfg.d_model))))
                hooks.append((f"blocks.{layer}.hook_resid_mid",
                              lambda x, hook, layer=layer: mids.__setitem__(layer, x.detach().clone())))
                hooks.append((f"blocks.{layer}.hook_resid_post", add((layer, "post"), (batch, n_pos, cfg.d_model))))
            with torch.enable_grad():
                value = metric(model.run_with_hooks(clean, fwd_hooks=hooks))
                found = dict(zip(probes, torch.autograd.grad(value, list(probes.values()))))
            for layer in range(cfg.n_layers):
                block = model.blocks[layer]
                for i, which in enumerate("qkv"):
                    for h in range(cfg.n_heads):
                        key = (("head", layer, h), which)
                        grads[key] = grads.get(key, 0) + found[(layer, which)][:, :, h] / len(alphas)
                mlp_in = torch.autograd.functional.vjp(lambda x: block.mlp(block.ln2(x)), mids[layer],
                                                       found[(layer, "post")])[1]
                grads[(("mlp", layer, -1), "mlp")] = grads.get((("mlp", layer, -1), "mlp"), 0) + mlp_in / len(alphas)
            key = (("logits", cfg.n_layers, -1), "logits")
            grads[key] = grads.get(key, 0) + found[(cfg.n_layers - 1, "post")] / len(alphas)
    finally:
        model.set_use_split_qkv_input(False)
    return np.array([float(((corrupted_out[s] - clean_out[s]) * grads[(r, via)]).sum().detach())
                     for s, r, via in zip(zip(graph.edges.sender_kind, graph.edges.sender_layer, graph.edges.sender_head),
                                          zip(graph.edges.receiver_kind, graph.edges.receiver_layer,
                                              graph.edges.receiver_head), graph.edges.via)])


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("steps", [None, 3])
def test_scores_equal_the_naive_gradient(config, steps):
    model = tiny(**CONFIGS[config])
    clean, corrupted = prompts()
    metric = last_token_metric(len(clean))
    frame = full_graph_edge_scores(model, clean, corrupted, metric, steps=steps, progress=False)
    alphas = [1.0] if steps is None else [k / steps for k in range(steps)]
    expected = naive_scores(model, clean, corrupted, metric, alphas)
    assert list(frame.columns[:-1]) == list(full_graph(model).edges.columns)
    np.testing.assert_allclose(frame.score.to_numpy(), expected, atol=1e-5, rtol=1e-4)
    assert np.abs(expected).max() > 0.1 and (np.abs(expected) > 1e-3).sum() > 20  # the check bites
    assert frame.attrs["method"] == ("EAP" if steps is None else "EAP-IG")
    # chunked one prompt at a time: the same scores
    chunked = full_graph_edge_scores(model, clean, corrupted, metric, steps=steps, memory_mb=1e-3, progress=False)
    np.testing.assert_allclose(chunked.score.to_numpy(), frame.score.to_numpy(), atol=1e-5, rtol=1e-4)


def near_model_and_prompts(scale: float = 1e-3):
    """A tiny model whose tokens 150.. embed as tokens 0.. plus ``scale`` noise, and prompts whose
    corrupted ids are the clean ones + 150: every edge's removal is a small change."""
    model = tiny()
    with torch.no_grad():
        generator = torch.Generator().manual_seed(2)
        model.W_E[150:300] = model.W_E[:150] + scale * torch.randn(150, model.cfg.d_model, generator=generator)
    clean = torch.randint(1, 150, (6, 7), generator=torch.Generator().manual_seed(3))
    return model, clean, clean + 150


def test_eap_is_the_first_order_change_of_removing_one_edge():
    """Each edge removed alone from the full circuit, exactly (the full-graph evaluation): m(full
    minus the edge) - m(full). Near the linear regime EAP and EAP-IG predict it, signs included."""
    model, clean, corrupted = near_model_and_prompts()
    metric = last_token_metric(len(clean))
    graph = full_graph(model)
    full = np.ones(graph.n_edges, dtype=bool)
    masks = [full] + [np.where(np.arange(graph.n_edges) == i, False, full) for i in range(graph.n_edges)]
    values = circuit_scores(model, clean, corrupted, metric, masks, progress=False).values.double().numpy()
    exact = values[1:] - values[0]
    assert np.abs(exact).max() > 1e-4  # removing an edge moves the metric, a little
    for steps in (None, 4):
        scores = full_graph_edge_scores(model, clean, corrupted, metric, steps=steps, progress=False).score.to_numpy()
        big = np.abs(exact) > 0.1 * np.abs(exact).max()
        assert np.all(np.sign(scores[big]) == np.sign(exact[big]))
        np.testing.assert_allclose(scores, exact, atol=0.03 * np.abs(exact).max())
        assert np.corrcoef(scores, exact)[0, 1] > 0.999


def test_head_edges_agree_with_edge_attribution():
    """On the head -> head and head -> logits edges the head-only EAP and EAP-IG (noising) give the same numbers."""
    model = tiny(**CONFIGS["rms_gqa"])
    clean, corrupted = prompts()
    metric = last_token_metric(len(clean))
    for steps in (None, 3):
        ours = full_graph_edge_scores(model, clean, corrupted, metric, steps=steps, progress=False)
        ours = ours[(ours.sender_kind == "head") & ours.receiver_kind.isin(["head", "logits"])]
        theirs = edge_attribution(model, clean, corrupted, metric, steps=steps, direction="noise", progress=False)
        keys = ["sender_layer", "sender_head", "receiver_layer", "receiver_head", "via"]
        merged = ours.merge(theirs, on=keys, how="inner", validate="one_to_one")
        assert len(merged) == len(ours) == len(theirs)
        np.testing.assert_allclose(merged.score, merged.attribution, atol=1e-5, rtol=1e-4)


def test_node_patching_is_removing_the_node_from_the_full_graph():
    model = tiny(**CONFIGS["rms_gqa"])
    clean, corrupted = prompts()
    metric = last_token_metric(len(clean))
    graph = full_graph(model)
    frame = node_patching(model, clean, corrupted, metric, progress=False)
    full = np.ones(graph.n_edges, dtype=bool)
    nodes = list(zip(frame.kind, frame.layer, frame["head"]))
    assert sorted(nodes) == sorted(graph.nodes)
    values = circuit_scores(model, clean, corrupted, metric, [full] + [graph.without(full, [n]) for n in nodes],
                            progress=False).values.double().numpy()
    np.testing.assert_allclose(frame.effect, values[1:] - values[0], atol=1e-5)
    assert (np.diff(frame.effect.abs()) <= 0).all() and frame.effect.abs().max() > 0.1
    assert (frame.ci_low <= frame.effect + 1e-9).all() and (frame.effect <= frame.ci_high + 1e-9).all()


def test_node_ranking_takes_the_most_nodes_within_each_size():
    graph = full_graph(tiny())
    nodes = tuple(graph.nodes[::-1])
    fractions = (0.02, 0.1, 0.3, 1.0)
    circuits = NodeRanking(nodes).circuits(graph, fractions)
    for fraction, mask in zip(fractions, circuits):
        limit = round(fraction * graph.n_edges)
        n = next(n for n in range(len(nodes) + 1) if (circuit_from_nodes(graph, nodes[:n]) == mask).all())
        assert mask.sum() <= limit
        assert n == len(nodes) or circuit_from_nodes(graph, nodes[:n + 1]).sum() > limit
    assert circuits[-1].all() and circuits[0].sum() == 1  # 2 of 100 edges: no node fits, the input -> logits edge


def test_comparison_against_the_evaluation_and_by_hand():
    model = tiny()
    clean, corrupted = prompts(n=8)
    metric = last_token_metric(len(clean))
    graph = full_graph(model)
    eap = full_graph_edge_scores(model, clean, corrupted, metric, progress=False).score.to_numpy()
    random = np.random.default_rng(0).normal(size=graph.n_edges)
    rankings = {"exact": NodeRanking.of(node_patching(model, clean, corrupted, metric, progress=False)),
                "EAP": EdgeRanking(eap), "random": EdgeRanking(random)}
    fractions = (0.05, 0.2, 0.5, 1.0)
    frame = compare_circuit_methods(model, clean, corrupted, metric, rankings, fractions, threshold=0.6, refine=2,
                                    progress=False)
    curve = frame[frame.on_curve]
    assert list(curve.method) == [m for m in rankings for _ in fractions]
    masks = [mask for ranking in rankings.values() for mask in ranking.circuits(graph, fractions)]
    peer = circuit_faithfulness(model, clean, corrupted, metric, masks, progress=False)
    np.testing.assert_allclose(curve.faithfulness, peer.faithfulness, atol=1e-6)
    np.testing.assert_allclose(curve.ci_low, peer.ci_low, atol=1e-6)
    assert (curve.n_edges.to_numpy() == peer.n_edges.to_numpy()).all()
    summary = frame.attrs["summary"].set_index("method")
    for method, rows in frame.groupby("method"):
        points = rows[rows.on_curve]
        cpr, cmd = curve_areas(points.fraction.to_numpy(), points.faithfulness.to_numpy())
        assert summary.loc[method, "cpr"] == pytest.approx(float(cpr))
        assert summary.loc[method, "cmd"] == pytest.approx(float(cmd))
        assert summary.loc[method, "cpr_low"] <= cpr <= summary.loc[method, "cpr_high"]
        passing = rows[rows.ci_low >= 0.6]
        assert summary.loc[method, "smallest_edges"] == passing.n_edges.min()
        assert summary.loc[method, "smallest_share"] == pytest.approx(passing.n_edges.min() / graph.n_edges)
        first = np.flatnonzero(points.ci_low.to_numpy() >= 0.6)[0]
        extra = rows[~rows.on_curve]
        if first > 0:  # the refinement lies strictly between the last point below and the first above
            assert len(extra) == 2
            assert (extra.target > fractions[first - 1]).all() and (extra.target < fractions[first]).all()
        else:
            assert extra.empty
    np.testing.assert_allclose(frame[frame.target == 1.0].faithfulness, 1.0, atol=1e-6)  # the whole graph
    figure = method_comparison_figure(frame, title="t")
    assert len(figure.axes[0].get_legend().get_texts()) == 3 and figure.axes[0].get_xscale() == "log"


def test_two_rankings_are_compared_by_the_interval_of_their_paired_difference():
    """``attrs["paired"]``: at each curve point, EAP's faithfulness minus a random ranking's and the
    interval of that difference, against ``paired_difference`` of the per-prompt numerators
    (circuit - empty over full - empty, both circuits on the same resamples of the same prompts) from
    an evaluation of its own."""
    model = tiny()
    clean, corrupted = prompts(n=8)
    metric = last_token_metric(len(clean))
    graph = full_graph(model)
    eap = full_graph_edge_scores(model, clean, corrupted, metric, progress=False).score.to_numpy()
    rankings = {"EAP": EdgeRanking(eap), "random": EdgeRanking(np.random.default_rng(0).normal(size=graph.n_edges))}
    fractions = (0.05, 0.2, 0.5)
    frame = compare_circuit_methods(model, clean, corrupted, metric, rankings, fractions, progress=False)
    paired = frame.attrs["paired"]
    assert list(zip(paired.a, paired.b, paired.target)) == [("EAP", "random", f) for f in fractions]
    ends = [np.ones(graph.n_edges, dtype=bool), np.zeros(graph.n_edges, dtype=bool)]
    for row in paired.itertuples():
        masks = [rankings[name].circuits(graph, [row.target])[0] for name in (row.a, row.b)]
        scores = circuit_scores(model, clean, corrupted, metric, [*ends, *masks], progress=False)
        full, empty, a, b = scores.numerators.double()
        want = paired_difference(a - empty, full - empty, b - empty, full - empty)
        assert (row.difference, row.ci_low, row.ci_high) == pytest.approx(tuple(map(float, want)), abs=1e-6)
        curve = frame[(frame.target == row.target) & frame.on_curve].set_index("method")
        assert row.difference == pytest.approx(curve.faithfulness["EAP"] - curve.faithfulness["random"], abs=1e-9)


def test_refusals():
    model = tiny(n_layers=2)
    clean, corrupted = prompts()
    metric = last_token_metric(len(clean))
    with pytest.raises(UserError, match="steps must be a positive integer"):
        full_graph_edge_scores(model, clean, corrupted, metric, steps=0)
    with pytest.raises(UserError, match="EdgeRanking or a NodeRanking"):
        compare_circuit_methods(model, clean, corrupted, metric, {"x": np.ones(3)})
    with pytest.raises(UserError, match="one per edge"):
        compare_circuit_methods(model, clean, corrupted, metric, {"x": EdgeRanking(np.ones(3))})
    with pytest.raises(UserError, match="refine"):
        compare_circuit_methods(model, clean, corrupted, metric, {"x": EdgeRanking(np.ones(46))}, refine=-1)
    with pytest.raises(UserError, match="parallel"):
        full_graph_edge_scores(tiny(n_layers=2, parallel_attn_mlp=True), clean, corrupted, metric)
