"""``interp task`` chooses on one split and measures on another (architecture §4.12), with the literature's
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


def test_the_task_page_measures_on_the_measurement_split_what_it_chose_on_the_selection_split(toy, tmp_path):
    """dla.csv and chosen_heads.csv hold dla_effects' and patch_effects' numbers and intervals on the
    measurement prompts (the split meta.json records); control.csv ablates with the ABC means."""
    from analyses.cli import main
    from analyses.components.decompose import components_cache, dla_effects
    from analyses.interventions.patching import patch_effects

    out = tmp_path / "ioi"
    assert main(["task", "ioi", "--n", "22", "--top", "2", "--out", str(out), "--quiet"]) == 0
    meta = json.loads((out / "meta.json").read_text())
    task = make_task(toy, "ioi", n=22)
    split = task_split(task)
    assert meta["split"] == split.record() and meta["split"]["stratified"]
    assert meta["ablation"]["method"] == "mean_corrupted" and "same template" in meta["ablation"]["reference"]
    measured = task.subset(split.measurement)
    batch = task_batch(toy, measured)
    metric = task_metric(measured, batch.last)
    dla = pd.read_csv(out / "dla.csv")
    expected = dla_effects(toy, components_cache(toy, batch.clean), measured.answers, measured.distractors,
                           at=batch.last)
    for column in ("dla", "ci_low", "ci_high", "dla_answer", "dla_distractor", "dla_distractor_ci_high"):
        assert dla[column].to_numpy() == pytest.approx(expected[column].to_numpy(), abs=1e-5), column
    assert (dla["n_prompts"] == 11).all() and dla["ci_low"].notna().all()
    with torch.no_grad():
        assert dla["dla"].sum() == pytest.approx(metric(toy(batch.clean)).item(), abs=1e-4)
    chosen = pd.read_csv(out / "chosen_heads.csv")
    patched = patch_effects(toy, batch.clean, batch.corrupted, metric).set_index(["layer", "head"])
    rows = patched.loc[list(zip(chosen["layer"], chosen["head"]))]
    for column in ("metric", "effect", "ci_low", "ci_high"):
        assert chosen[column].to_numpy() == pytest.approx(rows[column].to_numpy(), abs=1e-5), column
    assert chosen["ci_low"].notna().all() and (chosen["n_prompts"] == 11).all()
    heads_dla = expected[expected["kind"] == "head"].astype({"layer": int, "head": int}).set_index(["layer", "head"])
    assert chosen["dla_ci_low"].to_numpy() == pytest.approx(
        heads_dla.loc[list(zip(chosen["layer"], chosen["head"])), "ci_low"].to_numpy(), abs=1e-5)
    # the control's tested set (the top writers) ablated with the ABC means of the measurement prompts
    control = pd.read_csv(out / "control.csv").iloc[0]
    tested = [tuple(int(x) for x in label[1:].split("H")) for label in control["heads"].split("+")]
    reference, _ = task_ablation(measured, batch)
    with torch.no_grad():
        clean = metric(toy(batch.clean)).item()
    ablated = ablate_heads(toy, batch.clean, tested, "mean_corrupted", metric, reference=reference)
    assert control["effect"] == pytest.approx(ablated - clean, abs=1e-5) and control["method"] == "mean_corrupted"
    page = (out / "index.html").read_text()
    assert "measurement split" in page and "vs random heads" in page and "ABC means" in page


def test_no_split_is_in_sample_and_says_so(toy, tmp_path):
    from analyses.cli import main

    out = tmp_path / "ioi"
    assert main(["task", "ioi", "--n", "6", "--top", "1", "--no-split", "--out", str(out), "--quiet"]) == 0
    meta = json.loads((out / "meta.json").read_text())
    assert "in-sample" in meta["split"]["none"] and "In-sample" in (out / "index.html").read_text()
    assert pd.read_csv(out / "dla.csv")["n_prompts"].eq(6).all()


def test_a_task_too_small_to_measure_with_an_interval_is_refused(toy, tmp_path, capsys, monkeypatch):
    """A 2- or 3-prompt task would leave 1 prompt to measure on, whose interval has zero width; refused by
    the library and, before the model loads, by the command (with and without a split)."""
    from analyses.cli import main
    import analyses.cli.tasks as command

    for n in (2, 3):  # induction-text: no templates, so no template is left out of a split
        with pytest.raises(UserError, match=rf"^task 'induction-text': n_prompts={n} split at share=0.5 leaves 1 "
                                            r"prompt\(s\) to measure on; the measurement split's intervals need at "
                                            r"least 2; give more prompts \(--n\)$"):
            task_split(make_task(toy, "induction-text", n=n))
    assert len(task_split(make_task(toy, "induction-text", n=4)).measurement) == 2
    monkeypatch.setattr(command, "load_cli_model", lambda args: pytest.fail("the model loaded"))
    assert main(["task", "ioi", "--n", "3", "--out", str(tmp_path / "a")]) == 2
    assert capsys.readouterr().err.strip() == (
        "interp task: error: --n 3: n_prompts=3 split at share=0.5 leaves 1 prompt(s) to measure on; the measurement "
        "split's intervals need at least 2; give more prompts (--n)")
    assert main(["task", "ioi", "--n", "1", "--no-split", "--out", str(tmp_path / "b")]) == 2
    assert capsys.readouterr().err.strip() == (
        "interp task: error: --n 1: 1 prompt(s): an interval over prompts needs at least 2 prompts, since one "
        "prompt's resamples are all that prompt (a zero-width interval); give more prompts (--n)")
