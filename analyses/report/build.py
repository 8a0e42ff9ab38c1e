"""``interp report``: the head-role report (DESIGN 4.4), one directory per model:

    head_roles.csv   one row per head: layer, head, each measure with _ci_low/_ci_high,
                     ablation_effect, role (the assigned roles joined by ';')
    report.md        the roles found, their ablation effects, the figures (figures/*.png)
    index.html       the same and more, interactive and self-contained (``analyses.report.page``):
                     click a head in the layer x head grid to see its pattern on a probe prompt
                     and on the report's text; the head table sorts and filters by role
    meta.json        model spec, family, impl, weights hash, prompts, seq_len, seed, thresholds,
                     fdr, null seeds, package versions

Beside the roles, the page has a calibration section (each score against its nulls, backup
groups, direct vs total effects, dormant heads, head similarity: ``analyses.report.calibration_figures``),
the role heads against layer-matched random heads (``role_control``: ``analyses.interventions.controls``)
a circuit section (the edges among the role heads: ``analyses.circuits.circuit``) and why the role
heads attend (each induction, previous-token and duplicate-token head's QK attribution on the
intervention probes, head_roles.csv's ``qk_*`` columns: ``analyses.report.qk_section``).

The roles are chosen on the selection rows of the probe draw, every effect measured on the
intervention rows (``probe_split``); the lists the page prints (the top direct logit attributions,
the circuit edges listed and drawn, the backup groups) are chosen on the selection rows' first
``LIST_PROMPTS`` (fewer where ``intervention_prompts`` is fewer: ``selection_probes``, ``CHOSEN_LISTS``)
and printed with their effects on the intervention rows.

Same model, prompts and seed -> the same bytes. Every file is written atomically.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Mapping, Sequence

import pandas as pd
import torch

from analyses.components.rollout import all_patterns
from analyses.core.budget import DEFAULT_MEMORY_MB, left_after
from analyses.core.hook_check import left_out, require
from analyses.report.calibration_figures import (DEFAULT_PAIR_HEADS, CalibrationSection, FirstProbes, calibration_section,
                                                  choosing_probes, probe_run)
from analyses.circuits.circuit import (CIRCUIT_ROLES, CircuitSection, circuit_figure, circuit_section, edge_lines,
                                       induction_pair, strongest)
from analyses.circuits.circuit import role_heads as circuit_role_heads
from analyses.circuits.edges import KEY_COLUMNS, VIAS
from analyses.circuits.path_patching import edge_attribution, path_needs
from analyses.components.decompose import (attention_vs_mlp_figure, component_hooks, components_cache,
                                           direct_logit_attribution, dla_heatmap, logit_lens, logit_lens_figure,
                                           next_token_answers)
from analyses.components.meaning import ov_scores
from analyses.roles.classify import (ALL_ROLES, DEFAULT_FDR, DEFAULT_THRESHOLD, MEANING_ROLES, MEASURES, ROLES, check_fdr,
                                     classify_heads, head_table)
from analyses.roles.backup import DEFAULT_MIN_EXCESS, DIRECT_EFFECTS, direct_effect_needs
from analyses.roles.nulls import DEFAULT_NULL_SEEDS
from analyses.report.meta import model_meta
from analyses.report.plan import (DLA, DLA_NEEDS, ReportShape, circuit_cost, left_out_section, report_estimate,
                                  role_qk_cost)
from analyses.report.qk_section import QK, qk_heads, qk_report_section, role_qk, with_qk
from analyses.components.qk import qk_refusal
from analyses.core.plots import attention_grid, png_bytes, role_heatmaps
from analyses.core.probes import RepeatedProbes, check_prompt_count, probes_for
from analyses.core.progress import progress_bar
from analyses.core.stats import bootstrap_ratio
from analyses.report.page import (PatternView, ReportFigure, Section, display_tokens, effect_text, explorer_data,
                                  explorer_html, head_table_html, interval_columns, write_report_files)
from analyses.components.rollout import ROLLOUT_NOTE, attention_rollout, rollout_figure
from analyses.interventions.attribution import Screen
from analyses.interventions.controls import ControlEffects, control_effects, control_figure
from analyses.interventions.run import Run
from analyses.core.metrics import loss_metric
from analyses.core.tokens import encode, leading_tokens
from analyses.interventions.ablation import ablation_reads
from analyses.interventions.cost import CostEstimate, StepClock
from interp.memory import release_freed_memory

# why a report needs at least 2 prompts (``check_prompt_count``)
PROMPTS_NEEDED_BY = ("the role nulls' t-test has prompts - 1 degrees of freedom, and the total effects mean-ablate "
                     "each prompt with the other prompts' mean")

# the probes every per-head intervention runs on (total and direct effects of every head and MLP, backup,
# path patching): each sweeps every head, so its cost grows with prompts x heads, while the roles
# are read from every probe in the one forward
DEFAULT_INTERVENTION_PROMPTS = 16
CONTROL_DRAWS = 50  # random head sets the role heads are compared with (one sweep of this many + 1 ablations)

DISPLAY_TEXT = "the cat sat on the mat. the cat sat on the mat."
DISPLAY_TOKENS = 64  # the page stores every head's pattern on at most this many tokens of its text
FIGURE_CAPTIONS = {
    "role_scores": "Role scores and ablation effect per head (layer x head; hatched: the ablation effect's 95% "
                   "interval contains 0)",
    "top_heads": "The top-scoring head of each role on one probe prompt",
    "layer_map": "Every head of one layer on the report's text",
    "rollout": "Attention rollout on the report's text (Abnar & Zuidema 2020)",
    "circuit": "Edges among the role heads chosen on the selection probes (edge attribution), drawn by their "
               "effect on the intervention probes (path patching, noising)",
}
CIRCUIT = "circuit"  # the report's parts a model may not run (``report_plan``)
CHOSEN_EDGES = 5  # the circuit edges the page lists (chosen on the selection probes: ``chosen_edges``)
CIRCUIT_FIGURE_EDGES = 12  # and those it draws
TOP_DLA = 5  # the components the page lists by direct logit attribution (chosen on the selection probes)
LIST_PROMPTS = 8  # the selection rows that choose the page's lists (``selection_probes``): half the default 16 measuring


@dataclass
class HeadReport:
    """table: one row per head (see ``head_table``); sections: the page, in order (``Section``:
    title, Markdown, page-only HTML, figures, table; append one to add it); meta: JSON-able."""

    table: pd.DataFrame
    sections: list[Section]
    meta: dict

    @property
    def figures(self) -> dict[str, bytes]:
        """Every section's figures: name -> PNG bytes."""
        return {f.name: f.png for section in self.sections for f in section.figures}


def build_report(model, *, model_name: str, n_prompts: int = 64, seq_len: int | None = None, seed: int = 0,
                 texts: Sequence[str] | None = None,
                 thresholds: float | Mapping[str, float] | None = DEFAULT_THRESHOLD, fdr: float | None = DEFAULT_FDR,
                 intervention_prompts: int = DEFAULT_INTERVENTION_PROMPTS, memory_mb: float = DEFAULT_MEMORY_MB,
                 progress: bool | None = None, circuit_screen: Screen | None = None) -> HeadReport:
    """Classify every head (on probes, or on ``texts``), calibrate the scores and run the causal
    checks on the probes, find the edges among the role heads, store every head's pattern on a
    probe and on a text, draw the figures. The probes are drawn once and serve all of it.

    Roles (``analyses.roles.classify.assign_roles``): with ``fdr`` (and probe scores), a role is a
    (head, role) whose score beats its nulls at that false-discovery rate and, with
    ``thresholds``, also reaches the threshold; ``fdr=None`` (or ``texts``, which the probe nulls
    do not describe) is the fixed rule: the threshold and an interval above chance.
    The probes are one draw of ``intervention_prompts + n_prompts``: the interventions run on the first
    ``intervention_prompts``, the roles are chosen on the other ``n_prompts`` (``choosing_probes``), so
    every effect is measured on prompts that did not choose the heads (meta.json: ``probe_split``).
    ``model_name``: the spec the model was loaded from, for meta.json; ``memory_mb``: what the report
    may add to the process: the run's store (the first ``intervention_prompts`` probes' activations)
    stays taken, each step gets the rest (``analyses.core.budget.left_after``); ``circuit_screen``: None
    path-patches every edge of the circuit exactly, a ``Screen`` only those it chooses by edge
    attribution (the others show their estimate, and the page says so).

    Before any sweep the hook self-test plans the report (``report_plan``): a part this model
    cannot run (the circuit, direct logit attribution) is left out, and the page, report.md and
    meta.json (``left_out``) say which and why; a model whose head ablations cannot run is refused
    in one line.

    After the probe run, before the first sweep, the report prints on stderr (unless ``progress`` is False) what each step
    will cost in forward-equivalents and seconds on this machine (``report_cost``); meta.json's
    ``cost`` keeps that estimate and each step's measured seconds."""
    check_prompt_count(n_prompts, f"prompts={n_prompts}", PROMPTS_NEEDED_BY)
    check_prompt_count(intervention_prompts, f"intervention_prompts={intervention_prompts}", PROMPTS_NEEDED_BY)
    if fdr is not None:
        check_fdr(fdr)
    left = report_plan(model)
    # one draw: the first intervention_prompts probes measure every effect, the other n_prompts choose the roles
    probes = probes_for(model, intervention_prompts + n_prompts, seq_len, seed=seed)
    shape, estimate = report_cost(model, probes, left, texts, intervention_prompts)
    steps = ReportSteps(progress, StepClock(estimate))
    steps.begin("probe run")  # the probes' one forward, which every step below reads
    started = time.perf_counter()
    run = probe_run(model, probes, names=component_hooks(model, lens=True), intervention_prompts=intervention_prompts,
                    memory_mb=memory_mb, progress=progress)
    estimate.timed_by(time.perf_counter() - started)  # the probe run is one FE: the clock for every step's estimate
    estimate.show("report", progress)
    first = FirstProbes.of(probes, run, run.metric, intervention_prompts)
    chosen_on, chosen_run = choosing_probes(probes, run, intervention_prompts)
    selection = selection_probes(model, probes, intervention_prompts, left_after(memory_mb, run.held_mb()),
                                 progress)
    step_mb = left_after(memory_mb, run.held_mb() + selection.run.held_mb())
    steps.begin("classification")
    scores = classify_heads(model, seed=seed, texts=texts, probes=None if texts else chosen_on, memory_mb=memory_mb,
                            progress=progress, run=None if texts else chosen_run)
    steps.begin("calibration")
    calibration = calibration_section(model, probes, fdr=fdr or DEFAULT_FDR, seed=seed, memory_mb=memory_mb,
                                      progress=progress, run=run, intervention_prompts=intervention_prompts,
                                      direct=DIRECT_EFFECTS not in left, choose=selection)
    calibrated = fdr is not None and not texts
    table = with_direct_effects(head_table(scores, total_effects(calibration), thresholds, fdr=fdr or DEFAULT_FDR,
                                           calibration=calibration.frames["calibration"] if calibrated else None),
                                calibration)
    steps.begin("control")
    control = role_control(model, table, first, seed=seed, memory_mb=step_mb, progress=progress)
    steps.begin("circuit")
    skipped = [role for role in ALL_ROLES if role not in CIRCUIT_ROLES]
    estimate.at_start("circuit", circuit_cost(shape, circuit_role_heads(table, skip=skipped), circuit_screen), progress)
    circuit = None if CIRCUIT in left else chosen_edges(model, circuit_section(
        model, table, first.probes, seed=seed, memory_mb=step_mb, progress=progress, run=first.run,
        skip_roles=skipped, screen=circuit_screen), selection, seed=seed, memory_mb=step_mb, progress=progress)
    steps.begin("qk")
    estimate.at_start("qk", role_qk_cost(shape, [] if QK in left else qk_heads(table)), progress)
    found_qk = None if QK in left else role_qk(model, table, first.probes, seed=seed, memory_mb=step_mb)
    table = table if found_qk is None else with_qk(table, found_qk)
    steps.begin("pattern views")
    views = pattern_views(model, probes, texts[0] if texts else DISPLAY_TEXT)
    meta = model_meta(model, model_name) | {"prompts": n_prompts, "seq_len": probes.seq_len, "seed": seed,
                                            "texts": len(texts) if texts else None, "thresholds": thresholds,
                                            "fdr": fdr if calibrated else None,
                                            "intervention_prompts": first.probes.n_prompts,
                                            "probe_split": probe_split(n_prompts, intervention_prompts, seed, bool(texts)),
                                            "null_seeds": list(DEFAULT_NULL_SEEDS),
                                            "circuit_screen": screen_meta(circuit), "left_out": left}
    steps.begin("figures")
    chosen = chosen_apart(n_prompts, first.probes.n_prompts, len(texts) if texts else None)
    sections = report_sections(table, views, role_rule(thresholds, fdr if calibrated else None) + " " + chosen)
    circuit_page = ([] if circuit is None else [circuit_report_section(circuit)]) + (
        [] if found_qk is None else [qk_report_section(found_qk, circuit, table)])
    steps.begin("components")
    sections[2:2] = [calibration_report_section(calibration), control_report_section(control, chosen), *circuit_page,
                     components_report_section(model, first.probes, component_effects(calibration), run=first.run,
                                               memory_mb=step_mb, progress=progress, dla=DLA not in left,
                                               selection=selection)]
    sections[:0] = left_out_section(left)
    steps.close()
    meta["cost"] = estimate.record()
    return HeadReport(table, sections, meta)


class ReportSteps:
    """The report's step-level bar, e.g. ``report: calibration  3/7``: which of ``STEPS`` it is on
    (shown per ``progress``, as every bar: ``analyses.core.progress``)."""

    STEPS = ("probe run", "classification", "calibration", "control", "circuit", "qk", "pattern views", "figures",
             "components")

    def __init__(self, progress: bool | None, clock: StepClock | None = None):
        self.bar = progress_bar(total=len(self.STEPS), progress=progress, desc="report", unit="step")
        self.started = False
        self.clock = clock

    def begin(self, step: str) -> None:
        """Mark the step before as done and ``step`` (one of ``STEPS``, in order) as running; the
        memory the step before freed goes back to the system (``release_freed_memory``), so a
        step's peak is its own tensors, not its own plus the holes earlier steps left in the heap."""
        release_freed_memory()
        if self.clock is not None:
            self.clock.begin(step)
        self.bar.set_description_str(f"report: {step}", refresh=False)
        if self.started:
            self.bar.update()  # shows the new step's name with the count of those done
        else:
            self.bar.refresh()
        self.started = True

    def close(self) -> None:
        if self.clock is not None:
            self.clock.begin(None)
        self.bar.update()
        self.bar.close()


def report_plan(model) -> dict[str, str]:
    """The report's plan, from the hook self-test, before any sweep: each part this model cannot
    run (``CIRCUIT``: the composition scores and path patching; ``DLA``; ``DIRECT_EFFECTS``: the
    heads' direct effects and self-repair; ``QK``: the role heads' QK attribution, which needs interp's
    own attention, ``qk_refusal``) -> why, in one line. Refuses in one line a model whose
    head ablations cannot run: the head table's ablation effects and the calibration are made of them."""
    require(model, "hook_z", "the report's head ablations")
    left = left_out(model, {CIRCUIT: path_needs(VIAS), DLA: DLA_NEEDS, DIRECT_EFFECTS: direct_effect_needs(model)})
    refusal = qk_refusal(model)
    return left if refusal is None else left | {QK: refusal}


def report_cost(model, probes: RepeatedProbes, left: dict[str, str], texts: Sequence[str] | None,
                intervention_prompts: int) -> tuple[ReportShape, CostEstimate]:
    """The report's shape (``analyses.report.plan.ReportShape``) and its cost estimate
    (``report_estimate`` over ``ReportSteps.STEPS``), its clock set by the probe run (``CostEstimate.timed_by``)."""
    first = min(intervention_prompts, probes.n_prompts)
    view_rows = (len(display_probe(probes)[:DISPLAY_TOKENS])
                 + len(leading_tokens(model, texts[0] if texts else DISPLAY_TEXT, DISPLAY_TOKENS)))
    share = first / probes.n_prompts
    lists = list_prompts(intervention_prompts, probes.n_prompts - first) / probes.n_prompts  # ``selection_probes``
    shape = ReportShape(model, probes.tokens.numel(), share, lists, 1.0 - share if share < 1 else 1.0,  # ``choosing_probes``
                        encode(model, list(texts)).tokens.numel() if texts else 0, view_rows, len(DEFAULT_NULL_SEEDS),
                        DEFAULT_PAIR_HEADS, CONTROL_DRAWS, CIRCUIT not in left)
    return shape, report_estimate(shape, ReportSteps.STEPS, float("nan"))


def list_prompts(intervention_prompts: int, selection_rows: int) -> int:
    """How many of the ``selection_rows`` choose the report's lists: ``LIST_PROMPTS``, or as many as
    the intervention probes or the selection rows where those are fewer."""
    return min(LIST_PROMPTS, intervention_prompts, selection_rows)


def selection_probes(model, probes: RepeatedProbes, intervention_prompts: int, memory_mb: float,
                     progress: bool | None = None) -> FirstProbes:
    """The selection rows' first ``list_prompts`` probes, their loss metric on the predictable
    tokens and a ``Run`` of them keeping what the report's choices read: the ablation's hooks (the backup pairs and their
    heads' first-order screen, ``calibration_frames(choose=...)``) and the decomposition's
    (``component_hooks`` with the lens: the top direct logit attribution). One forward of these rows;
    the circuit's edge attribution runs its own (``chosen_edges``)."""
    selection = probes.after(intervention_prompts)
    chosen = selection.first(list_prompts(intervention_prompts, selection.n_prompts))
    metric = loss_metric(chosen.tokens, chosen.predictable)
    names = [*ablation_reads(model, "mean_aligned"), *component_hooks(model, lens=True)]
    run = Run.make(model, chosen.tokens, metric, list(dict.fromkeys(names)), memory_mb=memory_mb, progress=progress,
                   desc="selection probes")
    return FirstProbes(chosen, run, metric)


def chosen_edges(model, circuit: CircuitSection, selection: FirstProbes, *, seed: int = 0,
                 memory_mb: float = DEFAULT_MEMORY_MB, progress: bool | None = None) -> CircuitSection:
    """The circuit with each edge's edge-attribution estimate (EAP, noising, on the induction pair of
    ``selection``'s probes: two forwards and a backward, the cheaper screen of the exact sweep) as
    ``chosen_by``, by which the report chooses the edges it prints and draws (``CHOSEN_EDGES``, the
    figure's ``top``), their effects those path-patched on the intervention probes; the figure redrawn
    from them."""
    if circuit.edges.empty:
        return circuit
    clean, corrupted, metric = induction_pair(selection.probes, seed)
    screen = edge_attribution(model, clean, corrupted, metric, senders=circuit.senders, receivers=circuit.receivers,
                              via=VIAS, direction="noise", memory_mb=memory_mb, progress=progress)
    edges = circuit.edges.merge(screen[[*KEY_COLUMNS, "attribution"]].rename(columns={"attribution": "chosen_by"}),
                                on=KEY_COLUMNS, how="left")
    patched = edges[edges["exact"].astype(bool)]
    shown = strongest(patched, CIRCUIT_FIGURE_EDGES, "chosen_by")
    title = ("edges chosen by edge attribution on the selection probes; width = |effect| by path patching (noise) on "
             "the intervention probes" + (f"\nnot drawn: the {len(edges) - len(patched)} edges left at their EAP "
                                         "estimate" if len(patched) < len(edges) else ""))
    figure = circuit_figure(shown, top=CIRCUIT_FIGURE_EDGES, title=title) if len(shown) else None
    return replace(circuit, edges=edges, figure=figure)


def probe_split(n_prompts: int, intervention_prompts: int, seed: int, texts: bool = False) -> dict:
    """meta.json's record of how the probes are split (DESIGN 4.12): one draw of ``probes_for(model,
    intervention_prompts + n_prompts, seq_len, seed)``, rows [0, intervention_prompts) measuring every
    effect and the other rows choosing the roles (on ``texts``, the texts choose them and the selection
    rows serve the calibration's nulls): two disjoint sets of prompts (half-open row ranges), and
    ``lists`` the selection rows that choose the page's lists (``selection_probes``)."""
    total = intervention_prompts + n_prompts
    lists = intervention_prompts + list_prompts(intervention_prompts, n_prompts)
    return {"probes_drawn": total, "seed": seed, "measurement": [0, intervention_prompts],
            "selection": [intervention_prompts, total], "lists": [intervention_prompts, lists], "disjoint": True,
            "rule": ("the roles are chosen on the texts (the selection rows give the calibration's null bands)"
                     if texts else "the roles (classification, nulls, false-discovery rate) are chosen on the "
                     "selection rows") + "; " + CHOSEN_LISTS + "; every ablation, control, circuit and component "
                    "effect is measured on the measurement rows"}


# how the report's lists are chosen on the selection rows (meta.json's probe_split rule, the guide)
CHOSEN_LISTS = (f"the lists the page prints are chosen on the first {LIST_PROMPTS} selection rows (as many as the "
                "intervention probes where those are fewer): the top-5 "
                "direct logit attribution (exact DLA there), the circuit edges printed and drawn (edge attribution, "
                "EAP, there: a screen, not the exact path-patching sweep), the backup pairs' heads (their first-order "
                f"ablation effect there) and backup groups (pairwise ablation there, pairs whose excess is at least "
                f"{DEFAULT_MIN_EXCESS} nats and whose excess interval excludes 0)")


def chosen_apart(n_prompts: int, intervention_prompts: int, texts: int | None = None) -> str:
    """One sentence for the page: every effect is measured on prompts that did not choose the heads."""
    where = f"the {texts} texts" if texts else f"the other {n_prompts} probes of the same draw"
    return (f"Every effect is measured on prompts that did not choose the heads: the {intervention_prompts} "
            f"intervention probes, while the roles were chosen on {where}, and the top direct logit "
            "attributions, the circuit edges listed and the backup groups on the first "
            f"{list_prompts(intervention_prompts, n_prompts)} probes of the selection rows (meta.json: probe_split).")


def screen_meta(circuit: CircuitSection | None) -> dict | None:
    """meta.json's record of the circuit's screen: its rule and how many edges it measured exactly
    (None without a screen, or where the circuit was left out)."""
    if circuit is None or circuit.screen is None:
        return None
    return {"top_k": circuit.screen.top_k, "share": circuit.screen.share, "edges": len(circuit.edges),
            "exact": int(circuit.edges["exact"].sum())}


def total_effects(calibration: CalibrationSection) -> pd.DataFrame:
    """``layer, head, ablation_effect, ablation_ci_low, ablation_ci_high, ablation_n_prompts``: each head's
    total ablation effect and its 95% interval over prompts, measured once by the calibration
    (position-aligned mean ablation, loss on the probes' predictable tokens)."""
    names = {"total": "ablation_effect", "total_ci_low": "ablation_ci_low", "total_ci_high": "ablation_ci_high",
             "n_prompts": "ablation_n_prompts"}
    return calibration.frames["effects"].rename(columns=names)[["layer", "head", *names.values()]]


def with_direct_effects(table: pd.DataFrame, calibration: CalibrationSection) -> pd.DataFrame:
    """The head table with each head's direct effect (downstream frozen, as the calibration measured it;
    NaN where the plan left direct effects out) and its 95% interval, ``direct_effect, direct_ci_low,
    direct_ci_high``, right after the ablation (total) effect's columns and ``causal``."""
    direct = calibration.frames["effects"][["layer", "head", "direct", "direct_ci_low", "direct_ci_high"]]
    merged = table.merge(direct.rename(columns={"direct": "direct_effect"}).astype({"head": int}), on=["layer", "head"],
                         how="left")
    at = list(table.columns).index("causal") + 1
    return merged[[*table.columns[:at], "direct_effect", "direct_ci_low", "direct_ci_high", *table.columns[at:]]]


def role_rule(thresholds, fdr: float | None) -> str:
    """How this report assigned roles, in one paragraph."""
    strong = ("" if thresholds is None else
              f" and its score is at least the threshold ({thresholds})")
    if fdr is not None:
        return (f"A head has a role when its score beats both nulls (random initialisation of the same architecture; "
                f"for content roles also the model on control probes whose second copy is shuffled) at a "
                f"Benjamini-Hochberg false-discovery rate of {fdr} over all heads and roles{strong}; the roles "
                "are the attention roles and, read from each head's OV circuit, copying and copy suppression, "
                "all in that one false-discovery family.")
    limit = DEFAULT_THRESHOLD if thresholds is None else thresholds
    return (f"A head has a role when its score is at least the threshold ({limit}) and its 95% bootstrap "
            "interval lies above chance (a uniform head's score).")


@dataclass
class RoleControl:
    """The report's control: ``role``'s heads (``heads``, at most half of each layer's) ablated against
    layer-matched random sets (``found``), or why there is none (``why``); ``left``: the role heads
    left out so that every layer keeps as many others to draw from."""

    role: str
    heads: list[tuple[int, int]]
    left: list[tuple[int, int]]
    found: ControlEffects | None = None
    why: str = ""


def role_control(model, table: pd.DataFrame, first: FirstProbes, *, n_draws: int = CONTROL_DRAWS, seed: int = 0,
                 memory_mb: float = DEFAULT_MEMORY_MB, progress: bool | None = None) -> RoleControl:
    """The heads of the role the page opens on (``start_measure``: induction, else previous-token)
    ablated as the head table's ablation effect is (position-aligned mean, the loss of the
    predictable tokens, on ``first``'s probes and run) against ``n_draws`` layer-matched random sets,
    in one batched sweep of ``n_draws + 1`` variants (``control_effects``). A layer where more than
    half the heads have the role keeps its highest-scoring half, so the random sets have heads to
    come from (the others are listed in ``left``)."""
    role = start_measure(table)
    ranked = table[table["role"].str.split(";").apply(lambda roles: role in roles)].sort_values(
        [role, "layer", "head"], ascending=[False, True, True])
    heads, left, per_layer = [], [], {}
    for layer, head in ranked[["layer", "head"]].itertuples(index=False):
        kept = per_layer.get(int(layer), 0) < model.cfg.n_heads // 2
        (heads if kept else left).append((int(layer), int(head)))
        per_layer[int(layer)] = per_layer.get(int(layer), 0) + kept
    if not heads:
        why = (f"no head has the role {role}, so there is no set to test" if not left else
               f"the {role} heads' layers have too few heads to draw a layer-matched random set from")
        return RoleControl(role, [], left, why=why)
    found = control_effects(model, first.probes, sorted(heads), "mean_aligned", first.metric, n_draws=n_draws,
                            seed=seed, run=first.run, memory_mb=memory_mb, progress=progress)
    return RoleControl(role, sorted(heads), sorted(left), found)


def control_report_section(control: RoleControl, chosen: str) -> Section:
    """The role heads against layer-matched random heads: the effects, the ratio and its interval;
    ``chosen``: where the heads were chosen (``chosen_apart``)."""
    title = f"{control.role.replace('_', '-').capitalize()} heads vs layer-matched random heads"
    if control.found is None:
        return Section(title, control.why.capitalize() + ".")
    found = control.found
    left = (f" {len(control.left)} more {control.role} heads ({', '.join(f'L{l}H{h}' for l, h in control.left)}) "
            "are left out so that each layer keeps at least as many other heads to draw from." if control.left else "")
    text = (f"The {control.role} heads ablated together (position-aligned mean, the rise in loss on the predictable "
            f"tokens of the first {found.n_prompts} probes) against {found.n_draws} random sets with as many heads "
            "in each layer (and key/value group) and none of the tested heads, all in one batched sweep." + left
            + " Each interval is a 95% percentile bootstrap: the tested effect over prompts; the random mean and "
            "the ratio over prompts and draws together, the same resamples for both. p: (1 + the random sets whose "
            "|effect| is at least the tested one's) / (1 + the random sets), each different set once. " + chosen
            + "\n\n- " + found.describe())
    return Section(title, text, figures=[ReportFigure("control", f"{title}: the tested effect against each random "
                                                      "set's", png_bytes(control_figure(found)))],
                   table=found.summary().drop(columns=["heads"]).round(4))


def calibration_report_section(calibration: CalibrationSection) -> Section:
    """The calibration section: null bands, backup groups, self-repair, dormant heads, similarity."""
    frames = calibration.frames
    groups = [f"- backup group {int(g.group)}: {g.heads.replace(';', ', ')} (single effects sum to "
              f"{g.sum_single:.2f} nats, together {effect_text(g.joint, g.joint_ci_low, g.joint_ci_high, 2)}, "
              f"excess {effect_text(g.excess, g.excess_ci_low, g.excess_ci_high, 2)})"
              for g in frames["groups"].itertuples()]
    dormant = frames["dormant"][frames["dormant"]["dormant"]]
    dormant_line = ", ".join(f"L{int(r.layer)}H{int(r.head)}" for r in dormant.itertuples()) or "none"
    text = ("Each score against its nulls; heads that back each other up (ablated together they cost more than "
            "the sum of their single effects); each head's direct effect (downstream frozen) against its total "
            "effect, whose gap is self-repair; dormant heads (tiny output, ablation a no-op). " + BACKUP_RULE + "\n\n"
            + "\n".join(groups or ["- backup groups: none"]) + f"\n- dormant heads: {dormant_line}")
    figures = [ReportFigure(name, calibration.captions[name], png_bytes(figure))
               for name, figure in calibration.figures.items()]
    return Section("Calibration", text, figures=figures, table=pair_table(frames["pairs"]))


BACKUP_RULE = ("Backup: the role heads with the largest first-order ablation effect on the selection probes (at most "
               f"{DEFAULT_PAIR_HEADS}) are ablated in pairs there and on the intervention probes; a pair backs up when "
               f"its excess (joint effect minus the sum of its single effects, per prompt) is at least "
               f"{DEFAULT_MIN_EXCESS} nats with a 95% "
               "interval excluding 0 on the selection probes, and the groups (connected pairs) are measured on the "
               "intervention probes (the table: every pair, 'excess' measured there, 'chosen excess' where it was "
               "chosen).")


def pair_table(pairs: pd.DataFrame) -> pd.DataFrame | None:
    """The pairwise ablation as the calibration section's table: ``a, b``, the single and joint
    effects and the excess (each 'e [low, high]', ``effect_text``) on the intervention probes, the
    excess on the probes that chose the groups, and whether the pair backs up; None without pairs."""
    if pairs.empty:
        return None

    def shown(value: str, stem: str) -> list[str]:
        return [effect_text(*cells, 3) for cells in zip(pairs[value], pairs[f"{stem}_ci_low"], pairs[f"{stem}_ci_high"])]

    return pd.DataFrame({"a": pairs["a"], "b": pairs["b"], "effect a": pairs["effect_a"], "effect b": pairs["effect_b"],
                         "joint": shown("joint", "joint"), "excess": shown("excess", "excess"),
                         "chosen excess": shown("chosen_excess", "chosen_excess"),
                         "backs up": pairs["backs"].map({True: "yes", False: "no"})})


def components_report_section(model, probes: RepeatedProbes, effects: pd.DataFrame, *, run: Run | None = None,
                              memory_mb: float = DEFAULT_MEMORY_MB, progress: bool | None = None,
                              dla: bool = True, selection: FirstProbes | None = None) -> Section:
    """The components section (``analyses.components.decompose``, ``analyses.components.meaning``): direct logit
    attribution to the predictable tokens, the logit lens, each head's and MLP's direct against total
    effect (attention vs MLP: ``effects``, the calibration's ablations of every head and MLP,
    ``component_effects``), and the copying / copy-suppression roles of the OV circuits, on
    ``probes`` (the report's first ``intervention_prompts``). ``run``: a ``Run`` of the probes whose
    ``component_hooks`` (with the lens) serve instead of a forward. ``dla=False`` leaves direct logit
    attribution out (a model whose heads' writes are not z @ W_O: ``analyses.report.plan``). ``selection``:
    the probes (with a ``Run`` holding ``component_hooks``) the top ``TOP_DLA`` components are chosen on
    (``top_dla``; None: on ``probes``, in-sample), their values printed from ``probes``."""
    tokens = probes.tokens
    answers, positions = next_token_answers(tokens)
    cache = (components_cache(model, tokens, lens=True) if run is None else
             run.read(component_hooks(model, lens=True)))
    figures, attribution = [], "Which components write the answer."
    if dla:
        means = predictable_dla(model, probes, cache)
        top = top_dla(means if selection is None else
                      predictable_dla(model, selection.probes, selection.run.read(component_hooks(model, lens=True))),
                      means)
        figures.append(ReportFigure("dla", "Direct logit attribution to the predictable tokens (mean, layer x head; "
                                    "MLPs right; hatched: its 95% interval over the probes contains 0)",
                                    png_bytes(dla_heatmap(means))))
        attribution += (
            " **Direct logit attribution**: each head's, MLP's and embedding's "
            "contribution to the logit of the correct next token on the predictable second-copy tokens, with the "
            "final norm frozen at the clean run's scale (TransformerLens's convention; the parts add up to the "
            f"logit{', before the final soft cap' if means.attrs['logits'] != 'as output' else ''}). The largest, "
            "chosen on the first probes of the selection rows and measured on the intervention probes:\n\n"
            + "\n".join(f"- {r.component}: {effect_text(r.dla, r.ci_low, r.ci_high, 2)}" for r in top.itertuples()))
    lens = logit_lens(model, cache, answers, positions=positions, where=probes.predictable[:, 1:], memory_mb=memory_mb)
    del cache
    roles = ov_scores(model, progress=progress, memory_mb=memory_mb)
    per_kind = effects.groupby("kind")[["direct", "total"]].sum(min_count=1)
    direct = effects["direct"].notna().any()  # the direct effects, where the plan kept them
    text = (attribution
            + ("\n\n**Attention vs MLP**: each head and MLP ablated alone as in the calibration (position-aligned "
               "mean), its direct effect (everything downstream frozen) against its total effect, as the rise in the "
               "loss on the predictable tokens; summed over the heads the direct effects are "
               + f"{per_kind.loc['head', 'direct']:+.2f} nats (total {per_kind.loc['head', 'total']:+.2f}), over the MLPs "
               + (f"{per_kind.loc['mlp', 'direct']:+.2f} (total {per_kind.loc['mlp', 'total']:+.2f})"
                  if "mlp" in per_kind.index else "nothing (the model has none)") + "." if direct else "")
            + " **Logit lens**: the residual entering each block decoded as if it were the last. **What heads "
            "move** (table): copying read from each head's OV circuit on the tokens (the eigenvalues of W_E W_V "
            "W_O W_U; copy suppression is its negative) and the share of tokens whose own logit tops (bottoms) "
            "their row. The roles copying and copy_suppression are in the head table, decided against their "
            "random-initialisation nulls in the same false-discovery family as the attention roles.")
    figures += [ReportFigure("logit_lens", "The logit lens on the predictable tokens",
                             png_bytes(logit_lens_figure(lens))),
                *([ReportFigure("attention_vs_mlp", "Direct against total effect of ablating every head and MLP (nats)",
                                png_bytes(attention_vs_mlp_figure(effects)))] if direct else [])]
    columns = ["layer", "head", "copying", "copying_topk", "suppression_topk"]
    return Section("Components", text, figures=figures, table=roles[columns].round(3))


def predictable_dla(model, probes: RepeatedProbes, cache: dict) -> pd.DataFrame:
    """``dla_intervals`` of the components' direct logit attribution to the next token on the probes'
    predictable tokens, from ``cache`` (``component_hooks`` with the lens, of ``probes``); ``attrs["logits"]``:
    the frame's ``logits`` note (``direct_logit_attribution``)."""
    answers, positions = next_token_answers(probes.tokens)
    found = direct_logit_attribution(model, cache, answers, positions=positions)
    found = found[probes.predictable[:, 1:].reshape(-1).repeat(found["component"].nunique()).cpu().numpy()]
    means = dla_intervals(found)
    means.attrs["logits"] = found["logits"].iloc[0]
    return means


def top_dla(chosen_on: pd.DataFrame, measured: pd.DataFrame, k: int = TOP_DLA) -> pd.DataFrame:
    """The ``k`` components of largest DLA in ``chosen_on`` (``dla_intervals`` of the probes that choose;
    ties by name), best first, with their rows of ``measured`` (``dla_intervals`` of other probes):
    the values the page prints, measured on prompts that did not choose them."""
    order = chosen_on.sort_values(["dla", "component"], ascending=[False, True])["component"].head(k)
    return measured.set_index("component").loc[order].reset_index()


def dla_intervals(found: pd.DataFrame) -> pd.DataFrame:
    """Each component's mean DLA over the (prompt, position) rows of a ``direct_logit_attribution``
    frame, pooled over prompts, with its 95% percentile bootstrap interval over prompts
    (``bootstrap_ratio``): one row per component, ``component, kind, layer, head, dla, ci_low, ci_high``,
    as ``dla_heatmap`` reads them (it hatches the cells whose interval contains 0)."""
    sums = found.groupby(["prompt", "component"])["dla"].sum().unstack("component")  # (prompts, components)
    counts = found.groupby("prompt").size() / found["component"].nunique()  # each prompt's rows per component
    mean, low, high = bootstrap_ratio(torch.tensor(sums.to_numpy()), torch.tensor(counts.loc[sums.index].to_numpy()))
    parts = found.drop_duplicates("component").set_index("component").loc[sums.columns, ["kind", "layer", "head"]]
    return parts.reset_index().assign(dla=mean.cpu().numpy(), ci_low=low.cpu().numpy(), ci_high=high.cpu().numpy())


def component_effects(calibration: CalibrationSection) -> pd.DataFrame:
    """Every head's and MLP's direct and total ablation effect, as the calibration measured them:
    ``component, kind, layer, head, total, direct, self_repair, baseline``."""
    return pd.concat([calibration.frames["effects"], calibration.frames["mlp_effects"]], ignore_index=True)


def circuit_report_section(circuit: CircuitSection) -> Section:
    """The circuit section: the strongest edges among the role heads, as lines and a graph."""
    how = ("Edges among the role heads: the composition score of the weights (Elhage et al. 2021) and exact path "
           "patching (noising one edge: the rise in loss on the predictable tokens).")
    if circuit.skipped:
        how += (f" The circuit is that of the probes' induction task: the {len(circuit.skipped)} role heads with none "
                f"of the roles {', '.join(CIRCUIT_ROLES)} (attention sinks, self, copying) are left out.")
    if circuit.edges.empty:
        return Section("Circuit", how + "\n\nNo head has a role the circuit covers, so there is no edge to show.")
    if circuit.screen is not None:
        how += (f" Screened: edge attribution (EAP) estimated all {len(circuit.edges)} edges and "
                f"{int(circuit.edges['exact'].sum())} were path-patched exactly ({circuit.screen.describe('edges')}); "
                "the others show their estimate, marked as such, and are not drawn in the figure (`--exact-all` "
                "patches every edge).")
    figures = [] if circuit.figure is None else [ReportFigure("circuit", FIGURE_CAPTIONS["circuit"],
                                                              png_bytes(circuit.figure))]
    how += (f" The {CHOSEN_EDGES} edges listed (and the {CIRCUIT_FIGURE_EDGES} drawn) are chosen by their edge "
            "attribution (EAP, noising) on the first probes of the selection rows, a cheaper screen than path-patching "
            "every edge there; each shows its effect path-patched on the intervention probes.")
    chosen = strongest(circuit.edges.dropna(subset=["chosen_by"]), CHOSEN_EDGES, "chosen_by")
    return Section("Circuit", how + "\n\n" + "\n".join(edge_lines(chosen, top=CHOSEN_EDGES)), figures=figures)


def pattern_views(model, probes: RepeatedProbes, text: str) -> list[PatternView]:
    """Every head's pattern on the display probe and on the start of ``text``, each at most
    ``DISPLAY_TOKENS`` tokens (and the context): the page stores n^2 weights per head of each."""
    probe = display_probe(probes)[:DISPLAY_TOKENS]
    tokens = leading_tokens(model, text, DISPLAY_TOKENS)
    return [PatternView("probe prompt (a repeated random segment)", display_tokens(model.to_str_tokens(probe)),
                        all_patterns(model, probe)),
            PatternView("the report's text", display_tokens(model.to_str_tokens(tokens)), all_patterns(model, tokens))]


def report_sections(table: pd.DataFrame, views: list[PatternView], rule: str) -> list[Section]:
    """The head-role report's sections: the explorer, the roles, the head table, the figures, rollout.
    views: the display probe's and the text's (``pattern_views``); rule: how roles were assigned."""
    measures = [m for m in (*MEASURES, *MEANING_ROLES) if m in table.columns]
    grid = [*present_roles(table), *[m for m in ("entropy", "ablation_effect") if m in table.columns]]
    explorer = explorer_data(table, grid, [*ROLES, "entropy"], views, start_head(table), start_measure(table))
    probe_view, text_view = views
    intervals = {"ablation_effect": interval_columns("ablation_effect")}
    figures = [ReportFigure("role_scores", FIGURE_CAPTIONS["role_scores"],
                            png_bytes(role_heatmaps(table, heatmap_columns(table), intervals=intervals))),
               ReportFigure("top_heads", FIGURE_CAPTIONS["top_heads"], png_bytes(top_heads_figure(table, probe_view))),
               ReportFigure("layer_map", FIGURE_CAPTIONS["layer_map"], png_bytes(layer_map_figure(table, text_view)))]
    rolled = rollout_figure(attention_rollout(text_view.patterns), text_view.tokens)
    how = (rule + " Ablation effect: the rise in loss on the predictable second-copy tokens when the head's "
           "output is replaced by its mean over the other probes at the same place in their structure, printed "
           "as 'effect [low, high]' with its 95% percentile bootstrap interval over the probes; 'no causal "
           "effect' marks a role head whose interval contains 0 (not a cut-off on the effect's size).")
    return [
        Section("Heads", "Click a head in the grid to see its attention on a probe prompt and on the report's "
                "text.", explorer_html(explorer, "click a head; the colour is the score chosen above")),
        Section("Roles", how + "\n\n" + "\n".join(role_summary(table))),
        Section("All heads", "Each score with its 95% bootstrap interval over prompts.",
                head_table_html(table, measures, present_roles(table), "head-table", extra=effect_columns(table)),
                table=markdown_frame(table)),
        Section("Figures", figures=figures),
        Section("Attention rollout", ROLLOUT_NOTE,
                figures=[ReportFigure("rollout", FIGURE_CAPTIONS["rollout"], png_bytes(rolled))]),
    ]


def start_measure(table: pd.DataFrame) -> str:
    """The measure the page opens on: induction, else (texts score no induction) previous-token."""
    return "induction" if "induction" in table.columns else "previous_token"


def start_head(table: pd.DataFrame) -> tuple[int, int]:
    """The head the page shows first: the best head of ``start_measure``."""
    row = table.loc[table[start_measure(table)].idxmax()]
    return int(row["layer"]), int(row["head"])


def heatmap_columns(table: pd.DataFrame) -> list[str]:
    return [m for m in (*ROLES, "entropy") if m in table.columns] + ["ablation_effect"]


def present_roles(table: pd.DataFrame) -> list[str]:
    """The roles the table scores: the attention roles, and the copying roles where it is calibrated."""
    return [role for role in ALL_ROLES if role in table.columns]


def display_probe(probes: RepeatedProbes) -> torch.Tensor:
    """The probe whose second copy ends first, cut right after it -> tokens (pos,): the shortest
    prompt that shows a whole repeat."""
    ends = probes.segment_start + 2 * probes.period  # (batch,) first position after the second copy
    row = int(ends.argmin())
    return probes.tokens[row, : int(ends[row])]


def top_heads_figure(table: pd.DataFrame, probe: PatternView):
    """Each attention role's best head on the display probe."""
    picks = [(role, table.loc[table[role].idxmax()]) for role in present_roles(table) if role in ROLES]
    chosen = probe.patterns[[int(row["layer"]) for _, row in picks], [int(row["head"]) for _, row in picks]]
    titles = [f"{role}: L{int(row['layer'])}H{int(row['head'])} ({row[role]:.2f})" for role, row in picks]
    return attention_grid(chosen, probe.tokens, titles, suptitle="top head per role")


def layer_map_figure(table: pd.DataFrame, text: PatternView):
    """Every head of the layer holding the best induction (else previous-token) head, on the text."""
    layer = start_head(table)[0]
    titles = [f"L{layer}H{head}" for head in range(text.patterns.shape[1])]
    return attention_grid(text.patterns[layer], text.tokens, titles, suptitle=f"layer {layer}")


def role_summary(table: pd.DataFrame) -> list[str]:
    """Markdown lines: for each role, its heads (best first) with score and ablation effect, then
    its partial heads (``partial_role``: they beat their nulls but score below the threshold), so
    a role spread over several weaker heads is not reported as absent."""
    lines = []
    for role in present_roles(table):
        line = f"- **{role}**: {role_heads(table, 'role', role) or 'none'}"
        partial = role_heads(table, "partial_role", role) if "partial_role" in table else ""
        lines.append(line + (f"; partial (beat their nulls, below the threshold): {partial}" if partial else ""))
    return lines


def role_heads(table: pd.DataFrame, column: str, role: str) -> str:
    """The heads whose ``column`` (';'-joined roles) holds ``role``, best first, with score and ablation effect."""
    heads = table[table[column].str.split(";").apply(lambda roles: role in roles)]
    return ", ".join(f"L{int(r.layer)}H{int(r.head)} (score {getattr(r, role):.2f}, ablation "
                     f"{effect_text(r.ablation_effect, r.ablation_ci_low, r.ablation_ci_high)} nats"
                     + (f", {r.causal}" if r.causal else "") + ")"
                     for r in heads.sort_values(role, ascending=False).itertuples())


def effect_columns(table: pd.DataFrame) -> list[str]:
    """The head table's effects (each shown with its interval): the ablation effect, and the direct
    effect where the table has it."""
    return [column for column in ("ablation_effect", "direct_effect") if column in table.columns]


def markdown_frame(table: pd.DataFrame) -> pd.DataFrame:
    """The head table as report.md shows it: layer, head, role, the measures (and the copying scores),
    the effects as 'effect [low, high]' (``effect_text``)."""
    partial = ["partial_role"] if "partial_role" in table.columns else []
    effects = {column: [effect_text(*values) for values in zip(table[column], *map(table.get, interval_columns(column)))]
               for column in effect_columns(table)}
    return table[["layer", "head", "role", *partial, *[m for m in (*MEASURES, *MEANING_ROLES) if m in table.columns]]
                 ].assign(**effects)


def report_title(report: HeadReport) -> tuple[str, str]:
    """(title, the provenance line under it)."""
    meta = report.meta
    subtitle = (f"family `{meta['family']}`, impl `{meta['impl']}`, weights `{meta['weights_hash']}`, "
                f"{meta['prompts']} probe prompts choosing the roles and {meta['intervention_prompts']} others "
                f"measuring the effects, of {meta['seq_len']} tokens, seed {meta['seed']}"
                + (f", {meta['texts']} texts" if meta["texts"] else "") + ".")
    return f"Head roles: {meta['model']}", subtitle


def write_report(report: HeadReport, out: str | Path) -> Path:
    """Write the report directory (each file atomically)."""
    title, subtitle = report_title(report)
    return write_report_files(out, title, subtitle, report.sections, report.meta, {"head_roles.csv": report.table})
