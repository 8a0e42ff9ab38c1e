"""Tasks as data (architecture §4.9): clean prompts, corrupted prompts, answer and distractor tokens, a metric.

A ``Task`` is made for one tokenizer: its answers and distractors are token ids, each the one token
that continues its prompt. The built-in generators work for any tokenizer and keep only the words
that are a single token there, saying how many they dropped (``Task.dropped``):

- ``ioi_task``: indirect-object identification (Wang et al. 2022), "When Mary and John went to the
  store, John gave a drink to" -> " Mary" (the indirect object) against " John" (the subject), in
  ABBA and BABA orders; the corruption is ABC (three other, distinct names: no name repeats);
- ``greater_than_task`` (Hanna et al. 2023): "The war lasted from the year 1732 to the year 17" ->
  any two-digit YY > 32 against YY <= 32, with the probability-difference metric
  ``sum p(YY > 32) - sum p(YY <= 32)``; the corruption is the start year 1701. Its cutoff sharpness
  (``cutoff_scores``) is Hanna et al.'s p(YY + 1) - p(YY - 1): p(33) - p(31) here;
- ``induction_text_task``: a natural sentence and its repeat, cut mid-way, predicting the next
  word's first token; the corruption shuffles the words of the first copy, so nothing can be
  copied from it;
- ``brackets_task`` / ``identifier_task`` (code): predict the type of the bracket that closes an
  open one; recall the rest of a name defined earlier (an identifier used again);
- ``load_task``: a JSONL or CSV file of rows with ``clean``, ``corrupted``, ``answer`` and
  ``distractor`` (several answers or distractors joined by ``|`` in CSV, lists in JSONL), each the
  exact text that continues the prompt (" Mary", with its space, for GPT-2's tokenizer).

Where the tokenizer gives a word's leading space a token of its own (bytes), the space moves to the
end of the prompt and the word itself must be one token; a byte tokenizer therefore keeps no
multi-letter name, and ``ioi_task`` falls back to single capital letters (said in ``Task.note``),
``greater_than_task`` to the decade digit (start year 17D9; end decade > D against <= D: see its
docstring for what is then measured).

Metrics (``task_metric``) read each prompt's last real token, so prompts of different token
lengths share one right-padded batch; clean and corrupted prompts of one pair must have equal
token lengths (refused otherwise). ``"logit_diff"``: mean over prompts of (mean logit of the
answers - mean logit of the distractors); ``"prob_diff"``: mean over prompts of (sum of the answers'
probabilities - sum of the distractors'). ``task_measures`` adds a task's other measures (the cutoff
sharpness of one with ``cutoffs``) and ``measure_intervals`` gives each with its 95% interval over
prompts. ``chat_task`` gives every prompt as a user's message in the model's chat template.
"""

from __future__ import annotations

import csv
import io
import itertools
import json
import random
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Hashable, NamedTuple, Sequence

import pandas as pd
import torch

from analyses.core.metrics import Metric, PromptMeanMetric, PromptScores, prompt_scores
from analyses.core.splits import DEFAULT_SELECTION_SHARE, PromptSplit, check_split, split_prompts
from analyses.core.stats import (bootstrap_cluster_ratio, bootstrap_ratio, check_interval_prompts, effect_text,
                                 paired_difference)
from analyses.core.tokens import chat_texts, encode, model_tokenizer, read_text
from analyses.interventions.ablation import METHODS as ABLATION_METHODS, PAIRED_METHODS, CorruptedReference
from analyses.interventions.run import Run
from interp.errors import UserError
from interp.tokenizer import Tokenizer

METRICS = ("logit_diff", "prob_diff")
GAP = "clean - corrupted"  # the run of task_measure_intervals' paired-difference rows
BUILT_IN = ("ioi", "greater-than", "induction-text", "brackets", "identifier")

# Wang et al. 2022's templates are of this kind: two names introduced, one of them (the subject)
# named again, who gives something to the other (the indirect object). Written for this module.
IOI_TEMPLATES = (
    "When [A] and [B] went to the store, [B] gave a drink to",
    "When [A] and [B] went to the park, [B] handed a ball to",
    "After [A] and [B] arrived at the office, [B] sent a letter to",
    "While [A] and [B] were working at the school, [B] gave a book to",
    "Then, [A] and [B] had a long argument, and afterwards [B] said to",
    "When [A] and [B] got a snack at the cafe, [B] offered a bite to",
    "Friends [A] and [B] found a ring at the beach. [B] gave it to",
    "After the lunch, [A] and [B] went to the garden. [B] gave a flower to",
    "Then, [A] and [B] were thinking about going to the house. [B] wanted to give a key to",
    "The local big hospital had [A] and [B] as nurses. [B] passed a note to",
    "After [A] and [B] went to the station, [B] gave a ticket to",
    "When [A] and [B] started a game at the club, [B] threw the dice to",
    "Then, [A] and [B] had a lot of fun at the restaurant. [B] gave a bill to",
    "While [A] and [B] were commuting to the hospital, [B] gave a coat to",
    "After [A] and [B] met at the market, [B] sold a basket to",
)
# First names (a subset of the common English names such studies draw from).
NAMES = (
    "Mary", "John", "Alice", "Bob", "Tom", "James", "Sarah", "David", "Michael", "Anna", "Paul", "Laura",
    "Daniel", "Emma", "Kevin", "Rachel", "Brian", "Lisa", "Mark", "Jessica", "Peter", "Karen", "Eric",
    "Amy", "Steven", "Kate", "Ryan", "Helen", "Jason", "Grace", "Adam", "Julia", "Scott", "Rose", "Sam",
    "Jane", "Luke", "Anne", "Ben", "Claire",
)
LETTER_NAMES = tuple("ABCDEFGHJKLMNPRSTW")  # the fallback for tokenizers that keep no multi-letter name
GT_NOUNS = ("war", "dynasty", "siege", "drought", "strike", "expedition", "reign", "famine", "journey",
            "crisis", "empire", "festival", "voyage", "truce", "partnership")
GT_CENTURY = "17"
# Natural sentences written for this module (induction on text needs words that recur only by copying).
SENTENCES = (
    "The old lighthouse keeper painted every window of the tower bright green last spring",
    "A small brown dog followed the children all the way home from the crowded market",
    "Our neighbour grows tomatoes and tall sunflowers along the fence behind her garage",
    "The orchestra rehearsed the second movement slowly until the violins finally agreed",
    "Heavy rain flooded the narrow road near the bridge so the buses took another route",
    "My grandfather kept a wooden box of letters from sailors he had met in foreign ports",
    "The museum closed its western wing while engineers repaired the cracked glass ceiling",
    "Every morning the baker sells warm bread and honey cakes before the town wakes up",
    "Two students built a tiny weather station and measured the wind on the school roof",
    "The committee postponed the vote because half of its members were stuck at the airport",
    "She learned to play chess from a patient stranger who sat by the fountain each evening",
    "Farmers in the valley harvest apples in autumn and press most of them into cider",
    "The detective noticed muddy footprints leading from the kitchen door to the cellar",
    "A quiet library on the hill lends maps, telescopes and board games to its visitors",
    "During the storm the cat hid under the piano and refused to come out for dinner",
    "The young pilot circled the island twice before landing on the short grassy strip",
)


@dataclass(frozen=True)
class Task:
    """A task on one tokenizer.

    clean / corrupted: prompts (n,), pair i of equal token length; answers / distractors: per prompt,
    the token ids (one or more) that count for / against the behaviour at the prompt's last token;
    metric: one of ``METRICS``; dropped: candidate words (or prompts) a generator left out because
    the tokenizer does not keep them as single tokens (or a pair's token lengths differed); note:
    what the generator changed for this tokenizer, if anything; templates: per pair, the template
    its clean and corrupted prompts were made from (an int), where the generator has templates
    (``ioi``: the sentence; ``greater-than``: the noun; ``brackets``: the line; ``identifier``: the
    name's prefix), else empty. Prompts of one template put the same kinds of token at the same
    positions: the split is stratified by template and ``mean_corrupted`` ablation averages within one.
    cutoffs: per pair, (the token just above the cutoff, the token just below it) where the task has a
    cutoff (``greater-than``: the years YY + 1 and YY - 1, or the decades D + 1 and D - 1), for the
    cutoff sharpness (``cutoff_scores``), else empty.
    clusters: per pair, the cluster of near-copies its clean prompt belongs to (any hashable label),
    where the generator makes prompts that differ only in what the behaviour does not depend on
    (``greater-than``: one start year under several nouns), else empty: ``task_split`` keeps a
    cluster on one side and the intervals over prompts resample clusters. A built-in task's clean
    prompts are distinct.
    """

    name: str
    clean: tuple[str, ...]
    corrupted: tuple[str, ...]
    answers: tuple[tuple[int, ...], ...]
    distractors: tuple[tuple[int, ...], ...]
    metric: str = "logit_diff"
    dropped: int = 0
    note: str = ""
    templates: tuple[int, ...] = ()
    cutoffs: tuple[tuple[int, int], ...] = ()
    clusters: tuple = ()

    def __post_init__(self):
        if self.metric not in METRICS:
            raise UserError(f"unknown task metric {self.metric!r}; allowed: {', '.join(METRICS)}")
        n = len(self.clean)
        if n == 0:
            raise UserError(f"task {self.name!r} has no prompt")
        if not len(self.corrupted) == len(self.answers) == len(self.distractors) == n:
            raise UserError(f"task {self.name!r}: {n} clean prompts but {len(self.corrupted)} corrupted, "
                            f"{len(self.answers)} answer sets and {len(self.distractors)} distractor sets")
        if self.templates and len(self.templates) != n:
            raise UserError(f"task {self.name!r}: {n} prompts but {len(self.templates)} template labels")
        if self.cutoffs and len(self.cutoffs) != n:
            raise UserError(f"task {self.name!r}: {n} prompts but {len(self.cutoffs)} cutoffs")
        if self.clusters and len(self.clusters) != n:
            raise UserError(f"task {self.name!r}: {n} prompts but {len(self.clusters)} cluster labels")
        for i, (good, bad) in enumerate(zip(self.answers, self.distractors)):
            if not good or not bad:
                raise UserError(f"task {self.name!r}, prompt {i}: needs at least one answer and one distractor")

    def __len__(self) -> int:
        return len(self.clean)

    def take(self, n: int) -> "Task":
        """The first ``n`` prompts."""
        if n <= 0:
            raise UserError(f"a task needs at least one prompt, got n={n}")
        return self.subset(range(min(n, len(self))))

    def subset(self, indices: Sequence[int]) -> "Task":
        """The prompts ``indices`` (in that order), with their answers, distractors, templates, cutoffs
        and clusters."""
        indices = [int(i) for i in indices]
        fields = ("clean", "corrupted", "answers", "distractors",
                  *(name for name in ("templates", "cutoffs", "clusters") if getattr(self, name)))
        return replace(self, **{name: tuple(getattr(self, name)[i] for i in indices) for name in fields})


@dataclass
class TaskBatch:
    """A task tokenised for one model: clean / corrupted (batch, pos) ids, right-padded alike;
    last (batch,) each prompt's last real position (where its metric reads the logits)."""

    clean: torch.Tensor
    corrupted: torch.Tensor
    last: torch.Tensor


def task_batch(model, task: Task) -> TaskBatch:
    """The task's prompts as tokens for ``model``, a ``TaskBatch`` value; a pair whose clean and corrupted prompts
    tokenise to different lengths is refused in one line naming it."""
    clean, corrupted = encode(model, list(task.clean)), encode(model, list(task.corrupted))
    for i, (a, b) in enumerate(zip(clean.lengths.tolist(), corrupted.lengths.tolist())):
        if a != b:
            raise UserError(f"task {task.name!r}, prompt {i}: the clean prompt is {a} tokens but the corrupted "
                            f"one is {b}; they must have equal token lengths")
    vocab = model.cfg.d_vocab
    for ids in [*task.answers, *task.distractors]:
        if not all(0 <= t < vocab for t in ids):
            raise UserError(f"task {task.name!r}: answer/distractor ids {list(ids)} out of the vocabulary [0, {vocab})")
    return TaskBatch(clean.tokens, corrupted.tokens, clean.lengths - 1)


def _padded(sets: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged id sets -> (ids (n, width), mask (n, width)), padded with id 0 masked out."""
    width = max(len(s) for s in sets)
    ids = torch.zeros(len(sets), width, dtype=torch.long)
    mask = torch.zeros(len(sets), width, dtype=torch.bool)
    for i, s in enumerate(sets):
        ids[i, : len(s)] = torch.tensor(list(s))
        mask[i, : len(s)] = True
    return ids, mask


def task_scores(task: Task, last: torch.Tensor):
    """The task's metric per prompt: logits (batch, pos, d_vocab) -> (batch,) float32, each read at
    ``last`` (batch,), the prompt's last real position (see the module docstring for the two kinds).
    Differentiable; ``task_metric`` is its mean."""
    good, good_mask = _padded(task.answers)
    bad, bad_mask = _padded(task.distractors)

    def scores(logits: torch.Tensor) -> torch.Tensor:
        rows = torch.arange(logits.shape[0], device=logits.device)
        final = logits[rows, last.to(logits.device)].float()  # (batch, d_vocab)
        if task.metric == "prob_diff":
            final = final.softmax(dim=-1)
        picked_good = final.gather(-1, good.to(final.device)) * good_mask.to(final.device)
        picked_bad = final.gather(-1, bad.to(final.device)) * bad_mask.to(final.device)
        if task.metric == "prob_diff":
            return picked_good.sum(-1) - picked_bad.sum(-1)
        return picked_good.sum(-1) / good_mask.sum(-1).to(final.device) - \
            picked_bad.sum(-1) / bad_mask.sum(-1).to(final.device)

    return scores


def cutoff_scores(task: Task, last: torch.Tensor):
    """Hanna et al. 2023's cutoff sharpness per prompt: logits (batch, pos, d_vocab) -> (batch,)
    float32, p(the token just above the prompt's cutoff) - p(the token just below it) (``Task.cutoffs``),
    each p a softmax over the whole vocabulary at ``last`` (batch,), the prompt's last real position.
    Refused in one line for a task without cutoffs."""
    if not task.cutoffs:
        raise UserError(f"task {task.name!r} has no cutoff; the cutoff sharpness is greater-than's")
    above, below = torch.tensor(task.cutoffs).T

    def scores(logits: torch.Tensor) -> torch.Tensor:
        rows = torch.arange(logits.shape[0], device=logits.device)
        probs = logits[rows, last.to(logits.device)].float().softmax(dim=-1)  # (batch, d_vocab)
        return probs[rows, above.to(logits.device)] - probs[rows, below.to(logits.device)]

    return scores


def task_metric(task: Task, last: torch.Tensor) -> Metric:
    """The task's metric: logits (batch, pos, d_vocab) -> scalar, the mean over prompts of
    ``task_scores`` (a ``PromptMeanMetric``). Differentiable; declares the positions it reads
    (``read_positions``) so interventions unembed only those, and splits over chunks of prompts
    (``analyses.core.metrics.Metric.part``: a part's mean weighted by its prompts, with its
    per-prompt form, so every effect on a task gets its interval over prompts), so an intervention
    holds a chunk of prompts at a time, not the whole batch."""
    return _mean_metric(task, last, task_scores)


def task_measures(task: Task, last: torch.Tensor) -> dict[str, Metric]:
    """The task's measures, each a metric as ``task_metric`` makes (a mean over prompts with its
    per-prompt form): its own metric (named ``task.metric``) and, for a task with cutoffs,
    ``"cutoff_sharpness"`` (``cutoff_scores``): Hanna et al. 2023's two for greater-than."""
    measures = {task.metric: task_metric(task, last)}
    return measures | ({"cutoff_sharpness": _mean_metric(task, last, cutoff_scores)} if task.cutoffs else {})


def interval_frame(scores: dict[str, PromptScores], seed: int = 0, clusters: Sequence | None = None) -> pd.DataFrame:
    """measure name -> its ``PromptScores`` on a batch (per-prompt numerators and counts) -> one row
    per measure: ``measure``, ``value`` (the mean over prompts), ``ci_low``, ``ci_high`` (the 95%
    percentile bootstrap over prompts, seeded: ``analyses.core.stats.bootstrap_ratio``; over the
    ``clusters``, one label per prompt, where given: ``bootstrap_cluster_ratio``), ``n_prompts``."""
    rows = []
    for name, found in scores.items():
        interval = (bootstrap_ratio(found.numerators, found.counts, seed=seed) if clusters is None else
                    bootstrap_cluster_ratio(found.numerators, found.counts, clusters, seed=seed))
        rows.append(_interval_row(name, interval, len(found.counts)))
    return pd.DataFrame(rows)


def paired_interval_frame(clean: dict[str, PromptScores], corrupted: dict[str, PromptScores], seed: int = 0,
                          clusters: Sequence | None = None) -> pd.DataFrame:
    """measure name -> its ``PromptScores`` on the clean and on the corrupted prompts (prompt i the
    same task item in both) -> ``interval_frame``'s rows for each measure's clean minus corrupted
    pooled mean, with the 95% interval of the difference (``analyses.core.stats.paired_difference``:
    both runs resampled with the same draws, over the ``clusters`` where given)."""
    return pd.DataFrame([_interval_row(name, paired_difference(clean[name].numerators, clean[name].counts,
                                                               corrupted[name].numerators, corrupted[name].counts,
                                                               clusters, seed=seed), len(clean[name].counts))
                         for name in clean])


def _interval_row(measure: str, interval: tuple[torch.Tensor, torch.Tensor, torch.Tensor], n_prompts: int) -> dict:
    """One row of ``interval_frame``: (value, ci_low, ci_high), each 0-d, as floats."""
    value, low, high = interval
    return {"measure": measure, "value": float(value), "ci_low": float(low), "ci_high": float(high),
            "n_prompts": n_prompts}


def measure_intervals(task: Task, last: torch.Tensor, logits: torch.Tensor, seed: int = 0) -> pd.DataFrame:
    """Each of ``task_measures`` on ``logits`` (batch, pos, d_vocab) of the task's prompts, read at
    ``last`` (batch,): ``interval_frame``'s rows (measure, value, ci_low, ci_high, n_prompts), over the
    task's clusters where it has them."""
    return interval_frame({name: prompt_scores(metric, logits) for name, metric in task_measures(task, last).items()},
                          seed, task.clusters or None)


def task_measure_intervals(model, task: Task, batch: TaskBatch, *, seed: int = 0) -> pd.DataFrame:
    """Each of ``task_measures`` on the task's clean and on its corrupted prompts (``batch``:
    ``task_batch``), the forwards in chunks within the current execution's memory
    (``analyses.interventions.run.Run``, ``analyses.core.execution``), and their paired difference (``run`` ``GAP``: ``paired_interval_frame``): ``interval_frame``'s
    rows (over the task's clusters where it has them), ``run`` ("clean", "corrupted", ``GAP``) first."""
    measures = task_measures(task, batch.last)
    scores = {}
    for name, tokens in (("clean", batch.clean), ("corrupted", batch.corrupted)):
        run = Run.make(model, tokens, measures[task.metric], starts=False)
        scores[name] = {measure: run.scores(metric) for measure, metric in measures.items()}
    clusters = task.clusters or None
    frame = pd.concat([*(interval_frame(found, seed, clusters).assign(run=name) for name, found in scores.items()),
                       paired_interval_frame(scores["clean"], scores["corrupted"], seed, clusters).assign(run=GAP)],
                      ignore_index=True)
    return frame[["run", *(column for column in frame.columns if column != "run")]]


@dataclass(frozen=True)
class Performance:
    """Whether the model performs a task: it does where the 95% paired interval of its metric's
    clean-minus-corrupted difference (``task_measure_intervals``' ``GAP`` row) lies wholly above 0,
    i.e. the clean prompts' information moves the metric toward the answers, beyond prompt noise.
    Where it does not, every patching effect, edge and control measured on the task is a
    difference between two runs the model does not tell apart: built on noise. ``metric``: the
    task's metric; ``clean``, ``gap``: (value, ci_low, ci_high); ``n_prompts``: the prompts it is over."""

    metric: str
    clean: tuple[float, float, float]
    gap: tuple[float, float, float]
    n_prompts: int

    @property
    def performs(self) -> bool:
        return self.gap[1] > 0

    @property
    def text(self) -> str:
        """One line: the verdict and the numbers it rests on."""
        gap = (f"clean - corrupted {self.metric} {effect_text(*self.gap)} (95% paired interval over "
               f"{self.n_prompts} prompts)")
        if self.performs:
            return f"The model performs the task: {gap} lies above 0."
        where = "lies below 0: the corrupted prompts score higher" if self.gap[2] < 0 else "contains 0"
        return (f"The model does not perform this task: {gap} {where} (clean {self.metric} "
                f"{effect_text(*self.clean)}); the patching effects, circuit and control measured on it are "
                "built on noise.")


def task_performance(measures: pd.DataFrame, metric: str) -> Performance:
    """The ``Performance`` read from ``task_measure_intervals``' frame ``measures`` for the metric ``metric``."""
    rows = measures[measures["measure"] == metric].set_index("run")
    clean, gap = (tuple(float(rows.at[run, column]) for column in ("value", "ci_low", "ci_high"))
                  for run in ("clean", GAP))
    return Performance(metric, clean, gap, int(rows.at[GAP, "n_prompts"]))


def answer_prob_scores(task: Task, last: torch.Tensor):
    """The probability of the answer per prompt: logits (batch, pos, d_vocab) -> (batch,) float32, the
    sum of the answers' probabilities (a softmax over the whole vocabulary) at ``last`` (batch,), the
    prompt's last real position; for IOI p(indirect object)."""
    good, good_mask = _padded(task.answers)

    def scores(logits: torch.Tensor) -> torch.Tensor:
        rows = torch.arange(logits.shape[0], device=logits.device)
        probs = logits[rows, last.to(logits.device)].float().softmax(dim=-1)  # (batch, d_vocab)
        return (probs.gather(-1, good.to(probs.device)) * good_mask.to(probs.device)).sum(-1)

    return scores


def answer_prob_metric(task: Task, last: torch.Tensor) -> Metric:
    """The mean over prompts of ``answer_prob_scores``, a metric as ``task_metric`` makes (read
    positions, parts, per-prompt form)."""
    return _mean_metric(task, last, answer_prob_scores)


def kl_metric(task: Task, last: torch.Tensor, reference: torch.Tensor) -> Metric:
    """The mean over prompts of KL(reference || run) of the next-token distribution at each prompt's
    last real position ``last`` (batch,), in nats: ``reference`` (batch, d_vocab) the reference run's
    logits there (e.g. the clean, unablated run's), the run's the logits the metric is given. A metric
    as ``task_metric`` makes (read positions, parts, per-prompt form); 0 on the reference's own logits."""
    if reference.shape[0] != len(task):
        raise UserError(f"kl_metric: {reference.shape[0]} reference rows for {len(task)} prompts")
    target = reference.detach().float().log_softmax(dim=-1)

    def scores_of(rows: slice, at: torch.Tensor):
        def scores(logits: torch.Tensor) -> torch.Tensor:
            batch = torch.arange(logits.shape[0], device=logits.device)
            run = logits[batch, at.to(logits.device)].float().log_softmax(dim=-1)
            wanted = target[rows].to(run.device)
            return (wanted.exp() * (wanted - run)).sum(-1)

        return scores

    return _rows_metric(last, scores_of)


def _mean_metric(task: Task, last: torch.Tensor, scorer) -> Metric:
    """The mean over prompts of ``scorer(task, last)`` (logits -> (batch,)) as a metric with its read
    positions and its parts (see ``task_metric``)."""
    return _rows_metric(last, lambda rows, at: scorer(task.subset(range(len(task))[rows]), at))


def _rows_metric(last: torch.Tensor, scores_of) -> Metric:
    """The mean over prompts of ``scores_of(rows, at)`` (the scores of the prompts ``rows``, a slice,
    read at positions ``at``: logits (rows, pos, d_vocab) -> (rows,)) as a metric with its read
    positions and its parts (see ``task_metric``)."""
    def part_scores(rows: slice, read: torch.Tensor | None):
        """The scores of the prompts ``rows`` alone, on logits (rows, pos or len(read), d_vocab)."""
        at = last[rows].cpu() if read is None else torch.searchsorted(read, last[rows].cpu())
        return scores_of(rows, at)

    return PromptMeanMetric(scores_of(slice(0, len(last)), last), torch.unique(last).cpu(), part_scores)


# ------------------------------------------------------------- selection apart from measurement
def check_task_prompts(n_prompts: int, split: bool, what: str, share: float = DEFAULT_SELECTION_SHARE) -> None:
    """Refuse, in one line, a task whose effects would be measured, with intervals over prompts, on
    fewer than ``analyses.core.stats.MIN_INTERVAL_PROMPTS`` prompts: those of its measurement split
    (``check_split``) where ``split``, else all ``n_prompts``. ``what``: where the count came from
    ("--n 3", "task 'ioi'")."""
    try:
        if split:
            check_split(n_prompts, share)
        else:
            check_interval_prompts(n_prompts, f"{n_prompts} prompt(s)")
    except UserError as error:
        raise UserError(f"{what}: {error}; give more prompts (--n)") from None


def task_split(task: Task, seed: int = 0, share: float = DEFAULT_SELECTION_SHARE) -> PromptSplit:
    """The task's prompts split into a selection (to choose heads on) and a disjoint measurement split
    (to report their effects on): ``split_prompts``, seeded, whole clusters of near-copies at a time
    where the task has clusters (no cluster, and so no prompt, on both sides), stratified by template
    where the task has templates and each cluster lies within one (where clusters cross templates, as
    greater-than's start years cross its nouns, a template may fall on one side). Too few prompts or
    clusters to measure on (``check_task_prompts``) and a template of a stratified split that would
    be missing from either side are refused in one line."""
    check_task_prompts(len(task), True, f"task {task.name!r}", share)
    clusters = task.clusters or None
    nested = clusters is None or all(len(set(group)) == 1 for group in _by_cluster(task.templates, clusters))
    strata = task.templates if task.templates and nested else None
    try:
        split = split_prompts(len(task), share, seed, strata=strata, clusters=clusters)
    except UserError as error:
        raise UserError(f"task {task.name!r}: {error}; give more prompts (--n)") from None
    if strata is None:
        return split
    chosen = set(split.selection.tolist())
    for template in dict.fromkeys(task.templates):
        members = [i for i, label in enumerate(task.templates) if label == template]
        inside = sum(i in chosen for i in members)
        if inside in (0, len(members)):
            raise UserError(f"task {task.name!r}: template {template} has {len(members)} prompt(s), so the "
                            f"{'selection' if inside == 0 else 'measurement'} split would hold none of it; give more "
                            "prompts (--n) or --no-split (choose and measure on the same prompts: in-sample)")
    return split


def _by_cluster(labels: Sequence, clusters: Sequence) -> list[list]:
    """``labels`` (one per prompt) grouped by the prompts' ``clusters``."""
    groups: dict = {}
    for label, cluster in zip(labels, clusters):
        groups.setdefault(cluster, []).append(label)
    return list(groups.values())


# ----------------------------------------------------------------------------- chat template
def chat_task(model, task: Task) -> Task:
    """``task`` with each prompt, clean and corrupted, given as the user's one message in the model's
    chat template with the assistant's turn opened after it (``analyses.core.tokens.chat_texts``;
    a one-line refusal where the model has none), so the metric reads the first token of the
    model's reply; the answers and distractors keep the ids they had after the bare prompts. Texts in a
    template are encoded without the start token unless told otherwise (``--chat`` sets that). A pair
    the template makes of unequal token lengths is refused in one line naming it."""
    clean, corrupted = chat_texts(model, task.clean), chat_texts(model, task.corrupted)
    tokenizer = model_tokenizer(model)
    for i, (good, bad) in enumerate(zip(clean, corrupted)):
        lengths = len(tokenizer.encode(good)), len(tokenizer.encode(bad))
        if lengths[0] != lengths[1]:
            raise UserError(f"task {task.name!r}, prompt {i}: in the chat template the clean prompt is {lengths[0]} "
                            f"tokens but the corrupted one {lengths[1]}, so the pair no longer lines up; drop --chat")
    said = ("each prompt given as the user's message in the model's chat template, the metric read at the reply's "
            "first token")
    return replace(task, clean=tuple(clean), corrupted=tuple(corrupted),
                   note="; ".join(filter(None, (task.note, said))))


# -------------------------------------------------------------------------------- ablation
TASK_ABLATIONS = (*PAIRED_METHODS, *(method for method in ABLATION_METHODS if method != "mean_aligned"))


def task_ablation(task: Task, batch: TaskBatch, method: str = "mean_corrupted") -> tuple[CorruptedReference | None, str]:
    """How a task's ablations replace a head's output -> (the ``reference`` ``prepare_ablation``
    takes, the replacement in words for a page and ``meta.json``). ``mean_corrupted`` (the default:
    Wang et al. 2022's ABC means) is the mean over the task's corrupted prompts of the same template,
    position by position (over all of them, by position, for a task without templates); ``zero`` and
    ``resample`` (another clean prompt's output) as ``prepare_ablation`` has them; plain ``mean`` (by
    absolute position over every other prompt) is refused in one line for a task of several
    templates, whose tokens at one position differ. ``batch``: the prompts ablated (their corrupted
    twins are the reference)."""
    if method not in TASK_ABLATIONS:
        raise UserError(f"unknown task ablation {method!r}; allowed: {', '.join(TASK_ABLATIONS)}")
    n_templates = len(set(task.templates))
    if method == "mean" and n_templates > 1:
        raise UserError(f"mean ablation averages each absolute position over prompts of {n_templates} templates, "
                        "whose tokens there differ; use mean_corrupted (each template's corrupted prompts' mean, "
                        "position by position, as Wang et al. 2022)")
    if method != "mean_corrupted":
        return None, {"zero": "zeros", "resample": "another clean prompt's output (seeded)",
                      "mean": "the mean over the other clean prompts at the same position (one template)"}[method]
    templates = task.templates or (0,) * len(task)
    where = (f"the mean over the corrupted prompts of the same template, position by position ({n_templates} "
             "templates; Wang et al. 2022's ABC means)" if task.templates else
             "the mean over the corrupted prompts at the same position (the task names no templates)")
    return CorruptedReference(batch.corrupted, templates), where


# ------------------------------------------------------------------------- the one token rule
def continuation(tokenizer: Tokenizer, prompt: str, word: str, sep: str = " ") -> tuple[str, list[int]] | None:
    """How ``word`` continues ``prompt`` after ``sep`` -> (the prompt to use, the word's tokens).

    The tokens are those that ``prompt + sep + word`` adds to ``prompt``'s. Where the first of them
    is the space alone (a byte tokenizer), the space moves to the prompt's end and the word's own
    tokens follow it. None where the prompt's tokens are not a prefix of the joined text's."""
    base, joined = tokenizer.encode(prompt), tokenizer.encode(prompt + sep + word)
    if joined[: len(base)] != base or len(joined) == len(base):
        return None
    added = joined[len(base):]
    if sep and not tokenizer.decode(added[:1]).strip():  # the separator is a token of its own
        return continuation(tokenizer, prompt + sep, word, "")
    return prompt, added


def single_token(tokenizer: Tokenizer, prompt: str, word: str, sep: str = " ") -> tuple[str, int] | None:
    """(prompt to use, the word's token id) where ``word`` continues ``prompt`` (after ``sep``) as
    one token; else None."""
    found = continuation(tokenizer, prompt, word, sep)
    return (found[0], found[1][0]) if found is not None and len(found[1]) == 1 else None


# ------------------------------------------------------------------------------- generators
def _fill(template: str, a: str, b: str, s: str) -> str:
    return template.replace("[A]", a).replace("[B]", b, 1).replace("[B]", s)


def ioi_task(model, n: int = 60, seed: int = 0, names: Sequence[str] = NAMES,
             templates: Sequence[str] = IOI_TEMPLATES) -> Task:
    """Indirect-object identification: ``n`` prompts, ABBA ("When A and B ..., B gave ... to" -> A)
    for one pass over the templates, BABA ("When B and A ..., B gave ... to" -> A) for the next, and
    so on (half each when every template fits the context); the metric logit(IO) - logit(S);
    corrupted: the same template with three other, distinct names (ABC). Names that are not one
    token after " to" are dropped (counted); if fewer than 5 remain, single capital letters are used.
    The clean prompts are distinct (a draw that repeats one is skipped and counted); more than the
    templates and name pairs can make is refused in one line."""
    tokenizer = model_tokenizer(model)
    probe = templates[0].split("[B]")[-1]  # a prompt ending as the templates do
    kept = {name: single_token(tokenizer, probe, name) for name in names}
    kept = [name for name, found in kept.items() if found is not None]
    dropped, note = len(names) - len(kept), ""
    if len(kept) < 5:
        letters = [name for name in LETTER_NAMES if single_token(tokenizer, probe, name) is not None]
        if len(letters) < 5:
            raise UserError(f"ioi: only {len(kept)} of {len(names)} names and {len(letters)} capital letters are "
                            "single tokens for this tokenizer; pass names= that are")
        note = f"none of the names is a single token for this tokenizer: single capital letters {''.join(letters)} stand in"
        kept = letters
    most = len(templates) * len(kept) * (len(kept) - 1)  # a template and an ordered (IO, S) pair each
    if n > most:
        raise UserError(f"ioi can make at most {most} distinct prompts for this tokenizer ({len(templates)} templates, "
                        f"{len(kept)} names); asked for {n}")
    rng = random.Random(seed)
    clean, corrupted, answers, distractors, used, skipped = [], [], [], [], [], 0
    for attempt in range(20 * n):
        if len(clean) == n:
            break
        template = templates[attempt % len(templates)]
        io, s, *others = rng.sample(kept, 5)
        first, second = (io, s) if (attempt // len(templates)) % 2 == 0 else (s, io)  # ABBA, then BABA
        prompt, bad = _fill(template, first, second, s), _fill(template, *others)
        answer, subject = single_token(tokenizer, prompt, io), single_token(tokenizer, prompt, s)
        if answer is None or subject is None or answer[0] != subject[0] or answer[0] in clean:
            skipped += 1  # not one token each, or a prompt already made
            continue
        shifted = answer[0] != prompt  # the space moved into the prompt
        bad = bad + " " if shifted else bad
        length = len(tokenizer.encode(answer[0]))
        if length != len(tokenizer.encode(bad)) or length >= model.cfg.n_ctx:  # the start token comes first
            skipped += 1
            continue
        clean.append(answer[0])
        corrupted.append(bad)
        answers.append((answer[1],))
        distractors.append((subject[1],))
        used.append(attempt % len(templates))
    if len(clean) < n:
        raise UserError(f"ioi: made only {len(clean)} of {n} prompts whose clean and corrupted token lengths match "
                        f"within the context n_ctx={model.cfg.n_ctx}")
    return Task("ioi", tuple(clean), tuple(corrupted), tuple(answers), tuple(distractors), "logit_diff",
                dropped + skipped, note, tuple(used))


def greater_than_task(model, n: int | None = None, seed: int = 0, nouns: Sequence[str] = GT_NOUNS) -> Task:
    """Greater-than (Hanna et al. 2023): "The NOUN lasted from the year 17YY to the year 17", ``n``
    (None: 60, or all there are if fewer) distinct prompts drawn (seeded, without replacement) from
    every noun and start year, the nouns in turn; the metric ``prob_diff`` at the last token: the probability of the next token(s) that make
    the end year later than the start year minus that of those that do not. Which token is measured
    depends on the tokenizer:

    - where the two-digit numbers are single tokens after "... to the year 17" (GPT-2's), YY is any of
      02..98 whose neighbours YY +- 1 are single tokens, the answers the tokens of every two-digit
      number > YY, the distractors every one <= YY (YY itself is not greater): Hanna et al.'s
      ``sum p(y > YY) - sum p(y <= YY)``; the corruption is the start year 1701;
    - else (a tokenizer that writes digits one by one, as SmolLM2's and Llama 2's do), the digit
      measured is the first at which a later end year can differ from the start year 17DY. For YY = D9
      (D in 1..8) that is the decade: the prompt ends "17", the answers are the digits E > D, the
      distractors E <= D (an end year 17E? is later exactly when E > D), the corruption 1709. For Y in
      1..8 (D in 0..9) the end year's decade is given, the prompt ends "17D", and the answers are the
      digits F > Y, the distractors F <= Y (17DF is later exactly when F > Y), the corruption 17D0. The
      second kind separates "later" from "the next decade", which for 17D9 are the same answer. The
      model is not asked for the digits after the one measured.

    ``Task.cutoffs``: per prompt, the tokens just above and just below the cutoff, (YY + 1, YY - 1),
    or the digits either side of the one compared, whose probability difference is Hanna et al.'s
    cutoff sharpness (``cutoff_scores``). ``Task.templates``: the noun. ``Task.clusters``: the start
    year; prompts of one start year differ only in the noun, so a split keeps a start year on one side.
    Prompts whose clean and corrupted token lengths differ, or that do not fit the context, are
    dropped (counted). More prompts than the distinct ones this tokenizer allows are refused."""
    tokenizer = model_tokenizer(model)
    starts, dropped, note = _greater_than_starts(tokenizer, nouns[0])
    rows = []
    for template, noun in enumerate(nouns):
        for start in starts:
            prompt = f"The {noun} lasted from the year {GT_CENTURY}{{}} to the year {GT_CENTURY}{start.tail}"
            rows.append(_Row(prompt.format(start.year), prompt.format(start.corrupted), start.answers,
                             start.distractors, template, f"{GT_CENTURY}{start.year}", start.cutoff))
    fitting, skipped = _fitting_rows(tokenizer, rows, model.cfg.n_ctx)
    return _from_rows("greater-than", _distinct("greater-than", fitting, n, seed, default=60), "prob_diff", dropped + skipped,
                      note)


@dataclass(frozen=True)
class _Start:
    """One greater-than start year: ``year`` its last two digits, ``tail`` what the prompt's end
    year begins with after the century, ``corrupted`` the corruption's last two digits, ``answers`` /
    ``distractors`` the token ids that make the end year later / not later, ``cutoff`` the ids either
    side of the one compared."""

    year: str
    tail: str
    corrupted: str
    answers: tuple[int, ...]
    distractors: tuple[int, ...]
    cutoff: tuple[int, int]


def _greater_than_starts(tokenizer: Tokenizer, noun: str) -> tuple[list[_Start], int, str]:
    """The start years greater-than can measure for this tokenizer (see ``greater_than_task``), how
    many two-digit numbers it dropped (not single tokens), and the note saying what stands in."""
    probe = f"The {noun} lasted from the year {GT_CENTURY}50 to the year {GT_CENTURY}"
    found = {yy: single_token(tokenizer, probe, f"{yy:02d}", sep="") for yy in range(100)}
    ids = {yy: hit[1] for yy, hit in found.items() if hit is not None and hit[0] == probe}
    if len(ids) >= 10:
        starts = [_Start(f"{yy:02d}", "", "01", tuple(t for v, t in ids.items() if v > yy),
                         tuple(t for v, t in ids.items() if v <= yy), (ids[yy + 1], ids[yy - 1]))
                  for yy in range(2, 99) if yy - 1 in ids and yy + 1 in ids]
        if not starts:
            raise UserError("greater-than: no start year has both neighbouring years as single tokens for this "
                            "tokenizer")
        return starts, 100 - len(ids), ""
    digits = {}
    for tail in ("", "5"):  # after "17" (the decade) and after "175" (the year within a decade)
        for d in range(10):
            hit = single_token(tokenizer, probe + tail, str(d), sep="")
            if hit is None or hit[0] != probe + tail:
                raise UserError("greater-than: neither two-digit numbers nor single digits are single tokens after "
                                f"{probe + tail!r} for this tokenizer")
            digits[d] = hit[1]

    def start(year: str, tail: str, corrupted: str, compared: int) -> _Start:
        return _Start(year, tail, corrupted, tuple(t for d, t in digits.items() if d > compared),
                      tuple(t for d, t in digits.items() if d <= compared), (digits[compared + 1], digits[compared - 1]))

    starts = [start(f"{d}9", "", "09", d) for d in range(1, 9)]
    starts += [start(f"{d}{y}", str(d), f"{d}0", y) for d in range(10) for y in range(1, 9)]
    note = ("no two-digit number is a single token for this tokenizer: one digit stands in, the first at which a "
            "later end year can differ (start year 17D9: the end year's decade, > D against <= D; 17DY, Y < 9: "
            "its last digit after 17D, > Y against <= Y)")
    return starts, 100, note


def induction_text_task(model, n: int = 16, seed: int = 0, sentences: Sequence[str] = SENTENCES) -> Task:
    """Induction on natural text: each sentence (its first words, as many as fit the context
    twice), then its repeat cut after half its words, the answer the next word's first token, the
    distractor the first token of a word from earlier in the sentence; corrupted: the first copy's
    words shuffled (seeded) until no word equal to the prompt's last one is followed by the answer
    word, so the next word cannot be copied. Sentences with no such shuffle of equal token length
    in 20 tries, or whose first 4 words do not fit, are dropped (counted). ``n`` is at most the number
    of sentences (refused in one line above it)."""
    tokenizer = model_tokenizer(model)
    if n > len(sentences):
        raise UserError(f"induction-text can make at most {len(sentences)} distinct prompts (one per sentence); "
                        f"asked for {n}")
    rng = random.Random(seed)
    rows = []
    for sentence in list(sentences)[:n]:
        words = sentence.split()
        while len(words) > 4 and 2 * len(tokenizer.encode(" ".join(words))) + 2 >= model.cfg.n_ctx:
            words = words[:-1]
        sentence, cut = " ".join(words), len(words) // 2
        if 2 * len(tokenizer.encode(sentence)) + 2 >= model.cfg.n_ctx:
            continue
        prompt = f"{sentence}. {' '.join(words[:cut])}"
        nxt = continuation(tokenizer, prompt, words[cut])
        other = continuation(tokenizer, prompt, words[cut - 2])
        if nxt is None or other is None or other[0] != nxt[0] or nxt[1][0] == other[1][0]:
            continue
        pair = (words[cut - 1], words[cut])  # the prompt's last word, then the answer word
        if pair in zip(words[:cut], words[1:cut]):  # the repeat itself shows it: no shuffle hides it
            continue
        for _ in range(20):
            shuffled = words[:]
            rng.shuffle(shuffled)
            if pair not in zip(shuffled, shuffled[1:]):
                bad = f"{' '.join(shuffled)}. {' '.join(words[:cut])}" + nxt[0][len(prompt):]
                if len(tokenizer.encode(bad)) == len(tokenizer.encode(nxt[0])):
                    rows.append(_Row(nxt[0], bad, (nxt[1][0],), (other[1][0],)))
                    break
    dropped = min(n, len(sentences)) - len(rows)
    if not rows:
        raise UserError("induction-text: no sentence gives clean and corrupted prompts of equal token length for this tokenizer")
    return _from_rows("induction-text", rows, "logit_diff", dropped, "")


class _Row(NamedTuple):
    """One candidate pair of a generator: its prompts, answer and distractor ids, and the labels
    ``Task`` keeps per pair (None where the generator has none)."""

    clean: str
    corrupted: str
    answers: tuple[int, ...]
    distractors: tuple[int, ...]
    template: int | None = None
    cluster: Hashable | None = None
    cutoff: tuple[int, int] | None = None


def _fitting_rows(tokenizer: Tokenizer, rows: list[_Row], n_ctx: int) -> tuple[list[_Row], int]:
    """The rows whose clean and corrupted prompts tokenise to equal lengths within the context
    (after the start token), and how many were not."""
    lengths = [(len(tokenizer.encode(row.clean)), len(tokenizer.encode(row.corrupted))) for row in rows]
    kept = [row for row, (a, b) in zip(rows, lengths) if a == b < n_ctx]
    return kept, len(rows) - len(kept)


def _distinct(name: str, rows: list[_Row], n: int | None, seed: int, default: int) -> list[_Row]:
    """``n`` of a generator's candidate ``rows`` (distinct clean prompts), drawn without replacement,
    seeded: the rows of each template shuffled, then the templates in turn. ``n`` None: ``default``
    or all the rows, whichever is fewer; an ``n`` above the rows there are is refused in one line."""
    n = min(default, len(rows)) if n is None else n
    if n > len(rows):
        raise UserError(f"{name} can make {len(rows)} distinct prompts for this tokenizer; asked for {n}")
    if n <= 0:
        raise UserError(f"a task needs at least one prompt, got n={n}")
    rng = random.Random(seed)
    groups: dict = {}
    for row in rows:
        groups.setdefault(row.template, []).append(row)
    for members in groups.values():
        rng.shuffle(members)
    in_turn = [row for turn in itertools.zip_longest(*groups.values()) for row in turn if row is not None]
    return in_turn[:n]


def _from_rows(name: str, rows: list[_Row], metric: str, dropped: int, note: str) -> Task:
    """A task from rows, with the templates, clusters and cutoffs the rows have."""
    if not rows:
        raise UserError(f"{name}: no prompt survived for this tokenizer")
    labels = {field: tuple(getattr(row, field) for row in rows) for field in ("template", "cluster", "cutoff")}
    return Task(name, tuple(r.clean for r in rows), tuple(r.corrupted for r in rows), tuple(r.answers for r in rows),
                tuple(r.distractors for r in rows), metric, dropped, note,
                templates=labels["template"] if rows[0].template is not None else (),
                cutoffs=labels["cutoff"] if rows[0].cutoff is not None else (),
                clusters=labels["cluster"] if rows[0].cluster is not None else ())


# Code tasks (for the embedded "code" model): Python lines written for this module.
BRACKET_LINES = (
    "result = compute{o}first_value, second_value", "items = sorted{o}records, key", "print{o}total + offset",
    "config = load{o}path, strict", "values = merge{o}left, right", "data = parse{o}line.strip()",
    "if check{o}name, size", "out.append{o}row[0], row[1]", "return build{o}node.left, node.right",
    "self.cache = dict{o}", "args = collect{o}options, defaults", "yield pair{o}key, value",
)
BRACKETS = {"(": ")", "[": "]", "{": "}"}
IDENTIFIER_PREFIXES = ("total_", "user_", "max_", "item_", "last_", "num_", "line_", "file_")
IDENTIFIER_SUFFIXES = ("count", "value", "index", "width", "limit", "score")  # distinct first letters


def brackets_task(model, n: int | None = None, seed: int = 0, lines: Sequence[str] = BRACKET_LINES) -> Task:
    """Predict the closing bracket's type: a line with one bracket left open, "(", "[" or "{", the
    answer its closing bracket, the distractor the closing bracket of the corrupted prompt's
    opening bracket (another type, drawn, same place). ``n`` (None: 36, or all there are if fewer) distinct prompts (a line and an opening
    bracket each; the lines, ``Task.templates``, in turn) drawn without replacement, seeded. Prompts
    whose pair lengths differ, or whose closing brackets are not single tokens, are dropped (counted)."""
    tokenizer = model_tokenizer(model)
    rng = random.Random(seed)
    rows, dropped = [], 0
    for template, line in enumerate(lines):
        for opening in BRACKETS:
            other = rng.choice([bracket for bracket in BRACKETS if bracket != opening])
            clean, corrupted = line.format(o=opening), line.format(o=other)
            good = single_token(tokenizer, clean, BRACKETS[opening], sep="")
            bad = single_token(tokenizer, clean, BRACKETS[other], sep="")
            if good is None or bad is None:
                dropped += 1
                continue
            rows.append(_Row(clean, corrupted, (good[1],), (bad[1],), template))
    rows, skipped = _fitting_rows(tokenizer, rows, model.cfg.n_ctx)
    return _from_rows("brackets", _distinct("brackets", rows, n, seed, default=36), "logit_diff", dropped + skipped, "")


def identifier_task(model, n: int | None = None, seed: int = 0) -> Task:
    """Recall a name defined earlier: "PREFIX_count = 0\nfor x in data:\n    PREFIX_" -> the first
    token of "count"; corrupted: the line defines PREFIX_ + another suffix (drawn among those whose
    first token differs), whose first token is the distractor. ``n`` (None: 48, or all there are if
    fewer) distinct prompts (a prefix and a
    suffix each; the prefixes, ``Task.templates``, in turn) drawn without replacement, seeded. Names
    with no such other suffix, or whose pair lengths differ, are dropped (counted)."""
    tokenizer = model_tokenizer(model)
    rng = random.Random(seed)
    template = "{name} = 0\nfor x in data:\n    {prefix}"
    rows, dropped = [], 0
    for index, prefix in enumerate(IDENTIFIER_PREFIXES):
        clean_of = {name: template.format(name=prefix + name, prefix=prefix) for name in IDENTIFIER_SUFFIXES}
        first = {name: continuation(tokenizer, clean_of[name], name, sep="") for name in IDENTIFIER_SUFFIXES}
        for name in IDENTIFIER_SUFFIXES:
            others = [other for other in IDENTIFIER_SUFFIXES if other != name and first[name] is not None and
                      (hit := continuation(tokenizer, clean_of[name], other, sep="")) is not None and
                      hit[1][0] != first[name][1][0]]
            if not others:
                dropped += 1
                continue
            other = rng.choice(others)
            bad = continuation(tokenizer, clean_of[name], other, sep="")
            rows.append(_Row(clean_of[name], template.format(name=prefix + other, prefix=prefix),
                             (first[name][1][0],), (bad[1][0],), index))
    rows, skipped = _fitting_rows(tokenizer, rows, model.cfg.n_ctx)
    return _from_rows("identifier", _distinct("identifier", rows, n, seed, default=48), "logit_diff", dropped + skipped, "")


GENERATORS = {"ioi": ioi_task, "greater-than": greater_than_task, "induction-text": induction_text_task,
              "brackets": brackets_task, "identifier": identifier_task}


def make_task(model, name: str, n: int | None = None, seed: int = 0) -> Task:
    """A ``Task`` value: a built-in task (``BUILT_IN``) by name, or a JSONL/CSV file of rows (``load_task``)."""
    if name in GENERATORS:
        return GENERATORS[name](model, seed=seed, **({} if n is None else {"n": n}))
    path = Path(name)
    if path.suffix.lower() in (".jsonl", ".csv"):
        task = load_task(model, path)
        return task if n is None else task.take(n)
    raise UserError(f"unknown task {name!r}; allowed: {', '.join(BUILT_IN)}, or a .jsonl / .csv file")


# ----------------------------------------------------------------------------- custom tasks
FIELDS = ("clean", "corrupted", "answer", "distractor")


def check_header(what: str, found: Sequence[str] | None, needed: Sequence[str]) -> None:
    """Refuse, in one line naming what it lacks, what it needs and what it has, a CSV file
    (``what``: its name in the message) whose header ``found`` (``csv.DictReader.fieldnames``; None
    for an empty file) lacks a column of ``needed``."""
    missing = [column for column in needed if column not in (found or [])]
    if missing:
        has = ", ".join(repr(column) for column in found) if found else "no header (the file is empty)"
        raise UserError(f"{what}: the header lacks {', '.join(missing)}; it needs {', '.join(needed)}, and has {has}")


def load_task(model, path: str | Path, metric: str = "logit_diff") -> Task:
    """A ``Task`` value from a JSONL file (one object per line with ``FIELDS``; ``answer`` / ``distractor`` a
    string or a list of strings) or a CSV file (a header with ``FIELDS``; several answers joined by
    ``|``). Each answer and distractor is the exact text that continues the clean prompt and must
    be one token there (" Mary", with its space, on GPT-2). A malformed row is refused in one line naming its row number (1 = the first
    data row)."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in (".jsonl", ".csv"):
        raise UserError(f"task file {str(path)!r}: allowed suffixes are .jsonl and .csv")
    text = read_text(path, "task file")
    if suffix == ".jsonl":
        rows = []
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rows.append((number, json.loads(line)))
            except json.JSONDecodeError as error:
                raise UserError(f"{path.name}, row {number}: not JSON ({error.msg})") from None
    else:
        reader = csv.DictReader(io.StringIO(text, newline=""))
        check_header(path.name, reader.fieldnames, FIELDS)
        rows = [(number, {key: (value.split("|") if key in ("answer", "distractor") and value else value)
                          for key, value in row.items()})
                for number, row in enumerate(reader, start=1)]
    if not rows:
        raise UserError(f"{path.name} has no rows")
    tokenizer = model_tokenizer(model)
    parsed = [_Row(*_parse_row(tokenizer, path.name, number, row)) for number, row in rows]
    return _from_rows(path.stem, parsed, metric, 0, "")


def _parse_row(tokenizer: Tokenizer, source: str, number: int, row) -> tuple:
    where = f"{source}, row {number}"
    if not isinstance(row, dict):
        raise UserError(f"{where}: a row must be an object with {', '.join(FIELDS)}")
    given = [key for key, value in row.items() if value not in (None, "", [])]  # an empty field counts as missing
    missing = [f for f in FIELDS if f not in given]
    if missing:
        has = ", ".join(repr(key) for key in given) or "nothing"
        raise UserError(f"{where}: missing {', '.join(missing)}; a row needs {', '.join(FIELDS)}, and has {has}")
    clean, corrupted = row["clean"], row["corrupted"]
    if not isinstance(clean, str) or not isinstance(corrupted, str):
        raise UserError(f"{where}: clean and corrupted must be strings")
    sets, prompts = [], set()
    for field in ("answer", "distractor"):
        words = [row[field]] if isinstance(row[field], str) else row[field]
        if not isinstance(words, list) or not all(isinstance(w, str) and w for w in words):
            raise UserError(f"{where}: {field} must be a non-empty string or a list of them")
        ids = []
        for word in words:
            hit = single_token(tokenizer, clean, word, sep="")
            if hit is None:
                raise UserError(f"{where}: {field} {word!r} is not a single token after the clean prompt")
            ids.append(hit[1])
            prompts.add(hit[0])
        sets.append(tuple(ids))
    if len(prompts) > 1:
        raise UserError(f"{where}: the answers and distractors continue the prompt differently (some after a space token)")
    prompt = prompts.pop()
    corrupted = corrupted + prompt[len(clean):]
    if len(tokenizer.encode(prompt)) != len(tokenizer.encode(corrupted)):
        raise UserError(f"{where}: clean and corrupted prompts have different token lengths "
                        f"({len(tokenizer.encode(prompt))} and {len(tokenizer.encode(corrupted))})")
    return prompt, corrupted, sets[0], sets[1]
