"""``interp report``: the head-role report (DESIGN 4.4), one directory per model:

    head_roles.csv   one row per head: layer, head, head_name (L1H4), role (the assigned roles joined
                     by ';'), partial_role, then each measure with _ci_low/_ci_high, the null
                     columns, ablation_effect and the other effects
    report.md        a summary of the findings (``report_summary``), then the method, the roles,
                     the sections, the figures (figures/*.png); a table longer than the page shows
                     is in a CSV file beside it (backup_pairs.csv, copying.csv), linked
    index.html       the same and more, interactive and self-contained (``analyses.report.page``):
                     click a head in the layer x head grid to see its pattern on a probe prompt
                     and on the report's text; the head table sorts and filters by role
    meta.json        model spec, family, impl, weights hash, prompts, seq_len, seed, thresholds,
                     fdr, null seeds, package versions

Beside the roles, the page has a calibration section (each score against its nulls, backup
groups, direct vs total effects, dormant heads, head similarity: ``analyses.report.calibration_figures``),
the role heads against layer-matched random heads without the role (``role_control``:
``analyses.roles.control``),
a circuit section (the edges among the role heads: ``analyses.circuits.circuit``) and why the role
heads attend (each induction, previous-token and duplicate-token head's QK attribution on the
intervention probes, head_roles.csv's ``qk_*`` columns: ``analyses.report.qk_section``). Each section's
computation lives in the room of its job (the control ``analyses.roles.control``, the circuit
``analyses.circuits.circuit.report_circuit``, the QK attribution ``analyses.circuits.role_qk``, the components ``analyses.components.overview``, the
head effects ``analyses.roles.calibration``); this module orders the steps, turns their results into
the page's sections and writes them.

The roles are chosen on the selection rows of the probe draw, every effect measured on the
intervention rows (``probe_split``: ``analyses.report.split``); the lists the page prints (the top direct logit attributions,
the circuit edges listed and drawn, the backup groups) are chosen on the selection rows' first
``LIST_PROMPTS`` (fewer where ``intervention_prompts`` is fewer: ``selection_probes``, ``CHOSEN_LISTS``)
and printed with their effects on the intervention rows.

The report is the steps of ``REPORT_SECTIONS`` (roles, ablation, calibration, control, circuit,
components), run in order after the probes' one forward (``analyses.report.sections``); the page is
written once the roles land and rewritten as each section does, the rest shown pending, and each
finished section is kept in the directory's ``.sections`` store for ``--resume`` (``build_report``).

Same model, prompts and seed -> the same bytes (meta.json's ``cost``, the run's own record of its
seconds and of the sections it reused, aside), whether run at once or stopped and resumed. Every
file is written atomically.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

import pandas as pd
import torch

from analyses.components.rollout import all_patterns
from analyses.core.execution import current, executing
from analyses.core.budget import left_after
from analyses.core.steps import FOLDER, RECORD, Steps, directory_lock
from analyses.core.hook_check import left_out, require
from analyses.report.calibration_figures import CAPTIONS as CALIBRATION_CAPTIONS
from analyses.report.calibration_figures import CalibrationSection, section_figures
from analyses.roles.calibration import (DEFAULT_PAIR_HEADS, FirstProbes, backup_frames, choosing_probes,
                                        dormant_and_similarity, head_effects, probe_run, role_calibration,
                                        total_effects, with_direct_effects)
from analyses.circuits.circuit import (CHOSEN_EDGES, CIRCUIT_FIGURE_EDGES, CIRCUIT_ROLES, REPORT_SKIPPED_ROLES,
                                       CircuitSection, edge_lines, report_circuit, screen_meta, strongest)
from analyses.circuits.circuit import role_heads as circuit_role_heads
from analyses.circuits.edges import VIAS
from analyses.circuits.role_qk import qk_heads, role_qk, with_qk
from analyses.circuits.path_patching import path_needs
from analyses.components.decompose import attention_vs_mlp_figure, component_hooks, dla_heatmap, logit_lens_figure
from analyses.components.overview import ComponentsOverview, component_effects, components_overview
from analyses.roles.classify import (ALL_ROLES, DEFAULT_FDR, DEFAULT_THRESHOLD, MEANING_ROLES, MEASURES, ROLES, check_fdr,
                                     classify_heads, has_role, head_table)
from analyses.roles.control import CONTROL_DRAWS, RoleControl, lead_role, role_control, unmatched_text
from analyses.roles.backup import DEFAULT_MIN_EXCESS, DIRECT_EFFECTS, backup_refusal, direct_effect_needs
from analyses.roles.nulls import DEFAULT_NULL_SEEDS
from analyses.report.meta import model_meta
from analyses.report.plan import (DLA, DLA_NEEDS, ReportShape, circuit_cost, left_out_section, report_estimate,
                                  role_qk_cost)
from analyses.report.qk_section import QK, qk_report_section
from analyses.components.qk import qk_refusal
from analyses.report.split import LIST_PROMPTS, chosen_apart, drawn_probes, list_prompts, probe_split, selection_probes
from analyses.report.sections import ReportSection, chosen_sections, run_sections, section_data, section_of
from analyses.core.plots import attention_grid, png_bytes, role_heatmaps
from analyses.core.probes import RepeatedProbes, check_prompt_count, probes_for
from analyses.core.progress import progress_bar
from analyses.report.page import (PatternView, ReportFigure, Section, display_tokens, effect_text, explorer_data,
                                  explorer_html, head_table_html, interval_columns, write_report_files)
from analyses.components.rollout import ROLLOUT_NOTE, attention_rollout, rollout_figure
from analyses.interventions.attribution import Screen
from analyses.interventions.controls import control_figure
from analyses.interventions.run import Run
from analyses.core.tokens import encode, leading_tokens
from analyses.interventions.cost import CostEstimate, StepClock
from interp.memory import release_freed_memory
from interp.files import remove_stale_temporaries

# why a report needs at least 2 prompts (``check_prompt_count``)
PROMPTS_NEEDED_BY = ("the role nulls' t-test has prompts - 1 degrees of freedom, and the total effects mean-ablate "
                     "each prompt with the other prompts' mean")

# the probes every per-head intervention runs on (total and direct effects of every head and MLP, backup,
# path patching): each sweeps every head, so its cost grows with prompts x heads, while the roles
# are read from every probe in the one forward
DEFAULT_INTERVENTION_PROMPTS = 16

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
BACKUP = "backup pairs and groups"  # the report's part whose rises need interp's own final readout (``backup_refusal``)

@dataclass
class HeadReport:
    """table: one row per head (see ``head_table``, ``identity_first``); sections: the page, in order
    (``Section``: title, Markdown, page-only HTML, figures, table; append one to add it); meta:
    JSON-able; summary: the page's opening lines (``report_summary``), Markdown."""

    table: pd.DataFrame
    sections: list[Section]
    meta: dict
    summary: list[str] = field(default_factory=list)

    @property
    def figures(self) -> dict[str, bytes]:
        """Every section's figures: name -> PNG bytes."""
        return {f.name: f.png for section in self.sections for f in section.figures}


def build_report(model, *, model_name: str, n_prompts: int = 64, seq_len: int | None = None, seed: int = 0,
                 texts: Sequence[str] | None = None,
                 thresholds: float | Mapping[str, float] | None = DEFAULT_THRESHOLD, fdr: float | None = DEFAULT_FDR,
                 intervention_prompts: int = DEFAULT_INTERVENTION_PROMPTS, memory_mb: float | None = None,
                 progress: bool | None = None, circuit_screen: Screen | None = None,
                 sections: Sequence[str] | None = None, out: str | Path | None = None,
                 resume: bool = False) -> HeadReport:
    """Classify every head (on probes, or on ``texts``), calibrate the scores and run the causal
    checks on the probes, find the edges among the role heads, store every head's pattern on a
    probe and on a text, draw the figures -> a ``HeadReport`` value. The probes are drawn once and serve all of it.

    The report is the sections of ``REPORT_SECTIONS`` (``sections``: the names of those to run, None
    every one; roles always, and every section a chosen one needs), each a step run in order after
    the probes' one forward. With ``out``, the page (``write_report``) is written there as soon as the
    roles land, every later section shown pending with its estimate, and rewritten (each file
    atomically) as each section lands; each finished section is kept in ``out/.sections`` (the step
    store, ``analyses.core.steps.Steps``, fingerprinted by ``report_inputs``), and with ``resume`` a
    later run reads back those that are finished instead of computing them: stopped anywhere and
    resumed, the files equal an uninterrupted run's (meta.json's ``cost``, this run's record of
    seconds and of the sections it reused, aside); a store of other inputs is refused in one line
    naming the first that changed. Without ``resume`` the store is emptied first. Without ``out``
    nothing is written or kept.

    Roles (``analyses.roles.classify.assign_roles``): with ``fdr`` (and probe scores), a role is a
    (head, role) whose score beats its nulls at that false-discovery rate and, with
    ``thresholds``, also reaches the threshold; ``fdr=None`` (or ``texts``, which the probe nulls
    do not describe) is the fixed rule: the threshold and an interval above chance. No role reads
    an ablation effect, so the roles (and the head table's role column) are final when the roles
    section lands.
    The probes are one draw of ``intervention_prompts + n_prompts``: the interventions run on the first
    ``intervention_prompts``, the roles are chosen on the other ``n_prompts`` (``choosing_probes``), so
    every effect is measured on prompts that did not choose the heads (meta.json: ``probe_split``).
    ``model_name``: the spec the model was loaded from, for meta.json; ``memory_mb`` (None: the
    current execution's, ``analyses.core.execution``): what the report may add to the process: the
    run's store (the first ``intervention_prompts`` probes' activations) stays taken, each step gets
    the rest (``analyses.core.budget.left_after``); ``circuit_screen``: None
    path-patches every edge of the circuit exactly, a ``Screen`` only those it chooses by edge
    attribution (the others show their estimate, and the page says so).

    Before any sweep the hook self-test plans the report (``report_plan``): a part this model
    cannot run (the circuit, direct logit attribution) is left out, and the page, report.md and
    meta.json (``left_out``) say which and why; a model whose head ablations cannot run is refused
    in one line.

    After the probe run, before the first sweep, the report prints on stderr (unless ``progress`` is False) what each step
    will cost in forward-equivalents and seconds on this machine (``report_cost``); meta.json's
    ``cost`` keeps that estimate and each step's measured seconds (and ``reused``: whether the step
    was read back from the store)."""
    check_prompt_count(n_prompts, f"prompts={n_prompts}", PROMPTS_NEEDED_BY)
    check_prompt_count(intervention_prompts, f"intervention_prompts={intervention_prompts}", PROMPTS_NEEDED_BY)
    if fdr is not None:
        check_fdr(fdr)
    chosen = chosen_sections(REPORT_SECTIONS, sections, always="roles")
    if out is None:
        return _build(model, model_name, chosen, None, locals())
    store_dir = Path(out) / STORE
    store_dir.mkdir(parents=True, exist_ok=True)
    with directory_lock(store_dir, "report run"):
        remove_stale_temporaries(out)  # the page's, beside the store
        if not resume:
            clear_store(store_dir)
        return _build(model, model_name, chosen, (store_dir, Path(out)), locals())


def _build(model, model_name: str, chosen: list[ReportSection], where: tuple[Path, Path] | None,
           options: dict) -> HeadReport:
    """``build_report``'s work, with the step store and the page's directory ``where`` (or None)."""
    with executing(memory_mb=options["memory_mb"], progress=options["progress"]) as execution:
        left = report_plan(model)
        o = options
        # one draw: the first intervention_prompts probes measure every effect, the other n_prompts choose the roles
        probes = drawn_probes(model, probe_split(o["n_prompts"], o["intervention_prompts"], o["seed"]), o["seq_len"])
        shape, estimate = report_cost(model, probes, left, o["texts"], o["intervention_prompts"],
                                      [section.name for section in chosen])
        context = ReportContext(model=model, model_name=model_name, n_prompts=o["n_prompts"], seed=o["seed"],
                                texts=o["texts"], thresholds=o["thresholds"], fdr=o["fdr"],
                                intervention_prompts=o["intervention_prompts"], memory_mb=execution.memory_mb,
                                circuit_screen=o["circuit_screen"], left=left, probes=probes,
                                shape=shape, estimate=estimate)
        store = (Steps(where[0], report_inputs(context), resume=True) if where is not None else None)
        steps = ReportSteps(StepClock(estimate), ("probe run", *(s.name for s in chosen)))
        steps.begin("probe run")  # the probes' one forward, which every step below reads
        context.prepare()

        def written(results: dict) -> None:
            if where is None:
                return
            first_write = not (where[1] / "index.html").exists() or len(results) == 1
            # where the head sections' figures are still to draw (they take a while on a large model), the
            # page goes out with its tables first and is rewritten once they are drawn
            for figures in (False, True) if not context.drawn(results) else (True,):
                path = write_report(report_of(context, chosen, results, store, figures=figures), where[1])
                if first_write and current().progress is not False:
                    pending = len(chosen) - len(results)
                    print(f"report: the page is at {path / 'index.html'}" + (f" ({pending} sections pending; rewritten "
                          "as each lands)" if pending else ""), file=sys.stderr, flush=True)
                first_write = False

        results = run_sections(chosen, context, store if store is not None else _compute, steps.begin, written)
        steps.close()
        return report_of(context, chosen, results, store)


def _compute(name: str, compute):
    return compute()


STORE = ".sections"  # the report's step store in its directory (``analyses.core.steps.Steps``)


def clear_store(directory: Path) -> None:
    """Empty a report's step store (its record and its finished steps), for a run that does not resume."""
    (directory / RECORD).unlink(missing_ok=True)
    for path in (directory / FOLDER).glob("*.json"):
        path.unlink()


@dataclass
class ReportContext:
    """What every section reads: the model, the options, the plan (``left``: part -> why it is left
    out), the probes, the cost estimate, and once ``prepare`` ran, the probes' one forward (``run``),
    the intervention probes (``first``), the probes choosing the roles (``chosen_on``, ``chosen_run``),
    the selection rows choosing the page's lists (``selection``), each later step's memory
    (``step_mb``) and the pattern views (``views``). None of these is stored: a resumed report makes
    them again (one forward of the probes and of the lists' rows, the views' two). ``head_sections``:
    the page's head sections as drawn from the head table without and with the ablation's effects,
    each without and with its figures."""

    model: object
    model_name: str
    n_prompts: int
    seed: int
    texts: Sequence[str] | None
    thresholds: float | Mapping[str, float] | None
    fdr: float | None
    intervention_prompts: int
    memory_mb: float
    circuit_screen: Screen | None
    left: dict[str, str]
    probes: RepeatedProbes
    shape: ReportShape
    estimate: CostEstimate
    run: Run | None = None
    first: FirstProbes | None = None
    chosen_on: RepeatedProbes | None = None
    chosen_run: Run | None = None
    selection: FirstProbes | None = None
    step_mb: float = 0.0
    views: list[PatternView] | None = None
    head_sections: dict[tuple[bool, bool], tuple[list[Section], list[Section]]] = field(default_factory=dict)  # by
    # ``report_of``: (the ablation's effects in the table, the figures drawn) -> the sections
    figures: dict[str, bytes] = field(default_factory=dict)  # the head sections' figures that read no effect

    def prepare(self) -> None:
        """The probe run (timing one FE: the estimate's clock, printed), the selection rows' run, the views."""
        started = time.perf_counter()
        self.run = probe_run(self.model, self.probes, names=component_hooks(self.model, lens=True),
                             intervention_prompts=self.intervention_prompts)
        self.estimate.timed_by(time.perf_counter() - started)  # the probe run is one FE: every step's clock
        self.estimate.show("report")
        self.first = FirstProbes.of(self.probes, self.run, self.run.metric, self.intervention_prompts)
        self.chosen_on, self.chosen_run = choosing_probes(self.probes, self.run, self.intervention_prompts)
        with executing(memory_mb=left_after(self.memory_mb, self.run.held_mb())):
            self.selection = selection_probes(self.model, self.probes, self.intervention_prompts)
        self.step_mb = left_after(self.memory_mb, self.run.held_mb() + self.selection.run.held_mb())
        self.views = pattern_views(self.model, self.probes, self.texts[0] if self.texts else DISPLAY_TEXT)

    def drawn(self, results: dict) -> bool:
        """Whether the head sections' figures for ``results``' head table are drawn already."""
        return ("ablation" in results, True) in self.head_sections

    @property
    def calibrated(self) -> bool:
        """Whether the roles are decided against their nulls (``fdr``, on probes)."""
        return self.fdr is not None and not self.texts

    @property
    def calibration_mb(self) -> float:
        """The calibration's memory: what the probe run's store leaves."""
        return left_after(self.memory_mb, self.run.held_mb())

    def chosen_text(self) -> str:
        return chosen_apart(self.n_prompts, self.first.probes.n_prompts, len(self.texts) if self.texts else None)

    def meta(self) -> dict:
        """meta.json's record but the circuit's screen, the sections and the cost (``report_of``)."""
        o = self
        return model_meta(o.model, o.model_name) | {
            "prompts": o.n_prompts, "seq_len": o.probes.seq_len, "seed": o.seed,
            "texts": len(o.texts) if o.texts else None, "thresholds": o.thresholds,
            "fdr": o.fdr if o.calibrated else None, "intervention_prompts": min(o.intervention_prompts, o.probes.n_prompts),
            "probe_split": probe_split(o.n_prompts, o.intervention_prompts, o.seed, bool(o.texts)),
            "null_seeds": list(DEFAULT_NULL_SEEDS), "left_out": o.left}


def report_inputs(context: ReportContext) -> dict:
    """Everything a section's numbers depend on, the step store's fingerprint (``Steps``): the model
    (family, implementation, weights hash, dtype, precision, start token), the package versions, every
    option (the texts by their SHA-256) and the constants the steps read, and each section's code
    version. The memory budget says how, not what, and is left out, as a task's is; so is the choice
    of sections (a resume may add sections)."""
    meta = model_meta(context.model, context.model_name)
    texts = None if context.texts is None else hashlib.sha256(json.dumps(list(context.texts)).encode()).hexdigest()
    screen = context.circuit_screen
    return {"model": {key: meta[key] for key in ("family", "impl", "weights_hash", "dtype", "precision", "start_token")},
            "versions": meta["versions"],
            "options": {"prompts": context.n_prompts, "seq_len": context.probes.seq_len, "seed": context.seed,
                        "texts_sha256": texts, "thresholds": context.thresholds, "fdr": context.fdr,
                        "intervention_prompts": context.intervention_prompts,
                        "circuit_screen": None if screen is None else {"top_k": screen.top_k, "share": screen.share},
                        "null_seeds": list(DEFAULT_NULL_SEEDS), "pair_heads": DEFAULT_PAIR_HEADS,
                        "control_draws": CONTROL_DRAWS, "list_prompts": LIST_PROMPTS, "display_text": DISPLAY_TEXT},
            "code": {section.name: section.version for section in REPORT_SECTIONS}}


# ------------------------------------------------------------------------------ the sections
def roles_result(context: ReportContext, results: dict) -> dict:
    """Every head's scores (``classify_heads``, from the probe run, or on the texts) and the role
    tests against their nulls (``role_calibration``): all the roles read."""
    c = context
    scores = classify_heads(c.model, seed=c.seed, texts=c.texts, probes=None if c.texts else c.chosen_on,
                            memory_mb=c.memory_mb, run=None if c.texts else c.chosen_run)
    with executing(memory_mb=c.calibration_mb):
        calibration = role_calibration(c.model, c.chosen_on, run=c.chosen_run, fdr=c.fdr or DEFAULT_FDR, seed=c.seed)
    return {"scores": scores, "calibration": calibration}


def ablation_result(context: ReportContext, results: dict) -> dict:
    """Every head's and MLP's total and direct ablation effect on the intervention probes (``head_effects``)."""
    c = context
    with executing(memory_mb=c.calibration_mb):
        effects, mlp_effects = head_effects(c.model, c.first, direct=DIRECT_EFFECTS not in c.left)
    return {"effects": effects, "mlp_effects": mlp_effects}


def calibration_result(context: ReportContext, results: dict) -> dict:
    """The calibration section: null bands, backup groups (``backup_frames``, chosen on the selection
    rows), self-repair, dormant heads and similarity (``dormant_and_similarity``)."""
    c = context
    calibration, effects = results["roles"]["calibration"], results["ablation"]["effects"]
    with executing(memory_mb=c.calibration_mb):
        pairs, groups = ((pd.DataFrame(), pd.DataFrame()) if BACKUP in c.left else
                         backup_frames(c.model, c.first, calibration, effects, pair_heads=DEFAULT_PAIR_HEADS,
                                       choose=c.selection))
    dormant, similarities = dormant_and_similarity(c.model, c.probes, c.run, c.first, effects)
    frames = {"calibration": calibration, "pairs": pairs, "groups": groups, "effects": effects,
              "mlp_effects": results["ablation"]["mlp_effects"], "dormant": dormant,
              "output_clusters": similarities["output"].frame(), "pattern_clusters": similarities["pattern"].frame()}
    figures = section_figures(frames, similarities)
    found = CalibrationSection(frames, figures, {name: CALIBRATION_CAPTIONS[name] for name in figures})
    return {"section": section_data(calibration_report_section(found))}


def control_result(context: ReportContext, results: dict) -> dict:
    """The role heads against layer-matched random heads (``role_control``)."""
    c = context
    with executing(memory_mb=c.step_mb):
        control = role_control(c.model, roles_table(c, results), c.first, seed=c.seed)
    return {"section": section_data(control_report_section(control, c.chosen_text())),
            "finding": control_finding(control)}


def circuit_result(context: ReportContext, results: dict) -> dict:
    """The edges among the role heads (``report_circuit``), the edges path-patched
    exactly screened on the selection rows that choose the lists, and meta.json's record of its screen;
    no section where the plan left the circuit out."""
    c = context
    if CIRCUIT in c.left:
        return {"section": None, "screen": None}
    table = roles_table(c, results)
    c.estimate.at_start("circuit", circuit_cost(c.shape, circuit_role_heads(table, skip=REPORT_SKIPPED_ROLES),
                                                c.circuit_screen))
    with executing(memory_mb=c.step_mb):
        circuit = report_circuit(c.model, table, c.first, c.selection, seed=c.seed, screen=c.circuit_screen)
    screened_on = probe_split(c.n_prompts, c.intervention_prompts, c.seed)["lists"]
    return {"section": section_data(circuit_report_section(circuit)), "screen": screen_meta(circuit, screened_on),
            "edges": circuit.edges}


def qk_result(context: ReportContext, results: dict) -> dict:
    """Why the role heads attend (``role_qk``: each induction, previous-token and duplicate-token head's
    QK attribution of its contrast on the intervention probes), its edges beside the circuit's where the
    circuit ran, and the head table's ``qk_*`` columns; no section where the plan left it out."""
    c = context
    if QK in c.left:
        return {"section": None, "heads": None}
    table = roles_table(c, results)
    c.estimate.at_start("qk", role_qk_cost(c.shape, qk_heads(table)))
    with executing(memory_mb=c.step_mb):
        found = role_qk(c.model, table, c.first.probes, seed=c.seed)
    edges = (results.get("circuit") or {}).get("edges")
    return {"section": section_data(qk_report_section(found, edges, table)), "heads": found.heads}


def components_result(context: ReportContext, results: dict) -> dict:
    """The components section (``components_overview``), its attention-vs-MLP read from the ablation."""
    c = context
    with executing(memory_mb=c.step_mb):
        found = components_overview(c.model, c.first.probes, component_effects(results["ablation"]), run=c.first.run,
                                    dla=DLA not in c.left, selection=c.selection)
    return {"section": section_data(components_report_section(found))}


# The report's sections in the order they run; the page shows them (but the head table, which
# roles and ablation fill) between the roles and the head table, in this order. A new section is
# one entry here, a ``*_result`` function and its estimator in ``analyses.report.plan.REPORT_COSTS``.
REPORT_SECTIONS = (
    ReportSection("roles", "Roles", (), 1, roles_result),
    ReportSection("ablation", "Ablation effects", (), 1, ablation_result),
    ReportSection("calibration", "Calibration", ("ablation",), 2, calibration_result),
    ReportSection("control", "Role heads vs layer-matched random heads", (), 2, control_result),
    ReportSection("circuit", "Circuit", (), 4, circuit_result),
    ReportSection("qk", "Why the role heads attend", (), 2, qk_result),
    ReportSection("components", "Components", ("ablation",), 2, components_result),
)


def roles_table(context: ReportContext, results: dict) -> pd.DataFrame:
    """The head table of the roles alone (``head_table`` without effects): what the roles' readers need."""
    roles = results["roles"]
    return head_table(roles["scores"], None, context.thresholds, fdr=context.fdr or DEFAULT_FDR,
                      calibration=roles["calibration"] if context.calibrated else None)


def report_table(context: ReportContext, results: dict) -> pd.DataFrame:
    """The head table (head_roles.csv, ``identity_first``): the roles, the heads' ablation effects once
    that section landed, and the role heads' QK attribution once that one did."""
    ablation, qk = results.get("ablation"), results.get("qk")
    if ablation is None:
        table = roles_table(context, results)
    else:
        roles = results["roles"]
        table = with_direct_effects(head_table(roles["scores"], total_effects(ablation["effects"]), context.thresholds,
                                               fdr=context.fdr or DEFAULT_FDR,
                                               calibration=roles["calibration"] if context.calibrated else None),
                                    ablation["effects"])
    return identity_first(table if qk is None or qk["heads"] is None else with_qk(table, qk["heads"]))


IDENTITY = ("layer", "head", "head_name", "role", "partial_role")  # head_roles.csv's first columns


def identity_first(table: pd.DataFrame) -> pd.DataFrame:
    """The head table with each head's identity and verdict first: ``layer, head, head_name`` (e.g.
    "L1H4"), ``role``, ``partial_role`` (where the table has it), then every other column in its order."""
    named = table.assign(head_name=[f"L{int(layer)}H{int(head)}" for layer, head in zip(table["layer"], table["head"])])
    first = [column for column in IDENTITY if column in named.columns]
    return named[[*first, *[column for column in named.columns if column not in first]]]


def report_of(context: ReportContext, chosen: Sequence[ReportSection], results: dict, store: Steps | None, *,
              figures: bool = True) -> HeadReport:
    """The report as far as ``results`` go: the head sections from the head table (with their
    figures, or with ``figures`` False a line saying they are being drawn), each finished
    section's page section, each chosen section not finished yet as pending with its estimate
    (``pending_section``), the sections not chosen named (``unchosen_section``); meta.json with the
    sections (``chosen``, ``pending``) and the cost so far, each step marked ``reused`` where the store
    read it back."""
    table = report_table(context, results)
    c = context
    drawn = ("ablation" in results, figures)  # the head sections change only when the ablation's effects land
    if drawn not in c.head_sections:
        rule = role_rule(c.thresholds, c.fdr if c.calibrated else None) + " " + c.chosen_text()
        c.head_sections[drawn] = report_sections(table, c.views, provenance(c.meta()) + "\n\n" + rule, c.figures,
                                                 figures=figures)
    before, after = c.head_sections[drawn]
    middle = []
    for section in chosen[1:]:
        if section.name not in results:
            middle.append(pending_section(section, c.estimate))
        elif results[section.name].get("section") is not None:
            middle.append(section_of(results[section.name]["section"]))
    circuit = results.get("circuit")
    summary = report_summary(table, edges=None if circuit is None else circuit.get("edges"),
                             control=(results.get("control") or {}).get("finding"), missing=missing_parts(c.left, chosen,
                                                                                                         results))
    sections = [Section("Summary", "\n".join(summary)), *left_out_section(c.left), *before, *middle,
                *unchosen_section(chosen), *after]
    cost = c.estimate.record()
    for name, step in cost["steps"].items():
        step["reused"] = store is not None and name in store.reused
    meta = c.meta() | {"circuit_screen": results.get("circuit", {}).get("screen"),
                       "sections": {"chosen": [s.name for s in chosen],
                                    "pending": [s.name for s in chosen if s.name not in results]},
                       "cost": cost}
    return HeadReport(table, sections, meta, summary)


SUMMARY_HEADS = 3  # the heads of each role the summary names (the role list below names every one)
SUMMARY_EDGES = 3  # the circuit edges it names


def report_summary(table: pd.DataFrame, *, edges: pd.DataFrame | None = None, control: dict | None = None,
                   missing: Sequence[str] = ()) -> list[str]:
    """The report's opening lines (Markdown), made from its results: what was found (each role with a
    head: how many, the ``SUMMARY_HEADS`` of highest score with their ablation effects and intervals;
    the circuit's strongest edges, ``edges`` being the circuit section's where it ran; the control,
    ``control_finding``'s, where it ran), then what was not (the roles no head has, with their
    partial heads; the circuit without an edge; no matched control; ``missing``: the parts left out,
    pending or not run, ``missing_parts``)."""
    found, absent = [], []
    for role in present_roles(table):
        heads = int(has_role(table["role"], role).sum())
        if heads:
            found.append(f"- **{role}** ({heads} head{'s' if heads > 1 else ''}): "
                         + role_heads(table, "role", role, SUMMARY_HEADS))
        else:
            partial = partial_names(table, role)
            absent.append(f"- **{role}**: no head" + (f"; partial heads (beat their nulls, below the threshold): "
                                                      f"{partial}" if partial else ""))
    if edges is not None:
        (found if len(edges) else absent).append(circuit_line(edges))
    if control is not None:
        (found if control["tested"] else absent).append(f"- **control**: {control['text']}")
    return (["**Found**", "", *(found or ["- no head has any of the roles"]), "", "**Not found, or not run**", "",
             *(absent + list(missing) or ["- nothing: every role has a head and every part ran"])])


def partial_names(table: pd.DataFrame, role: str) -> str:
    """The names of ``role``'s partial heads (``partial_role``), best first, the ``SUMMARY_HEADS`` best and
    how many more; "" where it has none or the table has no partial roles."""
    if "partial_role" not in table:
        return ""
    heads = table[has_role(table["partial_role"], role)].sort_values(role, ascending=False)
    names = [f"L{int(r.layer)}H{int(r.head)}" for r in heads.itertuples()]
    more = len(names) - SUMMARY_HEADS
    return ", ".join(names[:SUMMARY_HEADS]) + (f", and {more} more" if more > 0 else "")


def circuit_line(edges: pd.DataFrame) -> str:
    """The circuit in one Markdown list item: its ``SUMMARY_EDGES`` strongest edges as the circuit
    section chooses them (edge attribution on the selection rows), each with its path-patched effect
    and interval on the intervention probes, or that no head has a role the circuit covers."""
    if edges.empty:
        return "- **circuit**: no edge (no head has a role the circuit covers)"
    shown = strongest(edges.dropna(subset=["chosen_by"]), SUMMARY_EDGES, "chosen_by")
    parts = []
    for row in shown.itertuples():
        receiver = "logits" if row.receiver_head < 0 else f"L{row.receiver_layer}H{row.receiver_head}.{row.via}"
        effect = (effect_text(row.effect, row.ci_low, row.ci_high) if row.exact else f"{row.effect:+.3f} (estimate)")
        parts.append(f"L{row.sender_layer}H{row.sender_head} -> {receiver} {effect}")
    return (f"- **circuit** ({len(edges)} edges among the role heads; the {len(shown)} strongest by edge attribution, "
            "their path-patched effect in nats): "
            + "; ".join(parts))


def control_finding(control: RoleControl) -> dict:
    """The control for the summary: ``tested`` (whether a matched control ran) and ``text``, its
    result (``describe``) or why there is none."""
    if control.found is None:
        return {"tested": False, "text": control.why}
    return {"tested": True, "text": control.found.describe()}


def missing_parts(left: dict[str, str], chosen: Sequence[ReportSection], results: dict) -> list[str]:
    """The summary's lines for the parts without a result: those the model cannot run (``left``: part ->
    why), the chosen sections still pending, the sections ``--sections`` did not choose."""
    pending = [s.name for s in chosen if s.name not in results]
    unchosen = [s.name for s in REPORT_SECTIONS if s not in chosen]
    return ([f"- **left out**: {part} ({why})" for part, why in left.items()]
            + ([f"- **pending**: {', '.join(pending)} (the page is rewritten as each lands)"] if pending else [])
            + ([f"- **not run**: {', '.join(unchosen)} (not chosen by `--sections`)"] if unchosen else []))


def report_roles(model, *, n_prompts: int = 64, seq_len: int | None = None, seed: int = 0,
                 texts: Sequence[str] | None = None,
                 thresholds: float | Mapping[str, float] | None = DEFAULT_THRESHOLD, fdr: float | None = DEFAULT_FDR,
                 intervention_prompts: int = DEFAULT_INTERVENTION_PROMPTS, memory_mb: float | None = None,
                 progress: bool | None = None) -> pd.DataFrame:
    """Exactly the roles ``build_report`` (``interp report``) gives with the same arguments, without
    the rest of the report: the head table (``head_table``: one row per head, every measure with its
    interval, the null columns, ``role`` and ``partial_role``; no effect columns).

    The probes are the report's one draw of ``intervention_prompts + n_prompts`` (seeded by
    ``seed``); the roles are chosen on the last ``n_prompts`` of it (``choosing_probes``):
    classification (``classify_heads``), then with ``fdr`` the calibration (``role_calibration``:
    the attention roles' nulls and the meaning roles' nulls in one false-discovery family), a role
    being a (head, role) whose q-value is at most ``fdr`` and whose score reaches ``thresholds``.
    ``fdr=None``, or ``texts`` (classified on the texts, which the probe nulls do not describe),
    is the fixed rule: the threshold and an interval above chance. Returns a tidy frame. ``memory_mb``,
    ``progress``: the execution's (``analyses.core.execution``; None: the current one's)."""
    check_prompt_count(n_prompts, f"n_prompts={n_prompts}", PROMPTS_NEEDED_BY)
    check_prompt_count(intervention_prompts, f"intervention_prompts={intervention_prompts}", PROMPTS_NEEDED_BY)
    probes = probes_for(model, intervention_prompts + n_prompts, seq_len, seed=seed)
    chosen_on = probes.after(intervention_prompts)
    with executing(memory_mb, progress):
        scores = classify_heads(model, seed=seed, texts=texts, probes=None if texts else chosen_on)
        calibration = (role_calibration(model, chosen_on, seed=seed, fdr=fdr)
                       if fdr is not None and not texts else None)
    return head_table(scores, None, thresholds, fdr=fdr or DEFAULT_FDR, calibration=calibration)


def pending_section(section: ReportSection, estimate: CostEstimate) -> Section:
    """A chosen section not finished yet: its slot on the page, with its estimated cost."""
    cost = estimate.step_line(section.name, estimate.steps.get(section.name)).strip().removeprefix(f"{section.name}: ")
    what = ("each head's and MLP's ablation effect, which fills the head table's effect columns and the role "
            "heads' effects above" if section.name == "ablation" else "this section")
    return Section(f"{section.title} (pending)", f"Pending: {what} is computed after the sections above; "
                   f"estimated {cost}. The page is rewritten as each section lands.")


def unchosen_section(chosen: Sequence[ReportSection]) -> list[Section]:
    """The page's line naming the sections ``--sections`` left out (none where every one was chosen)."""
    names = [s.name for s in REPORT_SECTIONS if s not in chosen]
    if not names:
        return []
    return [Section("Sections not run", f"Not chosen by `--sections`: {', '.join(names)}. Rerun with `--resume "
                    f"--sections {','.join([s.name for s in chosen] + names)}` to add them (the finished sections are "
                    "reused).")]


def plan_lines(model, *, n_prompts: int = 64, seq_len: int | None = None, seed: int = 0,
               texts: Sequence[str] | None = None, intervention_prompts: int = DEFAULT_INTERVENTION_PROMPTS,
               sections: Sequence[str] | None = None) -> list[str]:
    """``interp report --plan``: the sections a report would run, in order, each with what it needs
    and its estimated cost in forward-equivalents (``analyses.report.plan``), from the shapes alone:
    no forward runs (the hook self-test neither: a part it would leave out is costed as if kept)."""
    chosen = chosen_sections(REPORT_SECTIONS, sections, always="roles")
    probes = probes_for(model, intervention_prompts + n_prompts, seq_len, seed=seed)
    _, estimate = report_cost(model, probes, {}, texts, intervention_prompts, [s.name for s in chosen])
    lines = [f"interp report plan: {len(chosen)} of {len(REPORT_SECTIONS)} sections, in order, each with its estimated "
             f"cost in forward-equivalents (FE: one forward of the {probes.n_prompts} probes of {probes.seq_len} "
             "tokens); the run times one FE by its probe run and prints the seconds before its first sweep"]
    needs = {s.name: s.needs for s in REPORT_SECTIONS}
    for name, cost in estimate.steps.items():
        line = (estimate.step_line(name, cost) if cost is None else  # the seconds wait for the probe run
                f"  {name}: {'<= ' if cost.at_most else '~'}{cost.fe:.2f} FE")
        notes = ["always, made again on --resume"] if name == "probe run" else (
            ["always"] if name == "roles" else [f"needs {', '.join(needs[name])}"] if needs[name] else [])
        lines.append(line + (f" ({'; '.join(notes)})" if notes else ""))
    left = [s.name for s in REPORT_SECTIONS if s not in chosen]
    return lines + ([f"  not chosen: {', '.join(left)}"] if left else [])


class ReportSteps:
    """The report's step-level bar, e.g. ``report: calibration  3/7``: which of ``steps`` (the probe run
    and the chosen sections; ``STEPS``: every one) it is on
    (shown per the current execution's progress, as every bar: ``analyses.core.progress``)."""

    STEPS = ("probe run", "roles", "ablation", "calibration", "control", "circuit", "qk", "components")

    def __init__(self, clock: StepClock | None = None, steps: Sequence[str] = STEPS):
        self.bar = progress_bar(total=len(steps), desc="report", unit="step")
        self.started = False
        self.clock = clock

    def begin(self, step: str) -> None:
        """Mark the step before as done and ``step`` (the next of the steps, in order) as running; the
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
    own attention, ``qk_refusal``; ``BACKUP``: the backup pairs and groups, whose rise of attribution
    needs interp's own final readout, ``backup_refusal``) -> why, in one line. Refuses in one line a model whose
    head ablations cannot run: the head table's ablation effects and the calibration are made of them."""
    refusal, backup, direct = qk_refusal(model), backup_refusal(model), direct_effect_needs(model)  # each section's own check
    require(model, "hook_z", "the report's head ablations")
    left = left_out(model, {CIRCUIT: path_needs(VIAS), DLA: DLA_NEEDS, DIRECT_EFFECTS: direct,
                            QK: DLA_NEEDS})  # the split reads the residual's decomposition, as DLA does
    left = left if backup is None else left | {BACKUP: backup}
    return left if refusal is None or QK in left else left | {QK: refusal}


def report_cost(model, probes: RepeatedProbes, left: dict[str, str], texts: Sequence[str] | None,
                intervention_prompts: int, steps: Sequence[str] | None = None) -> tuple[ReportShape, CostEstimate]:
    """The report's shape (``analyses.report.plan.ReportShape``) and its cost estimate
    (``report_estimate`` over the probe run and ``steps``, the sections run, None every one), its clock set by the
    probe run (``CostEstimate.timed_by``)."""
    first = min(intervention_prompts, probes.n_prompts)
    share = first / probes.n_prompts
    lists = list_prompts(intervention_prompts, probes.n_prompts - first) / probes.n_prompts  # ``selection_probes``
    view_rows = (len(display_probe(probes)[:DISPLAY_TOKENS])
                 + len(leading_tokens(model, texts[0] if texts else DISPLAY_TEXT, DISPLAY_TOKENS)))
    shape = ReportShape(model=model, batch_rows=probes.tokens.numel(), share=share, list_share=lists,
                        role_share=1.0 - share if share < 1 else 1.0,  # ``choosing_probes``
                        text_rows=encode(model, list(texts)).tokens.numel() if texts else 0, view_rows=view_rows,
                        null_seeds=len(DEFAULT_NULL_SEEDS), pair_heads=DEFAULT_PAIR_HEADS, draws=CONTROL_DRAWS,
                        circuit=CIRCUIT not in left)
    steps = [section.name for section in REPORT_SECTIONS] if steps is None else steps
    return shape, report_estimate(shape, ["probe run", *steps], float("nan"))


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


def control_report_section(control: RoleControl, chosen: str) -> Section:
    """The role heads against layer-matched random heads without the role: the effects, the ratio
    and its interval, or why no matched control is possible; ``chosen``: where the heads were chosen
    (``chosen_apart``)."""
    title = f"{control.role.replace('_', '-').capitalize()} heads vs layer-matched random heads"
    if control.found is None:
        return Section(title, control.why.capitalize() + ".")
    found = control.found
    left = (f" {len(control.left)} more {control.role} heads ({', '.join(f'L{l}H{h}' for l, h in control.left)}) "
            "are left out so that each layer keeps at least as many heads without the role to draw from."
            if control.left else "")
    unmatched = f" {unmatched_text(control).capitalize()}." if control.unmatched else ""
    text = (f"The {control.role} heads ablated together (position-aligned mean, the rise in loss on the predictable "
            f"tokens of the first {found.n_prompts} probes) against {found.n_draws} random sets with as many heads "
            f"in each layer (and key/value group); the pool the sets are drawn from excludes all "
            f"{len(control.excluded)} {control.role} heads, tested or left out, so every random head is one without "
            "the role. All in one batched sweep." + left + unmatched
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
    if frames["pairs"].empty:
        return Section("Calibration", text, figures=figures)
    pairs = ranked_pairs(frames["pairs"])
    return Section("Calibration", text, figures=figures, table=pair_table(pairs), csv="backup_pairs.csv",
                   csv_table=pairs)


def ranked_pairs(pairs: pd.DataFrame) -> pd.DataFrame:
    """The backup pairs best first: those that back up, then by their excess on the intervention
    probes, largest first (ties in the pairs' order)."""
    order = pairs.assign(_rank=~pairs["backs"].astype(bool), _excess=-pairs["excess"]).sort_values(
        ["_rank", "_excess"], kind="stable").index
    return pairs.loc[order].reset_index(drop=True)


BACKUP_RULE = ("Backup: the role heads with the largest first-order ablation effect on the selection probes (at most "
               f"{DEFAULT_PAIR_HEADS}) are ablated in pairs there and on the intervention probes; a pair backs up when "
               f"its excess (joint effect minus the sum of its single effects, per prompt) is at least "
               f"{DEFAULT_MIN_EXCESS} nats with a 95% interval excluding 0 on the selection probes, and there one "
               "head's direct logit attribution on the metric rises when the other is ablated, with a 95% interval "
               "excluding 0 on the side of the ablated head's own attribution (Wang et al.'s test: the partner "
               "writes more of what the head wrote; a superadditive loss alone is not compensation); the groups "
               "(connected pairs) are measured on the intervention probes (the table: every pair, 'excess' and the "
               "rises measured there, 'chosen excess' where it was chosen; rises only for the pairs superadditive "
               "there).")


def pair_table(pairs: pd.DataFrame) -> pd.DataFrame:
    """The pairwise ablation as the calibration section's table: ``a, b``, the single and joint
    effects, the excess and each head's attribution rise when the other is ablated (each 'e [low,
    high]', ``effect_text``; no interval where the pair was not superadditive where it was chosen) on
    the intervention probes, the excess on the probes that chose the groups, whether the pair
    compensates (on the intervention probes) and whether it backs up."""
    def shown(value: str, stem: str) -> list[str]:
        return [effect_text(*cells, 3) for cells in zip(pairs[value], pairs[f"{stem}_ci_low"], pairs[f"{stem}_ci_high"])]

    return pd.DataFrame({"a": pairs["a"], "b": pairs["b"], "effect a": pairs["effect_a"], "effect b": pairs["effect_b"],
                         "joint": shown("joint", "joint"), "excess": shown("excess", "excess"),
                         "chosen excess": shown("chosen_excess", "chosen_excess"),
                         "b's attribution rise, a ablated": shown("rise_ab", "rise_ab"),
                         "a's attribution rise, b ablated": shown("rise_ba", "rise_ba"),
                         "compensates": pairs["compensates"].map({True: "yes", False: "no"}),
                         "backs up": pairs["backs"].map({True: "yes", False: "no"})})


def components_report_section(found: ComponentsOverview) -> Section:
    """The components section, from its numbers (``components_overview``): direct logit attribution
    to the predictable tokens and its top components, the logit lens, each head's and MLP's direct
    against total effect (attention vs MLP) and the copying / copy-suppression roles of the OV circuits."""
    figures, attribution = [], "Which components write the answer."
    if found.dla is not None:
        figures.append(ReportFigure("dla", "Direct logit attribution to the predictable tokens (mean, layer x head; "
                                    "MLPs right; hatched: its 95% interval over the probes contains 0)",
                                    png_bytes(dla_heatmap(found.dla))))
        attribution += (
            " **Direct logit attribution**: each head's, MLP's and embedding's "
            "contribution to the logit of the correct next token on the predictable second-copy tokens, with the "
            "final norm frozen at the clean run's scale (TransformerLens's convention; the parts add up to the "
            f"logit{', before the final soft cap' if found.dla.attrs['logits'] != 'as output' else ''}). The largest, "
            "chosen on the first probes of the selection rows and measured on the intervention probes:\n\n"
            + "\n".join(f"- {r.component}: {effect_text(r.dla, r.ci_low, r.ci_high, 2)}" for r in found.top.itertuples()))
    effects = found.effects
    per_kind = effects.groupby("kind")[["direct", "total"]].sum(min_count=1)
    text = (attribution
            + ("\n\n**Attention vs MLP**: each head and MLP ablated alone as in the calibration (position-aligned "
               "mean), its direct effect (everything downstream frozen) against its total effect, as the rise in the "
               "loss on the predictable tokens; summed over the heads the direct effects are "
               + f"{per_kind.loc['head', 'direct']:+.2f} nats (total {per_kind.loc['head', 'total']:+.2f}), over the MLPs "
               + (f"{per_kind.loc['mlp', 'direct']:+.2f} (total {per_kind.loc['mlp', 'total']:+.2f})"
                  if "mlp" in per_kind.index else "nothing (the model has none)") + "." if found.direct else "")
            + " **Logit lens**: the residual entering each block decoded as if it were the last. **What heads "
            "move** (table, largest copying first): copying read from each head's OV circuit on the tokens (the eigenvalues of W_E W_V "
            "W_O W_U; copy suppression is its negative) and the share of tokens whose own logit tops (bottoms) "
            "their row. The roles copying and copy_suppression are in the head table, decided against their "
            "random-initialisation nulls in the same false-discovery family as the attention roles.")
    figures += [ReportFigure("logit_lens", "The logit lens on the predictable tokens",
                             png_bytes(logit_lens_figure(found.lens))),
                *([ReportFigure("attention_vs_mlp", "Direct against total effect of ablating every head and MLP (nats)",
                                png_bytes(attention_vs_mlp_figure(effects)))] if found.direct else [])]
    return Section("Components", text, figures=figures, table=found.copying.round(3), csv="copying.csv",
                   csv_table=found.copying)


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
        how += (f" Screened: edge attribution (EAP) of all {len(circuit.edges)} edges on the first probes of the "
                f"selection rows chose the {int(circuit.edges['exact'].sum())} path-patched exactly on the "
                f"intervention probes ({circuit.screen.describe('edges')}, there; meta.json: circuit_screen); "
                "the others show their EAP estimate on the intervention probes, marked as such, and are not drawn in "
                "the figure (`--exact-all` patches every edge).")
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


def report_sections(table: pd.DataFrame, views: list[PatternView], rule: str,
                    drawn: dict[str, bytes] | None = None, *, figures: bool = True) -> tuple[list[Section], list[Section]]:
    """The head-role report's own sections, as (those before the later sections: the method, the
    roles, the explorer; those after: the head table, the figures, rollout). views: the display
    probe's and the text's (``pattern_views``); rule: what the probes were and how roles were
    assigned, Markdown; drawn: the PNGs of the figures that read no effect (the top heads, the layer
    map, the rollout), by name, drawn here where absent and kept there, so a page drawn again for
    the effects redraws only the role heatmaps; figures: False for the sections without their
    figures (``FIGURES_PENDING`` in their place), nothing drawn."""
    drawn = {} if drawn is None else drawn
    measures = [m for m in (*MEASURES, *MEANING_ROLES) if m in table.columns]
    grid = [*present_roles(table), *[m for m in ("entropy", "ablation_effect") if m in table.columns]]
    explorer = explorer_data(table, grid, [*ROLES, "entropy"], views, start_head(table), lead_role(table))
    figured, rolled = head_figures(table, views, drawn) if figures else ([], [])
    how = (rule + " Ablation effect: the rise in loss on the predictable second-copy tokens when the head's "
           "output is replaced by its mean over the other probes at the same place in their structure, printed "
           "as 'effect [low, high]' with its 95% percentile bootstrap interval over the probes; 'no detectable "
           "effect' marks a role head whose interval contains 0: no single-head effect on this loss that these "
           "probes tell apart from none, not a cut-off on the effect's size, nor a claim that the head does "
           "nothing (others may back it up, or it may act on another task).")
    return [
        Section("Method", how),
        Section("Roles", "Every head of each role, best first, and the partial heads (they beat their nulls but "
                "score below the threshold).\n\n" + "\n".join(role_summary(table))),
        Section("Heads", html=explorer_html(explorer, "click a head to see its attention on a probe prompt and on the "
                                            "report's text; the colour is the score chosen above")),
    ], [
        Section("All heads", "Each score with its 95% bootstrap interval over prompts; the heads with a role first, "
                "each group by its ablation effect once measured.",
                head_table_html(table, measures, present_roles(table), "head-table", extra=effect_columns(table)),
                table=markdown_frame(table), csv="head_roles.csv"),
        Section("Figures", "" if figures else FIGURES_PENDING, figures=figured),
        Section("Attention rollout", ROLLOUT_NOTE + ("" if figures else "\n\n" + FIGURES_PENDING), figures=rolled),
    ]


FIGURES_PENDING = "*Being drawn: the page is rewritten with these figures in a moment.*"


def head_figures(table: pd.DataFrame, views: list[PatternView],
                 drawn: dict[str, bytes]) -> tuple[list[ReportFigure], list[ReportFigure]]:
    """The head sections' figures from the head table and the views (``report_sections``): (the role
    heatmaps, the top heads, the layer map; the rollout), those that read no effect kept in ``drawn``."""
    probe_view, text_view = views
    intervals = {"ablation_effect": interval_columns("ablation_effect")}
    figures = [ReportFigure("role_scores", FIGURE_CAPTIONS["role_scores"],
                            png_bytes(role_heatmaps(table, heatmap_columns(table), intervals=intervals))),
               ReportFigure("top_heads", FIGURE_CAPTIONS["top_heads"],
                            once(drawn, "top_heads", lambda: top_heads_figure(table, probe_view))),
               ReportFigure("layer_map", FIGURE_CAPTIONS["layer_map"],
                            once(drawn, "layer_map", lambda: layer_map_figure(table, text_view)))]
    rolled = once(drawn, "rollout", lambda: rollout_figure(attention_rollout(text_view.patterns), text_view.tokens))
    return figures, [ReportFigure("rollout", FIGURE_CAPTIONS["rollout"], rolled)]


def once(drawn: dict[str, bytes], name: str, draw) -> bytes:
    """The PNG of the figure ``draw()`` makes, drawn where ``drawn`` lacks ``name`` and kept there."""
    if name not in drawn:
        drawn[name] = png_bytes(draw())
    return drawn[name]


def start_head(table: pd.DataFrame) -> tuple[int, int]:
    """The head the page shows first: the best head of ``lead_role``."""
    row = table.loc[table[lead_role(table)].idxmax()]
    return int(row["layer"]), int(row["head"])


def heatmap_columns(table: pd.DataFrame) -> list[str]:
    """The role heatmaps' panels: the roles, entropy and the ablation effect where the table has it."""
    return [m for m in (*ROLES, "entropy", "ablation_effect") if m in table.columns]


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
        line = f"- **{role}**{OV_ALONE if role in MEANING_ROLES else ''}: {role_heads(table, 'role', role) or 'none'}"
        partial = role_heads(table, "partial_role", role) if "partial_role" in table else ""
        lines.append(line + (f"; partial (beat their nulls, below the threshold): {partial}" if partial else ""))
    return lines


# a meaning role is read from the head's OV circuit alone, so beside it the page shows what the head
# writes to the logits itself (its direct effect), not what ablating it does through later layers
OV_ALONE = (" (read from the OV circuit alone, not from what the head does on the probes; beside it the head's "
            "direct effect, not its total ablation effect)")


def role_heads(table: pd.DataFrame, column: str, role: str, top: int | None = None) -> str:
    """The heads whose ``column`` (';'-joined roles) holds ``role``, best first (the ``top`` best, and
    how many more, where given), with score and ablation effect; for a meaning role
    (``MEANING_ROLES``, read from the OV circuit) its direct effect instead, where the table has it."""
    heads = table[has_role(table[column], role)].sort_values(role, ascending=False)
    direct = role in MEANING_ROLES and "direct_effect" in table
    shown = ", ".join(f"L{int(r.layer)}H{int(r.head)} (score {getattr(r, role):.2f}"
                      + (f", direct {effect_text(r.direct_effect, r.direct_ci_low, r.direct_ci_high)} nats" if direct
                         else ablation_text(r))
                      + ")" for r in heads.head(top).itertuples())
    more = len(heads) - (len(heads) if top is None else min(top, len(heads)))
    return shown + (f", and {more} more" if more else "")


def ablation_text(row) -> str:
    """A head's ablation effect as the role lists print it after its score, or that it is pending
    (a head table without the ablation section's columns)."""
    if not hasattr(row, "ablation_effect"):
        return ", ablation pending"
    return (f", ablation {effect_text(row.ablation_effect, row.ablation_ci_low, row.ablation_ci_high)} nats"
            + (f", {row.causal}" if row.causal else ""))


def effect_columns(table: pd.DataFrame) -> list[str]:
    """The head table's effects (each shown with its interval): the ablation effect, and the direct
    effect where the table has it."""
    return [column for column in ("ablation_effect", "direct_effect") if column in table.columns]


def markdown_frame(table: pd.DataFrame) -> pd.DataFrame:
    """The head table as report.md shows it: layer, head, role, the measures (and the copying scores),
    the effects as 'effect [low, high]' (``effect_text``); the heads with a role first, each group by
    its ablation effect, largest first, where the table has it (ties in (layer, head) order)."""
    partial = ["partial_role"] if "partial_role" in table.columns else []
    effect = -table["ablation_effect"] if "ablation_effect" in table.columns else 0.0
    order = table.assign(_no_role=table["role"].eq(""), _effect=effect).sort_values(
        ["_no_role", "_effect", "layer", "head"], kind="stable").index
    table = table.loc[order]
    effects = {column: [effect_text(*values) for values in zip(table[column], *map(table.get, interval_columns(column)))]
               for column in effect_columns(table)}
    return table[["layer", "head", "role", *partial, *[m for m in (*MEASURES, *MEANING_ROLES) if m in table.columns]]
                 ].assign(**effects)


def provenance(meta: dict) -> str:
    """The model and probes a report ran on, one sentence (the method section's first), from its meta.json."""
    return (f"Model `{meta['model']}`: family `{meta['family']}`, impl `{meta['impl']}`, weights "
            f"`{meta['weights_hash']}`; {meta['prompts']} probe prompts choosing the roles and "
            f"{meta['intervention_prompts']} others measuring the effects, of {meta['seq_len']} tokens, seed "
            f"{meta['seed']}" + (f", {meta['texts']} texts" if meta["texts"] else "") + ".")


def write_report(report: HeadReport, out: str | Path) -> Path:
    """Write the report directory (each file atomically) and return its ``Path``; the page opens on the
    summary, so no subtitle."""
    return write_report_files(out, f"Head roles: {report.meta['model']}", "", report.sections, report.meta,
                              {"head_roles.csv": report.table})
