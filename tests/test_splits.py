"""Prompt splits (selection apart from measurement): disjoint, seeded, stratified, recorded; and why
they matter: on a model with no real effect, the head chosen on one split looks real there and not
on the other."""

from __future__ import annotations

import hashlib
import json
from collections import Counter

import pytest
import torch

from analyses.components.decompose import dla_effects
from analyses.core.splits import split_prompts
from analyses.core.stats import excludes_zero
from interp import GPTConfig, GPTModel, UserError, load_model


def test_splits_are_disjoint_seeded_and_recorded():
    split = split_prompts(11, seed=3)
    selection, measurement = split.selection.tolist(), split.measurement.tolist()
    assert sorted(selection + measurement) == list(range(11)) and not set(selection) & set(measurement)
    assert len(selection) == 6 and selection == sorted(selection)  # round(5.5) up, sorted
    again = split_prompts(11, seed=3)
    assert torch.equal(again.selection, split.selection) and torch.equal(again.measurement, split.measurement)
    assert any(not torch.equal(split_prompts(11, seed=s).selection, split.selection) for s in range(4, 8))
    record = split.record()
    assert json.loads(json.dumps(record)) == record  # meta.json can hold it
    assert record["seed"] == 3 and record["n_prompts"] == 11 and record["sizes"] == {"selection": 6, "measurement": 5}
    assert record["selection"] == selection
    assert record["sha256"] == hashlib.sha256(json.dumps([selection, measurement]).encode()).hexdigest()
    assert len(split_prompts(10, share=0.01).selection) == 1 and len(split_prompts(10, share=0.8).measurement) == 2


def test_each_template_is_split_in_proportion():
    """15 templates of 4 prompts and one of 3: every template gives the selection 2 (or, the odd
    one, 1 or 2) of its prompts, where a plain draw leaves some templates on one side only."""
    templates = [t for t in range(15) for _ in range(4)] + [15] * 3
    split = split_prompts(len(templates), seed=0, strata=templates)
    chosen = Counter(templates[i] for i in split.selection.tolist())
    assert all(chosen[t] == 2 for t in range(15)) and chosen[15] in (1, 2)
    assert len(split.selection) == 32 and split.record()["stratified"]  # round(0.5 * 63)
    plain = split_prompts(len(templates), seed=0)
    assert any(Counter(templates[i] for i in plain.selection.tolist())[t] in (0, 4) for t in range(16))


def test_bad_splits_are_refused():
    with pytest.raises(UserError, match="at least 2 prompts"):
        split_prompts(1)
    with pytest.raises(UserError, match=r"share=1.0 must be in \(0, 1\)"):
        split_prompts(10, share=1.0)
    with pytest.raises(UserError, match="strata has 3 labels for 10 prompts"):
        split_prompts(10, strata=[0, 1, 2])


@pytest.mark.parametrize("n_prompts, share, left", [(2, 0.5, 1), (3, 0.5, 1), (10, 0.99, 0), (10, 0.9, 1)])
def test_a_measurement_split_too_small_for_an_interval_is_refused(n_prompts, share, left):
    """One prompt's bootstrap resamples are all that prompt: a zero-width interval that "excludes 0"."""
    with pytest.raises(UserError, match=rf"^n_prompts={n_prompts} split at share={share:g} leaves {left} prompt\(s\) "
                                        "to measure on; the measurement split's intervals need at least 2$"):
        split_prompts(n_prompts, share)
    assert len(split_prompts(4).measurement) == 2 and len(split_prompts(20, share=0.9).measurement) == 2


def test_a_head_chosen_on_one_split_is_measured_on_the_other():
    """A random-init model on random answers and distractors: no head's direct effect on the logit
    difference is real (the answer and the distractor are exchangeable). For each of 12 such tasks,
    pick the most significant of 48 heads (largest |DLA| over its interval's width) on the selection
    split. Measured on the prompts it was chosen on, its interval excludes 0 almost always; measured
    on the measurement split, about as rarely as a 95% interval should (1 in 20)."""
    toy = load_model("toy")
    cfg = GPTConfig(d_vocab=toy.cfg.d_vocab, n_ctx=16, d_model=64, n_heads=16, n_layers=3, attn_only=True)
    torch.manual_seed(0)
    model = GPTModel(cfg, toy.tokenizer).eval()
    in_sample = held_out = 0
    for task in range(12):
        generator = torch.Generator().manual_seed(task)
        tokens = torch.randint(3, cfg.d_vocab, (48, 10), generator=generator)
        answers, distractors = torch.randint(3, cfg.d_vocab, (2, 48), generator=generator)
        split = split_prompts(48, seed=task)
        chosen, measured = split.selection, split.measurement
        heads = dla_effects(model, tokens[chosen], answers[chosen], distractors[chosen], seed=task)
        heads = heads[heads["kind"] == "head"]
        top = heads.loc[(heads["dla"].abs() / (heads["ci_high"] - heads["ci_low"])).idxmax()]
        fresh = dla_effects(model, tokens[measured], answers[measured], distractors[measured], seed=task)
        fresh = fresh.set_index("component").loc[top["component"]]
        in_sample += bool(excludes_zero(top["ci_low"], top["ci_high"]))
        held_out += bool(excludes_zero(fresh["ci_low"], fresh["ci_high"]))
    assert in_sample >= 10 and held_out <= 2, (in_sample, held_out)


def test_clusters_of_near_copies_are_split_whole():
    """Prompts 0-2, 3-4, ... are copies of one another (a cluster each): a split draws whole clusters,
    stratified by the clusters' strata, and refuses too few clusters to measure on."""
    clusters = [0, 0, 0, 1, 1, 2, 3, 3, 4, 5, 5, 5, 6, 7]
    strata = ["x", "x", "x", "x", "x", "y", "y", "y", "x", "y", "y", "y", "x", "y"]
    for seed in range(5):
        split = split_prompts(len(clusters), seed=seed, strata=strata, clusters=clusters)
        selection, measurement = split.selection.tolist(), split.measurement.tolist()
        assert sorted(selection + measurement) == list(range(len(clusters)))
        assert not {clusters[i] for i in selection} & {clusters[i] for i in measurement}
        chosen = Counter(strata[i] for i in {c: i for i, c in enumerate(clusters)}.values() if i in selection)
        assert chosen == {"x": 2, "y": 2}  # 4 clusters of each stratum: half of each
        assert split.record()["n_clusters"] == 8 and len({clusters[i] for i in selection}) == 4
    with pytest.raises(UserError, match=r"^3 clusters of near-copy prompts split at share=0.5 leave 1 cluster\(s\) "
                                        r"to measure on; .* need at least 2$"):
        split_prompts(6, clusters=[0, 0, 1, 1, 2, 2])
    with pytest.raises(UserError, match="cluster 0 holds prompts of strata 'x' and 'y'"):
        split_prompts(6, strata=["x", "y", "x", "x", "y", "y"], clusters=[0, 0, 1, 2, 3, 4])
