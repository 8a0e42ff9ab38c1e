"""The report's "Why the role heads attend": each role head's contrast split over its input residual's
components (``analyses.circuits.role_qk.role_qk``: the QK attribution on the report's intervention
probes), written as the page's section: per role head its contrast and each side's top components,
the figure of the compositions the attribution reveals and the table joining them with the
circuit's composition score (weights) and path-patching effect (intervention) of the same edge.

Cost: one ``qk_attribution`` per role head, a forward of the intervention probes stopped at the
head's layer (``analyses.report.plan.role_qk_cost``).
"""

from __future__ import annotations

import pandas as pd

from analyses.circuits.circuit import circuit_figure, with_roles
from analyses.circuits.composition import head_label
from analyses.circuits.qk_check import PAIR_ROLES
from analyses.circuits.role_qk import QK_TOP, RoleQK, compared_edges, revealed_edges
from analyses.core.plots import png_bytes
from analyses.core.stats import effect_text
from analyses.report.page import ReportFigure, Section

QK = "QK attribution"  # the report's part name where a model cannot run it (meta.json: left_out)
QK_EDGES = 12  # revealed edges drawn and listed


def edge_table(edges: pd.DataFrame) -> pd.DataFrame:
    """The compared edges as the section's table: edge, QK share [interval], composition score over
    random, path-patching effect [interval] ('-' where not measured), largest share first."""
    shown = edges.reindex(edges["qk_share"].abs().sort_values(ascending=False, kind="stable").index).head(QK_EDGES)

    def interval(value, low, high, digits):
        return "-" if pd.isna(value) else effect_text(value, low, high, digits)

    return pd.DataFrame({
        "edge": [f"{head_label(r.sender_layer, r.sender_head)} -> {head_label(r.receiver_layer, r.receiver_head)}"
                 f".{r.via}" for r in shown.itertuples()],
        "QK share": [interval(r.qk_share, r.qk_ci_low, r.qk_ci_high, 2) for r in shown.itertuples()],
        "composition over random": ["-" if pd.isna(v) else f"{v:+.3f}" for v in shown["composition_minus_baseline"]],
        "path patching effect (nats)": [interval(r.effect, r.ci_low, r.ci_high, 3) for r in shown.itertuples()]})


def qk_report_section(found: RoleQK, circuit: pd.DataFrame | None, table: pd.DataFrame) -> Section:
    """The section: per role head its contrast and each side's top components, the figure of the
    revealed edges, and the table joining them with the circuit's composition scores and path patching
    (``circuit``: the circuit section's edges, ``CircuitSection.edges``; None where it did not run)."""
    title = "Why the role heads attend"
    if found.heads.empty:
        return Section(title, f"No head has a role of {', '.join(PAIR_ROLES)}, so there is no score to split.")
    text = (f"Each head with a role that names a target key has its pre-softmax contrast (the score at the target "
            f"minus the mean score of the other keys the query sees) split exactly over the components of its input "
            f"residual, with the pre-attention norm frozen at the clean run (`interp qk`, docs/guides/qk.md), on the "
            f"{found.n_prompts} intervention probes at up to {found.pairs} of its role's pairs per probe. Each side's "
            f"top {QK_TOP} components are shown with their share of the contrast (a side's shares add up to 1). A head "
            "among them is a composition the attribution reveals (sender -> receiver via k or q): the figure draws "
            "those, and the table puts each beside the circuit's composition score (weights) and path-patching "
            "effect (intervention) of the same edge, '-' where the circuit did not measure it.\n\n"
            + "\n".join(f"- {head_label(r.layer, r.head)} ({r.qk_role}, contrast {r.qk_contrast:.2f}): key side "
                        f"{r.qk_key_top.replace(';', ',')}; query side {r.qk_query_top.replace(';', ',')}"
                        for r in found.heads.itertuples()))
    edges = compared_edges(revealed_edges(found), circuit)
    if edges.empty:
        return Section(title, text + "\n\nNo head is among any role head's top components: no composition is "
                       "revealed.")
    figure = circuit_figure(with_roles(edges, table), top=QK_EDGES, value="qk_share",
                            title="composition revealed by QK attribution: sender -> receiver's key (k) or query (q); "
                                  "width = share of the receiver's contrast")
    return Section(title, text, figures=[ReportFigure("qk", "The heads among the role heads' top key- and query-side "
                                                      "components (QK attribution of the contrast)", png_bytes(figure))],
                   table=edge_table(edges))
