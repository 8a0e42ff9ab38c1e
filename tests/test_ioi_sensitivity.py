"""p(IO) and KL as task measures (``answer_prob_metric``, ``kl_metric``) against hand-written torch,
through a plain forward and through an ablation's per-prompt scores; and the IOI sensitivity table
(examples/smollm2/ioi_sensitivity.py) on the embedded model: every split seed x corruption, and its
clean p(IO) recomputed by hand."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from analyses.core.execution import executing
from analyses.core.metrics import prompt_scores
from analyses.interventions.ablation import prepare_ablation
from analyses.tasks.task import answer_prob_metric, ioi_task, kl_metric, task_batch, task_split
from hand_checks import zero_head
from interp import load_model

HEADS = [(0, 1), (1, 3)]


@pytest.fixture(scope="module")
def toy_ioi():
    model = load_model("toy").eval()
    task = ioi_task(model, n=40, seed=0)
    batch = task_batch(model, task)
    with torch.no_grad():
        logits = model(batch.clean)
    return model, task, batch, logits


def last_logits(logits: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    return logits[torch.arange(len(last)), last]


def test_p_io_is_the_softmax_of_the_answer_at_the_last_real_token(toy_ioi):
    model, task, batch, logits = toy_ioi
    at_last = last_logits(logits, batch.last).double()
    by_hand = np.array([float(row.softmax(-1)[answer[0]]) for row, answer in zip(at_last, task.answers)])
    found = prompt_scores(answer_prob_metric(task, batch.last), logits)
    assert found.numerators.numpy() == pytest.approx(by_hand, abs=1e-6)
    assert float(found.values) == pytest.approx(by_hand.mean(), abs=1e-6)


def test_kl_against_the_clean_run_is_torchs_kl_div_per_prompt_also_through_an_ablation(toy_ioi):
    """KL(clean || run) at the last real token: 0 on the clean run itself; on the run with two heads
    zeroed (interp's ablation, chunked and read at the declared positions) it equals torch's kl_div on
    the logits of hand-written zeroing hooks, prompt by prompt."""
    model, task, batch, logits = toy_ioi
    clean_last = last_logits(logits, batch.last)
    metric = kl_metric(task, batch.last, clean_last)
    assert prompt_scores(metric, logits).numerators.abs().max() < 1e-6
    with torch.no_grad():
        zeroed = model.run_with_hooks(batch.clean, fwd_hooks=[zero_head(*head) for head in HEADS])
    by_hand = F.kl_div(last_logits(zeroed, batch.last).double().log_softmax(-1),
                       clean_last.double().log_softmax(-1), log_target=True, reduction="none").sum(-1)
    assert by_hand.min() > 1e-4  # the zeroing moves every prompt's distribution
    with executing(progress=False):
        found = prepare_ablation(model, batch.clean, "zero", metric).scores([HEADS])
    assert found.numerators[0].double().numpy() == pytest.approx(by_hand.numpy(), rel=1e-3, abs=1e-6)
    with pytest.raises(ValueError, match="reference rows"):
        kl_metric(task, batch.last, clean_last[:3])


def test_the_sensitivity_table_has_each_split_seed_and_corruption_and_its_clean_p_io_by_hand(toy_ioi, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "examples" / "smollm2"))
    from ioi_sensitivity import COLUMNS, sensitivity, table_text

    model, task, _, _ = toy_ioi
    found = sensitivity(model, task, [0, 1, 2], top=2)
    assert list(zip(found["split_seed"], found["corruption"])) == [
        (seed, corruption) for seed in (0, 1, 2) for corruption in ("abc_mean", "abc_resample")]
    for column in COLUMNS:
        assert (found[f"{column}_ci_low"] <= found[column]).all() and (found[column] <= found[f"{column}_ci_high"]).all()
    assert (found["kl_clean_ablated"] > 0).all()
    for _, seed_rows in found.groupby("split_seed"):  # the clean measures do not depend on the corruption
        assert seed_rows["clean_p_io"].nunique() == 1 and seed_rows["clean_logit_diff"].nunique() == 1
    test = task.subset(task_split(task, seed=1).measurement)
    batch = task_batch(model, test)
    with torch.no_grad():
        at_last = last_logits(model(batch.clean), batch.last).double()
    p_io = np.mean([float(row.softmax(-1)[answer[0]]) for row, answer in zip(at_last, test.answers)])
    assert found.loc[found["split_seed"] == 1, "clean_p_io"].iloc[0] == pytest.approx(p_io, abs=1e-6)
    text = table_text(found)
    assert text.count("abc_resample") == 3 and "kl_clean_ablated" in text
