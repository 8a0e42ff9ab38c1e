"""Indirect-object identification on SmolLM2: accuracy, logit difference, the heads that write the
answer (direct logit attribution), and two interventions on them (ablation against layer-matched
random heads, activation patching of each writer), every number with its 95% interval.

Prompts: ``analyses.tasks.task.ioi_task``, 200 of them, ABBA and BABA alternating over the
templates; the corruption puts three other names in the same template (ABC). Metric: logit(indirect
object) - logit(subject) at the last token, mean over prompts. The prompts are split by
``task_split`` (stratified by template, seed 0): the writers are ranked on the selection half and
every effect is measured on the other half, so no head is measured on the prompts that chose it.
The measurement prompts are measured pooled, then their ABBA prompts (the indirect object named
first) and their BABA prompts apart (``IOIPositions.order``), each part with its own ABC means and
its own intervals; the writers stay the ones the selection prompts chose.
Ablation reference: ``mean_corrupted``, Wang et al. (2022)'s ABC means (each head's output replaced
by its mean over the corrupted prompts of the same template, position by position), and zero.
Intervals: percentile bootstrap over prompts (1,000 resamples, seeded); "% lower" is the ratio of
the mean ablation effect to the mean clean logit difference, both over the same resampled prompts.

    python examples/smollm2/ioi.py
"""

from __future__ import annotations

import numpy as np
import torch

from analyses.circuits.ioi_classes import ioi_positions
from analyses.core.stats import bootstrap_ratio
from analyses.core.tokens import model_tokenizer
from analyses.interventions.controls import control_effects
from analyses.interventions.ablation import prepare_ablation
from analyses.interventions.patching import COMPONENTS, prepare
from analyses.interventions.run import Options
from analyses.report.task_page import measured_heads, task_dla
from analyses.tasks.task import ioi_task, task_ablation, task_batch, task_metric, task_split
from setup_smollm2 import head_name, load

N_PROMPTS = 200
TOP = 5
N_DRAWS = 50


def interval(mean: float, low: float, high: float, digits: int = 2) -> str:
    return f"{mean:.{digits}f} [{low:.{digits}f}, {high:.{digits}f}]"


def accuracy_line(task, batch, model) -> str:
    """Accuracy and the logit difference over ``task``'s clean prompts, each with its interval."""
    with torch.no_grad():
        logits = model(batch.clean)
    final = logits[torch.arange(len(task)), batch.last]
    answer = torch.tensor([a[0] for a in task.answers])
    subject = torch.tensor([d[0] for d in task.distractors])
    diffs = (final.gather(1, answer[:, None]) - final.gather(1, subject[:, None]))[:, 0]
    ones = torch.ones(len(task))
    acc, diff = bootstrap_ratio((diffs > 0).double(), ones), bootstrap_ratio(diffs.double(), ones)
    return (f"accuracy {interval(*(100 * float(v) for v in acc), 0)}%, logit difference "
            f"{interval(*map(float, diff))} (per prompt {diffs.min():.2f} to {diffs.max():.2f})")


def writers(model, task) -> list[tuple[int, int]]:
    """Heads by their mean direct contribution to the logit difference on ``task``, most positive first."""
    dla = task_dla(model, task, task_batch(model, task))
    heads = dla[dla["kind"] == "head"].sort_values("dla", ascending=False)
    return [(int(l), int(h)) for l, h in zip(heads["layer"], heads["head"])]


def share_lower(model, batch, heads, method: str, metric, reference) -> str:
    """How much lower ablating ``heads`` makes the logit difference, as a share of the clean one."""
    ablation = prepare_ablation(model, batch.clean, method, metric, reference=reference)
    ablated, clean = ablation.scores([heads], progress=False), ablation.baseline_scores()
    change = (clean.numerators - ablated.numerators[0]).double()  # (prompts,) per-prompt drop
    share = bootstrap_ratio(change, clean.numerators.double())
    return f"{interval(*(100 * float(v) for v in share), 0)}% lower"


def measure(model, task, top, label: str) -> None:
    """Print, on ``task``'s prompts: the accuracy and logit difference, each writer of ``top``'s DLA,
    and the ablation of all of ``top`` (``mean_corrupted`` with this task's own ABC means, and zero)
    against layer-matched random heads, each with its interval over these prompts."""
    batch = task_batch(model, task)
    print(f"{label} ({len(task)} prompts): {accuracy_line(task, batch, model)}")
    dla = task_dla(model, task, batch).set_index(["kind", "layer", "head"])
    for layer, head in top:
        row = dla.loc[("head", layer, head)]
        print(f"  {head_name(layer, head)} DLA: {interval(row.dla, row.ci_low, row.ci_high)} "
              f"(+answer {row.dla_answer:+.2f}, -subject {row.dla_distractor:+.2f})")
    metric = task_metric(task, batch.last)
    for method in ("mean_corrupted", "zero"):
        reference, words = task_ablation(task, batch, method)
        control = control_effects(model, batch.clean, top, method, metric, reference=reference,
                                  n_draws=N_DRAWS, progress=False)
        print(f"  {method} ablation ({words}): {control.describe()}")
        print(f"    the logit difference {share_lower(model, batch, top, method, metric, reference)}")


def main() -> None:
    torch.set_grad_enabled(False)
    model = load()
    task = ioi_task(model, n=N_PROMPTS, seed=0)
    split = task_split(task, seed=0)
    choose, test = task.subset(split.selection), task.subset(split.measurement)
    test_batch = task_batch(model, test)
    print(f"IOI, {len(task)} prompts ({task.dropped} names/prompts dropped); chosen on {len(choose)}, measured on "
          f"{len(test)} (split by template, seed 0)")
    print("e.g.", repr(task.clean[0]), "->", repr(model_tokenizer(model).decode([task.answers[0][0]])))

    top = writers(model, choose)[:TOP]
    print(f"top {TOP} direct writers, chosen on the selection prompts:", ", ".join(head_name(*h) for h in top))
    measure(model, test, top, "measurement prompts")
    order = ioi_positions(test, test_batch).order()
    for name in ("ABBA", "BABA"):
        measure(model, test.subset(np.flatnonzero(order == name)), top, f"{name} measurement prompts")

    metric = task_metric(test, test_batch.last)
    contrast = prepare(model, test_batch.clean, test_batch.corrupted, metric, COMPONENTS["heads"].names(model))
    patched = measured_heads(contrast, {"top DLA": top}, None, Options(progress=False), seed=0)
    print(f"patching each writer's clean output into the corrupted run on the measurement prompts "
          f"(logit difference corrupted {contrast.baseline:.2f}, clean {contrast.source_value:.2f}):")
    print("  " + ", ".join(f"{head_name(r.layer, r.head)} {interval(r.effect, r.ci_low, r.ci_high)}"
                           for r in patched.itertuples()))


if __name__ == "__main__":
    main()
