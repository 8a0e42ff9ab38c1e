"""From head roles to the circuit (architecture §4.6): the edges among chosen heads, each scored two ways.

An edge joins a sender head to a later receiver head's query, key or value input (or to the
logits). ``circuit_edges`` gives every edge among the chosen heads two numbers side by side:

- ``composition``: the weights' Q/K/V composition score (``analyses.composition_scores``, with
  ``composition_minus_baseline`` its excess over random matrices of the same shapes); none for
  logits edges;
- ``effect``: exact path patching's change of the metric when only that edge carries the other
  run's signal (``analyses.circuits.path_patching.path_patch``).

Path patching defaults to *noising* here: the clean run with the sender's corrupted-minus-clean
write added to one receiver input, so an edge's effect says whether the circuit needs it. (On the
induction pair, denoising one key path alone makes an induction head match the clean previous
token at a corrupted position and copy the corrupted token there, which raises the loss: a real
but confusing sign.)

``circuit_figure`` draws the strongest edges as a layered graph, and ``circuit_section`` is the
whole step from a head-role table to edges + figure, which ``interp circuit`` and the report use;
``report_circuit`` is the report's, with the edges it lists and draws chosen by edge attribution on
other probes than those that measure them (``chosen_edges``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Sequence

import pandas as pd
import torch
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import FancyArrowPatch

from analyses.roles.calibration import FirstProbes
from analyses.roles.classify import ALL_ROLES, ROLES
from analyses.circuits.composition import KINDS, composition_scores, head_label
from analyses.core.execution import executing
from analyses.core.metrics import Metric, loss_metric
from analyses.circuits.edges import KEY_COLUMNS, VIAS, check_vias
from analyses.circuits.path_patching import edge_attribution, path_patch, screened_path_patch
from analyses.core.probes import RepeatedProbes, corrupt_first_copy
from analyses.interventions.attribution import Screen
from analyses.interventions.run import Run
from analyses.core.plots import new_figure
from interp.errors import UserError

Head = tuple[int, int]
VIA_COLOURS = {"q": "tab:blue", "k": "tab:orange", "v": "tab:green", "logits": "tab:gray"}
VIA_BEND = {"q": 0.25, "k": 0.0, "v": -0.25, "logits": 0.1}  # arcs, so parallel q/k/v edges stay apart
_COLUMNS = [*KEY_COLUMNS, "composition", "composition_minus_baseline", "value", "effect", "ci_low", "ci_high", "n_prompts",
            "exact"]
# the roles of the mechanism the report's probes test (induction: a previous-token head writes where
# the key of an induction head reads; duplicate-token heads find the earlier copy); the report's circuit
# leaves out heads with none of these (a real model has many attention sinks, ``bos``: 110 of
# SmolLM2-135M's 270 heads, which would make tens of thousands of edges, none of them the circuit the
# probes test)
CIRCUIT_ROLES = ("previous_token", "duplicate_token", "induction")
CHOSEN_EDGES = 5  # the circuit edges the report lists (chosen on the selection probes: ``chosen_edges``)
CIRCUIT_FIGURE_EDGES = 12  # and those it draws
REPORT_SKIPPED_ROLES = tuple(role for role in ALL_ROLES if role not in CIRCUIT_ROLES)  # the report's circuit skips


def circuit_edges(model, clean, corrupted, metric: Metric, *, senders: Sequence[Head], receivers: Sequence[Head],
                  via: str | Sequence[str] = VIAS, direction: str = "noise", baseline_samples: int = 100,
                  seed: int = 0, memory_mb: float | None = None, progress: bool | None = None,
                  base_run: Run | None = None, screen: Screen | None = None,
                  screen_on: tuple | None = None) -> pd.DataFrame:
    """Every edge from ``senders`` to later ``receivers`` through each of ``via``, one row each.

    Args:
        model: a hooked model (``GPTModel`` or ``TransformerBridge``).
        clean, corrupted: token ids (batch, pos) or texts of equal token lengths.
        metric: logits -> scalar (``analyses.core.metrics``).
        senders, receivers: [(layer, head), ...].
        via: "q", "k", "v", "logits" or several.
        direction: "noise" (default: the clean run, one edge corrupted) or "denoise".
        baseline_samples, seed: the composition scores' random baseline.
        base_run: a ``Run`` of the prompts path patching edits (clean when noising), see ``path_patch``.
        screen: None path-patches every edge exactly; a ``Screen`` estimates every edge by edge
            attribution and path-patches exactly only those it chooses (``screened_path_patch``).
        screen_on: other prompts ``(clean, corrupted, metric)`` whose edge attribution the screen
            chooses by (``screened_path_patch``); None: these prompts'.

    Returns ``sender_layer, sender_head, receiver_layer, receiver_head, via`` (a logits edge's
    receiver is ``(n_layers, -1)``), ``composition``, ``composition_minus_baseline`` (NaN for
    logits edges), ``value`` (the metric with the edge patched) and ``effect`` (value minus the
    unpatched run's) with its 95% interval over prompts ``ci_low, ci_high`` and ``n_prompts`` (NaN
    for an estimate), ``exact`` (False where ``screen`` left the edge at its estimate), sorted by
    sender, receiver, via. ``memory_mb``, ``progress``: the execution's (``analyses.core.execution``;
    None: the current one's).
    """
    vias = check_vias(via)
    options = dict(senders=senders, receivers=receivers, via=vias, direction=direction, base_run=base_run)
    kinds = [v for v in vias if v in KINDS]
    with executing(memory_mb, progress):
        if screen is None:
            paths = path_patch(model, clean, corrupted, metric, **options).assign(exact=True)
        else:
            paths = screened_path_patch(model, clean, corrupted, metric, screen=screen, screen_on=screen_on, **options)
        if not kinds:
            return paths.assign(composition=float("nan"), composition_minus_baseline=float("nan"))[_COLUMNS]
        scores = composition_scores(model, kinds, senders=senders, receivers=receivers,
                                    baseline_samples=baseline_samples, seed=seed)
    scores = scores.rename(columns={"kind": "via", "score": "composition",
                                    "score_minus_baseline": "composition_minus_baseline"})
    merged = paths.merge(scores[[*KEY_COLUMNS, "composition", "composition_minus_baseline"]], on=KEY_COLUMNS,
                         how="left")
    return merged[_COLUMNS]


def check_role(role: str | None, what: str = "role") -> None:
    """None (any role) or one of ``analyses.roles.classify.ROLES``, else a one-line error."""
    if role is not None and role not in ROLES:
        raise UserError(f"{what} {role!r} is not a role; allowed: {', '.join(ROLES)}")


def role_heads(table: pd.DataFrame, role: str | None = None, skip: Sequence[str] = ()) -> list[Head]:
    """The heads of a head-role table (``layer, head, role``, roles joined by ';' as
    ``analyses.assign_roles`` writes them) that have ``role``, or any role when ``role`` is None;
    roles in ``skip`` do not count (a head whose only roles are those is left out)."""
    check_role(role)
    unknown = [name for name in skip if name not in ALL_ROLES]
    if unknown:
        raise UserError(f"skipped role {unknown[0]!r} is not a role; allowed: {', '.join(ALL_ROLES)}")
    kept = [(int(row.layer), int(row.head), [r for r in row.role.split(";") if r and r not in skip])
            for row in table.itertuples()]
    return sorted((layer, head) for layer, head, roles in kept if (role in roles if role is not None else roles))


def with_roles(edges: pd.DataFrame, table: pd.DataFrame) -> pd.DataFrame:
    """``edges`` with ``sender_role`` and ``receiver_role`` from the head-role table ('logits' for
    a logits edge's receiver, '' for a head without a role)."""
    roles = {(int(r.layer), int(r.head)): r.role for r in table.itertuples()}

    def role_of(layer, head):
        return "logits" if head < 0 else roles.get((int(layer), int(head)), "")

    return edges.assign(
        sender_role=[role_of(l, h) for l, h in zip(edges["sender_layer"], edges["sender_head"])],
        receiver_role=[role_of(l, h) for l, h in zip(edges["receiver_layer"], edges["receiver_head"])],
    )


def strongest(edges: pd.DataFrame, top: int, value: str = "effect") -> pd.DataFrame:
    """The ``top`` edges of largest ``|value|`` (ties broken by the edge order), strongest first."""
    order = edges[value].abs().sort_values(ascending=False, kind="stable").index
    return edges.loc[order[:top]]


def edge_lines(edges: pd.DataFrame, top: int = 5, value: str = "effect") -> list[str]:
    """Markdown list items for the ``top`` edges of largest ``|value|``: sender (role) -> receiver
    (role) via input, the value (the effect with its 95% interval ``[ci_low, ci_high]`` where the edge has one)
    and, for q/k/v, the composition score."""
    lines = []
    for row in strongest(edges.dropna(subset=[value]), top, value).itertuples():
        low, high = getattr(row, "ci_low", float("nan")), getattr(row, "ci_high", float("nan"))
        interval = "" if value != "effect" or pd.isna(low) or pd.isna(high) else f" [{low:+.4f}, {high:+.4f}]"
        scored = f"{value} {getattr(row, value):+.4f}{interval}" + ("" if getattr(row, "exact", True) else " (estimate)")
        if row.via in KINDS:
            scored += f", composition {row.composition:.3f} ({row.composition_minus_baseline:+.3f} over random)"
        lines.append(f"- {_endpoint(row, 'sender')} -> {_endpoint(row, 'receiver')} via {row.via}: {scored}")
    return lines


def _endpoint(row, side: str) -> str:
    """'L0H3 (previous_token)', 'L1H5' or 'logits' for a row's ``side`` ("sender" or "receiver")."""
    head = getattr(row, f"{side}_head")
    if head < 0:
        return "logits"
    role = getattr(row, f"{side}_role", "")
    return head_label(getattr(row, f"{side}_layer"), head) + (f" ({role})" if role else "")


def _node_positions(nodes: Sequence[Head]) -> dict[Head, tuple[float, float]]:
    """x = layer, y = rank among the drawn heads of that layer, centred on 0."""
    positions = {}
    for layer in sorted({n[0] for n in nodes}):
        column = sorted(n for n in nodes if n[0] == layer)
        for rank, node in enumerate(column):
            positions[node] = (float(layer), (len(column) - 1) / 2 - rank)
    return positions


def _node_label(node: Head, roles: dict[Head, str]) -> str:
    if node[1] < 0:
        return "logits"
    role = roles.get(node, "")
    return head_label(*node) + ("\n" + role.replace("_", " ").replace(";", "\n") if role else "")


def circuit_figure(edges: pd.DataFrame, *, top: int = 12, value: str = "effect", title: str | None = None) -> Figure:
    """A layered graph of the ``top`` edges of largest ``|value|`` in a ``circuit_edges`` frame.

    Heads are nodes at x = layer (the logits after the last layer), labelled ``L{layer}H{head}``
    and, when the frame has ``sender_role``/``receiver_role`` (``with_roles``), their roles. Each
    edge is an arrow coloured by its input (q, k, v, logits), as wide as its ``|value|`` relative
    to the strongest, dashed where ``value`` is negative; the strongest edges are drawn on top.
    """
    shown = strongest(edges.dropna(subset=[value]), top, value)
    if shown.empty:
        raise UserError(f"no edge with a {value!r} to draw")
    senders = list(zip(shown["sender_layer"], shown["sender_head"]))
    receivers = list(zip(shown["receiver_layer"], shown["receiver_head"]))
    roles = {}
    if "sender_role" in shown:
        roles = dict(zip(senders, shown["sender_role"])) | dict(zip(receivers, shown["receiver_role"]))
    positions = _node_positions(sorted(set(senders) | set(receivers)))
    per_layer = Counter(x for x, _ in positions.values())
    figure = new_figure(figsize=(2.6 * len(per_layer) + 2.5, 0.9 * max(per_layer.values()) + 2.2))
    ax = figure.subplots()
    largest = float(shown[value].abs().max()) or 1.0
    for sender, receiver, via, size in reversed(list(zip(senders, receivers, shown["via"], shown[value]))):
        ax.add_patch(FancyArrowPatch(
            positions[sender], positions[receiver], connectionstyle=f"arc3,rad={VIA_BEND[via]}",
            arrowstyle="-|>", mutation_scale=12, linewidth=0.8 + 6.0 * abs(size) / largest,
            linestyle="--" if size < 0 else "-", color=VIA_COLOURS[via], alpha=0.85, shrinkA=24, shrinkB=24))
    for node, (x, y) in positions.items():
        ax.text(x, y, _node_label(node, roles), ha="center", va="center", fontsize=8, zorder=3,
                bbox=dict(boxstyle="round,pad=0.35", facecolor="white", edgecolor="0.3"))
    _layer_axis(ax, positions)
    ax.legend(handles=_legend_handles(shown, value), loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False,
              fontsize=8)
    ax.set_title(title or f"the {len(shown)} strongest edges by |{value}| (width)")
    return figure


def _layer_axis(ax, positions: dict[Head, tuple[float, float]]) -> None:
    """Limits around the nodes, one x tick per layer ('logits' for the logits), no y axis."""
    xs, ys = zip(*positions.values())
    ax.set_xlim(min(xs) - 0.6, max(xs) + 0.6)
    ax.set_ylim(min(ys) - 0.8, max(ys) + 0.8)
    names = {x: "logits" if head < 0 else f"layer {layer}" for (layer, head), (x, _) in positions.items()}
    ax.set_xticks(sorted(names), [names[x] for x in sorted(names)])
    ax.set_yticks([])
    for side in ("left", "right", "top"):
        ax.spines[side].set_visible(False)


def _legend_handles(shown: pd.DataFrame, value: str) -> list[Line2D]:
    """One colour per input drawn (in q, k, v, logits order), and the dash when a value is negative."""
    handles = [Line2D([], [], color=VIA_COLOURS[v], linewidth=3, label=f"via {v}") for v in VIAS
               if v in set(shown["via"])]
    if (shown[value] < 0).any():
        handles.append(Line2D([], [], color="0.3", linestyle="--", label=f"negative {value}"))
    return handles


@dataclass
class CircuitSection:
    """What the circuit step gives a report or ``interp circuit``.

    edges: ``circuit_edges`` among the chosen heads, with ``sender_role``/``receiver_role``.
    figure: ``circuit_figure`` of the strongest path-patched edges (a screen's estimates are not
        drawn); None when no head was chosen, or the screen patched no edge exactly.
    senders, receivers: the chosen heads.
    skipped: the role heads left out because their only roles are the skipped ones (``skip_roles``).
    screen: the ``Screen`` that chose which edges were path-patched exactly (None: every edge).
    """

    edges: pd.DataFrame
    figure: Figure | None
    senders: list[Head]
    receivers: list[Head]
    skipped: list[Head] = field(default_factory=list)
    screen: Screen | None = None


def induction_pair(probes: RepeatedProbes, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, Metric]:
    """The probes' patching pair and metric, as ``interp patch`` makes them: clean = the probes,
    corrupted = their first copy replaced (``corrupt_first_copy``, seeded ``seed + 1``), metric =
    the clean loss on the predictable (second-copy) tokens."""
    corrupted = corrupt_first_copy(probes, seed=seed + 1)
    return probes.tokens, corrupted, loss_metric(probes.tokens, probes.predictable)


def circuit_section(model, table: pd.DataFrame, probes: RepeatedProbes, *, sender_role: str | None = None,
                    receiver_role: str | None = None, via: str | Sequence[str] = VIAS, direction: str = "noise",
                    top: int = 12, baseline_samples: int = 100, seed: int = 0,
                    memory_mb: float | None = None, progress: bool | None = None,
                    run: Run | None = None, skip_roles: Sequence[str] = (),
                    screen: Screen | None = None, screen_probes: RepeatedProbes | None = None) -> CircuitSection:
    """The circuit among a head-role table's heads on the probes' induction pair.

    ``table``: ``layer, head, role`` (``analyses.assign_roles``, or the report's head table);
    senders are the heads with ``sender_role`` (None: any role), receivers those with
    ``receiver_role``; a head whose only roles are in ``skip_roles`` is neither (the report skips
    every role outside ``CIRCUIT_ROLES``). The metric is the loss on the probes' predictable tokens, so an edge's
    ``effect`` > 0 under noising means the loss rises without it. With no head chosen the section
    has no edges and no figure. ``run``: a ``Run`` of the probes, which noising path patching edits
    (it runs the clean probes) instead of running them again. ``screen``: as ``circuit_edges``;
    ``screen_probes``: the probes whose induction pair (same ``seed``) the screen chooses the exact edges
    on, so that the probes measured do not choose them (None: ``probes``). ``memory_mb``,
    ``progress``: the execution's (``analyses.core.execution``; None: the current one's).
    """
    senders, receivers = role_heads(table, sender_role, skip_roles), role_heads(table, receiver_role, skip_roles)
    skipped = sorted(set(role_heads(table)) - set(role_heads(table, skip=skip_roles)))
    if not senders or not receivers:
        empty = pd.DataFrame(columns=[*_COLUMNS, "sender_role", "receiver_role"])
        return CircuitSection(empty, None, senders, receivers, skipped)
    clean, corrupted, metric = induction_pair(probes, seed)
    with executing(memory_mb, progress):
        edges = circuit_edges(model, clean, corrupted, metric, senders=senders, receivers=receivers, via=via,
                              direction=direction, baseline_samples=baseline_samples, seed=seed,
                              base_run=run if direction == "noise" else None, screen=screen,
                              screen_on=None if screen_probes is None else induction_pair(screen_probes, seed))
    edges = with_roles(edges, table)
    patched = edges[edges["exact"].astype(bool)]  # the figure draws no estimate under "path patching"
    title = (f"strongest edges by path patching ({direction}; loss on repeated tokens; width = |effect|)"
             + (f"\nnot drawn: the {len(edges) - len(patched)} edges left at their EAP estimate"
                if len(patched) < len(edges) else ""))
    figure = circuit_figure(patched, top=top, title=title) if len(patched) else None
    return CircuitSection(edges, figure, senders, receivers, skipped, screen)




def chosen_edges(model, circuit: CircuitSection, selection: FirstProbes, *, seed: int = 0) -> CircuitSection:
    """The circuit with each edge's edge-attribution estimate (EAP, noising, on the induction pair of
    ``selection``'s probes: two forwards and a backward, the cheaper screen of the exact sweep) as
    ``chosen_by``, by which the report chooses the edges it prints and draws (``CHOSEN_EDGES``, the
    figure's ``top``), their effects those path-patched on the intervention probes; the figure redrawn
    from them."""
    if circuit.edges.empty:
        return circuit
    clean, corrupted, metric = induction_pair(selection.probes, seed)
    screen = edge_attribution(model, clean, corrupted, metric, senders=circuit.senders, receivers=circuit.receivers,
                              via=VIAS, direction="noise")
    edges = circuit.edges.merge(screen[[*KEY_COLUMNS, "attribution"]].rename(columns={"attribution": "chosen_by"}),
                                on=KEY_COLUMNS, how="left")
    patched = edges[edges["exact"].astype(bool)]
    shown = strongest(patched, CIRCUIT_FIGURE_EDGES, "chosen_by")
    title = ("edges chosen by edge attribution on the selection probes; width = |effect| by path patching (noise) on "
             "the intervention probes" + (f"\nnot drawn: the {len(edges) - len(patched)} edges left at their EAP "
                                         "estimate" if len(patched) < len(edges) else ""))
    figure = circuit_figure(shown, top=CIRCUIT_FIGURE_EDGES, title=title) if len(shown) else None
    return replace(circuit, edges=edges, figure=figure)


def screen_meta(circuit: CircuitSection | None, screened_on: list[int]) -> dict | None:
    """meta.json's record of the circuit's screen: its rule, how many edges it measured exactly and
    ``screened_on``, the probe rows (half-open, of ``probe_split``'s draw) whose edge attribution chose
    them (None without a screen, or where the circuit was left out)."""
    if circuit is None or circuit.screen is None:
        return None
    return {"top_k": circuit.screen.top_k, "share": circuit.screen.share, "edges": len(circuit.edges),
            "exact": int(circuit.edges["exact"].sum()), "screened_on": list(screened_on)}


def report_circuit(model, table: pd.DataFrame, first: FirstProbes, selection: FirstProbes, *, seed: int = 0,
                   screen: Screen | None = None) -> CircuitSection:
    """The report's circuit: the edges among ``table``'s role heads but those whose only roles are
    outside ``CIRCUIT_ROLES`` (``circuit_section`` on ``first``'s probes and run, a ``screen``, where
    given, choosing its exact edges on ``selection``'s probes), each with the edge attribution on
    ``selection``'s probes that chooses the edges the report lists and draws (``chosen_edges``).
    Within the current execution."""
    circuit = circuit_section(model, table, first.probes, seed=seed,
                              run=first.run, skip_roles=REPORT_SKIPPED_ROLES, screen=screen,
                              screen_probes=selection.probes)
    return chosen_edges(model, circuit, selection, seed=seed)
