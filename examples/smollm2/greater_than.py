"""Greater-than on SmolLM2 (Hanna et al. 2023): "The war lasted from the year 1759 to the year 17".

SmolLM2's tokenizer writes every digit as a token of its own, so no two-digit year is one token and
``analyses.tasks.task.greater_than_task`` asks for the first digit at which a later end year can
differ (the tasks guide): after a start year 17D9, the end year's decade digit ("... to the year 17",
answers the digits > D); after any other start year 17DY, its last digit ("... to the year 17D",
answers the digits > Y), so that "later" is not always "the next decade". The distractors are the
other digits, the metric the probability difference sum p(answers) - sum p(distractors) at the last
token. The corruption is the earliest start year of the same tokens (1709 on decades, 17D0 on last
digits). The prompts are distinct, each a noun and a start year.

First, Hanna et al.'s two measures on ``N_PROMPTS`` prompts, each a mean over prompts with its
95% bootstrap interval (``analyses.tasks.task.task_measure_intervals``): the probability difference
and the cutoff sharpness p(D + 1) - p(D - 1), the decades either side of the start decade; then how
the probability spreads over the digits, on the same prompts (they choose nothing).

Then the components. The prompts are split by ``task_split`` (whole start years on one side, seed 0: a
start year's prompts differ only in the noun, so no near-copy is on both sides): heads
and MLPs are ranked on the selection half, by direct logit attribution (DLA) and by activation
patching (each one's clean output into the corrupted run, every head and MLP), and every effect is
measured on the other half, so none is measured on the prompts that chose it:

- DLA and patching of the chosen ones, each a mean over prompts with its interval; patching also as
  a share of the gap between the corrupted and the clean run (a ratio of sums over the same
  resampled prompts);
- ablation of the top DLA heads, and of the head patching ranked first, against layer-matched random
  head sets (``analyses.interventions.controls.control_effects``); of the top DLA MLPs, and of those
  heads and MLPs together, with the effect's interval and the share lower (no random control: a
  layer holds one MLP, so no MLP set is matched by layer). Ablation references: ``mean_corrupted``
  (each output replaced by its mean over the corrupted prompts of the same noun, position by
  position: the earliest start years' run, the reference Hanna et al. patch from) and zero.

Intervals: 95% percentile bootstrap over prompts (1,000 resamples, seeded).

    python examples/smollm2/greater_than.py
"""

from __future__ import annotations

import pandas as pd
import torch

from analyses.core.stats import bootstrap_ratio
from analyses.interventions.ablation import MLP, component_cells, component_label, prepare_ablation
from analyses.interventions.controls import control_effects
from analyses.interventions.patching import COMPONENTS, prepare
from analyses.core.execution import executing
from analyses.report.task_page import task_dla
from analyses.tasks.task import (greater_than_task, task_ablation, task_batch, task_measure_intervals, task_metric,
                                 task_split)
from setup_smollm2 import load

N_PROMPTS = 100
TOP = 5
N_DRAWS = 50
METHODS = ("mean_corrupted", "zero")


def interval(mean: float, low: float, high: float, digits: int = 3, sign: str = "+") -> str:
    return f"{mean:{sign}.{digits}f} [{low:{sign}.{digits}f}, {high:{sign}.{digits}f}]"


def percent(mean: float, low: float, high: float) -> str:
    return f"{100 * mean:.0f}% [{100 * low:.0f}, {100 * high:.0f}]"


def mean_interval(values: torch.Tensor) -> tuple[float, float, float]:
    """(n,) per-prompt values -> their mean and its 95% bootstrap interval over prompts."""
    return tuple(float(v) for v in bootstrap_ratio(values.double(), torch.ones(len(values))))


def digit_ids(task) -> torch.Tensor:
    """(10,) the token ids of the digits 0-9: a prompt's distractors (digits <= D) then its answers
    (digits > D), each in digit order."""
    ids = torch.tensor([*task.distractors[0], *task.answers[0]])
    assert len(set(ids.tolist())) == 10, "each digit must be one token"
    return ids


def decades(task) -> torch.Tensor:
    """(n,) each prompt's compared digit: the digit measured is later exactly above it (the decade D
    of a start year 17D9, the last digit Y of 17DY otherwise), one less than its distractors."""
    return torch.tensor([len(distractors) - 1 for distractors in task.distractors])


def digit_probs(model, tokens: torch.Tensor, last: torch.Tensor, digits: torch.Tensor) -> torch.Tensor:
    """tokens (n, pos) right-padded, last (n,) each prompt's last real position -> (n, 10) the
    probability of each digit 0-9 there, by a plain softmax over the whole vocabulary (not through
    the task's metric)."""
    with torch.no_grad():
        logits = model(tokens)
    return logits[torch.arange(len(tokens)), last].float().softmax(-1)[:, digits]


def prob_diff(probs: torch.Tensor, decade: torch.Tensor) -> torch.Tensor:
    """(n, 10), (n,) -> (n,) sum p(digit > D) - sum p(digit <= D)."""
    above = torch.arange(10)[None] > decade[:, None]
    return (probs * above).sum(-1) - (probs * ~above).sum(-1)


def by_offset(probs: torch.Tensor, decade: torch.Tensor, offsets=range(-3, 4)) -> dict[int, tuple[float, float, float]]:
    """Mean p(digit D + k), with its interval, over the prompts where D + k is a digit: the shape of
    Hanna et al.'s curve."""
    out = {}
    for k in offsets:
        rows = ((decade + k) >= 0) & ((decade + k) <= 9)
        out[k] = mean_interval(probs[rows, (decade + k)[rows]])
    return out


def hanna_measures(model, task) -> None:
    """Print Hanna et al.'s probability difference and cutoff sharpness on ``task``'s prompts,
    clean and corrupted, each with its 95% interval over prompts."""
    frame = task_measure_intervals(model, task, task_batch(model, task), seed=0)
    print(f"Hanna et al.'s measures on {len(task)} prompts (mean [95% bootstrap interval over prompts]):")
    for row in frame.itertuples():
        print(f"  {row.run:9s} {row.measure:16s} {row.value:+.3f} [{row.ci_low:+.3f}, {row.ci_high:+.3f}]")


def spread(model, task) -> None:
    """Print where the probability goes on ``task``'s clean prompts, each number with its interval."""
    batch, digits, decade = task_batch(model, task), digit_ids(task), decades(task)
    probs = digit_probs(model, batch.clean, batch.last, digits)
    diff = prob_diff(probs, decade)
    print(f"clean: prob diff per prompt {diff.min():.3f} to {diff.max():.3f}; mass on the ten digits "
          f"{interval(*mean_interval(probs.sum(-1)), sign='')}; top digit > D on "
          f"{percent(*mean_interval((probs.argmax(-1) > decade).double()))} of prompts")
    print("mean p(digit D+k) by k:", ", ".join(f"{k:+d}: {interval(*v, sign='')}"
                                               for k, v in by_offset(probs, decade).items()))


def patched(contrast, components) -> pd.DataFrame:
    """Patch each of ``components`` (heads (layer, head) and ``MLP``s) alone into ``contrast``'s
    base run -> one row each: ``item`` (the component), ``component`` (its label), ``effect`` (metric
    - corrupted) with ``ci_low``, ``ci_high``, and ``share`` of the gap (clean - corrupted) with
    ``share_low``, ``share_high``."""
    with executing(progress=False):
        scores = contrast.score([component_cells([c]) for c in components], "patch")
    low, high, _ = contrast.intervals(scores, seed=0)
    share_low, share_high, _ = contrast.intervals(scores, normalize=True, seed=0)
    effect = (scores.values - contrast.baseline).cpu().double().numpy()
    share = contrast.normalize(scores.values).cpu().double().numpy()
    return pd.DataFrame({"item": components, "component": [component_label(c) for c in components],
                         "effect": effect, "ci_low": low.numpy(), "ci_high": high.numpy(),
                         "share": share, "share_low": share_low.numpy(), "share_high": share_high.numpy()})


def patching_contrast(model, task):
    """Clean into corrupted on ``task``'s prompts, every head's and MLP's output ready to patch."""
    batch = task_batch(model, task)
    names = COMPONENTS["heads"].names(model) + COMPONENTS["mlps"].names(model)
    return prepare(model, batch.clean, batch.corrupted, task_metric(task, batch.last), names)


def all_components(model) -> list:
    """Every head (layer, head), then every ``MLP``."""
    heads = [(layer, head) for layer in range(model.cfg.n_layers) for head in range(model.cfg.n_heads)]
    return heads + [MLP(layer) for layer in range(model.cfg.n_layers)]


def dla_frame(model, task) -> pd.DataFrame:
    """``task_dla`` of the heads and MLPs on ``task``'s prompts, indexed by component label, largest DLA first."""
    dla = task_dla(model, task, task_batch(model, task))
    dla = dla[dla["kind"].isin(["head", "mlp"])].sort_values("dla", ascending=False, kind="stable")
    items = [MLP(int(l)) if k == "mlp" else (int(l), int(h)) for k, l, h in zip(dla["kind"], dla["layer"], dla["head"])]
    return dla.assign(item=items).set_index(pd.Index([component_label(c) for c in items], name="component"))


def choose(model, task) -> dict[str, list]:
    """On the selection prompts ``task``: the top ``TOP`` heads and MLPs by DLA (and the 3 heads of
    most negative DLA) and by patching."""
    dla = dla_frame(model, task)
    heads, mlps = dla[dla["kind"] == "head"]["item"].tolist(), dla[dla["kind"] == "mlp"]["item"].tolist()
    patch = patched(patching_contrast(model, task), all_components(model)).sort_values("effect", ascending=False,
                                                                                       kind="stable")
    is_mlp = patch["item"].map(lambda c: isinstance(c, MLP))
    return {"DLA heads": heads[:TOP], "DLA heads against": heads[::-1][:3], "DLA MLPs": mlps[:TOP],
            "patching heads": patch[~is_mlp]["item"].tolist()[:TOP], "patching MLPs": patch[is_mlp]["item"].tolist()[:TOP]}


def ablation_share(ablation, components) -> tuple[str, str]:
    """Ablating ``components`` together: the effect on the metric with its interval, and the share
    lower (mean drop / mean unablated metric over the same resampled prompts) with its interval."""
    with executing(progress=False):
        scores = ablation.scores([components])
    low, high, _ = ablation.intervals(scores, seed=0)
    clean = ablation.baseline_scores()
    share = bootstrap_ratio((clean.numerators - scores.numerators[0]).double(), clean.numerators.double())
    effect = float(scores.values[0]) - ablation.baseline
    return interval(effect, float(low[0]), float(high[0])), percent(*(float(v) for v in share))


def ablations(model, task, chosen: dict[str, list]) -> None:
    """Print, on the measurement prompts ``task``, the ablation of the top DLA heads and of the head
    patching ranked first, each against matched random heads, and of the top DLA MLPs (alone and
    with those heads), each effect with its interval and the share lower with its own."""
    batch = task_batch(model, task)
    metric = task_metric(task, batch.last)
    heads, mlps = chosen["DLA heads"], chosen["DLA MLPs"]
    for method in METHODS:
        reference, words = task_ablation(task, batch, method)
        ablation = prepare_ablation(model, batch.clean, method, metric, reference=reference, mlps=True)
        print(f"{method} ablation ({words}) on the {len(task)} measurement prompts (prob diff unablated "
              f"{ablation.baseline:.3f}):")
        for tested in (heads, chosen["patching heads"][:1]):
            control = control_effects(model, batch.clean, tested, method, metric, reference=reference,
                                      n_draws=N_DRAWS, progress=False)
            print(f"  {control.describe()}; {ablation_share(ablation, tested)[1]} lower")
        for label, group in (("+".join(map(component_label, mlps)), mlps), ("those heads and MLPs together", heads + mlps)):
            effect, share = ablation_share(ablation, group)
            print(f"  {label}: effect {effect}; {share} lower")


def main() -> None:
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    model = load()
    task = greater_than_task(model, n=N_PROMPTS, seed=0)
    print(f"greater-than, {len(task)} prompts: {task.note}")
    print("e.g.", repr(task.clean[0]), "| corrupted", repr(task.corrupted[0]))
    hanna_measures(model, task)
    spread(model, task)

    split = task_split(task, seed=0)
    selection, test = task.subset(split.selection), task.subset(split.measurement)
    print(f"components chosen on {len(selection)} prompts, measured on the other {len(test)} (split by start "
          f"year, seed 0): the top {TOP} by each ranking, the 3 heads of most negative DLA")
    chosen = choose(model, selection)
    for reason, items in chosen.items():
        print(f"  {reason}: " + ", ".join(map(component_label, items)))

    dla = dla_frame(model, test)
    print(f"direct logit attribution on the {len(test)} measurement prompts (logits of > D minus <= D):")
    for reason in ("DLA heads", "DLA heads against", "DLA MLPs"):
        print(f"  {reason}: " + ", ".join(f"{label} {interval(*dla.loc[label, ['dla', 'ci_low', 'ci_high']], digits=2)}"
                                          for label in map(component_label, chosen[reason])))
    contrast = patching_contrast(model, test)
    print(f"patching on the {len(test)} measurement prompts, each component's clean output into the corrupted run "
          f"(prob diff corrupted {contrast.baseline:.3f}, clean {contrast.source_value:.3f}); effect, share of the gap:")
    for reason, items in chosen.items():
        frame = patched(contrast, items)
        print(f"  {reason}: " + ", ".join(f"{r.component} {interval(r.effect, r.ci_low, r.ci_high)} "
                                          f"({percent(r.share, r.share_low, r.share_high)})"
                                          for r in frame.itertuples()))
    ablations(model, test, chosen)


if __name__ == "__main__":
    main()
