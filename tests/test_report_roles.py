"""One route to a role: ``analyses.report_roles`` gives exactly the roles of ``interp report``'s
head_roles.csv at the same arguments."""

import pandas as pd

from analyses import report_roles
from analyses.cli import main
from interp import load_model

SMALL = ["--prompts", "8", "--seq-len", "24", "--intervention-prompts", "4"]


def test_report_roles_are_the_reports_roles(tmp_path):
    out = tmp_path / "toy"
    assert main(["report", "--model", "toy", *SMALL, "--out", str(out), "--quiet"]) == 0
    written = pd.read_csv(out / "head_roles.csv", keep_default_na=False)
    found = report_roles(load_model("toy").eval(), n_prompts=8, seq_len=24, intervention_prompts=4, progress=False)
    assert (written["role"] != "").any()  # a comparison of something
    assert list(zip(found["layer"], found["head"])) == list(zip(written["layer"], written["head"]))
    assert found["role"].tolist() == written["role"].tolist()
    assert found["partial_role"].tolist() == written["partial_role"].tolist()
