"""Random-head controls (analyses.interventions.controls): matched sets, their effects against
hand-written hook_z hooks, the ratio's interval against a naive loop, and on the toy model."""

from __future__ import annotations

import math
from collections import Counter
from itertools import combinations

import pytest
import torch

from analyses import control_effects, matched_random_sets
from analyses.core.metrics import loss_metric
from analyses.core.probes import probes_for
from analyses.core.stats import normal_p_value, percentile_bounds, resample_weights
from analyses.interventions.controls import control_figure
from interp import GPTConfig, GPTModel, load_model
from interp.errors import UserError

N_HEADS, GROUP = 8, 4  # query heads per layer, query heads per key/value head


@pytest.fixture(scope="module")
def gqa() -> GPTModel:
    """A random-init grouped-query model whose heads write 10x what initialisation gives them, so
    their ablation effects (tenths of a nat) stand far above float32 rounding."""
    torch.manual_seed(0)
    model = GPTModel(GPTConfig(d_vocab=300, n_ctx=16, d_model=32, n_heads=N_HEADS, n_key_value_heads=N_HEADS // GROUP,
                               n_layers=3, normalization_type="RMS", positional_embedding_type="rotary",
                               tie_word_embeddings=False)).eval()
    with torch.no_grad():
        for block in model.blocks:
            block.attn.out_proj.weight.mul_(10.0)
    return model


def _kv_cells(heads) -> Counter:
    return Counter((layer, head // GROUP) for layer, head in heads)


def test_sets_match_layers_and_kv_groups_and_exclude_the_tested_heads(gqa):
    """Layers 0 and 2: every group holding tested heads has at least as many others, so each set has
    the tested set's count in every (layer, key/value group); layer 1: group 1 holds 3 tested heads
    and only 1 other, so the layer is matched by layer alone. No set holds a tested head, every head
    the rule allows is drawn, the sets differ (270 are possible); the same seed gives the same sets,
    another seed others."""
    tested = [(0, 1), (1, 4), (1, 5), (1, 6), (2, 0), (2, 5)]
    sets = matched_random_sets(gqa, tested, n_draws=50, seed=3)
    assert len(sets) == 50 and len({tuple(s) for s in sets}) == 50
    want = _kv_cells(tested)
    for drawn in sets:
        assert not set(drawn) & set(tested), drawn
        assert drawn == sorted(drawn) and len(set(drawn)) == len(drawn)
        assert Counter(layer for layer, _ in drawn) == Counter(layer for layer, _ in tested)
        cells = _kv_cells(drawn)
        assert {cell: n for cell, n in cells.items() if cell[0] != 1} == {
            cell: n for cell, n in want.items() if cell[0] != 1}, drawn
    allowed = {(0, 0), (0, 2), (0, 3), (1, 0), (1, 1), (1, 2), (1, 3), (1, 7),
               (2, 1), (2, 2), (2, 3), (2, 4), (2, 6), (2, 7)}
    assert {head for drawn in sets for head in drawn} == allowed
    assert matched_random_sets(gqa, tested, n_draws=50, seed=3) == sets
    assert matched_random_sets(gqa, tested, n_draws=50, seed=4) != sets


def test_sets_repeat_evenly_only_when_fewer_are_possible(gqa):
    """(0, 0) alone: 3 possible sets (the other heads of its key/value group), so 7 draws use each 2
    or 3 times; (0, 0) and (0, 1): the only possible set is (0, 2) and (0, 3)."""
    sets = matched_random_sets(gqa, [(0, 0)], n_draws=7, seed=0)
    assert sorted(Counter(tuple(s) for s in sets).values()) == [2, 2, 3]
    assert {tuple(s) for s in sets} == {((0, 1),), ((0, 2),), ((0, 3),)}
    assert matched_random_sets(gqa, [(0, 0), (0, 1)], n_draws=4) == [[(0, 2), (0, 3)]] * 4


def test_one_possible_set_gives_no_z(gqa):
    """(0, 0) and (0, 1): the only possible random set is (0, 2) and (0, 3), drawn 4 times; its effects
    do not spread, so there is nothing to measure the tested set's distance in: z is NaN, with no
    interval, and its p is 1 (not an infinite z from a zero standard deviation)."""
    tokens = torch.randint(300, (4, 16), generator=torch.Generator().manual_seed(0))
    control = control_effects(gqa, tokens, [(0, 0), (0, 1)], "zero", n_draws=4, n_boot=20)
    assert control.n_distinct == 1 and control.effect != control.random_effect
    assert math.isnan(control.z) and math.isnan(control.z_ci_low) and control.z_p_value == 1.0


def test_a_multi_head_model_is_matched_by_layer():
    """Without grouped-query attention every untested head of the layer is drawn."""
    torch.manual_seed(0)
    model = GPTModel(GPTConfig(d_vocab=300, n_ctx=16, d_model=32, n_heads=4, n_layers=2)).eval()
    sets = matched_random_sets(model, [(1, 0)], n_draws=3)
    assert sorted(map(tuple, sets)) == [((1, 1),), ((1, 2),), ((1, 3),)]


def test_excluded_heads_are_never_drawn(gqa):
    """``exclude`` bars heads from the pool (pool sizes by hand; groups of 4 query heads):
    layer 0, tested (0, 1) and (0, 5), excluded (0, 0), (0, 1), (0, 2), (0, 4): group 0 keeps (0, 3)
    alone, group 1 keeps (0, 6) and (0, 7), so 1 x 2 = 2 sets, 6 draws use each 3 times. Layer 1,
    tested (1, 0) and (1, 1), excluded (1, 2) and (1, 3): group 0 has no head left, so the layer is
    matched by layer alone from (1, 4) ... (1, 7): C(4, 2) = 6 sets, 12 draws use each twice. Layer 2,
    every other head excluded: refused. Without ``exclude`` the excluded heads are drawn."""
    tested, exclude = [(0, 1), (0, 5)], [(0, 0), (0, 1), (0, 2), (0, 4)]
    sets = matched_random_sets(gqa, tested, n_draws=6, exclude=exclude)
    assert Counter(map(tuple, sets)) == {((0, 3), (0, 6)): 3, ((0, 3), (0, 7)): 3}
    assert {(0, 0), (0, 2), (0, 4)} <= {head for drawn in matched_random_sets(gqa, tested, n_draws=50)
                                        for head in drawn}

    sets = matched_random_sets(gqa, [(1, 0), (1, 1)], n_draws=12, exclude=[(1, 2), (1, 3)])
    assert Counter(map(tuple, sets)) == {pair: 2 for pair in combinations([(1, h) for h in range(4, 8)], 2)}

    with pytest.raises(UserError, match=r"layer 2 has 1 tested heads and only 0 others \(7 more excluded\)"):
        matched_random_sets(gqa, [(2, 0)], exclude=[(2, h) for h in range(1, 8)])
    with pytest.raises(UserError, match="out of range"):
        matched_random_sets(gqa, [(2, 0)], exclude=[(5, 0)])


def test_control_effects_draws_no_excluded_head(gqa):
    """``control_effects`` passes ``exclude`` to its draws: tested (1, 2), excluded (1, 0), (1, 1),
    (1, 3): the tested head's group has no other head left, so every set is one of (1, 4) ... (1, 7)."""
    tokens = torch.randint(300, (4, 16), generator=torch.Generator().manual_seed(0))
    control = control_effects(gqa, tokens, [(1, 2)], "zero", n_draws=8, n_boot=10, exclude=[(1, 0), (1, 1), (1, 3)])
    assert {tuple(s) for s in control.sets} == {((1, h),) for h in range(4, 8)}
    assert control.n_distinct == 4 and control.matching == "layer-matched"


def _zeroed(model, tokens, heads, per_token: bool = False) -> torch.Tensor:
    """The next-token loss per token (batch, pos - 1) with ``heads`` zeroed at hook_z by hand."""
    def hook_for(layer):
        def zero(z, hook):
            z = z.clone()
            z[:, :, [h for l, h in heads if l == layer]] = 0.0
            return z
        return zero

    hooks = [(f"blocks.{layer}.attn.hook_z", hook_for(layer)) for layer in sorted({l for l, _ in heads})]
    with torch.no_grad():
        logits = model.run_with_hooks(tokens, fwd_hooks=hooks).double()
    return torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), tokens[:, 1:], reduction="none")


def test_effects_equal_hand_written_hooks(gqa):
    """Zero ablation of the tested set and every random set (one batched sweep) against hand-written
    hook_z hooks, each a forward of its own, on a loss that counts some tokens of each prompt: every
    effect and the random mean agree to 1e-5, the ratio to 1e-4 of itself."""
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(300, (10, 16), generator=generator)
    counted = torch.rand(10, 16, generator=generator) < 0.5
    metric = loss_metric(tokens, counted)
    tested = [(1, 2), (2, 6)]
    control = control_effects(gqa, tokens, tested, "zero", metric, n_draws=12, seed=5, n_boot=100)
    mask = counted[:, 1:].double()
    clean = _zeroed(gqa, tokens, [])
    effects = torch.stack([((_zeroed(gqa, tokens, heads) - clean) * mask).sum() / mask.sum()
                           for heads in [tested, *control.sets]])
    assert torch.allclose(torch.tensor(control.frame["effect"].to_numpy()), effects, rtol=0, atol=1e-5)
    assert control.effect == pytest.approx(float(effects[0]), abs=1e-5)
    assert control.random_effect == pytest.approx(float(effects[1:].mean()), abs=1e-5)
    assert control.ratio == pytest.approx(float(effects[0] / effects[1:].mean()), rel=1e-4)
    assert control.frame["set"].tolist() == ["tested"] + ["random"] * 12 and control.n_draws == 12
    # 9 different sets (3 heads left in each tested head's group), so 12 draws repeat some; the
    # p-value counts each different set once
    unique = {tuple(s): float(e) for s, e in zip(control.sets, effects[1:])}
    assert control.n_distinct == len(unique) == 9
    assert control.p_value == (1 + sum(abs(e) >= abs(float(effects[0])) for e in unique.values())) / 10
    assert control_figure(control).axes  # the plotting helper draws it


def test_intervals_equal_a_naive_bootstrap_over_prompts_and_draws():
    """On the toy model, the random mean's and the ratio's intervals against a naive loop over the
    same resample weights (prompts: seed, draws: seed + 1) of per-prompt loss changes computed by
    hand-written hooks; a prompt that counts nothing is left out (n_prompts)."""
    toy = load_model("toy")
    probes = probes_for(toy, n_prompts=10, seq_len=24, seed=3)
    counted = probes.predictable.clone()
    counted[4] = False  # this prompt counts nothing
    metric = loss_metric(probes.tokens, counted)
    n_boot, seed, n_draws = 100, 7, 6
    control = control_effects(toy, probes.tokens, [(1, 5)], "zero", metric, n_draws=n_draws, seed=seed,
                              n_boot=n_boot)
    assert control.n_prompts == 9 and control.n_distinct == 7
    mask = counted[:, 1:].double()
    clean = _zeroed(toy, probes.tokens, [])
    changes = torch.stack([((_zeroed(toy, probes.tokens, heads) - clean) * mask).sum(1)
                           for heads in [[(1, 5)], *control.sets]]).T[mask.sum(1) > 0]  # (prompts, 1 + draws)
    counts = mask.sum(1)[mask.sum(1) > 0]
    prompts, draws = resample_weights(len(counts), n_boot, seed), resample_weights(n_draws, n_boot, seed + 1)
    means, ratios = [], []
    for b in range(n_boot):
        tested_mean = sum(prompts[b, p] * changes[p, 0] for p in range(len(counts))) / (prompts[b] @ counts)
        random_total = sum(prompts[b, p] * draws[b, d] * changes[p, 1 + d]
                           for p in range(len(counts)) for d in range(n_draws))
        means.append(random_total / (n_draws * (prompts[b] @ counts)))
        ratios.append(tested_mean / means[-1])
    for (low, high), found in (((control.random_ci_low, control.random_ci_high), torch.stack(means)),
                               ((control.ratio_ci_low, control.ratio_ci_high), torch.stack(ratios))):
        want_low, want_high = percentile_bounds(found[:, None])
        assert (low, high) == pytest.approx((float(want_low), float(want_high)), rel=1e-4)
    assert control.ci_low < control.effect < control.ci_high
    assert control.random_ci_low < control.random_effect < control.random_ci_high
    assert control.ratio_ci_low < control.ratio < control.ratio_ci_high


def test_z_and_its_interval_equal_a_naive_loop_over_prompts_and_draws():
    """On the toy model: z = (tested effect - the random sets' mean effect) / their standard
    deviation (n - 1), from per-prompt loss changes computed by hand-written hooks, and its interval
    from a naive loop over the same resample weights (prompts: seed, draws: seed + 1), each draw's
    effect pooled over the resampled prompts; its normal p is the two-sided tail erfc(|z| / sqrt 2)
    at the interval's bound nearest 0."""
    toy = load_model("toy")
    probes = probes_for(toy, n_prompts=10, seq_len=24, seed=3)
    metric = loss_metric(probes.tokens, probes.predictable)
    n_boot, seed, n_draws = 100, 7, 6
    control = control_effects(toy, probes.tokens, [(1, 5)], "zero", metric, n_draws=n_draws, seed=seed,
                              n_boot=n_boot)
    mask = probes.predictable[:, 1:].double()
    clean = _zeroed(toy, probes.tokens, [])
    changes = torch.stack([((_zeroed(toy, probes.tokens, heads) - clean) * mask).sum(1)
                           for heads in [[(1, 5)], *control.sets]]).T  # (prompts, 1 + draws)
    counts = mask.sum(1)

    def z_of(prompt_weights, draw_weights):
        pooled = (prompt_weights @ changes) / (prompt_weights @ counts)  # (1 + draws,)
        drawn = pooled[1:]
        mean = sum(draw_weights[d] * drawn[d] for d in range(n_draws)) / n_draws
        variance = sum(draw_weights[d] * (drawn[d] - mean) ** 2 for d in range(n_draws)) / (n_draws - 1)
        return (pooled[0] - mean) / variance.sqrt()

    want = float(z_of(torch.ones(len(counts), dtype=torch.float64), torch.ones(n_draws, dtype=torch.float64)))
    assert control.z == pytest.approx(want, rel=1e-4)
    prompts, draws = resample_weights(len(counts), n_boot, seed), resample_weights(n_draws, n_boot, seed + 1)
    low, high = percentile_bounds(torch.stack([z_of(prompts[b], draws[b]) for b in range(n_boot)])[:, None])
    assert (control.z_ci_low, control.z_ci_high) == pytest.approx((float(low), float(high)), rel=1e-4)
    nearest = min(abs(control.z_ci_low), abs(control.z_ci_high))  # the bound nearest 0, the interval off 0 here
    assert control.z_ci_low * control.z_ci_high > 0
    assert control.z_p_value == pytest.approx(math.erfc(nearest / math.sqrt(2)), rel=1e-9)
    summary = control.summary().iloc[0]
    assert (summary["z"], summary["z_ci_low"], summary["z_p_value"]) == (control.z, control.z_ci_low, control.z_p_value)
    assert f"z {control.z:+.1f} [{control.z_ci_low:+.1f}, {control.z_ci_high:+.1f}]" in control.describe()
    assert normal_p_value(-0.5, 2.0) == 1.0 and normal_p_value(-3.0, -2.0) == pytest.approx(math.erfc(2 / math.sqrt(2)))


def test_z_carries_a_false_discovery_correction_the_permutation_p_cannot():
    """The toy model's previous-token head L0H3 (which the induction heads read: ablating it costs
    about 5 nats) against the other layer-0 heads: only 7 random sets exist, so the permutation p
    cannot fall below 1/8 however many draws are made, too large to pass Benjamini-Hochberg at 0.05
    over 50 tests (the smallest p must be at most 0.001); the z, many spreads away from the random
    sets, gives a normal p far below that, and its interval stays far from 0."""
    toy = load_model("toy")
    probes = probes_for(toy, n_prompts=32, seed=5)
    control = control_effects(toy, probes, [(0, 3)], "zero", loss_metric(probes.tokens, probes.predictable),
                              n_draws=50, seed=0, n_boot=200)
    assert control.n_distinct == 7 and control.p_value == 1 / 8
    assert control.z_p_value < 0.05 / 50 and control.z_ci_low > 5, control.describe()


def _induction_scores(model, probes) -> torch.Tensor:
    """(n_layers, n_heads) mean attention from each second-copy token to the token after its earlier
    occurrence (the induction target)."""
    _, cache = model.run_with_cache(probes.tokens, names_filter=lambda name: name.endswith("hook_pattern"))
    target = (probes.earlier_occurrence + 1).clamp(min=0)
    weight = probes.second_copy.double()
    scores = []
    for layer in range(model.cfg.n_layers):
        pattern = cache[f"blocks.{layer}.attn.hook_pattern"].double()  # (batch, head, query, key)
        to_target = pattern.gather(-1, target[:, None, :, None].expand(-1, pattern.shape[1], -1, 1))[..., 0]
        scores.append((to_target * weight[:, None]).sum((0, 2)) / weight.sum())
    return torch.stack(scores)


def test_on_the_toy_model_induction_heads_beat_matched_random_heads_and_copies_do_not():
    """The toy model's three strongest induction heads, chosen on one set of probes and ablated on
    another, cost the copy more than layer-matched random sets of three: the ratio's interval lies
    above 1 (every layer-1 head scores as induction there, so the control is the other layer-1
    heads). And where every head of a layer is an exact copy of one head, any one of them tested
    against the others has effect equal to each random set's and the ratio's interval covers 1."""
    toy = load_model("toy")
    scores = _induction_scores(toy, probes_for(toy, n_prompts=32, seed=1234))
    top = [divmod(int(i), toy.cfg.n_heads) for i in scores.flatten().argsort(descending=True)[:3]]
    assert {layer for layer, _ in top} == {1}
    test = probes_for(toy, n_prompts=32, seed=5)
    control = control_effects(toy, test, top, "zero", loss_metric(test.tokens, test.predictable), seed=0)
    assert control.n_draws == 50 and control.matching == "layer-matched"
    assert control.ratio_ci_low > 1, control.describe()

    torch.manual_seed(2)
    copies = GPTModel(GPTConfig(d_vocab=300, n_ctx=32, d_model=32, n_heads=4, n_layers=2)).eval()
    attn, width = copies.blocks[1].attn, copies.cfg.d_head
    with torch.no_grad():
        for linear in (attn.W_query, attn.W_key, attn.W_value):
            linear.weight.copy_(linear.weight[:width].repeat(4, 1))
            linear.bias.copy_(linear.bias[:width].repeat(4))
        attn.out_proj.weight.copy_(attn.out_proj.weight[:, :width].repeat(1, 4))
    probes = probes_for(copies, n_prompts=16, seq_len=24, seed=0)
    same = control_effects(copies, probes, [(1, 2)], "zero", loss_metric(probes.tokens, probes.predictable), n_draws=6)
    assert (same.frame["effect"] - same.effect).abs().max() < 1e-6
    assert same.ratio_ci_low <= 1 <= same.ratio_ci_high, same.describe()


@pytest.mark.parametrize("heads, n_draws, message", [
    ([], 5, "no heads to test"),
    ([(0, 1), (0, 1)], 5, "listed twice"),
    ([(3, 0)], 5, "out of range"),
    ([(0, h) for h in range(5)], 5, "layer 0 has 5 tested heads and only 3 others"),
    ([(0, 1)], 0, "n_draws=0"),
])
def test_bad_input_is_refused_in_one_line(gqa, heads, n_draws, message):
    with pytest.raises(UserError, match=message) as refusal:
        matched_random_sets(gqa, heads, n_draws=n_draws)
    assert "\n" not in str(refusal.value)
