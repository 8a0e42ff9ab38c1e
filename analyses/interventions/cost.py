"""What a command's steps cost, said before the work: forward-equivalents and seconds.

A forward-equivalent (FE) is one forward of a command's batch (the report's probes, a task's
prompts) through every block, as ``benchmarks/bench_report.py`` counts them: a run of r rows (tokens
of prompts) through blocks l.. of an n_layers model is (r / the batch's rows) x (n_layers - l) /
n_layers FE; a run that starts after block l's attention (from its ``hook_resid_mid``) adds that
block's MLP share of its parameters instead of the whole block. A backward is not counted (as in
the benchmark), nor the unembedding.

Each command's steps get their FE from their shapes (the report's in ``analyses.report.plan``, a
task's in ``analyses.report.task_cost``); the seconds are FE x the seconds of one FE on this machine,
timed by the command's own first forward (``CostEstimate.timed_by``: the report's
probe run, 1 FE with its caches and the metric's readout, so the timing adds no forward; a task's clean
run of its selection prompts, which its metric step makes anyway; the
estimate then leaves out the unembedding's share in later steps beyond that run's, and any backward). ``CostEstimate`` holds both, prints them as one line per step, and
with each step's measured seconds (``StepClock``) is the record ``meta.json`` keeps.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

from analyses.core.execution import current
from analyses.interventions.engine import runs_suffix_only


@dataclass(frozen=True)
class StepCost:
    """A step's forward-equivalents: ``fe``; ``at_most``: ``fe`` is an upper bound (the step's work
    depends on what earlier steps find, e.g. how many heads have a role), else an estimate."""

    fe: float
    at_most: bool = False

    def __add__(self, other: "StepCost") -> "StepCost":
        return StepCost(self.fe + other.fe, self.at_most or other.at_most)


def mlp_share(block) -> float:
    """The share of a block's parameters in its MLP (0 for an attention-only block)."""
    mlp = getattr(block, "mlp", None)
    return 0.0 if mlp is None else sum(p.numel() for p in mlp.parameters()) / sum(p.numel() for p in block.parameters())


def suffix_fe(model, layer: int, after_attention: bool = False) -> float:
    """FE of one run of the whole batch from block ``layer`` on (``after_attention``: from its
    ``hook_resid_mid``), on a model that runs only those blocks (``runs_suffix_only``); a model that
    reruns the earlier blocks (a TransformerBridge) costs a whole forward (1)."""
    n_layers = model.cfg.n_layers
    if not runs_suffix_only(model):
        return 1.0
    if layer >= n_layers:
        return 0.0
    first = mlp_share(model.blocks[layer]) if after_attention else 1.0
    return (first + n_layers - 1 - layer) / n_layers


@dataclass
class CostEstimate:
    """Every step's ``StepCost`` (in the order the steps run; None for a step whose work follows
    from what the steps before it find, costed when it begins: ``at_start``) and the seconds of one
    FE; ``actual``: each step's measured seconds, filled in as the steps end (``StepClock``)."""

    steps: dict[str, StepCost | None]
    seconds_per_fe: float
    actual: dict[str, float] = field(default_factory=dict)
    later: set[str] = field(default_factory=set)
    clock: str = "the probe run"  # the run that timed one FE (``timed_by``)

    def at_start(self, step: str, cost: StepCost) -> None:
        """Cost ``step`` as it begins (it had no estimate, or a bound, before the first sweep) and print
        it, unless the current execution's progress is False (``--quiet``)."""
        self.steps[step] = cost
        self.later.add(step)
        if current().progress is not False:
            print(self.step_line(step, cost), file=sys.stderr, flush=True)

    def step_line(self, step: str, cost: StepCost | None) -> str:
        if cost is None:
            return f"  {step}: estimated when it begins (its work follows from what the steps before it find)"
        about = "<= " if cost.at_most else "~"
        return f"  {step}: {about}{cost.fe:.2f} FE, {about}{_clock(cost.fe * self.seconds_per_fe)}"

    def step_words(self, step: str) -> str:
        """``step``'s estimate as ``step_line`` says it, without the step's name: "~0.50 FE, ~1.2 s"."""
        return self.step_line(step, self.steps.get(step)).strip().removeprefix(f"{step}: ")

    def lines(self, what: str) -> list[str]:
        """The estimate as text: a head line, then one line per step."""
        known = [cost for cost in self.steps.values() if cost is not None]
        total = sum(cost.fe for cost in known)
        bounded = any(cost.at_most for cost in known)
        head = (f"{what} cost estimate: {'at most ' if bounded else ''}{total:.1f} forward-equivalents "
                f"x {self.seconds_per_fe:.3g} s = {'<= ' if bounded else '~'}{_clock(total * self.seconds_per_fe)} "
                "on this machine" + (" and the steps costed when they begin" if len(known) < len(self.steps) else "")
                + f" (timed by {self.clock}; any backward is left out)")
        return [head] + [self.step_line(name, cost) for name, cost in self.steps.items()]

    def timed_by(self, seconds: float, fe: float = 1.0, by: str = "the probe run") -> None:
        """The seconds of one FE, from a run of ``fe`` forward-equivalents that took ``seconds`` (``by``: it, in words)."""
        self.seconds_per_fe, self.clock = seconds / fe, by

    def show(self, what: str) -> None:
        """Print ``lines`` on stderr, unless the current execution's progress is False (``--quiet``)."""
        if current().progress is not False:
            print("\n".join(self.lines(what)), file=sys.stderr, flush=True)

    def record(self) -> dict:
        """``meta.json``'s record: seconds per FE, and per step the estimated FE (and whether it is
        an upper bound), the estimated seconds and the measured seconds (None for a step that
        did not run)."""
        return {"seconds_per_fe": self.seconds_per_fe,
                "timed": "one forward of the blocks, without the unembedding",
                "steps": {name: {"estimated_fe": None if cost is None else cost.fe,
                                 "at_most": None if cost is None else cost.at_most,
                                 "estimated": "when the step began" if name in self.later else "before the first sweep",
                                 "estimated_s": None if cost is None else cost.fe * self.seconds_per_fe,
                                 "actual_s": self.actual.get(name)}
                          for name, cost in self.steps.items()}}


def _clock(seconds: float) -> str:
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes:d}:{rest:02d}" if minutes else f"{seconds:.1f} s"


class StepClock:
    """Measures each step's seconds into ``estimate.actual``: ``begin(step)`` ends the step before."""

    def __init__(self, estimate: CostEstimate):
        self.estimate, self.step, self.start = estimate, None, 0.0

    def begin(self, step: str | None) -> None:
        now = time.perf_counter()
        if self.step is not None:
            self.estimate.actual[self.step] = self.estimate.actual.get(self.step, 0.0) + now - self.start
        self.step, self.start = step, now
