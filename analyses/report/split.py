"""The report's one probe draw and its split (meta.json's ``probe_split``): rows measuring every
effect (the intervention probes), rows choosing the roles (the selection rows), and the first
selection rows choosing the page's lists (``selection_probes``, ``CHOSEN_LISTS``). ``drawn_probes``
and ``probe_rows`` give back the rows a written report used, from its meta.json."""

from __future__ import annotations

from analyses.core.execution import current
from analyses.components.decompose import component_hooks
from analyses.core.metrics import loss_metric
from analyses.core.probes import RepeatedProbes, probes_for
from analyses.interventions.ablation import ablation_reads
from analyses.interventions.run import Run
from analyses.roles.backup import DEFAULT_MIN_EXCESS
from analyses.roles.calibration import FirstProbes
from interp.errors import UserError

LIST_PROMPTS = 8  # the selection rows that choose the page's lists (``selection_probes``): half the default 16 measuring

# how the report's lists are chosen on the selection rows (meta.json's probe_split rule, the guide)
CHOSEN_LISTS = (f"the lists the page prints are chosen on the first {LIST_PROMPTS} selection rows (as many as the "
                "intervention probes where those are fewer): the top-5 "
                "direct logit attribution (exact DLA there), the circuit edges printed and drawn and, with a screen, "
                "those path-patched exactly (edge attribution, EAP, there: a screen, not the exact path-patching "
                "sweep), the backup pairs' heads (their first-order "
                f"ablation effect there) and backup groups (pairwise ablation there, pairs whose excess is at least "
                f"{DEFAULT_MIN_EXCESS} nats and whose excess interval excludes 0, and where one head's direct logit "
                "attribution rises when the other is ablated, its interval excluding 0)")


def list_prompts(intervention_prompts: int, selection_rows: int) -> int:
    """How many of the ``selection_rows`` choose the report's lists: ``LIST_PROMPTS``, or as many as
    the intervention probes or the selection rows where those are fewer."""
    return min(LIST_PROMPTS, intervention_prompts, selection_rows)


def selection_probes(model, probes: RepeatedProbes, intervention_prompts: int) -> FirstProbes:
    """The selection rows' first ``list_prompts`` probes, their loss metric on the predictable
    tokens and a ``Run`` of them keeping what the report's choices read: the ablation's hooks (the backup pairs and their
    heads' first-order screen, ``calibration_frames(choose=...)``) and the decomposition's
    (``component_hooks`` with the lens: the top direct logit attribution). One forward of these rows;
    the circuit's edge attribution runs its own (``chosen_edges``). Within the current execution: its
    memory bounds the forward's chunks, its progress shows the forward's bar."""
    selection = probes.after(intervention_prompts)
    chosen = selection.first(list_prompts(intervention_prompts, selection.n_prompts))
    metric = loss_metric(chosen.tokens, chosen.predictable)
    names = [*ablation_reads(model, "mean_aligned"), *component_hooks(model, lens=True)]
    run = Run.make(model, chosen.tokens, metric=metric, names=list(dict.fromkeys(names)),
                   progress=current().progress, desc="selection probes")
    return FirstProbes(probes=chosen, run=run, metric=metric)


def probe_split(n_prompts: int, intervention_prompts: int, seed: int, texts: bool = False) -> dict:
    """meta.json's record of how the probes are split (architecture §4.12): one draw of ``probes_for(model,
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


def drawn_probes(model, split: dict, seq_len: int | None) -> RepeatedProbes:
    """The one probe draw that ``split`` (``probe_split``'s record, meta.json's ``probe_split``) describes,
    drawn as the report draws it: ``probes_for`` of its ``probes_drawn`` at ``seq_len`` (meta.json's) and
    its ``seed``."""
    return probes_for(model, split["probes_drawn"], seq_len, seed=split["seed"])


def probe_rows(probes: RepeatedProbes, split: dict, part: str) -> RepeatedProbes:
    """The rows of ``part`` ("measurement", "selection" or "lists": ``probe_split``'s half-open row
    ranges) of ``drawn_probes``' draw."""
    if part not in ("measurement", "selection", "lists"):
        raise UserError(f"probe rows {part!r}: the split has 'measurement', 'selection' and 'lists'")
    low, high = split[part]
    return probes.rows(slice(low, high))


def chosen_apart(n_prompts: int, intervention_prompts: int, texts: int | None = None) -> str:
    """One sentence for the page: every effect is measured on prompts that did not choose the heads."""
    where = f"the {texts} texts" if texts else f"the other {n_prompts} probes of the same draw"
    return (f"Every effect is measured on prompts that did not choose the heads: the {intervention_prompts} "
            f"intervention probes, while the roles were chosen on {where}, and the top direct logit "
            "attributions, the circuit edges listed and the backup groups on the first "
            f"{list_prompts(intervention_prompts, n_prompts)} probes of the selection rows (meta.json: probe_split).")
