"""Tasks as data (DESIGN 4.9): clean prompts, corrupted prompts, answer and distractor tokens, a metric.

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
import json
import random
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

import pandas as pd
import torch

from analyses.core.budget import DEFAULT_MEMORY_MB
from analyses.core.metrics import Metric, PromptMeanMetric, PromptScores, prompt_scores
from analyses.core.splits import DEFAULT_SELECTION_SHARE, PromptSplit, check_split, split_prompts
from analyses.core.stats import bootstrap_ratio, check_interval_prompts
from analyses.core.tokens import chat_texts, encode, model_tokenizer, read_text
from analyses.interventions.ablation import METHODS as ABLATION_METHODS, PAIRED_METHODS, CorruptedReference
from analyses.interventions.run import Run
from interp.errors import UserError
from interp.tokenizer import Tokenizer

METRICS = ("logit_diff", "prob_diff")
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
        """The prompts ``indices`` (in that order), with their answers, distractors, templates and cutoffs."""
        indices = [int(i) for i in indices]
        fields = ("clean", "corrupted", "answers", "distractors",
                  *(name for name in ("templates", "cutoffs") if getattr(self, name)))
        return replace(self, **{name: tuple(getattr(self, name)[i] for i in indices) for name in fields})


@dataclass
class TaskBatch:
    """A task tokenised for one model: clean / corrupted (batch, pos) ids, right-padded alike;
    last (batch,) each prompt's last real position (where its metric reads the logits)."""

    clean: torch.Tensor
    corrupted: torch.Tensor
    last: torch.Tensor


def task_batch(model, task: Task) -> TaskBatch:
    """The task's prompts as tokens for ``model``; a pair whose clean and corrupted prompts
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


def interval_frame(scores: dict[str, PromptScores], seed: int = 0) -> pd.DataFrame:
    """measure name -> its ``PromptScores`` on a batch (per-prompt numerators and counts) -> one row
    per measure: ``measure``, ``value`` (the mean over prompts), ``ci_low``, ``ci_high`` (the 95%
    percentile bootstrap over prompts, seeded: ``analyses.core.stats.bootstrap_ratio``), ``n_prompts``."""
    rows = []
    for name, found in scores.items():
        value, low, high = bootstrap_ratio(found.numerators, found.counts, seed=seed)
        rows.append({"measure": name, "value": float(value), "ci_low": float(low), "ci_high": float(high),
                     "n_prompts": len(found.counts)})
    return pd.DataFrame(rows)


def measure_intervals(task: Task, last: torch.Tensor, logits: torch.Tensor, seed: int = 0) -> pd.DataFrame:
    """Each of ``task_measures`` on ``logits`` (batch, pos, d_vocab) of the task's prompts, read at
    ``last`` (batch,): ``interval_frame``'s rows (measure, value, ci_low, ci_high, n_prompts)."""
    return interval_frame({name: prompt_scores(metric, logits) for name, metric in task_measures(task, last).items()},
                          seed)


def task_measure_intervals(model, task: Task, batch: TaskBatch, *, seed: int = 0,
                           memory_mb: float = DEFAULT_MEMORY_MB) -> pd.DataFrame:
    """Each of ``task_measures`` on the task's clean and on its corrupted prompts (``batch``:
    ``task_batch``), the forwards in chunks within ``memory_mb`` (``analyses.interventions.run.Run``):
    ``interval_frame``'s rows, ``run`` ("clean", "corrupted") first."""
    measures = task_measures(task, batch.last)
    frames = []
    for name, tokens in (("clean", batch.clean), ("corrupted", batch.corrupted)):
        run = Run.make(model, tokens, measures[task.metric], starts=False, memory_mb=memory_mb)
        frames.append(interval_frame({measure: run.scores(metric) for measure, metric in measures.items()}, seed)
                      .assign(run=name))
    frame = pd.concat(frames, ignore_index=True)
    return frame[["run", *(column for column in frame.columns if column != "run")]]


def _mean_metric(task: Task, last: torch.Tensor, scorer) -> Metric:
    """The mean over prompts of ``scorer(task, last)`` (logits -> (batch,)) as a metric with its read
    positions and its parts (see ``task_metric``)."""
    def part_scores(rows: slice, read: torch.Tensor | None):
        """The scores of the prompts ``rows`` alone, on logits (rows, pos or len(read), d_vocab)."""
        at = last[rows].cpu() if read is None else torch.searchsorted(read, last[rows].cpu())
        return scorer(task.subset(range(len(task))[rows]), at)

    return PromptMeanMetric(scorer(task, last), torch.unique(last).cpu(), part_scores)


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
    (to report their effects on): ``split_prompts``, seeded, stratified by template where the task has
    templates. Too few prompts to measure on (``check_task_prompts``) and a template that would be
    missing from either split are refused in one line."""
    check_task_prompts(len(task), True, f"task {task.name!r}", share)
    split = split_prompts(len(task), share, seed, strata=task.templates or None)
    chosen = set(split.selection.tolist())
    for template in dict.fromkeys(task.templates):
        members = [i for i, label in enumerate(task.templates) if label == template]
        inside = sum(i in chosen for i in members)
        if inside in (0, len(members)):
            raise UserError(f"task {task.name!r}: template {template} has {len(members)} prompt(s), so the "
                            f"{'selection' if inside == 0 else 'measurement'} split would hold none of it; give more "
                            "prompts (--n) or --no-split (choose and measure on the same prompts: in-sample)")
    return split


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
    token after " to" are dropped (counted); if fewer than 5 remain, single capital letters are used."""
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
        if answer is None or subject is None or answer[0] != subject[0]:
            skipped += 1
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


def greater_than_task(model, n: int = 60, seed: int = 0, nouns: Sequence[str] = GT_NOUNS) -> Task:
    """Greater-than (Hanna et al. 2023): "The NOUN lasted from the year 17YY to the year 17", the
    nouns in turn, YY drawn (seeded) from 02..98; the metric ``prob_diff`` at the last token, the
    corruption the start year 1701 (same tokens, YY = 01). Which token is measured depends on the
    tokenizer:

    - where the two-digit numbers are single tokens after "... to the year 17" (GPT-2's), the
      answers are the tokens of every two-digit number > YY, the distractors every one <= YY (YY
      itself is not greater), so the metric is Hanna et al.'s probability difference
      ``sum p(y > YY) - sum p(y <= YY)`` over those tokens (the ones that are not single tokens are
      dropped, counted in ``Task.dropped``, and YY is drawn among those whose neighbours YY +- 1
      are kept);
    - else (fewer than 10 such tokens: a tokenizer that writes digits one by one, as SmolLM2's and
      Llama 2's do), the decade digit stands in: the start year is 17D9 with D drawn from 1..8 (YY =
      D9, the last year of decade D; corrupted 1709), the token measured is the end year's first
      digit E, the answers the digits E > D and the distractors E <= D. An end year 17E? is greater
      than 17D9 exactly when E > D, whatever its second digit, so ``prob_diff`` is the probability
      that the model begins an end year greater than the start year minus that it begins one not
      greater (a non-digit next token counts in neither). The prompt stops after "17"; the model is
      not asked for the second digit.

    ``Task.cutoffs``: per prompt, the tokens just above and just below the cutoff, (YY + 1, YY - 1),
    or (D + 1, D - 1) for decades, whose probability difference is Hanna et al.'s cutoff sharpness
    (``cutoff_scores``): how steeply the probability rises across the start year. Prompts whose clean
    and corrupted token lengths differ are dropped (counted)."""
    tokenizer = model_tokenizer(model)
    probe = f"The {nouns[0]} lasted from the year {GT_CENTURY}50 to the year {GT_CENTURY}"
    pairs = [f"{y:02d}" for y in range(100)]
    found = {yy: single_token(tokenizer, probe, yy, sep="") for yy in pairs}
    kept = {yy: hit for yy, hit in found.items() if hit is not None and hit[0] == probe}
    if len(kept) >= 10:
        dropped, note, start, lowest, highest = 100 - len(kept), "", "{:02d}", 2, 98
        ids = {int(yy): hit[1] for yy, hit in kept.items()}
        corrupted_start = "01"
    else:
        digits = {d: single_token(tokenizer, probe, str(d), sep="") for d in range(10)}
        if any(hit is None or hit[0] != probe for hit in digits.values()):
            raise UserError("greater-than: neither two-digit numbers nor single digits are single tokens after "
                            f"{probe!r} for this tokenizer")
        dropped, start, lowest, highest = 100, "{}9", 1, 8
        note = ("no two-digit number is a single token for this tokenizer: the decade digit D of start year 17D9 "
                "stands in (the end year's first digit, > D against <= D)")
        ids = {d: hit[1] for d, hit in digits.items()}
        corrupted_start = "09"
    cutoffs = [value for value in range(lowest, highest + 1) if value - 1 in ids and value + 1 in ids]
    if not cutoffs:
        raise UserError("greater-than: no start year has both neighbouring years as single tokens for this tokenizer")
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        noun, value = nouns[i % len(nouns)], rng.choice(cutoffs)
        prompt = f"The {noun} lasted from the year {GT_CENTURY}{{}} to the year {GT_CENTURY}"
        rows.append((prompt.format(start.format(value)), prompt.format(corrupted_start),
                     tuple(t for v, t in ids.items() if v > value), tuple(t for v, t in ids.items() if v <= value),
                     i % len(nouns), (ids[value + 1], ids[value - 1])))
    rows, skipped = _fitting_rows(tokenizer, rows, model.cfg.n_ctx)
    return _from_rows("greater-than", rows, "prob_diff", dropped + skipped, note)


def induction_text_task(model, n: int = 16, seed: int = 0, sentences: Sequence[str] = SENTENCES) -> Task:
    """Induction on natural text: each sentence (its first words, as many as fit the context
    twice), then its repeat cut after half its words, the answer the next word's first token, the
    distractor the first token of a word from earlier in the sentence; corrupted: the first copy's
    words shuffled (seeded) until no word equal to the prompt's last one is followed by the answer
    word, so the next word cannot be copied. Sentences with no such shuffle of equal token length
    in 20 tries, or whose first 4 words do not fit, are dropped (counted)."""
    tokenizer = model_tokenizer(model)
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
                    rows.append((nxt[0], bad, (nxt[1][0],), (other[1][0],)))
                    break
    dropped = min(n, len(sentences)) - len(rows)
    if not rows:
        raise UserError("induction-text: no sentence gives clean and corrupted prompts of equal token length for this tokenizer")
    return _from_rows("induction-text", rows, "logit_diff", dropped, "")


def _fitting_rows(tokenizer: Tokenizer, rows: list, n_ctx: int) -> tuple[list, int]:
    """The rows whose clean and corrupted prompts tokenise to equal lengths within the context
    (after the start token), and how many were not."""
    lengths = [(len(tokenizer.encode(row[0])), len(tokenizer.encode(row[1]))) for row in rows]
    kept = [row for row, (a, b) in zip(rows, lengths) if a == b < n_ctx]
    return kept, len(rows) - len(kept)


def _from_rows(name: str, rows: list, metric: str, dropped: int, note: str) -> Task:
    """A task from rows (clean, corrupted, answers, distractors[, template[, cutoff]])."""
    if not rows:
        raise UserError(f"{name}: no prompt survived for this tokenizer")
    clean, corrupted, answers, distractors, *templates = zip(*rows)
    return Task(name, clean, corrupted, answers, distractors, metric, dropped, note, *templates)


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


def brackets_task(model, n: int = 36, seed: int = 0, lines: Sequence[str] = BRACKET_LINES) -> Task:
    """Predict the closing bracket's type: a line with one bracket left open, "(", "[" or "{", the
    answer its closing bracket, the distractor the closing bracket of the corrupted prompt's
    opening bracket (another type, same place). Lines whose pair lengths differ, or whose closing
    brackets are not single tokens, are dropped (counted)."""
    tokenizer = model_tokenizer(model)
    rng = random.Random(seed)
    rows, dropped = [], 0
    for i in range(n):
        line = lines[i % len(lines)]
        opening, other = rng.sample(list(BRACKETS), 2)
        clean, corrupted = line.format(o=opening), line.format(o=other)
        good, bad = single_token(tokenizer, clean, BRACKETS[opening], sep=""), single_token(tokenizer, clean, BRACKETS[other], sep="")
        if good is None or bad is None:
            dropped += 1
            continue
        rows.append((clean, corrupted, (good[1],), (bad[1],), i % len(lines)))
    rows, skipped = _fitting_rows(tokenizer, rows, model.cfg.n_ctx)
    return _from_rows("brackets", rows, "logit_diff", dropped + skipped, "")


def identifier_task(model, n: int = 48, seed: int = 0) -> Task:
    """Recall a name defined earlier: "PREFIX_count = 0\nfor x in data:\n    PREFIX_" -> the first
    token of "count"; corrupted: the line defines PREFIX_ + another suffix of the same length, whose
    first token is the distractor. Pairs whose suffixes are not single first tokens, or whose
    lengths differ, are dropped (counted)."""
    tokenizer = model_tokenizer(model)
    rng = random.Random(seed)
    rows, dropped = [], 0
    for i in range(n):
        prefix = IDENTIFIER_PREFIXES[i % len(IDENTIFIER_PREFIXES)]
        name, other = rng.sample(IDENTIFIER_SUFFIXES, 2)
        template = "{name} = 0\nfor x in data:\n    {prefix}"
        clean = template.format(name=prefix + name, prefix=prefix)
        corrupted = template.format(name=prefix + other, prefix=prefix)
        good, bad = continuation(tokenizer, clean, name, sep=""), continuation(tokenizer, clean, other, sep="")
        if good is None or bad is None or good[1][0] == bad[1][0]:
            dropped += 1
            continue
        rows.append((clean, corrupted, (good[1][0],), (bad[1][0],), i % len(IDENTIFIER_PREFIXES)))
    rows, skipped = _fitting_rows(tokenizer, rows, model.cfg.n_ctx)
    return _from_rows("identifier", rows, "logit_diff", dropped + skipped, "")


GENERATORS = {"ioi": ioi_task, "greater-than": greater_than_task, "induction-text": induction_text_task,
              "brackets": brackets_task, "identifier": identifier_task}


def make_task(model, name: str, n: int | None = None, seed: int = 0) -> Task:
    """A built-in task (``BUILT_IN``) by name, or a JSONL/CSV file of rows (``load_task``)."""
    if name in GENERATORS:
        return GENERATORS[name](model, seed=seed, **({} if n is None else {"n": n}))
    path = Path(name)
    if path.suffix.lower() in (".jsonl", ".csv"):
        task = load_task(model, path)
        return task if n is None else task.take(n)
    raise UserError(f"unknown task {name!r}; allowed: {', '.join(BUILT_IN)}, or a .jsonl / .csv file")


# ----------------------------------------------------------------------------- custom tasks
FIELDS = ("clean", "corrupted", "answer", "distractor")


def load_task(model, path: str | Path, metric: str = "logit_diff") -> Task:
    """A task from a JSONL file (one object per line with ``FIELDS``; ``answer`` / ``distractor`` a
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
        missing = [f for f in FIELDS if f not in (reader.fieldnames or [])]
        if missing:
            raise UserError(f"{path.name}: the header lacks {', '.join(missing)}; it needs {', '.join(FIELDS)}")
        rows = [(number, {key: (value.split("|") if key in ("answer", "distractor") and value else value)
                          for key, value in row.items()})
                for number, row in enumerate(reader, start=1)]
    if not rows:
        raise UserError(f"{path.name} has no rows")
    tokenizer = model_tokenizer(model)
    parsed = [_parse_row(tokenizer, path.name, number, row) for number, row in rows]
    return _from_rows(path.stem, parsed, metric, 0, "")


def _parse_row(tokenizer: Tokenizer, source: str, number: int, row) -> tuple:
    where = f"{source}, row {number}"
    if not isinstance(row, dict):
        raise UserError(f"{where}: a row must be an object with {', '.join(FIELDS)}")
    missing = [f for f in FIELDS if f not in row or row[f] in (None, "", [])]
    if missing:
        raise UserError(f"{where}: missing {', '.join(missing)}")
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
