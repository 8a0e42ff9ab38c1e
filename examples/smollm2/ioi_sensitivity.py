"""How the headline IOI numbers move with what they rest on: the split seed, the corruption that
removes the writers, and the measure.

For each split seed (``task_split``, stratified by template) the writers are the ``--top`` heads of
largest direct logit attribution on the selection prompts (as ``ioi.py`` chooses them); on the
measurement prompts the script prints, each a mean over prompts with its 95% percentile bootstrap
interval (1,000 resamples, seeded):

- clean: the logit difference logit(IO) - logit(S) and p(IO), the indirect object's probability (a
  softmax over the whole vocabulary), at the last token;
- the writers removed together, by each corruption: the change of the logit difference and of p(IO)
  (ablated minus clean, per prompt), and KL(clean || ablated) of the next-token distribution at the
  last token, in nats (``analyses.tasks.task``: ``task_metric``, ``answer_prob_metric``, ``kl_metric``).

The corruptions: ``abc_mean`` (``mean_corrupted``, Wang et al. 2022's ABC means: each writer's output
replaced by its mean over the corrupted prompts of the same template, position by position) and
``abc_resample`` (each prompt's writers given their outputs on one corrupted prompt of its own template,
drawn at random, seeded: ``resample`` ablation with that template's corrupted prompts as the reference;
a template's prompts have one token length, which resampling needs).

    OMP_NUM_THREADS=1 python examples/smollm2/ioi_sensitivity.py [--model smollm2] [--n 200] [--seeds 0 1 2] [--top 5]
"""

from __future__ import annotations

import argparse

import pandas as pd
import torch

import interp
from analyses.core.execution import executing
from analyses.core.metrics import Metric, prompt_scores
from analyses.core.stats import bootstrap_ratio
from analyses.interventions.ablation import prepare_ablation
from analyses.report.task_page import task_dla
from analyses.tasks.task import (Task, TaskBatch, answer_prob_metric, ioi_task, kl_metric, task_ablation, task_batch,
                                 task_metric, task_split)

CORRUPTIONS = ("abc_mean", "abc_resample")
MEASURES = ("logit_diff", "p_io", "kl")


def measures(task: Task, batch: TaskBatch, clean_last: torch.Tensor) -> dict[str, Metric]:
    """The three measures on ``task``'s prompts, each a metric as ``task_metric`` makes: the logit
    difference, p(IO) and KL(clean || run) at the last token; ``clean_last`` (batch, d_vocab) the
    clean run's logits there."""
    return {"logit_diff": task_metric(task, batch.last), "p_io": answer_prob_metric(task, batch.last),
            "kl": kl_metric(task, batch.last, clean_last)}


def writers(model, task: Task, top: int) -> list[tuple[int, int]]:
    """The ``top`` heads of largest mean direct logit attribution to the logit difference on ``task``."""
    dla = task_dla(model, task, task_batch(model, task))
    heads = dla[dla["kind"] == "head"].sort_values("dla", ascending=False)
    return [(int(layer), int(head)) for layer, head in zip(heads["layer"], heads["head"])][:top]


def ablated(model, task: Task, batch: TaskBatch, clean_last: torch.Tensor, heads, corruption: str,
            seed: int) -> dict[str, torch.Tensor]:
    """Each prompt's score of each measure with ``heads`` removed by ``corruption`` -> name -> (batch,)."""
    with executing(progress=False):
        if corruption == "abc_mean":
            reference, _ = task_ablation(task, batch, "mean_corrupted")
            return {name: prepare_ablation(model, batch.clean, "mean_corrupted", metric, reference=reference)
                    .scores([heads]).numerators[0].double()
                    for name, metric in measures(task, batch, clean_last).items()}
        found = {name: torch.empty(len(task), dtype=torch.float64) for name in MEASURES}
        groups = pd.Series(range(len(task))).groupby([list(task.templates), batch.last.tolist()]).agg(list)
        for rows in groups:  # one template and one length: resampling needs prompts of equal length
            width = int(batch.last[rows[0]]) + 1
            part = TaskBatch(batch.clean[rows, :width], batch.corrupted[rows, :width], batch.last[rows])
            for name, metric in measures(task.subset(rows), part, clean_last[rows]).items():
                ablation = prepare_ablation(model, part.clean, "resample", metric, reference=part.corrupted, seed=seed)
                found[name][rows] = ablation.scores([heads]).numerators[0].double()
        return found


def interval(name: str, values: torch.Tensor) -> dict[str, float]:
    """``name``, ``name_ci_low``, ``name_ci_high``: the mean of per-prompt ``values`` (batch,) and its 95%
    percentile bootstrap over prompts."""
    mean, low, high = (float(v) for v in bootstrap_ratio(values.double(), torch.ones(len(values), dtype=torch.float64)))
    return {name: mean, f"{name}_ci_low": low, f"{name}_ci_high": high}


COLUMNS = ("clean_logit_diff", "effect_logit_diff", "clean_p_io", "effect_p_io", "kl_clean_ablated")


def sensitivity(model, task: Task, seeds, top: int) -> pd.DataFrame:
    """One row per split seed x corruption: ``split_seed, corruption, prompts, writers`` (chosen on that
    seed's selection prompts) and, on its measurement prompts, each of ``COLUMNS`` with its
    ``_ci_low``/``_ci_high`` (``interval``): the clean logit difference and p(IO), the writers' removal's
    change of both (ablated minus clean) and KL(clean || ablated)."""
    rows = []
    for seed in seeds:
        split = task_split(task, seed=seed)
        heads = writers(model, task.subset(split.selection), top)
        test = task.subset(split.measurement)
        batch = task_batch(model, test)
        with torch.no_grad():
            logits = model(batch.clean)
        clean_last = logits[torch.arange(len(test)), batch.last]  # (batch, d_vocab)
        clean = {name: prompt_scores(metric, logits).numerators.double()
                 for name, metric in measures(test, batch, clean_last).items()}
        for corruption in CORRUPTIONS:
            removed = ablated(model, test, batch, clean_last, heads, corruption, seed)
            rows.append({"split_seed": seed, "corruption": corruption, "prompts": len(test),
                         "writers": " ".join(f"L{layer}H{head}" for layer, head in heads),
                         **interval("clean_logit_diff", clean["logit_diff"]),
                         **interval("effect_logit_diff", removed["logit_diff"] - clean["logit_diff"]),
                         **interval("clean_p_io", clean["p_io"]),
                         **interval("effect_p_io", removed["p_io"] - clean["p_io"]),
                         **interval("kl_clean_ablated", removed["kl"])})
    return pd.DataFrame(rows)


def table_text(found: pd.DataFrame) -> str:
    """``sensitivity``'s frame as a Markdown table, each measure "mean [low, high]"."""
    shown = found[["split_seed", "corruption", "prompts", "writers"]].copy()
    for column in COLUMNS:
        shown[column] = [f"{v:+.3g} [{lo:+.3g}, {hi:+.3g}]" for v, lo, hi in
                         zip(found[column], found[f"{column}_ci_low"], found[f"{column}_ci_high"])]
    return shown.to_markdown(index=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="a model spec interp.load_model takes (toy: the embedded one)")
    parser.add_argument("--n", type=int, default=200, help="IOI prompts (ioi_task, seed 0)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="the split seeds (task_split)")
    parser.add_argument("--top", type=int, default=5, help="the writers removed: the top heads by DLA on selection")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_grad_enabled(False)
    model = interp.load_model(args.model).eval()
    task = ioi_task(model, n=args.n, seed=0)
    print(f"IOI on {args.model}: {len(task)} prompts ({task.dropped} dropped); split seeds {args.seeds}; the top "
          f"{args.top} writers by DLA on each seed's selection prompts removed on its measurement prompts")
    print(table_text(sensitivity(model, task, args.seeds, args.top)))


if __name__ == "__main__":
    main()
