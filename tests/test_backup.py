"""Backup heads and self-repair: pairwise ablation and direct effects against hand-written hooks and
the residual-stream algebra, the bridge against our model on the same weights, and the embedded
model's layer-1 induction heads measured as one backup group."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from analyses.core.execution import executing
from analyses.roles.backup import (backup_direct_effect_rise, backup_groups, backup_report, direct_and_total_effects,
                                   pairwise_ablation)
from analyses.core.metrics import logit_diff_metric, loss_metric
from analyses.core.probes import probes_for
from analyses.core.stats import percentile_bounds, resample_weights
from interp import GPTConfig, GPTModel, load_model
from interp.errors import UserError
from hand_checks import compensating_model


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


def test_backup_groups_are_connected_components_of_superadditive_pairs_that_compensate():
    pairs = pd.DataFrame({"a": ["L1H0", "L1H1", "L0H2", "L1H0"], "b": ["L1H1", "L1H3", "L0H3", "L0H2"],
                          "excess": [0.2, 0.06, 0.5, 0.01], "compensates": True})
    pairs = pairs.assign(excess_ci_low=pairs["excess"] - 0.01, excess_ci_high=pairs["excess"] + 0.01)
    assert backup_groups(pairs, 0.05) == [["L0H2", "L0H3"], ["L1H0", "L1H1", "L1H3"]]
    assert backup_groups(pairs, 0.1) == [["L0H2", "L0H3"], ["L1H0", "L1H1"]]
    assert backup_groups(pairs, 1.0) == []
    unsure = pairs.assign(excess_ci_low=[0.1, -0.01, 0.4, 0.0])  # L1H1-L1H3's interval holds 0: it joins nothing
    assert backup_groups(unsure, 0.05) == [["L0H2", "L0H3"], ["L1H0", "L1H1"]]
    # superadditive but neither head's attribution rises when the other is ablated: not backup
    assert backup_groups(pairs.assign(compensates=[True, True, False, True]), 0.05) == [["L1H0", "L1H1", "L1H3"]]


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


def test_embedded_induction_heads_are_superadditive_but_do_not_back_each_other_up(toy_probes):
    """Measured: each layer-1 induction head alone costs 0.03-0.27 nats (position-aligned mean
    ablation), the eight together ~6.5 nats: 18 of the 28 pairs are superadditive. But in one
    layer neither head of a pair reads what the other writes, so neither's direct logit attribution
    can rise when the other is ablated (the rise is exactly 0): the loss saturates, nothing
    compensates, and there is no backup group."""
    model, probes = toy_probes
    metric = loss_metric(probes.tokens, probes.predictable)
    heads = [(1, h) for h in range(8)]
    pairs, groups = backup_report(model, probes, heads, "mean_aligned", metric, progress=False)
    singles = pd.concat([pairs["effect_a"], pairs["effect_b"]])
    assert singles.between(0, 1).all()
    superadditive = pairs["excess"] >= 0.05
    assert superadditive.sum() >= 15  # 18 of the 28 pairs
    assert (pairs.loc[superadditive, ["rise_ab", "rise_ba"]] == 0).all().all()
    assert not pairs["compensates"].any() and not pairs["backs"].any() and groups.empty


def test_backup_report_groups_a_head_and_the_partner_that_covers_for_it():
    """``compensating_model`` (L1H0 writes +1 along the answer's logit exactly when L0H0 does not),
    metric logit(0) - logit(1) so that losing the answer raises it as a loss does: each head alone
    costs nothing (the other covers), both together +1, and L1H0's attribution rises by -1 (the
    side of L0H0's own, -1) when L0H0 is zeroed: one backup group of the two; L1H1 joins nothing."""
    model = compensating_model()
    tokens = torch.randint(300, (6, 8), generator=torch.Generator().manual_seed(0))
    pairs, groups = backup_report(model, tokens, [(0, 0), (1, 0), (1, 1)], "zero", logit_diff_metric(0, 1),
                                  progress=False)
    row = pairs.set_index(["a", "b"]).loc[("L0H0", "L1H0")]
    assert (row.effect_a, row.effect_b, row.joint) == pytest.approx((0.0, 0.0, 1.0), abs=1e-6)
    assert row.rise_ab == pytest.approx(-1.0) and row.rise_ba == 0 and row.compensates and row.backs
    assert list(groups["heads"]) == ["L0H0;L1H0"]


def test_embedded_previous_token_head_acts_through_later_heads(toy_probes):
    """L0H3 (previous-token) matters only through layer 1: direct ~0, total > 1 nat; the last
    layer's heads have nothing downstream, so direct = total."""
    model, probes = toy_probes
    metric = loss_metric(probes.tokens, probes.predictable)
    effects = direct_and_total_effects(model, probes, None, "mean_aligned", metric, progress=False).set_index(["layer", "head"])
    assert abs(effects.loc[(0, 3), "direct"]) < 0.05 and effects.loc[(0, 3), "total"] > 1
    last = effects.loc[1]
    assert (last["direct"] - last["total"]).abs().max() < 1e-5


def frozen_downstream_metric(model, tokens, metric, layer: int, head: int, source: torch.Tensor) -> float:
    """The naive direct effect (the computation before the final-residual shortcut): rerun the whole
    model with head (layer, head)'s z replaced by ``source`` (batch, pos, d_head) and every later
    hook_z and every hook_mlp_out from ``layer`` on held at its clean value, by hand-written hooks."""
    n_layers = model.cfg.n_layers
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens)

    def ablate(z, hook):
        z = z.clone()
        z[:, :, head] = source
        return z

    def frozen(name):
        return lambda activation, hook: cache[name]

    hooks = [(f"blocks.{layer}.attn.hook_z", ablate)]
    hooks += [(f"blocks.{l}.attn.hook_z", frozen(f"blocks.{l}.attn.hook_z")) for l in range(layer + 1, n_layers)]
    hooks += [(f"blocks.{l}.hook_mlp_out", frozen(f"blocks.{l}.hook_mlp_out")) for l in range(layer, n_layers)
              if f"blocks.{l}.hook_mlp_out" in model.hook_dict]
    with torch.no_grad():
        return metric(model.run_with_hooks(tokens, fwd_hooks=hooks)).item()


@pytest.mark.parametrize("knobs", [
    dict(),  # GPT-2: LayerNorm, learned positions, sequential blocks with MLPs, tied
    dict(parallel_attn_mlp=True, positional_embedding_type="rotary", rotary_dim=4, tie_word_embeddings=False,
         unembed_bias=True),  # GPT-NeoX / Phi: parallel attention + MLP, an unembedding bias
    dict(normalization_type="RMS", gated_mlp=True, act_fn="silu", positional_embedding_type="rotary",
         n_key_value_heads=2, qkv_bias=False, attn_out_bias=False, mlp_bias=False,
         tie_word_embeddings=False),  # Llama: RMS norm, SwiGLU, grouped-query
])
def test_direct_effects_from_the_final_residual_equal_rerunning_the_blocks(knobs):
    """The direct effect read off the final residual (clean final residual + the head's changed write,
    through the recomputed final norm and the unembedding) equals rerunning every block after the head
    with all later head outputs and MLP outputs frozen, to float error, on a loss that reads only some
    positions (so only those are unembedded) and with position-aligned mean ablation."""
    from interp import GPTConfig, GPTModel

    torch.manual_seed(3)
    model = GPTModel(GPTConfig(d_vocab=300, n_ctx=32, d_model=32, n_heads=4, n_layers=3, **knobs)).eval()
    probes = probes_for(model, 6, 24, seed=2)
    metric = loss_metric(probes.tokens, probes.predictable)
    effects = direct_and_total_effects(model, probes, None, "mean", metric, progress=False, memory_mb=0.05)
    with torch.no_grad():
        _, cache = model.run_with_cache(probes.tokens)
    baseline = metric(model(probes.tokens)).item()
    for row in effects.itertuples():
        z = cache[f"blocks.{row.layer}.attn.hook_z"][:, :, row.head]  # (batch, pos, d_head)
        others = (z.sum(0, keepdim=True) - z) / (z.shape[0] - 1)  # leave-one-out mean, as "mean" ablation
        naive = frozen_downstream_metric(model, probes.tokens, metric, row.layer, row.head, others) - baseline
        assert row.direct == pytest.approx(naive, abs=2e-5), (row.layer, row.head)
    assert effects["direct"].abs().max() > 1e-3  # the heads move the loss: the comparison is not of zeros
    # the MLPs react in the total effect (even the last layer's), not in the direct one
    assert (effects["direct"] - effects["total"]).abs().max() > 1e-3


@pytest.mark.parametrize("kind", ["plain", "logit_diff"])
def test_direct_effects_with_other_metrics_equal_rerunning_the_blocks(kind):
    """The same agreement for a metric that reads every position and cannot be split over prompts (a
    plain callable: full logits, every prompt at once) and for a logit difference (one position,
    split over prompts by the budget)."""
    from analyses.core.metrics import logit_diff_metric
    from interp import GPTConfig, GPTModel

    torch.manual_seed(4)
    model = GPTModel(GPTConfig(d_vocab=300, n_ctx=32, d_model=32, n_heads=4, n_layers=2)).eval()
    tokens = torch.randint(0, 300, (5, 16), generator=torch.Generator().manual_seed(1))
    metric = ((lambda logits: logits[:, :, 7].float().mean() - logits[:, :, 9].float().mean()) if kind == "plain"
              else logit_diff_metric(tokens[:, 3], tokens[:, 4], position=-2))
    effects = direct_and_total_effects(model, tokens, None, "mean", metric, progress=False, memory_mb=0.05)
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens)
        baseline = metric(model(tokens)).item()
    for row in effects.itertuples():
        z = cache[f"blocks.{row.layer}.attn.hook_z"][:, :, row.head]
        others = (z.sum(0, keepdim=True) - z) / (z.shape[0] - 1)
        naive = frozen_downstream_metric(model, tokens, metric, row.layer, row.head, others) - baseline
        assert row.direct == pytest.approx(naive, abs=2e-5), (row.layer, row.head)
    assert effects["direct"].abs().max() > 1e-4


def mlp_ablated_metric(model, tokens, metric, layer: int, source: torch.Tensor, freeze: bool) -> float:
    """The naive MLP effect: rerun the whole model with layer ``layer``'s hook_mlp_out replaced by
    ``source`` (batch, pos, d_model), with ``freeze`` also every later hook_z and hook_mlp_out held at
    its clean value, by hand-written hooks."""
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens)
    later = range(layer + 1, model.cfg.n_layers) if freeze else range(0)
    frozen = [name for l in later for name in (f"blocks.{l}.attn.hook_z", f"blocks.{l}.hook_mlp_out")]
    hooks = [(f"blocks.{layer}.hook_mlp_out", lambda activation, hook: source)]
    hooks += [(name, lambda activation, hook, name=name: cache[name]) for name in frozen]
    with torch.no_grad():
        return metric(model.run_with_hooks(tokens, fwd_hooks=hooks)).item()


@pytest.mark.parametrize("knobs", [
    dict(),
    dict(parallel_attn_mlp=True, positional_embedding_type="rotary", rotary_dim=4, tie_word_embeddings=False),
    dict(normalization_type="RMS", gated_mlp=True, act_fn="silu", positional_embedding_type="rotary",
         n_key_value_heads=2, qkv_bias=False, attn_out_bias=False, mlp_bias=False, tie_word_embeddings=False),
])
def test_mlp_direct_and_total_effects_equal_hand_hooks(knobs):
    """With ``mlps``, each MLP's total effect is the loss with its output mean-ablated (leave-one-out)
    and its direct effect the same with every later head and MLP output frozen, both as hand-written
    hooks compute them; the heads' rows are the ones a call without MLPs gives."""
    from interp import GPTConfig, GPTModel

    torch.manual_seed(6)
    model = GPTModel(GPTConfig(d_vocab=300, n_ctx=32, d_model=32, n_heads=4, n_layers=3, **knobs)).eval()
    probes = probes_for(model, 6, 24, seed=2)
    metric = loss_metric(probes.tokens, probes.predictable)
    effects = direct_and_total_effects(model, probes, None, "mean", metric, mlps=True, progress=False, memory_mb=0.05)
    heads_only = direct_and_total_effects(model, probes, None, "mean", metric, progress=False, memory_mb=0.05)
    assert list(effects["kind"]) == ["head"] * 12 + ["mlp"] * 3
    assert list(effects["component"][-3:]) == ["L0 MLP", "L1 MLP", "L2 MLP"] and effects["head"][12:].isna().all()
    pd.testing.assert_frame_equal(effects.iloc[:12], heads_only)
    with torch.no_grad():
        _, cache = model.run_with_cache(probes.tokens)
        baseline = metric(model(probes.tokens)).item()
    for row in effects.iloc[12:].itertuples():
        out = cache[f"blocks.{row.layer}.hook_mlp_out"]
        others = (out.sum(0, keepdim=True) - out) / (out.shape[0] - 1)
        for freeze, measured in ((False, row.total), (True, row.direct)):
            naive = mlp_ablated_metric(model, probes.tokens, metric, row.layer, others, freeze) - baseline
            assert measured == pytest.approx(naive, abs=2e-5), (row.layer, freeze)
    mlps = effects.iloc[12:]
    assert mlps["total"].abs().min() > 5e-4  # the MLPs move the loss: the comparison is not of zeros
    assert (mlps["direct"].iloc[:2] - mlps["total"].iloc[:2]).abs().max() > 1e-4  # later layers react
    assert abs(mlps["direct"].iloc[2] - mlps["total"].iloc[2]) < 1e-5  # nothing after the last MLP


def test_mlp_effects_on_the_bridge_equal_our_model(scratch_gpt2, bridge_gpt2, prompts):
    """The bridge reruns the blocks with the later outputs frozen (``frozen_downstream_run``), our model
    reads the final residual: the same MLP effects on the same weights."""
    ours = direct_and_total_effects(scratch_gpt2, prompts, [(0, 1)], "zero", mlps=True, progress=False)
    theirs = direct_and_total_effects(bridge_gpt2, prompts, [(0, 1)], "zero", mlps=True, progress=False)
    assert list(ours["component"]) == ["L0H1", *(f"L{l} MLP" for l in range(scratch_gpt2.cfg.n_layers))]
    assert (ours[["total", "direct"]] - theirs[["total", "direct"]]).abs().max().max() < 1e-4
    assert ours["direct"].abs().max() > 1e-3


@pytest.mark.parametrize("knobs", [
    dict(),  # LayerNorm with its bias, tied
    dict(normalization_type="RMS", tie_word_embeddings=False, unembed_bias=True),
    dict(normalization_type=None, tie_word_embeddings=False),
])
def test_split_readout_equals_the_unembedding(knobs):
    """The final norm + unembedding split into a linear part and a per-row scale reproduces
    ``model.unembed`` on a residual plus a change, the change's linear part taken apart (and a head's
    through its own (d_head, vocab) readout), for every final norm ``GPTModel`` has."""
    from analyses.roles.readout import FinalReadout
    from interp import GPTConfig, GPTModel

    torch.manual_seed(7)
    model = GPTModel(GPTConfig(d_vocab=200, n_ctx=16, d_model=24, n_heads=3, n_layers=1, **knobs)).eval()
    for param in model.parameters():  # norm weights and biases away from their 1 / 0 start
        param.data.add_(0.1 * torch.randn_like(param))
    readout = FinalReadout(model)
    assert FinalReadout.exact_for(model)
    final, dz = torch.randn(4, 5, 24), torch.randn(4, 5, 8)
    W_O = model.blocks[0].attn.W_O[1].detach()  # (d_head, d_model)
    moved = final + dz @ W_O
    split = readout.logits(readout.linear(final), dz, readout.head_readout(W_O), readout.scale(moved))
    change = torch.randn(4, 5, 24)  # a residual change (an MLP's) through the whole readout
    whole = readout.logits(readout.linear(final), readout.normed(change), readout.readout, readout.scale(final + change))
    with torch.no_grad():
        assert (split - model.unembed(moved)).abs().max() < 1e-4
        assert (whole - model.unembed(final + change)).abs().max() < 1e-4
    unembedding = model.embed.weight if model.cfg.tie_word_embeddings else model.lm_head.weight
    assert readout.readout.data_ptr() == unembedding.data_ptr()  # the model's own weight: no (d_model, vocab) copy
    assert not FinalReadout.exact_for(model.to(torch.bfloat16))


@pytest.mark.parametrize("knobs", [
    dict(),
    dict(normalization_type="RMS", gated_mlp=True, act_fn="silu", positional_embedding_type="rotary",
         n_key_value_heads=2, tie_word_embeddings=False, unembed_bias=True),
])
def test_direct_effects_through_the_split_readout_equal_whole_unembeddings(knobs, monkeypatch):
    """Every head's and MLP's direct effect through the split readout (the default on float32) equals
    the one that unembeds each changed final residual whole, to 1e-5 nats (the float32 rounding of a
    loss near 6), on the loss of the predictable tokens (read positions only), with budgets that split
    the prompts and that do not. A budget the readouts would take over half of unembeds whole (the
    memory bound's case: tests/test_memory_bound.py)."""
    from analyses.roles.readout import FinalReadout
    from interp import GPTConfig, GPTModel

    torch.manual_seed(8)
    model = GPTModel(GPTConfig(d_vocab=300, n_ctx=32, d_model=32, n_heads=4, n_layers=3, **knobs)).eval()
    probes = probes_for(model, 6, 24, seed=2)
    metric = loss_metric(probes.tokens, probes.predictable)
    for budget in (0.2, 2.0):  # both leave the split's readouts room, so it is the one used
        assert FinalReadout.held_mb(model) <= budget / 2
        fast = direct_and_total_effects(model, probes, None, "mean", metric, mlps=True, progress=False,
                                        memory_mb=budget)
        with monkeypatch.context() as patched:
            patched.setattr(FinalReadout, "exact_for", staticmethod(lambda model: False))
            whole = direct_and_total_effects(model, probes, None, "mean", metric, mlps=True, progress=False,
                                             memory_mb=budget)
        assert (fast["direct"] - whole["direct"]).abs().max() < 1e-5
        assert whole["direct"].abs().max() > 1e-3  # the comparison is not of zeros


def test_first_order_effects_are_the_derivative_along_the_ablation():
    """``first_order_effects`` equals a central finite difference of the metric along each head's and
    MLP's ablation (z + eps (source - z) by hand-written hooks, float64), on a loss read at some positions
    with prompts split over budgets."""
    from analyses.interventions.ablation import MLP, prepare_ablation
    from analyses.roles.backup import first_order_effects
    from interp import GPTConfig, GPTModel

    torch.manual_seed(9)
    model = GPTModel(GPTConfig(d_vocab=300, n_ctx=32, d_model=32, n_heads=4, n_layers=2)).double().eval()
    probes = probes_for(model, 4, 20, seed=3)
    metric = loss_metric(probes.tokens, probes.predictable)
    components = [(0, 1), (1, 3), MLP(0)]
    ablation = prepare_ablation(model, probes, "mean", metric, mlps=True)
    _, cache = model.run_with_cache(probes.tokens)

    def moved(component, eps: float) -> float:
        name = f"blocks.{component.layer}.hook_mlp_out" if isinstance(component, MLP) else \
            f"blocks.{component[0]}.attn.hook_z"
        source = ablation.sources[name]

        def hook(activation, hook):
            activation = activation.clone()
            if isinstance(component, MLP):
                return activation + eps * (source - activation)
            activation[:, :, component[1]] += eps * (source[:, :, component[1]] - activation[:, :, component[1]])
            return activation

        with torch.no_grad():
            logits = model.run_with_hooks(probes.tokens, fwd_hooks=[(name, hook)])[:, :-1]
        mask = probes.predictable[:, 1:]  # the loss metric in float64 (it rounds to float32 itself)
        return -logits.log_softmax(-1)[mask].gather(-1, probes.tokens[:, 1:][mask][:, None]).mean().item()

    for budget in (0.02, 64):
        with executing(memory_mb=budget):
            estimate = first_order_effects(ablation, components)
        for component, value in zip(components, estimate.tolist()):
            eps = 1e-4
            assert value == pytest.approx((moved(component, eps) - moved(component, -eps)) / (2 * eps), abs=1e-6)
    assert estimate.abs().min() > 1e-4


def test_screened_total_effects_are_exact_where_they_matter(knobs=dict(normalization_type="RMS")):
    """With ``screen``, a component whose first-order estimate or direct effect reaches it has its
    exact total effect (equal to the unscreened run's), every other one its estimate; the flag says which."""
    from analyses.interventions.ablation import MLP, prepare_ablation
    from analyses.roles.backup import first_order_effects
    from interp import GPTConfig, GPTModel

    torch.manual_seed(10)
    model = GPTModel(GPTConfig(d_vocab=300, n_ctx=32, d_model=32, n_heads=4, n_layers=3, **knobs)).eval()
    probes = probes_for(model, 6, 24, seed=2)
    metric = loss_metric(probes.tokens, probes.predictable)
    full = direct_and_total_effects(model, probes, None, "mean", metric, mlps=True, progress=False)
    screen = float(full["direct"].abs().median())
    screened = direct_and_total_effects(model, probes, None, "mean", metric, mlps=True, progress=False, screen=screen)
    components = [(int(r.layer), int(r.head)) if r.kind == "head" else MLP(int(r.layer)) for r in full.itertuples()]
    estimate = first_order_effects(prepare_ablation(model, probes, "mean", metric, mlps=True), components)
    chosen = (estimate.abs().numpy() >= screen) | (full["direct"].abs().to_numpy() >= screen)
    assert full["total_exact"].all() and (screened["total_exact"].to_numpy() == chosen).all()
    assert 0 < chosen.sum() < len(chosen)
    exact, rest = screened[chosen], screened[~chosen]
    assert (exact["total"] - full.loc[chosen, "total"]).abs().max() < 1e-6
    assert (rest["total"].to_numpy() - estimate.numpy()[~chosen]).__abs__().max() < 1e-6
    assert (screened["direct"] - full["direct"]).abs().max() < 1e-7


# ------------------------------------------------------------------ backup as Wang et al. test it
def _by_hand_attributions(model, tokens, head, partner, readout_grad):
    """The partner's direct logit attribution per prompt, unedited and with ``head``'s z zeroed, and
    the head's own, by hand: hook_z from run_with_cache (the ablated run by a hand-written hook),
    the write z @ W_O, the final LayerNorm with its scale held at the clean run's (centre, times
    its weight, over sqrt(var + eps)) and the unembedding, dotted with ``readout_grad`` (batch, pos,
    vocab): the gradient of each prompt's metric with respect to its clean logits."""
    def zero(z, hook):
        z = z.clone()
        z[:, :, head[1]] = 0
        return z

    with torch.no_grad():
        _, clean = model.run_with_cache(tokens)
        with model.hooks(fwd_hooks=[(f"blocks.{head[0]}.attn.hook_z", zero)]):
            _, ablated = model.run_with_cache(tokens)
    final = clean[f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"]
    scale = (final.var(-1, unbiased=False, keepdim=True) + model.ln_final.eps).sqrt()

    @torch.no_grad()
    def attribution(cache, layer, index):
        write = cache[f"blocks.{layer}.attn.hook_z"][:, :, index] @ model.blocks[layer].attn.W_O[index]
        normed = (write - write.mean(-1, keepdim=True)) * model.ln_final.weight / scale
        return (readout_grad * (normed @ model.embed.weight.T)).sum((1, 2)).double()

    return attribution(clean, *partner), attribution(ablated, *partner), attribution(clean, *head)


@pytest.mark.parametrize("kind", ["logit_diff", "loss"])
def test_a_partners_attribution_rise_equals_a_hand_computation(kind):
    """On a random-init GPT-2-shaped model, head (0, 1) zero-ablated and partner (2, 3): the
    partner's attribution unedited and ablated, the head's, and the rise with its paired interval
    (the same prompt resamples for both runs), against hand-written hooks and the unembedding; for
    a logit difference the gradient is +1 / -1 on the two ids at the last position, for the loss it
    is autograd's on the clean logits (the readout is held at the clean run in both runs)."""
    torch.manual_seed(0)
    model = GPTModel(GPTConfig(d_vocab=300, n_ctx=12, d_model=16, n_heads=4, n_layers=3)).eval()
    with torch.no_grad():
        for block in model.blocks:
            block.attn.out_proj.weight.mul_(5.0)  # heads that move the later ones
    tokens = torch.randint(300, (12, 10), generator=torch.Generator().manual_seed(1))
    correct, incorrect = tokens[:, 0], tokens[:, 1]
    with torch.no_grad():
        logits = model(tokens)
    grad = torch.zeros_like(logits)
    if kind == "logit_diff":
        metric = logit_diff_metric(correct, incorrect)
        rows = torch.arange(len(tokens))
        grad[rows, -1, correct] += 1
        grad[rows, -1, incorrect] -= 1
    else:
        metric = loss_metric(tokens)
        leaf = logits.clone().requires_grad_(True)
        losses = torch.nn.functional.cross_entropy(leaf[:, :-1].transpose(1, 2), tokens[:, 1:], reduction="sum")
        grad, = torch.autograd.grad(losses, leaf)
    found = backup_direct_effect_rise(model, tokens, metric, (0, 1), (2, 3), "zero", n_boot=200, seed=3)
    clean, ablated, own = _by_hand_attributions(model, tokens, (0, 1), (2, 3), grad)
    counts = torch.full((len(tokens),), 1.0 if kind == "logit_diff" else tokens.shape[1] - 1, dtype=torch.float64)
    assert found["partner_dla"] == pytest.approx(float(clean.sum() / counts.sum()), abs=1e-5)
    assert found["partner_dla_ablated"] == pytest.approx(float(ablated.sum() / counts.sum()), abs=1e-5)
    assert found["head_dla"] == pytest.approx(float(own.sum() / counts.sum()), abs=1e-5)
    assert found["rise"] == pytest.approx(float((ablated - clean).sum() / counts.sum()), abs=1e-5)
    assert abs(found["rise"]) > 1e-3  # the ablation reached the partner
    weights = resample_weights(len(tokens), 200, 3)
    low, high = percentile_bounds((weights @ (ablated - clean)) / (weights @ counts))
    assert (found["rise_ci_low"], found["rise_ci_high"]) == pytest.approx((float(low), float(high)), abs=1e-5)
    # mean ablation: each head's attribution is that of its write beyond its leave-one-out mean z
    mean = backup_direct_effect_rise(model, tokens, metric, (0, 1), (2, 3), "mean", n_boot=50)
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens)
    z = cache["blocks.0.attn.hook_z"][:, :, 1]
    others = (z.sum(0, keepdim=True) - z) / (len(tokens) - 1)
    final = cache[f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"]
    scale = (final.var(-1, unbiased=False, keepdim=True) + model.ln_final.eps).sqrt()
    with torch.no_grad():
        write = (z - others) @ model.blocks[0].attn.W_O[1]
        normed = (write - write.mean(-1, keepdim=True)) * model.ln_final.weight / scale
        own_mean = (grad * (normed @ model.embed.weight.T)).sum((1, 2)).double()
    assert mean["head_dla"] == pytest.approx(float(own_mean.sum() / counts.sum()), abs=1e-5)
    same_layer = backup_direct_effect_rise(model, tokens, metric, (2, 0), (2, 3), "zero", n_boot=50)
    assert same_layer["rise"] == 0 and not same_layer["compensates"]  # a head of the same layer reads nothing it wrote


def test_a_partner_that_covers_for_the_head_compensates_and_one_that_writes_nothing_does_not():
    """On ``compensating_model``, with logit(1) - logit(0) at the last position: L1H0's attribution
    rises by exactly +1 when L0H0 is zeroed (L0H0's own is +1: it writes what L0H0 wrote), so it
    compensates; L1H1, which writes nothing, does not."""
    model = compensating_model()
    tokens = torch.randint(300, (6, 8), generator=torch.Generator().manual_seed(0))
    metric = logit_diff_metric(1, 0)
    found = backup_direct_effect_rise(model, tokens, metric, (0, 0), (1, 0), "zero", n_boot=100)
    assert found["head_dla"] == pytest.approx(1.0) and found["partner_dla"] == pytest.approx(0.0, abs=1e-6)
    assert found["rise"] == pytest.approx(1.0) and found["compensates"]
    assert not backup_direct_effect_rise(model, tokens, metric, (0, 0), (1, 1), "zero", n_boot=100)["compensates"]
