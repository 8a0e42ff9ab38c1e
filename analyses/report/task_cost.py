"""What ``interp task``'s steps cost, said before the work (issue 45): one estimator per step of
``analyses.report.task_page.STEPS``, each the forward-equivalents (``analyses.interventions.cost``)
of the code that runs the step, from the shapes and the options alone.

A task's FE is one forward of every prompt of the task (the selection and the measurement split's
clean prompts; in-sample, the task's): a step on the selection split costs its share of that
(``TaskShape.selection``), the measured step the measurement split's (``TaskShape.measurement``).
The clean run of the selection split, which the analysis makes first anyway, is the clock
(``CostEstimate.timed_by``). Where a step's work follows from what earlier steps find, its estimate is
an upper bound (``StepCost.at_most``): the cells and edges the attribution screen measures exactly
(every cell where ``--screen-share`` is finite, since any may reach the share; else the ``top_k``
costliest), and the circuit and the measured step before their heads are chosen (the earliest heads
bound them); those steps are costed again, exactly where they can be, as they begin
(``ClockedSteps.at_start``)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from analyses.circuits.edges import QKV, VIAS, edges_of
from analyses.circuits.path_patching import DEFAULT_IG_STEPS
from analyses.interventions.attribution import Screen
from analyses.interventions.cost import CostEstimate, StepClock, StepCost, suffix_fe
from analyses.report.plan import from_mid, one_block_fe

Head = tuple[int, int]


@dataclass(frozen=True)
class TaskShape:
    """What a task's cost follows: the model; ``selection`` / ``measurement``: the two splits' shares
    of the task's rows (prompts x tokens: one FE; in-sample both 1); ``n_pos``: the selection
    batch's positions (the by-position sweeps' cells); ``top``: the senders and the top writers;
    ``screen``: the attribution screen (None: every cell and edge exact); ``chosen``: the most heads
    the measured step measures; ``measures``: the task's measures (``task_measures``); ``draws``: the
    control's random sets; ``dla``: whether the measured step makes DLA's forward; ``reference``:
    whether the control's ablation reads a reference run (``mean_corrupted``'s corrupted prompts)."""

    model: object
    selection: float
    measurement: float
    n_pos: int
    top: int
    screen: Screen | None
    chosen: int
    measures: int
    draws: int
    dla: bool
    reference: bool


def every_head(model) -> list[Head]:
    """Every head, earliest layer first: the costliest to patch or measure first."""
    return [(layer, head) for layer in range(model.cfg.n_layers) for head in range(model.cfg.n_heads)]


def screened(cells: Sequence[float], screen: Screen | None) -> StepCost:
    """FE of the cells (each one's FE) a sweep measures exactly: all without a ``screen``; with one
    at most all where its share is finite (any cell may reach it), else its ``top_k`` costliest."""
    if screen is None:
        return StepCost(sum(cells))
    return StepCost(sum(cells) if math.isfinite(screen.share) else sum(sorted(cells, reverse=True)[:screen.top_k]),
                    at_most=True)


def sweep_cost(shape: TaskShape, units: int, by_position: bool, estimate: bool) -> StepCost:
    """A patching sweep (``patch_sweep``), ``units`` per layer (heads, or 1: the MLP): one run of the
    corrupted prompts from each cell's layer (``component_patches``; screened: ``screened_patches``),
    and with ``estimate`` and a screen, attribution patching's forward of each run (its backward not
    counted: ``TaskRuns.estimate``, made once for both of a component's sweeps)."""
    model = shape.model
    cells = [suffix_fe(model, layer) for layer in range(model.cfg.n_layers)
             for _ in range(units * (shape.n_pos if by_position else 1))]
    cost = screened(cells, shape.screen) + StepCost(2.0 if estimate and shape.screen is not None else 0.0)
    return StepCost(shape.selection * cost.fe, cost.at_most)


def metric_cost(shape: TaskShape) -> StepCost:
    """``TaskRuns.clean`` and ``TaskRuns.corrupted``: a forward of each."""
    return StepCost(2.0 * shape.selection)


def heads_cost(shape: TaskShape) -> StepCost:
    """Each head patched at every position, with the heads' attribution estimate."""
    return sweep_cost(shape, shape.model.cfg.n_heads, False, estimate=True)


def heads_by_pos_cost(shape: TaskShape) -> StepCost:
    """Each head patched at each position (the estimate is the heads step's)."""
    return sweep_cost(shape, shape.model.cfg.n_heads, True, estimate=False)


def mlps_cost(shape: TaskShape) -> StepCost:
    """Each MLP patched at every position, with the MLPs' attribution estimate."""
    return sweep_cost(shape, 1, False, estimate=True)


def mlps_by_pos_cost(shape: TaskShape) -> StepCost:
    """Each MLP patched at each position."""
    return sweep_cost(shape, 1, True, estimate=False)


def dla_cost(shape: TaskShape) -> StepCost:
    """``task_dla``: ``components_cache``'s forward of the clean prompts."""
    return StepCost(shape.selection)


def sender_reach(shape: TaskShape, senders: Sequence[Head] | None) -> tuple[float, bool]:
    """(FE of a forward up to the last sender's block: what edge attribution's source runs cache,
    whether it is a bound: ``senders`` None, not chosen yet, bounded by the last block)."""
    n_layers = shape.model.cfg.n_layers
    if senders is None:
        return 1.0, True
    return (max(layer for layer, _ in senders) + 1) / n_layers, False


def attribution_cost(shape: TaskShape, senders: Sequence[Head] | None = None) -> StepCost:
    """EAP from ``senders`` (``edge_attribution``, ``eap_scores``): a forward of the clean prompts up
    to the last sender, and one of the corrupted prompts (its backward not counted)."""
    reach, bound = sender_reach(shape, senders)
    return StepCost(shape.selection * (reach + 1.0), at_most=bound)


def attribution_ig_cost(shape: TaskShape, senders: Sequence[Head] | None = None) -> StepCost:
    """EAP-IG from ``senders`` (``eap_ig``): a forward of each run up to the last sender, and one per
    point of the integrated gradient (``DEFAULT_IG_STEPS``; their backwards not counted)."""
    reach, bound = sender_reach(shape, senders)
    return StepCost(shape.selection * (2.0 * reach + DEFAULT_IG_STEPS), at_most=bound)


def edge_fe(model, receiver_layer: int, via: int) -> float:
    """FE of path patching one edge (``path_values``' step 2): a logits edge the last block, a q/k/v
    edge a run from its receiver's layer (from its MLP where ``from_mid``)."""
    if VIAS[via] not in QKV:
        return one_block_fe(model)
    return suffix_fe(model, receiver_layer, after_attention=from_mid(model, receiver_layer))


def path_patching_cost(shape: TaskShape, senders: Sequence[Head] | None = None) -> StepCost:
    """Path patching from ``senders`` (None: not chosen yet, bounded by the ``top`` earliest heads) to
    every later head's q/k/v and the logits (``edge_sweep``): the corrupted run's reads it lacks
    (``prepare_paths``: every ``hook_z`` and the receivers' q/k/v, a forward), one block per (sender,
    receiver layer, q/k/v) (step 1: ``receiver_z``) and each edge's run (``edge_fe``). Screened by
    EAP, at most every edge (``screened``), each edge with its own step-1 block."""
    model = shape.model
    edges = edges_of(model, every_head(model)[:shape.top] if senders is None else senders, None, VIAS).table.tolist()
    qkv = [VIAS.index(via) for via in QKV]
    steps_one = {(s_layer, s_head, r_layer, via) for s_layer, s_head, r_layer, _, via in edges if via in qkv}
    runs = [edge_fe(model, layer, via) for _, _, layer, _, via in edges]
    if shape.screen is None:
        cost = StepCost(1.0 + len(steps_one) * one_block_fe(model) + sum(runs), at_most=senders is None)
    else:
        own = [fe + (one_block_fe(model) if via in qkv else 0.0) for fe, (*_, via) in zip(runs, edges)]
        cost = StepCost(1.0) + screened(own, shape.screen)
    return StepCost(shape.selection * cost.fe, cost.at_most)


def measured_cost(shape: TaskShape, chosen: Sequence[Head] | None = None,
                  tested: Sequence[Head] | None = None) -> StepCost:
    """``measure_chosen`` on the measurement split: its clean and corrupted runs (``prepare``), DLA's
    forward (``task_dla``, with DLA), the control's run and its reference's (``prepare_ablation``,
    ``replacements``: the corrupted prompts for ``mean_corrupted``) and the ``tested`` heads
    with ``draws`` layer-matched random sets, each one run from their earliest layer
    (``control_effects``), each measure's forward of the clean and the corrupted prompts
    (``task_measure_intervals``: the metric's, and one more per other measure) and each of the
    ``chosen`` heads patched, one run from its layer (``measured_heads``). None: not chosen yet,
    bounded by the earliest ``TaskShape.chosen`` heads and block 0."""
    model = shape.model
    heads = every_head(model)[:shape.chosen] if chosen is None else chosen
    first = 0 if tested is None else min(layer for layer, _ in tested)
    fe = (2.0 + shape.dla + 1.0 + shape.reference + 2.0 * shape.measures + (1 + shape.draws) * suffix_fe(model, first)
          + sum(suffix_fe(model, layer) for layer, _ in heads))
    return StepCost(shape.measurement * fe, at_most=chosen is None or tested is None)


TASK_COSTS: dict[str, Callable[[TaskShape], StepCost]] = {
    "metric": metric_cost, "heads": heads_cost, "heads_by_pos": heads_by_pos_cost, "mlps": mlps_cost,
    "mlps_by_pos": mlps_by_pos_cost, "dla": dla_cost, "attribution": attribution_cost,
    "path_patching": path_patching_cost, "attribution_ig": attribution_ig_cost, "measured": measured_cost}


def task_estimate(shape: TaskShape, steps: Sequence[str]) -> CostEstimate:
    """The task's estimate before its first sweep: each of ``steps`` (those of ``task_page.STEPS``
    that run, in order) costed by its estimator in ``TASK_COSTS``; its clock is set by the clean run."""
    return CostEstimate({step: TASK_COSTS[step](shape) for step in steps}, float("nan"))


class ClockedSteps:
    """A task's steps run through ``store`` (``task_page.Step``: the step store, or compute them),
    each one's seconds measured into ``estimate`` (``StepClock``); ``reused``: the steps the store
    read back finished instead of computing them (a resumed run): their estimate stays what they
    would cost, their seconds are the reading, and ``record`` marks them."""

    def __init__(self, store: Callable, estimate: CostEstimate):
        self.store, self.estimate = store, estimate
        self.clock = StepClock(estimate)
        self.reused: list[str] = []

    def __call__(self, name: str, compute: Callable[[], object]) -> object:
        self.clock.begin(name)
        ran = []
        value = self.store(name, lambda: ran.append(name) or compute())
        if not ran:
            self.reused.append(name)
        return value

    def timed(self, first: str, run: Callable[[], object], fe: float, what: str) -> None:
        """Begin step ``first`` with ``run()``, a forward of ``fe`` FE that the step makes anyway: its
        seconds set the estimate's clock (``CostEstimate.timed_by``); then print the estimate."""
        self.clock.begin(first)
        started = time.perf_counter()
        run()
        self.estimate.timed_by(time.perf_counter() - started, fe, by=what)
        self.estimate.show("task")

    def at_start(self, name: str, cost: StepCost) -> None:
        """Cost ``name`` again as it begins, from what the steps before it chose, and print it."""
        self.estimate.at_start(name, cost)

    def record(self) -> dict:
        """meta.json's ``cost``: ``CostEstimate.record``, each step with ``reused``; ends the last step's clock."""
        self.clock.begin(None)
        record = self.estimate.record()
        for name, step in record["steps"].items():
            step["reused"] = name in self.reused
        return record
