"""Why the role heads attend, computed (``role_qk``): each head with an attention role that defines
a target key (``analyses.circuits.qk_check.PAIR_ROLES``: induction, previous-token, duplicate-token)
has its pre-softmax contrast (its score at the role's target minus the mean score of the other keys
the query sees) split exactly over the components of its input residual (``qk_attribution``,
baseline ``mean_other_keys``), on probes at the pairs the role defines (``role_pairs``). Each side's
components are read as shares of the contrast (a component's key-side or query-side attribution
over the whole contrast; the shares of a side add up to 1).

A head among a receiver's top components on its key (query) side is a composition the attribution
reveals: sender -> receiver via k (q) (``revealed_edges``), joined with the circuit's composition
score (weights) and path-patching effect (intervention) of the same edge where the circuit measured
it (``compared_edges``). The report's section is ``analyses.report.qk_section``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import pandas as pd

from analyses.circuits.edges import KEY_COLUMNS
from analyses.circuits.qk_check import PAIR_ROLES, role_pairs
from analyses.components.qk import qk_attribution, qk_hooks
from analyses.core.probes import RepeatedProbes
from analyses.interventions.engine import cache_run

QK_PAIRS = 8  # pairs per probe (``role_pairs``' max_pairs): each probe's last queries where the role has a target
QK_TOP = 3  # components named per side
QK_COLUMNS = ["qk_role", "qk_contrast", "qk_key_top", "qk_query_top"]
SIDE_VIA = {"key": "k", "query": "q"}
_HEAD = re.compile(r"L(\d+)H(\d+)")


@dataclass(frozen=True)
class RoleQK:
    """heads: one row per role head, ``layer, head`` and ``QK_COLUMNS`` (the role whose pairs were
    attributed, the mean contrast in score units, each side's top ``QK_TOP`` components as
    'name share; ...'). sides: ``layer, head, role, side, component, attribution, ci_low, ci_high,
    share`` for every component of every role head. n_prompts, pairs: the probes and pairs per probe."""

    heads: pd.DataFrame
    sides: pd.DataFrame
    n_prompts: int
    pairs: int


def qk_heads(table: pd.DataFrame) -> list[tuple[int, int, str]]:
    """(layer, head, role) of every head holding a role of ``PAIR_ROLES``; a head with several takes
    the one it scores highest on."""
    picked = []
    for row in table.itertuples():
        held = [role for role in PAIR_ROLES if role in row.role.split(";")]
        if held:
            picked.append((int(row.layer), int(row.head), max(held, key=lambda role: getattr(row, role))))
    return picked


def role_qk(model, table: pd.DataFrame, probes: RepeatedProbes, *, seed: int = 0) -> RoleQK:
    """Each role head's contrast attribution (module docstring) on ``probes``, up to ``QK_PAIRS``
    pairs per probe, with the sides' 95% intervals (bootstrap over prompts, ``seed``). One forward of
    the probes, stopped at the last role head's layer, serves every head (``qk_hooks``); the
    attributions are chunked within the current execution's memory (``qk_attribution``)."""
    rows, sides, pairs = [], [], 0
    heads = qk_heads(table)
    wanted = list(dict.fromkeys(name for layer in sorted({layer for layer, _, _ in heads})
                                for name in qk_hooks(model, layer)))
    _, cache = cache_run(model, probes.tokens, wanted, logits=False) if heads else (None, None)
    for layer, head, role in heads:
        query, key = role_pairs(probes, role, QK_PAIRS)
        pairs = max(pairs, int(query.shape[1]))
        result = qk_attribution(model, probes.tokens, layer, head, query, key, "mean_other_keys", cache=cache)
        contrast = float(result.score.mean())
        found = pd.concat([result.key_side(seed=seed), result.query_side(seed=seed)], ignore_index=True)
        found = found.assign(layer=layer, head=head, role=role, share=found["attribution"] / contrast)
        sides.append(found)
        rows.append({"layer": layer, "head": head, "qk_role": role, "qk_contrast": contrast,
                     **{f"qk_{side}_top": top_text(found[found["side"] == side]) for side in SIDE_VIA}})
    columns = ["layer", "head", "role", "side", "component", "attribution", "ci_low", "ci_high", "share"]
    return RoleQK(pd.DataFrame(rows, columns=["layer", "head", *QK_COLUMNS]),
                  pd.concat(sides, ignore_index=True)[columns] if sides else pd.DataFrame(columns=columns),
                  probes.n_prompts, pairs)


def top_text(side: pd.DataFrame, top: int = QK_TOP) -> str:
    """A side's ``top`` components (rows largest |attribution| first) as 'L0H3 0.82; embed 0.10'."""
    return "; ".join(f"{row.component} {row.share:.2f}" for row in side.head(top).itertuples())


def with_qk(table: pd.DataFrame, heads: pd.DataFrame) -> pd.DataFrame:
    """The head table with ``QK_COLUMNS`` from ``heads`` (``RoleQK.heads``; '' and NaN for a head
    without a role of ``PAIR_ROLES``)."""
    merged = table.merge(heads, on=["layer", "head"], how="left")
    return merged.fillna({column: "" for column in QK_COLUMNS if column != "qk_contrast"})


def revealed_edges(found: RoleQK, top: int = QK_TOP) -> pd.DataFrame:
    """The heads among each role head's ``top`` components of each side, as edges: ``KEY_COLUMNS``
    (via k for the key side, q for the query side) and ``qk_share``, ``qk_ci_low``, ``qk_ci_high``
    (the sender's share of the receiver's contrast, its interval as the attribution's over the
    mean contrast)."""
    rows = []
    for (layer, head, side), group in found.sides.groupby(["layer", "head", "side"], sort=False):
        contrast = float(found.heads.set_index(["layer", "head"]).loc[(layer, head), "qk_contrast"])
        for row in group.head(top).itertuples():
            match = _HEAD.fullmatch(row.component)
            if match:
                rows.append({"sender_layer": int(match[1]), "sender_head": int(match[2]), "receiver_layer": int(layer),
                             "receiver_head": int(head), "via": SIDE_VIA[side], "qk_share": row.share,
                             "qk_ci_low": min(row.ci_low, row.ci_high) / contrast,
                             "qk_ci_high": max(row.ci_low, row.ci_high) / contrast})
    return pd.DataFrame(rows, columns=[*KEY_COLUMNS, "qk_share", "qk_ci_low", "qk_ci_high"])


def compared_edges(revealed: pd.DataFrame, circuit: pd.DataFrame | None) -> pd.DataFrame:
    """``revealed`` with the circuit's ``composition_minus_baseline`` and path-patching ``effect``
    (and its interval) of the same edge: NaN where the circuit did not measure it (a sender without a
    circuit role, an edge left at its estimate, or no circuit)."""
    measured = ["composition_minus_baseline", "effect", "ci_low", "ci_high"]
    if circuit is None or circuit.empty:
        return revealed.assign(**{column: float("nan") for column in measured})
    edges = circuit[circuit["exact"].astype(bool)]
    return revealed.merge(edges[[*KEY_COLUMNS, *measured]].astype({c: int for c in KEY_COLUMNS[:4]}),
                          on=KEY_COLUMNS, how="left")
