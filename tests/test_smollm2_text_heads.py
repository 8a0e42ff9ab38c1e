"""examples/smollm2/text_heads.py: SmolLM2's heads on real text, chosen on one text and measured on another.

- the held-out text (sample_text_2.txt) is new prose with the features of the text that chooses the
  heads (several lines, parentheses, square brackets, quotes, repeated words), sharing no line with it;
- a run from the first edited layer (``losses_under``) gives the losses of a full forward with a
  hand-written hook (tests/hand_checks.zero_head);
- ``text_effect``'s effect and interval are the per-line sums bootstrapped by hand (numpy), its random
  mean the draws' mean and the ratio their quotient: lines, not positions, are the resampled units;
- on SmolLM2: L26H6, the bracket head chosen on sample_text.txt, is the top bracket head on the held-out
  text too, and zeroing the three chosen bracket heads costs the held-out closers more than 1 nat and
  more than each of 5 layer-matched random sets.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from analyses import matched_random_sets
from analyses.components.rollout import all_patterns
from hand_checks import bootstrap_by_hand, zero_head
from interp import load_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "smollm2"))
import text_heads  # noqa: E402


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2")


@pytest.fixture(scope="module")
def texts(smollm2):
    """(choosing, held-out): each its tokens (1, pos), their strings and the kinds' targets."""
    out = []
    for path in (text_heads.TEXT, text_heads.HELD_OUT):
        tokens, strings = text_heads.text_tokens(smollm2, path.read_text(encoding="utf-8"))
        out.append((tokens, strings, text_heads.targets(tokens, strings)))
    return out


def test_the_held_out_text_has_the_choosing_texts_features_and_none_of_its_lines(texts):
    (tokens, _, where), (held_tokens, held_strings, held) = texts
    assert 0.8 < held_tokens.shape[1] / tokens.shape[1] < 1.2
    assert int(text_heads.lines_of(held_strings)[-1]) + 1 >= 7
    assert len(held["bracket_close"][0]) >= 6 and len(held["quote_close"][0]) >= 4
    assert len(held["duplicate_token"][0]) >= 0.3 * held_tokens.shape[1]
    chosen_lines = set(text_heads.TEXT.read_text(encoding="utf-8").splitlines())
    assert not chosen_lines & set(text_heads.HELD_OUT.read_text(encoding="utf-8").splitlines())


def test_a_run_from_the_first_edited_layer_equals_a_full_forward_with_a_hand_written_hook(smollm2, texts):
    tokens = texts[1][0][:, :40]
    suffix = text_heads.losses_under(smollm2, tokens, [[], text_heads.zero_edit([(11, 2)])], layer=11)
    with torch.no_grad():
        clean = smollm2(tokens)
        zeroed = smollm2.run_with_hooks(tokens, fwd_hooks=[zero_head(11, 2)])
    for losses, logits in zip(suffix, (clean, zeroed)):
        logp = logits[0, :-1].double().log_softmax(-1)
        by_hand = -logp[torch.arange(39), tokens[0, 1:]]
        assert (losses - by_hand).abs().max() < 1e-4
    assert (suffix[1] - suffix[0]).abs().max() > 1e-3  # the edit reached the losses


def test_text_effect_bootstraps_lines_as_a_hand_written_bootstrap_does():
    generator = torch.Generator().manual_seed(0)
    losses = torch.rand(2 + 6, 30, generator=generator, dtype=torch.float64)  # unedited, tested, 6 random sets
    losses[1] += torch.linspace(0, 2, 30, dtype=torch.float64)
    lines = torch.tensor([0] * 8 + [1] * 5 + [2] * 9 + [3] * 8 + [4])  # (pos,): 31 positions, 30 queries
    positions = [1, 2, 5, 9, 10, 14, 15, 16, 20, 23, 25, 29]
    got = text_heads.text_effect(losses, positions, lines)
    at = np.array(positions)
    unit = lines.numpy()[at]
    tested = (losses[1] - losses[0]).numpy()[at]
    sums = np.array([tested[unit == u].sum() for u in np.unique(unit)])
    counts = np.array([(unit == u).sum() for u in np.unique(unit)], dtype=float)
    assert got.effect == pytest.approx(tested.mean())
    assert got.ci == pytest.approx(bootstrap_by_hand(sums, counts))
    random = (losses[2:] - losses[0]).numpy()[:, at].mean(axis=1)
    assert got.random == pytest.approx(random.mean())
    assert got.ratio == pytest.approx(tested.mean() / random.mean())
    assert got.z[0] == pytest.approx((tested.mean() - random.mean()) / random.std(ddof=1))
    assert got.z[1] < got.z[0] < got.z[2]
    assert (got.n_lines, got.n_positions, got.base) == (len(sums), len(positions), pytest.approx(losses[0, at].mean()))


def test_the_bracket_heads_chosen_on_one_text_carry_the_closers_of_another(smollm2, texts):
    (tokens, _, where), (held_tokens, _, held) = texts
    chosen = text_heads.top(text_heads.kind_scores(all_patterns(smollm2, tokens[0]), where["bracket_before"])[0], 3)
    assert chosen[0] == (26, 6)
    on_held = text_heads.kind_scores(all_patterns(smollm2, held_tokens[0]), held["bracket_before"])[0]
    assert text_heads.top(on_held, 1) == [(26, 6)]
    closers = held["bracket_before"][0] + held["quote_before"][0]
    sets = matched_random_sets(smollm2, chosen, n_draws=5)
    losses = text_heads.losses_under(smollm2, held_tokens, [[], *map(text_heads.zero_edit, [chosen, *sets])],
                                     min(l for l, _ in chosen))
    effects = (losses[1:, closers] - losses[0, closers]).mean(1)
    assert effects[0] > 1.0 and effects[0] > effects[1:].max()  # nats
