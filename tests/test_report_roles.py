"""One route to a role: ``analyses.report_roles`` gives exactly the roles of ``interp report``'s
head_roles.csv at the same arguments."""

import pandas as pd

from analyses import report_roles
from interp import load_model
from shared_reports import TOY_REPORT_ARGS


def test_report_roles_are_the_reports_roles(toy_report):
    """The run's shared toy report (``interp report`` at ``TOY_REPORT_ARGS``) against ``report_roles``
    at the same arguments."""
    assert TOY_REPORT_ARGS == ["--model", "toy", "--prompts", "4", "--seq-len", "32", "--intervention-prompts", "2"]
    written = pd.read_csv(toy_report[0] / "head_roles.csv", keep_default_na=False)
    found = report_roles(load_model("toy").eval(), n_prompts=4, seq_len=32, intervention_prompts=2, progress=False)
    assert (written["role"] != "").any()  # a comparison of something
    assert list(zip(found["layer"], found["head"])) == list(zip(written["layer"], written["head"]))
    assert found["role"].tolist() == written["role"].tolist()
    assert found["partial_role"].tolist() == written["partial_role"].tolist()


def test_a_meaning_role_shows_the_heads_direct_effect_and_says_it_rests_on_the_ov_circuit():
    """L0H3 with copy_suppression (a meaning role) and previous_token (an attention role): the
    meaning role's line gives the direct effect and says it is read from the OV circuit alone; the
    attention role's keeps the ablation effect."""
    from analyses.report.build import role_summary

    table = pd.DataFrame([{"layer": 0, "head": 3, "role": "previous_token;copy_suppression", "partial_role": "",
                           "previous_token": 0.9, "copy_suppression": 0.6, "ablation_effect": 5.2,
                           "ablation_ci_low": 4.9, "ablation_ci_high": 5.5, "causal": "", "direct_effect": 0.001,
                           "direct_ci_low": -0.004, "direct_ci_high": 0.007}])
    lines = {line.split("**")[1]: line for line in role_summary(table)}
    assert lines["copy_suppression"] == (
        "- **copy_suppression** (read from the OV circuit alone, not from what the head does on the probes; beside "
        "it the head's direct effect, not its total ablation effect): L0H3 (score 0.60, direct +0.001 [-0.004, "
        "+0.007] nats)")
    assert lines["previous_token"] == "- **previous_token**: L0H3 (score 0.90, ablation +5.200 [+4.900, +5.500] nats)"
