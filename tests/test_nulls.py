"""Null distributions, p-values and Benjamini-Hochberg roles: the statistics against closed forms and
hand computations, random-init models of several families and shapes getting no role, the embedded
model keeping its roles, and the random-init builder on both implementations."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch

from analyses.roles.classify import ROLES, assign_roles, classify_heads, head_table
from analyses.roles.nulls import (
    benjamini_hochberg,
    calibrate_roles,
    layer_null,
    ratio_and_error,
    role_samples,
    t_upper_tail,
)
from analyses.core.probes import probes_for, repeated_probes, shuffle_second_copy
from interp import GPTConfig, GPTModel, load_model
from interp.errors import UserError
from interp.random_models import gpt2_initialise, random_like

N_PROMPTS, SEQ_LEN = 32, 32


def test_t_tail_matches_closed_forms():
    t = torch.tensor([-2.0, 0.0, 0.5, 1.0, 3.0, 30.0])
    cauchy = [0.5 - math.atan(x) / math.pi for x in t.tolist()]  # 1 degree of freedom
    two = [0.5 - x / (2 * math.sqrt(x * x + 2)) for x in t.tolist()]  # 2 degrees of freedom
    normal = [0.5 * math.erfc(x / math.sqrt(2)) for x in t.tolist()]
    torch.testing.assert_close(t_upper_tail(t, 1), torch.tensor(cauchy, dtype=torch.double))
    torch.testing.assert_close(t_upper_tail(t, 2), torch.tensor(two, dtype=torch.double))
    torch.testing.assert_close(t_upper_tail(t[:5], 4001), torch.tensor(normal[:5], dtype=torch.double), atol=2e-4, rtol=0)
    assert t_upper_tail(torch.tensor(1.0), 3).item() == pytest.approx(0.19550, abs=1e-5)  # tables: t_3
    assert t_upper_tail(torch.tensor(3.0), 4).item() == pytest.approx(0.019971, abs=1e-6)  # tables: t_4
    mixed = t_upper_tail(torch.tensor([1.0, 1.0]), torch.tensor([1, 2]))
    torch.testing.assert_close(mixed, torch.tensor([0.25, 0.5 - 1 / (2 * math.sqrt(3))], dtype=torch.double))


def test_benjamini_hochberg_by_hand():
    p = torch.tensor([0.01, 0.04, 0.03, 0.005], dtype=torch.double)
    # sorted 0.005, 0.01, 0.03, 0.04 -> p * 4 / rank = 0.02, 0.02, 0.04, 0.04 (already monotone)
    torch.testing.assert_close(benjamini_hochberg(p), torch.tensor([0.02, 0.04, 0.04, 0.02], dtype=torch.double))
    p = torch.tensor([0.2, 0.011, 0.012], dtype=torch.double)
    # 0.011 * 3 = 0.033, 0.012 * 3 / 2 = 0.018 -> the smaller later one carries back: both 0.018
    torch.testing.assert_close(benjamini_hochberg(p), torch.tensor([0.2, 0.018, 0.018], dtype=torch.double))


def test_ratio_error_is_the_linearised_ratio_estimator():
    sums = torch.tensor([[1.0], [2.0], [4.0]], dtype=torch.double)
    counts = torch.tensor([2.0, 2.0, 4.0], dtype=torch.double)
    ratio, se = ratio_and_error(sums, counts)
    r = 7 / 8
    residuals = [1 - r * 2, 2 - r * 2, 4 - r * 4]
    expected = math.sqrt(3 / 2 * sum(x * x for x in residuals) / 8 ** 2)
    assert ratio.item() == pytest.approx(r) and se.item() == pytest.approx(expected)


def test_layer_null_is_two_level():
    """Heads of one seed share a model effect: the spread grows with it, and the degrees of
    freedom fall towards seeds - 1; with no model effect they are seeds x heads - 1."""
    torch.manual_seed(0)
    heads_only = torch.randn(4, 1, 6)
    centre, spread, dof = layer_null(heads_only - heads_only.mean(2, keepdim=True))  # seed means all 0
    assert centre.item() == pytest.approx(0.0, abs=1e-6) and dof.item() == 4 * 6 - 1
    shared = heads_only + 10 * torch.randn(4, 1, 1)
    _, wide, few = layer_null(shared)
    assert wide.item() > 3 * spread.item() and few.item() <= 4


def test_control_probes_break_the_repeat_and_keep_everything_else():
    probes = repeated_probes(20, 40, range(3, 200), 0, seed=4)
    control = shuffle_second_copy(probes, seed=1)
    assert torch.equal(control.period, probes.period) and torch.equal(control.segment_start, probes.segment_start)
    second = probes.second_copy
    assert torch.equal(control.tokens[~second], probes.tokens[~second])
    for row in range(20):
        assert sorted(control.tokens[row][second[row]].tolist()) == sorted(probes.tokens[row][second[row]].tolist())
    earlier = probes.earlier_occurrence
    rows, cols = second.nonzero(as_tuple=True)
    assert (control.tokens[rows, cols] != probes.tokens[rows, earlier[rows, cols]]).all()  # no token at i - p
    assert torch.equal(shuffle_second_copy(probes, seed=1).tokens, control.tokens)


def test_random_like_on_both_implementations(scratch_gpt2, bridge_gpt2):
    for model in (scratch_gpt2, bridge_gpt2):
        first, again, other = random_like(model, 5), random_like(model, 5), random_like(model, 6)
        tokens = torch.tensor([[256, 1, 2, 3, 4]])
        with torch.no_grad():
            logits = [m(tokens) for m in (model, first, again, other)]
        assert logits[1].shape == logits[0].shape
        torch.testing.assert_close(logits[1], logits[2])  # deterministic in the seed
        assert not torch.allclose(logits[1], logits[3]) and not torch.allclose(logits[1], logits[0])
    assert random_like(scratch_gpt2, 5).cfg == scratch_gpt2.cfg
    with torch.no_grad():  # one null for both implementations of one model: the very same random weights
        tokens = torch.tensor([[256, 7, 8, 9]])
        torch.testing.assert_close(random_like(scratch_gpt2, 5)(tokens), random_like(bridge_gpt2, 5)(tokens),
                                   atol=1e-4, rtol=0)
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    random_like(bridge_gpt2, 5), random_like(scratch_gpt2, 5)
    assert torch.equal(torch.rand(3), expected)  # the caller's random state is untouched
    assert random_like(bridge_gpt2, 5).original_model.config.to_dict() == bridge_gpt2.original_model.config.to_dict()


def small_gpt(n_layers: int, n_heads: int, d_model: int, positions: str, seed: int) -> GPTModel:
    torch.manual_seed(seed)
    cfg = GPTConfig(d_vocab=257, n_ctx=64, d_model=d_model, n_heads=n_heads, n_layers=n_layers,
                    positional_embedding_type=positions)
    return gpt2_initialise(GPTModel(cfg)).eval()


RANDOM_MODELS = {
    "gpt2-scratch": lambda family_dir: load_model(family_dir("gpt2"), impl="scratch"),
    "llama-bridge": lambda family_dir: load_model(family_dir("llama"), impl="transformer_lens"),
    "gpt_neox-scratch": lambda family_dir: load_model(family_dir("gpt_neox"), impl="scratch"),
    "qwen2-bridge": lambda family_dir: load_model(family_dir("qwen2"), impl="transformer_lens"),
    "opt-bridge": lambda family_dir: load_model(family_dir("opt"), impl="transformer_lens"),
    "3x6-rotary-scratch": lambda family_dir: small_gpt(3, 6, 48, "rotary", seed=11),
    "1x2-learned-scratch": lambda family_dir: small_gpt(1, 2, 32, "standard", seed=12),
}


@pytest.mark.parametrize("name", RANDOM_MODELS)
def test_random_init_models_get_no_role(name, family_dir):
    model = RANDOM_MODELS[name](family_dir)
    calibration = calibrate_roles(model, n_prompts=N_PROMPTS, seq_len=SEQ_LEN, progress=False)
    assert len(calibration) == model.cfg.n_layers * model.cfg.n_heads * len(ROLES)
    assert not calibration["significant"].any(), calibration[calibration["significant"]]
    assert calibration["p"].between(0, 1).all() and (calibration["null_low"] <= calibration["null_high"]).all()


def test_p_values_of_random_init_heads_are_not_too_small():
    """Calibration, not one lucky draw: over 12 random models, p < 0.05 about 5% of the time or
    less, and few models get any role (at FDR 0.05 each null model gets one with probability at
    most 5%: 3 or more of 12 would happen by chance 2% of the time)."""
    p, any_role = [], 0
    for seed in range(12):
        calibration = calibrate_roles(small_gpt(2, 4, 64, "standard", seed=100 + seed), n_prompts=N_PROMPTS,
                                      seq_len=SEQ_LEN, progress=False)
        p.append(calibration["p"])
        any_role += int(calibration["significant"].any())
    p = pd.concat(p)
    assert (p < 0.05).mean() <= 0.08 and (p < 0.01).mean() <= 0.02 and any_role <= 2


@pytest.fixture(scope="module")
def toy():
    return load_model("toy")


@pytest.fixture(scope="module")
def toy_calibration(toy):
    probes = probes_for(toy, 64, seed=0)
    return probes, calibrate_roles(toy, probes, progress=False)


def test_embedded_model_keeps_its_roles_under_fdr(toy, toy_calibration):
    probes, calibration = toy_calibration
    scores = classify_heads(toy, probes=probes, n_boot=50, progress=False)
    roles = assign_roles(scores, calibration=calibration).set_index(["layer", "head"])["role"].str.split(";")
    assert "previous_token" in roles[(0, 3)]
    assert all("induction" in roles[(1, head)] for head in range(8))
    assert not any("induction" in roles[(0, head)] for head in range(8))
    assert not any("duplicate_token" in r for r in roles)
    significant = calibration[calibration["significant"]]
    assert significant["q"].max() <= 0.05
    induction = calibration[(calibration["role"] == "induction") & (calibration["layer"] == 1)]
    assert (induction["score"] > induction["null_high"]).all()
    # the fixed threshold on top of the null: only strong roles remain
    strong = assign_roles(scores, 0.4, calibration=calibration).set_index(["layer", "head"])["role"]
    assert strong[(0, 3)] == "previous_token" and (strong.loc[1] == "induction").all()
    assert (strong.loc[0].drop(3) == "").all()


def test_random_init_embedded_model_gets_no_role(toy):
    calibration = calibrate_roles(random_like(toy, 5), n_prompts=N_PROMPTS, seq_len=SEQ_LEN, progress=False)
    assert not calibration["significant"].any()


def test_head_table_shows_null_bands_and_roles_by_fdr(toy, toy_calibration):
    probes, calibration = toy_calibration
    scores = classify_heads(toy, probes=probes, n_boot=50, progress=False)
    table = head_table(scores, calibration=calibration)
    for role in ROLES:
        for column in ("null_low", "null_high", "z", "p", "q"):
            assert f"{role}_{column}" in table.columns
    row = table[(table["layer"] == 1) & (table["head"] == 5)].iloc[0]
    assert row["induction_null_low"] < row["induction_null_high"] < row["induction"]
    fixed = head_table(scores, thresholds=0.4)  # the fixed-threshold path, unchanged
    assert "induction_q" not in fixed.columns
    assert fixed.set_index(["layer", "head"])["role"][(0, 3)] == "previous_token"
    with pytest.raises(UserError, match="fdr=1.5 must be in"):
        assign_roles(scores, calibration=calibration, fdr=1.5)


def test_observed_samples_agree_across_backends(scratch_gpt2, bridge_gpt2):
    probes = probes_for(scratch_gpt2, 8, 24, seed=3)
    ours, theirs = role_samples(scratch_gpt2, probes), role_samples(bridge_gpt2, probes)
    for role in ROLES:
        assert (ours.sums[role] - theirs.sums[role]).abs().max() < 1e-4
        assert torch.equal(ours.counts[role], theirs.counts[role])


def test_bad_null_settings_are_refused(scratch_gpt2):
    with pytest.raises(UserError, match="at least 2 random initialisations"):
        calibrate_roles(scratch_gpt2, n_prompts=4, seq_len=16, null_seeds=(1,), progress=False)
    with pytest.raises(UserError, match="fdr=0 must be in"):
        calibrate_roles(scratch_gpt2, n_prompts=4, seq_len=16, fdr=0, progress=False)


def spread_previous_token_model(strengths: list[float], d_token: int = 16) -> GPTModel:
    """One attention-only layer whose heads attend by position alone: head h puts weight
    e^s / (e^s + i) on the previous token from query position i (s = ``strengths[h]``), the rest
    evenly on every position up to i. The residual is [one-hot position (n_ctx), token embedding
    (``d_token``, random)]: query i is s e_i and key j is e_{j+1} (their product is s where
    j = i - 1, else 0); each head copies the token part of what it attends to back into the
    token part (the unembedding is tied), so ablating a head changes the logits."""
    toy = load_model("toy")
    n_ctx, n_heads = 32, len(strengths)
    cfg = GPTConfig(d_vocab=toy.cfg.d_vocab, n_ctx=n_ctx, d_model=n_ctx + d_token, n_heads=n_heads, n_layers=1,
                    d_head=n_ctx, attn_only=True, normalization_type=None, use_attn_scale=False, qkv_bias=False)
    model = GPTModel(cfg, toy.tokenizer).eval()
    eye, shift = torch.eye(n_ctx), torch.diag(torch.ones(n_ctx - 1), -1)  # shift @ e_j = e_{j+1}
    def positions(matrix):  # (d_head, d_model): reads the position part through ``matrix``
        return torch.cat([matrix, torch.zeros(n_ctx, d_token)], dim=1)

    token = torch.zeros(n_ctx, n_ctx + d_token)  # reads the token part into the head's first d_token dims
    token[:d_token, n_ctx:] = torch.eye(d_token)
    with torch.no_grad():
        model.embed.weight.zero_()
        model.embed.weight[:, n_ctx:] = torch.randn(cfg.d_vocab, d_token, generator=torch.Generator().manual_seed(0))
        model.pos_embed.weight.zero_()
        model.pos_embed.weight[:, :n_ctx] = eye
        attn = model.blocks[0].attn
        attn.W_query.weight.copy_(torch.cat([positions(s * eye) for s in strengths]))
        attn.W_key.weight.copy_(torch.cat([positions(shift)] * n_heads))
        attn.W_value.weight.copy_(torch.cat([token] * n_heads))
        attn.out_proj.weight.copy_(torch.cat([token.T] * n_heads, dim=1) / n_heads)
        attn.out_proj.bias.zero_()
    return model


def test_a_mechanism_spread_over_several_heads_shows_as_partial_roles():
    """Three heads share the previous-token work, each scoring about 0.35 (under the 0.4 threshold,
    far above the random-init null); one head does it alone (score near 1). The strong head keeps
    its role; the three are partial previous-token heads in head_roles.csv, the role list and the
    page, with their ablation effects, instead of "previous_token: none" beside them."""
    from analyses.report.build import role_summary
    from analyses.report.page import head_table_html
    from analyses.roles.causal_check import ablation_effects

    model = spread_previous_token_model([12.0, 1.7, 1.8, 1.9])
    probes = probes_for(model, 24, seq_len=32, seed=0)
    scores = classify_heads(model, probes=probes, n_boot=20, progress=False)
    calibration = calibrate_roles(model, probes, progress=False)
    effects = ablation_effects(model, probes, progress=False)
    table = head_table(scores, effects, 0.4, calibration=calibration).set_index(["layer", "head"])
    previous = table["previous_token"]
    assert previous[(0, 0)] > 0.9 and all(0.25 < previous[(0, h)] < 0.4 for h in (1, 2, 3))
    assert (table["previous_token_q"] < 1e-6).all()
    assert table.loc[(0, 0), "role"] == "previous_token" and table.loc[(0, 0), "partial_role"] == ""
    for head in (1, 2, 3):
        assert "previous_token" not in table.loc[(0, head), "role"].split(";")
        assert "previous_token" in table.loc[(0, head), "partial_role"].split(";")
    [line] = [line for line in role_summary(table.reset_index()) if line.startswith("- **previous_token**")]
    strong, partial = line.split("; partial")
    assert "L0H0" in strong and all(f"L0H{h}" not in strong for h in (1, 2, 3))
    row = lambda h: table.loc[(0, h)]
    assert all(f"L0H{h} (score {previous[(0, h)]:.2f}, ablation {row(h)['ablation_effect']:+.3f} "
               f"[{row(h)['ablation_ci_low']:+.3f}, {row(h)['ablation_ci_high']:+.3f}] nats)" in partial
               for h in (1, 2, 3))  # each effect with its 95% interval
    page = head_table_html(table.reset_index(), ["previous_token"], ["previous_token"], "t")
    assert page.count("partial: previous_token") == 3
    fixed = head_table(scores, thresholds=0.4)  # the fixed rule has no nulls, so no partial roles
    assert (fixed["partial_role"] == "").all()


def test_a_partial_role_needs_an_effect_size_not_only_a_small_p():
    """Three previous-token heads beside a strong one, all with q-values below 1e-12 against a null
    with next to no spread (random-init heads attend alike): L0H1 at about 0.34 goes most of the way
    from the null (about 0.10) to the 0.4 threshold, a partial role; L0H2 and L0H3 (about 0.12 and
    0.21) barely move off the null and are not partial roles, though their p-values are as small."""
    model = spread_previous_token_model([12.0, 1.8, 0.3, 1.0])
    probes = probes_for(model, N_PROMPTS, seq_len=32, seed=0)
    scores = classify_heads(model, probes=probes, n_boot=50, progress=False)
    calibration = calibrate_roles(model, probes, progress=False)
    table = head_table(scores, thresholds=0.4, calibration=calibration).set_index(["layer", "head"])
    previous = table["previous_token"]
    center = calibration[calibration["role"] == "previous_token"]["null_center"].iloc[0]
    assert 0.09 < center < 0.11 and (table["previous_token_q"] < 1e-12).all()
    assert 0.3 < previous[(0, 1)] < 0.4 and previous[(0, 2)] < 0.15 and 0.18 < previous[(0, 3)] < 0.24
    assert table["role"].tolist() == ["previous_token", "", "", ""]
    assert table["partial_role"].tolist() == ["", "previous_token", "", ""]


def test_partial_roles_read_the_lower_bound_and_the_weights_scores():
    """By hand: the rule is ci_low - null_center >= PARTIAL_SHARE (threshold - null_center) for the
    attention roles, score - null_center for the meaning roles (no interval: read from the weights)."""
    from analyses.roles.classify import PARTIAL_SHARE
    assert PARTIAL_SHARE == 0.5
    heads = [(0, 0), (0, 1), (0, 2), (0, 3)]
    #                 score, ci_low  (null centre 0.1, threshold 0.4: partial needs ci_low >= 0.25)
    attention = {(0, 0): (0.30, 0.26), (0, 1): (0.30, 0.24), (0, 2): (0.20, 0.19), (0, 3): (0.45, 0.44)}
    scores = pd.DataFrame([{"layer": l, "head": h, "measure": "previous_token", "score": s, "ci_low": lo,
                            "ci_high": s + 0.01, "chance": 0.1} for (l, h), (s, lo) in attention.items()])
    copying = {(0, 0): 0.26, (0, 1): 0.24, (0, 2): 0.5, (0, 3): 0.3}
    rows = [{"layer": l, "head": h, "role": "previous_token", "q": 1e-9, "null_center": 0.1, "score": s}
            for (l, h), (s, _) in attention.items()]
    rows += [{"layer": l, "head": h, "role": "copying", "q": 1e-9, "null_center": 0.1, "score": copying[(l, h)]}
             for l, h in heads]
    roles = assign_roles(scores, 0.4, calibration=pd.DataFrame(rows)).set_index(["layer", "head"])
    assert roles["role"].tolist() == ["", "", "copying", "previous_token"]
    assert roles["partial_role"].tolist() == ["previous_token;copying", "", "", "copying"]


def test_t_tail_runs_each_continued_fraction_once_on_its_own_elements(monkeypatch):
    """Many degrees of freedom at once: each continued fraction runs once (not once per degree of
    freedom), only over the elements where it converges fast (x below (a + 1) / (a + b + 2)), and
    log P(T >= t) equals scipy's t.logsf to 1e-12 relative, deep tails and negative t included."""
    import analyses.roles.nulls as nulls
    from scipy import stats

    t = torch.tensor([-40.0, -3.0, -0.5, 0.0, 0.3, 1.0, 1.7, 2.5, 6.0, 30.0, 300.0]).repeat(26)
    dof = torch.arange(1, 27).repeat_interleave(11)
    calls = []
    real = nulls._log_beta_inc

    def recorded(log_x, log_1mx, a, b, steps=2000):
        calls.append((log_x.numel(), bool((log_x.exp() < (a + 1) / (a + b + 2)).all())))
        return real(log_x, log_1mx, a, b, steps)

    monkeypatch.setattr(nulls, "_log_beta_inc", recorded)
    ours = nulls.t_log_upper_tail(t, dof)
    (far, converges), (near, _) = calls  # I_x(a, b) where it converges, then I_{1-x}(b, a) on the rest
    assert converges and far + near == t.numel() and far > 0 and near > 0
    expected = torch.tensor(stats.t.logsf(t.numpy(), dof.numpy()), dtype=torch.double)
    torch.testing.assert_close(ours, expected, rtol=1e-12, atol=1e-300)


def test_role_calibration_makes_each_null_model_once(scratch_gpt2, monkeypatch):
    """The attention roles' and the copying roles' random-init nulls read the same null model per seed,
    made once each (three random_like calls for three seeds, not six), and the calibration table is
    what the two nulls give apart; the copying null's centre equals the mean over seeds and heads of
    sum(Re eig) / sum(|eig|) of each hand-built null model's full vocab x vocab OV matrix."""
    import analyses.roles.copying
    import analyses.roles.nulls
    from analyses.roles.calibration import role_calibration
    from analyses.roles.copying import meaning_nulls
    from analyses.roles.nulls import joint_fdr

    seeds = (1001, 1002, 1003)
    probes = repeated_probes(6, 16, range(1, 250), 0, seed=4)
    apart = joint_fdr(calibrate_roles(scratch_gpt2, probes, null_seeds=seeds, progress=False),
                      meaning_nulls(scratch_gpt2, seeds), fdr=0.05)
    made = []

    def counted(model, seed=0):
        made.append(seed)
        return random_like(model, seed)

    for module in (analyses.roles.nulls, analyses.roles.copying):  # where each null imported it
        monkeypatch.setattr(module, "random_like", counted, raising=False)
    joint = role_calibration(scratch_gpt2, probes, null_seeds=seeds, fdr=0.05)
    assert made == list(seeds)
    pd.testing.assert_frame_equal(joint, apart)

    def full_copying(null) -> torch.Tensor:  # (layer, head), from the vocab x vocab matrix itself
        W_E, W_U = null.W_E.detach().double(), null.W_U.detach().double()
        W_V, W_O = null.W_V.detach().double(), null.W_O.detach().double()
        return torch.tensor([[float((eig := torch.linalg.eigvals(W_E @ W_V[layer, head] @ W_O[layer, head] @ W_U))
                                    .real.sum() / eig.abs().sum()) for head in range(W_O.shape[1])]
                             for layer in range(W_O.shape[0])], dtype=torch.double)

    centre = torch.stack([full_copying(random_like(scratch_gpt2, seed)) for seed in seeds]).mean((0, 2))
    copying = joint[joint["role"] == "copying"].groupby("layer")["null_center"].first()
    assert copying.to_numpy() == pytest.approx(centre.numpy(), abs=1e-6)
