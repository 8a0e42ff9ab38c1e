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
its own intervals; the writers stay the ones the selection prompts chose. Each comparison of the two
orders is printed as the difference ABBA minus BABA with the interval of that difference (the
templates resampled, so each template's prompts of both orders are drawn together).
The random sets of the ablation control leave out every head of the class under test: every head
whose DLA on the selection prompts lies beyond +-``DLA_MIN`` with its interval (for the answer or
against it), so no random set holds another direct writer.
Ablation reference: ``mean_corrupted``, Wang et al. (2022)'s ABC means (each head's output replaced
by its mean over the corrupted prompts of the same template, position by position), and zero.
Intervals: percentile bootstrap over prompts (1,000 resamples, seeded); "% lower" is the ratio of
the mean ablation effect to the mean clean logit difference, both over the same resampled prompts.

    python examples/smollm2/ioi.py
"""

from __future__ import annotations

import numpy as np
import torch

from analyses.circuits.ioi_classes import DLA_MIN, ioi_positions, prompt_dla
from analyses.components.decompose import components_cache
from analyses.core.stats import bootstrap_ratio, paired_difference
from analyses.core.tokens import model_tokenizer
from analyses.interventions.controls import control_effects
from analyses.interventions.ablation import prepare_ablation
from analyses.interventions.patching import COMPONENTS, prepare
from analyses.core.execution import executing
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
    with executing(progress=False):
        ablated, clean = ablation.scores([heads]), ablation.baseline_scores()
    change = (clean.numerators - ablated.numerators[0]).double()  # (prompts,) per-prompt drop
    share = bootstrap_ratio(change, clean.numerators.double())
    return f"{interval(*(100 * float(v) for v in share), 0)}% lower"


def writer_class(model, task) -> list[tuple[int, int]]:
    """Every head that writes onto the logit difference directly on ``task``, for the answer or against
    it: its DLA's 95% interval beyond +-``DLA_MIN`` (the name movers' threshold)."""
    dla = task_dla(model, task, task_batch(model, task))
    heads = dla[(dla["kind"] == "head") & ((dla["ci_low"] > DLA_MIN) | (dla["ci_high"] < -DLA_MIN))]
    return [(int(l), int(h)) for l, h in zip(heads["layer"], heads["head"])]


def measure(model, task, top, label: str, exclude=()) -> None:
    """Print, on ``task``'s prompts: the accuracy and logit difference, each writer of ``top``'s DLA,
    and the ablation of all of ``top`` (``mean_corrupted`` with this task's own ABC means, and zero)
    against layer-matched random heads (none of ``exclude``), each with its interval over these prompts."""
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
                                  n_draws=N_DRAWS, progress=False, exclude=exclude)
        print(f"  {method} ablation ({words}): {control.describe()}")
        print(f"    the logit difference {share_lower(model, batch, top, method, metric, reference)}")


def order_difference(values: torch.Tensor, counts: torch.Tensor, abba: torch.Tensor, baba: torch.Tensor,
                     templates) -> str:
    """ABBA minus BABA of a pooled mean, sum(values) / sum(counts) over each order's prompts (values,
    counts (batch,)), with the 95% interval of the difference, templates resampled (each template's
    prompts of both orders drawn together: ``paired_difference`` with the templates as clusters)."""
    difference, low, high = paired_difference(values * abba, counts * abba, values * baba, counts * baba,
                                              clusters=list(templates))
    return interval(float(difference), float(low), float(high))


def order_drops(model, task, order: np.ndarray, top, method: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per prompt of ``task`` (batch,): the logit difference's drop when ``top`` is ablated by ``method``,
    each order's prompts with that order's own ABC means (as ``measure`` ablates them), and the clean
    logit difference; float64."""
    drop, clean = torch.zeros(len(task), dtype=torch.float64), torch.zeros(len(task), dtype=torch.float64)
    for name in ("ABBA", "BABA"):
        rows = np.flatnonzero(order == name)
        part = task.subset(rows)
        batch = task_batch(model, part)
        reference, _ = task_ablation(part, batch, method)
        ablation = prepare_ablation(model, batch.clean, method, task_metric(part, batch.last), reference=reference)
        with executing(progress=False):
            ablated, unablated = ablation.scores([top]), ablation.baseline_scores()
        drop[rows] = (unablated.numerators - ablated.numerators[0]).double().cpu()
        clean[rows] = unablated.numerators.double().cpu()
    return drop, clean


def orders_apart(model, test, top) -> None:
    """Print ABBA minus BABA, on ``test``'s prompts, of the logit difference, each writer's DLA, and the
    ablation of ``top`` (its effect and its share of the logit difference), each with the interval of
    the difference (``order_difference``), not two marginal intervals side by side."""
    batch = task_batch(model, test)
    order = ioi_positions(test, batch).order()
    abba, baba = (torch.tensor(order == name, dtype=torch.float64) for name in ("ABBA", "BABA"))
    ones = torch.ones(len(test), dtype=torch.float64)
    with torch.no_grad():
        logits = model(batch.clean)
    final = logits[torch.arange(len(test)), batch.last].double()
    diffs = (final.gather(1, torch.tensor([a[0] for a in test.answers])[:, None])
             - final.gather(1, torch.tensor([d[0] for d in test.distractors])[:, None]))[:, 0]
    print(f"ABBA minus BABA (the 95% interval of the difference, the {len(set(test.templates))} templates "
          f"resampled): logit difference {order_difference(diffs, ones, abba, baba, test.templates)}")
    dla = prompt_dla(model, components_cache(model, batch.clean), test, batch.last).double()
    print("  DLA: " + ", ".join(f"{head_name(l, h)} {order_difference(dla[:, l, h], ones, abba, baba, test.templates)}"
                                for l, h in top))
    for method in ("mean_corrupted", "zero"):
        drop, clean = order_drops(model, test, order, top, method)
        print(f"  ablating the {len(top)} writers, {method}: effect "
              f"{order_difference(-drop, ones, abba, baba, test.templates)}; share lower (percentage points) "
              f"{order_difference(100 * drop, clean, abba, baba, test.templates)}")


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
    others = [head for head in writer_class(model, choose) if head not in top]
    print(f"the random sets leave out every head whose DLA on the selection prompts lies beyond +-{DLA_MIN} "
          f"with its interval: {', '.join(head_name(*h) for h in others) or 'no other'}")
    measure(model, test, top, "measurement prompts", exclude=others)
    order = ioi_positions(test, test_batch).order()
    for name in ("ABBA", "BABA"):
        measure(model, test.subset(np.flatnonzero(order == name)), top, f"{name} measurement prompts", exclude=others)
    orders_apart(model, test, top)

    metric = task_metric(test, test_batch.last)
    contrast = prepare(model, test_batch.clean, test_batch.corrupted, metric, COMPONENTS["heads"].names(model))
    with executing(progress=False):
        patched = measured_heads(contrast, {"top DLA": top}, None, seed=0)
    print(f"patching each writer's clean output into the corrupted run on the measurement prompts "
          f"(logit difference corrupted {contrast.baseline:.2f}, clean {contrast.source_value:.2f}):")
    print("  " + ", ".join(f"{head_name(r.layer, r.head)} {interval(r.effect, r.ci_low, r.ci_high)}"
                           for r in patched.itertuples()))


if __name__ == "__main__":
    main()
