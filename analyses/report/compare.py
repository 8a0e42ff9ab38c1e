"""Two models of one shape, head by head (``interp compare A B``; DESIGN 4.4): two checkpoints of a
training run, or a model and its fine-tune, classified on the same probes.

Per head: every score of A and of B and the change B - A with a paired bootstrap interval over
the prompts (both models see the same prompts, so the same resamples serve both; the probes'
denominators do not depend on the model, so the change is itself a pooled ratio), the roles
gained and lost, the divergence of the two patterns (Jensen-Shannon, in bits, per query row
i >= 1, averaged over rows and prompts: 0 = the same attention, 1 = disjoint) and the change in
the mean-ablation effect. ``scores_over_training`` follows each head's scores through a series of
checkpoints (``interp train --save-every N``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import pandas as pd
import torch
from matplotlib.figure import Figure

from analyses.core.execution import executing
from analyses.components.rollout import all_patterns
from analyses.core.budget import DEFAULT_MEMORY_MB
from analyses.roles.causal_check import ablation_effects
from analyses.core.stats import bootstrap_ratio
from analyses.roles.classify import (DEFAULT_THRESHOLD, MEASURES, ROLES, head_table, pattern_chunks,
                               per_prompt_scores, probe_targets, prompt_counts_and_chance, scores_frame)
from analyses.core.hook_names import pattern_names
from analyses.interventions.engine import cache_run
from analyses.report.meta import model_meta
from analyses.core.plots import new_figure, png_bytes, role_heatmaps
from analyses.core.probes import RepeatedProbes, check_prompt_count, probes_for
from analyses.core.progress import progress_bar
from analyses.report.build import display_probe
from analyses.report.page import (PatternView, ReportFigure, Section, display_tokens, explorer_data, explorer_html,
                                  head_table_html, write_report_files)
from analyses.core.tokens import accumulator, token_differences
from interp.errors import UserError

# why a comparison needs at least 2 prompts (``check_prompt_count``)
PROMPTS_NEEDED_BY = ("the differences' intervals bootstrap over prompts, and the ablation effects mean-ablate each "
                     "prompt with the other prompts' mean")

SHAPE_FIELDS = ("n_layers", "n_heads", "d_vocab")
N_BOOT = 1000


@dataclass
class Comparison:
    """table: one row per head (see ``compare_models``); sections: the page; meta: both models' records."""

    table: pd.DataFrame
    sections: list[Section]
    meta: dict


def check_same_shape(model_a, model_b) -> None:
    """One-line UserError naming every field of the two configs that differs, or how their tokens
    differ (both models read the same token ids, so each id must be the same token in both)."""
    differ = [f"{field} {getattr(model_a.cfg, field)} vs {getattr(model_b.cfg, field)}" for field in SHAPE_FIELDS
              if getattr(model_a.cfg, field) != getattr(model_b.cfg, field)]
    if differ:
        raise UserError(f"the models differ in shape ({'; '.join(differ)}); compare needs the same "
                        f"{', '.join(SHAPE_FIELDS)}")
    tokens = token_differences(model_a, model_b)
    if tokens:
        raise UserError(f"the models differ in their tokens ({'; '.join(tokens)}); compare feeds both the same "
                        "token ids, so it needs one tokenizer and one start token")


def check_probes_fit(probes: RepeatedProbes, drawn_for: tuple[str, object], other: tuple[str, object]) -> None:
    """Refuse probes drawn for one model (``drawn_for``: its name and the model) that are longer than
    the context of another (``other``), which reads the same probes."""
    (name_a, model_a), (name_b, model_b) = drawn_for, other
    if probes.seq_len > model_b.cfg.n_ctx:
        raise UserError(f"the probes are {probes.seq_len} tokens (within {name_a}'s context n_ctx={model_a.cfg.n_ctx}) "
                        f"but {name_b} reads at most n_ctx={model_b.cfg.n_ctx}; pass seq_len <= {model_b.cfg.n_ctx}")


def js_divergence(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Jensen-Shannon divergence in bits between distributions along the last dim -> p.shape[:-1]."""
    m = (p + q) / 2

    def kl_to_m(a: torch.Tensor) -> torch.Tensor:  # 0 log 0 = 0
        return (torch.special.xlogy(a, a) - torch.special.xlogy(a, m)).sum(-1)

    return (kl_to_m(p) + kl_to_m(q)) / (2 * math.log(2))


def pattern_divergence(model_a, model_b, tokens: torch.Tensor, memory_mb: float = DEFAULT_MEMORY_MB) -> torch.Tensor:
    """Mean JS divergence (bits) between the two models' patterns over query rows i >= 1 and the
    prompts ``tokens`` (batch, pos) -> (layer, head); a bar over the chunks, shown per the current
    execution's progress."""
    names = pattern_names(model_a)
    total = accumulator(model_a, model_a.cfg.n_layers, model_a.cfg.n_heads)
    for rows, cache_a in pattern_chunks(model_a, tokens, memory_mb, "pattern divergence"):
        cache_b = cache_run(model_b, tokens[rows], names, logits=False)[1]
        for layer, name in enumerate(names):
            divergence = js_divergence(cache_a[name].float(), cache_b[name].float())  # (chunk, head, q)
            total[layer] += divergence[..., 1:].to(total.dtype).sum(dim=(0, 2))
    return (total / (tokens.shape[0] * (tokens.shape[1] - 1))).float()


def compare_models(model_a, model_b, *, names: tuple[str, str] = ("A", "B"), n_prompts: int = 64,
                   seq_len: int | None = None, seed: int = 0,
                   thresholds: float | Mapping[str, float] = DEFAULT_THRESHOLD,
                   memory_mb: float | None = None, progress: bool | None = None) -> Comparison:
    """Classify both models on the same probes (drawn once, from A's vocabulary) and compare them: a
    ``Comparison`` value.

    The table has, per head (``layer, head``): for each measure m ``m_a``, ``m_b``, ``m_delta``
    (B - A) with ``m_delta_ci_low``/``m_delta_ci_high``; ``role_a``, ``role_b``, ``gained``,
    ``lost`` (roles joined by ';'), ``change`` (``+role``/``-role``); ``divergence`` (bits);
    ``ablation_effect_a``/``_b``/``_delta`` (nats). ``names``: the two models' specs; ``memory_mb``:
    the budget of each step, ``progress``: see ``analyses.core.progress`` (both None: the current
    execution's, ``analyses.core.execution``)."""
    check_same_shape(model_a, model_b)
    check_prompt_count(n_prompts, f"prompts={n_prompts}", PROMPTS_NEEDED_BY)
    with executing(memory_mb, progress) as execution:
        steps = progress_bar(total=4, progress=execution.progress, desc="compare", unit="step")
        probes = probes_for(model_a, n_prompts, seq_len, seed=seed)
        check_probes_fit(probes, ("model A", model_a), ("model B", model_b))
        targets = probe_targets(probes)
        counts, chance = prompt_counts_and_chance(targets, MEASURES)
        sums = [per_prompt_scores(m, probes.tokens, targets, MEASURES) for m in (model_a, model_b)]
        steps.update()
        tables = [head_table(scores_frame(s, counts, chance, n_boot=N_BOOT, seed=seed),
                             ablation_effects(m, probes, execution.memory_mb), thresholds)
                  for s, m in zip(sums, (model_a, model_b))]
        steps.update()
        table = joined_table(tables, {m: bootstrap_ratio(sums[1][m] - sums[0][m], counts[m], N_BOOT, seed)
                                      for m in MEASURES})
        table["divergence"] = pattern_divergence(model_a, model_b, probes.tokens,
                                                 execution.memory_mb).flatten().cpu().numpy()
        steps.update()
        views = probe_views(model_a, model_b, probes, names)
        meta = {"a": model_meta(model_a, names[0]), "b": model_meta(model_b, names[1]), "prompts": n_prompts,
                "seq_len": probes.seq_len, "seed": seed, "thresholds": thresholds}
        sections = comparison_sections(table, views, names)
        steps.update()
        steps.close()
        return Comparison(table, sections, meta)


def joined_table(tables: Sequence[pd.DataFrame], deltas: Mapping[str, tuple]) -> pd.DataFrame:
    """The two head tables side by side (``_a``/``_b``) with each measure's change and interval
    (``deltas``: measure -> (estimate, low, high), each (layer, head)) and the role changes."""
    a, b = tables
    table = a[["layer", "head"]].copy()
    for measure, (delta, low, high) in deltas.items():
        table[f"{measure}_a"], table[f"{measure}_b"] = a[measure], b[measure]
        table[f"{measure}_delta"] = delta.flatten().cpu().numpy()
        table[f"{measure}_delta_ci_low"], table[f"{measure}_delta_ci_high"] = low.flatten().cpu().numpy(), high.flatten().cpu().numpy()
    table["role_a"], table["role_b"] = a["role"], b["role"]
    roles = [[set(r.split(";")) for r in t["role"]] for t in (a, b)]
    gained = [[r for r in ROLES if r in new - old] for old, new in zip(*roles)]
    lost = [[r for r in ROLES if r in old - new] for old, new in zip(*roles)]
    table["gained"], table["lost"] = [";".join(g) for g in gained], [";".join(l) for l in lost]
    table["change"] = [";".join([f"+{r}" for r in g] + [f"-{r}" for r in l]) for g, l in zip(gained, lost)]
    table["ablation_effect_a"], table["ablation_effect_b"] = a["ablation_effect"], b["ablation_effect"]
    table["ablation_effect_delta"] = b["ablation_effect"] - a["ablation_effect"]
    return table


def probe_views(model_a, model_b, probes: RepeatedProbes, names: tuple[str, str]) -> list[PatternView]:
    """Every head's pattern in each model on the display probe."""
    probe = display_probe(probes)
    tokens = display_tokens(model_a.to_str_tokens(probe))
    return [PatternView(f"{label}: {name}", tokens, all_patterns(model, probe))
            for label, name, model in zip("AB", names, (model_a, model_b))]


def change_summary(table: pd.DataFrame) -> list[str]:
    """Markdown lines: per role, the heads that gained it and those that lost it."""
    lines = []
    for role in ROLES:
        for kind in ("gained", "lost"):
            heads = table[table[kind].str.split(";").apply(lambda roles: role in roles)]
            if len(heads):
                found = ", ".join(f"L{int(r.layer)}H{int(r.head)} ({getattr(r, f'{role}_a'):.2f} -> "
                                  f"{getattr(r, f'{role}_b'):.2f})" for r in heads.itertuples())
                lines.append(f"- **{role}** {kind}: {found}")
    return lines or ["- no head gained or lost a role"]


def diff_columns() -> list[str]:
    return [f"{role}_delta" for role in ROLES] + ["divergence", "ablation_effect_delta"]


def comparison_sections(table: pd.DataFrame, views: list[PatternView], names: tuple[str, str]) -> list[Section]:
    """The comparison page: the explorer (grid coloured by a change; both models' patterns), the
    roles gained and lost, the per-head table, the change heatmaps."""
    grid = diff_columns()
    shown = table.assign(role=table["change"])  # the page's role column: what changed
    explorer = explorer_data(shown, grid, ["divergence"], views, start_head_of(table), "divergence")
    figure = ReportFigure("score_changes", "Change in each role score (B - A), pattern divergence and change in "
                          "ablation effect per head", png_bytes(role_heatmaps(table, grid, diverging=[c for c in grid if c != "divergence"])))
    deltas = [f"{m}_delta" for m in MEASURES]
    return [
        Section("Heads", f"A = `{names[0]}`, B = `{names[1]}`. Click a head to see its attention in both models "
                "on the same probe prompt.", explorer_html(explorer, "click a head; the colour is the change chosen above")),
        Section("Roles gained and lost", "\n".join(change_summary(table))),
        Section("All heads", "Each change B - A with its 95% paired bootstrap interval over prompts; divergence: "
                "mean Jensen-Shannon divergence of the two patterns over query rows (bits).",
                head_table_html(shown, deltas, sorted({c for changes in shown["role"] for c in changes.split(";") if c}),
                                "head-table", extra=("divergence", "ablation_effect_delta")),
                table=table[["layer", "head", "role_a", "role_b", *deltas, "divergence", "ablation_effect_delta"]]),
        Section("Figures", figures=[figure]),
    ]


def start_head_of(table: pd.DataFrame) -> tuple[int, int]:
    """The head whose pattern changed most."""
    row = table.loc[table["divergence"].idxmax()]
    return int(row["layer"]), int(row["head"])


def write_comparison(comparison: Comparison, out: str | Path) -> Path:
    """The comparison directory: heads.csv, report.md, index.html, figures/, meta.json (atomically)."""
    meta = comparison.meta
    subtitle = (f"A `{meta['a']['model']}` (weights `{meta['a']['weights_hash']}`), B `{meta['b']['model']}` "
                f"(weights `{meta['b']['weights_hash']}`); {meta['prompts']} probe prompts of {meta['seq_len']} "
                f"tokens, seed {meta['seed']}.")
    return write_report_files(out, f"Compare: {meta['a']['model']} -> {meta['b']['model']}", subtitle,
                              comparison.sections, meta, {"heads.csv": comparison.table})


# ------------------------------------------------------------------------ over training
def checkpoint_step(path: str | Path, index: int) -> int:
    """The training step of a checkpoint named ``step_NNNNNN`` (``interp train --save-every``),
    else its position in the series."""
    found = re.search(r"step_(\d+)", Path(path).name)
    return int(found.group(1)) if found else index


def scores_over_training(models: Sequence, steps: Sequence[int], *, n_prompts: int = 32, seq_len: int | None = None,
                         seed: int = 0, progress: bool | None = None) -> pd.DataFrame:
    """Each head's scores in each of a series of same-shape models (checkpoints of one run), on the
    same probes -> tidy frame ``step, layer, head, measure, score, ci_low, ci_high, chance``.
    ``progress``: the execution's (``analyses.core.execution``; None: the current one's)."""
    if len(models) != len(steps) or not models:
        raise UserError(f"need one step per model and at least one model (got {len(models)} models, {len(steps)} steps)")
    for model in models[1:]:
        check_same_shape(models[0], model)
    probes = probes_for(models[0], n_prompts, seq_len, seed=seed)
    for step, model in zip(steps[1:], models[1:]):
        check_probes_fit(probes, (f"the model of step {steps[0]}", models[0]), (f"the model of step {step}", model))
    targets = probe_targets(probes)
    counts, chance = prompt_counts_and_chance(targets, MEASURES)
    frames = []
    with executing(progress=progress):
        for step, model in zip(steps, progress_bar(models, desc="checkpoints", unit="model")):
            with executing(progress=False):
                sums = per_prompt_scores(model, probes.tokens, targets, MEASURES)
            frames.append(scores_frame(sums, counts, chance, n_boot=N_BOOT, seed=seed).assign(step=step))
    frame = pd.concat(frames, ignore_index=True)
    return frame[["step", *[c for c in frame.columns if c != "step"]]]


def training_figure(frame: pd.DataFrame, measures: Sequence[str] = ("previous_token", "induction")) -> Figure:
    """One panel per measure: every head's score against the training step (a line per head; the
    three that end highest in colour with their intervals, the others grey), the phase change
    visible head by head."""
    figure = new_figure(figsize=(6 * len(measures), 4.2))
    axes = figure.subplots(1, len(measures), squeeze=False)[0]
    for ax, measure in zip(axes, measures):
        rows = frame[frame["measure"] == measure]
        last = rows[rows["step"] == rows["step"].max()].sort_values("score", ascending=False)
        top = {(int(r.layer), int(r.head)) for r in last.head(3).itertuples()}
        for (layer, head), series in rows.groupby(["layer", "head"]):
            series = series.sort_values("step")
            labelled = (layer, head) in top
            style = {"linewidth": 1.8, "label": f"L{layer}H{head}"} if labelled else {"linewidth": 0.8, "color": "grey",
                                                                                    "alpha": 0.5}
            ax.plot(series["step"], series["score"], **style)
            if labelled:
                ax.fill_between(series["step"], series["ci_low"], series["ci_high"], alpha=0.15)
        ax.set(xlabel="training step", ylabel="score", title=measure.replace("_", " "), ylim=(0, 1))
        ax.legend(loc="upper left", fontsize=8)
    return figure
