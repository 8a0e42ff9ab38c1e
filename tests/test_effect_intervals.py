"""Effects of interventions as means over prompts with bootstrap intervals (architecture §4.12), against
prompts run one at a time through hand-written hooks and a bootstrap written out by hand."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from analyses.core.execution import executing
from analyses.core.metrics import PromptScores, logit_diff_metric, loss_metric
from analyses.core.stats import effect_intervals
from analyses.interventions.ablation import ablation_sweep, prepare_ablation
from analyses.interventions.patching import patch_effects, patch_heads
from interp import load_model
from hand_checks import bootstrap_by_hand, zero_head


@pytest.fixture(scope="module")
def toy():
    return load_model("toy")


@pytest.fixture(scope="module")
def batch(toy):
    """Six prompts of 10 tokens; a loss mask counting a different number of tokens in each, none in
    the last (position 0 is never predicted, so prompt 5 counts nothing)."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, toy.cfg.d_vocab, (6, 10), generator=generator)
    mask = torch.zeros(6, 10, dtype=torch.bool)
    for b, n in enumerate([1, 3, 5, 2, 9, 0]):
        mask[b, 10 - n:] = True
    mask[5, 0] = True  # position 0 only: nothing predicted
    return tokens, mask



def loss_by_hand(logits: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor) -> tuple[float, int]:
    """One prompt's logits (pos, d_vocab) -> (its summed next-token loss over the masked predicted
    tokens, how many)."""
    losses = -torch.log_softmax(logits[:-1].double(), dim=-1).gather(-1, tokens[1:, None])[:, 0]
    return float(losses[mask[1:]].sum()), int(mask[1:].sum())


def alone(model, tokens: torch.Tensor, hooks=()) -> list[torch.Tensor]:
    """Each prompt run alone (1, pos) under ``hooks`` -> its logits (pos, d_vocab)."""
    with torch.no_grad():
        return [model.run_with_hooks(tokens[b:b + 1], fwd_hooks=list(hooks))[0] for b in range(len(tokens))]


@pytest.mark.parametrize("memory_mb", [1024, 0.02])  # every prompt in one forward; a few prompts per forward
def test_per_prompt_loss_pools_to_the_engine_value(toy, batch, memory_mb):
    tokens, mask = batch
    metric = loss_metric(tokens, mask)
    head_sets = [[(1, 3)], [], [(0, 5), (1, 0)]]
    with executing(memory_mb=memory_mb, progress=False):
        ablation = prepare_ablation(toy, tokens, "zero", metric)
        scores = ablation.scores(head_sets)
    runs = {0: [zero_head(1, 3)], 1: [], 2: [zero_head(0, 5), zero_head(1, 0)]}
    for row, hooks in runs.items():
        by_hand = [loss_by_hand(logits, tokens[b], mask[b]) for b, logits in enumerate(alone(toy, tokens, hooks))]
        sums = torch.tensor([s for s, _ in by_hand], dtype=torch.float64)
        counts = torch.tensor([n for _, n in by_hand], dtype=torch.float64)
        torch.testing.assert_close(scores.numerators[row].cpu(), sums, atol=1e-4, rtol=1e-5)
        assert torch.equal(scores.counts.cpu(), counts)
        # the pooled value the engine returned (as before per-prompt numerators existed) is theirs
        assert scores.values[row].item() == pytest.approx((sums.sum() / counts.sum()).item(), abs=1e-6)
        assert scores.values[row].item() == pytest.approx(
            (scores.numerators[row].sum() / scores.counts.sum()).item(), rel=1e-6)
    assert scores.values[1].item() == ablation.baseline
    assert torch.equal(scores.numerators[1], ablation.baseline_scores().numerators)


def test_per_prompt_logit_difference_pools_to_the_engine_value(toy, batch):
    tokens, _ = batch
    correct, incorrect = tokens[:, 0], (tokens[:, 0] + 1) % toy.cfg.d_vocab
    metric = logit_diff_metric(correct, incorrect, position=-2)
    with executing(memory_mb=0.02, progress=False):
        scores = prepare_ablation(toy, tokens, "zero", metric).scores([[(1, 6)]])
    diffs = torch.tensor([float(logits[-2, correct[b]] - logits[-2, incorrect[b]])
                          for b, logits in enumerate(alone(toy, tokens, [zero_head(1, 6)]))], dtype=torch.float64)
    torch.testing.assert_close(scores.numerators[0].cpu(), diffs, atol=1e-4, rtol=1e-5)
    assert torch.equal(scores.counts.cpu(), torch.ones(6, dtype=torch.float64))
    assert scores.values[0].item() == pytest.approx(diffs.mean().item(), abs=1e-5)



def test_single_head_ablation_interval_is_the_hand_bootstrap(toy, batch):
    tokens, mask = batch
    frame = ablation_sweep(toy, tokens, [[(1, 3)]], "zero", loss_metric(tokens, mask), seed=7, progress=False)
    base = [loss_by_hand(logits, tokens[b], mask[b]) for b, logits in enumerate(alone(toy, tokens))]
    ablated = [loss_by_hand(logits, tokens[b], mask[b]) for b, logits in enumerate(alone(toy, tokens, [zero_head(1, 3)]))]
    kept = [b for b, (_, n) in enumerate(base) if n > 0]  # prompt 5 counts nothing: it is not a sample
    effects = np.array([ablated[b][0] - base[b][0] for b in kept])
    counts = np.array([base[b][1] for b in kept], dtype=float)
    low, high = bootstrap_by_hand(effects, counts, seed=7)
    row = frame.iloc[0]
    assert row["n_prompts"] == 5
    assert row["effect"] == pytest.approx(effects.sum() / counts.sum(), abs=1e-5)
    assert row["ci_low"] == pytest.approx(low, abs=1e-6)
    assert row["ci_high"] == pytest.approx(high, abs=1e-6)
    assert row["ci_low"] < row["ci_high"]


def test_normalised_patching_interval_is_the_hand_ratio_bootstrap(toy, batch):
    """Denoising one head, normalised: per prompt (patched - corrupted) over (clean - corrupted)."""
    clean, _ = batch
    corrupted = clean.clone()
    corrupted[:, 1:5] = torch.randint(1, toy.cfg.d_vocab, (6, 4), generator=torch.Generator().manual_seed(1))
    metric = logit_diff_metric(clean[:, -1], clean[:, 1])
    frame = patch_effects(toy, clean, corrupted, metric, normalize=True, seed=3, progress=False)
    assert np.allclose(frame["metric"], patch_heads(toy, clean, corrupted, metric, normalize=True).flatten().numpy())
    with torch.no_grad():
        _, cache = toy.run_with_cache(clean)
    clean_z = cache["blocks.1.attn.hook_z"]

    def patch_in(z, hook):
        z = z.clone()
        z[:, :, 2] = clean_z[hook_rows[0]:hook_rows[0] + 1, :, 2]
        return z

    def diff(logits, b):
        return float(logits[-1, clean[b, -1]] - logits[-1, clean[b, 1]])

    hook_rows = [0]
    patched = []
    for b in range(6):
        hook_rows[0] = b
        with torch.no_grad():
            patched.append(diff(toy.run_with_hooks(corrupted[b:b + 1], fwd_hooks=[("blocks.1.attn.hook_z", patch_in)])[0], b))
    clean_d = np.array([diff(logits, b) for b, logits in enumerate(alone(toy, clean))])
    corrupted_d = np.array([diff(logits, b) for b, logits in enumerate(alone(toy, corrupted))])
    low, high = bootstrap_by_hand(np.array(patched) - corrupted_d, clean_d - corrupted_d, seed=3)
    row = frame[(frame["layer"] == 1) & (frame["head"] == 2)].iloc[0]
    assert row["baseline"] == 0.0 and row["n_prompts"] == 6
    assert row["effect"] == pytest.approx((sum(patched) - corrupted_d.sum()) / (clean_d - corrupted_d).sum(), abs=1e-4)
    # a ratio of float32 differences: batched and one-prompt forwards agree to ~1e-6 of it
    assert row["ci_low"] == pytest.approx(low, rel=1e-5)
    assert row["ci_high"] == pytest.approx(high, rel=1e-5)


def test_a_callable_without_per_prompt_form_gets_no_interval(toy, batch):
    tokens, _ = batch
    frame = ablation_sweep(toy, tokens, [[(0, 0)], []], "zero", lambda logits: logits[:, -1, 0].mean(), progress=False)
    assert frame["effect"].notna().all() and frame["ci_low"].isna().all() and frame["ci_high"].isna().all()
    assert (frame["n_prompts"] == 6).all()


def test_empty_set_interval_is_exactly_zero(toy, batch):
    tokens, mask = batch
    frame = ablation_sweep(toy, tokens, [[]], "zero", loss_metric(tokens, mask), progress=False)
    assert (frame["effect"].iloc[0], frame["ci_low"].iloc[0], frame["ci_high"].iloc[0]) == (0.0, 0.0, 0.0)


def test_intervals_cover_a_known_effect():
    """Per-prompt effects drawn with a known pooled mean (0.3 per counted token, counts 1..5): the
    95% intervals cover it in at least 90% of 200 seeds (and are not so wide as to cover 0 often)."""
    truth, covered, excluded_zero, n = 0.3, 0, 0, 40
    for seed in range(200):
        generator = torch.Generator().manual_seed(1000 + seed)
        counts = torch.randint(1, 6, (n,), generator=generator).double()
        base = torch.randn(n, generator=generator, dtype=torch.float64) * counts
        effect = truth * counts + torch.randn(n, generator=generator, dtype=torch.float64) * counts.sqrt()
        baseline = PromptScores(base.sum() / counts.sum(), base, counts)
        scores = PromptScores(((base + effect).sum() / counts.sum())[None], (base + effect)[None], counts)
        low, high, n_prompts = effect_intervals(scores, baseline, n, seed=seed)
        assert n_prompts == n
        covered += int(low.item() <= truth <= high.item())
        excluded_zero += int(low.item() > 0)
    assert covered >= 180
    assert excluded_zero >= 150


@pytest.mark.parametrize("device", ["cuda", "mps"])
def test_intervals_on_a_gpu_are_the_cpus(toy, batch, device):
    """With the model on a (simulated) GPU, the per-prompt numerators stay on it (float32 on mps, which
    has no float64) and the frames come out as on the CPU."""
    from simulated_device import CUDA, MPS, SimulatedDevice

    placed = CUDA if device == "cuda" else MPS

    def frames(on):
        tokens, mask = (tensor.to(on) for tensor in batch)  # the prompts on the model's device, as a user's
        metric = loss_metric(tokens, mask)
        return (ablation_sweep(toy, tokens, [[(1, 3)], [(0, 1), (1, 2)]], "mean", metric, progress=False),
                patch_effects(toy, tokens, tokens.flip(0), metric, "heads", normalize=True, progress=False))

    on_cpu = frames("cpu")
    simulated = SimulatedDevice()
    simulated.place_model(toy, placed)
    try:
        with simulated:
            on_gpu = frames(placed)
    finally:
        simulated.place_model(toy, "cpu")
    for gpu, cpu in zip(on_gpu, on_cpu):
        assert gpu["ci_low"].notna().all()
        pd.testing.assert_frame_equal(gpu, cpu, check_exact=False, atol=1e-5, rtol=1e-5, check_dtype=False)
