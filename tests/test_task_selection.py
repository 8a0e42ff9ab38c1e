"""``interp task`` chooses on one split and measures on another (DESIGN 4.12), with the literature's
ablation reference: the ABC means of Wang et al. 2022 (each template's corrupted prompts' mean,
position by position), checked against a hand computation; the task's CSVs against the library's
interval functions on the measurement split."""

import json

import pandas as pd
import pytest
import torch

from analyses.interventions.ablation import CorruptedReference, ablate_heads
from analyses.tasks.task import Task, make_task, task_ablation, task_batch, task_metric, task_split
from interp import UserError, load_model


@pytest.fixture(scope="module")
def toy():
    return load_model("toy")


def abc_mean_by_hand(model, task: Task, corrupted: torch.Tensor, layer: int) -> torch.Tensor:
    """hook_z of ``layer`` replaced, for prompt i at position p, by the mean of the corrupted prompts'
    hook_z at p over the prompts j of prompt i's template: one plain forward and a loop."""
    name = f"blocks.{layer}.attn.hook_z"
    _, cache = model.run_with_cache(corrupted, names_filter=name)
    z = cache[name].double()  # (batch, pos, head, d_head)
    rows = []
    for i in range(len(task)):
        same = [j for j in range(len(task)) if task.templates[j] == task.templates[i]]
        rows.append(sum(z[j] for j in same) / len(same))
    return torch.stack(rows)


def test_mean_corrupted_ablation_is_each_templates_corrupted_mean_at_each_position(toy):
    task = make_task(toy, "ioi", n=22)
    assert len(set(task.templates)) == 11 and all(task.templates.count(t) == 2 for t in set(task.templates))
    batch = task_batch(toy, task)
    metric = task_metric(task, batch.last)
    layer, head = 1, 2
    replacement = abc_mean_by_hand(toy, task, batch.corrupted, layer)

    def ablate(z, hook):
        z = z.clone()
        z[:, :, head] = replacement[:, :, head].to(z.dtype)
        return z

    with torch.no_grad():
        expected = metric(toy.run_with_hooks(batch.clean, fwd_hooks=[(f"blocks.{layer}.attn.hook_z", ablate)])).item()
    reference, words = task_ablation(task, batch)
    assert "same template" in words and reference.templates == task.templates
    found = ablate_heads(toy, batch.clean, [(layer, head)], "mean_corrupted", metric, reference=reference)
    assert found == pytest.approx(expected, abs=1e-5)
    # the plain mean over every other prompt at the same position is another number, and refused for a task
    assert abs(ablate_heads(toy, batch.clean, [(layer, head)], "mean", metric) - expected) > 1e-3
    with pytest.raises(UserError, match="over prompts of 11 templates.*use mean_corrupted"):
        task_ablation(task, batch, "mean")
    with pytest.raises(UserError, match="mean_corrupted ablation needs reference=CorruptedReference"):
        ablate_heads(toy, batch.clean, [(layer, head)], "mean_corrupted", metric)
    with pytest.raises(UserError, match="is for mean_corrupted ablation, not mean"):
        ablate_heads(toy, batch.clean, [(layer, head)], "mean", metric, reference=reference)
    short = CorruptedReference(batch.corrupted[:4], task.templates[:4])
    with pytest.raises(UserError, match="4 corrupted prompts .* for 22 prompts"):
        ablate_heads(toy, batch.clean, [(layer, head)], "mean_corrupted", metric, reference=short)


def test_the_split_is_stratified_by_template_and_a_template_left_empty_is_refused(toy):
    task = make_task(toy, "ioi", n=22)
    split = task_split(task, seed=3)
    selection, measurement = set(split.selection.tolist()), set(split.measurement.tolist())
    assert not selection & measurement and len(selection | measurement) == 22 and split.stratified
    for template in set(task.templates):  # 2 prompts each: one in each split
        members = {i for i, t in enumerate(task.templates) if t == template}
        assert len(members & selection) == len(members & measurement) == 1
    with pytest.raises(UserError) as error:
        task_split(make_task(toy, "ioi", n=20))  # 11 templates that fit the toy context: 2 of them have one prompt
    assert "has 1 prompt(s), so the" in str(error.value) and "--no-split" in str(error.value)
    assert "\n" not in str(error.value)
