"""A task's analysis and its page (``interp task`` writes it): the metric on the clean and corrupted
runs, head and MLP patching (all positions and by position), direct logit attribution, path
patching from the top senders with edge attribution (EAP, EAP-IG) beside it, as one offline page
built with the report's machinery (``analyses/report/page.py``).

Each of those is a step (``STEPS``); given a store (``analyses.core.steps.Steps``, keyed by
``task_inputs``: the model's weights hash, the task's contents, the options), ``analyse_task``
reads the steps already finished from it and writes each other step to it as soon as it is done,
so an interrupted ``interp task --resume`` computes only the rest."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pandas as pd
import torch

from analyses.core.budget import DEFAULT_MEMORY_MB
from analyses.circuits.circuit import circuit_figure, strongest
from analyses.components.decompose import components_cache, direct_logit_attribution, dla_heatmap
from analyses.circuits.edge_attribution import edge_agreement
from analyses.report.intervention_figures import patching_figure
from analyses.core.hook_names import has_mlps
from analyses.core.metrics import evaluate_metric
from analyses.circuits.path_patching import eap_ig, edge_attribution, path_patch
from analyses.interventions.patching import patch_heads, patch_mlps, patching_frame
from analyses.core.plots import png_bytes
from analyses.report.page import ReportFigure, Section, write_report_files
from analyses.tasks.task import Task, TaskBatch, task_batch, task_metric
from interp.errors import UserError


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
    or {"refused": why} where the model cannot take that method's edits."""

    task: Task
    values: dict
    heads: pd.DataFrame
    heads_by_pos: pd.DataFrame
    mlps: pd.DataFrame | None
    mlps_by_pos: pd.DataFrame | None
    dla: pd.DataFrame | None
    edges: pd.DataFrame
    agreement: dict


# edge attribution methods beside path patching: frame column -> method (same edges, same frame)
ATTRIBUTIONS = {"attribution": edge_attribution, "attribution_ig": eap_ig}
ATTRIBUTION_NAMES = {"attribution": "Edge attribution (EAP)", "attribution_ig": "EAP-IG"}
# the steps of a task's analysis, in the order they run (the MLP steps only where the model has
# MLPs, DLA only for the logit difference)
STEPS = ("metric", "heads", "heads_by_pos", "mlps", "mlps_by_pos", "dla", "path_patching", *ATTRIBUTIONS)
Step = Callable[[str, Callable[[], object]], object]  # (name, compute) -> the step's value


def task_inputs(task: Task, record: dict[str, str], top: int) -> dict:
    """What a task's analysis depends on, for a step store (``analyses.core.steps.Steps``): the
    model's ``record`` (``interp.provenance``: family, impl, weights hash), the task's contents
    (its name, size, metric, and the SHA-256 of its prompts, answers and distractors) and ``top``.
    The memory budget and the device say how, not what, and are left out, as a study's are."""
    contents = json.dumps([task.clean, task.corrupted, task.answers, task.distractors, task.metric])
    return {"model": {key: record[key] for key in ("family", "impl", "weights_hash")},
            "task": {"name": task.name, "prompts": len(task), "metric": task.metric,
                     "sha256": hashlib.sha256(contents.encode()).hexdigest()},
            "options": {"top": top}}


def _compute(name: str, compute: Callable[[], object]) -> object:
    return compute()


def task_dla(model, task: Task, batch: TaskBatch) -> pd.DataFrame:
    """Mean over prompts of each component's direct contribution to (mean answer logit - mean
    distractor logit) at the prompt's last token -> ``component, kind, layer, head, dla``. DLA is
    linear in the answer's unembedding, so each answer (distractor) slot is one call, weighted."""
    cache = components_cache(model, batch.clean)
    positions = torch.unique(batch.last).tolist()
    per_prompt = None
    for ids, sign in ((task.answers, 1.0), (task.distractors, -1.0)):
        for slot in range(max(len(s) for s in ids)):
            tokens = torch.tensor([s[slot] if slot < len(s) else s[0] for s in ids])
            weight = torch.tensor([sign / len(s) if slot < len(s) else 0.0 for s in ids])
            frame = direct_logit_attribution(model, cache, tokens[:, None].expand(-1, len(positions)),
                                             positions=positions)
            frame = frame[frame["position"].to_numpy() == batch.last.cpu().numpy()[frame["prompt"].to_numpy()]]
            frame = frame.assign(dla=frame["dla"] * weight.cpu().numpy()[frame["prompt"].to_numpy()])
            per_prompt = frame if per_prompt is None else per_prompt.assign(
                dla=per_prompt["dla"].to_numpy() + frame["dla"].to_numpy())
    keys = ["component", "kind", "layer", "head"]
    return per_prompt.groupby(keys, dropna=False, sort=False)["dla"].mean().reset_index()


def analyse_task(model, task: Task, *, top: int = 3, memory_mb: float = DEFAULT_MEMORY_MB,
                 progress: bool | None = None, steps: Step | None = None) -> TaskAnalysis:
    """The ``TaskAnalysis`` of ``task`` on ``model``. ``steps``: a store of finished steps
    (``analyses.core.steps.Steps`` made for ``task_inputs``), called ``steps(name, compute)`` for each
    of ``STEPS``: it gives the finished value or computes it and keeps it; None computes every step."""
    step = steps or _compute
    batch = task_batch(model, task)
    metric = task_metric(task, batch.last)
    pair = (model, batch.clean, batch.corrupted, metric)
    options = dict(memory_mb=memory_mb, progress=progress)

    def unpatched() -> dict:
        with torch.no_grad():
            return {"clean": evaluate_metric(metric, model(batch.clean)).item(),
                    "corrupted": evaluate_metric(metric, model(batch.corrupted)).item()}

    values = step("metric", unpatched)
    heads = step("heads", lambda: patching_frame(patch_heads(*pair, **options), ("layer", "head")))
    heads_by_pos = step("heads_by_pos", lambda: patching_frame(patch_heads(*pair, by_position=True, **options),
                                                               ("layer", "pos", "head")))
    with_mlps = has_mlps(model)
    mlps = step("mlps", lambda: patching_frame(patch_mlps(*pair, **options), ("layer",))) if with_mlps else None
    mlps_by_pos = step("mlps_by_pos", lambda: patching_frame(patch_mlps(*pair, by_position=True, **options),
                                                             ("layer", "pos"))) if with_mlps else None
    dla = step("dla", lambda: task_dla(model, task, batch)) if task.metric == "logit_diff" else None
    ranked = heads.assign(size=(heads["metric"] - values["corrupted"]).abs()).sort_values("size", ascending=False,
                                                                                          kind="stable")
    senders = [tuple(map(int, cell)) for cell in ranked[["layer", "head"]].head(top).to_numpy()]
    edges = step("path_patching", lambda: path_patch(*pair, senders=senders, **options))
    agreement = {}
    for column, method in ATTRIBUTIONS.items():
        found = step(column, lambda method=method: _attribution(method, pair, senders))
        if isinstance(found, dict):  # e.g. a bridge that cannot split q/k/v per head: said on the page
            agreement[column] = found
            continue
        edges[column] = found["attribution"].to_numpy()
        if len(edges) >= 2:
            scored = edges[["effect", column]].rename(columns={column: "attribution"})
            agreement[column] = edge_agreement(scored, top_k=min(5, len(edges)))
    return TaskAnalysis(task, values, heads, heads_by_pos, mlps, mlps_by_pos, dla, edges, agreement)


def _attribution(method, pair: tuple, senders: list[tuple[int, int]]) -> pd.DataFrame | dict:
    """``method``'s attribution of the path-patched edges, as a one-column frame (``attribution``),
    or ``{"refused": why}`` where the model cannot take its edits."""
    try:
        return method(*pair, senders=senders)[["attribution"]]
    except UserError as refusal:
        return {"refused": str(refusal)}


def _figure(name: str, caption: str, figure) -> ReportFigure:
    return ReportFigure(name, caption, png_bytes(figure, caption))


def task_sections(analysis: TaskAnalysis) -> list[Section]:
    """The page's sections: the task, the metric, patching, DLA, the circuit."""
    task, values = analysis.task, analysis.values
    about = [f"**{len(task)}** prompt pairs; metric **{task.metric}** at each prompt's last token; "
             f"{task.dropped} candidate words or prompts dropped for this tokenizer.",
             *([f"Note: {task.note}."] if task.note else []),
             f"- clean: `{task.clean[0]}`", f"- corrupted: `{task.corrupted[0]}`"]
    metric = pd.DataFrame({"run": list(values), "metric": list(values.values())})
    sections = [Section("Task", "\n".join(about)), Section("Metric", "The task metric on the unpatched runs.",
                                                         table=metric)]
    patched = [_figure("heads", "denoising: each head's output patched clean into corrupted (all positions)",
                       patching_figure(analysis.heads, "metric", "head patching")),
               _figure("heads_by_pos", "denoising: each head at each position",
                       patching_figure(analysis.heads_by_pos, "metric", "head patching by position"))]
    if analysis.mlps is not None:
        patched += [_figure("mlps_by_pos", "denoising: each MLP's output at each position",
                            patching_figure(analysis.mlps_by_pos, "metric", "MLP patching by position"))]
    sections.append(Section("Patching", f"Corrupted-run metric {values['corrupted']:.4f}, clean {values['clean']:.4f}; "
                                        "each cell is the metric with one component patched from the clean run.",
                            figures=patched, table=analysis.heads))
    if analysis.mlps is not None:
        sections.append(Section("MLP patching", "Each MLP's output patched from the clean run (all positions).",
                                table=analysis.mlps))
    if analysis.dla is not None:
        sections.append(Section("Direct logit attribution",
                                "Each component's direct contribution to the logit difference (mean over prompts).",
                                figures=[_figure("dla", "direct logit attribution", dla_heatmap(analysis.dla))],
                                table=analysis.dla))
    agreement = "".join(
        f" {ATTRIBUTION_NAMES[column]} not computed: {found['refused']}" if "refused" in found else
        f" {ATTRIBUTION_NAMES[column]} vs path patching: Spearman {found['spearman']:.3f}, top-{found['top_k']} "
        f"overlap {found['top_k_overlap']:.2f}." for column, found in analysis.agreement.items())
    sections.append(Section("Circuit", "Path patching from the heads whose patching moves the metric most." + agreement
                            + "\n\n" + "\n".join(edge_lines_plain(analysis.edges)),
                            figures=[_figure("circuit", "strongest path-patched edges",
                                             circuit_figure(analysis.edges, title="task circuit"))],
                            table=analysis.edges))
    return sections


def edge_lines_plain(edges: pd.DataFrame, top: int = 5) -> list[str]:
    """Markdown items for the ``top`` edges of largest |effect|."""
    lines = []
    for row in strongest(edges, top).itertuples():
        receiver = "logits" if row.via == "logits" else f"L{row.receiver_layer}H{row.receiver_head}"
        lines.append(f"- L{row.sender_layer}H{row.sender_head} -> {receiver} via {row.via}: effect {row.effect:+.4f}")
    return lines


def write_task_page(analysis: TaskAnalysis, out: Path, meta: dict) -> Path:
    """``out``: index.html (self-contained), report.md, figures/, the tables as CSV, meta.json."""
    tables = {"metric.csv": pd.DataFrame({"run": list(analysis.values), "metric": list(analysis.values.values())}),
              "heads.csv": analysis.heads, "heads_by_pos.csv": analysis.heads_by_pos, "edges.csv": analysis.edges}
    if analysis.mlps is not None:
        tables |= {"mlps.csv": analysis.mlps, "mlps_by_pos.csv": analysis.mlps_by_pos}
    if analysis.dla is not None:
        tables["dla.csv"] = analysis.dla
    title = f"interp task {analysis.task.name}"
    return write_report_files(out, title, f"model {meta['model']}", task_sections(analysis), meta, tables)
