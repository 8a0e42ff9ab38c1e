"""Indirect-object identification on SmolLM2: accuracy, logit difference, the heads that write the
answer (direct logit attribution), and two interventions on them (ablation, activation patching).

Prompts: ``analyses.tasks.task.ioi_task`` (ABBA and BABA; the corruption puts three other names in
the same template). Metric: logit(indirect object) - logit(subject) at the last token, mean over
prompts. The writers are ranked on the first half of the prompts and ablated (and every head
patched) on the second half, so no head is chosen on the prompts that test it.

    python examples/smollm2/ioi.py
"""

from __future__ import annotations

import torch

from analyses import logit_diff_metric, patch_heads
from analyses.interventions.ablation import prepare_ablation
from analyses.core.tokens import model_tokenizer
from analyses.report.task_page import task_dla
from analyses.tasks.task import ioi_task, task_batch, task_metric
from setup_smollm2 import head_name, load

N_PROMPTS = 32
TOP = 5


def per_prompt_logit_diff(model, task, batch) -> torch.Tensor:
    """(n,) logit(answer) - logit(distractor) at each prompt's last real token; and accuracy is
    whether the answer's logit is the higher of the two."""
    with torch.no_grad():
        logits = model(batch.clean)
    final = logits[torch.arange(len(task)), batch.last]
    answer = torch.tensor([a[0] for a in task.answers])
    subject = torch.tensor([d[0] for d in task.distractors])
    return final.gather(1, answer[:, None])[:, 0] - final.gather(1, subject[:, None])[:, 0]


def head_writers(model, task) -> list[tuple[tuple[int, int], float]]:
    """Heads by their mean direct contribution to the logit difference, most positive first."""
    dla = task_dla(model, task, task_batch(model, task))
    heads = dla[dla["kind"] == "head"].sort_values("dla", ascending=False)
    return [((int(l), int(h)), float(v)) for l, h, v in zip(heads["layer"], heads["head"], heads["dla"])]


def halves(task):
    half = len(task) // 2
    rest = type(task)(task.name, task.clean[half:], task.corrupted[half:], task.answers[half:],
                      task.distractors[half:], task.metric)
    return task.take(half), rest


def main() -> None:
    model = load()
    task = ioi_task(model, n=N_PROMPTS, seed=0)
    batch = task_batch(model, task)
    diffs = per_prompt_logit_diff(model, task, batch)
    print(f"IOI, {len(task)} prompts ({task.dropped} names/prompts dropped): accuracy {(diffs > 0).float().mean():.0%}, "
          f"logit difference {diffs.mean():.2f} (min {diffs.min():.2f}, max {diffs.max():.2f})")
    print("e.g.", repr(task.clean[0]), "->", repr(model_tokenizer(model).decode([task.answers[0][0]])))

    choose, test = halves(task)
    writers = head_writers(model, choose)
    print("top positive direct writers:", ", ".join(f"{head_name(*h)} {v:+.2f}" for h, v in writers[:TOP]))
    print("top negative direct writers:", ", ".join(f"{head_name(*h)} {v:+.2f}" for h, v in writers[::-1][:TOP]))
    all_heads = sum(v for _, v in writers)
    print(f"all heads' direct writes sum to {all_heads:+.2f}; the top {TOP} positive give "
          f"{sum(v for _, v in writers[:TOP]):+.2f}")

    # texts of unequal token lengths: the ablation pads them, binds each prompt's own last position to
    # the metric, and keeps the padding out of the mean replacement
    metric = logit_diff_metric([a[0] for a in test.answers], [d[0] for d in test.distractors])
    top = [h for h, _ in writers[:TOP]]
    for method in ("mean", "zero"):
        ablation = prepare_ablation(model, list(test.clean), method, metric)
        value = ablation.run([top], progress=False)[0].item()
        base = ablation.baseline
        print(f"{method}-ablating the top {TOP} writers on the other {len(test)} prompts: logit difference "
              f"{base:.2f} -> {value:.2f} ({(base - value) / base:.0%} lower)")

    test_batch = task_batch(model, test)
    test_metric = task_metric(test, test_batch.last)
    patched = patch_heads(model, test_batch.clean, test_batch.corrupted, test_metric, progress=False)
    with torch.no_grad():
        corrupted, clean = (test_metric(model(tokens)).item() for tokens in (test_batch.corrupted, test_batch.clean))
    gain = (patched - corrupted).flatten()
    order = gain.argsort(descending=True)[:TOP].tolist()
    n_heads = model.cfg.n_heads
    print(f"head patching on those {len(test)} prompts (each head's clean output into the corrupted run; "
          f"logit difference corrupted {corrupted:.2f}, clean {clean:.2f}):")
    print("  largest gains:", ", ".join(f"{head_name(i // n_heads, i % n_heads)} {gain[i]:+.2f}" for i in order))
    lowest = gain.argsort()[:3].tolist()
    print("  largest losses:", ", ".join(f"{head_name(i // n_heads, i % n_heads)} {gain[i]:+.2f}" for i in lowest))


if __name__ == "__main__":
    main()
