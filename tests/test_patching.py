"""Exact patching against TransformerLens's own sweeps on the same weights (DESIGN 6)."""

from __future__ import annotations

import copy

import pytest
import torch
from transformer_lens import patching as tl_patching

from analyses.metrics import logit_diff_metric, loss_metric
from analyses.patching import patch_heads, patch_patterns, patch_residual, patching_frame
from analyses.probes import corrupt_first_copy, repeated_probes

N_POS = 12


@pytest.fixture(scope="module")
def pair():
    """Clean: repeated segments; corrupted: first copy replaced (the built-in induction pair)."""
    probes = repeated_probes(3, N_POS, 257, bos_token_id=256, seed=4)
    return probes.tokens, corrupt_first_copy(probes, 257, 256, seed=5), probes.predictable


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


def test_transformer_lens_sweep_on_gptmodel_agrees(scratch_gpt2, pair, metric):
    """TL's own sweep driving our GPTModel equals ours."""
    model = copy.deepcopy(scratch_gpt2).eval()
    clean, corrupted, _ = pair
    _, clean_cache = model.run_with_cache(clean)
    expected = tl_patching.get_act_patch_attn_head_out_all_pos(model, corrupted, clean_cache, metric)
    torch.testing.assert_close(patch_heads(model, clean, corrupted, metric, progress=False), expected, atol=1e-4, rtol=0)


def test_normalized_and_noising_endpoints(scratch_gpt2, pair, metric):
    """Patching the whole residual at layer 0 reproduces the source run: normalised 1 when
    denoising, 0 when noising (the clean run patched with everything corrupted is corrupted)."""
    clean, corrupted, _ = pair
    clean_loss = metric(scratch_gpt2(clean)).item()
    corrupted_loss = metric(scratch_gpt2(corrupted)).item()
    denoised = patch_residual(scratch_gpt2, clean, corrupted, metric, normalize=True, progress=False)
    raw = patch_residual(scratch_gpt2, clean, corrupted, metric, progress=False)
    torch.testing.assert_close(denoised, (raw - corrupted_loss) / (clean_loss - corrupted_loss))
    # positions where clean and corrupted tokens agree change nothing: normalised 0
    same = (clean == corrupted).all(0)
    assert denoised[0, same].abs().max() < 1e-4
    noised = patch_heads(scratch_gpt2, clean, corrupted, metric, direction="noise", progress=False)
    # noising head h: the clean run with h's output from the corrupted run
    with torch.no_grad():
        _, cache = scratch_gpt2.run_with_cache(corrupted)

        def hook(z, hook):
            z[:, :, 2] = cache["blocks.1.attn.hook_z"][:, :, 2]
            return z

        expected = metric(scratch_gpt2.run_with_hooks(clean, fwd_hooks=[("blocks.1.attn.hook_z", hook)]))
    assert noised[1, 2].item() == pytest.approx(expected.item(), abs=1e-5)


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
