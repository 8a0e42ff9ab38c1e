"""Direct logit attribution as a task measures it (``dla_effects``): onto the logit difference split into
its answer and distractor parts, onto the centred logit without distractors, each a mean over prompts
with a bootstrap interval. Checked against the model's own logits, a hand computation from hooked
activations, TransformerLens's ``ActivationCache.logit_attrs`` and a naive bootstrap loop."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from analyses.components.decompose import components_cache, dla_effects
from interp import UserError, from_hf
from interp.bridge import boot_bridge
from interp.random_models import random_hf_model

N_BOOT = 400


def _perturbed(family: str):
    """A random model whose norm gains and biases are moved off 1 and 0 (a missing one would show)."""
    hf_model, tokenizer = random_hf_model(family, seed=7)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in hf_model.parameters():
            if param.ndim == 1:
                param.add_(0.3 * torch.randn(param.shape, generator=generator))
    return hf_model, tokenizer


def _naive_bootstrap(per_prompt: np.ndarray, n_boot: int = N_BOOT, seed: int = 0) -> tuple[float, float]:
    """The percentile interval of the mean, one resample at a time: prompts drawn with replacement by
    the same seeded generator as the library (torch.randint, one row of draws per resample)."""
    n = len(per_prompt)
    draws = torch.randint(n, (n_boot, n), generator=torch.Generator().manual_seed(seed)).numpy()
    means = np.array([per_prompt[row].mean() for row in draws])
    return float(np.quantile(means, 0.025)), float(np.quantile(means, 0.975))


def _sets(n: int, width: int, seed: int) -> list[tuple[int, ...]]:
    """Ragged per-prompt id sets (1..width ids each)."""
    generator = torch.Generator().manual_seed(seed)
    return [tuple(torch.randint(3, 300, (1 + i % width,), generator=generator).tolist()) for i in range(n)]


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_logit_difference_parts_add_up_to_the_models_logits(family):
    """Ragged answer and distractor sets, each prompt read at its own position: summed over the
    components, dla is the mean over prompts of (mean answer logit - mean distractor logit) that the
    model's logits give, dla_answer the mean answer logit, dla_distractor minus the distractors'."""
    model = from_hf(*_perturbed(family))
    tokens = torch.randint(3, 300, (12, 9), generator=torch.Generator().manual_seed(0))
    at = torch.tensor([8, 5, 8, 3, 7, 8, 2, 8, 6, 8, 4, 8])
    answers, distractors = _sets(12, 3, 1), _sets(12, 2, 2)
    frame = dla_effects(model, tokens, answers, distractors, at=at, n_boot=50)
    assert (frame["onto"] == "logit_diff").all() and (frame["n_prompts"] == 12).all()
    with torch.no_grad():
        logits = model(tokens)[torch.arange(12), at].double()  # (batch, vocab)
    good = torch.stack([logits[i, list(s)].mean() for i, s in enumerate(answers)])
    bad = torch.stack([logits[i, list(s)].mean() for i, s in enumerate(distractors)])
    assert frame["dla_answer"].sum() == pytest.approx(float(good.mean()), abs=1e-4)
    assert frame["dla_distractor"].sum() == pytest.approx(float(-bad.mean()), abs=1e-4)
    assert frame["dla"].sum() == pytest.approx(float((good - bad).mean()), abs=1e-4)
    assert np.allclose(frame["dla"], frame["dla_answer"] + frame["dla_distractor"], atol=1e-5)
    assert (frame["ci_low"] <= frame["dla"] + 1e-9).all() and (frame["dla"] <= frame["ci_high"] + 1e-9).all()
    assert (frame["dla_answer_ci_low"] < frame["dla_answer_ci_high"]).any()


def test_centred_logit_against_a_hand_computation_from_hooks(scratch_gpt2):
    """Without distractors: one head's write (its hook_z through its W_O, from run_with_cache), divided
    by the final LayerNorm's scale sqrt(var + eps) of the cached final residual, centred, times the
    norm's weight, onto W_U[:, answer] minus the vocabulary's mean column, per prompt and position;
    pooled over the counted positions, with a naive bootstrap over prompts of the per-prompt sums."""
    model = scratch_gpt2
    tokens = torch.randint(3, 250, (10, 8), generator=torch.Generator().manual_seed(3))
    positions = [2, 5, 7]
    answers = tokens[:, [3, 6, 0]]
    counted = torch.rand(10, 3, generator=torch.Generator().manual_seed(4)) > 0.3
    counted[:, 0] = True
    frame = dla_effects(model, tokens, answers, positions=positions, counted=counted, n_boot=N_BOOT)
    assert (frame["onto"] == "centred_logit").all()
    _, cache = model.run_with_cache(tokens)
    layer, head = 1, 2
    write = cache[f"blocks.{layer}.attn.hook_z"][:, positions, head] @ model.blocks[layer].attn.W_O[head]
    final = cache[f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"][:, positions]
    scale = (final.var(-1, unbiased=False, keepdim=True) + model.ln_final.eps).sqrt()
    direction = model.W_U[:, answers].permute(1, 2, 0) - model.W_U.mean(1)  # (batch, n, d_model)
    centred = write - write.mean(-1, keepdim=True)
    values = (centred / scale * model.ln_final.weight * direction).sum(-1).double()  # (batch, n)
    sums, counts = (values * counted).sum(1).detach().numpy(), counted.sum(1).numpy()
    row = frame.set_index("component").loc[f"L{layer}H{head}"]
    assert row["dla"] == pytest.approx(sums.sum() / counts.sum(), abs=1e-5)
    draws = torch.randint(10, (N_BOOT, 10), generator=torch.Generator().manual_seed(0)).numpy()
    means = np.array([sums[d].sum() / counts[d].sum() for d in draws])
    assert row["ci_low"] == pytest.approx(np.quantile(means, 0.025), abs=1e-5)
    assert row["ci_high"] == pytest.approx(np.quantile(means, 0.975), abs=1e-5)
    with torch.no_grad():
        logits = model(tokens)[:, positions].double()
    centred_logit = logits.gather(-1, answers[..., None])[..., 0] - logits.mean(-1)
    assert frame["dla"].sum() == pytest.approx(float(centred_logit[counted].mean()), abs=1e-4)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_centred_logit_equals_transformer_lens_logit_attrs(family):
    """TransformerLens's compatibility mode folds the final norm into W_U and centres W_U over the
    vocabulary, so its ``logit_attrs`` onto one token is the attribution onto the centred logit: per
    component its mean over prompts is ``dla``, and the naive bootstrap of its per-prompt values is
    ``ci_low``/``ci_high`` (heads' results from the unfolded bridge, as in test_components)."""
    hf_model, tokenizer = _perturbed(family)
    bridge, folded = boot_bridge(hf_model, tokenizer), boot_bridge(hf_model, tokenizer)
    folded.enable_compatibility_mode()
    tokens = torch.randint(3, 300, (16, 7), generator=torch.Generator().manual_seed(5))
    answers = torch.randint(3, 300, (16,), generator=torch.Generator().manual_seed(6))
    frame = dla_effects(bridge, tokens, answers, n_boot=N_BOOT).set_index("component")
    with torch.no_grad():
        _, tl_cache = folded.run_with_cache(tokens)
        _, unfolded_cache = bridge.run_with_cache(tokens)
    heads, labels = unfolded_cache.stack_head_results(return_labels=True, pos_slice=-1)
    stack, stack_labels = tl_cache.decompose_resid(return_labels=True, pos_slice=-1)
    theirs = torch.cat([tl_cache.logit_attrs(heads, answers, pos_slice=-1),
                        tl_cache.logit_attrs(stack, answers, pos_slice=-1)])  # (component, batch)
    checked = 0
    for label, values in zip(labels + stack_labels, theirs):
        if label not in frame.index:  # "{l}_attn_out" / "{l}_mlp_out": the layer sums, compared in test_components
            continue
        per_prompt = values.detach().double().numpy()
        low, high = _naive_bootstrap(per_prompt)
        assert frame.loc[label, "dla"] == pytest.approx(per_prompt.mean(), abs=1e-5), label
        assert (frame.loc[label, "ci_low"], frame.loc[label, "ci_high"]) == pytest.approx((low, high), abs=1e-5), label
        checked += 1
    assert checked == len(labels) + len({"embed", "pos_embed"} & set(stack_labels))  # every head, the embeddings


def test_a_cache_serves_and_bad_reads_are_refused(scratch_gpt2):
    tokens = torch.randint(3, 250, (4, 6), generator=torch.Generator().manual_seed(8))
    cache = components_cache(scratch_gpt2, tokens)
    assert dla_effects(scratch_gpt2, cache, tokens[:, -1], tokens[:, 0]).equals(
        dla_effects(scratch_gpt2, tokens, tokens[:, -1], tokens[:, 0]))
    with pytest.raises(UserError, match="not both"):
        dla_effects(scratch_gpt2, tokens, tokens[:, -1], at=torch.tensor([5, 5, 5, 5]), positions=[5])
    with pytest.raises(UserError, match="at= must be"):
        dla_effects(scratch_gpt2, tokens, tokens[:, -1], at=torch.tensor([5, 5, 6, 5]))
    with pytest.raises(UserError, match="counted= of shape"):
        dla_effects(scratch_gpt2, tokens, tokens[:, 1:], positions=range(5), counted=torch.ones(4, 4, dtype=torch.bool))
    with pytest.raises(UserError, match="counts no entry"):
        dla_effects(scratch_gpt2, tokens, tokens[:, -1], counted=torch.zeros(4, 1, dtype=torch.bool))
    with pytest.raises(UserError, match="id sets for 4 prompts"):
        dla_effects(scratch_gpt2, tokens, [(5,), (6,)], at=torch.tensor([5, 5, 5, 5]))
    with pytest.raises(UserError, match="one position per prompt"):
        dla_effects(scratch_gpt2, tokens, [(5,), (6, 7), (8,), (9,)], positions=[4, 5])
