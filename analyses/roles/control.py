"""The report's control: the heads of its leading role (``lead_role``: induction, else previous-token)
ablated together against layer-matched random sets of the heads without the role
(``role_control``, one batched sweep of ``analyses.interventions.controls.control_effects``)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pandas as pd

from analyses.interventions.controls import ControlEffects, control_effects
from analyses.roles.calibration import FirstProbes
from analyses.roles.classify import has_role


CONTROL_DRAWS = 50  # random head sets the role heads are compared with (one sweep of this many + 1 ablations)


def lead_role(table: pd.DataFrame) -> str:
    """The role the report leads with (its control tests it, its page opens on it): induction, else
    (texts score no induction) previous-token."""
    return "induction" if "induction" in table.columns else "previous_token"


@dataclass
class RoleControl:
    """The report's control: ``role``'s heads (``heads``) ablated against layer-matched random sets
    drawn from the heads without the role (``found``), or why there is none (``why``).
    ``excluded``: every head with the role, tested or not, none of which a random set holds;
    ``unmatched``: the layers whose every head has the role, where no matched control is possible
    (none of their heads is tested); ``left``: the role heads of the other layers left untested, so
    that each layer keeps as many heads without the role as it has tested heads."""

    role: str
    heads: list[tuple[int, int]]
    left: list[tuple[int, int]]
    excluded: list[tuple[int, int]]
    unmatched: list[int]
    found: ControlEffects | None = None
    why: str = ""


def role_control(model, table: pd.DataFrame, first: FirstProbes, *, n_draws: int = CONTROL_DRAWS,
                 seed: int = 0) -> RoleControl:
    """The heads of the report's leading role (``lead_role``: induction, else previous-token)
    ablated as the head table's ablation effect is (position-aligned mean, the loss of the
    predictable tokens, on ``first``'s probes and run) against ``n_draws`` layer-matched random sets,
    in one batched sweep of ``n_draws + 1`` variants (``control_effects``). The random sets never
    hold a head with the role (every one is passed as ``exclude``), so a layer with k role heads of n
    tests its highest-scoring min(k, n - k); a layer whose every head has the role is unmatched."""
    role = lead_role(table)
    ranked = table[has_role(table["role"], role)].sort_values(
        [role, "layer", "head"], ascending=[False, True, True])
    role_heads = [(int(layer), int(head)) for layer, head in ranked[["layer", "head"]].itertuples(index=False)]
    per_layer = Counter(layer for layer, _ in role_heads)
    unmatched = sorted(layer for layer, count in per_layer.items() if count == model.cfg.n_heads)
    heads, left, taken = [], [], Counter()
    for layer, head in role_heads:
        if layer in unmatched:
            continue
        kept = taken[layer] < model.cfg.n_heads - per_layer[layer]
        (heads if kept else left).append((layer, head))
        taken[layer] += kept
    control = RoleControl(role, sorted(heads), sorted(left), sorted(role_heads), unmatched)
    if not role_heads:
        control.why = f"no head has the role {role}, so there is no set to test"
    elif not heads:
        control.why = unmatched_text(control)
    else:
        control.found = control_effects(model, first.probes, control.heads, "mean_aligned", first.metric,
                                        n_draws=n_draws, seed=seed, run=first.run, exclude=control.excluded)
    return control


def unmatched_text(control: RoleControl) -> str:
    """Where ``control`` has no matched control and why, in words."""
    plural = "s" if len(control.unmatched) > 1 else ""
    return (f"no matched control is possible in layer{plural} {', '.join(map(str, control.unmatched))}: every head "
            f"there has the role {control.role}, so no head without it is left to draw a layer-matched random "
            "set from")
