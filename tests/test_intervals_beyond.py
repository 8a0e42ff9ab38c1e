"""Intervals beyond the intervention floor (architecture §4.12): the role heads' causal check, direct and
total effects, path patching, neuron and MLP ablation each carry a 95% interval over prompts equal to
a bootstrap written out by hand over per-prompt effects measured with hand-written hooks; "no causal
effect" follows the interval, not the effect's size."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from analyses.circuits.path_patching import path_patch
from analyses.components.decompose import mlp_ablation
from analyses.components.neurons import neuron_effects
from analyses.core.metrics import logit_diff_metric, loss_metric
from analyses.core.probes import probes_for
from analyses.roles.backup import direct_and_total_effects
from analyses.roles.causal_check import ablation_effects
from analyses.roles.classify import NO_EFFECT, head_table
from interp import load_model
from hand_checks import bootstrap_by_hand, zero_head


@pytest.fixture(scope="module")
def toy():
    return load_model("toy")




def losses(logits: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """logits (batch, pos, vocab) -> each prompt's summed next-token loss over ``mask``'s predicted
    tokens and how many, in float64."""
    each = -torch.log_softmax(logits[:, :-1].double(), -1).gather(-1, tokens[:, 1:, None])[..., 0]
    kept = mask[:, 1:]
    return (each * kept).sum(1).numpy(), kept.sum(1).double().numpy()


def assert_interval(row, effects, counts, seed: int = 0):
    low, high = bootstrap_by_hand(effects, counts, seed)
    assert row[0] == pytest.approx(low, abs=1e-6) and row[1] == pytest.approx(high, abs=1e-6)
    assert row[0] < row[1]


def test_causal_check_interval_is_the_hand_bootstrap(toy):
    probes = probes_for(toy, 8, 24, seed=3)
    frame = ablation_effects(toy, probes, progress=False, method="zero").set_index(["layer", "head"])
    with torch.no_grad():
        clean = losses(toy(probes.tokens), probes.tokens, probes.predictable)
        ablated = losses(toy.run_with_hooks(probes.tokens, fwd_hooks=[zero_head(1, 3)]), probes.tokens,
                         probes.predictable)
    row = frame.loc[(1, 3)]
    assert row["ablation_effect"] == pytest.approx((ablated[0] - clean[0]).sum() / clean[1].sum(), abs=1e-5)
    assert_interval((row["ablation_ci_low"], row["ablation_ci_high"]), ablated[0] - clean[0], clean[1])
    assert row["ablation_n_prompts"] == 8


def test_no_causal_effect_follows_the_interval():
    """A tiny effect that every prompt shows is an effect; a larger one whose interval covers 0 is
    not (the old rule, |effect| < 0.01 nats, said the reverse of both)."""
    scores = pd.DataFrame({"layer": [0, 0], "head": [0, 1], "measure": "induction", "score": [0.9, 0.9],
                           "ci_low": [0.8, 0.8], "ci_high": [1.0, 1.0], "chance": 0.1})
    effects = pd.DataFrame({"layer": [0, 0], "head": [0, 1], "ablation_effect": [0.002, 0.5],
                            "ablation_ci_low": [0.001, -0.1], "ablation_ci_high": [0.003, 1.1],
                            "ablation_n_prompts": [16, 16]})
    table = head_table(scores, effects, 0.4).set_index("head")
    assert table.loc[0, "causal"] == "" and table.loc[1, "causal"] == NO_EFFECT
    with pytest.raises(ValueError, match="ablation_ci_low"):
        head_table(scores, effects[["layer", "head", "ablation_effect"]], 0.4)


def test_direct_total_and_self_repair_intervals_are_the_hand_bootstrap(toy):
    probes = probes_for(toy, 8, 24, seed=4)
    tokens, mask = probes.tokens, probes.predictable
    frame = direct_and_total_effects(toy, probes, [(0, 5), (1, 3)], "zero", loss_metric(tokens, mask),
                                     progress=False).set_index("component")
    with torch.no_grad():
        logits, cache = toy.run_with_cache(tokens)
        clean = losses(logits, tokens, mask)
        total = losses(toy.run_with_hooks(tokens, fwd_hooks=[zero_head(1, 3)]), tokens, mask)
        # the direct effect: only the head's own write leaves the final residual, nothing downstream reacts
        write = cache["blocks.1.attn.hook_z"][:, :, 3] @ toy.blocks[1].attn.W_O[3]
        final = cache[f"blocks.{toy.cfg.n_layers - 1}.hook_resid_post"]
        direct = losses(toy.unembed(final - write), tokens, mask)
    row = frame.loc["L1H3"]
    assert row["direct"] == pytest.approx((direct[0] - clean[0]).sum() / clean[1].sum(), abs=1e-5)
    assert_interval((row["total_ci_low"], row["total_ci_high"]), total[0] - clean[0], clean[1])
    assert_interval((row["direct_ci_low"], row["direct_ci_high"]), direct[0] - clean[0], clean[1])
    assert_interval((row["self_repair_ci_low"], row["self_repair_ci_high"]), direct[0] - total[0], clean[1])
    assert row["n_prompts"] == 8


def test_path_patching_interval_is_the_hand_bootstrap(toy):
    generator = torch.Generator().manual_seed(5)
    clean = torch.randint(1, toy.cfg.d_vocab, (8, 12), generator=generator)
    corrupted = clean.clone()
    corrupted[:, :6] = torch.randint(1, toy.cfg.d_vocab, (8, 6), generator=generator)
    metric = logit_diff_metric(clean[:, -1], clean[:, 0])
    frame = path_patch(toy, clean, corrupted, metric, senders=[(0, 2)], via="logits", progress=False)
    with torch.no_grad():
        _, clean_cache = toy.run_with_cache(clean)
        logits, cache = toy.run_with_cache(corrupted)
        write = (clean_cache["blocks.0.attn.hook_z"][:, :, 2] - cache["blocks.0.attn.hook_z"][:, :, 2]) @ \
            toy.blocks[0].attn.W_O[2]
        patched = toy.unembed(cache[f"blocks.{toy.cfg.n_layers - 1}.hook_resid_post"] + write)
    rows = torch.arange(8)

    def diffs(out):
        return (out[rows, -1, clean[:, -1]] - out[rows, -1, clean[:, 0]]).double().numpy()

    effects = diffs(patched) - diffs(logits)
    row = frame.iloc[0]
    assert row["effect"] == pytest.approx(effects.mean(), abs=1e-5)
    assert_interval((row["ci_low"], row["ci_high"]), effects, np.ones(8))
    assert row["n_prompts"] == 8


def test_neuron_and_mlp_ablation_intervals_are_the_hand_bootstrap(scratch_gpt2):
    model = scratch_gpt2
    tokens = torch.randint(0, 256, (8, 10), generator=torch.Generator().manual_seed(6))
    metric = loss_metric(tokens)
    neurons = neuron_effects(model, tokens, metric, 1, exact=3, progress=False)
    neuron = int(neurons["neuron"].iloc[0])

    def zero_neuron(post, hook):
        post = post.clone()
        post[:, :, neuron] = 0.0
        return post

    def zero_mlp(out, hook):
        return torch.zeros_like(out)

    everything = torch.ones_like(tokens, dtype=torch.bool)
    with torch.no_grad():
        clean = losses(model(tokens), tokens, everything)
        no_neuron = losses(model.run_with_hooks(tokens, fwd_hooks=[("blocks.1.mlp.hook_post", zero_neuron)]),
                           tokens, everything)
        no_mlp = losses(model.run_with_hooks(tokens, fwd_hooks=[("blocks.0.hook_mlp_out", zero_mlp)]), tokens,
                        everything)
    row = neurons.iloc[0]
    assert_interval((row["ci_low"], row["ci_high"]), no_neuron[0] - clean[0], clean[1])
    assert neurons["ci_low"].iloc[3:].isna().all() and row["n_prompts"] == 8  # not run exactly: no interval
    mlps = mlp_ablation(model, tokens, metric, progress=False).set_index("layer")
    assert_interval((mlps.loc[0, "ci_low"], mlps.loc[0, "ci_high"]), no_mlp[0] - clean[0], clean[1])
