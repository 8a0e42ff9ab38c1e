"""Intervals over clusters of near-copy prompts, and of the paired difference of two conditions on
the same prompts: checked against a hand-written numpy bootstrap that makes the same draws."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from analyses.core.stats import bootstrap_cluster_ratio, bootstrap_ratio, paired_difference
from interp import UserError


def drawn_rows(n_units: int, n_boot: int = 1000, seed: int = 0) -> np.ndarray:
    """(n_boot, n_units) the unit indices each resample draws: the seeded generator's draws."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(n_units, (n_boot, n_units), generator=generator).numpy()


def numpy_cluster_bootstrap(sums, counts, clusters, seed=0):
    """The pooled ratio, and its 95% percentile interval, drawing clusters (numbered by first
    appearance) with replacement and pooling all their prompts: a loop over resamples."""
    sums, counts = np.asarray(sums, float), np.asarray(counts, float)
    order = list(dict.fromkeys(clusters))
    members = [[i for i, c in enumerate(clusters) if c == label] for label in order]
    ratios = []
    for row in drawn_rows(len(order), seed=seed):
        prompts = [i for cluster in row for i in members[cluster]]
        ratios.append(sums[prompts].sum() / counts[prompts].sum())
    return sums.sum() / counts.sum(), np.quantile(ratios, 0.025), np.quantile(ratios, 0.975)


def test_the_cluster_bootstrap_draws_whole_clusters():
    sums = torch.tensor([1.0, 1.2, 0.9, -0.5, -0.4, 2.0, 0.1, 0.3, 0.2])
    counts = torch.tensor([1.0, 2.0, 1.0, 1.0, 1.0, 3.0, 1.0, 1.0, 2.0])
    clusters = ["a", "a", "a", "b", "b", "c", "d", "d", "e"]
    estimate, low, high = bootstrap_cluster_ratio(sums, counts, clusters, seed=3)
    expected = numpy_cluster_bootstrap(sums.numpy(), counts.numpy(), clusters, seed=3)
    assert (float(estimate), float(low), float(high)) == pytest.approx(expected, abs=1e-12)
    # three copies of one prompt are one draw, not three: the prompt bootstrap's interval is narrower
    copies = torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0, -1.0, 0.5, 0.5, 0.5, 0.0, 0.0, 0.0])
    ones, labels = torch.ones(12), [i // 3 for i in range(12)]
    _, c_low, c_high = bootstrap_cluster_ratio(copies, ones, labels)
    _, p_low, p_high = bootstrap_ratio(copies, ones)
    assert float(c_high - c_low) > 1.3 * float(p_high - p_low)


def test_with_one_prompt_per_cluster_it_is_the_prompt_bootstrap_draw_for_draw():
    sums = torch.randn(7, 3, generator=torch.Generator().manual_seed(1))
    counts = torch.tensor([1.0, 2.0, 1.0, 3.0, 1.0, 1.0, 2.0])
    for found, expected in zip(bootstrap_cluster_ratio(sums, counts, ["x", "y", 3, 4, 5, 6, 7], seed=5),
                               bootstrap_ratio(sums, counts, seed=5)):
        assert torch.equal(found, expected)
    with pytest.raises(UserError, match="2 cluster labels for 7 prompts"):
        bootstrap_cluster_ratio(sums, counts, [0, 1])


def test_the_paired_difference_resamples_both_conditions_with_the_same_draws():
    """Two conditions whose per-prompt values share a large prompt-to-prompt spread: their marginal
    intervals overlap, the difference's interval (by hand: the same draws for both) excludes 0."""
    base = torch.tensor([3.0, -2.0, 5.0, 0.5, -4.0, 1.0, 2.5, -1.5], dtype=torch.float64)
    shift = torch.tensor([0.0, 0.1, -0.05, 0.02, 0.0, 0.05, -0.02, 0.01], dtype=torch.float64)
    a, b, ones = base + 0.2, base + shift, torch.ones(8)
    difference, low, high = paired_difference(a, ones, b, ones, seed=2)
    rows = drawn_rows(8, seed=2)
    by_hand = (a.numpy()[rows].mean(1) - b.numpy()[rows].mean(1))
    assert float(difference) == pytest.approx(float(a.mean() - b.mean()), abs=1e-12)
    assert (float(low), float(high)) == pytest.approx((np.quantile(by_hand, 0.025), np.quantile(by_hand, 0.975)),
                                                      abs=1e-12)
    assert low > 0
    _, a_low, a_high = bootstrap_ratio(a, ones, seed=2)
    _, b_low, b_high = bootstrap_ratio(b, ones, seed=2)
    assert a_low < b_high and b_low < a_high  # the marginal intervals overlap
    # with clusters, whole clusters are drawn for both conditions alike
    clusters = [0, 0, 1, 1, 2, 2, 3, 3]
    _, c_low, c_high = paired_difference(a, ones, b, ones, clusters=clusters, seed=2)
    diff_by_hand = numpy_cluster_bootstrap((a - b).numpy(), ones.numpy(), clusters, seed=2)
    assert (float(c_low), float(c_high)) == pytest.approx(diff_by_hand[1:], abs=1e-12)
    with pytest.raises(UserError, match="need the same prompts"):
        paired_difference(a, ones, b[:4], ones[:4])
