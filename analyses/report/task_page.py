"""A task's analysis and its page (``interp task`` writes it): the metric on the clean and corrupted
runs, head and MLP patching (all positions and by position), direct logit attribution, path
patching from the top senders with edge attribution (EAP, EAP-IG) beside it, as one offline page
built with the report's machinery (``analyses/report/page.py``).

By default the four patching sweeps and path patching are screened by attribution
(``analyses.interventions.attribution.Screen``, ``DEFAULT_SCREEN``): every cell (edge) is estimated
to first order, those the rule chooses are measured exactly and the others keep their estimate
(column ``exact``); the page and ``meta.json`` say so and give the rule. ``screen=None`` measures
every cell and edge exactly. Either way the clean and corrupted runs are made once and read by
every sweep.

Each of those is a step (``STEPS``); given a store (``analyses.core.steps.Steps``, keyed by
``task_inputs``: the model and how it runs, the task's contents and tokens, the options), ``analyse_task``
reads the steps already finished from it and writes each other step to it as soon as it is done,
so an interrupted ``interp task --resume`` computes only the rest. Given ``landed`` it hands the
analysis so far to it after each step (``task_analysis``: the steps not finished yet in
``TaskAnalysis.pending`` with their estimates), and ``page_writer`` rewrites the page with it: the
page is there from the first step on, each section whose step is pending shown as its pending slot,
every file written whole (``write_report_files``); stopped anywhere and resumed, the files equal an
uninterrupted run's (meta.json's ``cost``, the run's own seconds, aside).

Selection apart from measurement (architecture §4.12), by default: the prompts are split
(``analyses.tasks.task.task_split``: seeded, stratified by template) and every sweep above runs on the
selection split, where the heads are chosen (the path-patching senders by head patching, the top
writers by DLA, the heads of the strongest edges); their effects are then measured on the disjoint
measurement split with 95% intervals (``patch_effects``' and ``dla_effects``'), as is the DLA of
every component and the top writers' ablation against matched random head sets
(``analyses.interventions.controls.control_effects``), ablated with the means of the corrupted prompts
of each template (``mean_corrupted``: Wang et al. 2022's ABC means). ``split=False`` chooses and
measures on every prompt (in-sample).

Before any step the hook self-test plans the analysis (``task_plan``, ``analyses.report.plan``): the
circuit (edge attribution, path patching) and direct logit attribution are left out where the model
cannot run them, and the page and ``meta.json`` (``left_out``) say why; a model whose head
patching cannot run is refused in one line.

Where the model does not perform the task (``analyses.tasks.task.Performance``: the 95% paired
interval of the metric's clean - corrupted difference on the measurement prompts does not lie above
0), the page opens with a banner saying so, and the patching, circuit and chosen-heads sections are
each marked as built on noise; ``meta.json`` keeps ``performs_task`` and the verdict's line.

After the clean run, before the first sweep, ``analyse_task`` prints on stderr (unless ``progress`` is
False) what each step will cost in forward-equivalents and seconds on this machine
(``analyses.report.task_cost``; the clean run is the clock), the circuit's and the measured step's
again as they begin, from the heads chosen; ``meta.json``'s ``cost`` keeps the estimate and each
step's measured seconds (a step a resumed run read back finished is marked ``reused``)."""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Callable, Sequence

import pandas as pd
import torch
from matplotlib.figure import Figure

from analyses.core.execution import current, executing
from analyses.circuits.circuit import circuit_figure, strongest
from analyses.components.decompose import components_cache, dla_effects, dla_heatmap
from analyses.circuits.edge_attribution import edge_agreement
from analyses.circuits.edges import VIAS
from analyses.core.hook_check import left_out, require
from analyses.report.intervention_figures import patching_figure
from analyses.core.hook_names import has_mlps
from analyses.core.splits import PromptSplit
from analyses.interventions.controls import DEFAULT_DRAWS, control_effects, describe_control
from analyses.interventions.engine import head_cells
from analyses.circuits.path_patching import eap_ig, edge_attribution, path_needs, path_patch, screened_path_patch
from analyses.interventions.attribution import DEFAULT_SCREEN, Screen, screened_patches
from analyses.interventions.patching import COMPONENTS, component_patches, patch_components, patching_frame, prepare
from analyses.core.plots import new_figure
from analyses.interventions.run import Contrast, Options, Run
from analyses.core.plots import png_bytes
from analyses.report.page import ReportFigure, Section, write_report_files
from analyses.report.meta import run_setting, versions
from analyses.report.plan import DLA, DLA_NEEDS, left_out_section
from analyses.report.task_cost import TASK_COSTS, ClockedSteps, TaskShape, measured_cost, task_estimate
from analyses.tasks.task import (Performance, Task, TaskBatch, task_ablation, task_batch, task_measure_intervals,
                                  task_measures, task_metric, task_performance, task_split)
from interp.errors import UserError
from interp.provenance import provenance


@dataclass
class TaskAnalysis:
    """Everything ``interp task`` computes, each from one library call (no number is made here).

    values: metric on the clean and corrupted runs; heads / heads_by_pos / mlps / mlps_by_pos:
    denoising patching frames (``patching_frame``; MLPs None on attention-only models); dla: mean
    direct logit attribution per component (``direct_logit_attribution`` at each prompt's last
    token, averaged over prompts and over each prompt's answers minus its distractors; None for the
    probability-difference metric, which is not linear in the logits); edges: path patching from the
    ``top`` senders by |head patching - corrupted| to every later head's q/k/v and the logits, with
    edge attribution beside it (``ATTRIBUTIONS``: EAP in column ``attribution``, EAP-IG in
    ``attribution_ig``); agreement: for each of those columns, ``edge_agreement`` with path patching,
    or {"refused": why} where the model cannot take that method's edits; screen: the rule that chose
    the cells and edges measured exactly (None: every one was), each frame's ``exact`` column saying
    which were (the others hold their first-order estimate: attribution patching's, EAP's); the
    agreement is then over the exactly measured edges. left_out: each part the model could not run
    (``task_plan``) -> why; its frame is None (``edges`` for ``CIRCUIT``, ``dla`` for ``DLA``).

    split: the ``PromptSplit`` (None: in-sample, every frame on every prompt); the frames above but
    ``dla`` are of the selection split, ``values`` its metric. measured: on the measurement split,
    ``values`` (its clean and corrupted metric), ``dla`` (``dla_effects`` of every component: the frame
    ``dla`` holds), ``heads`` (``measured_heads``: the chosen heads, why each was chosen, its exact
    patching effect and DLA with their intervals) and ``control`` (the top writers against matched
    random sets, ``ControlEffects.summary``, or {"refused": why}). ablation: how the control ablates
    (``task_ablation``: method and reference in words). cost: each step's estimate and measured
    seconds (``analyses.report.task_cost``: ``ClockedSteps.record``), meta.json's ``cost``.

    steps: the ``STEPS`` this analysis runs, in order (``steps_run``); pending: those not finished
    yet -> each one's estimate in words (``CostEstimate.step_words``), empty once the analysis is
    whole. While a step is pending, what it makes is None (``measured`` empty), so a frame that is
    None is "not made" where its step is pending, "not run" (no MLPs, left out) where it is not.
    drawn: the page's figures drawn so far, by name, shared by the successive analyses of one run
    (``task_analysis``), so that each is drawn once: a figure is drawn only from what landed steps
    made, which no later step changes."""

    task: Task
    values: dict
    heads: pd.DataFrame
    heads_by_pos: pd.DataFrame
    mlps: pd.DataFrame | None
    mlps_by_pos: pd.DataFrame | None
    dla: pd.DataFrame | None
    edges: pd.DataFrame | None
    agreement: dict
    screen: Screen | None = None
    left_out: dict[str, str] = field(default_factory=dict)
    split: PromptSplit | None = None
    measured: dict = field(default_factory=dict)
    ablation: dict = field(default_factory=dict)
    cost: dict = field(default_factory=dict)
    steps: tuple[str, ...] = ()
    pending: dict[str, str] = field(default_factory=dict)
    drawn: dict[str, ReportFigure] = field(default_factory=dict, repr=False, compare=False)

    @property
    def performance(self) -> Performance | None:
        """Whether the model performs the task, on the prompts the effects are measured on
        (``task_performance``: the paired clean - corrupted interval of its metric lies above 0);
        None while the measured step is pending."""
        if "measures" not in self.measured:
            return None
        return task_performance(self.measured["measures"], self.task.metric)


# edge attribution methods beside path patching: frame column -> method (same edges, same frame)
ATTRIBUTIONS = {"attribution": edge_attribution, "attribution_ig": eap_ig}
ATTRIBUTION_NAMES = {"attribution": "Edge attribution (EAP)", "attribution_ig": "EAP-IG"}
# the steps of a task's analysis, in the order they run (the MLP steps only where the model has
# MLPs, DLA only for the logit difference)
# (EAP comes before path patching, whose screen it is)
# (the last measures on the measurement split what the others chose)
STEPS = ("metric", "heads", "heads_by_pos", "mlps", "mlps_by_pos", "dla", "attribution", "path_patching",
         "attribution_ig", "measured")
CIRCUIT_STEPS = ("attribution", "path_patching", "attribution_ig")
PATCHING_STEPS = ("heads", "heads_by_pos", "mlps_by_pos")  # the sweeps the Patching section draws
CIRCUIT_EDGES = 5  # the strongest exact edges whose heads are chosen (``circuit_heads``)
Step = Callable[[str, Callable[[], object]], object]  # (name, compute) -> the step's value
CIRCUIT = "circuit (edge attribution and path patching)"  # a part a model may not run (``task_plan``)


def screen_record(screen: Screen | None) -> dict:
    """The screen as data (meta.json, the step store's options): the rule, or that there was none."""
    if screen is None:
        return {"exact": "every cell and edge"}
    return {"top_k": screen.top_k, "share": screen.share, "rule": screen.describe()}


def split_record(split: PromptSplit | None) -> dict:
    """The split as data (meta.json, the step store's options): ``PromptSplit.record``, or that
    there was none (in-sample)."""
    return split.record() if split is not None else {"none": "heads chosen and measured on every prompt (in-sample)"}


def task_inputs(model, task: Task, top: int, screen: Screen | None = DEFAULT_SCREEN,
                split: PromptSplit | None = None, ablation: str = "mean_corrupted") -> dict:
    """What a task's analysis on ``model`` depends on, for a step store (``analyses.core.steps.Steps``):
    the model (``interp.provenance``: family, impl, weights hash) and how it runs (``run_setting``:
    dtype, precision, device, start token), the package versions, the task's contents (its name,
    size, metric, and the SHA-256 of its prompts, answers, distractors and templates), the SHA-256 of
    the tokens the model reads (``task_batch``'s clean and corrupted tokens: the tokenizer and the
    start token change them), ``top``, the ``screen``, the ``split`` (``task_split``'s, or None) and
    the ``ablation`` method. ``interp task`` adds its command line's options."""
    contents = json.dumps([task.clean, task.corrupted, task.answers, task.distractors, task.metric, task.templates])
    batch = task_batch(model, task)
    tokens = json.dumps([batch.clean.tolist(), batch.corrupted.tolist()])
    return {"model": provenance(model) | run_setting(model), "versions": versions(),
            "task": {"name": task.name, "prompts": len(task), "metric": task.metric,
                     "sha256": hashlib.sha256(contents.encode()).hexdigest(),
                     "tokens_sha256": hashlib.sha256(tokens.encode()).hexdigest()},
            "options": {"top": top, "screen": screen_record(screen), "split": split_record(split),
                        "ablation": ablation}}


def task_plan(model, task: Task) -> dict[str, str]:
    """The analysis's plan, from the hook self-test, before any step: each part this model cannot
    run (``CIRCUIT``: EAP, path patching and EAP-IG from the top heads through q, k, v and the
    logits; ``DLA``, which the logit difference has) -> why, in one line. Refuses in one line a
    model whose head patching cannot run: the senders of the circuit are chosen by it."""
    require(model, "hook_z", "the task's head patching")
    return left_out(model, {CIRCUIT: path_needs(VIAS), **({DLA: DLA_NEEDS} if task.metric == "logit_diff" else {})})


def _compute(name: str, compute: Callable[[], object]) -> object:
    return compute()


def task_dla(model, task: Task, batch: TaskBatch, seed: int = 0) -> pd.DataFrame:
    """Each component's direct logit attribution onto the logit difference at each prompt's last
    token, a mean over prompts with its 95% interval, split into the answers' part (``dla_answer``)
    and the distractors' (``dla_distractor``): ``dla_effects`` of the clean run (its columns). Over
    the components ``dla`` adds up to the task's metric on the clean prompts."""
    return dla_effects(model, components_cache(model, batch.clean), task.answers, task.distractors, at=batch.last,
                       seed=seed)


class TaskRuns:
    """What several steps of a task's analysis read, each made once, on first use (so a resumed run
    makes only what its unfinished steps need): the corrupted run (the base every denoising sweep
    edits, its residual starts kept), the clean run (its metric and the heads' and MLPs' outputs,
    the sources), and each component's first-order estimate by position (attribution patching: one
    forward and backward for both of its sweeps)."""

    def __init__(self, model, batch: TaskBatch, metric):
        self.model, self.batch, self.metric = model, batch, metric
        self.estimates: dict[str, torch.Tensor] = {}

    def names(self) -> list[str]:
        return [name for component in ("heads", "mlps") if component == "heads" or has_mlps(self.model)
                for name in COMPONENTS[component].names(self.model)]

    @cached_property
    def clean(self) -> Run:
        return Run.make(self.model, self.batch.clean, self.metric, self.names(), starts=False)

    @cached_property
    def corrupted(self) -> Run:
        return Run.make(self.model, self.batch.corrupted, self.metric)

    def contrast(self, component: str) -> Contrast:
        return prepare(self.model, self.batch.clean, self.batch.corrupted, self.metric,
                       COMPONENTS[component].names(self.model), base_run=self.corrupted, clean_run=self.clean)

    def estimate(self, component: str, by_position: bool) -> torch.Tensor:
        """The component's attribution-patching estimate, [n_layers, pos(, n_heads)] by position, its
        sum over positions (the estimate of patching every position: it is linear) without."""
        if component not in self.estimates:
            self.estimates[component] = patch_components(self.model, self.batch.clean, self.batch.corrupted,
                                                         self.metric, component, by_position=True,
                                                         method="attribution")
        found = self.estimates[component]
        return found if by_position else self.corrupted.baseline + (found - self.corrupted.baseline).sum(dim=1)


def patch_sweep(runs: TaskRuns, component: str, by_position: bool, screen: Screen | None) -> pd.DataFrame:
    """One patching sweep of the task as a frame (``patching_frame``'s, with ``exact``): every cell
    exact without a ``screen``, else screened (``screened_patches`` on the shared runs)."""
    contrast = runs.contrast(component)
    if screen is None:
        values = component_patches(contrast, component, Options(), by_position=by_position)
        exact = torch.ones_like(values, dtype=torch.bool)
    else:
        found = screened_patches(runs.model, runs.batch.clean, runs.batch.corrupted, runs.metric, component,
                                 by_position=by_position, screen=screen, estimate=runs.estimate(component, by_position),
                                 contrast=contrast)
        values, exact = found.values, found.exact
    dims = {"heads": ("layer", "pos", "head") if by_position else ("layer", "head"),
            "mlps": ("layer", "pos") if by_position else ("layer",)}[component]
    return patching_frame(values, dims).assign(exact=exact.flatten().cpu().numpy())


def edge_sweep(runs: TaskRuns, senders: list[tuple[int, int]], screen: Screen | None,
               attribution: pd.DataFrame | dict) -> pd.DataFrame:
    """Path patching from ``senders`` to every later head and the logits -> ``path_patch``'s frame
    with ``exact``: every edge exact without a ``screen`` or where EAP was refused (``attribution``
    a dict), else screened by EAP's ``attribution`` (``screened_path_patch``)."""
    pair = (runs.model, runs.batch.clean, runs.batch.corrupted, runs.metric)
    if screen is None or isinstance(attribution, dict):
        return path_patch(*pair, senders=senders, base_run=runs.corrupted,
                          source_run=runs.clean).assign(exact=True)
    found = screened_path_patch(*pair, senders=senders, screen=screen, attribution=attribution["attribution"],
                                base_run=runs.corrupted, source_run=runs.clean)
    return found.drop(columns="attribution")


def analyse_task(model, task: Task, *, top: int = 3, screen: Screen | None = DEFAULT_SCREEN,
                 split: PromptSplit | bool = True, ablation: str = "mean_corrupted", seed: int = 0,
                 memory_mb: float | None = None, progress: bool | None = None,
                 steps: Step | None = None, landed: Callable[[TaskAnalysis], object] | None = None) -> TaskAnalysis:
    """The ``TaskAnalysis`` of ``task`` on ``model``. ``screen``: the rule choosing the patching
    cells and path-patching edges measured exactly (see the module docstring); None: all of them.
    ``split``: True (``task_split(task, seed)``), a ``PromptSplit`` of the task's prompts, or False
    (in-sample: choose and measure on every prompt). ``ablation``: how the top writers' control
    ablates (``task_ablation``: ``mean_corrupted`` by default; plain ``mean`` over several templates
    is refused before any step). ``seed``: the split's, the control's draws and every interval's.
    ``steps``: a store of finished steps (``analyses.core.steps.Steps`` made for ``task_inputs``),
    called ``steps(name, compute)`` for each of ``STEPS``: it gives the finished value or computes
    it and keeps it; None computes every step. The senders of path patching are the ``top`` heads
    by |exact head patching - corrupted| (among those measured exactly), the top writers the ``top``
    heads by |DLA|, each chosen on the selection split. The parts ``task_plan`` leaves out are not
    computed. ``landed``: called after each step (the first: the metric, the clean and corrupted
    runs) with the analysis so far (``task_analysis``: the later steps pending), e.g. to rewrite
    the page (``page_writer``); the last call's, after the measured step, is whole. ``memory_mb``,
    ``progress``: the execution's (``analyses.core.execution``; None: the current one's)."""
    with executing(memory_mb, progress):
        left = task_plan(model, task)
        split = task_split(task, seed) if split is True else (split or None)
        chosen_on = task.subset(split.selection) if split is not None else task
        measured_on = task.subset(split.measurement) if split is not None else task
        measure_batch = task_batch(model, measured_on)
        reference, replaced_by = task_ablation(measured_on, measure_batch, ablation)  # a refusal before any step
        batch = task_batch(model, chosen_on)
        metric = task_metric(chosen_on, batch.last)
        runs = TaskRuns(model, batch, metric)
        with_mlps, with_dla = has_mlps(model), task.metric == "logit_diff" and DLA not in left
        shape = task_shape(model, (batch, measure_batch if split is not None else None), measured_on, top, screen,
                           with_dla, CIRCUIT not in left, reference is not None)
        plan = steps_run(model, with_dla, CIRCUIT not in left)
        step = ClockedSteps(steps or _compute, task_estimate(shape, plan))
        record = {"method": ablation, "reference": replaced_by, "tested": "top writers by DLA" if with_dla else
                  "top heads by patching"}
        done, drawn = {}, {}

        def so_far() -> TaskAnalysis:
            return task_analysis(task, done, plan, step, screen=screen, left=left, split=split, ablation=record,
                                 drawn=drawn)

        def finish(name: str, compute: Callable[[], object]) -> object:
            """Step ``name``'s value (``step``: read back or computed), then the analysis so far to ``landed``."""
            done[name] = step(name, compute)
            if landed is not None:
                landed(so_far())
            return done[name]

        step.timed("metric", lambda: runs.clean, shape.selection, "the clean run")  # the metric step's first forward
        values = finish("metric", lambda: {"clean": runs.clean.baseline, "corrupted": runs.corrupted.baseline})
        heads = finish("heads", lambda: patch_sweep(runs, "heads", False, screen))
        finish("heads_by_pos", lambda: patch_sweep(runs, "heads", True, screen))
        if with_mlps:
            finish("mlps", lambda: patch_sweep(runs, "mlps", False, screen))
            finish("mlps_by_pos", lambda: patch_sweep(runs, "mlps", True, screen))
        writers = (top_heads(finish("dla", lambda: task_dla(model, chosen_on, batch, seed)), "dla", top) if with_dla
                   else [])
        exact = heads[heads["exact"].astype(bool)]
        senders = top_heads(exact.assign(moved=exact["metric"] - values["corrupted"]), "moved", top)
        circuit = []
        if CIRCUIT not in left:
            for name in CIRCUIT_STEPS:  # their edges known now
                step.at_start(name, TASK_COSTS[name](shape, senders))
            circuit_steps(runs, senders, screen, finish)
            edges = done["path_patching"]
            circuit = circuit_heads(edges[edges["exact"].astype(bool)])
        chosen = {"patching": senders, "dla": writers, "circuit": circuit}
        tested = writers or senders
        with_reference = (measured_on, measure_batch, reference)
        step.at_start("measured", measured_cost(shape, list(dict.fromkeys(sum(chosen.values(), []))), tested))
        finish("measured", lambda: measure_chosen(model, with_reference, chosen, tested, ablation, with_dla, seed))
        return so_far()


def task_analysis(task: Task, done: dict, plan: list[str], step: ClockedSteps, *, screen: Screen | None,
                  left: dict[str, str], split: PromptSplit | None, ablation: dict, drawn: dict) -> TaskAnalysis:
    """The ``TaskAnalysis`` as far as the finished steps ``done`` (step -> value; the metric's at
    least) go, of the steps ``plan``: each pending one's frames None, named in ``pending`` with its
    estimate (``step``'s); the circuit's edges once path patching is done, with the attributions
    finished so far; ``cost``: ``step.record()``, which ends the clock of the step just finished;
    ``drawn``: the run's figures drawn so far (``TaskAnalysis.drawn``)."""
    edges, agreement = circuit_edges(done["path_patching"], done) if "path_patching" in done else (None, {})
    measured = done.get("measured", {})
    return TaskAnalysis(task, done["metric"], done.get("heads"), done.get("heads_by_pos"), done.get("mlps"),
                        done.get("mlps_by_pos"), measured.get("dla"), edges, agreement, screen, left, split, measured,
                        ablation, step.record(), tuple(plan),
                        {name: step.estimate.step_words(name) for name in plan if name not in done}, drawn)


def task_shape(model, batches: tuple[TaskBatch, TaskBatch | None], measured_on: Task, top: int,
               screen: Screen | None, with_dla: bool, with_circuit: bool, with_reference: bool) -> TaskShape:
    """What the analysis's cost follows (``analyses.report.task_cost.TaskShape``): ``batches``, the
    selection split's and the measurement split's (None: in-sample, both on the one batch), whose
    rows together are one FE; ``measured_on``: the prompts the measured step runs on; the others as
    ``analyse_task`` has them."""
    chosen, measure = batches
    rows = chosen.clean.numel() + (0 if measure is None else measure.clean.numel())
    measured_rows = chosen.clean.numel() if measure is None else measure.clean.numel()
    most = top * (1 + with_dla) + (2 * CIRCUIT_EDGES if with_circuit else 0)  # ``chosen``: with repeats, a bound
    return TaskShape(model, chosen.clean.numel() / rows, measured_rows / rows, chosen.clean.shape[1], top, screen,
                     most, len(task_measures(measured_on, (measure or chosen).last)), DEFAULT_DRAWS, with_dla,
                     with_reference)


def steps_run(model, with_dla: bool, with_circuit: bool) -> list[str]:
    """Which of ``STEPS`` the analysis runs, in order: the MLPs' on a model with MLPs, DLA's with it
    (``with_dla``), the circuit's where it is not left out (``with_circuit``)."""
    skipped = {*(() if has_mlps(model) else ("mlps", "mlps_by_pos")), *(() if with_dla else ("dla",)),
               *(() if with_circuit else CIRCUIT_STEPS)}
    return [name for name in STEPS if name not in skipped]


def top_heads(frame: pd.DataFrame, value: str, top: int) -> list[tuple[int, int]]:
    """The ``top`` heads of ``frame`` (rows with ``layer``, ``head``; a DLA frame's heads only) by
    |``value``|, largest first (ties in row order)."""
    if "kind" in frame:
        frame = frame[frame["kind"] == "head"]
    order = frame[value].abs().sort_values(ascending=False, kind="stable").index[:top]
    return [(int(frame.at[i, "layer"]), int(frame.at[i, "head"])) for i in order]


def circuit_heads(edges: pd.DataFrame, top: int = CIRCUIT_EDGES) -> list[tuple[int, int]]:
    """The heads of the ``top`` strongest edges (senders and receiving heads), in order of appearance."""
    found = []
    for row in strongest(edges, top).itertuples():
        found += [(int(row.sender_layer), int(row.sender_head))]
        if row.via != "logits":
            found += [(int(row.receiver_layer), int(row.receiver_head))]
    return list(dict.fromkeys(found))


def circuit_steps(runs: TaskRuns, senders: list[tuple[int, int]], screen: Screen | None, step: Step) -> None:
    """The circuit's steps (``CIRCUIT_STEPS``), through ``step``: EAP from ``senders``, path patching
    screened by it, EAP-IG."""
    pair = (runs.model, runs.batch.clean, runs.batch.corrupted, runs.metric)
    attribution = step("attribution", lambda: _attribution(ATTRIBUTIONS["attribution"], pair, senders))
    step("path_patching", lambda: edge_sweep(runs, senders, screen, attribution))
    step("attribution_ig", lambda: _attribution(ATTRIBUTIONS["attribution_ig"], pair, senders))


def circuit_edges(edges: pd.DataFrame, found: dict) -> tuple[pd.DataFrame, dict]:
    """Path patching's ``edges`` with each attribution of ``found`` (step -> its value, of those of
    ``ATTRIBUTIONS`` finished) beside it -> (a new edges frame, agreement): see ``TaskAnalysis``."""
    edges, agreement = edges.copy(), {}
    for column in (name for name in ATTRIBUTIONS if name in found):
        result = found[column]
        if isinstance(result, dict):  # e.g. a bridge that cannot split q/k/v per head: said on the page
            agreement[column] = result
            continue
        edges[column] = result["attribution"].to_numpy()
        scored = edges[edges["exact"].astype(bool)]
        if len(scored) >= 2:
            scored = scored[["effect", column]].rename(columns={column: "attribution"})
            agreement[column] = edge_agreement(scored, top_k=min(5, len(scored)))
    return edges, agreement


def measure_chosen(model, prompts: tuple, chosen: dict[str, list[tuple[int, int]]], tested: list[tuple[int, int]],
                   ablation: str, with_dla: bool, seed: int) -> dict:
    """What was chosen, measured on ``prompts`` (the measurement split: its ``Task``, ``TaskBatch``
    and ``task_ablation`` reference) -> {"values": its clean and corrupted metric, "measures": the
    task's measures there with their intervals (``task_measure_intervals``), "dla":
    ``task_dla`` (None without DLA), "heads": ``measured_heads`` of every chosen head, "control":
    ``tested`` (the top writers) against matched random sets, ``control_effects(...).summary()``
    ablated by ``ablation``, or {"refused": why}}; within the current execution."""
    task, batch, reference = prompts
    metric = task_metric(task, batch.last)
    contrast = prepare(model, batch.clean, batch.corrupted, metric, COMPONENTS["heads"].names(model))
    dla = task_dla(model, task, batch, seed) if with_dla else None
    try:
        control = control_effects(model, batch.clean, tested, ablation, metric, reference=reference,
                                  seed=seed).summary()
    except UserError as refusal:  # e.g. a layer with too few other heads to draw matched sets from
        control = {"refused": str(refusal)}
    measures = task_measure_intervals(model, task, batch, seed=seed)
    return {"values": {"clean": contrast.source_value, "corrupted": contrast.baseline}, "measures": measures,
            "dla": dla, "heads": measured_heads(contrast, chosen, dla, seed), "control": control}


def measured_heads(contrast: Contrast, chosen: dict[str, list[tuple[int, int]]], dla: pd.DataFrame | None,
                   seed: int) -> pd.DataFrame:
    """The chosen heads (``chosen``: why -> heads) measured on ``contrast``'s prompts: one row per head,
    ``layer``, ``head``, ``chosen_by`` (the reasons joined by '+'), its exact patching (``metric``,
    ``baseline``, ``effect``, ``ci_low``, ``ci_high``, ``n_prompts``: ``patch_effects``' row for that
    head) and, with ``dla``, its ``dla`` with ``dla_ci_low``, ``dla_ci_high`` (``dla_effects``' row).
    Within the current execution."""
    reasons: dict[tuple[int, int], list[str]] = {}
    for reason, heads in chosen.items():
        for head in heads:
            reasons.setdefault(head, []).append(reason)
    heads = list(reasons)
    scores = contrast.score([head_cells([head]) for head in heads], "measure chosen heads")
    low, high, n_prompts = contrast.intervals(scores, seed=seed)
    frame = pd.DataFrame({"layer": [l for l, _ in heads], "head": [h for _, h in heads],
                          "chosen_by": ["+".join(reasons[head]) for head in heads],
                          "metric": scores.values.cpu().double().numpy(), "baseline": contrast.baseline})
    frame["effect"] = frame["metric"] - frame["baseline"]
    frame["ci_low"], frame["ci_high"], frame["n_prompts"] = low.cpu().numpy(), high.cpu().numpy(), n_prompts
    if dla is not None:
        rows = dla[dla["kind"] == "head"].astype({"layer": int, "head": int}).set_index(["layer", "head"])
        keys = pd.MultiIndex.from_arrays([frame["layer"], frame["head"]])
        for column, name in (("dla", "dla"), ("ci_low", "dla_ci_low"), ("ci_high", "dla_ci_high")):
            frame[name] = rows[column].reindex(keys).to_numpy()
    return frame


def _attribution(method, pair: tuple, senders: list[tuple[int, int]]) -> pd.DataFrame | dict:
    """``method``'s attribution of the path-patched edges, as a one-column frame (``attribution``),
    or ``{"refused": why}`` where the model cannot take its edits; on the analysis's budget (the current execution's)."""
    try:
        return method(*pair, senders=senders)[["attribution"]]
    except UserError as refusal:
        return {"refused": str(refusal)}


def _figure(analysis: TaskAnalysis, name: str, caption: str, draw: Callable[[], Figure]) -> ReportFigure:
    """The page's figure ``name``: ``draw()`` the first time, then as ``analysis.drawn`` keeps it."""
    if name not in analysis.drawn:
        analysis.drawn[name] = ReportFigure(name, caption, png_bytes(draw(), caption))
    return analysis.drawn[name]


def task_sections(analysis: TaskAnalysis) -> list[Section]:
    """The page's sections: the task, the metric, patching, DLA, the circuit, the chosen heads; while
    steps are pending (``TaskAnalysis.pending``), first a section naming them with their estimates,
    and in the place of each section whose steps have not landed, its pending slot."""
    task = analysis.task
    about = [f"**{len(task)}** prompt pairs; metric **{task.metric}** at each prompt's last token; "
             f"{task.dropped} candidate words or prompts dropped for this tokenizer.",
             *([f"Note: {task.note}."] if task.note else []), split_text(analysis),
             f"- clean: `{task.clean[0]}`", f"- corrupted: `{task.corrupted[0]}`"]
    sections = [*pending_steps_section(analysis), *performance_section(analysis.performance),
                *left_out_section(analysis.left_out), Section("Task", "\n".join(about)), metric_section(analysis),
                landed_section(analysis, "Patching", "heads", PATCHING_STEPS, patching_section)]
    if "mlps" in analysis.steps:
        sections.append(landed_section(analysis, "MLP patching", "mlps", ["mlps"], lambda found: Section(
            "MLP patching", "Each MLP's output patched from the clean run (all positions).", table=found.mlps)))
    if "dla" in analysis.steps:
        sections.append(landed_section(analysis, "Direct logit attribution", "measured", ["measured"], dla_section))
    if "path_patching" in analysis.steps:
        sections.append(landed_section(analysis, "Circuit", "path_patching", CIRCUIT_STEPS, circuit_page))
    sections.append(landed_section(analysis, "Chosen heads, measured", "measured", ["measured"], chosen_section))
    return sections


def pending_words(analysis: TaskAnalysis, names) -> str:
    """The pending steps among ``names``, each with its estimate, in words."""
    return "; ".join(f"step `{name}`, estimated {analysis.pending[name]}" for name in names if name in analysis.pending)


def pending_steps_section(analysis: TaskAnalysis) -> list[Section]:
    """The section that opens the page while steps are pending: the steps finished and each pending
    one with its estimate (none once the analysis is whole)."""
    if not analysis.pending:
        return []
    finished = ", ".join(f"`{name}`" for name in analysis.steps if name not in analysis.pending)
    return [Section("Steps pending", f"This run is still going: finished {finished}. The page is rewritten as each "
                                     "step lands (each file replaced whole). Pending, with the estimate of each:\n\n"
                    + "\n".join(f"- `{name}`: {words}" for name, words in analysis.pending.items()))]


def landed_section(analysis: TaskAnalysis, title: str, waits_for: str, shows: Sequence[str],
                   section: Callable[[TaskAnalysis], Section]) -> Section:
    """``section(analysis)`` once the step ``waits_for`` has landed, else the slot the section
    ``title`` holds on the page meanwhile, naming the pending steps of those it shows (``shows``)
    with their estimates."""
    if waits_for not in analysis.pending:
        return section(analysis)
    return Section(f"{title} (pending)", f"Pending: {pending_words(analysis, shows)}. The page is rewritten as each "
                                         "step lands.")


def noise_text(analysis: TaskAnalysis) -> str:
    """``NOISE`` where the measured step found the model does not perform the task, else nothing."""
    performance = analysis.performance
    return NOISE if performance is not None and not performance.performs else ""


def metric_section(analysis: TaskAnalysis) -> Section:
    """The metric's section: its table (``metric_table``) and the verdict on performance, or that
    the measures on the measurement split and the verdict are pending."""
    if analysis.performance is None:
        waiting = pending_words(analysis, ["measured"])
        return Section("Metric", "The metric on the unpatched runs of the prompts the heads are chosen on. The task's "
                                 "measures with their 95% intervals on the split the effects are measured on, and "
                                 f"whether the model performs the task, are pending: {waiting}.",
                       table=metric_table(analysis))
    return Section("Metric", "The task's measures on the unpatched runs and their paired difference (`clean - "
                             "corrupted`, prompt by prompt), with their 95% intervals over prompts on the split the "
                             f"effects are measured on. {analysis.performance.text}", table=metric_table(analysis))


def patching_section(analysis: TaskAnalysis) -> Section:
    """Head patching's table, the figures of the patching sweeps landed so far and the pending ones named."""
    sweeps = [("heads", analysis.heads, "denoising: each head's output patched clean into corrupted (all positions)",
               "head patching"),
              ("heads_by_pos", analysis.heads_by_pos, "denoising: each head at each position",
               "head patching by position"),
              ("mlps_by_pos", analysis.mlps_by_pos, "denoising: each MLP's output at each position",
               "MLP patching by position")]
    patched = [_figure(analysis, name, caption,
                       lambda frame=frame, title=title: patching_figure(frame, "metric", title))
               for name, frame, caption, title in sweeps if frame is not None]
    waiting = pending_words(analysis, PATCHING_STEPS)
    on = " on the selection split" if analysis.split is not None else ""
    values = analysis.values
    return Section("Patching", noise_text(analysis) + f"Corrupted-run metric{on} {values['corrupted']:.4f}, clean "
                   f"{values['clean']:.4f}; each cell is the metric with one component patched from the clean run."
                   + screen_note(analysis) + (f" Pending: {waiting}." if waiting else ""),
                   figures=patched, table=analysis.heads)


def dla_section(analysis: TaskAnalysis) -> Section:
    """Direct logit attribution on the measurement split."""
    return Section(
        "Direct logit attribution",
        f"Each component's direct contribution to the logit difference on the {measured_where(analysis)}: mean "
        "over prompts with its 95% interval, and its parts onto the answers' logit (`dla_answer`) and minus the "
        "distractors' (`dla_distractor`); hatched cells: the interval contains 0.",
        figures=[_figure(analysis, "dla", "direct logit attribution (hatched: 95% interval contains 0)",
                         lambda: dla_heatmap(analysis.dla))], table=analysis.dla)


NOISE = ("**Built on noise**: the model does not perform this task (see the top of the page), so what follows "
         "measures differences between runs the model does not tell apart; read no circuit or control claim into "
         "it.\n\n")


def performance_section(performance: Performance | None) -> list[Section]:
    """The banner that opens the page of a task the model does not perform (``Performance``), or
    none where it performs it or its measurement is pending (None)."""
    if performance is None or performance.performs:
        return []
    return [Section("The model does not perform this task", f"**{performance.text}**")]


def measured_where(analysis: TaskAnalysis) -> str:
    """Where the measured effects come from, in words."""
    return ("measurement split (prompts disjoint from those the heads were chosen on)" if analysis.split is not None
            else "prompts the heads were chosen on (in-sample: --no-split)")


def split_text(analysis: TaskAnalysis) -> str:
    """The Task section's sentence on selection and measurement."""
    if analysis.split is None:
        return ("**In-sample** (`--no-split`): the heads are chosen and their effects measured on the same prompts, "
                "so the chosen heads' effects are biased away from 0.")
    record = analysis.split.record()
    return (f"Heads are chosen on a **selection split** of {record['sizes']['selection']} prompts (the patching "
            f"sweeps, path patching) and measured on the disjoint **measurement split** of "
            f"{record['sizes']['measurement']} (DLA, the chosen heads, the control)"
            + (", each template split alike" if record["stratified"] else "") + f" (seed {record['seed']}).")


def metric_table(analysis: TaskAnalysis) -> pd.DataFrame:
    """The metric on the clean and corrupted runs of the selection split (without an interval), then
    on the measurement split (``all`` in-sample) each of the task's measures (``task_measures``: the
    metric and, for greater-than, the cutoff sharpness) on the clean and corrupted runs and their
    paired difference, each with its 95% interval over prompts (``task_measure_intervals``). While
    the measured step is pending: the first part alone (in-sample, its split ``all``)."""
    split = "all" if analysis.split is None else "selection"
    chosen = pd.DataFrame([{"run": run, "split": split, "measure": analysis.task.metric, "metric": value}
                           for run, value in analysis.values.items()])
    if "measures" not in analysis.measured:
        return chosen
    measured = analysis.measured["measures"].rename(columns={"value": "metric"})
    measured.insert(1, "split", "all" if analysis.split is None else "measurement")
    return measured if analysis.split is None else pd.concat([chosen, measured], ignore_index=True)


def chosen_figure(frame: pd.DataFrame) -> Figure:
    """The chosen heads' measured effects with their 95% intervals as error bars: exact patching's
    effect and, where measured, DLA."""
    columns = [("effect", "ci_low", "ci_high", "patching effect (metric - corrupted)")]
    if "dla" in frame:
        columns.append(("dla", "dla_ci_low", "dla_ci_high", "direct logit attribution"))
    figure = new_figure(figsize=(max(4.0, 0.5 * len(frame) + 2), 2.6 * len(columns)))
    labels = [f"L{l}H{h}" for l, h in zip(frame["layer"], frame["head"])]
    for ax, (value, low, high, title) in zip(figure.subplots(len(columns), 1, squeeze=False)[:, 0], columns):
        errors = [frame[value] - frame[low], frame[high] - frame[value]]
        ax.bar(labels, frame[value], yerr=errors, color="tab:blue", capsize=3)
        ax.axhline(0.0, color="black", linewidth=0.8)
        ax.set_title(title, fontsize="medium")
    return figure


def chosen_section(analysis: TaskAnalysis) -> Section:
    """The chosen heads measured, and the top heads against matched random sets."""
    heads, control = analysis.measured["heads"], analysis.measured["control"]
    ablation = analysis.ablation
    if isinstance(control, dict):
        verdict = f"Not computed: {control['refused']}"
    else:
        verdict = describe_control(control.iloc[0]) + "."
    noise = noise_text(analysis)
    text = (noise + f"Chosen on the selection split, measured on the {measured_where(analysis)}: the path-patching "
            "senders (`patching`: the heads whose patching moves the metric most), the top writers by |DLA| (`dla`) "
            "and the heads of the 5 strongest exact edges (`circuit`); each one's exact patching effect (metric - "
            "corrupted) and DLA with their 95% intervals.\n\n"
            f"**{ablation['tested'][:1].upper() + ablation['tested'][1:]} vs random heads**, each head's output "
            "replaced by "
            f"{ablation['reference']} (`{ablation['method']}`): {verdict}")
    return Section("Chosen heads, measured", text, table=heads,
                   figures=[_figure(analysis, "chosen", "chosen heads on the measurement prompts (95% intervals)",
                                    lambda: chosen_figure(heads))])


def circuit_page(analysis: TaskAnalysis) -> Section:
    """The circuit section: path patching from the top heads, the attributions' agreement with it."""
    agreement = "".join(
        f" {ATTRIBUTION_NAMES[column]} not computed: {found['refused']}" if "refused" in found else
        f" {ATTRIBUTION_NAMES[column]} vs path patching: Spearman {found['spearman']:.3f}, top-{found['top_k']} "
        f"overlap {found['top_k_overlap']:.2f}." for column, found in analysis.agreement.items())
    measured = analysis.edges[analysis.edges["exact"].astype(bool)]
    screened = (f" Screened by EAP: {len(measured)} of {len(analysis.edges)} edges path-patched exactly "
                f"({analysis.screen.describe('edges')}), the others at their EAP estimate (column exact); the "
                "agreement, the list and the figure are of the exact edges."
                if analysis.screen is not None and len(measured) < len(analysis.edges) else "")
    waiting = pending_words(analysis, ["attribution_ig"])
    noise = noise_text(analysis)
    return Section("Circuit", noise + "Path patching from the heads whose patching moves the metric most." + screened
                   + agreement + (f" {ATTRIBUTION_NAMES['attribution_ig']} pending: {waiting}." if waiting else "")
                   + "\n\n" + "\n".join(edge_lines_plain(measured)),
                   figures=[_figure(analysis, "circuit", "strongest path-patched edges",
                                    lambda: circuit_figure(measured, title="task circuit"))],
                   table=analysis.edges)


def sweep_counts(analysis: TaskAnalysis) -> dict[str, list[int]]:
    """For each patching sweep and the edges: [cells measured exactly, cells]."""
    frames = {"heads": analysis.heads, "heads_by_pos": analysis.heads_by_pos, "mlps": analysis.mlps,
              "mlps_by_pos": analysis.mlps_by_pos, "edges": analysis.edges}
    return {name: [int(frame["exact"].astype(bool).sum()), len(frame)] for name, frame in frames.items()
            if frame is not None}


def screen_note(analysis: TaskAnalysis) -> str:
    """The patching sections' sentence on the screen: its rule and what it measured exactly."""
    if analysis.screen is None:
        return " Every cell measured exactly."
    counts = sweep_counts(analysis)
    measured = ", ".join(f"{name} {done} of {total}" for name, (done, total) in counts.items() if name != "edges")
    return (f" **Screened by attribution**: every cell estimated to first order (attribution patching), measured "
            f"exactly in each sweep {analysis.screen.describe()} ({measured}); the other cells show their estimate "
            "(column exact). `--exact-all` measures every cell.")


def edge_lines_plain(edges: pd.DataFrame, top: int = 5) -> list[str]:
    """Markdown items for the ``top`` edges of largest |effect|."""
    lines = []
    for row in strongest(edges, top).itertuples():
        receiver = "logits" if row.via == "logits" else f"L{row.receiver_layer}H{row.receiver_head}"
        lines.append(f"- L{row.sender_layer}H{row.sender_head} -> {receiver} via {row.via}: effect {row.effect:+.4f}")
    return lines


def write_task_page(analysis: TaskAnalysis, out: Path, meta: dict) -> Path:
    """``out``: index.html (self-contained), report.md, figures/, the tables as CSV, meta.json, each
    file written whole (``write_report_files``), of the analysis as far as its steps have landed:
    a pending step's tables are not written yet, its sections are pending slots (``task_sections``),
    and meta.json's ``steps`` names the steps run and those pending (``performs_task`` None
    until the measured step lands)."""
    tables = {"metric.csv": metric_table(analysis), "heads.csv": analysis.heads,
              "heads_by_pos.csv": analysis.heads_by_pos, "chosen_heads.csv": analysis.measured.get("heads"),
              "edges.csv": analysis.edges, "mlps.csv": analysis.mlps, "mlps_by_pos.csv": analysis.mlps_by_pos,
              "dla.csv": analysis.dla}
    if isinstance(analysis.measured.get("control"), pd.DataFrame):
        tables["control.csv"] = analysis.measured["control"]
    title = f"interp task {analysis.task.name}"
    performance = analysis.performance
    meta = meta | {"screen": screen_record(analysis.screen) | {"exact_of_all": sweep_counts(analysis)},
                   "left_out": analysis.left_out, "split": split_record(analysis.split), "ablation": analysis.ablation,
                   "performs_task": None if performance is None else performance.performs,
                   "performance": None if performance is None else performance.text, "cost": analysis.cost,
                   "steps": {"run": list(analysis.steps), "pending": list(analysis.pending)}}
    return write_report_files(out, title, f"model {meta['model']}", task_sections(analysis), meta,
                              {name: frame for name, frame in tables.items() if frame is not None})


def page_writer(out: Path, meta: dict) -> Callable[[TaskAnalysis], Path]:
    """``analyse_task``'s ``landed`` for ``interp task``: each call writes the page of the analysis
    so far in ``out`` (``write_task_page``, with ``meta``); the first also says on stderr where the
    page is and how many steps are pending (unless the current execution's progress is False, as
    every progress line)."""
    written: list[Path] = []

    def land(analysis: TaskAnalysis) -> Path:
        path = write_task_page(analysis, out, meta)
        if not written and current().progress is not False:
            pending = len(analysis.pending)
            print(f"task: the page is at {path / 'index.html'}" + (f" ({pending} steps pending; rewritten as each "
                  "lands)" if pending else ""), file=sys.stderr, flush=True)
        written.append(path)
        return path

    return land
