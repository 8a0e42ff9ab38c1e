"""SmolLM2's head roles with and without the start token (issue 44.6; docs/guides/smollm2.md, "The
input format").

SmolLM2's GGUF file says ``tokenizer.ggml.add_bos_token = False``: llama.cpp and Hugging Face hand
the model its text with no ``<|im_start|>`` (its BOS, id 1) in front, and that is what
``load_model("smollm2")`` now does. This script scores every head's roles (``classify_heads``, the
same 16 probes of 64 tokens, seed 0, as the other SmolLM2 scripts) both ways: the model's own
format (no start token) and with the start token prepended, as interp did before. For each role it
prints the Spearman rank correlation of the 270 heads' scores between the two, and the top 5 heads
each way. Then, both ways: the five strongest induction heads' (by the scores without the start
token) mean-aligned ablation effect on the copy loss, and IOI's logit difference on 100 prompts,
each with its 95% interval over prompts, and each's difference with minus without the start token
on the same prompts, with the interval of that paired difference (``paired_difference``: both
settings resampled with the same draws of prompts).

    OMP_NUM_THREADS=1 python examples/smollm2/start_token.py
"""

from __future__ import annotations

import pandas as pd
import torch

from analyses import classify_heads, loss_metric
from analyses.core.execution import executing
from analyses.core.stats import bootstrap_ratio, paired_difference
from analyses.interventions.ablation import prepare_ablation
from analyses.tasks.task import ioi_task, task_batch
from analyses.roles.classify import ROLES
from interp.tokenizer import set_start_token, start_token_setting
from setup_smollm2 import N_PROMPTS, SEQ_LEN, head_name, load, probes

TOP = 5


def scores(model, prepend: bool) -> pd.DataFrame:
    """(layer, head) x role: the role scores on the probes with or without the start token."""
    set_start_token(model, prepend, "command line")
    frame = classify_heads(model, probes=probes(model), n_boot=100, progress=False)
    return frame[frame.measure.isin(ROLES)].pivot_table(index=["layer", "head"], columns="measure", values="score")


def main() -> None:
    model = load()
    own = start_token_setting(model)
    print(f"SmolLM2 as loaded: prepend_bos={own[0]} (source: {own[1]}); {N_PROMPTS} probes of {SEQ_LEN} tokens")
    without, with_bos = scores(model, False), scores(model, True)
    print(f"{'role':16} {'Spearman':>8}  top {TOP} without start token | top {TOP} with it")
    for role in ROLES:
        rho = without[role].corr(with_bos[role], method="spearman")
        tops = [", ".join(f"{head_name(l, h)} {s:.2f}" for (l, h), s in frame[role].nlargest(TOP).items())
                for frame in (without, with_bos)]
        print(f"{role:16} {rho:8.3f}  {tops[0]} | {tops[1]}")
    induction = [(int(l), int(h)) for l, h in without["induction"].nlargest(TOP).index]
    effects, logit_diffs = {}, {}
    for prepend in (False, True):
        set_start_token(model, prepend, "command line")
        effects[prepend], logit_diffs[prepend] = induction_effect(model, induction), ioi_difference(model)
        print(f"prepend_bos={prepend}: {effects[prepend][0]}; {logit_diffs[prepend][0]}")
    (_, with_sums, with_counts), (_, without_sums, without_counts) = effects[True], effects[False]
    effect = paired_difference(with_sums, with_counts, without_sums, without_counts)
    ones = torch.ones(len(logit_diffs[True][1]), dtype=torch.float64)
    logit_diff = paired_difference(logit_diffs[True][1], ones, logit_diffs[False][1], ones)
    print("with minus without the start token, on the same prompts (the 95% interval of the paired difference): "
          f"ablation effect {interval_text(*effect)} nats, IOI logit difference {interval_text(*logit_diff)}")


def interval_text(value, low, high) -> str:
    return f"{float(value):+.2f} [{float(low):+.2f}, {float(high):+.2f}]"


def induction_effect(model, heads) -> tuple[str, torch.Tensor, torch.Tensor]:
    """The heads' mean-aligned ablation effect on the copy loss of the probes, with its interval ->
    (that in words, each probe's effect numerator (batch,) float64, its count of copied tokens (batch,))."""
    test = probes(model)
    ablation = prepare_ablation(model, test, "mean_aligned", loss_metric(test.tokens, positions=test.predictable))
    with executing(progress=False):
        scores = ablation.scores([heads])
    low, high, n = ablation.intervals(scores)
    effect = float(scores.values[0]) - ablation.baseline
    baseline = ablation.baseline_scores()
    return (f"ablating {'+'.join(head_name(*h) for h in heads)} (mean_aligned) raises the copy loss "
            f"{ablation.baseline:.2f} by {effect:+.2f} [{float(low[0]):+.2f}, {float(high[0]):+.2f}] nats ({n} probes)",
            (scores.numerators[0] - baseline.numerators).double().cpu(), baseline.counts.double().cpu())


def ioi_difference(model, n: int = 100) -> tuple[str, torch.Tensor]:
    """IOI's logit difference on ``n`` prompts, with its interval over prompts -> (that in words, each
    prompt's logit difference (n,) float64)."""
    task = ioi_task(model, n=n, seed=0)
    batch = task_batch(model, task)
    with torch.no_grad():
        logits = model(batch.clean)
    final = logits[torch.arange(n), batch.last]
    diffs = final[torch.arange(n), [a[0] for a in task.answers]] - final[torch.arange(n), [d[0] for d in task.distractors]]
    mean, low, high = (float(v) for v in bootstrap_ratio(diffs.double(), torch.ones(n)))
    return f"IOI logit difference {mean:.2f} [{low:.2f}, {high:.2f}] ({n} prompts)", diffs.double().cpu()


if __name__ == "__main__":
    main()
