"""Scripted ablation studies (DESIGN 4.5): ``interp study run SPEC.toml --out DIR [--resume]``.

Each target of the spec is one row of ``DIR/results.csv``, appended (flushed, fsynced) as soon as
it is computed; every row is computed by its own forward, so its value does not depend on which
rows were computed before (a resumed run gives the very same bytes). A killed run loses at most
the row in flight (a torn last line is dropped on resume); ``--resume`` checks that the rows on
disk are the spec's rows in order and computes only the missing ones. A run holds an exclusive
lock on DIR (``flock`` of ``DIR/.lock``, dropped when it ends or is killed), so a second run on DIR
is refused. Once the model is loaded and the spec checked against it, ``DIR/spec.json`` records the
spec and ``DIR/provenance.json`` the model (``interp.provenance``: family, impl, weights hash);
resuming with a different spec or another model is refused. ``DIR/results.png`` plots the table.

Columns: ``row, target, layer, head, n_heads, metric, baseline, effect`` (layer / head empty
where the target is not one layer / one head; floats written in full precision).
"""

from __future__ import annotations

import csv
import fcntl
import io
import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import pandas as pd
import torch

from analyses.ablation import Ablation, head_importance, prepare_ablation, sweep_targets
from analyses.intervention_figures import ablation_figure, save_figure
from analyses.metrics import Metric, logit_diff_metric, loss_metric
from analyses.probes import probes_for
from analyses.progress import progress_bar
from analyses.study_spec import StudySpec, load_spec
from analyses.tokens import encode, single_token_id
from interp import load_model, provenance
from interp.files import write_atomic
from interp.errors import UserError

COLUMNS = ["row", "target", "layer", "head", "n_heads", "metric", "baseline", "effect"]
RESULTS, LOCK, SPEC_RECORD, MODEL_RECORD = "results.csv", ".lock", "spec.json", "provenance.json"
Targets = list[tuple[str, list[tuple[int, int]]]]


def study_prompts(model, spec: StudySpec) -> tuple[object, torch.Tensor, torch.Tensor]:
    """(what the ablation takes: the probe ids or the texts, tokens (batch, pos), the mask (batch,
    pos) of tokens the loss counts: the predictable ones of probes, the real ones of texts).

    Texts follow the one tokenization rule (``analyses.tokens``): the start token first, a ragged
    batch right-padded with the padding masked out; a logit difference, read at the last
    position, needs texts of equal token length."""
    if spec.prompt_kind == "repeated":
        probes = probes_for(model, spec.n_prompts, spec.seq_len, seed=spec.prompt_seed)
        return probes.tokens, probes.tokens, probes.predictable
    path = Path(spec.text_file)
    if not path.is_file():
        raise UserError(f"[prompts].file {str(path)!r} does not exist")
    lines = [line for line in path.read_text().splitlines() if line.strip()][: spec.n_prompts]
    if not lines:
        raise UserError(f"[prompts].file {str(path)!r} has no non-empty line")
    batch = encode(model, lines, equal_lengths=spec.metric == "logit_diff")
    if int(batch.lengths.min()) < 2:
        raise UserError(f"[prompts].file {str(path)!r} has a prompt of 1 token; a loss needs at least 2")
    return lines, batch.tokens, batch.real


def single_token(model, text: str, key: str) -> int:
    try:
        return single_token_id(model, text)
    except UserError as error:
        raise UserError(f"study spec: [metric].{key}: {error}") from None


def study_metric(model, spec: StudySpec, tokens: torch.Tensor, counted: torch.Tensor) -> Metric:
    """The spec's metric; ``counted`` (batch, pos) marks the tokens a loss counts."""
    if spec.metric == "loss":
        return loss_metric(tokens, counted if spec.prompt_kind == "text" else None)
    if spec.metric == "repeat_loss":
        return loss_metric(tokens, counted)
    return logit_diff_metric(single_token(model, spec.correct, "correct"), single_token(model, spec.incorrect, "incorrect"))


def study_targets(model, spec: StudySpec, prompts, metric) -> Targets:
    """The rows of the study, in order: (target name, heads ablated together)."""
    if spec.targets == "cumulative":
        importance = head_importance(model, prompts, spec.method, metric, seed=spec.ablation_seed)
        order = [divmod(int(i), model.cfg.n_heads) for i in importance.flatten().argsort(stable=True)]
        return [("none", [])] + [(f"prune:L{l}H{h}", order[: i + 1]) for i, (l, h) in enumerate(order)]
    if isinstance(spec.targets, tuple):
        try:
            singles = sweep_targets(model, [[head] for head in spec.targets])
        except UserError as error:
            raise UserError(f"study spec: [ablation].targets: {error}") from None
        group = [("group", [head for _, heads in singles for head in heads])] if len(singles) > 1 else []
        return singles + group
    return sweep_targets(model, spec.targets)


def format_row(index: int, name: str, heads: list, value: float, baseline: float) -> list[str]:
    layers = {l for l, _ in heads}
    layer = str(heads[0][0]) if len(layers) == 1 else ""
    head = str(heads[0][1]) if len(heads) == 1 else ""
    return [str(index), name, layer, head, str(len(heads)), repr(value), repr(baseline), repr(value - baseline)]


def _csv_line(fields: list[str]) -> str:
    buffer = io.StringIO()
    csv.writer(buffer, lineterminator="\n").writerow(fields)
    return buffer.getvalue()


def rows_on_disk(path: Path, expected_names: list[str]) -> int:
    """Complete rows already in ``path``, checked to be the spec's rows in order. Only a file that
    passes is changed: its torn last line, if any, is cut off."""
    data = path.read_bytes()
    header = _csv_line(COLUMNS).encode()
    if not (data.startswith(header) or header.startswith(data)):
        raise UserError(f"{path} does not start with the results header {','.join(COLUMNS)!r}; not a study of ours")
    complete = data[: data.rfind(b"\n") + 1]
    rows = list(csv.reader(complete.decode().splitlines()[1:]))
    for i, fields in enumerate(rows):
        if i >= len(expected_names) or fields[:2] != [str(i), expected_names[i]]:
            expected = expected_names[i] if i < len(expected_names) else "nothing"
            raise UserError(f"{path} row {i} is {fields[:2]} but the spec gives [{i!r}, {expected!r}]; use a new --out")
    if len(complete) != len(data):
        with open(path, "r+b") as handle:
            handle.truncate(len(complete))
    return len(rows)


@contextmanager
def directory_lock(out: Path) -> Iterator[None]:
    """Hold an exclusive lock on the directory ``out`` (``flock`` of ``out/.lock``) for the block, or
    refuse if another run holds it. The kernel drops the lock when the file is closed, also when the
    process is killed."""
    with open(out / LOCK, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UserError(f"{out} is in use by another study run (it holds {out / LOCK}); "
                            "wait for it to end, or choose another --out") from None
        yield


def _record_text(record: dict) -> str:
    return json.dumps(record, indent=2, sort_keys=True) + "\n"


def check_out_dir(out: Path, spec: StudySpec, resume: bool) -> None:
    """Before loading the model: refuse to overwrite results, or to resume results of another spec."""
    results, recorded = out / RESULTS, out / SPEC_RECORD
    if results.exists() and not resume:
        raise UserError(f"{results} already exists; pass --resume to finish it, or choose another --out")
    if resume and recorded.exists() and recorded.read_text() != _record_text(spec.as_dict()):
        raise UserError(f"--resume: {out} holds a study of a different spec (see {recorded}); use a new --out")


def check_model(out: Path, model_record: dict[str, str]) -> None:
    """Refuse to add rows to results of another model: ``model_record`` (``interp.provenance`` of
    the model loaded now: family, impl, weights hash) must be the one recorded with them."""
    if not (out / RESULTS).exists():
        return
    path = out / MODEL_RECORD
    if not path.is_file():
        raise UserError(f"--resume: {out} has no {MODEL_RECORD} recording the model its rows came from; use a new --out")
    recorded = json.loads(path.read_text())
    for key, value in model_record.items():
        if recorded.get(key) != value:
            raise UserError(f"--resume: the rows in {out} came from {key} {recorded.get(key)!r}, "
                            f"but the model loaded now has {value!r}; use a new --out")


def write_records(out: Path, spec: StudySpec, model_record: dict[str, str]) -> None:
    write_atomic(out / SPEC_RECORD, _record_text(spec.as_dict()))
    write_atomic(out / MODEL_RECORD, _record_text(model_record))


def prepare_study(model, spec: StudySpec) -> tuple[Targets, Ablation]:
    """The study checked against ``model`` (prompts, metric, targets, method), and what its rows
    need: the targets in row order and the prepared ablation."""
    prompts, tokens, counted = study_prompts(model, spec)
    metric = study_metric(model, spec, tokens, counted)
    targets = study_targets(model, spec, prompts, metric)
    ablation = prepare_ablation(model, prompts, spec.method, metric,
                                preserve_patterns=spec.preserve_patterns, seed=spec.ablation_seed)
    return targets, ablation


def append_rows(results: Path, targets: Targets, ablation: Ablation, done: int, *, progress: bool | None,
                on_row: Callable[[int], None] | None) -> None:
    """Compute rows ``done:`` and append each to ``results`` (flushed, fsynced) as it comes."""
    with open(results, "a", newline="") as handle:
        if done == 0 and handle.tell() == 0:
            handle.write(_csv_line(COLUMNS))
        for index in progress_bar(range(done, len(targets)), progress=progress, desc="study",
                          initial=done, total=len(targets)):
            name, heads = targets[index]
            value = ablation.run([heads], progress=False).item()
            handle.write(_csv_line(format_row(index, name, heads, value, ablation.baseline)))
            handle.flush()
            os.fsync(handle.fileno())
            if on_row is not None:
                on_row(index)


def run_study(spec_path, out, resume: bool = False, *, progress: bool | None = None,
              on_row: Callable[[int], None] | None = None) -> Path:
    """Run (or finish, with ``resume``) the study of ``spec_path`` into ``out``; returns results.csv.
    ``on_row(i)`` is called after row i is on disk. ``[model].impl = "auto"`` leaves the choice
    to ``load_model``."""
    spec, out = load_spec(spec_path), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with directory_lock(out):
        check_out_dir(out, spec, resume)
        model = load_model(spec.model, impl=None if spec.impl == "auto" else spec.impl).eval()
        targets, ablation = prepare_study(model, spec)
        model_record = provenance(model)
        check_model(out, model_record)
        results = out / RESULTS
        done = rows_on_disk(results, [name for name, _ in targets]) if results.exists() else 0
        write_records(out, spec, model_record)
        append_rows(results, targets, ablation, done, progress=progress, on_row=on_row)
        plot_study(results, spec)
    return results


def plot_study(results: Path, spec: StudySpec) -> Path:
    frame = pd.read_csv(results, dtype={"layer": "Int64", "head": "Int64"})
    if spec.targets == "cumulative":
        frame["fraction"] = frame["n_heads"] / max(1, frame["n_heads"].max())
    title = f"{spec.method} ablation of {spec.model}: {spec.metric}"
    return save_figure(ablation_figure(frame, title), results.with_name("results.png"))
