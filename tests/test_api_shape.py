"""One API shape: a head written three ways is the same head everywhere, the plotting helpers draw
with their defaults, and the snippets' helpers are where the other entry points are."""

import pytest
from matplotlib.figure import Figure

import analyses
from analyses import (ablate_heads, ablation_figure, ablation_sweep, as_head, as_heads, control_effects,
                      corrupt_first_copy, head_label, loss_metric, patch_heads, patching_figure, patching_frame, probes_for)
from interp import UserError, load_model


@pytest.fixture(scope="module")
def toy():
    return load_model("toy")


def test_a_head_is_the_same_head_written_three_ways():
    assert as_head((1, 4)) == as_head("L1H4") == as_head("1.4") == as_head(" l1h4 ") == (1, 4)
    assert as_heads("L1H4,1.10") == as_heads([(1, 4), "1.10"]) == [(1, 4), (1, 10)]
    assert head_label("1.10") == "L1H10"
    for bad in (1.4, "1:4", (1, 2, 3), (1.0, 4)):
        with pytest.raises(UserError, match=r"is not a head; write a head as \(1, 4\), 'L1H4' or '1.4'$"):
            as_head(bad)


def test_the_library_and_the_command_line_take_every_form(toy, tmp_path, capsys):
    probes = probes_for(toy, 4, seq_len=24)
    values = {ablate_heads(toy, probes, heads) for heads in ([(1, 0), (1, 3)], ["L1H0", "1.3"], "L1H0,1.3")}
    assert len(values) == 1
    sweep = ablation_sweep(toy, probes, [["L1H0"], [(1, 0)]])
    assert sweep["metric"].iloc[0] == sweep["metric"].iloc[1]
    tested = control_effects(toy, probes.tokens, ["L1H0"], n_draws=2).effect
    assert tested == pytest.approx(control_effects(toy, probes.tokens, [(1, 0)], n_draws=2).effect)
    from analyses.cli import main
    assert main(["ablate", "--heads", "L1H0,1.3", "--prompts", "4", "--out", str(tmp_path / "a"), "--quiet"]) == 0


def test_the_entry_points_that_take_a_head_as_two_numbers_are_the_ones_the_docs_name():
    """Where an entry point takes ``layer`` and ``head`` apart instead of one head in any form, the
    package's docstring and the API page name it as the exception, so "wherever one is taken" stays true."""
    import inspect
    from pathlib import Path

    apart = set()
    for name in dir(analyses):
        entry = getattr(analyses, name)
        if inspect.isfunction(entry) and {"layer", "head"} <= set(inspect.signature(entry).parameters):
            apart.add(name)
    assert apart == {"qk_attribution", "qk_intervention_check"}
    page = (Path(__file__).resolve().parents[1] / "docs" / "reference" / "analyses.md").read_text(encoding="utf-8")
    for text, quoted in ((" ".join(analyses.__doc__.split()), "``{}``"), (" ".join(page.split()), "`{}`")):
        exception = text.split("wherever one is taken", 1)[1].split(";", 1)[0]
        assert all(quoted.format(name) in exception for name in apart), exception


def test_the_plotting_helpers_draw_with_their_defaults(toy):
    probes = probes_for(toy, 4, seq_len=24)
    assert isinstance(ablation_figure(ablation_sweep(toy, probes)), Figure)
    metric = loss_metric(probes.tokens, probes.predictable)
    found = patch_heads(toy, probes.tokens, corrupt_first_copy(probes), metric, progress=False)
    assert isinstance(patching_figure(patching_frame(found, ("layer", "head"))), Figure)
    assert ablation_figure(ablation_sweep(toy, probes)).axes[0].get_title() == "ablation effect (metric - unablated)"


def test_the_package_lists_its_entry_points_by_job_and_exports_the_snippets_helpers():
    assert analyses.probes_for is probes_for and analyses.corrupt_first_copy is corrupt_first_copy
    doc = analyses.__doc__
    for name in ("report_roles", "classify_heads", "ablation_sweep", "patch_heads", "make_task", "causal_trace",
                 "probes_for", "corrupt_first_copy", "as_head"):
        assert f"``{name}``" in doc, name
        assert hasattr(analyses, name), name


def test_the_docs_home_links_every_guide():
    from pathlib import Path

    docs = Path(__file__).resolve().parents[1] / "docs"
    index = (docs / "index.md").read_text(encoding="utf-8")
    missing = [path.name for path in sorted((docs / "guides").glob("*.md")) if f"(guides/{path.name})" not in index]
    assert missing == []


def test_the_api_page_says_what_every_listed_entry_point_returns():
    """Every entry point ``help(analyses)`` lists by job is in the API page's table of return types."""
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "reference" / "analyses.md").read_text(encoding="utf-8")
    table = page.split("## What each entry point returns", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"``(\w+)``", analyses.__doc__.split("- Prompts:", 1)[1]))
    missing = sorted(name for name in listed if f"`{name}`" not in table)
    assert missing == []


def returned_name(function) -> str:
    """The name of what ``function``'s annotation says it returns ("RepeatedProbes", "Figure")."""
    import typing

    annotation = typing.get_type_hints(function).get("return", object)
    return getattr(annotation, "__name__", str(annotation))


def test_each_entry_point_says_in_its_docstring_what_the_api_page_says_it_returns():
    """The API page's table puts each entry point in a column (tidy frame, tensor, value or object);
    its docstring says the same: "frame", "tensor", or the name of what it returns (or "value")."""
    import inspect
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "reference" / "analyses.md").read_text(encoding="utf-8")
    table = page.split("## What each entry point returns", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[2:5] for line in table.splitlines() if line.startswith("| ") and "---" not in line][1:]
    silent = []
    for frames, tensors, values in rows:
        for cell, kind in ((frames, "frame"), (tensors, "tensor"), (values, "value")):
            for name in re.findall(r"`(\w+)`", cell):
                function = getattr(analyses, name, None)
                if not inspect.isfunction(function):
                    continue  # a class the cell names as what is returned
                doc = inspect.getdoc(function)
                if kind not in doc.lower() and (kind != "value" or returned_name(function) not in doc):
                    silent.append(name)

    assert silent == []


def test_the_examples_import_the_entry_points_from_analyses():
    """README.md's and the guides' examples take what ``analyses`` exports from ``analyses`` itself
    (``from analyses import probes_for``), not from the module that defines it, so a reader meets
    one place to import from."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    deep = []
    for page in [root / "README.md", *sorted((root / "docs" / "guides").glob("*.md"))]:
        for line in page.read_text(encoding="utf-8").splitlines():
            found = re.fullmatch(r"\s*from (analyses\.[\w.]+) import ([\w, ]+)", line)
            if found and all(hasattr(analyses, name.strip()) for name in found[2].split(",")):
                deep.append(f"{page.name}: {line.strip()}")
    assert deep == []
