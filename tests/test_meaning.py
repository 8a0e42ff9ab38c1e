"""Copying and copy suppression from the OV circuit, QK positional scores, their calibrated roles, and
the attended-token effect: against the naive vocab x vocab matrix, a planted copying head, naive loops
and the two implementations."""

from __future__ import annotations

import pytest
import torch

from analyses.components.decompose import direct_logit_attribution
from analyses.components.meaning import attended_token_effect, meaning_roles, ov_scores, qk_positional_scores
from analyses.roles.copying import copying_from_eigenvalues, meaning_nulls, ov_eigenvalues
from analyses.roles.nulls import joint_fdr
from interp import GPTConfig, GPTModel, UserError, from_hf
from interp.bridge import boot_bridge
from interp.random_models import gpt2_initialise, random_hf_model
from interp.weights import expand_kv_heads

COPIER, SUPPRESSOR = (1, 2), (0, 1)


def _naive_copying(model) -> torch.Tensor:
    """sum(Re eig) / sum(|eig|) of the full (vocab x vocab) W_E W_V W_O W_U of every head."""
    W_V = expand_kv_heads(model.W_V.detach(), model.cfg.n_heads).double()
    W_E, W_O, W_U = model.W_E.detach().double(), model.W_O.detach().double(), model.W_U.detach().double()
    scores = torch.zeros(W_O.shape[:2])
    for layer in range(W_O.shape[0]):
        for head in range(W_O.shape[1]):
            eig = torch.linalg.eigvals(W_E @ W_V[layer, head] @ W_O[layer, head] @ W_U)
            scores[layer, head] = float(eig.real.sum() / eig.abs().sum())
    return scores


def test_reduced_eigenvalues_equal_the_full_matrix(scratch_gpt2, bridge_gpt2):
    ours = copying_from_eigenvalues(ov_eigenvalues(scratch_gpt2)).float()
    assert ours.shape == (2, 4)
    assert torch.allclose(ours, _naive_copying(scratch_gpt2), atol=1e-4)
    assert torch.allclose(copying_from_eigenvalues(ov_eigenvalues(bridge_gpt2)).float(), ours, atol=1e-5)
    positional = [qk_positional_scores(model).drop(columns=["layer", "head"]).to_numpy() for model in
                  (scratch_gpt2, bridge_gpt2)]
    assert torch.allclose(torch.tensor(positional[0]), torch.tensor(positional[1]), atol=1e-5)


def test_grouped_query_heads_on_both_implementations():
    hf_model, tokenizer = random_hf_model("llama", seed=4)
    scratch, bridge = from_hf(hf_model, tokenizer), boot_bridge(hf_model, tokenizer)
    ours = ov_scores(scratch, n_tokens=64)
    theirs = ov_scores(bridge, n_tokens=64)
    assert torch.allclose(torch.tensor(ours["copying"].to_numpy()),
                          _naive_copying(scratch).flatten(), atol=1e-4)
    assert ours.drop(columns="copying").round(6).equals(theirs.drop(columns="copying").round(6))


def _planted_model() -> GPTModel:
    """A small random GPT-2 with head COPIER's OV set to a projection (W_V = U, W_O = U^T: the full OV
    circuit (W_E U)(W_E U)^T is positive semi-definite) and head SUPPRESSOR's to its negative."""
    torch.manual_seed(0)
    model = gpt2_initialise(GPTModel(GPTConfig(d_vocab=64, n_ctx=16, d_model=32, n_heads=4, n_layers=2))).eval()
    d_head = model.cfg.d_head
    U = torch.linalg.qr(torch.randn(32, d_head, generator=torch.Generator().manual_seed(1)))[0]
    with torch.no_grad():
        for (layer, head), sign in ((COPIER, 1.0), (SUPPRESSOR, -1.0)):
            attn = model.blocks[layer].attn
            rows = slice(head * d_head, (head + 1) * d_head)
            attn.W_value.weight[rows] = U.T  # W_V[h] = weight[rows].T = U
            attn.out_proj.weight[:, rows] = sign * U  # W_O[h] = weight[:, rows].T = sign U^T
    assert torch.allclose(model.W_V[COPIER], U) and torch.allclose(model.W_O[SUPPRESSOR], -U.T)
    return model


def test_a_planted_copying_head_gets_the_role_and_a_random_head_does_not():
    model = _planted_model()
    table = meaning_roles(model, null_seeds=(1001, 1002, 1003, 1004), progress=False).set_index(["layer", "head"])
    assert table.loc[COPIER, "copying"] > 0.99 and table.loc[SUPPRESSOR, "copy_suppression"] > 0.99
    assert table.loc[COPIER, "meaning_role"] == "copying"
    assert table.loc[SUPPRESSOR, "meaning_role"] == "copy_suppression"
    others = table.drop(index=[COPIER, SUPPRESSOR])
    assert (others["meaning_role"] == "").all()
    assert (others["copying"].abs() < 0.9).all()
    # the planted heads' own logits top (bottom) their rows far more often than chance (k / vocab)
    assert table.loc[COPIER, "copying_topk"] > 0.5 and table.loc[SUPPRESSOR, "suppression_topk"] > 0.5
    assert others["copying_topk"].max() < table.loc[COPIER, "copying_topk"]


def test_joint_fdr_and_bad_input():
    model = _planted_model()
    nulls = meaning_nulls(model, (1001, 1002))
    joined = joint_fdr(nulls, nulls.assign(role=nulls["role"] + "_again"))
    assert len(joined) == 2 * len(nulls) and (joined["q"] >= joined["p"]).all()
    with pytest.raises(UserError, match="null_seeds"):
        meaning_nulls(model, (1001,))
    with pytest.raises(UserError, match="k=0"):
        ov_scores(model, k=0)
    with pytest.raises(UserError, match="W_pos"):
        qk_positional_scores(from_hf(*random_hf_model("llama", seed=4)))


def test_qk_positional_scores_equal_a_naive_loop():
    model = _planted_model()
    table = qk_positional_scores(model).set_index(["layer", "head"])
    W_pos = model.pos_embed.weight.detach()
    for layer, head in [(0, 0), (1, 3)]:
        W_Q, W_K = model.W_Q[layer, head].detach(), model.W_K[layer, head].detach()
        previous, self_, first = [], [], []
        for q in range(1, 16):
            scores = torch.stack([W_pos[q] @ W_Q @ (W_pos[k] @ W_K) for k in range(q + 1)]) / W_Q.shape[1] ** 0.5
            weights = scores.softmax(0)
            previous.append(weights[q - 1]), self_.append(weights[q]), first.append(weights[0])
        for column, values in (("qk_previous", previous), ("qk_self", self_), ("qk_first", first)):
            assert table.loc[(layer, head), column] == pytest.approx(float(torch.stack(values).mean()), abs=1e-5)


def test_attended_token_effect_equals_dla_on_the_attended_tokens():
    model = _planted_model()
    tokens = torch.randint(0, 64, (3, 12), generator=torch.Generator().manual_seed(2))
    effects = attended_token_effect(model, tokens).set_index(["layer", "head"])
    _, cache = model.run_with_cache(tokens)
    for layer, head in (COPIER, SUPPRESSOR, (0, 0)):
        attended = cache[f"blocks.{layer}.attn.hook_pattern"][:, head, 1:].argmax(-1)  # (batch, q)
        answers = tokens.gather(1, attended)
        dla = direct_logit_attribution(model, tokens, answers, positions=list(range(1, 12)))
        expected = dla[dla["component"] == f"L{layer}H{head}"]["dla"].mean()
        assert effects.loc[(layer, head), "attended_effect"] == pytest.approx(expected, abs=1e-5)


def naive_benjamini_hochberg(p: list[float]) -> list[float]:
    """Benjamini-Hochberg by its definition: q_i = min(1, min over p_j >= p_i of p_j m / rank_j)."""
    m, order = len(p), sorted(range(len(p)), key=lambda i: p[i])
    rank = {index: r + 1 for r, index in enumerate(order)}
    return [min(1.0, min(p[j] * m / rank[j] for j in range(m) if p[j] >= p[i])) for i in range(m)]


def test_copying_roles_are_in_one_fdr_family_with_the_attention_roles():
    """The planted copying (suppressing) head is named in the head table, beside the attention roles,
    with q < 0.05 from ONE Benjamini-Hochberg over every (head, role) test; no other head gets a
    meaning role."""
    from analyses.core.probes import repeated_probes
    from analyses.roles.classify import ALL_ROLES, classify_heads, head_table
    from analyses.roles.nulls import calibrate_roles

    model = _planted_model()
    probes = repeated_probes(8, 16, range(1, 64), 0, seed=3)
    seeds = tuple(range(1001, 1007))  # enough null models for both planted heads to pass a family of 56 tests
    joint = joint_fdr(calibrate_roles(model, probes, null_seeds=seeds, progress=False),
                      meaning_nulls(model, seeds), fdr=0.05)
    assert sorted(joint["role"].unique()) == sorted(ALL_ROLES) and len(joint) == 8 * len(ALL_ROLES)
    assert joint["q"].tolist() == pytest.approx(naive_benjamini_hochberg(joint["p"].tolist()), abs=1e-12, rel=1e-9)
    alone = meaning_roles(model, null_seeds=seeds, progress=False).set_index(["layer", "head"])
    in_joint = joint[joint["role"] == "copying"].set_index(["layer", "head"])["q"]
    assert not in_joint.equals(alone["copying_q"])  # a larger family: not the meaning roles' own q
    table = head_table(classify_heads(model, probes=probes, progress=False), calibration=joint,
                       thresholds=0.4).set_index(["layer", "head"])
    assert {"induction_q", "previous_token_q", "copying", "copying_q", "copy_suppression_q"} <= set(table.columns)
    assert "copying" in table.loc[COPIER, "role"].split(";") and table.loc[COPIER, "copying_q"] < 0.05
    assert "copy_suppression" in table.loc[SUPPRESSOR, "role"].split(";")
    assert table.loc[SUPPRESSOR, "copy_suppression_q"] < 0.05
    assert table.loc[COPIER, "copying"] == pytest.approx(alone.loc[COPIER, "copying"], abs=1e-6)
    others = table.drop(index=[COPIER, SUPPRESSOR])
    assert not others["role"].str.contains("cop").any()
    with pytest.raises(UserError, match="more than one calibration table"):
        joint_fdr(joint, meaning_nulls(model, seeds))


def test_top_k_shares_in_small_chunks_equal_the_full_rows():
    """ov_top_k through the d_head-wide factors, a few heads and tokens at a time (a budget of a few
    kB), against each head's full rows W_E[t] W_V W_O W_U made at once in float64: the shares agree
    to one sampled token (a float tie at the k-th entry may round either way), on a grouped-query
    model, and the ov_eigenvalues of the chunked vocabulary sum equal the naive full matrix."""
    from analyses.components.meaning import ov_top_k

    torch.manual_seed(1)
    model = GPTModel(GPTConfig(d_vocab=300, n_ctx=16, d_model=32, n_heads=4, n_key_value_heads=2, n_layers=2,
                               normalization_type="RMS", positional_embedding_type="rotary",
                               tie_word_embeddings=False)).eval()
    n_tokens, k = 120, 5
    top, bottom = ov_top_k(model, k, n_tokens=n_tokens, seed=3, memory_mb=0.02)
    tokens = torch.randperm(300, generator=torch.Generator().manual_seed(3))[:n_tokens].sort().values
    W_V = expand_kv_heads(model.W_V.detach(), 4).double()
    W_E, W_O, W_U = model.W_E.detach().double(), model.W_O.detach().double(), model.W_U.detach().double()
    for layer in range(2):
        for head in range(4):
            rows = W_E[tokens] @ W_V[layer, head] @ W_O[layer, head] @ W_U
            own = rows.gather(1, tokens[:, None])
            assert abs(top[layer, head] - ((rows > own).sum(1) < k).float().mean()) <= 1 / n_tokens
            assert abs(bottom[layer, head] - ((rows < own).sum(1) < k).float().mean()) <= 1 / n_tokens
    assert top.std() > 0  # heads differ: a mix-up of heads would show
    chunked = copying_from_eigenvalues(ov_eigenvalues(model, memory_mb=0.01)).float()
    assert torch.allclose(chunked, _naive_copying(model), atol=1e-4)


@pytest.mark.parametrize("span", [7, 64])
def test_top_k_shares_settled_early_equal_the_full_count(monkeypatch, span):
    """ov_top_k compares ``SPAN_COLUMNS`` columns at a time and stops counting a token once both its
    counts reach k: on the planted model (a copier whose own entries are at the top of most rows, so
    those rows are read to the end, and a suppressor at the bottom), with a span that cuts the
    64-token vocabulary into several pieces, every share equals the naive full count."""
    from analyses.components import meaning

    model = _planted_model()
    monkeypatch.setattr(meaning, "SPAN_COLUMNS", span)
    k = 3
    top, bottom = meaning.ov_top_k(model, k, n_tokens=64)
    W_V, W_O = model.W_V.detach().double(), model.W_O.detach().double()
    W_E, W_U = model.W_E.detach().double(), model.W_U.detach().double()
    for layer in range(2):
        for head in range(4):
            rows = W_E @ W_V[layer, head] @ W_O[layer, head] @ W_U
            own = rows.diagonal()[:, None]
            assert top[layer, head].item() == pytest.approx(((rows > own).sum(1) < k).double().mean().item(), abs=1e-6)
            assert bottom[layer, head].item() == pytest.approx(((rows < own).sum(1) < k).double().mean().item(), abs=1e-6)
    assert top[COPIER] > 0.9 and bottom[SUPPRESSOR] > 0.9 and top.median() < 0.5
