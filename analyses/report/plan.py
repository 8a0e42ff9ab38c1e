"""A page's plan (DESIGN 2.1): which of its parts the model can run, known before the first sweep.

Each optional part of a page (the report's circuit, a task's path patching, direct logit
attribution) names what its steps need of the model (``analyses.core.hook_check.NEEDS``: an edit
reaching the output, each head's write being z @ W_O); ``analyses.core.hook_check.left_out`` asks
the hook self-test, once, before any sweep. A part the model cannot run is left out, and the page,
report.md and meta.json (``left_out``: part -> reason) say which and why, in the very line its step
would have refused with (``HookCheck.refusal``), instead of the command stopping half-way with
nothing written.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations
from typing import Callable, Sequence

from analyses.circuits.edges import QKV, VIAS, edges_of
from analyses.core.hook_check import HEAD_CONTRIBUTIONS, output_norm
from analyses.core.hook_names import has_mlps
from analyses.interventions.attribution import Screen
from analyses.interventions.cost import CostEstimate, StepCost, suffix_fe
from analyses.report.page import Section

# direct logit attribution splits each layer's attention output into its heads' z @ W_O, through
# the norm on it frozen where a block has one (``analyses.components.decompose``); its own check (the
# parts adding up to the final residual) refuses a model whose heads write otherwise, but only after
# the forward
DLA_NEEDS = (HEAD_CONTRIBUTIONS,)
DLA = "direct logit attribution"


def left_out_section(left: dict[str, str]) -> list[Section]:
    """The page's section naming each part left out (``left``: part -> the one-line reason), or
    none where every part ran."""
    if not left:
        return []
    lines = [f"- **{part}**: {reason}" for part, reason in left.items()]
    return [Section("Left out", "The hook self-test (`interp check`), run before any sweep, found that this model "
                    "cannot run these parts, so they were left out; every other part ran.\n\n" + "\n".join(lines))]


# ----------------------------------------------------------------------------- the report's cost
# One estimator per report step (the probe run, then each of ``analyses.report.build.REPORT_SECTIONS``), each the forward-
# equivalents (``analyses.interventions.cost``) of the code that runs the step, on the shapes alone.
@dataclass(frozen=True)
class ReportShape:
    """What the report's cost follows: the model; ``batch_rows``: the probes' rows (prompts x
    tokens: one FE); ``share``: the intervention probes' share of them; ``list_share``: that of the
    selection rows the page's lists are chosen on (``selection_probes``); ``role_share``: the share
    the roles are chosen on (the nulls' and the control probes' forwards); ``text_rows``: the texts'
    rows (0 on probes); ``view_rows``: the pattern views' rows (the display probe and the text);
    ``null_seeds``, ``pair_heads``, ``draws``: the null models, the most heads pairwise ablation
    covers, the control's random sets; ``circuit``: whether the circuit runs (not left out)."""

    model: object
    batch_rows: int
    share: float
    list_share: float
    role_share: float
    text_rows: int
    view_rows: int
    null_seeds: int
    pair_heads: int
    draws: int
    circuit: bool


def one_block_fe(model) -> float:
    """FE of a run of one block over the whole batch (a bridge reruns every block before it)."""
    return suffix_fe(model, model.cfg.n_layers - 1)


def probe_run_cost(shape: ReportShape) -> StepCost:
    """The probes' one forward (``probe_run``): 1 FE; that of the selection rows the report's lists
    are chosen on (``selection_probes``); and the pattern views' (``pattern_views``: one forward of
    the display probe and one of the text). A resumed report makes them again (they are not stored)."""
    return StepCost(1.0 + shape.list_share + shape.view_rows / shape.batch_rows)


def roles_cost(shape: ReportShape) -> StepCost:
    """Classification (read from the probe run; on texts, one forward of the texts) and the role
    nulls (``role_calibration``): on the probes the roles are chosen on, the control probes' forward and
    one per null model (``calibrate_roles``)."""
    return StepCost(shape.text_rows / shape.batch_rows + shape.role_share * (1 + shape.null_seeds))


def ablation_cost(shape: ReportShape) -> StepCost:
    """``head_effects``: the ablation's reference (one block of the intervention probes) and every
    head's and MLP's total effect, one run from its layer on each (``direct_and_total_effects``; the
    direct effects run no block)."""
    model = shape.model
    layers = [layer for layer in range(model.cfg.n_layers) for _ in range(model.cfg.n_heads)]  # every head's
    mlps = list(range(model.cfg.n_layers)) if has_mlps(model) else []
    return StepCost(shape.share * (one_block_fe(model) + sum(suffix_fe(model, layer) for layer in [*layers, *mlps])))


def calibration_cost(shape: ReportShape) -> StepCost:
    """``backup_frames`` (dormant heads and similarities read the probe run): the heads' first-order
    screen on the selection rows that choose the groups (a forward, ``list_share``; its backward is
    not counted); pairwise ablation of at most ``pair_heads`` role heads and their backup groups
    (``backup_report``), which heads is known only after the nulls: bounded by the earliest heads,
    each pair from the earlier head's layer on, at most one group per two heads, each from block 0;
    the pairs and each head alone (the excess is per prompt) run twice, on the selection rows and
    on the intervention probes."""
    model = shape.model
    earliest = [layer for layer in range(model.cfg.n_layers) for _ in range(model.cfg.n_heads)][:shape.pair_heads]
    pairs = sum(suffix_fe(model, min(a, b)) for a, b in combinations(earliest, 2))
    singles = sum(suffix_fe(model, layer) for layer in earliest)  # each head alone, for the excess per prompt
    groups = len(earliest) // 2 * suffix_fe(model, 0)
    return StepCost(shape.list_share) + StepCost((shape.share + shape.list_share) * (pairs + singles)
                                                 + shape.share * groups, at_most=True)


def control_cost(shape: ReportShape) -> StepCost:
    """``role_control``: the reference (one block) and the role heads with ``draws`` layer-matched
    random sets, each one run from the heads' earliest layer (``control_effects``): which layer is
    known only after the roles, so at most from block 0."""
    return StepCost(shape.share * one_block_fe(shape.model)) + \
        StepCost(shape.share * (shape.draws + 1) * suffix_fe(shape.model, 0), at_most=True)


def circuit_cost(shape: ReportShape, heads: list[tuple[int, int]] | None = None,
                 screen: Screen | None = None) -> StepCost | None:
    """``circuit_section``'s path patching among ``heads`` (the heads of a circuit role; None: not
    known yet, before the roles, so no estimate): the corrupted probes' run and what the probe run
    lacks (at most a forward each); per (sender, receiver layer, q/k/v) one block (step 1); per
    q/k/v edge one run from the receiver's layer (from its MLP where the receiver's moved z
    reaches ``hook_resid_mid`` alone); per logits edge the last block (``path_values``). With a
    ``screen``, edge attribution first (a forward of each prompt set, on the lists' rows, which choose
    the exact edges, and on the intervention probes) and at most every edge exact. The edges the page lists are chosen by edge attribution on the selection rows of the
    lists (``chosen_edges``: a forward of each prompt set, ``list_share``). 0 where the circuit is
    left out or no head has a circuit role."""
    if not shape.circuit or heads == []:
        return StepCost(0.0)
    if heads is None:
        return None
    model = shape.model
    edges = edges_of(model, heads, heads, VIAS).table.tolist()  # sender layer, head, receiver layer, head, via
    qkv = [VIAS.index(via) for via in QKV]
    step_one = {(s_layer, s_head, r_layer, via) for s_layer, s_head, r_layer, _, via in edges if via in qkv}
    fe = 2.0 + len(step_one) * one_block_fe(model)
    for _, _, layer, _, via in edges:
        fe += one_block_fe(model) if via not in qkv else suffix_fe(model, layer, after_attention=from_mid(model, layer))
    cost = StepCost(shape.share * fe + 2.0 * shape.list_share)  # ``chosen_edges``' two forwards
    # a screen: edge attribution and the gap's two forwards on the lists' rows, which choose the exact edges, and
    # edge attribution on the intervention probes, the estimate of the others
    return cost if screen is None else cost + StepCost(2.0 * shape.share + 4.0 * shape.list_share, at_most=True)


def role_qk_cost(shape: ReportShape, heads: list[tuple[int, int, str]] | None = None) -> StepCost | None:
    """``role_qk``'s forward: one run of the intervention probes through blocks 0..the last role head's
    layer (stopped inside it, counted whole), which every role head's split reads (``qk_heads``: None
    before the roles, so no estimate; [] where the model cannot run it or has no role head: none)."""
    if heads is None:
        return None
    last = max((layer for layer, _, _ in heads), default=-1)
    return StepCost(shape.share * (last + 1) / shape.model.cfg.n_layers)


def from_mid(model, layer: int) -> bool:
    """Whether path patching's run for a receiver in ``layer`` starts at its ``hook_resid_mid``
    (``edge_variants``: a block with one, and no norm on its attention output to recompute)."""
    return getattr(model.blocks[layer], "has_resid_mid", False) and output_norm(model, layer) is None


def no_forward_cost(shape: ReportShape) -> StepCost:
    """The components (read from the probe run; the OV circuits and the logit lens are weights and
    cached residuals): no block runs."""
    return StepCost(0.0)


REPORT_COSTS: dict[str, Callable[[ReportShape], StepCost | None]] = {
    "probe run": probe_run_cost, "roles": roles_cost, "ablation": ablation_cost, "calibration": calibration_cost,
    "control": control_cost, "circuit": circuit_cost, "qk": role_qk_cost,
    "components": no_forward_cost}


def report_estimate(shape: ReportShape, steps: Sequence[str], seconds_per_fe: float) -> CostEstimate:
    """The report's estimate before its first sweep: each of ``steps`` (the probe run and the chosen
    sections, in order) costed by its estimator in ``REPORT_COSTS``; the circuit's (None) waits for the roles."""
    return CostEstimate({step: REPORT_COSTS[step](shape) for step in steps}, seconds_per_fe)
