"""Residual decomposition, direct logit attribution and the logit lens, against TransformerLens's own
``ActivationCache.decompose_resid`` / ``stack_head_results`` / ``logit_attrs`` / ``accumulated_resid``
on a bridge over the same weights, against the model's logits, and between the two implementations."""

from __future__ import annotations

import pytest
import torch

from analyses.components.decompose import (
    component_hooks, components_cache, decompose_residual, direct_logit_attribution, dla_heatmap, head_grid,
    logit_lens, logit_lens_figure, next_token_answers,
)
from analyses.core.hook_names import final_resid_name
from interp import GPTConfig, GPTModel, UserError, from_hf
from interp.bridge import boot_bridge
from interp.random_models import FAMILIES, random_hf_model

TOL = 1e-5
SCRATCH_FAMILIES = ("gpt2", "llama", "mistral", "qwen2", "gemma", "gpt_neox", "phi")


def _perturbed(family: str):
    """A random model of ``family`` whose 1-d parameters (norm gains, biases) are moved off their
    initial 1 and 0, which would hide a missing weight or bias in the final norm."""
    hf_model, tokenizer = random_hf_model(family, seed=5)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in hf_model.parameters():
            if param.ndim == 1:  # norm gains and biases, other biases
                param.add_(0.3 * torch.randn(param.shape, generator=generator))
    return hf_model, tokenizer


@pytest.fixture(scope="module")
def models():
    """family -> (hf model, tokenizer, bridge), made once per family."""
    made = {}

    def make(family: str):
        if family not in made:
            hf_model, tokenizer = _perturbed(family)
            made[family] = hf_model, tokenizer, boot_bridge(hf_model, tokenizer)
        return made[family]

    return make


def _tokens(n_batch=2, n_pos=10, seed=0):
    return torch.randint(3, 250, (n_batch, n_pos), generator=torch.Generator().manual_seed(seed))


def _tl_cache(bridge, tokens):
    with torch.no_grad():
        return bridge.run_with_cache(tokens)


@pytest.mark.parametrize("family", FAMILIES)
def test_parts_sum_to_the_final_residual_and_dla_to_the_logits(models, family):
    hf_model, _, bridge = models(family)
    tokens = _tokens()
    logits, cache = _tl_cache(bridge, tokens)
    cap = getattr(hf_model.config, "final_logit_softcapping", None)  # Gemma 2: DLA splits the logits before it
    if cap is not None:
        logits = cap * torch.atanh(logits.double() / cap)
    decomposition = decompose_residual(bridge, cache)
    final = cache[final_resid_name(bridge)]
    assert torch.allclose(decomposition.parts.sum(0), final.float(), atol=TOL)
    assert decomposition.parts.shape[0] == len(decomposition.components)
    answers, positions = next_token_answers(tokens)
    dla = direct_logit_attribution(bridge, cache, answers, positions=positions)
    total = dla.groupby(["prompt", "position"])["dla"].sum().to_numpy().reshape(answers.shape)
    expected = logits[:, :-1].gather(-1, answers[..., None])[..., 0]
    assert torch.allclose(torch.as_tensor(total), expected.float(), atol=1e-4)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_decomposition_equals_transformer_lens(models, family):
    _, _, bridge = models(family)
    tokens = _tokens()
    _, cache = _tl_cache(bridge, tokens)
    ours = decompose_residual(bridge, cache)
    table = ours.components
    heads, labels = cache.stack_head_results(return_labels=True)
    head_rows = table.index[table["kind"] == "head"].to_numpy()
    assert list(table.loc[head_rows, "component"]) == labels
    assert torch.allclose(ours.parts[head_rows], heads.float(), atol=TOL)
    theirs, their_labels = cache.decompose_resid(return_labels=True)
    for stack, label in zip(theirs, their_labels):
        if label in ("embed", "pos_embed"):
            mine = ours.parts[(table["component"] == label).to_numpy()].sum(0)
        else:  # "{l}_attn_out" = the layer's heads + its bias; "{l}_mlp_out" = its MLP
            layer, kind = int(label.split("_")[0]), label.split("_")[1]
            rows = (table["layer"] == layer) & table["kind"].isin(["head", "attn_bias"] if kind == "attn" else ["mlp"])
            mine = ours.parts[rows.to_numpy()].sum(0)
        assert torch.allclose(mine, stack.float(), atol=TOL), label


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_dla_equals_transformer_lens_logit_attrs(models, family):
    """TransformerLens's ``logit_attrs`` assumes the final LayerNorm folded into W_U (compatibility
    mode): it reads the scale and the unembedding of a folded bridge's cache, applied to the heads'
    results of the unfolded bridge (the folded one moves value biases out of the heads into b_O) and
    to the folded bridge's per-layer outputs. On logit differences: that mode also centres W_U over the
    vocabulary, which moves a single token's attribution by a constant per component."""
    hf_model, tokenizer, bridge = models(family)
    folded = boot_bridge(hf_model, tokenizer)
    folded.enable_compatibility_mode()
    tokens = _tokens(seed=1)
    answers, distractors = tokens[:, 1:], torch.roll(tokens[:, 1:], 1, dims=1)
    positions = list(range(tokens.shape[1] - 1))
    _, tl_cache = _tl_cache(folded, tokens)
    _, unfolded_cache = _tl_cache(bridge, tokens)
    dla = direct_logit_attribution(bridge, tokens, answers, distractors, positions=positions)
    heads, labels = unfolded_cache.stack_head_results(return_labels=True, pos_slice=slice(0, -1))
    stack, stack_labels = tl_cache.decompose_resid(return_labels=True, pos_slice=slice(0, -1))
    theirs = torch.cat([tl_cache.logit_attrs(heads, answers, distractors, pos_slice=slice(0, -1)),
                        tl_cache.logit_attrs(stack, answers, distractors, pos_slice=slice(0, -1))])
    for label, values in zip(labels + stack_labels, theirs):
        if label in ("embed", "pos_embed") or label.startswith("L"):
            rows = dla["component"] == label
        else:  # "{l}_attn_out" = the layer's heads + its bias; "{l}_mlp_out" = its MLP
            layer, kind = int(label.split("_")[0]), label.split("_")[1]
            rows = (dla["layer"] == layer) & dla["kind"].isin(["head", "attn_bias"] if kind == "attn" else ["mlp"])
        mine = dla[rows.fillna(False)].groupby(["prompt", "position"])["dla"].sum().to_numpy()
        assert torch.allclose(torch.as_tensor(mine).reshape(values.shape), values.float(), atol=TOL), label


@pytest.mark.parametrize("family", SCRATCH_FAMILIES)
def test_both_implementations_agree(models, family):
    hf_model, tokenizer, bridge = models(family)
    scratch = from_hf(hf_model, tokenizer)
    tokens = _tokens(seed=2)
    answers, positions = next_token_answers(tokens)
    ours, theirs = (direct_logit_attribution(model, tokens, answers, positions=positions) for model in (scratch, bridge))
    assert list(ours["component"]) == list(theirs["component"])
    assert torch.allclose(torch.as_tensor(ours["dla"].to_numpy()), torch.as_tensor(theirs["dla"].to_numpy()), atol=TOL)
    lens = [logit_lens(model, tokens, answers, positions=positions) for model in (scratch, bridge)]
    assert torch.allclose(torch.as_tensor(lens[0]["logit"].to_numpy()), torch.as_tensor(lens[1]["logit"].to_numpy()),
                          atol=TOL)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_logit_lens_equals_transformer_lens_accumulated_resid(models, family):
    _, _, bridge = models(family)
    tokens = _tokens(seed=3)
    logits, cache = _tl_cache(bridge, tokens)
    answers, positions = next_token_answers(tokens)
    lens = logit_lens(bridge, cache, answers, positions=positions, memory_mb=0.01)  # many small chunks
    stack, labels = cache.accumulated_resid(apply_ln=True, return_labels=True, pos_slice=slice(0, -1))
    theirs = stack @ bridge.W_U + bridge.b_U  # (stage, batch, pos, vocab)
    assert list(lens["stage"].unique()) == labels
    picked = theirs.gather(-1, answers[None, ..., None].expand(len(labels), -1, -1, 1))[..., 0]
    assert torch.allclose(torch.as_tensor(lens["logit"].to_numpy()).reshape(picked.shape), picked.float(), atol=TOL)
    rank = (theirs > picked[..., None]).sum(-1)
    assert (torch.as_tensor(lens["rank"].to_numpy()).reshape(rank.shape) == rank).all()
    final = lens[lens["stage"] == "final_post"]["log_prob"].to_numpy().reshape(answers.shape)
    expected = logits[:, :-1].log_softmax(-1).gather(-1, answers[..., None])[..., 0]
    assert torch.allclose(torch.as_tensor(final), expected.float(), atol=TOL)
    # ``where`` reads some entries only: TransformerLens's values there, labelled by prompt and position
    where = torch.rand(answers.shape, generator=torch.Generator().manual_seed(0)) < 0.3
    some = logit_lens(bridge, cache, answers, positions=positions, where=where, memory_mb=0.01)
    prompt, column = where.nonzero(as_tuple=True)
    assert len(some) == len(labels) * len(prompt)
    assert (some["prompt"].to_numpy() == prompt.repeat(len(labels)).numpy()).all()
    assert (some["position"].to_numpy() == column.repeat(len(labels)).numpy()).all()
    assert torch.allclose(torch.as_tensor(some["logit"].to_numpy()), picked[:, where].reshape(-1).float(), atol=TOL)
    assert (torch.as_tensor(some["rank"].to_numpy()) == rank[:, where].reshape(-1)).all()
    with pytest.raises(UserError, match="where of shape"):
        logit_lens(bridge, cache, answers, positions=positions, where=where[:, 1:])


def test_convenience_run_caches_only_what_it_reads(scratch_gpt2):
    tokens = _tokens(n_batch=3, n_pos=8)
    cache = components_cache(scratch_gpt2, tokens)
    assert sorted(cache.keys()) == sorted(component_hooks(scratch_gpt2))
    answers = tokens[:, -1]
    from_cache = direct_logit_attribution(scratch_gpt2, cache, answers)
    from_tokens = direct_logit_attribution(scratch_gpt2, tokens, answers)
    assert from_cache.equals(from_tokens)
    assert set(from_cache["position"]) == {7}
    grid = head_grid(from_cache)
    assert grid.shape == (2, 5)  # 4 heads and the MLP
    dla_heatmap(from_cache)
    logit_lens_figure(logit_lens(scratch_gpt2, tokens, answers))


def test_a_missing_part_or_bad_answers_is_refused(scratch_gpt2):
    tokens = _tokens(n_batch=2, n_pos=6)
    cache = dict(components_cache(scratch_gpt2, tokens).items())
    del cache["hook_pos_embed"]
    with pytest.raises(UserError, match="add up"):
        decompose_residual(scratch_gpt2, cache)
    with pytest.raises(UserError, match="answers"):
        direct_logit_attribution(scratch_gpt2, tokens, tokens[:, :3])
    with pytest.raises(UserError, match="positions"):
        direct_logit_attribution(scratch_gpt2, tokens, tokens[:, 0], positions=[9])
    with pytest.raises(UserError, match="token ids"):
        direct_logit_attribution(scratch_gpt2, tokens, tokens[:, 0] + 10_000)
    del cache["blocks.0.attn.hook_z"]
    with pytest.raises(UserError, match="lacks blocks.0.attn.hook_z"):
        decompose_residual(scratch_gpt2, cache)


# ---- MLPs as components: patching and attribution patching ------------------------------------------

def _induction_pair():
    from analyses.core.metrics import loss_metric
    from analyses.core.probes import corrupt_first_copy, repeated_probes
    probes = repeated_probes(3, 12, range(256), 256, seed=4)
    return probes.tokens, corrupt_first_copy(probes, seed=5), loss_metric(probes.tokens, probes.predictable)


@pytest.mark.parametrize("impl", ["scratch", "bridge"])
def test_mlp_patching_equals_transformer_lens(impl, scratch_gpt2, bridge_gpt2):
    from transformer_lens import patching as tl_patching

    from analyses.interventions.patching import patch_mlps
    clean, corrupted, metric = _induction_pair()
    model = scratch_gpt2 if impl == "scratch" else bridge_gpt2
    _, clean_cache = bridge_gpt2.run_with_cache(clean)
    theirs = tl_patching.get_act_patch_mlp_out(bridge_gpt2, corrupted, clean_cache, metric).float()
    by_position = patch_mlps(model, clean, corrupted, metric, by_position=True, progress=False, memory_mb=1)
    assert by_position.shape == (2, 12) and by_position.std() > 1e-4
    torch.testing.assert_close(by_position, theirs, atol=1e-4, rtol=0)
    # all positions at once: TransformerLens's generic patcher with a whole-layer index
    whole = tl_patching.generic_activation_patch(
        bridge_gpt2, corrupted, clean_cache, metric, lambda corrupted_act, index, clean_act: clean_act,
        "mlp_out", index_axis_names=("layer",)).float()
    torch.testing.assert_close(patch_mlps(model, clean, corrupted, metric, progress=False), whole, atol=1e-4, rtol=0)


def test_mlp_attribution_equals_a_naive_gradient(scratch_gpt2):
    from analyses.interventions.attribution import attribution_patch_mlps
    from analyses.core.hook_names import mlp_out_name
    clean, corrupted, metric = _induction_pair()
    estimate = attribution_patch_mlps(scratch_gpt2, clean, corrupted, metric, by_position=True)
    _, clean_cache = scratch_gpt2.run_with_cache(clean)
    kept = {}

    def keep(activation, hook):
        kept[hook.name] = activation
        return activation

    def start(embed, hook):  # the graph starts at the embeddings (the weights need no grad)
        return embed.detach().requires_grad_(True)

    names = [mlp_out_name(layer) for layer in range(2)]
    with torch.enable_grad():
        value = metric(scratch_gpt2.run_with_hooks(corrupted, fwd_hooks=[("hook_embed", start)] + [(n, keep) for n in names]))
        grads = torch.autograd.grad(value, [kept[n] for n in names])
    naive = torch.stack([((clean_cache[n] - kept[n].detach()) * grad).sum(-1).sum(0) for n, grad in zip(names, grads)])
    torch.testing.assert_close(estimate, value.item() + naive, atol=1e-5, rtol=0)
    whole = attribution_patch_mlps(scratch_gpt2, clean, corrupted, metric)
    torch.testing.assert_close(whole, value.item() + naive.sum(1), atol=1e-5, rtol=0)


def test_attention_only_models_have_no_mlps_to_patch():
    from analyses.interventions.patching import patch_mlps
    model = GPTModel(GPTConfig(d_vocab=300, n_ctx=16, d_model=16, n_heads=2, n_layers=1, attn_only=True))
    tokens = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(0))
    with pytest.raises(UserError, match="attention-only"):
        patch_mlps(model, tokens, tokens, lambda logits: logits.sum())


@pytest.mark.parametrize("method", ["zero", "mean"])
def test_mlp_ablation_equals_a_naive_loop(scratch_gpt2, method):
    from analyses.components.decompose import mlp_ablation
    from analyses.core.metrics import loss_metric
    tokens = _tokens(n_batch=3, n_pos=8, seed=4)
    metric = loss_metric(tokens)
    frame = mlp_ablation(scratch_gpt2, tokens, metric, method=method, progress=False)
    by_position = mlp_ablation(scratch_gpt2, tokens, metric, method=method, by_position=True, memory_mb=1,
                               progress=False)
    _, cache = scratch_gpt2.run_with_cache(tokens)
    for layer in range(2):
        name = f"blocks.{layer}.hook_mlp_out"
        full = cache[name]
        replacement = torch.zeros_like(full) if method == "zero" else (full.sum(0, keepdim=True) - full) / 2
        for position in (None, 5):
            def ablate(activation, hook):
                edited = activation.clone()
                edited[:, slice(None) if position is None else position] = replacement[:, slice(None) if position is None else position]
                return edited
            expected = metric(scratch_gpt2.run_with_hooks(tokens, fwd_hooks=[(name, ablate)])).item()
            table = frame if position is None else by_position[by_position["position"] == position]
            assert table[table["layer"] == layer]["value"].item() == pytest.approx(expected, abs=1e-5)
    assert (frame["effect"] == frame["value"] - frame["baseline"]).all()
    with pytest.raises(UserError, match="MLP ablation method"):
        mlp_ablation(scratch_gpt2, tokens, metric, method="resample")


def test_attention_vs_mlp_rows(scratch_gpt2):
    from analyses.components.decompose import attention_vs_mlp, attention_vs_mlp_figure
    from analyses.interventions.patching import patch_heads, patch_mlps
    clean, corrupted, metric = _induction_pair()
    answers, positions = next_token_answers(clean)
    frame = attention_vs_mlp(scratch_gpt2, clean, corrupted, metric, answers, positions=positions, progress=False)
    assert list(frame["component"]) == ["L0H0", "L0H1", "L0H2", "L0H3", "L0 MLP", "L1H0", "L1H1", "L1H2", "L1H3", "L1 MLP"]
    heads = patch_heads(scratch_gpt2, clean, corrupted, metric, normalize=True, progress=False)
    mlps = patch_mlps(scratch_gpt2, clean, corrupted, metric, normalize=True, progress=False)
    assert frame["total"].tolist() == pytest.approx([*heads[0].tolist(), mlps[0].item(), *heads[1].tolist(), mlps[1].item()])
    from analyses.components.decompose import dla_effects  # onto the centred logit, tested in test_dla_intervals
    dla = dla_effects(scratch_gpt2, clean, answers, positions=positions).set_index("component")
    row = frame.set_index("component").loc["L1H2"]
    assert (row["direct"], row["direct_ci_low"], row["direct_ci_high"], row["n_prompts"]) == pytest.approx(
        tuple(dla.loc["L1H2", ["dla", "ci_low", "ci_high", "n_prompts"]]))
    assert row["direct_ci_low"] < row["direct"] < row["direct_ci_high"]
    assert (frame["total_ci_low"] <= frame["total"] + 1e-9).all() and (frame["total"] <= frame["total_ci_high"] + 1e-9).all()
    cached = attention_vs_mlp(scratch_gpt2, clean, corrupted, metric, answers, positions=positions,
                              cache=components_cache(scratch_gpt2, clean), progress=False)
    assert cached.equals(frame)  # the clean run's cache serves the direct effects
    attention_vs_mlp_figure(frame)


def test_a_zero_residual_row_contributes_nothing():
    """Qwen2's padding token (its start token in the probes) has a zero embedding; in a model without
    biases its final residual is exactly zero, and the norm outputs its bias there."""
    hf_model, tokenizer = random_hf_model("qwen2", seed=3)
    model = from_hf(hf_model, tokenizer)
    tokens = torch.tensor([[256, 5, 6, 7], [256, 8, 9, 10]])
    assert hf_model.model.embed_tokens.weight[256].abs().max() == 0
    answers, positions = next_token_answers(tokens)
    dla = direct_logit_attribution(model, tokens, answers, positions=positions)
    at_start = dla[dla["position"] == 0]
    assert (at_start[at_start["component"] != "unembed bias"]["dla"] == 0).all()
    total = dla.groupby(["prompt", "position"])["dla"].sum().to_numpy().reshape(answers.shape)
    expected = model(tokens)[:, :-1].gather(-1, answers[..., None])[..., 0]
    assert torch.allclose(torch.as_tensor(total), expected, atol=1e-5)
