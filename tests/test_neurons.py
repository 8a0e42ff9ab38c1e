"""MLP neurons: ``blocks.{l}.mlp.hook_post`` on both backends against Hugging Face's own modules, and
``analyses.components.neurons`` against explicit loops (one hooked forward per neuron), autograd by
hand, and a neuron planted to promote a known token."""

from __future__ import annotations

import pytest
import torch

from analyses.components.neurons import neuron_effects, promoted_tokens, promotion_effects
from analyses.core.metrics import logit_diff_metric
from interp import GPTConfig, GPTModel, from_hf
from interp.bridge import boot_bridge
from interp.errors import UserError
from interp.random_models import random_hf_model

LAYER = 1


@pytest.fixture(scope="module")
def llama():
    """(Hugging Face Llama, our GPTModel, its bridge) over the same random weights (gated SwiGLU MLPs)."""
    hf, tokenizer = random_hf_model("llama", seed=5, initializer_range=0.2)
    return hf, from_hf(hf, tokenizer), boot_bridge(hf, tokenizer)


def tokens_for(model, batch=3, pos=10, seed=0):
    return torch.randint(3, model.cfg.d_vocab, (batch, pos), generator=torch.Generator().manual_seed(seed))


def hf_hidden(hf, tokens, layer, by_hand):
    """Hugging Face's MLP hidden activation at ``layer``, computed by hand from the MLP's input."""
    blocks = hf.model.layers if hasattr(hf, "model") else hf.transformer.h
    mlp, seen = blocks[layer].mlp, {}
    handle = mlp.register_forward_pre_hook(lambda module, args: seen.setdefault("x", args[0]))
    with torch.no_grad():
        hf(tokens)
        handle.remove()
        return by_hand(mlp, seen["x"])


def test_hook_post_is_the_gated_mlps_act_gate_times_up(llama):
    hf, ours, bridge = llama
    tokens = tokens_for(ours)
    expected = hf_hidden(hf, tokens, LAYER, lambda mlp, x: mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))
    assert expected.shape == (3, 10, hf.config.intermediate_size) and expected.abs().max() > 0.01
    for model in (ours, bridge):
        _, cache = model.run_with_cache(tokens, names_filter=f"blocks.{LAYER}.mlp.hook_post")
        torch.testing.assert_close(cache[f"blocks.{LAYER}.mlp.hook_post"], expected, atol=1e-5, rtol=1e-6)


def test_hook_post_is_gpt2s_act_of_fc(hf_gpt2, scratch_gpt2, bridge_gpt2):
    hf = hf_gpt2[0]
    tokens = tokens_for(scratch_gpt2)
    expected = hf_hidden(hf, tokens, LAYER, lambda mlp, x: mlp.act(mlp.c_fc(x)))
    assert expected.shape == (3, 10, 4 * 64)
    for model in (scratch_gpt2, bridge_gpt2):
        _, cache = model.run_with_cache(tokens, names_filter=f"blocks.{LAYER}.mlp.hook_post")
        torch.testing.assert_close(cache[f"blocks.{LAYER}.mlp.hook_post"], expected, atol=1e-5, rtol=1e-6)


def naive_effects(model, tokens, metric, layer, neurons, replacement):
    """The metric with each neuron replaced at every position, one hooked forward per neuron, minus the baseline."""
    baseline = float(metric(model(tokens)))

    def ablate(neuron):
        def hook(activation, hook):
            activation[:, :, neuron] = replacement[neuron]
            return activation
        return hook

    return [float(metric(model.run_with_hooks(tokens, fwd_hooks=[(f"blocks.{layer}.mlp.hook_post", ablate(n))])))
            - baseline for n in neurons]


def diff_metric(model):
    return logit_diff_metric(torch.tensor([5, 6, 7]), torch.tensor([8, 9, 10]))


@torch.no_grad()
def test_every_neurons_exact_effect_equals_a_loop_of_hooked_forwards():
    torch.manual_seed(1)
    model = GPTModel(GPTConfig(d_vocab=64, n_ctx=16, d_model=32, n_heads=2, n_layers=2, d_mlp=40)).eval()
    for weight in model.parameters():
        weight.mul_(4.0)  # far from the initialisation's near-zero MLP effects
    tokens, metric = tokens_for(model), diff_metric(model)
    frame = neuron_effects(model, tokens, metric, LAYER, exact="all")
    assert sorted(frame["neuron"]) == list(range(40))
    expected = naive_effects(model, tokens, metric, LAYER, list(frame["neuron"]), torch.zeros(40))
    torch.testing.assert_close(torch.tensor(frame["effect"].tolist()), torch.tensor(expected), atol=1e-5, rtol=0)
    assert frame["effect"].abs().max() > 1e-3  # neurons that matter, not an all-zero comparison


def test_the_bridges_mean_ablation_of_the_top_neurons_equals_the_loop(llama):
    _, ours, bridge = llama
    tokens, metric = tokens_for(ours), diff_metric(ours)
    _, cache = bridge.run_with_cache(tokens, names_filter=f"blocks.{LAYER}.mlp.hook_post")
    means = cache[f"blocks.{LAYER}.mlp.hook_post"].mean(dim=(0, 1))
    theirs = neuron_effects(bridge, tokens, metric, LAYER, method="mean", exact=8)
    assert theirs["effect"].notna().sum() == 8 and theirs["effect"].iloc[:8].notna().all()
    with torch.no_grad():
        expected = naive_effects(bridge, tokens, metric, LAYER, list(theirs["neuron"][:8]), means)
    torch.testing.assert_close(torch.tensor(theirs["effect"][:8].tolist()), torch.tensor(expected), atol=1e-5, rtol=0)
    ours_frame = neuron_effects(ours, tokens, metric, LAYER, method="mean", exact=8)
    torch.testing.assert_close(torch.tensor(ours_frame["attribution"].tolist()),
                               torch.tensor(theirs["attribution"].tolist()), atol=1e-4, rtol=0)


def test_attribution_equals_autograd_by_hand(scratch_gpt2):
    tokens, metric = tokens_for(scratch_gpt2), diff_metric(scratch_gpt2)
    kept = {}

    def keep(activation, hook):
        kept["act"] = activation.detach().requires_grad_(True)
        return kept["act"]

    value = metric(scratch_gpt2.run_with_hooks(tokens, fwd_hooks=[(f"blocks.{LAYER}.mlp.hook_post", keep)]))
    (grad,) = torch.autograd.grad(value, kept["act"])
    expected = (grad * (0 - kept["act"].detach())).sum(dim=(0, 1))
    frame = neuron_effects(scratch_gpt2, tokens, metric, LAYER, exact=0).sort_values("neuron")
    assert frame["effect"].isna().all()
    torch.testing.assert_close(torch.tensor(frame["attribution"].tolist()), expected, atol=1e-5, rtol=0)
    assert frame["attribution"].abs().max() > 1e-3


@pytest.fixture(scope="module")
def planted():
    """A one-layer GPTModel whose MLP neuron 3 writes (a large multiple of) token 42's unembedding and
    always fires (a large input bias on a ReLU): it promotes token 42."""
    torch.manual_seed(0)
    model = GPTModel(GPTConfig(d_vocab=64, n_ctx=16, d_model=32, n_heads=2, n_layers=1, act_fn="relu")).eval()
    with torch.no_grad():
        model.blocks[0].mlp.fc.bias[3] = 50.0
        model.blocks[0].mlp.proj.weight[:, 3] = 0.5 * model.embed.weight[42] / model.embed.weight[42].norm()
    return model


def test_a_planted_neuron_promotes_its_token_and_ablating_it_confirms(planted):
    table = promoted_tokens(planted, 0, [3, 7], k=3)
    assert list(table.columns) == ["layer", "neuron", "rank", "token_id", "token", "score"]
    assert table[table["neuron"] == 3]["token_id"].iloc[0] == 42
    # the scores by hand: the value row through the tied unembedding
    by_hand = planted.blocks[0].mlp.proj.weight[:, 7] @ planted.embed.weight.T
    torch.testing.assert_close(torch.tensor(table[table["neuron"] == 7]["score"].tolist()), by_hand.topk(3).values,
                               atol=1e-5, rtol=0)
    tokens = tokens_for(planted, pos=8)
    confirmed = promotion_effects(planted, tokens, 0, [3, 7], k=1).set_index("neuron")
    assert confirmed.loc[3, "promotion"] > 1.0 and confirmed.loc[3, "activation"] > 40
    # neuron 3's promotion by hand: token 42's logit less the mean logit, at the last position, unablated - ablated
    def lift(logits):
        return float((logits[:, -1, 42] - logits[:, -1].mean(-1)).mean())

    def zero(activation, hook):
        activation[:, :, 3] = 0
        return activation

    with torch.no_grad():
        ablated = planted.run_with_hooks(tokens, fwd_hooks=[("blocks.0.mlp.hook_post", zero)])
        assert confirmed.loc[3, "promotion"] == pytest.approx(lift(planted(tokens)) - lift(ablated), abs=1e-5)


def test_bad_input_gets_one_line_errors(scratch_gpt2):
    tokens, metric = tokens_for(scratch_gpt2), diff_metric(scratch_gpt2)
    attn_only = GPTModel(GPTConfig(d_vocab=64, n_ctx=16, d_model=32, n_heads=2, n_layers=1, attn_only=True))
    with pytest.raises(UserError, match="attention-only"):
        neuron_effects(attn_only, tokens_for(attn_only), metric, 0)
    with pytest.raises(UserError, match=r"layer=2 must be in \[0, 2\)"):
        neuron_effects(scratch_gpt2, tokens, metric, 2)
    with pytest.raises(UserError, match="neuron ablation method 'resample'"):
        neuron_effects(scratch_gpt2, tokens, metric, 0, method="resample")
    with pytest.raises(UserError, match="exact=-1"):
        neuron_effects(scratch_gpt2, tokens, metric, 0, exact=-1)
    with pytest.raises(UserError, match=r"neuron 256 out of range \[0, 256\)"):
        promoted_tokens(scratch_gpt2, 0, [256])
