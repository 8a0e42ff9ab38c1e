"""The report guide's unmarked ``interp`` commands run as written (a plan, the roles alone, a resume
with every other section): apart from tests/test_doc_commands.py, as the longest page."""

from __future__ import annotations

from test_doc_commands import REPORT_GUIDE
from test_doc_examples import placeholder_models, run_page_commands, workdir  # noqa: F401 (fixtures)


def test_the_report_guides_commands_run(workdir):
    run_page_commands(REPORT_GUIDE, workdir)
