"""Attention rollout: a hand computation on a tiny example, the two GPT-2 backends on the same
weights, and a naive per-layer loop on the embedded model."""

from __future__ import annotations

import pytest
import torch
from matplotlib.figure import Figure

from analyses.components.rollout import attention_rollout, model_rollout, rollout_figure
from interp import load_model
from interp.errors import UserError


def test_rollout_matches_a_hand_computation():
    """Two layers, two heads, three tokens. Layer 0: head-mean [[1,0,0],[.5,.5,0],[0,.5,.5]],
    mixed 0.5 A + 0.5 I -> [[1,0,0],[.25,.75,0],[0,.25,.75]]. Layer 1: both heads attend to
    token 0 -> mixed [[1,0,0],[.5,.5,0],[.5,0,.5]]. Rollout after layer 1 = M1 @ M0, by hand:
    row 1 = .5 [1,0,0] + .5 [.25,.75,0]; row 2 = .5 [1,0,0] + .5 [0,.25,.75]."""
    layer0 = torch.tensor([[[1, 0, 0], [1, 0, 0], [0, 1, 0]],
                           [[1, 0, 0], [0, 1, 0], [0, 0, 1]]], dtype=torch.float)
    layer1 = torch.tensor([[1, 0, 0], [1, 0, 0], [1, 0, 0]], dtype=torch.float).expand(2, 3, 3)
    rolled = attention_rollout(torch.stack([layer0, layer1]))
    assert rolled.shape == (2, 3, 3)
    assert torch.allclose(rolled[0], torch.tensor([[1, 0, 0], [0.25, 0.75, 0], [0, 0.25, 0.75]]))
    assert torch.allclose(rolled[1], torch.tensor([[1, 0, 0], [0.625, 0.375, 0], [0.5, 0.125, 0.375]]))
    # w = 1: plain head-averaged attention multiplied through; w = 0: the identity (residual only)
    assert torch.allclose(attention_rollout(torch.stack([layer0, layer1]), 1.0)[1], torch.tensor([[1.0, 0, 0]] * 3))
    assert torch.equal(attention_rollout(torch.stack([layer0, layer1]), 0.0)[1], torch.eye(3))


def test_rows_are_renormalised():
    """Rows of a pattern that do not sum to one (e.g. a quantised one) are renormalised after mixing."""
    pattern = torch.tensor([[[[0.5, 0.0], [0.2, 0.2]]]])  # (layer, head, q, k)
    rolled = attention_rollout(pattern)
    assert torch.allclose(rolled[0], torch.tensor([[1.0, 0.0], [0.1 / 0.7, 0.6 / 0.7]]))


def test_rollout_is_the_same_on_both_gpt2_backends(scratch_gpt2, bridge_gpt2):
    tokens = scratch_gpt2.to_tokens("the cat sat on the mat")[0]
    ours, theirs = model_rollout(scratch_gpt2, tokens), model_rollout(bridge_gpt2, tokens)
    assert ours.shape == (2, len(tokens), len(tokens))
    assert (ours - theirs).abs().max() < 1e-4
    assert torch.allclose(ours.sum(-1), torch.ones(2, len(tokens)), atol=1e-5)


def test_rollout_of_the_embedded_model_equals_a_naive_loop():
    model = load_model("toy")
    tokens = model.to_tokens("abcabcabc")[0]
    _, cache = model.run_with_cache(tokens[None])
    n = len(tokens)
    expected = torch.eye(n, dtype=torch.double)
    for layer in range(model.cfg.n_layers):
        pattern = cache[f"blocks.{layer}.attn.hook_pattern"][0].double()
        mixed = [[0.5 * float(pattern[:, q, k].mean()) + 0.5 * (q == k) for k in range(n)] for q in range(n)]
        mixed = torch.tensor([[v / sum(row) for v in row] for row in mixed], dtype=torch.double)
        expected = mixed @ expected
    assert (model_rollout(model, tokens)[-1].double() - expected).abs().max() < 1e-5


def test_bad_weight_is_refused_and_the_figure_draws():
    with pytest.raises(UserError, match=r"attention_weight=1.5 must be in \[0, 1\]"):
        attention_rollout(torch.ones(1, 1, 2, 2), 1.5)
    rolled = attention_rollout(torch.eye(4).expand(3, 2, 4, 4))
    figure = rollout_figure(rolled, ["a", "b", "c", "d"])
    assert isinstance(figure, Figure) and [ax.get_title() for ax in figure.axes if ax.get_visible()] == [
        "rollout after layer 0", "rollout after layer 1", "rollout after layer 2"]


# ---- attention flow ----------------------------------------------------------------------------------

def _networkx_flow(mixed: torch.Tensor) -> torch.Tensor:
    """The attention-flow values by networkx's own max-flow on the same graph, (layer, q, k)."""
    import networkx as nx

    n_layers, n_pos = mixed.shape[0], mixed.shape[-1]
    flows = torch.zeros(n_layers, n_pos, n_pos)
    for layer in range(n_layers):
        graph = nx.DiGraph()
        for t in range(layer + 1):
            for q in range(n_pos):
                for k in range(n_pos):
                    if mixed[t, q, k] > 0:
                        graph.add_edge((t, k), (t + 1, q), capacity=float(mixed[t, q, k]))
        for q in range(n_pos):
            for k in range(n_pos):
                if graph.has_node((0, k)) and graph.has_node((layer + 1, q)):
                    flows[layer, q, k] = nx.maximum_flow_value(graph, (0, k), (layer + 1, q))
    return flows


def test_attention_flow_equals_networkx_and_a_hand_example():
    from analyses.components.rollout import attention_flow, mixed_attention
    generator = torch.Generator().manual_seed(0)
    scores = torch.randn(3, 2, 5, 5, generator=generator).masked_fill(~torch.ones(5, 5, dtype=torch.bool).tril(), -torch.inf)
    patterns = scores.softmax(-1)
    flow = attention_flow(patterns, progress=False)
    assert flow.shape == (3, 5, 5)
    assert torch.allclose(flow, _networkx_flow(mixed_attention(patterns)), atol=1e-6)
    # the hand example of the rollout test: one layer's flow is its mixed matrix; after layer 1,
    # to position 2 from token 0: paths 0 -> 0 -> 2 (min(1, .5)) and 0 -> 2 -> 2 (none: 2 does not
    # see 0 in layer 0) -> 0.5; from token 1: 1 -> 2 -> 2 (min(.25, .5)) = .25; from 2: min(.75, .5)
    layer0 = torch.tensor([[[1, 0, 0], [1, 0, 0], [0, 1, 0]],
                           [[1, 0, 0], [0, 1, 0], [0, 0, 1]]], dtype=torch.float)
    layer1 = torch.tensor([[1, 0, 0], [1, 0, 0], [1, 0, 0]], dtype=torch.float).expand(2, 3, 3)
    hand = attention_flow(torch.stack([layer0, layer1]), progress=False)
    assert torch.allclose(hand[0], mixed_attention(torch.stack([layer0, layer1]))[0])
    assert torch.allclose(hand[1, 2], torch.tensor([0.5, 0.25, 0.5]))


def test_attention_flow_of_a_model_and_its_figure(scratch_gpt2):
    from analyses.components.rollout import model_flow
    tokens = scratch_gpt2.to_tokens("the cat")[0]
    flow = model_flow(scratch_gpt2, tokens)
    assert flow.shape == (2, len(tokens), len(tokens))
    assert torch.allclose(flow[:, 0, 0], torch.ones(2))  # the first token reaches itself fully
    assert isinstance(rollout_figure(flow, scratch_gpt2.to_str_tokens(tokens), kind="attention flow"), Figure)
    with pytest.raises(UserError, match="one prompt"):
        from analyses.components.rollout import attention_flow
        attention_flow(flow)
