"""Head ablation against a hand-computed forward, a peer backend, and hand-written hooks."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from analyses.ablation import (
    ablate_heads,
    ablation_sweep,
    head_importance,
    pruning_curve,
    resample_index,
)
from analyses.metrics import loss_metric
from analyses.probes import probes_for
from interp import GPTConfig, GPTModel, load_model


@pytest.fixture(scope="module")
def tiny():
    """One attention-only layer, two heads: small enough to compute by hand."""
    torch.manual_seed(0)
    model = GPTModel(GPTConfig(d_vocab=11, n_ctx=8, d_model=8, n_heads=2, n_layers=1, attn_only=True)).eval()
    tokens = torch.tensor([[10, 3, 4, 5, 3, 4], [10, 7, 1, 2, 7, 1], [10, 6, 6, 0, 9, 8]])
    return model, tokens


def hand_forward(model, tokens, replace_head=None, replacement=None):
    """Loss of the tiny model written out with plain tensor ops; head ``replace_head``'s z is
    replaced by ``replacement`` (batch or 1, pos, d_head)."""
    attn, n_pos = model.blocks[0].attn, tokens.shape[1]
    x = model.embed.weight[tokens] + model.pos_embed.weight[:n_pos]
    h = F.layer_norm(x, (8,), model.blocks[0].ln1.weight, model.blocks[0].ln1.bias, 1e-5)
    heads = []
    for head in range(2):
        cols = slice(4 * head, 4 * head + 4)
        q = h @ attn.W_query.weight[cols].T + attn.W_query.bias[cols]
        k = h @ attn.W_key.weight[cols].T + attn.W_key.bias[cols]
        v = h @ attn.W_value.weight[cols].T + attn.W_value.bias[cols]
        scores = q @ k.transpose(1, 2) / math.sqrt(4)
        scores = scores.masked_fill(torch.triu(torch.ones(n_pos, n_pos, dtype=torch.bool), 1), -torch.inf)
        z = scores.softmax(-1) @ v
        heads.append(replacement.expand_as(z) if head == replace_head else z)
    resid = x + torch.cat(heads, -1) @ attn.out_proj.weight.T + attn.out_proj.bias
    logits = F.layer_norm(resid, (8,), model.ln_final.weight, model.ln_final.bias, 1e-5) @ model.embed.weight.T
    return F.cross_entropy(logits[:, :-1].reshape(-1, 11), tokens[:, 1:].reshape(-1)).item(), heads


def test_zero_mean_resample_match_hand_computation(tiny):
    model, tokens = tiny
    with torch.no_grad():
        unablated, heads = hand_forward(model, tokens)
        zero, _ = hand_forward(model, tokens, 1, torch.zeros(1, 6, 4))
        mean, _ = hand_forward(model, tokens, 1, heads[1].mean(0, keepdim=True))
        index = resample_index(3, 3, same_batch=True, seed=5)
        resample, _ = hand_forward(model, tokens, 1, heads[1][index])
    assert ablate_heads(model, tokens, [], "zero") == pytest.approx(unablated, abs=1e-5)
    assert ablate_heads(model, tokens, [(0, 1)], "zero") == pytest.approx(zero, abs=1e-5)
    assert ablate_heads(model, tokens, [(0, 1)], "mean") == pytest.approx(mean, abs=1e-5)
    assert ablate_heads(model, tokens, [(0, 1)], "resample", seed=5) == pytest.approx(resample, abs=1e-5)
    assert len({zero, mean, resample, unablated}) == 4  # the methods are told apart


def test_resample_index_is_a_seeded_derangement():
    for seed in range(5):
        index = resample_index(6, 6, same_batch=True, seed=seed)
        assert sorted(index.tolist()) == list(range(6)) and (index != torch.arange(6)).all()
        assert torch.equal(index, resample_index(6, 6, same_batch=True, seed=seed))
    assert resample_index(4, 10, same_batch=False, seed=0).max() < 10
    with pytest.raises(ValueError, match="at least 2 prompts"):
        resample_index(1, 1, same_batch=True, seed=0)


def test_reference_batch_for_mean(tiny):
    model, tokens = tiny
    reference = tokens.flip(1)
    with torch.no_grad():
        _, ref_heads = hand_forward(model, reference)
        expected, _ = hand_forward(model, tokens, 0, ref_heads[0].mean(0, keepdim=True))
    assert ablate_heads(model, tokens, [(0, 0)], "mean", reference=reference) == pytest.approx(expected, abs=1e-5)


@pytest.fixture(scope="module")
def prompts():
    return torch.randint(0, 256, (3, 10), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("method", ["zero", "mean", "resample"])
def test_sweeps_agree_across_backends(scratch_gpt2, bridge_gpt2, prompts, method):
    """GPTModel (suffix runs from cached residuals) and the bridge (full forwards) agree."""
    ours = ablation_sweep(scratch_gpt2, prompts, "each_head", method, progress=False)
    peer = ablation_sweep(bridge_gpt2, prompts, "each_head", method, progress=False)
    assert list(ours["target"]) == [f"L{l}H{h}" for l in range(2) for h in range(4)]
    torch.testing.assert_close(torch.tensor(ours["metric"]), torch.tensor(peer["metric"]), atol=1e-4, rtol=0)
    assert ours["effect"].abs().max() > 1e-4


def test_layer_and_group_targets(scratch_gpt2, prompts):
    frame = ablation_sweep(scratch_gpt2, prompts, "each_layer", "zero", progress=False)
    assert list(frame["target"]) == ["L0", "L1"] and list(frame["n_heads"]) == [4, 4]
    whole_layer = ablate_heads(scratch_gpt2, prompts, [(1, h) for h in range(4)], "zero")
    assert frame["metric"].iloc[1] == pytest.approx(whole_layer, abs=1e-5)
    groups = ablation_sweep(scratch_gpt2, prompts, {"pair": [(0, 1), (1, 2)]}, "zero", progress=False)
    assert groups["target"].item() == "pair" and groups["layer"].isna().item()
    assert groups["metric"].item() == pytest.approx(ablate_heads(scratch_gpt2, prompts, [(1, 2), (0, 1)]), abs=1e-5)


def test_pattern_preserving_matches_hand_written_hooks(scratch_gpt2, bridge_gpt2, prompts):
    metric = loss_metric(prompts)
    with torch.no_grad():
        _, cache = scratch_gpt2.run_with_cache(prompts)

        def zero_head(z, hook):
            z = z.clone()
            z[:, :, 1] = 0
            return z

        frozen = [(f"blocks.{l}.attn.hook_pattern", lambda p, hook, l=l: cache[f"blocks.{l}.attn.hook_pattern"])
                  for l in range(2)]
        expected = metric(scratch_gpt2.run_with_hooks(prompts, fwd_hooks=[("blocks.0.attn.hook_z", zero_head), *frozen]))
        free = metric(scratch_gpt2.run_with_hooks(prompts, fwd_hooks=[("blocks.0.attn.hook_z", zero_head)]))
    preserved = ablate_heads(scratch_gpt2, prompts, [(0, 1)], "zero", preserve_patterns=True)
    assert preserved == pytest.approx(expected.item(), abs=1e-5)
    assert abs(expected.item() - free.item()) > 1e-6  # freezing changed something
    on_bridge = ablate_heads(bridge_gpt2, prompts, [(0, 1)], "zero", preserve_patterns=True)
    assert on_bridge == pytest.approx(expected.item(), abs=1e-4)


def test_importance_is_the_gate_derivative(scratch_gpt2, prompts):
    """For one prompt and zero ablation, Michel et al.'s |dL/d gate| by finite differences."""
    one = prompts[:1]
    metric = loss_metric(one)
    importance = head_importance(scratch_gpt2, one, "zero")

    def gated(scale):
        def hook(z, hook):
            z = z.clone()
            z[:, :, 2] *= scale
            return z

        with torch.no_grad():
            return metric(scratch_gpt2.run_with_hooks(one, fwd_hooks=[("blocks.1.attn.hook_z", hook)]).double()).item()

    derivative = (gated(1 + 1e-2) - gated(1 - 1e-2)) / 2e-2
    assert importance[1, 2].item() == pytest.approx(abs(derivative), rel=1e-2, abs=1e-5)


def test_pruning_curve(scratch_gpt2, prompts):
    curve = pruning_curve(scratch_gpt2, prompts, "zero", progress=False)
    assert list(curve["step"]) == list(range(9)) and curve["fraction"].iloc[-1] == 1.0
    assert curve["importance"].iloc[1:].is_monotonic_increasing
    assert curve["metric"].iloc[0] == pytest.approx(curve["baseline"].iloc[0])
    everything = [(l, h) for l in range(2) for h in range(4)]
    assert curve["metric"].iloc[-1] == pytest.approx(ablate_heads(scratch_gpt2, prompts, everything), abs=1e-5)
    first_three = [tuple(map(int, pair)) for pair in curve[["layer", "head"]].iloc[1:4].to_numpy()]
    assert curve["metric"].iloc[3] == pytest.approx(ablate_heads(scratch_gpt2, prompts, first_three), abs=1e-5)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda m, t: ablate_heads(m, t, [(0, 0)], "shuffle"), "unknown ablation method 'shuffle'; allowed: zero, mean, resample"),
        (lambda m, t: ablate_heads(m, t, [(2, 0)]), r"head \(2, 0\) out of range: layer must be in \[0, 2\), head in \[0, 4\)"),
        (lambda m, t: ablate_heads(m, t, [(0, 4)]), r"head \(0, 4\) out of range"),
        (lambda m, t: ablation_sweep(m, t, "each_neuron"), "unknown targets 'each_neuron'"),
        (lambda m, t: ablate_heads(m, t, [(0, 0)], "mean", reference=t[:, :5]), "reference prompts are 5 tokens long"),
    ],
)
def test_bad_inputs_name_the_value(scratch_gpt2, prompts, call, message):
    with pytest.raises(ValueError, match=message):
        call(scratch_gpt2, prompts)


def test_embedded_model_needs_its_second_layer_for_induction():
    """The toy model predicts the second copy of a segment (low repeat loss) and loses that when
    its second layer, where induction heads must sit, is mean-ablated."""
    model = load_model("toy").eval()
    probes = probes_for(model, 16, 64, seed=11)
    metric = loss_metric(probes.tokens, probes.predictable)
    layers = ablation_sweep(model, probes.tokens, "each_layer", "mean", metric, progress=False)
    assert layers["baseline"].iloc[0] < 1.0
    assert layers["effect"].iloc[1] > 1.0
