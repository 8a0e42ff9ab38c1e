"""Backup heads and self-repair: pairwise ablation and direct effects against hand-written hooks and
the residual-stream algebra, the bridge against our model on the same weights, and the embedded
model's layer-1 induction heads measured as one backup group."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from analyses.roles.backup import backup_groups, backup_report, direct_and_total_effects, pairwise_ablation
from analyses.core.metrics import loss_metric
from analyses.core.probes import probes_for
from interp import load_model
from interp.errors import UserError


@pytest.fixture(scope="module")
def prompts():
    return torch.randint(0, 256, (3, 12), generator=torch.Generator().manual_seed(5))


def zeroed_loss(model, tokens, heads) -> float:
    """Mean next-token loss with ``heads`` zero-ablated, by hand-written hooks."""
    def hook_for(layer):
        def hook(z, hook):
            z = z.clone()
            for l, h in heads:
                if l == layer:
                    z[:, :, h] = 0
            return z
        return hook

    hooks = [(f"blocks.{l}.attn.hook_z", hook_for(l)) for l in {l for l, _ in heads}]
    with torch.no_grad():
        return loss_metric(tokens)(model.run_with_hooks(tokens, fwd_hooks=hooks)).item()


def test_pairwise_ablation_matches_hand_hooks(scratch_gpt2, bridge_gpt2, prompts):
    heads = [(0, 1), (1, 2), (1, 3)]
    pairs = pairwise_ablation(scratch_gpt2, prompts, heads, "zero")
    clean = zeroed_loss(scratch_gpt2, prompts, [])
    assert len(pairs) == 3 and list(pairs["a"]) == ["L0H1", "L0H1", "L1H2"]
    for row in pairs.itertuples():
        a, b = (row.layer_a, row.head_a), (row.layer_b, row.head_b)
        assert row.effect_a == pytest.approx(zeroed_loss(scratch_gpt2, prompts, [a]) - clean, abs=1e-5)
        assert row.joint == pytest.approx(zeroed_loss(scratch_gpt2, prompts, [a, b]) - clean, abs=1e-5)
        assert row.excess == pytest.approx(row.joint - row.effect_a - row.effect_b, abs=1e-6)
    on_bridge = pairwise_ablation(bridge_gpt2, prompts, heads, "zero")
    assert (on_bridge["joint"] - pairs["joint"]).abs().max() < 1e-4
    with pytest.raises(UserError, match="at least 2 heads"):
        pairwise_ablation(scratch_gpt2, prompts, [(0, 1)])


def test_backup_groups_are_connected_components():
    pairs = pd.DataFrame({"a": ["L1H0", "L1H1", "L0H2", "L1H0"], "b": ["L1H1", "L1H3", "L0H3", "L0H2"],
                          "excess": [0.2, 0.06, 0.5, 0.01]})
    assert backup_groups(pairs, 0.05) == [["L0H2", "L0H3"], ["L1H0", "L1H1", "L1H3"]]
    assert backup_groups(pairs, 0.1) == [["L0H2", "L0H3"], ["L1H0", "L1H1"]]
    assert backup_groups(pairs, 1.0) == []


def test_direct_effect_is_the_head_output_through_the_unembedding(scratch_gpt2, bridge_gpt2, prompts):
    """Direct effect of zero-ablating a head = the loss when only the final residual moves, by
    exactly minus the head's write (z_h W_O[h]), and nothing downstream reacts."""
    effects = direct_and_total_effects(scratch_gpt2, prompts, None, "zero")
    metric = loss_metric(prompts)
    last = f"blocks.{scratch_gpt2.cfg.n_layers - 1}.hook_resid_post"
    with torch.no_grad():
        _, cache = scratch_gpt2.run_with_cache(prompts)
        clean = metric(scratch_gpt2.unembed(cache[last])).item()
        for row in effects.itertuples():
            z = cache[f"blocks.{row.layer}.attn.hook_z"][:, :, row.head]
            write = z @ scratch_gpt2.blocks[row.layer].attn.W_O[row.head]
            direct = metric(scratch_gpt2.unembed(cache[last] - write)).item() - clean
            assert row.direct == pytest.approx(direct, abs=1e-5)
            assert row.total == pytest.approx(zeroed_loss(scratch_gpt2, prompts, [(row.layer, row.head)]) - clean, abs=1e-5)
    assert (effects["self_repair"] - (effects["direct"] - effects["total"])).abs().max() < 1e-7
    on_bridge = direct_and_total_effects(bridge_gpt2, prompts, None, "zero")
    assert (on_bridge[["total", "direct"]] - effects[["total", "direct"]]).abs().max().max() < 1e-4


@pytest.fixture(scope="module")
def toy_probes():
    model = load_model("toy")
    return model, probes_for(model, 64, seed=0)


def test_embedded_induction_heads_back_each_other_up(toy_probes):
    """Measured: each layer-1 induction head alone costs 0.03-0.27 nats (position-aligned mean
    ablation), the eight together ~6.5 nats; every pair is super-additive or nearly so, and the
    eight form one backup group."""
    model, probes = toy_probes
    metric = loss_metric(probes.tokens, probes.predictable)
    heads = [(1, h) for h in range(8)]
    pairs, groups = backup_report(model, probes, heads, "mean_aligned", metric, progress=False)
    singles = pd.concat([pairs["effect_a"], pairs["effect_b"]])
    assert singles.between(0, 1).all()
    assert len(groups) == 1 and groups["heads"].iloc[0] == ";".join(f"L1H{h}" for h in range(8))
    assert groups["joint"].iloc[0] > 4 and groups["sum_single"].iloc[0] < 1.5


def test_embedded_previous_token_head_acts_through_later_heads(toy_probes):
    """L0H3 (previous-token) matters only through layer 1: direct ~0, total > 1 nat; the last
    layer's heads have nothing downstream, so direct = total."""
    model, probes = toy_probes
    metric = loss_metric(probes.tokens, probes.predictable)
    effects = direct_and_total_effects(model, probes, None, "mean_aligned", metric, progress=False).set_index(["layer", "head"])
    assert abs(effects.loc[(0, 3), "direct"]) < 0.05 and effects.loc[(0, 3), "total"] > 1
    last = effects.loc[1]
    assert (last["direct"] - last["total"]).abs().max() < 1e-5
