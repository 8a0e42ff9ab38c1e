"""Facts for causal tracing (Meng et al. 2022): the set the project ships, a user's CSV, and the
filter that keeps the facts a model knows.

A fact is a prompt, the subject it names and the answer that continues it ("The capital of France
is", "France", " Paris"). The shipped set (``builtin_facts``, ``--facts builtin``) is generated from
the table ``data/facts.csv`` (relation, subject, object: capitals, official languages, currencies,
continents, the countries of cities and companies, landmarks' cities, founders, authors) through one
prompt template per relation (``TEMPLATES``); the answer is the object after a space. A user's file
(``read_facts``) is a CSV with ``prompt, subject, answer`` columns, the answer the exact text that
continues the prompt (" Paris", with its space), and optionally ``relation`` (what a trace's
per-relation breakdown groups by).

The answer traced is one token, taken by one rule for a fact set and a single trace (``answer_token``):
the first token the answer adds to the prompt, where a leading space that is a token of its own (a
byte tokenizer) moves onto the prompt, so the token traced is the answer's first character, never the
space. Meng et al. trace only facts the model knows; ``top1_facts`` keeps those whose answer token is
the model's top next token after the prompt.
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch

from analyses.core.budget import rows_within
from analyses.core.execution import executing
from analyses.core.progress import progress_bar
from analyses.core.tokens import encode, model_tokenizer, read_text
from analyses.tasks.task import check_header, continuation
from interp.errors import UserError

TABLE = Path(__file__).parent / "data" / "facts.csv"
BUILTIN = "builtin"
COLUMNS = ("prompt", "subject", "answer")
TEMPLATES = {  # short after the subject: a restore costs the positions from its first one to the end
    "capital": "The capital of {} is",
    "language": "The official language of {} is",
    "currency": "The currency of {} is the",
    "continent": "{} is a country in",
    "city_country": "{} is a city in",
    "company_country": "{} is a company from",
    "landmark_city": "{} is in the city of",
    "founder": "{} was founded by",
    "author": "{} was written by",
}


@dataclass(frozen=True)
class Fact:
    """A prompt, the subject text in it whose tokens are noised, and the text that continues it
    (its first token is the one traced, ``answer_token``); ``relation``: which of ``TEMPLATES`` made it, or a
    user's file's ``relation`` column ("" where it has none)."""

    prompt: str
    subject: str
    answer: str
    relation: str = ""


def builtin_facts() -> list[Fact]:
    """The shipped fact set: every row of ``TABLE`` through its relation's template."""
    rows = csv.DictReader(io.StringIO(TABLE.read_text(encoding="utf-8"), newline=""))
    return [Fact(TEMPLATES[row["relation"]].format(row["subject"]), row["subject"], " " + row["object"], row["relation"])
            for row in rows]


def read_facts(path) -> list[Fact]:
    """The facts of a CSV file with ``COLUMNS`` and optionally ``relation`` (more columns are
    ignored); a missing column, an empty cell of ``COLUMNS`` or a subject that is not in its prompt is
    refused in one line (rows count from 1, the first after the header)."""
    path = Path(path)
    reader = csv.DictReader(io.StringIO(read_text(path, "facts file"), newline=""))
    check_header(f"facts file {path.name}", reader.fieldnames, COLUMNS)
    facts = []
    for number, row in enumerate(reader, start=1):
        empty = [column for column in COLUMNS if not row[column]]
        if empty:
            raise UserError(f"facts file {path.name}, row {number}: empty {', '.join(empty)}")
        if row["subject"] not in row["prompt"]:
            raise UserError(f"facts file {path.name}, row {number}: subject {row['subject']!r} does not occur in "
                            f"the prompt {row['prompt']!r}")
        facts.append(Fact(row["prompt"], row["subject"], row["answer"], row.get("relation") or ""))
    if not facts:
        raise UserError(f"facts file {path.name} has no rows")
    return facts


def load_facts(source: str) -> list[Fact]:
    """``BUILTIN`` (the shipped set) or the path of a CSV file of facts (``read_facts``)."""
    return builtin_facts() if source == BUILTIN else read_facts(source)


def answer_token(model, prompt: str, answer: str) -> tuple[str, int]:
    """The rule every trace takes its answer by -> (the prompt to trace, the answer's token id): the
    first of ``answer_tokens``."""
    prompt, tokens = answer_tokens(model, prompt, answer)
    return prompt, tokens[0]


def answer_tokens(model, prompt: str, answer: str) -> tuple[str, list[int]]:
    """(the prompt to trace, the tokens that ``answer`` adds to ``prompt``). Where the first is the
    answer's leading whitespace alone (a byte tokenizer: " Paris" adds " ", "P", ...), the whitespace
    moves onto the prompt's end and the tokens are the word's ("P", "a", ...), as the tasks take a
    word after a space (``analyses.tasks.task.continuation``); an answer of whitespace alone is its
    own token. A one-line error for an empty answer, and where the prompt's tokens are not a prefix
    of the joined text's (the answer merges into the prompt), showing the tokens that merge."""
    if not answer:
        raise UserError(f"the answer to {prompt!r} is empty; give the exact continuation, e.g. ' Paris'")
    word = answer.lstrip() or answer
    tokenizer = model_tokenizer(model)
    found = continuation(tokenizer, prompt, word, sep=answer[: len(answer) - len(word)])
    if found is None:
        raise UserError(f"answer {answer!r} does not continue the prompt {prompt!r} as tokens of its own: "
                        f"{merged_tokens(tokenizer, prompt, answer)}; end the prompt where a token ends, or give the "
                        "answer with what it merges with")
    return found


def token_list(tokenizer, ids: list[int]) -> str:
    """Token ids as their texts, e.g. "[' st', 'ore']"."""
    return "[" + ", ".join(repr(tokenizer.decode([i])) for i in ids) + "]"


def merged_tokens(tokenizer, prompt: str, answer: str) -> str:
    """Where ``answer`` merges into ``prompt`` on ``tokenizer``, in words: the prompt's tokens from
    the first that the joined text tokenizes otherwise, and the joined text's tokens from there."""
    base, joined = tokenizer.encode(prompt), tokenizer.encode(prompt + answer)
    same = next((i for i, (a, b) in enumerate(zip(base, joined)) if a != b), min(len(base), len(joined)))
    same = min(same, max(len(base) - 1, 0))
    return (f"the prompt ends in the tokens {token_list(tokenizer, base[same:])}, prompt + answer in "
            f"{token_list(tokenizer, joined[same:])}")


def traced_facts(model, facts: list[Fact]) -> list[tuple[Fact, int]]:
    """Each fact as it is traced, with its answer's token id (``answer_token``): on a byte tokenizer
    the answer's leading space moved onto the prompt (" Paris" -> prompt + " ", "Paris"); a fact
    whose answer does not continue its prompt is refused in one line naming it."""
    found = []
    for number, fact in enumerate(facts, start=1):
        try:
            prompt, token = answer_token(model, fact.prompt, fact.answer)
        except UserError as error:
            raise UserError(f"fact {number}: {error}") from None
        found.append((Fact(prompt, fact.subject, fact.answer[len(prompt) - len(fact.prompt):], fact.relation), token))
    return found


def top1_facts(model, facts: list[Fact], *, memory_mb: float | None = None,
               progress: bool | None = None) -> tuple[list[Fact], pd.DataFrame]:
    """The facts whose answer token (``answer_token``) is the model's top next token after the
    prompt it is traced on -> a tuple (those facts, in order, as given; a frame of every fact as it is traced
    (``traced_facts``): ``relation, prompt, subject, answer, answer_token, answer_text, top_token,
    answer_prob, kept``). The prompts run in right-padded batches within ``memory_mb``, each read at
    its own last token. ``memory_mb``, ``progress``: the execution's (``analyses.core.execution``; None:
    the current one's)."""
    traced = traced_facts(model, facts)
    answers = [token for _, token in traced]
    tops, probs = [], []
    longest = max(encode(model, fact.prompt).tokens.shape[1] for fact, _ in traced)
    with executing(memory_mb, progress) as execution:
        size = rows_within(model, longest, execution.memory_mb, logits=True)
        with progress_bar(total=len(facts), desc="top-1 filter", unit="fact") as bar:
            for begin in range(0, len(facts), size):
                batch = encode(model, [fact.prompt for fact, _ in traced[begin:begin + size]])
                with torch.no_grad():
                    logits = model(batch.tokens)
                last = logits[torch.arange(len(batch.lengths)), batch.lengths - 1].float()  # (rows, d_vocab)
                wanted = torch.tensor(answers[begin:begin + size], device=last.device)
                tops += last.argmax(-1).tolist()
                probs += last.softmax(-1).gather(1, wanted[:, None])[:, 0].tolist()
                bar.update(len(batch.lengths))
    tokenizer = model_tokenizer(model)
    frame = pd.DataFrame([{"relation": f.relation, "prompt": f.prompt, "subject": f.subject, "answer": f.answer}
                          for f, _ in traced]).assign(
        answer_token=answers, answer_text=[tokenizer.decode([token]) for token in answers], top_token=tops,
        answer_prob=probs)
    frame["kept"] = frame["answer_token"] == frame["top_token"]
    return [fact for fact, kept in zip(facts, frame["kept"]) if kept], frame
