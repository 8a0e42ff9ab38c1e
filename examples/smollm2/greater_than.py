"""Greater-than on SmolLM2 (Hanna et al. 2023): "The war lasted from the year 1759 to the year 17".

SmolLM2's tokenizer writes every digit as a token of its own, so no two-digit year is one token and
``analyses.tasks.task.greater_than_task`` falls back to the decade digit: the prompt's start year is
17D9 and the answer is the next token, a digit; the answers are the digits > D, the distractors
the digits <= D, the metric the probability difference sum p(> D) - sum p(<= D) at the last token.
The corruption is the start year 1709 (the same tokens, decade 0).

First, Hanna et al.'s two measures on ``MEASURE_PROMPTS`` prompts, each a mean over prompts with its
95% bootstrap interval (``analyses.tasks.task.task_measure_intervals``): the probability difference
and the cutoff sharpness p(D + 1) - p(D - 1), the decades either side of the start decade.

Heads and MLPs are ranked on the first half of the prompts (direct logit attribution, one forward)
and tested on the second half (activation patching of every head and MLP; mean ablation of the top
ranked, against as many random heads), so none is chosen on the prompts that test it.

    python examples/smollm2/greater_than.py
"""

from __future__ import annotations

import torch

from analyses import matched_random_sets, patch_heads
from analyses.interventions.ablation import MLP, prepare_ablation
from analyses.interventions.patching import patch_mlps
from analyses.report.task_page import task_dla
from analyses.tasks.task import greater_than_task, task_batch, task_measure_intervals, task_metric, task_split
from setup_smollm2 import head_name, load

N_PROMPTS = 48
MEASURE_PROMPTS = 100
TOP = 5
N_DRAWS = 10


def digit_ids(task) -> torch.Tensor:
    """(10,) the token ids of the digits 0-9: a prompt's distractors (digits <= D) then its answers
    (digits > D), each in digit order."""
    ids = torch.tensor([*task.distractors[0], *task.answers[0]])
    assert len(set(ids.tolist())) == 10, "each digit must be one token"
    return ids


def decades(task) -> torch.Tensor:
    """(n,) each prompt's start decade D (the third digit of its start year 17D9)."""
    return torch.tensor([int(prompt.split(" 17")[1][0]) for prompt in task.clean])


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


def by_offset(probs: torch.Tensor, decade: torch.Tensor, offsets=range(-3, 4)) -> dict[int, float]:
    """Mean p(digit D + k) over the prompts where D + k is a digit: the shape of Hanna et al.'s curve."""
    out = {}
    for k in offsets:
        rows = ((decade + k) >= 0) & ((decade + k) <= 9)
        out[k] = probs[rows, (decade + k)[rows]].mean().item()
    return out


def ranked(frame, kind: str) -> list[tuple[tuple[int, int] | int, float]]:
    rows = frame[frame["kind"] == kind].sort_values("dla", ascending=False)
    if kind == "head":
        return [((int(l), int(h)), float(v)) for l, h, v in zip(rows["layer"], rows["head"], rows["dla"])]
    return [(int(l), float(v)) for l, v in zip(rows["layer"], rows["dla"])]


def mean_ablated(model, tokens, components, metric):
    """The metric with ``components`` (heads and MLPs) mean-ablated together, and the ablation (for more runs)."""
    ablation = prepare_ablation(model, tokens, "mean", metric, mlps=any(isinstance(c, MLP) for c in components))
    return ablation.run([components], progress=False)[0].item(), ablation


def hanna_measures(model) -> None:
    """Print Hanna et al.'s probability difference and cutoff sharpness on ``MEASURE_PROMPTS`` prompts,
    clean and corrupted, each with its 95% interval over prompts."""
    task = greater_than_task(model, n=MEASURE_PROMPTS, seed=0)
    frame = task_measure_intervals(model, task, task_batch(model, task), seed=0)
    print(f"Hanna et al.'s measures on {len(task)} prompts (mean [95% bootstrap interval over prompts]):")
    for row in frame.itertuples():
        print(f"  {row.run:9s} {row.measure:16s} {row.value:+.3f} [{row.ci_low:+.3f}, {row.ci_high:+.3f}]")


def main() -> None:
    torch.set_num_threads(1)
    model = load()
    hanna_measures(model)
    task = greater_than_task(model, n=N_PROMPTS, seed=0)
    print(f"greater-than, {len(task)} prompts: {task.note}")
    print("e.g.", repr(task.clean[0]), "| corrupted", repr(task.corrupted[0]))
    digits = digit_ids(task)
    batch = task_batch(model, task)
    decade = decades(task)
    probs = digit_probs(model, batch.clean, batch.last, digits)
    corrupted = digit_probs(model, batch.corrupted, batch.last, digits)
    diff = prob_diff(probs, decade)
    print(f"clean: prob diff {diff.mean():.3f} (per prompt {diff.min():.3f} to {diff.max():.3f}); "
          f"p(digit > D) {(diff.mean() + probs.sum(-1).mean()) / 2:.3f}; mass on the ten digits "
          f"{probs.sum(-1).mean():.3f}; top digit > D on {(probs.argmax(-1) > decade).float().mean():.0%} of prompts")
    print(f"corrupted (start year 1709): prob diff {prob_diff(corrupted, decade).mean():.3f}")
    print("mean p(digit D+k) by k:", ", ".join(f"{k:+d}: {v:.3f}" for k, v in by_offset(probs, decade).items()))

    split = task_split(task, seed=0)
    choose, test = task.subset(split.selection), task.subset(split.measurement)
    dla = task_dla(model, choose, task_batch(model, choose))
    heads, mlps = ranked(dla, "head"), ranked(dla, "mlp")
    print(f"direct logit attribution on the first {len(choose)} prompts (onto mean logit of > D minus <= D):")
    print("  heads for:", ", ".join(f"{head_name(*h)} {v:+.2f}" for h, v in heads[:TOP]))
    print("  heads against:", ", ".join(f"{head_name(*h)} {v:+.2f}" for h, v in heads[::-1][:3]))
    print("  MLPs for:", ", ".join(f"MLP{l} {v:+.2f}" for l, v in mlps[:TOP]))

    test_batch = task_batch(model, test)
    metric = task_metric(test, test_batch.last)
    with torch.no_grad():
        clean_value, corrupted_value = (metric(model(t)).item() for t in (test_batch.clean, test_batch.corrupted))
    head_gain = (patch_heads(model, test_batch.clean, test_batch.corrupted, metric, progress=False) - corrupted_value)
    mlp_gain = (patch_mlps(model, test_batch.clean, test_batch.corrupted, metric, progress=False) - corrupted_value)
    gap = clean_value - corrupted_value
    n_heads = model.cfg.n_heads
    order = head_gain.flatten().argsort(descending=True)[:TOP].tolist()
    print(f"patching on the other {len(test)} prompts (clean output into the corrupted run; prob diff corrupted "
          f"{corrupted_value:.3f}, clean {clean_value:.3f}):")
    print("  heads:", ", ".join(f"{head_name(i // n_heads, i % n_heads)} {head_gain.flatten()[i]:+.3f} "
                                f"({head_gain.flatten()[i] / gap:.0%})" for i in order))
    print("  MLPs:", ", ".join(f"MLP{l} {mlp_gain.flatten()[l]:+.3f} ({mlp_gain.flatten()[l] / gap:.0%})"
                               for l in mlp_gain.flatten().argsort(descending=True)[:TOP].tolist()))

    top_heads = [h for h, _ in heads[:TOP]]
    top_mlps = [MLP(l) for l, _ in mlps[:TOP]]
    value, ablation = mean_ablated(model, test_batch.clean, top_heads, metric)
    controls = ablation.run(matched_random_sets(model, top_heads, n_draws=N_DRAWS), progress=False) - ablation.baseline
    base = ablation.baseline
    print(f"mean-ablating the top {TOP} DLA heads on the other {len(test)} prompts: prob diff {base:.3f} -> {value:.3f} "
          f"({(base - value) / base:.0%} lower); {TOP} random heads: {controls.mean():+.3f} "
          f"(sd {controls.std():.3f}, min {controls.min():+.3f}) over {N_DRAWS} draws")
    value, _ = mean_ablated(model, test_batch.clean, top_mlps, metric)
    print(f"mean-ablating the top {TOP} DLA MLPs ({', '.join(f'MLP{m.layer}' for m in top_mlps)}): prob diff "
          f"{base:.3f} -> {value:.3f} ({(base - value) / base:.0%} lower)")
    value, _ = mean_ablated(model, test_batch.clean, top_heads + top_mlps, metric)
    print(f"both together: {base:.3f} -> {value:.3f} ({(base - value) / base:.0%} lower)")
    patched_top = divmod(order[0], n_heads)
    ablated_elsewhere(model, choose, patched_top)


def ablated_elsewhere(model, choose, head: tuple[int, int]) -> None:
    """The head that patching ranked first (on the second half), mean-ablated on the first half,
    against single random heads."""
    batch = task_batch(model, choose)
    metric = task_metric(choose, batch.last)
    value, ablation = mean_ablated(model, batch.clean, [head], metric)
    controls = ablation.run(matched_random_sets(model, [head], n_draws=N_DRAWS), progress=False) - ablation.baseline
    base = ablation.baseline
    print(f"mean-ablating {head_name(*head)} (patching's first) on the first {len(choose)} prompts: prob diff "
          f"{base:.3f} -> {value:.3f} ({(base - value) / base:.0%} lower); one random head: {controls.mean():+.3f} "
          f"(min {controls.min():+.3f}) over {N_DRAWS} draws")


if __name__ == "__main__":
    main()
