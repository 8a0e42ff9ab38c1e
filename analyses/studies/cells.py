"""A study's cells, prepared for the executors: each cell's model loaded, its prompts, metric and
ablation targets made (``prepare_study``), and the rows computed one block at a time
(``StudyCells``, the local executor and what each Ray actor of ``analyses/studies/on_ray.py``
runs). The runner (``analyses/studies/runner.py``) and the Ray executor both import this module,
and neither imports the other at import time."""

from __future__ import annotations

from typing import Iterator, NamedTuple

import torch

from analyses.interventions.ablation import (FROM_OTHER_PROMPTS, Ablation, Component, prepare_ablation, pruning_order,
                                            sweep_targets)
from analyses.core.budget import DEFAULT_MEMORY_MB
from analyses.core.execution import executing
from analyses.interventions.engine import rows_per_chunk
from analyses.core.metrics import Metric, logit_diff_metric, loss_metric
from analyses.core.probes import check_prompt_count, probes_for
from analyses.studies.spec import Cell, StudySpec
from analyses.core.tokens import encode, read_text_lines, single_token_id
from analyses.report.meta import run_setting
from interp import load_model, provenance
from interp.errors import UserError
from interp.tokenizer import set_start_token

Targets = list[tuple[str, list[Component]]]


def study_prompts(model, spec: StudySpec) -> tuple[object, torch.Tensor, torch.Tensor]:
    """(what the ablation takes: the ``RepeatedProbes`` (their structure is what ``mean_aligned``
    aligns by) or the texts, tokens (batch, pos), the mask (batch, pos) of tokens the loss counts:
    the predictable ones of probes, the real ones of texts).

    Texts follow the one tokenization rule (``analyses.core.tokens``): the start token first, a ragged
    batch right-padded with the padding masked out; a logit difference is read at each text's
    last real token (``analyses.core.metrics.metric_for_batch``)."""
    if spec.prompt_kind == "repeated":
        probes = probes_for(model, spec.n_prompts, spec.seq_len, seed=spec.prompt_seed)
        return probes, probes.tokens, probes.predictable
    lines = read_text_lines(spec.text_file, "[prompts].file")[: spec.n_prompts]
    if spec.method in FROM_OTHER_PROMPTS:
        check_prompt_count(len(lines), f"[prompts].file {spec.text_file!r} has {len(lines)} non-empty line(s)",
                           FROM_OTHER_PROMPTS[spec.method])
    batch = encode(model, lines)
    if int(batch.lengths.min()) < 2:
        raise UserError(f"[prompts].file {spec.text_file!r} has a prompt of 1 token; a loss needs at least 2")
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


def study_targets(model, spec: StudySpec, ablation: Ablation) -> Targets:
    """The rows of the study, in order: (target name, components ablated together). A cumulative study
    prunes in ``pruning_curve``'s order, the importance taken from the study's own prepared
    ``ablation`` (its method, seed and ``preserve_patterns``), as ``interp ablate --targets
    cumulative`` does."""
    if spec.targets == "cumulative":
        order = pruning_order(ablation.importance())
        return [("none", [])] + [(f"prune:L{l}H{h}", order[: i + 1]) for i, (l, h) in enumerate(order)]
    n_pos = ablation.tokens.shape[1]
    if isinstance(spec.targets, tuple):
        try:
            singles = sweep_targets(model, [[component] for component in spec.targets], n_pos)
        except UserError as error:
            raise UserError(f"study spec: [ablation].targets: {error}") from None
        group = [("group", [c for _, components in singles for c in components])] if len(singles) > 1 else []
        return singles + group
    return sweep_targets(model, spec.targets, n_pos)


def ablates_mlps(spec: StudySpec) -> bool:
    """Whether the study's targets include MLP outputs (its ablation then prepares their replacements)."""
    if isinstance(spec.targets, tuple):
        return any(isinstance(component, str) for component in spec.targets)
    return spec.targets in ("each_mlp", "each_mlp_by_position")


class CellPlan(NamedTuple):
    """What the driver needs of a prepared cell: its rows' targets in order, the unablated metric,
    the model's record (``interp.provenance`` and how it ran, ``run_setting``: its dtype, precision,
    device and start token, each of which changes the rows' numbers), and how many rows make one
    block of work (those one forward under the default memory budget would hold)."""

    targets: Targets
    baseline: float
    record: dict[str, str]
    block_rows: int


class StudyCells:
    """The local executor, and what each Ray actor runs: the study's cells prepared here one at a
    time, a model loaded once for consecutive cells that name it (and dropped before the next
    one loads)."""

    def __init__(self, cells: tuple[Cell, ...], device: str | None = None, memory_mb: float = DEFAULT_MEMORY_MB):
        # the budget comes as an argument and is set with executing around each step: an actor's process
        # (or a thread) starts from Execution(), not from the driver's execution
        self.cells, self.device, self.memory_mb = cells, device, memory_mb
        self._model_key = self._model = None
        self._cell: tuple[int, CellPlan, Ablation] | None = None

    def _load(self, spec: StudySpec):
        """The cell's model, its prompts beginning with the start token as ``[model].prepend_bos`` says
        (absent: the model's own setting), as ``--prepend-bos`` does on the command line."""
        key = (spec.model, spec.impl, spec.dtype, spec.prepend_bos)
        if key != self._model_key:
            self._model = self._cell = None  # free the previous model before loading the next
            self._model = load_model(spec.model, impl=None if spec.impl == "auto" else spec.impl,
                                     device=self.device, dtype=spec.dtype).eval()
            if spec.prepend_bos is not None:
                set_start_token(self._model, spec.prepend_bos, "study spec")
            self._model_key = key
        return self._model

    def _prepared(self, index: int) -> tuple[CellPlan, Ablation]:
        if self._cell is None or self._cell[0] != index:
            model = self._load(self.cells[index].spec)
            with executing(memory_mb=self.memory_mb):
                targets, ablation = prepare_study(model, self.cells[index].spec)
            block = rows_per_chunk(model, ablation.tokens.shape[0], ablation.tokens.shape[1], self.memory_mb)
            record = provenance(model) | run_setting(model)
            self._cell = (index, CellPlan(targets, ablation.baseline, record, block), ablation)
        return self._cell[1:]

    def plan(self, index: int) -> CellPlan:
        """Cell ``index`` checked against its model (loaded if need be) -> its ``CellPlan``."""
        return self._prepared(index)[0]

    def rows(self, index: int, start: int, stop: int) -> Iterator[tuple[int, float]]:
        """(row, metric) of rows ``start:stop`` of cell ``index``, each computed when asked for."""
        plan, ablation = self._prepared(index)
        for row in range(start, stop):
            with executing(memory_mb=self.memory_mb, progress=False):
                value = ablation.run([plan.targets[row][1]]).item()
            yield row, value


def prepare_study(model, spec: StudySpec) -> tuple[Targets, Ablation]:
    """The study checked against ``model`` (prompts, metric, targets, method), and what its rows
    need: the targets in row order and the ablation prepared within the current execution's memory
    (``analyses.core.execution``; its forward, and a cumulative study's importance)."""
    prompts, tokens, counted = study_prompts(model, spec)
    metric = study_metric(model, spec, tokens, counted)
    ablation = prepare_ablation(model, prompts, spec.method, metric, preserve_patterns=spec.preserve_patterns,
                                seed=spec.ablation_seed, mlps=ablates_mlps(spec))
    return study_targets(model, spec, ablation), ablation
