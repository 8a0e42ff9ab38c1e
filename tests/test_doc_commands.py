"""Every unmarked ``interp`` command of README.md and docs/guides/*.md runs as written, page by page
(the pages' conventions and the runner: tests/test_doc_examples.py). The report guide's commands, a
whole toy report, are tests/test_doc_commands_report.py's, a module of their own so that
pytest-xdist (``--dist loadscope``: each module on one worker) runs them beside these."""

from __future__ import annotations

import pytest

from test_doc_examples import COMMAND_PAGES, placeholder_models, run_page_commands, workdir  # noqa: F401 (fixtures)

REPORT_GUIDE = "docs/guides/report.md"


def test_the_report_guide_has_commands_to_run():
    """The report guide's commands run in tests/test_doc_commands_report.py; were it renamed, or its
    commands all marked, nothing would run them."""
    assert REPORT_GUIDE in COMMAND_PAGES


@pytest.mark.parametrize("page", [page for page in COMMAND_PAGES if page != REPORT_GUIDE])
def test_commands_run(page, workdir):
    run_page_commands(page, workdir)
