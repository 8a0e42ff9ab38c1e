"""What the hook self-test knows is known before the first sweep (architecture §2.1): on a model whose heads'
z @ W_O does not give hook_attn_out (as the bridge's Gemma-3 measured), ``interp report`` and
``interp task`` leave out the parts that need it (the circuit, direct logit attribution), run the
rest, and say which and why on the page, in report.md and in meta.json; ``interp circuit``, which has
nothing left to run, refuses in one line before any sweep."""

from __future__ import annotations

import json

import pytest

import analyses.circuits.circuit as circuit
import analyses.cli.circuit
import analyses.cli.report
import analyses.cli.tasks
import analyses.components.overview as overview
import analyses.core.hook_check as hook_check
import analyses.report.build as build
import analyses.report.task_page as task_page
from analyses.cli import main
from interp import load_model
from interp.errors import UserError

# the line a step needing the heads' writes refuses with, written out by hand for a scratch GPT
WRITES = "needs each head's write z @ W_O, and on this {family} model (scratch) blocks.{{l}}.attn.W_O does not give " \
         "hook_attn_out; see `interp check`"


def doubled_output_projection(model):
    """``model`` with every layer's ``W_O`` read as twice the projection its forward uses, so the
    heads' z @ W_O + b_O is no longer hook_attn_out (the forward itself is unchanged)."""
    for block in model.blocks:
        attention = type(block.attn)
        block.attn.__class__ = type("DoubledW_O", (attention,),
                                    {"W_O": property(lambda attn, base=attention: 2 * base.W_O.fget(attn))})
    return model


def loading_doubled(monkeypatch, command_module) -> None:
    """The command loads its model as usual, then its W_O is doubled (``doubled_output_projection``)."""
    load = command_module.load_cli_model
    monkeypatch.setattr(command_module, "load_cli_model", lambda args: doubled_output_projection(load(args)))


def forbid(monkeypatch, module, *names: str) -> None:
    """Each of ``names`` in ``module`` (or a dict's keys) fails the test if called: a sweep the plan
    should have left out."""
    for name in names:
        def called(*args, _name=name, **kwargs):
            raise AssertionError(f"{_name} ran on a model that cannot take it")
        if isinstance(module, dict):
            monkeypatch.setitem(module, name, called)
        else:
            monkeypatch.setattr(module, name, called)


def test_a_report_leaves_out_the_circuit_and_dla_and_says_why(tmp_path, monkeypatch):
    loading_doubled(monkeypatch, analyses.cli.report)
    forbid(monkeypatch, circuit, "path_patch", "screened_path_patch", "composition_scores", "circuit_section")
    forbid(monkeypatch, overview, "direct_logit_attribution")
    out = tmp_path / "report"
    assert main(["report", "--model", "toy", "--prompts", "4", "--out", str(out), "--quiet"]) == 0
    assert {"index.html", "report.md", "head_roles.csv", "meta.json"} <= {p.name for p in out.iterdir()}
    reasons = {part: f"{part} " + WRITES.format(family="interp-gpt")
               for part in ("circuit", "direct logit attribution", "QK attribution")}
    assert json.loads((out / "meta.json").read_text())["left_out"] == reasons
    markdown, page = (out / "report.md").read_text(), (out / "index.html").read_text()
    assert "## Left out" in markdown
    for part, reason in reasons.items():
        assert f"- **{part}**: {reason}" in markdown
        assert f"<strong>{part}</strong>" in page
    assert ">Left out<" in page and page.count("does not give hook_attn_out") >= 2
    figures = {p.stem for p in (out / "figures").iterdir()}
    assert "logit_lens" in figures and "role_scores" in figures  # what could run did
    assert not {"circuit", "dla", "qk"} & figures


def test_a_report_refuses_before_the_probe_run_where_head_ablation_cannot_run(monkeypatch):
    model = load_model("toy")
    real = hook_check.check_hooks(model)
    dead = type(real)(**{**vars(real), "reaches_output": {**real.reaches_output, "hook_z": False}})
    monkeypatch.setattr(hook_check, "check_hooks", lambda model: dead)
    forbid(monkeypatch, build, "probe_run")
    with pytest.raises(UserError, match="^the report's head ablations needs edits of hook_z, which do not reach"):
        build.build_report(model, model_name="toy", n_prompts=4, progress=False)


def test_a_task_leaves_out_the_circuit_and_dla_and_says_why(gpt2_dir, tmp_path, monkeypatch):
    loading_doubled(monkeypatch, analyses.cli.tasks)
    forbid(monkeypatch, task_page, "edge_sweep", "task_dla")
    forbid(monkeypatch, task_page.ATTRIBUTIONS, *task_page.ATTRIBUTIONS)  # EAP and EAP-IG
    out = tmp_path / "task"
    argv = ["task", "ioi", "--model", str(gpt2_dir), "--n", "4", "--no-split", "--top", "2", "--out", str(out), "--quiet"]
    assert main(argv) == 0
    names = {p.name for p in out.iterdir()}
    assert {"index.html", "report.md", "meta.json", "heads.csv", "mlps.csv"} <= names
    assert not {"edges.csv", "dla.csv"} & names
    part = task_page.CIRCUIT
    reasons = {part: f"{part} " + WRITES.format(family="gpt2"),
               "direct logit attribution": "direct logit attribution " + WRITES.format(family="gpt2")}
    assert json.loads((out / "meta.json").read_text())["left_out"] == reasons
    markdown = (out / "report.md").read_text()
    assert all(f"- **{name}**: {reason}" in markdown for name, reason in reasons.items())
    assert "## Circuit" not in markdown and "## Patching" in markdown


def test_circuit_refuses_in_one_line_before_any_sweep(tmp_path, monkeypatch, capsys):
    loading_doubled(monkeypatch, analyses.cli.circuit)
    forbid(monkeypatch, analyses.cli.circuit, "probes_for", "classify_heads", "circuit_section")
    out = tmp_path / "circuit"
    assert main(["circuit", "--model", "toy", "--prompts", "4", "--out", str(out)]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line.lower()]
    assert errors == ["interp circuit: error: interp circuit " + WRITES.format(family="interp-gpt")]
    assert not out.exists()


def test_a_report_on_a_gemma_bridge_leaves_out_the_heads_direct_effects_and_says_why(tmp_path, monkeypatch):
    """On the bridge, a head's direct effect is a rerun that would recompute Gemma's norm on the
    attention output (``ln1_post``): the plan leaves the direct effects out before any sweep, the
    totals (the head table's ablation effects) still run, and the page says why."""
    import analyses.roles.backup as backup
    from interp.random_models import save_random_model

    model_dir = save_random_model("gemma2", tmp_path / "gemma2")
    forbid(monkeypatch, backup, "direct_effects")
    out = tmp_path / "report"
    assert main(["report", "--model", str(model_dir), "--impl", "transformer_lens", "--prompts", "8",
                 "--out", str(out), "--quiet"]) == 0
    reason = ("direct effects of heads reruns the blocks with a head's z edited, and on this gemma2 model "
              "(transformer_lens) the norm on the attention output (blocks.{l}.ln1_post) would be recomputed there")
    assert json.loads((out / "meta.json").read_text())["left_out"]["direct effects of heads"].startswith(reason)
    assert reason in (out / "report.md").read_text()
    assert not (out / "figures" / "self_repair.png").exists()
