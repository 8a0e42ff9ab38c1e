"""Composition scores (architecture §4.6) against TransformerLens's ``all_composition_scores`` on the same
weights, on hand-set weights whose answer is known, and on the embedded model's induction circuit."""

from __future__ import annotations

import copy

import pandas as pd
import pytest
import torch

from analyses.roles.classify import assign_roles, classify_heads
from analyses.circuits.composition import composition_figure, composition_scores, random_baseline, score_tensor
from interp import GPTConfig, GPTModel, from_hf, load_model
from interp.bridge import boot_bridge
from interp.errors import UserError

WEIGHTS = ("W_Q", "W_K", "W_V", "W_O", "b_Q", "b_K", "b_V", "b_O", "W_out")


@pytest.mark.parametrize("name", WEIGHTS)
def test_stacked_weights_equal_the_bridges(scratch_gpt2, bridge_gpt2, name):
    ours, theirs = getattr(scratch_gpt2, name), getattr(bridge_gpt2, name)
    assert ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def test_grouped_query_weights_keep_their_kv_heads_as_the_bridge_does(family_dir):
    directory = family_dir("llama")  # 4 query heads, 2 key/value heads
    ours, bridge = load_model(directory, impl="scratch"), load_model(directory, impl="transformer_lens")
    assert ours.W_K.shape == (2, 2, 64, 16) and ours.W_Q.shape == (2, 4, 64, 16)
    for name in ("W_Q", "W_K", "W_V", "W_O", "W_out"):
        torch.testing.assert_close(getattr(ours, name), getattr(bridge, name), rtol=0, atol=0)
    assert not ours.b_Q.any()  # bias-free: zeros here, where the bridge raises


@pytest.mark.parametrize("kind", ["q", "k", "v"])
def test_scores_equal_transformer_lens_on_gpt2(scratch_gpt2, bridge_gpt2, kind):
    reference = bridge_gpt2.all_composition_scores(kind.upper()).scores
    assert reference.abs().max() > 0.05  # not an all-zero comparison
    torch.testing.assert_close(score_tensor(bridge_gpt2, kind), reference, rtol=0, atol=1e-4)
    torch.testing.assert_close(score_tensor(scratch_gpt2, kind), reference, rtol=0, atol=1e-4)


def test_compatibility_mode_scores_its_processed_weights(hf_gpt2, scratch_gpt2):
    """With LayerNorm folded into W_Q/W_K/W_V and the writing weights centred (TransformerLens's
    compatibility mode), TL scores the processed weights; so do we, and they differ from the raw
    weights' scores (LayerNorm weights made non-trivial first, so the fold matters)."""
    hf_model, tokenizer = copy.deepcopy(hf_gpt2[0]), hf_gpt2[1]
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for block in hf_model.transformer.h:
            block.ln_1.weight.copy_(1 + 0.5 * torch.randn(block.ln_1.weight.shape, generator=generator))
    raw = score_tensor(from_hf(copy.deepcopy(hf_model), tokenizer), "k")
    bridge = boot_bridge(hf_model, tokenizer)
    bridge.enable_compatibility_mode()
    reference = bridge.all_composition_scores("K").scores.detach()
    torch.testing.assert_close(score_tensor(bridge, "k"), reference, rtol=0, atol=1e-4)
    assert (raw - reference).abs().max() > 1e-3


@pytest.mark.parametrize("kind", ["q", "k", "v"])
def test_scores_equal_transformer_lens_with_grouped_query_heads(family_dir, kind):
    directory = family_dir("llama")
    bridge = load_model(directory, impl="transformer_lens")
    reference = bridge.all_composition_scores(kind.upper()).scores
    for model in (bridge, load_model(directory, impl="scratch")):
        torch.testing.assert_close(score_tensor(model, kind), reference, rtol=0, atol=1e-4)


def test_frame_rows_are_the_tensors_entries(bridge_gpt2):
    frame = composition_scores(bridge_gpt2, ("k", "v"), baseline_samples=8)
    n_layers, n_heads = bridge_gpt2.cfg.n_layers, bridge_gpt2.cfg.n_heads
    assert len(frame) == 2 * n_heads * n_heads * n_layers * (n_layers - 1) // 2
    assert (frame["sender_layer"] < frame["receiver_layer"]).all()
    reference = bridge_gpt2.all_composition_scores("V").scores.detach()
    for row in frame[frame["kind"] == "v"].itertuples():
        expected = reference[row.sender_layer, row.sender_head, row.receiver_layer, row.receiver_head]
        assert row.score == pytest.approx(float(expected), abs=1e-4)


def test_chosen_heads_are_the_full_frames_rows(bridge_gpt2):
    full = composition_scores(bridge_gpt2, ("q", "v"), baseline_samples=8)
    senders, receivers = [(0, 1), (0, 3)], [(1, 0), (1, 2), (0, 2)]
    chosen = composition_scores(bridge_gpt2, ("q", "v"), senders=senders, receivers=receivers, baseline_samples=8)
    pairs = lambda f, side: pd.Series(list(zip(f[f"{side}_layer"], f[f"{side}_head"])), index=f.index)  # noqa: E731
    expected = full[pairs(full, "sender").isin(senders) & pairs(full, "receiver").isin(receivers)]
    assert len(chosen) == 2 * 2 * 2  # (0, 2) is no later than any sender
    pd.testing.assert_frame_equal(chosen, expected.reset_index(drop=True))
    with pytest.raises(UserError, match=r"head L2H0 out of range"):
        composition_scores(bridge_gpt2, "k", senders=[(2, 0)])


def _hand_built() -> GPTModel:
    """Two layers of two heads (d_model 8, d_head 4). Head 0.0's OV is u w^T (it reads u, writes w).
    Head 1.0 reads w through its key (W_K = w e1^T) and its query and value read directions
    orthogonal to w; head 1.1 reads only orthogonal directions."""
    model = GPTModel(GPTConfig(d_vocab=16, n_ctx=8, d_model=8, n_heads=2, n_layers=2, attn_only=True))
    eye = torch.eye(8)
    u, w, x, y = eye[0], eye[1], eye[2], eye[3]
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.zero_()
        sender, receiver = model.blocks[0].attn, model.blocks[1].attn
        sender.W_value.weight[0] = u  # W_V[0, 0] = u e1^T (rows of the weight are head dims)
        sender.out_proj.weight[:, 0] = w  # W_O[0, 0] = e1 w^T
        receiver.W_key.weight[0] = w  # W_K[1, 0] = w e1^T
        receiver.W_query.weight[0] = x
        receiver.W_value.weight[0] = y
        receiver.out_proj.weight[:, 0] = x
        receiver.W_key.weight[4] = y  # head 1.1 (head dims 4..7): key y, query and value x, writes y
        receiver.W_query.weight[4] = x
        receiver.W_value.weight[4] = x
        receiver.out_proj.weight[:, 4] = y
        sender.W_value.weight[4] = eye[5]  # head 0.1: reads e5, writes e6, orthogonal to all above
        sender.out_proj.weight[:, 4] = eye[6]
    return model


def test_hand_built_key_composition_is_one_and_orthogonal_is_zero():
    frame = composition_scores(_hand_built(), ("q", "k", "v"), baseline_samples=8)
    score = {(r.kind, r.sender_head, r.receiver_head): r.score for r in frame.itertuples()}
    assert score["k", 0, 0] == pytest.approx(1.0, abs=1e-6)
    for other in [("q", 0, 0), ("v", 0, 0), ("k", 0, 1), ("q", 0, 1), ("v", 0, 1), ("k", 1, 0), ("k", 1, 1)]:
        assert score[other] == pytest.approx(0.0, abs=1e-6), other


def test_baseline_equals_naive_gaussian_products():
    """The QR-reduced baseline against the formula on full d_model x d_model products of fresh
    Gaussian draws: equal means within a few standard errors."""
    d_model, d_head, samples = 24, 3, 400
    generator = torch.Generator().manual_seed(123)
    draw = lambda *shape: torch.randn(samples, *shape, generator=generator, dtype=torch.float64)  # noqa: E731
    ov = draw(d_model, d_head) @ draw(d_head, d_model)
    qk = draw(d_model, d_head) @ draw(d_model, d_head).transpose(-1, -2)
    norm = torch.linalg.matrix_norm
    naive = norm(ov @ qk) / norm(ov) / norm(qk)
    ours = random_baseline(d_model, d_head, samples, seed=0)
    assert abs(ours - naive.mean().item()) < 4 * naive.std().item() / samples ** 0.5
    assert 0.05 < ours < 0.5 and ours == random_baseline(d_model, d_head, samples, seed=0)


@pytest.mark.parametrize("bad", ["x", "K", ("q", "o")])
def test_unknown_kind_is_a_user_error(scratch_gpt2, bad):
    with pytest.raises(UserError, match="composition kind .* is not one of q, k, v"):
        composition_scores(scratch_gpt2, bad)


@pytest.fixture(scope="module")
def toy():
    model = load_model("toy")
    roles = assign_roles(classify_heads(model, n_prompts=24, seed=0, n_boot=50))
    heads_with = lambda role: [(r.layer, r.head) for r in roles.itertuples() if role in r.role.split(";")]  # noqa: E731
    return model, heads_with("previous_token"), heads_with("induction")


def test_toy_previous_token_to_induction_is_the_strongest_key_composition(toy):
    """Measured on the embedded model: 0.3 -> each layer-1 induction head scores 0.16-0.27 through
    the key (baseline ~0.09); 0.2 -> 1.6 (0.21) is the one other K edge above 0.2, so 0.3 is the
    strongest key sender of 7 of the 8 induction heads, not all."""
    model, previous, induction = toy
    assert previous == [(0, 3)] and len(induction) >= 4
    frame = composition_scores(model, ("q", "k", "v"))
    keys = frame[frame["kind"] == "k"]
    top = keys.nlargest(len(induction) // 2, "score")
    assert set(zip(top["sender_layer"], top["sender_head"])) == {(0, 3)}
    strongest = keys.loc[keys.groupby(["receiver_layer", "receiver_head"])["score"].idxmax()]
    from_previous = strongest[(strongest["sender_layer"] == 0) & (strongest["sender_head"] == 3)]
    assert len(from_previous) >= 0.75 * len(induction)

    receiver = pd.Series(list(zip(frame["receiver_layer"], frame["receiver_head"])), index=frame.index)
    pairs = frame[(frame["sender_layer"] == 0) & (frame["sender_head"] == 3) & receiver.isin(induction)]
    mean = pairs.groupby("kind")["score_minus_baseline"].mean()
    assert mean["k"] > 0.1 and mean["k"] > 2 * max(mean["q"], mean["v"])


def test_figure_has_a_panel_per_kind(scratch_gpt2):
    frame = composition_scores(scratch_gpt2, ("q", "k"), baseline_samples=4)
    figure = composition_figure(frame)
    titles = [ax.get_title() for ax in figure.axes if ax.get_title()]
    assert titles == ["Q-composition", "K-composition"]
