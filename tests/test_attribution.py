"""Attribution patching: the gradient linearisation checked against finite differences, its
agreement with exact patching measured, and the shortlist mode's exact cells."""

from __future__ import annotations

import copy
import math
from itertools import product

import pytest
import torch

from analyses.interventions.attribution import (
    Screen,
    attribution_agreement,
    attribution_patch_heads,
    screened_patches,
    shortlist_patch_heads,
    unpatched_value,
)
from analyses.core.metrics import logit_diff_metric, loss_metric
from analyses.interventions.engine import gradient_parts
from interp import UserError, load_model
from analyses.interventions.patching import patch_components, patch_effects, patch_heads
from analyses.core.probes import corrupt_first_copy, probes_for, repeated_probes


@pytest.fixture(scope="module")
def pair():
    probes = repeated_probes(3, 12, range(256), 256, seed=7)
    clean = probes.tokens
    return clean, corrupt_first_copy(probes, seed=8), loss_metric(clean, probes.predictable)


def moved_metric(model, tokens, metric, layer, head, target_z, eps):
    """The metric with head (layer, head)'s z moved a fraction ``eps`` towards ``target_z``."""

    def hook(z, hook):
        z = z.clone()
        z[:, :, head] += eps * (target_z[:, :, head] - z[:, :, head])
        return z

    with torch.no_grad():
        logits = model.run_with_hooks(tokens, fwd_hooks=[(f"blocks.{layer}.attn.hook_z", hook)])
    return metric(logits.double()).item()


@pytest.mark.parametrize("fixture", ["scratch_gpt2", "bridge_gpt2"])
def test_attribution_is_the_directional_derivative(request, fixture, pair):
    """value + dM/dz . (z_clean - z_corrupted) against a central finite difference, per head."""
    model = request.getfixturevalue(fixture)
    clean, corrupted, metric = pair
    attributed = attribution_patch_heads(model, clean, corrupted, metric)
    assert attributed.shape == (2, 4)
    _, cache = model.run_with_cache(clean)
    base = metric(model(corrupted)).item()
    eps = 1e-2
    for layer, head in [(0, 1), (1, 3)]:
        target = cache[f"blocks.{layer}.attn.hook_z"]
        up = moved_metric(model, corrupted, metric, layer, head, target, eps)
        down = moved_metric(model, corrupted, metric, layer, head, target, -eps)
        derivative = (up - down) / (2 * eps)
        assert attributed[layer, head].item() == pytest.approx(base + derivative, abs=2e-4)


@pytest.mark.parametrize("fixture", ["scratch_gpt2", "bridge_gpt2"])
def test_chunks_of_prompts_give_the_batch_estimate(request, fixture, pair):
    """Attribution patching over chunks of one prompt (memory_mb=1e-6), each chunk's gradient
    weighted by its share of the metric, equals one backward over the whole batch (4 GB): heads and
    MLPs, by position or not, both directions, normalised or not, for the loss over the predicted
    tokens, a per-prompt logit difference (GPTModel: its one read position unembedded) and a plain
    callable (it cannot be split, so it stays one part). Compared in the metric's units (to 1e-5):
    a normalised cell times the clean - corrupted gap, which is 0.004 for this loss."""
    model = request.getfixturevalue(fixture)
    clean, corrupted, loss = pair
    metrics = {"loss": loss, "logit_diff": logit_diff_metric(clean[:, -1], torch.arange(3) + 5),
               "callable": lambda logits: logits[:, -1, 7].mean()}
    assert len(gradient_parts(model, corrupted, loss, 1e-6)[0]) == 3  # one prompt each: the chunks do happen
    for (name, metric), component, by_position, direction, normalize in product(
            metrics.items(), ["heads", "mlps"], [False, True], ["denoise", "noise"], [False, True]):
        whole, chunked = (patch_components(model, clean, corrupted, metric, component, by_position=by_position,
                                           method="attribution", direction=direction, normalize=normalize,
                                           memory_mb=budget) for budget in (4096, 1e-6))
        with torch.no_grad():
            gap = abs(metric(model(clean)).item() - metric(model(corrupted)).item()) if normalize else 1.0
        case = f"{name} {component} by_position={by_position} {direction} normalize={normalize}"
        assert (whole - whole.flatten()[0]).abs().max() * gap > 1e-4, case  # the cells differ: a wrong sum would show
        torch.testing.assert_close(chunked * gap, whole * gap, atol=1e-5, rtol=0, msg=case)


def test_by_position_sums_to_all_positions(scratch_gpt2, pair):
    clean, corrupted, metric = pair
    all_pos = attribution_patch_heads(scratch_gpt2, clean, corrupted, metric)
    by_pos = attribution_patch_heads(scratch_gpt2, clean, corrupted, metric, by_position=True)
    base = metric(scratch_gpt2(corrupted)).item()
    assert by_pos.shape == (2, 12, 4)
    torch.testing.assert_close((by_pos - base).sum(1) + base, all_pos, atol=1e-5, rtol=0)


def test_agreement_with_exact_is_measured(scratch_gpt2, pair):
    clean, corrupted, metric = pair
    exact = patch_heads(scratch_gpt2, clean, corrupted, metric, progress=False)
    attributed = attribution_patch_heads(scratch_gpt2, clean, corrupted, metric)
    unpatched = metric(scratch_gpt2(corrupted)).item()
    assert unpatched_value(scratch_gpt2, clean, corrupted, metric) == pytest.approx(unpatched, abs=1e-6)
    assert unpatched_value(scratch_gpt2, clean, corrupted, metric, direction="noise") == pytest.approx(
        metric(scratch_gpt2(clean)).item(), abs=1e-6)
    assert unpatched_value(scratch_gpt2, clean, corrupted, metric, direction="noise", normalize=True) == 1.0
    agreement = attribution_agreement(attributed, exact, top_k=3, baseline=unpatched)
    # small random weights: patching effects are nearly linear
    assert agreement["pearson"] > 0.9
    assert agreement["max_abs_error"] == pytest.approx((attributed - exact).abs().max().item(), rel=1e-5)
    perfect = attribution_agreement(exact, exact, top_k=3, baseline=unpatched)
    assert perfect["pearson"] == pytest.approx(1.0) and perfect["top3_overlap"] == 1.0
    with pytest.raises(ValueError, match="shapes differ"):
        attribution_agreement(attributed, exact[0], baseline=unpatched)


def test_agreement_top_k_is_measured_from_the_unpatched_value():
    """The largest effects are the cells farthest from the unpatched run (10 here), not from the
    median cell: cell 0 (|1 - 10| = 9) is exact's top effect, and attribution's too, although
    measured from the medians (2.5 and 2.6) the two would pick different cells."""
    exact = torch.tensor([1.0, 2.0, 3.0, 10.0])
    attributed = torch.tensor([1.0, 2.2, 3.0, 4.0])
    assert attribution_agreement(attributed, exact, top_k=1, baseline=10.0)["top1_overlap"] == 1.0
    assert attribution_agreement(attributed, exact, top_k=1, baseline=2.5)["top1_overlap"] == 0.0



def naive_patch(model, base, source, metric, layer, head):
    """The metric of ``base`` with one head's output taken from the ``source`` run, by hand."""
    _, cache = model.run_with_cache(source)
    name = f"blocks.{layer}.attn.hook_z"

    def hook(z, hook):
        z = z.clone()
        z[:, :, head] = cache[name][:, :, head]
        return z

    with torch.no_grad():
        return metric(model.run_with_hooks(base, fwd_hooks=[(name, hook)])).item()


def test_shortlist_confirms_top_k_exactly(scratch_gpt2, pair):
    clean, corrupted, metric = pair
    attributed = attribution_patch_heads(scratch_gpt2, clean, corrupted, metric)
    frame = shortlist_patch_heads(scratch_gpt2, clean, corrupted, metric, k=3, progress=False)
    assert len(frame) == 8 and frame["exact"].sum() == 3 and frame["exact"].iloc[:3].all()
    # the ranking: each head's first-order effect, by central finite differences in the test
    _, cache = scratch_gpt2.run_with_cache(clean)
    eps = 1e-2
    effect = {}
    for layer, head in zip(frame["layer"], frame["head"]):
        target = cache[f"blocks.{layer}.attn.hook_z"]
        up = moved_metric(scratch_gpt2, corrupted, metric, layer, head, target, eps)
        down = moved_metric(scratch_gpt2, corrupted, metric, layer, head, target, -eps)
        effect[layer, head] = abs(up - down) / (2 * eps)
    ranked = [effect[layer, head] for layer, head in zip(frame["layer"], frame["head"])]
    assert all(earlier >= later - 1e-5 for earlier, later in zip(ranked, ranked[1:]))
    assert max(ranked) - min(ranked) > 1e-3  # the ranking is not among ties
    for row in frame.itertuples():
        expected = (naive_patch(scratch_gpt2, corrupted, clean, metric, row.layer, row.head) if row.exact
                    else attributed[row.layer, row.head].item())
        assert row.value == pytest.approx(expected, abs=1e-5)
        assert row.attribution == pytest.approx(attributed[row.layer, row.head].item(), abs=1e-5)
    with pytest.raises(ValueError, match=r"k=9 out of range \[0, 8\]"):
        shortlist_patch_heads(scratch_gpt2, clean, corrupted, metric, k=9)


def test_shortlist_exact_rows_carry_the_sweeps_intervals(scratch_gpt2, pair):
    """Every exact row of the shortlist is an effect with its interval: the effect is the patched
    metric minus the unpatched run's (by hand), and the interval and n_prompts are the full exact
    sweep's (``patch_effects``) for that head, in either normalisation; estimates carry none."""
    clean, corrupted, metric = pair
    for normalize in (False, True):
        frame = shortlist_patch_heads(scratch_gpt2, clean, corrupted, metric, k=3, normalize=normalize, progress=False)
        sweep = patch_effects(scratch_gpt2, clean, corrupted, metric, normalize=normalize).set_index(["layer", "head"])
        unpatched = 0.0 if normalize else metric(scratch_gpt2(corrupted)).item()
        exact, estimated = frame[frame["exact"]], frame[~frame["exact"]]
        assert len(exact) == 3 and estimated[["effect", "ci_low", "ci_high"]].isna().all().all()
        assert estimated["n_prompts"].isna().all()
        for row in exact.itertuples():
            full = sweep.loc[(row.layer, row.head)]
            assert row.effect == pytest.approx(row.value - unpatched, abs=1e-5)
            assert (row.ci_low, row.ci_high) == pytest.approx((full.ci_low, full.ci_high), abs=1e-5)
            assert row.ci_low < row.ci_high and row.n_prompts == full.n_prompts == 3


def test_shortlist_in_chunks_of_prompts_is_the_batch_shortlist(scratch_gpt2, pair):
    """The shortlist and the unpatched value within a budget of one prompt per forward (1e-6 MB)
    equal them at 4 GB: the same ranking, attribution and exact values to 1e-5."""
    clean, corrupted, metric = pair
    whole, chunked = (shortlist_patch_heads(scratch_gpt2, clean, corrupted, metric, k=3, memory_mb=budget,
                                            progress=False) for budget in (4096, 1e-6))
    assert whole[["layer", "head", "exact"]].equals(chunked[["layer", "head", "exact"]])
    for column in ("attribution", "value"):
        assert abs(chunked[column] - whole[column]).max() < 1e-5
    for direction in ("denoise", "noise"):
        assert unpatched_value(scratch_gpt2, clean, corrupted, metric, direction=direction, memory_mb=1e-6) == (
            pytest.approx(unpatched_value(scratch_gpt2, clean, corrupted, metric, direction=direction), abs=1e-6))


def test_normalized_attribution(scratch_gpt2, pair):
    clean, corrupted, metric = pair
    raw = attribution_patch_heads(scratch_gpt2, clean, corrupted, metric)
    clean_value, corrupted_value = metric(scratch_gpt2(clean)).item(), metric(scratch_gpt2(corrupted)).item()
    normalized = attribution_patch_heads(scratch_gpt2, clean, corrupted, metric, normalize=True)
    torch.testing.assert_close(normalized, (raw - corrupted_value) / (clean_value - corrupted_value))


def test_residual_attribution_by_position_is_the_directional_derivative():
    """patch_components(method="attribution") on the residual stream: value + dM/dr . (r_clean -
    r_corrupted) at one (layer, position), against a central finite difference of that move, on the
    trained toy model (whose residual matters to its induction loss)."""
    toy = load_model("toy")
    probes = probes_for(toy, 3, 24, seed=7)
    clean, corrupted = probes.tokens, corrupt_first_copy(probes, seed=8)
    metric = loss_metric(clean, probes.predictable)
    attributed = patch_components(toy, clean, corrupted, metric, "residual", by_position=True, method="attribution")
    assert attributed.shape == (toy.cfg.n_layers, 24)
    _, cache = toy.run_with_cache(clean)
    base = metric(toy(corrupted)).item()
    eps = 1e-2
    for layer in range(toy.cfg.n_layers):
        name = f"blocks.{layer}.hook_resid_pre"
        pos = int((attributed[layer] - base).abs().argmax())  # the largest estimate, checked independently below

        def moved(step):
            def hook(resid, hook):
                resid = resid.clone()
                resid[:, pos] += step * (cache[name][:, pos] - resid[:, pos])
                return resid
            with torch.no_grad():
                return metric(toy.run_with_hooks(corrupted, fwd_hooks=[(name, hook)]).double()).item()

        derivative = (moved(eps) - moved(-eps)) / (2 * eps)
        assert abs(derivative) > 1e-2  # the position matters, so the comparison is not vacuous
        assert attributed[layer, pos].item() == pytest.approx(base + derivative, abs=1e-3 * abs(derivative) + 1e-4)


def test_the_screen_measures_exactly_what_its_rule_names_and_a_planted_head_always(scratch_gpt2, pair):
    """``screened_patches``: a head planted to matter (its W_O times 20) is measured exactly by a
    screen that keeps only what reaches half the clean - corrupted gap; the cells measured are
    exactly those the rule names (by share; the top k), each equal to exact patching and to a
    hand-written patch (1e-5), the others left at the attribution estimate."""
    model = copy.deepcopy(scratch_gpt2)
    with torch.no_grad():
        model.blocks[0].attn.W_O[2] *= 20
    clean, corrupted, metric = pair
    with torch.no_grad():
        gap = metric(model(clean)).item() - (base := metric(model(corrupted)).item())
    estimate, exact = attribution_patch_heads(model, clean, corrupted, metric), patch_heads(model, clean, corrupted, metric)
    by_share = screened_patches(model, clean, corrupted, metric, screen=Screen(0, 0.5), progress=False)
    assert by_share.exact[0, 2] and by_share.exact.sum() < by_share.exact.numel() / 2
    assert torch.equal(by_share.exact, (estimate - base).abs() >= 0.5 * abs(gap))
    assert by_share.values[0, 2].item() == pytest.approx(naive_patch(model, corrupted, clean, metric, 0, 2), abs=1e-5)
    top = screened_patches(model, clean, corrupted, metric, screen=Screen(3, math.inf), progress=False)
    assert torch.equal(top.exact.flatten().nonzero()[:, 0].sort().values,
                       (estimate - base).abs().flatten().topk(3).indices.sort().values)
    for screened in (by_share, top):
        torch.testing.assert_close(screened.values[screened.exact], exact[screened.exact], atol=1e-5, rtol=0)
        torch.testing.assert_close(screened.values[~screened.exact], estimate[~screened.exact], atol=1e-5, rtol=0)
        torch.testing.assert_close(screened.estimate, estimate, atol=1e-6, rtol=0)
    for bad, message in (((-1, 0.1), "top_k=-1"), ((2, 0.0), "share=0.0")):
        with pytest.raises(UserError, match=message):
            Screen(*bad)
