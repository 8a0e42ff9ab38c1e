"""Exact patching against TransformerLens's own sweeps on the same weights (architecture §6)."""

from __future__ import annotations

import copy

import pytest
import torch
from transformer_lens import patching as tl_patching

from analyses.interventions.ablation import ablate_heads
from analyses.core.metrics import logit_diff_metric, loss_metric
from analyses.interventions.patching import patch_components, patch_heads, patch_patterns, patch_residual, patching_frame
from analyses.core.probes import corrupt_first_copy, probes_for, repeated_probes
from interp import load_model
from interp.errors import UserError

N_POS = 12


@pytest.fixture(scope="module")
def pair():
    """Clean: repeated segments; corrupted: first copy replaced (the built-in induction pair)."""
    probes = repeated_probes(3, N_POS, range(256), 256, seed=4)
    return probes.tokens, corrupt_first_copy(probes, seed=5), probes.predictable


@pytest.fixture(scope="module")
def metric(pair):
    clean, _, predictable = pair
    return loss_metric(clean, predictable)


@pytest.fixture(scope="module")
def tl_reference(bridge_gpt2, pair, metric):
    """TransformerLens's sweeps on the bridge: the peer every implementation must match."""
    clean, corrupted, _ = pair
    bridge_gpt2.eval()
    _, clean_cache = bridge_gpt2.run_with_cache(clean)
    args = (bridge_gpt2, corrupted, clean_cache, metric)
    return {
        "heads": tl_patching.get_act_patch_attn_head_out_all_pos(*args),
        "by_pos": tl_patching.get_act_patch_attn_head_out_by_pos(*args),
        "resid": tl_patching.get_act_patch_resid_pre(*args),
        "pattern": tl_patching.get_act_patch_attn_head_pattern_all_pos(*args),
        "pattern_by_pos": tl_patching.get_act_patch_attn_head_pattern_by_pos(*args),
    }


@pytest.fixture(params=["scratch", "bridge"])
def model(request, scratch_gpt2, bridge_gpt2):
    return scratch_gpt2 if request.param == "scratch" else bridge_gpt2


def test_heads_all_positions_equal_transformer_lens(model, pair, metric, tl_reference):
    clean, corrupted, _ = pair
    ours = patch_heads(model, clean, corrupted, metric, progress=False)
    assert ours.shape == (2, 4)
    torch.testing.assert_close(ours, tl_reference["heads"].cpu().float(), atol=1e-4, rtol=0)
    assert ours.std() > 1e-3  # the heads differ, so the comparison is not vacuous


def test_heads_by_position_equal_transformer_lens(model, pair, metric, tl_reference):
    clean, corrupted, _ = pair
    ours = patch_heads(model, clean, corrupted, metric, by_position=True, progress=False, memory_mb=1)
    assert ours.shape == (2, N_POS, 4)
    torch.testing.assert_close(ours, tl_reference["by_pos"].cpu().float(), atol=1e-4, rtol=0)


def test_residual_equals_transformer_lens(model, pair, metric, tl_reference):
    clean, corrupted, _ = pair
    ours = patch_residual(model, clean, corrupted, metric, progress=False)
    assert ours.shape == (2, N_POS)
    torch.testing.assert_close(ours, tl_reference["resid"].cpu().float(), atol=1e-4, rtol=0)


def test_patterns_equal_transformer_lens(model, pair, metric, tl_reference):
    clean, corrupted, _ = pair
    ours = patch_patterns(model, clean, corrupted, metric, progress=False)
    torch.testing.assert_close(ours, tl_reference["pattern"].cpu().float(), atol=1e-4, rtol=0)


def test_patterns_by_query_position_equal_transformer_lens(model, pair, metric, tl_reference):
    clean, corrupted, _ = pair
    ours = patch_components(model, clean, corrupted, metric, "patterns", by_position=True, progress=False)
    assert ours.shape == (2, 4, N_POS)  # TransformerLens's [n_layers, n_heads, dest_pos]
    theirs = tl_reference["pattern_by_pos"].cpu().float()
    unpatched = metric(model(corrupted)).item()
    # a random model's query rows matter little (effects up to ~1e-4), so the effects are compared, finely
    assert (ours - unpatched).abs().max() > 5e-5
    torch.testing.assert_close(ours - unpatched, theirs - unpatched, atol=1e-6, rtol=1e-2)


@pytest.mark.parametrize("component, kwargs, message", [
    ("neurons", {}, "unknown component 'neurons'; allowed: heads, mlps, residual, patterns"),
    ("heads", {"method": "guess"}, "unknown method 'guess'; allowed: exact, attribution"),
    ("residual", {}, r"patching residual is by position only \(by_position=True\)"),
    ("patterns", {"method": "attribution"}, "attribution patching takes heads, MLPs or the residual, not patterns"),
])
def test_bad_components_and_methods_are_refused_in_one_line(scratch_gpt2, pair, metric, component, kwargs, message):
    clean, corrupted, _ = pair
    with pytest.raises(ValueError, match=message):
        patch_components(scratch_gpt2, clean, corrupted, metric, component, progress=False, **kwargs)


def test_transformer_lens_sweep_on_gptmodel_agrees(scratch_gpt2, pair, metric):
    """TL's own sweep driving our GPTModel equals ours."""
    model = copy.deepcopy(scratch_gpt2).eval()
    clean, corrupted, _ = pair
    _, clean_cache = model.run_with_cache(clean)
    expected = tl_patching.get_act_patch_attn_head_out_all_pos(model, corrupted, clean_cache, metric)
    torch.testing.assert_close(patch_heads(model, clean, corrupted, metric, progress=False), expected, atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def one_token_pair(pair):
    """Clean probes and a corrupted copy differing in one position (the first segment token)."""
    clean, _, predictable = pair
    corrupted = clean.clone()
    corrupted[:, 3] = (clean[:, 3] + 1) % 256
    return clean, corrupted, loss_metric(clean, predictable), 3


@pytest.mark.parametrize("fixture", ["scratch_gpt2", "bridge_gpt2"])
def test_normalized_endpoints(request, fixture, one_token_pair):
    """The docstring's endpoints: 0 = the corrupted run, 1 = the clean run. At layer 0 the only
    residual that differs is the changed position's, so patching it there reproduces the source
    run (denoising: 1; noising: 0) and patching any other position changes nothing."""
    model = request.getfixturevalue(fixture)
    clean, corrupted, metric, changed = one_token_pair
    others = [pos for pos in range(N_POS) if pos != changed]
    denoised = patch_residual(model, clean, corrupted, metric, normalize=True, progress=False)
    assert denoised[0, changed].item() == pytest.approx(1.0, abs=1e-5)
    assert denoised[0, others].abs().max().item() < 1e-5
    noised = patch_residual(model, clean, corrupted, metric, direction="noise", normalize=True, progress=False)
    assert noised[0, changed].item() == pytest.approx(0.0, abs=1e-5)
    assert (noised[0, others] - 1).abs().max().item() < 1e-5


def test_noising_a_head_is_the_clean_run_with_its_corrupted_output(scratch_gpt2, pair, metric):
    clean, corrupted, _ = pair
    noised = patch_heads(scratch_gpt2, clean, corrupted, metric, direction="noise", progress=False)
    with torch.no_grad():
        _, cache = scratch_gpt2.run_with_cache(corrupted)
        for layer, head in [(0, 0), (1, 2)]:
            def hook(z, hook, head=head, name=f"blocks.{layer}.attn.hook_z"):
                z = z.clone()
                z[:, :, head] = cache[name][:, :, head]
                return z

            expected = metric(scratch_gpt2.run_with_hooks(clean, fwd_hooks=[(f"blocks.{layer}.attn.hook_z", hook)]))
            assert noised[layer, head].item() == pytest.approx(expected.item(), abs=1e-5)


def test_heads_equal_transformer_lens_on_a_grouped_query_model(family_dir, pair, metric):
    """Llama with 2 key/value heads for 4 query heads, on the bridge (whose hook_k/hook_v carry the
    2 key/value heads): hook_z carries the 4 query heads, and head patching equals TransformerLens."""
    model = load_model(family_dir("llama"), impl="transformer_lens")
    clean, corrupted, _ = pair
    clean, corrupted = clean % 256 + 3, corrupted % 256 + 3  # byte tokens of the Llama tokenizer
    clean[:, 0] = corrupted[:, 0] = 1
    metric = loss_metric(clean)
    _, clean_cache = model.run_with_cache(clean)
    expected = tl_patching.get_act_patch_attn_head_out_all_pos(model, corrupted, clean_cache, metric)
    ours = patch_heads(model, clean, corrupted, metric, progress=False)
    torch.testing.assert_close(ours, expected.cpu().float(), atol=1e-4, rtol=0)
    assert ours.std() > 1e-4


def test_logit_diff_metric_and_frame(scratch_gpt2, pair):
    clean, corrupted, _ = pair
    metric = logit_diff_metric(clean[:, -1], corrupted[:, -1], position=-2)
    result = patch_heads(scratch_gpt2, clean, corrupted, metric, progress=False)
    frame = patching_frame(result, ("layer", "head"))
    assert list(frame.columns) == ["layer", "head", "metric"] and len(frame) == 8
    assert frame.loc[(frame["layer"] == 1) & (frame["head"] == 3), "metric"].item() == pytest.approx(result[1, 3].item())


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"corrupted_tokens": torch.zeros(3, N_POS - 1, dtype=torch.long)}, "12 tokens long but corrupted prompts are 11"),
        ({"direction": "sideways"}, "unknown direction 'sideways'; allowed: denoise, noise"),
    ],
)
def test_bad_inputs_name_the_value(scratch_gpt2, pair, metric, kwargs, message):
    clean, corrupted, _ = pair
    args = {"clean_tokens": clean, "corrupted_tokens": corrupted} | kwargs
    with pytest.raises(ValueError, match=message):
        patch_heads(scratch_gpt2, metric=metric, progress=False, **args)


@pytest.mark.parametrize("family", ["opt", "gpt_neo"])
def test_edits_that_reach_nothing_are_refused(family, family_dir):
    """On these bridges an edit of hook_pattern changes nothing (the hook self-test measures it):
    pattern patching and pattern-preserving ablation are refused instead of returning numbers;
    hook_z edits reach the output, so head patching and plain ablation run."""
    model = load_model(family_dir(family))
    probes = probes_for(model, 2, 16, seed=0)
    clean, corrupted, metric = probes.tokens, corrupt_first_copy(probes, seed=1), loss_metric(probes.tokens)
    with pytest.raises(UserError, match=f"patching patterns needs edits of hook_pattern.*{family}"):
        patch_patterns(model, clean, corrupted, metric, progress=False)
    with pytest.raises(UserError, match="preserve_patterns=True needs edits of hook_pattern"):
        ablate_heads(model, clean, [(0, 0)], preserve_patterns=True)
    assert patch_heads(model, clean, corrupted, metric, progress=False).shape == (2, 4)
    assert ablate_heads(model, clean, [(0, 0)]) != ablate_heads(model, clean, [])
