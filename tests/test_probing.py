"""Linear probes: the properties against naive loops, the fit at its optimum, held-out accuracy on
planted and random labels, the control task, and what the embedded model's residual encodes."""

from __future__ import annotations

import pytest
import torch

from analyses.core.probes import probes_for
from analyses.components.probing import (
    bracket_depth, bracket_prompts, control_labels, fit_probe, linear_probe, probe_loss, prompt_split, repeat_offset,
    seen_before,
)
from interp import UserError, load_model


@pytest.fixture(scope="module")
def toy():
    return load_model("toy").eval()


def test_properties_equal_naive_loops(toy):
    tokens = torch.randint(0, 6, (4, 20), generator=torch.Generator().manual_seed(0))
    seen = seen_before(tokens)
    depth = bracket_depth(tokens, open_id=1, close_id=2)
    for b in range(4):
        level = 0
        for i in range(20):
            assert seen[b, i] == (-1 if i == 0 else int(tokens[b, i].item() in tokens[b, :i].tolist()))
            level = max(0, level + (tokens[b, i] == 1).item() - (tokens[b, i] == 2).item())
            assert depth[b, i] == level
    probes = probes_for(toy, 6, seed=1)
    offsets = repeat_offset(probes)
    for b in range(6):
        start, period = int(probes.segment_start[b] + probes.period[b]), int(probes.period[b])
        expected = [i - start if start <= i < start + period else -1 for i in range(probes.seq_len)]
        assert offsets[b].tolist() == expected
        # the offset's token is the segment's token at that offset
        second = probes.tokens[b, start:start + period]
        assert torch.equal(second, probes.tokens[b, start - period:start])
    tokens, labels = bracket_prompts(toy, 5, 30, seed=2)
    open_id, close_id = ord("("), ord(")")
    assert torch.equal(labels[:, 1:], bracket_depth(tokens, open_id, close_id)[:, 1:]) and (labels[:, 0] == -1).all()
    assert labels.max() <= 4 and (tokens == open_id).any() and (tokens == close_id).any()


def test_control_labels_are_per_token_type():
    tokens = torch.randint(0, 10, (8, 16), generator=torch.Generator().manual_seed(3))
    labels = seen_before(tokens)
    control = control_labels(tokens, labels, seed=0)
    assert torch.equal(control < 0, labels < 0)
    for token in tokens[labels >= 0].unique():
        values = control[(tokens == token) & (labels >= 0)]
        assert (values == values[0]).all()
    assert set(control[labels >= 0].tolist()) <= set(labels[labels >= 0].tolist())


def test_the_fit_reaches_the_optimum_and_generalises():
    generator = torch.Generator().manual_seed(4)
    rule = torch.randn(8, generator=generator)
    x, test = torch.randn(400, 8, generator=generator), torch.randn(400, 8, generator=generator)
    y, truth = (x @ rule > 0).long(), (test @ rule > 0).long()
    fit = fit_probe(x, y, weight_decay=1e-2, steps=200)
    weight, bias = fit.weight.clone().requires_grad_(True), fit.bias.clone().requires_grad_(True)
    loss = probe_loss(weight, bias, (x - fit.mean) / fit.std, y, 1e-2)
    grads = torch.autograd.grad(loss, [weight, bias])
    assert max(g.abs().max().item() for g in grads) < 1e-4  # the regularised loss is at its minimum
    assert (fit.predict(test) == truth).float().mean() > 0.95  # a linear rule is learnt from 400 rows
    noise = fit_probe(x, torch.randint(0, 2, (400,), generator=generator))
    assert (noise.predict(test) == truth).float().mean() < 0.65  # random labels teach nothing
    held_out = prompt_split(10, 0.3, seed=0)
    assert held_out.sum() == 3 and torch.equal(held_out, prompt_split(10, 0.3, seed=0))


def test_seen_before_is_read_from_the_residual_not_the_embedding(toy):
    probes = probes_for(toy, 24, seed=5)
    labels = seen_before(probes.tokens)
    hooks = ["hook_embed", "blocks.1.hook_resid_pre", "blocks.1.hook_resid_post"]
    first = linear_probe(toy, probes.tokens, labels, hooks, progress=False).set_index("hook")
    second = linear_probe(toy, probes.tokens, labels, hooks, progress=False).set_index("hook")
    assert first.equals(second)  # seeded, deterministic
    embed, final = first.loc["hook_embed"], first.loc["blocks.1.hook_resid_post"]
    # the token embedding cannot know whether the token came before; layer 0's duplicate-token
    # attention writes it into the residual
    assert embed["accuracy"] < embed["majority"] + 0.1
    assert final["accuracy"] > 0.9 and final["selectivity"] > embed["selectivity"] + 0.2
    heads = linear_probe(toy, probes.tokens, labels, ["blocks.0.attn.hook_z"], per_head=True, progress=False)
    assert len(heads) == 8 and heads["head"].tolist() == list(range(8))


def test_bad_input_is_refused(toy):
    tokens = probes_for(toy, 4, seed=6).tokens
    with pytest.raises(UserError, match="labels of shape"):
        linear_probe(toy, tokens, seen_before(tokens)[:, :3])
    with pytest.raises(UserError, match="no position"):
        linear_probe(toy, tokens, torch.full_like(tokens, -1))
    with pytest.raises(UserError, match="per_head"):
        linear_probe(toy, tokens, seen_before(tokens), ["hook_embed"], per_head=True)
    with pytest.raises(UserError, match="test_fraction"):
        prompt_split(4, 1.5, 0)
