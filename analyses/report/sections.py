"""A report as an ordered list of sections, each a step (architecture: "The path of one interp report").

A ``ReportSection`` names a step of a report: the word ``--sections`` chooses it by, the title its
page slot shows while it is pending, the sections whose results it reads (``needs``), the code's
version of its numbers (a resume's fingerprint holds it) and the function that computes its result
from the run's context and the results before it. A result is JSON data, DataFrames and rendered
page sections (``section_data``), so the step store (``analyses.core.steps.Steps``) keeps it exactly
and a resumed run reads back what an uninterrupted one computed.

``run_sections`` runs (or reads back) the chosen sections in order and hands the results so far to
the page writer after each, so the page is written as soon as the first section lands and rewritten
as each later one does; ``chosen_sections`` resolves ``--sections``.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Callable, Sequence

from analyses.report.page import ReportFigure, Section
from interp.errors import UserError


@dataclass(frozen=True)
class ReportSection:
    """One step of a report.

    name: the word ``--sections`` chooses it by (and its step's name in the cost estimate); title:
    its page slot's title while it is pending; needs: the sections whose results ``compute`` reads
    (chosen with it); version: the code's version of its numbers, raised when a change of the code
    changes them (a resume refuses a store of another version); compute: ``(context, results) ->
    result``, where results maps each finished section's name to its result."""

    name: str
    title: str
    needs: tuple[str, ...]
    version: int
    compute: Callable[[object, dict], object]


def chosen_sections(sections: Sequence[ReportSection], names: Sequence[str] | None,
                    always: str) -> list[ReportSection]:
    """The sections ``names`` chooses (None: every one), with ``always`` and every section a chosen
    one needs, in the report's order; an unknown name refused in one line naming the allowed ones."""
    known = {section.name: section for section in sections}
    if names is None:
        return list(sections)
    unknown = [name for name in names if name not in known]
    if unknown:
        raise UserError(f"--sections: no section {unknown[0]!r}; the sections are {', '.join(known)}")
    wanted, todo = set(), [always, *names]
    while todo:
        name = todo.pop()
        if name not in wanted:
            wanted.add(name)
            todo.extend(known[name].needs)
    return [section for section in sections if section.name in wanted]


def parse_sections(text: str) -> list[str]:
    """``--sections roles,ablation`` -> ["roles", "ablation"] (blanks ignored)."""
    return [name.strip() for name in text.split(",") if name.strip()]


def section_data(section: Section) -> dict:
    """A rendered page section as a step's result: its text, HTML, table (a DataFrame, or None),
    figures (name, caption, base64 PNG), CSV file's name and that file's table (or None)."""
    return {"title": section.title, "text": section.text, "html": section.html, "table": section.table,
            "figures": [[f.name, f.caption, base64.b64encode(f.png).decode("ascii")] for f in section.figures],
            "csv": section.csv, "csv_table": section.csv_table}


def section_of(data: dict) -> Section:
    """The inverse of ``section_data``."""
    figures = [ReportFigure(name, caption, base64.b64decode(png)) for name, caption, png in data["figures"]]
    return Section(data["title"], data["text"], data["html"], figures, data["table"], data["csv"], data["csv_table"])


def run_sections(sections: Sequence[ReportSection], context, store: Callable[[str, Callable[[], object]], object],
                 begin: Callable[[str], None], written: Callable[[dict], None]) -> dict:
    """Each of ``sections`` in order: ``begin(name)`` (the step's bar and clock), its result from
    ``store(name, compute)`` (the step store: read back where it is finished, else computed and
    kept), then ``written(results)`` with every result so far (the page's rewrite). -> the results."""
    results: dict = {}
    for section in sections:
        begin(section.name)
        results[section.name] = store(section.name, lambda section=section: section.compute(context, results))
        written(results)
    return results
