"""The report's pages (``index.html`` of ``interp report`` and ``interp compare``) and their
Markdown twin, built from a list of ``Section``s.

The HTML page is one self-contained file that makes no network request: its figures are base64
PNGs, its style and script (``analyses/report/assets/``) and CircuitsVis's browser bundle are inlined, and
the attention patterns it shows are stored in the page, compactly: for each stored text, the
lower triangle of every head's (q, k) pattern quantised to uint8 (value x 255, rounded), base64.
The same inputs give the same bytes.

A section is a title, Markdown text, HTML for the page only (e.g. an interactive view), figures
and a table; adding one to a report is ``report.sections.append(Section(...))``. A section with a
``csv`` file keeps its whole table in that file beside the page, and both pages show its first
``INLINE_ROWS`` rows with a link to it.
"""

from __future__ import annotations

import base64
import html
import json
import math
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Sequence

import einops
import pandas as pd
import torch

from analyses.report.meta import write_meta
from analyses.core.plots import token_label
from analyses.core.stats import effect_text
from interp.files import write_atomic

FLOAT_FORMAT = "%.6f"
INLINE_ROWS = 20  # the rows of a table with a ``csv`` file that the pages show (the file has every row)

ASSETS = resources.files("analyses") / "report" / "assets"


@dataclass
class ReportFigure:
    """A figure of a report: ``figures/{name}.png`` beside report.md, inlined in index.html."""

    name: str
    caption: str
    png: bytes


@dataclass
class Section:
    """One part of a report page.

    text: Markdown (paragraphs, ``- `` lists, ``**bold**``, ``code``) for both report.md and index.html.
    html: for index.html only (an interactive view); where given with a table, it stands for the
        table on the page (report.md still gets the table). A section with html alone is not in report.md.
    table: a Markdown table in report.md, a sortable one in index.html.
    csv: the name of a CSV file beside the page holding the whole table (a section with a csv has a
        table); the pages then show the table's first ``INLINE_ROWS`` rows (order it best first; the
        html, where given, shows what it shows) and link the file.
    csv_table: what that file holds (e.g. the table's numbers where ``table`` shows them as text);
        None where the report writes the file itself (``write_report_files``' tables).
    Each is shown in this order: text, html (or table), the link to the CSV, figures.
    """

    title: str
    text: str = ""
    html: str = ""
    figures: list[ReportFigure] = field(default_factory=list)
    table: pd.DataFrame | None = None
    csv: str = ""
    csv_table: pd.DataFrame | None = None

    @property
    def anchor(self) -> str:
        return re.sub(r"[^a-z0-9]+", "-", self.title.lower()).strip("-")

    @property
    def shown_table(self) -> pd.DataFrame | None:
        """The rows of ``table`` the pages show: every row, or with a ``csv`` file the first ``INLINE_ROWS``."""
        if self.table is None or not self.csv:
            return self.table
        return self.table.head(INLINE_ROWS)

    def csv_note(self, shown: int) -> str:
        """What precedes the link to the section's CSV file, where a page shows ``shown`` rows of the table."""
        rows = len(self.table)
        return f"The first {shown} of {rows} rows; full table: " if shown < rows else "Full table: "


@dataclass
class PatternView:
    """Every head's attention on one text, for the page. tokens: the n display labels;
    patterns: (layer, head, n, n) post-softmax attention."""

    title: str
    tokens: list[str]
    patterns: torch.Tensor


# ---------------------------------------------------------------------------------- data
def encode_patterns(patterns: torch.Tensor) -> str:
    """(layer, head, n, n) attention in [0, 1] -> base64 of the uint8-quantised lower triangles,
    head after head in (layer, head) order, each row q holding keys 0..q."""
    n = patterns.shape[-1]
    rows, keys = torch.tril_indices(n, n)
    flat = einops.rearrange(patterns.detach().float().cpu(), "l h q k -> (l h) q k")[:, rows, keys]
    quantised = (flat.clamp(0, 1) * 255).round().to(torch.uint8)
    return base64.b64encode(quantised.cpu().numpy().tobytes()).decode("ascii")


def decode_patterns(encoded: str, n_layers: int, n_heads: int, n: int) -> torch.Tensor:
    """The inverse of ``encode_patterns`` (to 1/255) -> (layer, head, n, n)."""
    flat = torch.frombuffer(bytearray(base64.b64decode(encoded)), dtype=torch.uint8).float() / 255
    patterns = torch.zeros(n_layers * n_heads, n, n)
    rows, keys = torch.tril_indices(n, n)
    patterns[:, rows, keys] = flat.reshape(n_layers * n_heads, -1)
    return patterns.reshape(n_layers, n_heads, n, n)


def display_tokens(str_tokens: Sequence[str]) -> list[str]:
    """Token strings as the page shows them (visible blanks, escaped control characters)."""
    return [token_label(t).replace("\\$", "$") for t in str_tokens]


def explorer_data(table: pd.DataFrame, measures: Sequence[str], bounded: Sequence[str],
                  views: Sequence[PatternView], start: tuple[int, int], colour: str) -> dict:
    """What the explorer script reads: the grid's values per measure ((layer, head) order; those
    in ``bounded`` on a 0..1 scale, the others centred on zero), each measure's 95% interval where the
    table has its ``interval_columns`` ([low, high] per head, shown beside the value), the heads' roles,
    the head shown first, the measure the grid is coloured by first, and the encoded views."""
    table = table.sort_values(["layer", "head"])
    n_layers, n_heads = int(table["layer"].max()) + 1, int(table["head"].max()) + 1

    def rounded(values) -> list:
        return [round(float(v), 4) if math.isfinite(v) else None for v in values]

    return {
        "n_layers": n_layers, "n_heads": n_heads, "measures": list(measures), "bounded": list(bounded),
        "grid": {m: rounded(table[m]) for m in measures},
        "intervals": {m: [list(pair) for pair in zip(*(rounded(table[c]) for c in interval_columns(m)))]
                      for m in measures if set(interval_columns(m)) <= set(table.columns)},
        "roles": list(table["role"]) if "role" in table else [""] * len(table),
        "start": [int(start[0]), int(start[1])], "colour": colour,
        "views": [{"title": v.title, "tokens": v.tokens, "patterns": encode_patterns(v.patterns)} for v in views],
    }


# ------------------------------------------------------------------------------ HTML bits
def explorer_html(data: dict, hint: str) -> str:
    """The layer x head grid (a button per head), a measure picker, and one pattern view per text."""
    head_cells = "".join(f"<th>{h}</th>" for h in range(data["n_heads"]))
    rows = "".join(
        f"<tr><th>L{layer}</th>" + "".join(
            f'<td><button type="button" data-layer="{layer}" data-head="{head}" aria-label="L{layer}H{head}">'
            f"</button></td>" for head in range(data["n_heads"])) + "</tr>"
        for layer in range(data["n_layers"]))
    options = "".join(f'<option value="{m}"{" selected" if m == data["colour"] else ""}>'
                      f'{html.escape(m.replace("_", " "))}</option>' for m in data["measures"])
    views = "".join(f'<div class="pattern-view"><h4>{html.escape(v["title"])}</h4><div id="view-{i}"></div></div>'
                    for i, v in enumerate(data["views"]))
    return f"""<div id="explorer">
<div id="head-grid-panel">
<label>colour by <select id="grid-measure">{options}</select></label>
<table id="head-grid"><thead><tr><th></th>{head_cells}</tr></thead><tbody>{rows}</tbody></table>
<p class="hint">{html.escape(hint)}</p>
</div>
<div id="pattern-panel">
<h3 id="pattern-title"></h3>
<div id="pattern-scores"></div>
<p class="hint">Heatmap: query (row) x key (column); hover a cell for its value. Token strip: hover a token
to shade every earlier token by the attention it pays it.</p>
<div class="pattern-views">{views}</div>
</div>
</div>
<script type="application/json" id="report-data">{json_for_script(data)}</script>"""


def head_table_html(table: pd.DataFrame, measures: Sequence[str], roles: Sequence[str], table_id: str,
                    extra: Sequence[str] = ("ablation_effect",)) -> str:
    """The per-head table: one column per measure showing ``score [ci_low, ci_high]`` (and the
    null band from ``{m}_null_low``/``{m}_null_high`` where the table has them), then the ``extra``
    columns (signed, 3 decimals, with their interval where the table has its ``interval_columns``);
    sortable, with a filter on the ``role`` column (';'-joined values among ``roles``); clicking a
    row shows that head."""
    options = "".join(f'<option value="{html.escape(r)}">{html.escape(r)}</option>' for r in roles)
    extra = [c for c in extra if c in table.columns]
    header = "".join(f"<th>{html.escape(c.replace('_', ' '))}</th>" for c in ["layer", "head", "role", *measures, *extra])
    body = []
    for _, row in table.iterrows():
        layer, head, role = int(row["layer"]), int(row["head"]), str(row.get("role", ""))
        partial = str(row.get("partial_role", "") or "")
        shown = html.escape(role) + (f' <span class="hint">partial: {html.escape(partial)}</span>' if partial else "")
        cells = [f"<td>{layer}</td>", f"<td>{head}</td>", f'<td class="text">{shown}</td>']
        cells += [_score_cell(row, m) for m in measures]
        cells += [_effect_cell(row, c) for c in extra]
        body.append(f'<tr data-head-name="L{layer}H{head}" data-layer="{layer}" data-head="{head}" '
                    f'data-roles="{html.escape(role)}">{"".join(cells)}</tr>')
    return (f'<div class="filter"><label>role <select data-filter-table="{table_id}"><option value="">all heads'
            f"</option>{options}</select></label> <span class=\"hint\">click a column to sort, a row to see the "
            f'head</span></div>\n<div class="table-wrap"><table class="sortable" id="{table_id}"><thead><tr>{header}'
            f"</tr></thead><tbody>{''.join(body)}</tbody></table></div>")


def _score_cell(row: pd.Series, measure: str) -> str:
    text = f"{row[measure]:.3f}"
    if f"{measure}_ci_low" in row:
        text += f' <span class="interval">[{row[f"{measure}_ci_low"]:.2f}, {row[f"{measure}_ci_high"]:.2f}]</span>'
    if f"{measure}_null_low" in row:
        text += (f'<span class="null" title="null band">null [{row[f"{measure}_null_low"]:.2f}, '
                 f'{row[f"{measure}_null_high"]:.2f}]</span>')
    return f'<td data-sort="{row[measure]:.6f}">{text}</td>'


def interval_columns(column: str) -> tuple[str, str]:
    """The names of a column's 95% interval bounds: ``{m}_ci_low, {m}_ci_high`` for a measure ``m``, and
    for an effect ``{kind}_effect`` those of its kind (``ablation_effect``: ``ablation_ci_low``, ...)."""
    stem = column.removesuffix("_effect")
    return f"{stem}_ci_low", f"{stem}_ci_high"


def _effect_cell(row: pd.Series, column: str) -> str:
    low, high = interval_columns(column)
    text = f"{row[column]:+.3f}"
    if low in row and high in row:
        text = effect_text(row[column], row[low], row[high]).replace(" ", ' <span class="interval">', 1) + "</span>"
    return f'<td data-sort="{row[column]:.6f}">{text}</td>'


def plain_table_html(table: pd.DataFrame) -> str:
    """Any frame as a sortable table (numbers as ``cell_text`` writes them)."""
    header = "".join(f"<th>{html.escape(str(c))}</th>" for c in table.columns)
    rows = "".join("<tr>" + "".join(_plain_cell(column, v) for column, v in zip(table.columns, row)) + "</tr>"
                   for row in table.itertuples(index=False))
    return f'<div class="table-wrap"><table class="sortable"><thead><tr>{header}</tr></thead><tbody>{rows}</tbody></table></div>'


def _plain_cell(column, value) -> str:
    if isinstance(value, float):
        return f'<td data-sort="{value:.6f}">{cell_text(column, value)}</td>'
    return f'<td class="text">{html.escape(str(value))}</td>' if isinstance(value, str) else f"<td>{value}</td>"


def cell_text(column, value) -> str:
    """A table cell as the pages write it: a float to 3 decimals, but a count (a column ``n_*``, such
    as ``n_prompts``, made float by a missing value beside it) as a whole number, and a missing value
    (NaN: not measured there) blank rather than "nan"."""
    if not isinstance(value, float):
        return str(value)
    if math.isnan(value):
        return ""
    return f"{value:.0f}" if str(column).startswith("n_") and value.is_integer() else f"{value:.3f}"


def markdown_html(text: str) -> str:
    """The Markdown subset sections use -> HTML: paragraphs, '- ' lists, **bold**, `code`."""
    blocks = []
    for block in re.split(r"\n\s*\n", text.strip()):
        lines = block.splitlines()
        if all(line.startswith("- ") for line in lines):
            blocks.append("<ul>" + "".join(f"<li>{_inline(line[2:])}</li>" for line in lines) + "</ul>")
        elif block.strip():
            blocks.append(f"<p>{_inline(' '.join(lines))}</p>")
    return "\n".join(blocks)


def _inline(text: str) -> str:
    text = html.escape(text, quote=False)
    text = re.sub(r"\*\*(.+?)\*\*", r"<strong>\1</strong>", text)
    return re.sub(r"`(.+?)`", r"<code>\1</code>", text)


def figure_html(figure: ReportFigure) -> str:
    data = base64.b64encode(figure.png).decode("ascii")
    caption = html.escape(figure.caption)
    return f'<figure><img alt="{caption}" src="data:image/png;base64,{data}"><figcaption>{caption}</figcaption></figure>'


def section_html(section: Section) -> str:
    parts = [f'<section id="{section.anchor}">', f"<h2>{html.escape(section.title)}</h2>", markdown_html(section.text)]
    if section.html:
        parts.append(section.html)
    elif section.table is not None:
        parts.append(plain_table_html(section.shown_table))
    if section.csv:
        shown = len(section.table) if section.html else len(section.shown_table)
        parts.append(f'<p class="hint">{html.escape(section.csv_note(shown))}<a href="{html.escape(section.csv)}">'
                     f"{html.escape(section.csv)}</a></p>")
    parts += [figure_html(f) for f in section.figures]
    return "\n".join(parts + ["</section>"])


def _asset(name: str) -> str:
    return (ASSETS / name).read_text(encoding="utf-8")


def circuitsvis_bundle() -> str:
    """CircuitsVis's browser bundle (defines the global ``CircuitsVis``), safe to inline: without
    its source-map comment (a developer tool would fetch the map) and without any '</script>'."""
    import circuitsvis

    bundle = (Path(circuitsvis.__file__).parent / "dist" / "cdn" / "iife.js").read_text(encoding="utf-8")
    bundle = re.sub(r"//# sourceMappingURL=\S*\s*$", "", bundle)
    return bundle.replace("</script>", "<\\/script>")


# what JSON inside a <script> element must not hold literally: '<' (a '</script' ends the element,
# a '<!--' followed by '<script' makes the parser run past its real end), '>' and '&' (for any HTML
# reader); json.dumps already writes U+2028 and U+2029 (line ends to JavaScript) as \u escapes
_SCRIPT_ESCAPES = str.maketrans({"<": "\\u003c", ">": "\\u003e", "&": "\\u0026"})


def json_for_script(data: dict) -> str:
    """``data`` as JSON to embed in a ``<script type="application/json">`` element: only ASCII, and
    no '<', '>' or '&' (written as JSON's \\u escapes, which ``JSON.parse`` reads back), so no text
    in it (a token, a text line) can end the element early or open an HTML comment in it."""
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=True).translate(_SCRIPT_ESCAPES)


def render_page(title: str, subtitle: str, sections: Sequence[Section]) -> str:
    """The whole self-contained page: header (the subtitle where not ""), a link per section, the
    sections, the inlined style, CircuitsVis bundle and our script."""
    nav = " ".join(f'<a href="#{s.anchor}">{html.escape(s.title)}</a>' for s in sections)
    body = "\n".join(section_html(s) for s in sections)
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; img-src data:; style-src 'unsafe-inline'; script-src 'unsafe-inline' 'unsafe-eval'; font-src data:">
<title>{html.escape(title)}</title>
<style>
{_asset("report.css")}</style>
</head>
<body>
<h1>{html.escape(title)}</h1>
{f'<p class="meta">{_inline(subtitle)}</p>' if subtitle else ""}
<nav>{nav}</nav>
{body}
<script>
{circuitsvis_bundle()}
</script>
<script>
{_asset("report.js")}</script>
</body>
</html>
"""


def render_markdown(title: str, subtitle: str, sections: Sequence[Section]) -> str:
    """report.md: the same sections but those of page-only HTML, figures linked as figures/{name}.png,
    tables in Markdown (the first ``INLINE_ROWS`` rows and a link where the section has a CSV file);
    the subtitle under the title where not ""."""
    lines = [f"# {title}", "", *([subtitle, ""] if subtitle else [])]
    for section in sections:
        if not (section.text or section.table is not None or section.figures):
            continue  # an interactive view of index.html alone
        lines += [f"## {section.title}", ""]
        if section.text:
            lines += [section.text.strip(), ""]
        if section.table is not None:
            lines += [*markdown_table(section.shown_table), ""]
        if section.csv:
            lines += [f"{section.csv_note(len(section.shown_table))}[{section.csv}]({section.csv})", ""]
        lines += [line for f in section.figures for line in (f"![{f.caption}](figures/{f.name}.png)", "")]
    return "\n".join(lines)


def markdown_table(table: pd.DataFrame) -> list[str]:
    lines = ["| " + " | ".join(map(str, table.columns)) + " |", "|" + "---|" * len(table.columns)]
    for row in table.itertuples(index=False):
        lines.append("| " + " | ".join(cell_text(column, value) for column, value in zip(table.columns, row)) + " |")
    return lines


def is_probability_column(name) -> bool:
    """p- and q-value columns (``p``, ``q``, ``{role}_p``, ``{role}_q``): they can be far below 1e-6."""
    return str(name) in ("p", "q") or str(name).endswith(("_p", "_q"))


def csv_text(frame: pd.DataFrame) -> str:
    """A report table as CSV: floats to 6 decimals (``FLOAT_FORMAT``), but p- and q-values to 6
    significant digits, so a p of 4e-31 is written 4e-31, not 0.000000."""
    probabilities = {column: frame[column].map(lambda value: "" if pd.isna(value) else f"{value:.6g}")
                     for column in frame.columns if is_probability_column(column) and frame[column].dtype.kind == "f"}
    return frame.assign(**probabilities).to_csv(index=False, float_format=FLOAT_FORMAT, lineterminator="\n")


def write_report_files(out: str | Path, title: str, subtitle: str, sections: Sequence[Section], meta: dict,
                       tables: dict[str, pd.DataFrame]) -> Path:
    """A report directory: figures/*.png, each of ``tables`` as CSV (name -> frame) and each section's
    ``csv_table`` as its ``csv`` file, report.md, index.html and meta.json, each file written atomically."""
    out = Path(out)
    (out / "figures").mkdir(parents=True, exist_ok=True)
    for figure in (f for section in sections for f in section.figures):
        write_atomic(out / "figures" / f"{figure.name}.png", figure.png)
    sections_tables = {s.csv: s.csv_table for s in sections if s.csv and s.csv_table is not None}
    for name, frame in (sections_tables | tables).items():
        write_atomic(out / name, csv_text(frame))
    write_atomic(out / "report.md", render_markdown(title, subtitle, sections))
    write_atomic(out / "index.html", render_page(title, subtitle, sections))
    write_meta(out, meta)
    return out
