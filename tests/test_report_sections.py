"""``interp report`` as sections: the page written once the roles land and rewritten as each section
does, ``--resume`` reusing the finished sections (stopped anywhere, the files equal an uninterrupted
run's), a resume under another option refused in one line, ``--sections`` and ``--plan``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest

import analyses.report.build as build
import analyses.roles.calibration as calibration
from analyses.cli import main
from interp.model import GPTModel
from shared_reports import TOY_REPORT_ARGS

ARGS = TOY_REPORT_ARGS  # the uninterrupted run is the run's shared toy report (tests/shared_reports.py)
LATER = ["ablation", "calibration", "control", "circuit", "qk", "components"]


class Stopped(Exception):
    """A run stopped part-way (as by Ctrl-C or a killed job)."""


def report(out: Path, *extra: str) -> int:
    return main(["report", *ARGS, "--out", str(out), *extra])


@pytest.fixture(scope="module")
def uninterrupted(toy_report) -> Path:
    """``report(out)`` run to the end: the shared toy report (read-only; the tests resume in copies)."""
    return toy_report[0]


def files(directory: Path) -> dict[str, bytes]:
    """Every file of a report directory by its relative path, meta.json without its ``cost`` (this
    run's record of seconds and of the sections it reused) and without the store's lock."""
    found = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file() and p.name != ".lock"):
        data = path.read_bytes()
        if path.name == "meta.json":
            data = json.dumps(json.loads(data) | {"cost": None}, sort_keys=True).encode()
        found[path.relative_to(directory).as_posix()] = data
    return found


def assert_same_files(ours: Path, theirs: Path) -> None:
    mine, other = files(ours), files(theirs)
    assert sorted(mine) == sorted(other)
    for name in mine:
        assert mine[name] == other[name], name


def reused(out: Path) -> dict[str, bool]:
    return {name: step["reused"] for name, step in json.loads((out / "meta.json").read_text())["cost"]["steps"].items()}


def stopped(out: Path, monkeypatch, landed: int, *extra: str) -> None:
    """``interp report`` into ``out`` stopped right after its ``landed``-th whole page write (one a
    section, a reused section included; not counting a write whose figures are still being drawn)."""
    writes = []
    write = build.write_report

    def stop_after(report_, directory):
        written = write(report_, directory)
        if all(build.FIGURES_PENDING not in section.text for section in report_.sections):
            writes.append(directory)
        if len(writes) == landed:
            raise Stopped
        return written

    with monkeypatch.context() as patch:
        patch.setattr(build, "write_report", stop_after)
        with pytest.raises(Stopped):
            report(out, *extra)


def copy_of(report_dir: Path, where: Path) -> Path:
    """A copy of a finished report directory (its pages and its step store) to resume in."""
    return Path(shutil.copytree(report_dir, where))


def test_the_page_holds_the_roles_and_the_pending_sections_before_the_ablation_ends(uninterrupted, tmp_path,
                                                                                     monkeypatch, capsys):
    """Stopped inside the ablation (the longest section), the directory already holds a whole page:
    the head table with its final roles and no effect yet, every later section pending with its
    estimate; the terminal said where the page is. Then resumed and stopped again right after the
    third and the fifth section's page (a resume stopped anywhere, resumed in turn) and resumed to
    the end: each resume reused exactly the sections that had landed, and the files equal an
    uninterrupted run's. (One chain of runs, so the sections are computed once, not once a stop.)"""
    out = tmp_path / "stopped"

    def stop(*args, **kwargs):
        raise Stopped

    with monkeypatch.context() as patch:
        patch.setattr(calibration, "direct_and_total_effects", stop)
        with pytest.raises(Stopped):
            report(out)
    assert f"report: the page is at {out / 'index.html'}" in capsys.readouterr().err
    table = pd.read_csv(out / "head_roles.csv", keep_default_na=False)
    final = pd.read_csv(uninterrupted / "head_roles.csv", keep_default_na=False)
    assert "ablation_effect" not in table.columns and "ablation_effect" in final.columns
    assert list(table["role"]) == list(final["role"]) and any(table["role"])  # the roles are final already
    assert table.columns.isin(final.columns).all()
    meta = json.loads((out / "meta.json").read_text())
    assert meta["sections"] == {"chosen": ["roles", *LATER], "pending": LATER}
    page, markdown = (out / "index.html").read_text(), (out / "report.md").read_text()
    assert page.rstrip().endswith("</html>")
    for title in ("Ablation effects", "Calibration", "Role heads vs layer-matched random heads", "Circuit", "Components"):
        assert f"## {title} (pending)" in markdown and f"<h2>{title} (pending)</h2>" in page
    assert "ablation pending" in markdown and "estimated ~" in markdown
    summary = markdown[markdown.index("## Summary"):markdown.index("## Method")]  # the page opens on it
    assert f"- **pending**: {', '.join(LATER)} (the page is rewritten as each lands)" in summary
    for figure in (out / "figures").iterdir():  # every figure the page names, and no other
        assert f"figures/{figure.name}" in markdown
    sections, landed = ["roles", *LATER], 1
    for stop_at in (3, 5):
        stopped(out, monkeypatch, stop_at, "--resume")
        assert reused(out) == {"probe run": False} | {name: i < landed for i, name in enumerate(sections)}
        assert json.loads((out / "meta.json").read_text())["sections"]["pending"] == sections[stop_at:]
        landed = stop_at
    assert report(out, "--resume") == 0
    assert_same_files(out, uninterrupted)
    assert reused(out) == {"probe run": False} | {name: i < landed for i, name in enumerate(sections)}


def test_the_page_goes_out_with_the_head_table_before_its_figures_are_drawn(tmp_path, monkeypatch, capsys):
    """``--sections roles``: the first page write holds the head table (head_roles.csv, the roles) and
    says its figures are being drawn, with none drawn yet; the terminal names the page right then;
    the next write adds the figures (role heatmaps, top heads, layer map, rollout) and is the last."""
    out, writes = tmp_path / "roles", []
    write = build.write_report

    def recorded(report_, directory):
        figures = [f.name for section in report_.sections for f in section.figures]
        markdown = "\n".join(section.text for section in report_.sections)
        csvs = [section.csv for section in report_.sections]
        writes.append((figures, build.FIGURES_PENDING in markdown, "head_roles.csv" in csvs,
                       "report: the page is at" in capsys.readouterr().err))
        return write(report_, directory)

    monkeypatch.setattr(build, "write_report", recorded)
    assert report(out, "--sections", "roles") == 0
    assert writes[0] == ([], True, True, False)
    assert writes[1] == (["role_scores", "top_heads", "layer_map", "rollout"], False, True, True)
    assert len(writes) == 2 and "report: the page is at" not in capsys.readouterr().err
    assert sorted(path.name for path in (out / "figures").iterdir()) == sorted(f"{name}.png" for name in writes[1][0])


def test_sections_choose_a_subset_and_a_resume_adds_the_rest(uninterrupted, tmp_path):
    """``--sections control`` runs the roles and the control only, and the page names the others;
    a resume with every section reuses those two and ends equal to an uninterrupted run."""
    out = tmp_path / "subset"
    assert report(out, "--sections", "control") == 0
    meta = json.loads((out / "meta.json").read_text())
    assert meta["sections"] == {"chosen": ["roles", "control"], "pending": []}
    assert sorted(meta["cost"]["steps"]) == ["control", "probe run", "roles"]
    markdown = (out / "report.md").read_text()
    assert "Not chosen by `--sections`: ablation, calibration, circuit, qk, components." in markdown
    assert "- **not run**: ablation, calibration, circuit, qk, components (not chosen by `--sections`)" in markdown
    assert "## Role heads vs layer-matched random heads" not in markdown  # the control's title names the role
    assert "## Induction heads vs layer-matched random heads" in markdown and "## Calibration" not in markdown
    assert "ablation_effect" not in pd.read_csv(out / "head_roles.csv").columns
    assert report(out, "--resume") == 0
    assert_same_files(out, uninterrupted)
    assert reused(out) == {"probe run": False, "roles": True, "ablation": False, "calibration": False,
                           "control": True, "circuit": False, "qk": False, "components": False}


def test_a_section_needs_what_it_reads(uninterrupted, tmp_path):
    """``--sections components`` chooses the ablation it reads too, and computes from those two alone:
    resumed in a copy of an uninterrupted run whose components step is removed, it reuses the roles
    and the ablation, computes the components and stores what the uninterrupted run stored."""
    out = copy_of(uninterrupted, tmp_path / "components")
    (out / build.STORE / "steps" / "components.json").unlink()
    assert report(out, "--sections", "components", "--resume", "--quiet") == 0
    assert json.loads((out / "meta.json").read_text())["sections"]["chosen"] == ["roles", "ablation", "components"]
    assert reused(out) == {"probe run": False, "roles": True, "ablation": True, "components": False}
    stored = Path(build.STORE, "steps", "components.json")
    assert (out / stored).read_bytes() == (uninterrupted / stored).read_bytes()


@pytest.mark.parametrize("change, named", [(["--fdr", "0.1"], "options.fdr was 0.05, now 0.1"),
                                           (["--seed", "1"], "options.seed was 0, now 1")])
def test_a_resume_under_another_option_is_refused_in_one_line(change, named, uninterrupted, tmp_path, capsys):
    out = copy_of(uninterrupted, tmp_path / "changed")
    before = files(out)
    capsys.readouterr()
    assert report(out, "--resume", *change) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("interp report: error: --resume: ") and named in errors[0]
    assert files(out) == before  # nothing rewritten, the store included


def test_plan_prints_each_section_with_its_cost_and_runs_no_forward(tmp_path, monkeypatch, capsys):
    forwards = []
    monkeypatch.setattr(GPTModel, "forward", lambda self, *a, **k: forwards.append(a))
    out = tmp_path / "plan"
    assert report(out, "--plan", "--sections", "calibration") == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("interp report plan: 3 of 7 sections")
    assert [line.split(":")[0].strip() for line in lines[1:5]] == ["probe run", "roles", "ablation", "calibration"]
    assert all(" FE" in line for line in lines[1:5]) and "<= " in lines[4] and "needs ablation" in lines[4]
    assert lines[5] == "  not chosen: control, circuit, qk, components"
    assert forwards == [] and not out.exists()


def test_an_unknown_section_is_refused_in_one_line(capsys):
    assert main(["report", *ARGS, "--sections", "roles,ablations"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line.lower()]
    assert errors == ["interp report: error: --sections: no section 'ablations'; the sections are roles, ablation, "
                      "calibration, control, circuit, qk, components"]
