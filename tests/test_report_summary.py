"""``interp report`` opens on its findings: report.md and index.html start with a summary made from
the results (each role's strongest heads with their effects and intervals, the circuit in one line,
what did not form or run), then the method; a long table is in its CSV file beside the page with every
row, the page showing its first rows and the link; head_roles.csv starts with each head's identity and
verdict; the command ends by printing the summary and where the page is."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pandas as pd
import pytest


ATTENTION_ROLES = ["previous_token", "duplicate_token", "induction", "self", "bos"]
MEANING_ROLES = ["copying", "copy_suppression"]


@pytest.fixture(scope="module")
def toy(toy_report) -> tuple[Path, str]:
    """The toy's report directory and what ``interp report`` printed on stdout (the run's shared
    report, tests/shared_reports.py)."""
    return toy_report


def markdown_sections(markdown: str) -> dict[str, list[str]]:
    """report.md's sections: title -> its lines (without the heading)."""
    found, title = {}, None
    for line in markdown.splitlines():
        if line.startswith("## "):
            title = line[3:]
            found[title] = []
        elif title is not None:
            found[title].append(line)
    return found


def test_report_md_opens_on_the_summary_naming_each_roles_strongest_heads_with_their_intervals(toy):
    out, _ = toy
    markdown = (out / "report.md").read_text()
    lines = markdown.splitlines()
    assert lines[:3] == ["# Head roles: toy", "", "## Summary"]  # no provenance line, no hint about a grid
    titles = [line[3:] for line in lines if line.startswith("## ")]
    assert titles[:3] == ["Summary", "Method", "Roles"]
    assert "sha256:" in "\n".join(markdown_sections(markdown)["Method"])  # the weights' hash is in the method
    assert "click a head" not in markdown.lower() and "grid" not in markdown.lower()
    summary = markdown_sections(markdown)["Summary"]
    table = pd.read_csv(out / "head_roles.csv", keep_default_na=False)
    named = 0
    for role in ATTENTION_ROLES + MEANING_ROLES:
        heads = table[table["role"].str.split(";").apply(lambda roles: role in roles)]
        heads = heads.sort_values(role, ascending=False)
        if heads.empty:
            assert f"- **{role}**: no head" in "\n".join(summary), role
            continue
        [line] = [line for line in summary if line.startswith(f"- **{role}** (")]
        assert line.startswith(f"- **{role}** ({len(heads)} head{'s' if len(heads) > 1 else ''}): ")
        shown = re.findall(r"(L\d+H\d+) \(score ([\d.]+), (ablation|direct) ([+-][\d.]+) \[([+-][\d.]+), "
                           r"([+-][\d.]+)\] nats", line)
        assert [name for name, *_ in shown] == [f"L{r.layer}H{r.head}" for r in heads.head(3).itertuples()]
        for (_, score, kind, *effect), row in zip(shown, heads.head(3).itertuples()):
            # the three of highest score, each with its effect and interval (the CSV's, to the printed digits)
            stem = "direct" if role in MEANING_ROLES else "ablation"
            assert kind == stem and float(score) == pytest.approx(getattr(row, role), abs=0.0051)
            expected = [getattr(row, f"{stem}_effect"), getattr(row, f"{stem}_ci_low"), getattr(row, f"{stem}_ci_high")]
            assert list(map(float, effect)) == pytest.approx(expected, abs=0.00051), (role, line)
            named += 1
        assert (f"and {len(heads) - 3} more" in line) == (len(heads) > 3)
    assert named >= 2  # the toy's previous-token and induction heads at least
    assert any(line.startswith("- **circuit** (") and " -> " in line for line in summary)
    # every induction head sits in layer 1, whose every head has the role: the control cannot run
    assert "- **control**: no matched control is possible in layer 1" in "\n".join(summary)
    page = (out / "index.html").read_text()
    assert re.findall(r"<h2>(.*?)</h2>", page)[:3] == ["Summary", "Method", "Roles"]
    assert page.index("<h2>Summary</h2>") < page.index("sha256:")


def test_a_long_table_is_in_its_csv_with_every_row_and_the_page_shows_its_first_rows_and_the_link(toy):
    from analyses.report.page import INLINE_ROWS  # the rows the pages show of a table with a CSV file

    out, _ = toy
    pairs = pd.read_csv(out / "backup_pairs.csv", keep_default_na=False)
    heads = sorted(set(pairs["a"]) | set(pairs["b"]))
    assert len(pairs) > INLINE_ROWS  # a long table, or the test shows nothing
    # every pair of the heads ablated in pairs, each once
    assert sorted(tuple(sorted(pair)) for pair in zip(pairs["a"], pairs["b"])) == sorted(itertools.combinations(heads, 2))
    backs = pairs["backs"].astype(str) == "True"
    assert list(backs) == sorted(backs, reverse=True)  # the pairs that back up first, each group by its excess
    for group in (pairs[backs], pairs[~backs]):
        assert list(group["excess"]) == sorted(group["excess"], reverse=True)
    markdown = (out / "report.md").read_text()
    calibration = markdown_sections(markdown)["Calibration"]
    rows = [line for line in calibration if re.match(r"\| L\d+H\d+ \| L\d+H\d+ \|", line)]
    assert [tuple(row.split(" | ")[:2]) for row in rows] == [(f"| {a}", b) for a, b in
                                                             zip(pairs["a"][:INLINE_ROWS], pairs["b"][:INLINE_ROWS])]
    link = f"The first {INLINE_ROWS} of {len(pairs)} rows; full table: [backup_pairs.csv](backup_pairs.csv)"
    assert link in calibration
    page = (out / "index.html").read_text()
    assert (f'The first {INLINE_ROWS} of {len(pairs)} rows; full table: <a href="backup_pairs.csv">backup_pairs.csv</a>'
            in page)
    calibration_html = page[page.index('<section id="calibration">'):]
    calibration_html = calibration_html[:calibration_html.index("</section>")]
    assert calibration_html.count("<tr>") == INLINE_ROWS + 1  # the header and the first rows
    head_table = markdown_sections(markdown)["All heads"]
    assert "Full table: [head_roles.csv](head_roles.csv)" in head_table


def test_head_roles_csv_starts_with_each_heads_identity_and_verdict(toy):
    out, _ = toy
    table = pd.read_csv(out / "head_roles.csv", keep_default_na=False)
    assert list(table.columns[:5]) == ["layer", "head", "head_name", "role", "partial_role"]
    assert list(table["head_name"]) == [f"L{layer}H{head}" for layer, head in zip(table["layer"], table["head"])]
    assert list(table.columns[5:8]) == ["previous_token", "previous_token_ci_low", "previous_token_ci_high"]


def test_interp_report_ends_by_printing_the_summary_and_where_the_page_is(toy):
    out, printed = toy
    summary = markdown_sections((out / "report.md").read_text())["Summary"]
    lines = printed.splitlines()
    assert lines[-1] == f"The report: {out / 'index.html'} (and report.md, head_roles.csv beside it)"
    assert "\n".join(lines[:-1]).strip() == "\n".join(summary).replace("**", "").strip()
    assert any(line.startswith("- induction (") for line in lines)


def test_the_summary_says_what_did_not_form_and_what_did_not_run():
    """A head table without effects yet (the ablation pending), a circuit without an edge, a control that
    could not run and the parts without a result: each in the summary's second list."""
    from analyses.report.build import report_summary

    table = pd.DataFrame({"layer": [0, 1], "head": [0, 1], "role": ["previous_token", ""], "partial_role": ["", "self"],
                          "previous_token": [0.9, 0.1], "self": [0.0, 0.3]})
    lines = report_summary(table, edges=pd.DataFrame(columns=["effect"]),
                           control={"tested": False, "text": "no head has the role induction, so there is no set to test"},
                           missing=["- **pending**: ablation (the page is rewritten as each lands)"])
    assert lines == ["**Found**", "", "- **previous_token** (1 head): L0H0 (score 0.90, ablation pending)", "",
                     "**Not found, or not run**", "",
                     "- **self**: no head; partial heads (beat their nulls, below the threshold): L1H1",
                     "- **circuit**: no edge (no head has a role the circuit covers)",
                     "- **control**: no head has the role induction, so there is no set to test",
                     "- **pending**: ablation (the page is rewritten as each lands)"]
