"""Greater-than measured as Hanna et al. 2023 measure it: the probability difference and the cutoff
sharpness p(YY + 1) - p(YY - 1), per prompt with a 95% bootstrap interval, checked against hand
computations on known probability vectors; what the task measures on a digit-by-digit tokenizer
(the decade digit) and on one with two-digit tokens; the task page's metric table."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch

from analyses.tasks.task import (GT_NOUNS, Task, cutoff_scores, greater_than_task, measure_intervals, task_batch,
                                 task_measures)
from interp import UserError, load_model
from test_tasks import bpe_model  # noqa: F401  (a fixture: a tokenizer with two-digit year tokens)

# Two prompts over a 12-token vocabulary whose ids 0..9 are the digits 0..9 (ids 10, 11: other tokens),
# each with its probability vector at the last position and its start decade D.
PROBS = [[0.01, 0.02, 0.05, 0.10, 0.20, 0.25, 0.15, 0.10, 0.05, 0.02, 0.03, 0.02],   # D = 4
         [0.05, 0.05, 0.30, 0.20, 0.10, 0.10, 0.05, 0.05, 0.02, 0.03, 0.04, 0.01]]   # D = 2
DECADES = [4, 2]
# by hand: sum p(digit > D) - sum p(digit <= D), and p(D + 1) - p(D - 1)
PROB_DIFF = [(0.25 + 0.15 + 0.10 + 0.05 + 0.02) - (0.01 + 0.02 + 0.05 + 0.10 + 0.20),   # 0.19
             (0.20 + 0.10 + 0.10 + 0.05 + 0.05 + 0.02 + 0.03) - (0.05 + 0.05 + 0.30)]   # 0.15
SHARPNESS = [0.25 - 0.10, 0.20 - 0.05]


def digit_task() -> Task:
    """The two prompts as a task: answers the digits > D, distractors <= D, cutoffs (D + 1, D - 1)."""
    return Task("greater-than", ("a", "b"), ("c", "d"),
                tuple(tuple(range(d + 1, 10)) for d in DECADES), tuple(tuple(range(d + 1)) for d in DECADES),
                "prob_diff", cutoffs=tuple((d + 1, d - 1) for d in DECADES))


def known_logits() -> torch.Tensor:
    """(2, 3, 12) logits whose softmax at the last position is ``PROBS`` (earlier positions: noise)."""
    logits = torch.randn(2, 3, 12, generator=torch.Generator().manual_seed(0))
    logits[:, -1] = torch.tensor(PROBS).log() + 3.0  # any shift: the softmax is the same
    return logits


def naive_bootstrap(values: list[float], seed: int = 0, n_boot: int = 1000) -> tuple[float, float]:
    """The 95% percentile interval of the mean, resampling prompts with replacement (as drawn by a
    generator seeded ``seed``: ``n_boot`` rows of prompt indices)."""
    generator = torch.Generator().manual_seed(seed)
    draws = torch.randint(len(values), (n_boot, len(values)), generator=generator)
    means = torch.tensor(values, dtype=torch.float64)[draws].mean(1)
    return torch.quantile(means, 0.025).item(), torch.quantile(means, 0.975).item()


def test_cutoff_sharpness_and_prob_diff_equal_a_hand_computation_with_their_intervals():
    task, logits, last = digit_task(), known_logits(), torch.tensor([2, 2])
    assert cutoff_scores(task, last)(logits).tolist() == pytest.approx(SHARPNESS, abs=1e-6)
    assert set(task_measures(task, last)) == {"prob_diff", "cutoff_sharpness"}
    frame = measure_intervals(task, last, logits, seed=0).set_index("measure")
    for measure, values in (("prob_diff", PROB_DIFF), ("cutoff_sharpness", SHARPNESS)):
        row = frame.loc[measure]
        assert row["value"] == pytest.approx(sum(values) / 2, abs=1e-6)
        assert (row["ci_low"], row["ci_high"]) == pytest.approx(naive_bootstrap(values), abs=1e-6)
        assert row["n_prompts"] == 2
    # the bootstrap draws prompts: one prompt's value alone is the interval's floor or ceiling
    assert frame.loc["cutoff_sharpness", "ci_low"] == pytest.approx(min(SHARPNESS), abs=1e-6)
    # the parts of a chunked run give the same per-prompt values (the metric's per-prompt form)
    part = task.subset([1])
    assert cutoff_scores(part, last[1:])(logits[1:]).tolist() == pytest.approx(SHARPNESS[1:], abs=1e-6)


def test_a_task_without_a_cutoff_has_no_sharpness():
    task = Task("t", ("a",), ("b",), ((1,),), ((2,),))
    assert set(task_measures(task, torch.tensor([0]))) == {"logit_diff"}
    with pytest.raises(UserError, match="has no cutoff"):
        cutoff_scores(task, torch.tensor([0]))
    with pytest.raises(UserError, match="1 prompts but 2 cutoffs"):
        Task("t", ("a",), ("b",), ((1,),), ((2,),), cutoffs=((1, 2), (3, 4)))


def test_on_a_digit_by_digit_tokenizer_the_digit_measured_is_the_first_a_later_year_can_differ_at():
    """The toy's byte tokenizer writes digits one by one. Start year 17D9: the prompt ends "17" and the
    end year's decade is measured (corruption 1709); 17DY, Y < 9: the prompt ends "17D" and the last
    digit is measured (corruption 17D0), so "later" and "the next decade" differ. By hand: a digit is
    an answer when every end year it begins is later than the start year, a distractor when none is."""
    model = load_model("toy")
    task = greater_than_task(model, n=60, seed=1)
    decode = model.tokenizer.decode
    kinds = set()
    for clean, corrupted, answers, distractors, (above, below), cluster in zip(
            task.clean, task.corrupted, task.answers, task.distractors, task.cutoffs, task.clusters):
        start = clean.split("from the year ")[1].split(" ")[0]
        begun = clean.split("to the year ")[1]
        assert cluster == start and begun == ("17" if start[3] == "9" else start[:3])
        kinds.add(len(begun))
        assert corrupted == clean.replace(start, "1709" if start[3] == "9" else start[:3] + "0", 1)
        later = sorted(str(d) for d in range(10) if int((begun + str(d)).ljust(4, "0")) > int(start))
        not_later = sorted(str(d) for d in range(10) if int((begun + str(d)).ljust(4, "9")) <= int(start))
        assert sorted(decode([t]) for t in answers) == later and sorted(decode([t]) for t in distractors) == not_later
        compared = int(start[2] if start[3] == "9" else start[3])
        assert (decode([above]), decode([below])) == (str(compared + 1), str(compared - 1))
    assert kinds == {2, 3}  # both: start years 17D9 and others
    assert "first at which a later end year can differ" in task.note
    years = {f"17{d}9" for d in range(1, 9)} | {f"17{d}{y}" for d in range(10) for y in range(1, 9)}
    assert set(greater_than_task(model, n=len(years) * len(GT_NOUNS)).clusters) == years  # every start year
    with pytest.raises(UserError, match=rf"^greater-than can make {len(years) * len(GT_NOUNS)} distinct prompts for "
                                        rf"this tokenizer; asked for {len(years) * len(GT_NOUNS) + 1}$"):
        greater_than_task(model, n=len(years) * len(GT_NOUNS) + 1)


def test_with_two_digit_tokens_the_cutoff_is_the_years_either_side_of_the_start(bpe_model):  # noqa: F811
    task = greater_than_task(bpe_model, n=20, seed=0)
    decode = bpe_model.tokenizer.decode
    for clean, answers, (above, below) in zip(task.clean, task.answers, task.cutoffs):
        year = int(clean.split("from the year 17")[1][:2])
        assert (decode([above]), decode([below])) == (f"{year + 1:02d}", f"{year - 1:02d}")
        assert all(int(decode([t])) > year for t in answers)


def test_the_task_page_shows_both_measures_with_their_intervals(tmp_path):
    """``interp task greater-than``: metric.csv holds the probability difference and the cutoff
    sharpness of the clean and corrupted runs, each equal to a plain softmax over the model's logits,
    with the naive bootstrap interval."""
    from analyses.cli import main

    model = load_model("toy")
    out = tmp_path / "gt"
    assert main(["task", "greater-than", "--n", "6", "--top", "1", "--no-split", "--out", str(out), "--quiet"]) == 0
    task = greater_than_task(model, n=6)
    batch = task_batch(model, task)
    table = pd.read_csv(out / "metric.csv").set_index(["run", "measure"])
    assert set(table["split"]) == {"all"}
    for run, tokens in (("clean", batch.clean), ("corrupted", batch.corrupted)):
        with torch.no_grad():
            probs = model(tokens)[torch.arange(len(task)), batch.last].softmax(-1)
        sharp = [(p[a] - p[b]).item() for p, (a, b) in zip(probs, task.cutoffs)]
        diff = [(p[list(good)].sum() - p[list(bad)].sum()).item()
                for p, good, bad in zip(probs, task.answers, task.distractors)]
        for measure, values in (("prob_diff", diff), ("cutoff_sharpness", sharp)):
            row = table.loc[(run, measure)]
            assert row["metric"] == pytest.approx(sum(values) / len(values), abs=1e-5)
            assert (row["ci_low"], row["ci_high"]) == pytest.approx(naive_bootstrap(values), abs=1e-5)
    assert "cutoff_sharpness" in (out / "report.md").read_text()
    assert json.loads((out / "meta.json").read_text())["task"] == "greater-than"
