"""Attention as explanation (``analyses.components.explanation``): every attribution against autograd
or an explicit loop done by hand, the attention read against the cache, the interventions against
hand-written hooks, on right-padded prompts of different lengths."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch

from analyses.cli import main
from analyses.components.explanation import (decisive_attention, explain, explanation_figure, gradient_x_input,
                                             integrated_gradients, occlusion, rank_agreement)
from analyses.components.rollout import model_flow, model_rollout
from interp import from_hf
from interp.errors import UserError
from interp.random_models import random_hf_model

LAST = torch.tensor([9, 6, 8])  # each prompt's last real position: prompts 1 and 2 are padded
ANSWERS, DISTRACTORS = torch.tensor([5, 6, 7]), torch.tensor([8, 9, 10])
HEADS = [(1, 0), (1, 3)]


def score(logits):
    """Per prompt: the answer's logit minus the distractor's at its last real position."""
    rows = torch.arange(len(LAST))
    at = logits[rows, LAST]
    return at[rows, ANSWERS] - at[rows, DISTRACTORS]


@pytest.fixture(scope="module")
def model():
    """A tiny GPT-2 with weights ten times the usual initialisation, so that tokens matter unequally."""
    return from_hf(*random_hf_model("gpt2", seed=2, initializer_range=0.2))


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(3, 257, (3, 10), generator=torch.Generator().manual_seed(0))


def scores_with_embed(model, tokens, edit):
    """Scores with ``edit(embed)`` replacing the token embeddings, by one hooked forward."""
    return score(model.run_with_hooks(tokens, fwd_hooks=[("hook_embed", lambda embed, hook: edit(embed))]))


def test_gradient_x_input_equals_autograd_by_hand(model, tokens):
    kept = {}

    def leaf(embed):
        kept["embed"] = embed.detach().requires_grad_(True)
        return kept["embed"]

    found = gradient_x_input(model, tokens, score)
    for b in range(3):  # one prompt's own score at a time
        kept.clear()
        (grad,) = torch.autograd.grad(scores_with_embed(model, tokens, leaf)[b], kept["embed"])
        torch.testing.assert_close(found[b], (grad[b] * kept["embed"][b]).sum(-1), atol=1e-5, rtol=0)
    assert found.abs().max() > 0.01


def test_integrated_gradients_equal_a_loop_over_alphas_and_are_complete(model, tokens):
    steps, total = 8, 0
    for i in range(steps):
        alpha, kept = (i + 0.5) / steps, {}

        def scaled(embed):
            kept["embed"] = embed.detach()
            kept["input"] = (alpha * embed.detach()).requires_grad_(True)
            return kept["input"]

        (grad,) = torch.autograd.grad(scores_with_embed(model, tokens, scaled).sum(), kept["input"])
        total = total + grad
    expected = (total / steps * kept["embed"]).sum(-1)
    found = integrated_gradients(model, tokens, score, steps, memory_mb=1)  # one alpha per forward
    torch.testing.assert_close(found, expected, atol=1e-5, rtol=0)
    # completeness: the attributions add up to score(embeddings) - score(zero embeddings)
    with torch.no_grad():
        gap = score(model(tokens)) - scores_with_embed(model, tokens, torch.zeros_like)
    fine = integrated_gradients(model, tokens, score, 32)
    torch.testing.assert_close(fine.sum(-1), gap, atol=0.02 * float(gap.abs().max()), rtol=0)
    assert gap.abs().max() > 0.1


@torch.no_grad()
def test_occlusion_equals_a_loop_of_erased_positions(model, tokens):
    clean = score(model(tokens))
    expected = torch.zeros(3, 10)
    for position in range(10):
        def erase(embed, position=position):
            embed[:, position] = 0
            return embed
        expected[:, position] = clean - scores_with_embed(model, tokens, erase)
    torch.testing.assert_close(occlusion(model, tokens, score, memory_mb=1), expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(occlusion(model, tokens, score), expected, atol=1e-5, rtol=0)
    assert expected[1, 7:].abs().max() < 1e-6  # padding after prompt 1's end changes nothing
    assert expected[0].abs().max() > 0.05


def test_rank_agreement_is_spearmans_rho_by_hand():
    left = torch.tensor([[9.0, 1.0, 4.0, 2.0, 8.0, 3.0]])
    right = torch.tensor([[0.0, 2.0, 3.0, 1.0, 9.0, 4.0]])
    ranks = lambda x: x.argsort().argsort().float()  # noqa: E731 (no ties here)
    a, b = ranks(left[0, 1:5]), ranks(right[0, 1:5])
    rho = float(((a - a.mean()) * (b - b.mean())).sum() / ((a - a.mean()).norm() * (b - b.mean()).norm()))
    assert rank_agreement(left, right, torch.tensor([4])) == pytest.approx([rho])
    assert math.isnan(rank_agreement(left, torch.ones(1, 6), torch.tensor([5]))[0])  # a constant side: no ranking


def test_explain_reads_the_heads_attention_and_rollout_of_each_prompt(model, tokens):
    found = explain(model, tokens, score, HEADS, LAST, steps=4)
    _, cache = model.run_with_cache(tokens, names_filter=lambda n: n.endswith("hook_pattern"))
    scores = found.scores.set_index(["prompt", "method", "position"]).sort_index()["value"]
    for b, at in enumerate(LAST.tolist()):
        expected = cache["blocks.1.attn.hook_pattern"][b, [0, 3], at, : at + 1].mean(0)
        torch.testing.assert_close(torch.tensor(scores.loc[(b, "attention")].to_numpy(), dtype=torch.float32), expected,
                                   atol=1e-6, rtol=0)
        rollout = model_rollout(model, tokens[b, : at + 1])[-1, at]
        torch.testing.assert_close(torch.tensor(scores.loc[(b, "rollout")].to_numpy(), dtype=torch.float32), rollout,
                                   atol=1e-6, rtol=0)
        flow = model_flow(model, tokens[b, : at + 1])[-1, at]
        torch.testing.assert_close(torch.tensor(scores.loc[(b, "flow")].to_numpy(), dtype=torch.float32), flow,
                                   atol=1e-6, rtol=0)
    assert len(found.agreement) == 3 * 3 * 3 and found.agreement["spearman"].between(-1, 1).all()
    assert set(found.summary()["attribution"]) == {"gradient_x_input", "integrated_gradients", "occlusion"}
    assert explanation_figure(found, prompt=1).axes
    with pytest.raises(UserError, match="prompt 5"):
        explanation_figure(found, prompt=5)
    with pytest.raises(UserError, match=r"head L1H4 out of range"):
        explain(model, tokens, score, [(1, 4)], LAST)


@torch.no_grad()
def test_decisive_attention_equals_hand_written_pattern_edits(model, tokens):
    frame = decisive_attention(model, tokens, score, HEADS, LAST)
    assert len(frame) == 6
    clean = score(model(tokens))
    erased = occlusion(model, tokens, score)
    _, cache = model.run_with_cache(tokens, names_filter="blocks.1.attn.hook_pattern")
    for row in frame.itertuples():
        at, top = int(LAST[row.prompt]), row.top_position
        row_weights = cache["blocks.1.attn.hook_pattern"][row.prompt, row.head, at, : at + 1]
        assert top == int(row_weights[1:].argmax()) + 1 and row.top_weight == pytest.approx(float(row_weights[top]))

        def knock(pattern, hook, b=row.prompt, h=row.head, at=at, top=top):
            for prompt, last in enumerate(LAST.tolist()):  # every prompt's own top key, as the function does
                weights = cache["blocks.1.attn.hook_pattern"][prompt, h, last, : last + 1].clone()
                weights[int(weights[1:].argmax()) + 1] = 0
                pattern[prompt, h, last, : last + 1] = weights / weights.sum()
            return pattern

        knocked = score(model.run_with_hooks(tokens, fwd_hooks=[("blocks.1.attn.hook_pattern", knock)]))
        assert row.knockout == pytest.approx(float(knocked[row.prompt] - clean[row.prompt]), abs=1e-5)
        assert row.erased == pytest.approx(-float(erased[row.prompt, top]), abs=1e-5)
    assert frame["knockout"].abs().max() > 1e-3 and frame["permuted"].abs().max() > 1e-3


def test_interp_explain_writes_its_tables_and_figure(tmp_path, capsys):
    out = tmp_path / "explain"
    assert main(["explain", "ioi", "--n", "3", "--heads", "1.7,0.4", "--steps", "2", "--no-flow", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "attention of heads L1H7, L0H4" in printed and "integrated_gradients" in printed
    assert {path.name for path in out.iterdir()} == {"scores.csv", "agreement.csv", "decisive.csv", "explanation.png",
                                                     "meta.json"}
    decisive = pd.read_csv(out / "decisive.csv")
    assert len(decisive) == 6 and set(decisive["layer"]) == {0, 1}
    assert set(pd.read_csv(out / "scores.csv")["method"]) == {"attention", "rollout", "gradient_x_input",
                                                               "integrated_gradients", "occlusion"}
    assert main(["explain", "ioi", "--heads", "1:7", "--out", str(out)]) == 2
    assert "--heads '1:7': give heads (9.1 or L9H1) separated by commas" in capsys.readouterr().err
