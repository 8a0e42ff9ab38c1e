"""The analyses on blocks that norm their attention output (Gemma 2 and 3's ``ln1_post``) and on a
final logit soft cap (issue 46.2): each is exact under the definitions of docs/guides/families.md,
checked against hand computations from Hugging Face's own modules (its ``1 + weight`` norms, its
eps), or refused in one line. Tiny random models, norm weights drawn away from Gemma's zero
initialisation so that every norm's weight counts, the final logits capped at 2 so that the cap
bends them.

A head's contribution to the residual in such a block: ``weight * (z_h @ W_O[h]) / s``, ``s`` the
clean run's ``sqrt(mean(attn.hook_out ** 2) + eps)`` at that prompt and position, frozen.
"""

from __future__ import annotations

import argparse

import pytest
import torch

import analyses.cli.check as check_command
import analyses.core.hook_check as hook_check
from analyses.components.decompose import decompose_residual, direct_logit_attribution, dla_effects
from analyses.circuits.composition import composition_scores
from analyses.circuits.path_patching import path_patch
from analyses.core.metrics import logit_diff_metric, loss_metric
from analyses.roles.backup import direct_and_total_effects
from analyses.roles.readout import FinalReadout
from interp import from_hf
from interp.bridge import boot_bridge
from interp.errors import UserError
from interp.random_models import random_hf_model

SANDWICH = ("gemma2", "gemma3_text")
CAP = 2.0


def normed_models(family: str):
    """(our model, the Hugging Face model it was read from): norm weights ~ N(0, 0.5^2), the final
    logits capped at ``CAP``."""
    hf, tokenizer = random_hf_model(family, seed=4, initializer_range=0.2, final_logit_softcapping=CAP)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "norm" in name:
                param.copy_(0.5 * torch.randn(param.shape, generator=generator))
    return from_hf(hf, tokenizer), hf, tokenizer


@pytest.fixture(scope="module", params=SANDWICH)
def gemma(request):
    return normed_models(request.param)


def prompts(batch: int = 3, pos: int = 10, seed: int = 0) -> torch.Tensor:
    return torch.randint(4, 300, (batch, pos), generator=torch.Generator().manual_seed(seed))


def hf_scale(hf, layer: int, pre_norm: torch.Tensor) -> torch.Tensor:
    """The clean run's scale of layer ``layer``'s norm on its attention output, by hand from Hugging
    Face's own eps: sqrt(mean(x^2) + eps), (..., 1)."""
    eps = hf.model.layers[layer].post_attention_layernorm.eps
    return torch.sqrt(pre_norm.float().pow(2).mean(-1, keepdim=True) + eps)


def hf_weight(hf, layer: int) -> torch.Tensor:
    """Its weight as it multiplies: Gemma's 1 + weight, from Hugging Face's parameter."""
    return 1.0 + hf.model.layers[layer].post_attention_layernorm.weight.detach().float()


def contribution(model, hf, cache, layer: int, head: int, z: torch.Tensor) -> torch.Tensor:
    """Head (layer, head)'s contribution to the residual for z (batch, pos, d_head), by hand."""
    write = z @ model.blocks[layer].attn.W_O[head].detach()
    return hf_weight(hf, layer) * write / hf_scale(hf, layer, cache[f"blocks.{layer}.attn.hook_out"])


@torch.no_grad()
def test_the_fast_readout_caps_the_logits_as_the_model_does(gemma):
    """FinalReadout's logits of (clean + change) equal the model's own unembedding, soft cap included,
    to 1e-5; without the cap they would be off by far more."""
    model, _, _ = gemma
    _, cache = model.run_with_cache(prompts())
    final = cache[f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"]
    change = torch.randn(final.shape, generator=torch.Generator().manual_seed(2))
    readout = FinalReadout(model)
    moved = final + change
    fast = readout.logits(readout.linear(final), readout.normed(change), readout.readout, readout.scale(moved))
    expected = model.unembed(moved)
    torch.testing.assert_close(fast, expected, atol=1e-5, rtol=0)
    uncapped = model.ln_final(moved) @ model.embed.weight.T  # Gemma ties its unembedding to its embedding
    assert (uncapped - expected).abs().max() > 0.5  # the cap bends these logits: the comparison sees it


@torch.no_grad()
def test_direct_effects_hold_the_output_norm_at_the_clean_run_s_scale(gemma):
    """Direct effect of zero-ablating a head = the loss when the final residual moves by minus the
    head's contribution (weight * z W_O / the clean scale, by hand), through the model's own final
    norm, unembedding and cap; the total effect is the plain hook_z ablation."""
    model, hf, _ = gemma
    tokens = prompts()
    effects = direct_and_total_effects(model, tokens, None, "zero", progress=False)
    metric = loss_metric(tokens)
    _, cache = model.run_with_cache(tokens)
    final = cache[f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"]
    clean = metric(model.unembed(final)).item()
    for row in effects.itertuples():
        z = cache[f"blocks.{row.layer}.attn.hook_z"][:, :, row.head]
        naive = metric(model.unembed(final - contribution(model, hf, cache, row.layer, row.head, z))).item() - clean
        assert row.direct == pytest.approx(naive, abs=1e-5), (row.layer, row.head)
    assert effects["direct"].abs().min() > 1e-4  # every head moves the loss: the comparison is not of zeros


@torch.no_grad()
def test_dla_adds_up_to_the_logit_difference_before_the_cap(gemma):
    """The components' DLA (heads, biases, MLPs, embeddings, unembed bias) adds up, per prompt, to the
    logit difference before the final soft cap, by hand from the cache (final norm and unembedding,
    no cap); the frame says which logits it split."""
    model, _, _ = gemma
    tokens = prompts()
    answers, distractors = tokens[:, 1], tokens[:, 2]
    frame = direct_logit_attribution(model, tokens, answers, distractors)
    _, cache = model.run_with_cache(tokens)
    final = cache[f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"][:, -1]
    pre_cap = model.ln_final(final) @ model.embed.weight.T  # (batch, vocab), Gemma's tied unembedding
    rows = torch.arange(len(tokens))
    expected = pre_cap[rows, answers] - pre_cap[rows, distractors]
    summed = torch.tensor(frame.groupby("prompt")["dla"].sum().to_numpy())
    torch.testing.assert_close(summed, expected, atol=1e-4, rtol=0)
    capped = model(tokens)[:, -1]
    assert (capped[rows, answers] - capped[rows, distractors] - expected).abs().max() > 1e-2  # the cap bends it
    assert set(frame["logits"]) == {"before the soft cap"}
    effects = dla_effects(model, tokens, answers, distractors, n_boot=20)
    assert effects["dla"].sum() == pytest.approx(float(expected.mean()), abs=1e-4)
    assert set(effects["logits"]) == {"before the soft cap"}


@torch.no_grad()
def test_one_head_s_dla_is_its_frozen_norm_contribution_through_the_frozen_final_norm(gemma):
    """A head's DLA onto an answer's logit = its contribution (weight * z W_O / the clean scale, by
    hand with Hugging Face's eps and 1 + weight) through the final norm at the clean run's scale
    (Hugging Face's too) and the answer's unembedding column; its parts, summed with the bias's,
    give hook_attn_out."""
    model, hf, _ = gemma
    tokens = prompts()
    answers = tokens[:, 3]
    frame = direct_logit_attribution(model, tokens, answers)
    _, cache = model.run_with_cache(tokens)
    final = cache[f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"][:, -1]
    final_norm = hf.model.norm
    final_scale = torch.sqrt(final.pow(2).mean(-1, keepdim=True) + final_norm.eps)
    reader = (1.0 + final_norm.weight.detach()) * hf.lm_head.weight.detach()[answers] / final_scale  # (batch, d_model)
    layer, head = 1, 2
    z = cache[f"blocks.{layer}.attn.hook_z"][:, -1:, head]
    part = contribution(model, hf, {f"blocks.{layer}.attn.hook_out": cache[f"blocks.{layer}.attn.hook_out"][:, -1:]},
                        layer, head, z)[:, 0]
    ours = frame[(frame["layer"] == layer) & (frame["head"] == head)].sort_values("prompt")["dla"].to_numpy()
    torch.testing.assert_close(torch.tensor(ours), (part * reader).sum(-1), atol=1e-5, rtol=1e-5)
    decomposition = decompose_residual(model, tokens)
    parts = decomposition.components
    in_layer = ((parts["layer"] == layer).fillna(False) & parts["kind"].isin(["head", "attn_bias"])).to_numpy(bool)
    torch.testing.assert_close(decomposition.parts[torch.from_numpy(in_layer)].sum(0),
                               cache[f"blocks.{layer}.hook_attn_out"], atol=1e-5, rtol=0)


def test_direct_effects_of_heads_by_a_rerun_are_refused_in_one_line():
    """The bridge reruns the blocks with the head's z edited, which would recompute the norm on the
    attention output instead of holding it: refused in one line, by the hook self-test's refusal."""
    _, hf, tokenizer = normed_models("gemma2")
    with pytest.raises(UserError) as refusal:
        direct_and_total_effects(boot_bridge(hf, tokenizer), prompts(), [(0, 0)], "zero", progress=False)
    message = str(refusal.value)
    assert message.startswith("direct effects of heads reruns the blocks with a head's z edited, and on this gemma2 "
                              "model (transformer_lens) the norm on the attention output"), message
    assert "\n" not in message


def test_interp_check_exits_1_where_the_frozen_norm_check_fails(monkeypatch, capsys):
    """`interp check` counts the frozen-norm check in its exit code: 0 on a sound Gemma 2, 1 where the
    norm read is another (the MLP's input norm: the heads still add up before it)."""
    for model, code in ((normed_models("gemma2")[0], 0), (normed_models("gemma2")[0], 1)):
        if code:
            monkeypatch.setattr(hook_check, "output_norm", lambda model, layer: model.blocks[layer].ln2)
        monkeypatch.setattr(check_command, "load_cli_model", lambda args: model)
        assert check_command.run(argparse.Namespace(model="gemma2")) == code
        assert "hook_attn_out = weight * (heads + b_O) / scale" in capsys.readouterr().out


@torch.no_grad()
def test_a_sender_to_logits_edge_adds_the_frozen_scaled_difference(gemma):
    """Path patching one sender -> logits edge (denoising) = a rerun of the corrupted prompts whose final
    residual gains weight * (z_clean - z_corrupted) W_O / s, s the corrupted (base) run's scale, by a
    hand-written hook. This holds to float rounding whatever the two runs' scales: the edge's
    receiver reads nothing else. It equals patching the sender's z and letting the norm recompute only
    where the patched attention output keeps the base run's RMS (not here: the test asserts they differ)."""
    model, hf, _ = gemma
    clean, corrupted = prompts(seed=0), prompts(seed=1)
    metric = logit_diff_metric(clean[:, 1], clean[:, 2])
    layer, head = 0, 1
    frame = path_patch(model, clean, corrupted, metric, senders=[(layer, head)], via="logits", normalize=False,
                       progress=False)
    _, clean_cache = model.run_with_cache(clean)
    _, base = model.run_with_cache(corrupted)
    z = f"blocks.{layer}.attn.hook_z"
    difference = contribution(model, hf, base, layer, head, clean_cache[z][:, :, head] - base[z][:, :, head])
    final = f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"
    naive = metric(model.run_with_hooks(corrupted, fwd_hooks=[(final, lambda resid, hook: resid + difference)])).item()
    assert frame["value"].item() == pytest.approx(naive, abs=1e-5)
    recomputed = base[f"blocks.{layer}.hook_attn_out"] - hf.model.layers[layer].post_attention_layernorm(
        base[f"blocks.{layer}.attn.hook_out"] + (clean_cache[z] - base[z])[:, :, head] @ model.blocks[layer].attn.W_O[head])
    assert (recomputed + difference).abs().max() > 1e-3  # the frozen scale is a choice: the norm recomputed differs


def test_what_cannot_apply_the_norms_is_refused_in_one_line(gemma):
    """Composition scores (weights alone) and edge attribution (a head's write taken to be z @ W_O)
    are refused in one line; exact path patching, DLA and direct effects run (above)."""
    model, _, _ = gemma
    with pytest.raises(UserError) as composition:
        composition_scores(model, "k")
    with pytest.raises(UserError) as attribution:
        path_patch(model, prompts(seed=0), prompts(seed=1), loss_metric(prompts(seed=0)), method="eap")
    for refusal in (composition, attribution):
        assert "\n" not in str(refusal.value), str(refusal.value)
    assert str(composition.value).startswith("composition scores read W_Q, W_K, W_V and W_O alone")
    assert str(attribution.value).startswith("path patching needs each head's write to the residual to be its z @ W_O")


@torch.no_grad()
def test_a_sender_to_query_edge_moves_only_the_receiver_s_query(gemma):
    """Path patching one sender -> receiver query edge (denoising) = two hand-written reruns of the
    corrupted prompts: one whose residual entering the receiver's layer gains the frozen-scaled
    difference, read at hook_q; one with only the receiver's query replaced by it, the rest of the
    model (the receiver's own norm on its attention output included) as it runs."""
    model, hf, _ = gemma
    clean, corrupted = prompts(seed=0), prompts(seed=1)
    metric = logit_diff_metric(clean[:, 1], clean[:, 2])
    (sender, receiver) = (0, 1), (1, 3)
    frame = path_patch(model, clean, corrupted, metric, senders=[sender], receivers=[receiver], via="q",
                       normalize=False, progress=False)
    _, clean_cache = model.run_with_cache(clean)
    _, base = model.run_with_cache(corrupted)
    z = f"blocks.{sender[0]}.attn.hook_z"
    difference = contribution(model, hf, base, *sender, clean_cache[z][:, :, sender[1]] - base[z][:, :, sender[1]])
    captured = {}
    model.run_with_hooks(corrupted, fwd_hooks=[
        (f"blocks.{receiver[0]}.hook_resid_pre", lambda resid, hook: resid + difference),
        (f"blocks.{receiver[0]}.attn.hook_q", lambda q, hook: captured.setdefault("q", q.clone()))])

    def only_the_receiver(q, hook):
        q = q.clone()
        q[:, :, receiver[1]] = captured["q"][:, :, receiver[1]]
        return q

    naive = metric(model.run_with_hooks(corrupted, fwd_hooks=[(f"blocks.{receiver[0]}.attn.hook_q",
                                                                only_the_receiver)])).item()
    assert frame["value"].item() == pytest.approx(naive, abs=1e-5)
    assert abs(naive - metric(model(corrupted)).item()) > 1e-4  # the edge moves the metric
