"""``interp report`` (issue 44): every effect it prints carries its 95% interval, and the heads are
chosen on probes apart from those their effects are measured on.

One report of the embedded toy model (module-scoped) serves every test; the probes each step was
given are recorded as it runs."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import pytest
import torch
from matplotlib.collections import LineCollection
from matplotlib.patches import Rectangle

import analyses.report.build as build
import analyses.report.calibration_figures as calibration_figures
import analyses.report.split as split_module
import analyses.roles.calibration as calibration
import analyses.roles.control as control_module
from analyses.core.probes import probes_for
from analyses.core.metrics import loss_metric
from analyses.circuits.qk_check import qk_intervention_check, role_pairs
from analyses.components.decompose import component_hooks
from analyses.report.build import build_report, write_report
from analyses.roles.calibration import FirstProbes, probe_run
from analyses.circuits.role_qk import QK_PAIRS
from analyses.roles.backup import direct_and_total_effects
from analyses.roles.causal_check import ablation_effects
from analyses.roles.classify import ROLES, classify_heads
from interp import load_model

N_PROMPTS, INTERVENTION_PROMPTS, SEQ_LEN = 8, 6, 32


@dataclass
class Seen:
    """What steps of the report were given and gave, by step: the tokens (batch, pos) of their
    prompts, and what they returned (the figures)."""

    tokens: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    returned: dict[str, list] = field(default_factory=dict)

    def wrap(self, monkeypatch, module, name: str, argument: int | str | None = None) -> None:
        original = getattr(module, name)

        def recording(*args, **kwargs):
            if argument is not None:
                prompts = kwargs[argument] if isinstance(argument, str) else args[argument]
                self.tokens.setdefault(name, []).append(getattr(prompts, "tokens", prompts).cpu())
            result = original(*args, **kwargs)
            self.returned.setdefault(name, []).append(result)
            return result

        monkeypatch.setattr(module, name, recording)


@pytest.fixture(scope="module")
def toy_report():
    model = load_model("toy").eval()
    seen = Seen()
    with pytest.MonkeyPatch.context() as monkeypatch:
        seen.wrap(monkeypatch, build, "classify_heads", "probes")
        seen.wrap(monkeypatch, calibration, "calibrate_roles", 1)
        seen.wrap(monkeypatch, calibration, "direct_and_total_effects", 1)
        seen.wrap(monkeypatch, control_module, "control_effects", 1)
        seen.wrap(monkeypatch, build, "role_heatmaps")
        seen.wrap(monkeypatch, calibration_figures, "self_repair_figure")
        report = build_report(model, model_name="toy", n_prompts=N_PROMPTS, seq_len=SEQ_LEN, seed=0,
                              intervention_prompts=INTERVENTION_PROMPTS, progress=False)
    return model, report, seen


def test_roles_are_chosen_on_probes_the_effects_are_not_measured_on(toy_report):
    """Classification and the role nulls see the draw's last N_PROMPTS probes, every ablation its
    first INTERVENTION_PROMPTS: no prompt in both (the old report chose on every probe, these
    included), and meta.json says which rows are which. (The toy has no control to run:
    ``test_the_control_draws_no_head_of_the_role`` measures one on these probes.)"""
    model, report, seen = toy_report
    drawn = probes_for(model, INTERVENTION_PROMPTS + N_PROMPTS, SEQ_LEN, seed=0).tokens.cpu()
    measured, chosen = drawn[:INTERVENTION_PROMPTS], drawn[INTERVENTION_PROMPTS:]
    assert not (measured[:, None] == chosen[None]).all(-1).any()  # no prompt of one set is in the other
    for step in ("classify_heads", "calibrate_roles"):
        assert [tokens.shape for tokens in seen.tokens[step]] == [chosen.shape] and torch.equal(seen.tokens[step][0], chosen)
    assert all(torch.equal(tokens, measured) for tokens in seen.tokens["direct_and_total_effects"])
    split = report.meta["probe_split"]
    assert split["measurement"] == [0, INTERVENTION_PROMPTS] and split["disjoint"] is True
    assert split["selection"] == [INTERVENTION_PROMPTS, INTERVENTION_PROMPTS + N_PROMPTS]
    lists = min(split_module.LIST_PROMPTS, INTERVENTION_PROMPTS, N_PROMPTS)  # the selection rows choosing the page's lists
    assert split["lists"] == [INTERVENTION_PROMPTS, INTERVENTION_PROMPTS + lists]
    assert split["probes_drawn"] == INTERVENTION_PROMPTS + N_PROMPTS and split["seed"] == 0
    assert report.meta["prompts"] == N_PROMPTS and report.meta["intervention_prompts"] == INTERVENTION_PROMPTS


def test_the_role_scores_are_those_of_the_choosing_probes_alone(toy_report):
    """The head table's scores are read from the shared forward's pattern sums of the choosing rows:
    equal to classifying those probes alone in a forward of their own."""
    model, report, _ = toy_report
    alone = probes_for(model, INTERVENTION_PROMPTS + N_PROMPTS, SEQ_LEN, seed=0).after(INTERVENTION_PROMPTS)
    scores = classify_heads(model, probes=alone, seed=0, progress=False)
    induction = scores[scores["measure"] == "induction"].merge(report.table, on=["layer", "head"])
    torch.testing.assert_close(torch.tensor(induction["score"].to_numpy()), torch.tensor(induction["induction"].to_numpy()),
                               rtol=0, atol=1e-5)


def test_the_page_says_the_effects_were_measured_apart(toy_report):
    _, report, _ = toy_report
    roles = next(s for s in report.sections if s.title == "Method").text
    assert "measured on prompts that did not choose the heads" in roles
    assert f"the {INTERVENTION_PROMPTS} intervention probes" in roles and f"the other {N_PROMPTS} probes" in roles
    assert "these included" not in roles


def test_the_toy_has_no_matched_control(toy_report):
    """Every induction head of the toy is in layer 1, whose 8 heads all have the role: no head
    without the role is left to draw from, so the page says no matched control is possible in layer
    1 and prints no ratio (it used to test 4 of them against the other 4)."""
    model, report, seen = toy_report
    induction = report.table[report.table["role"].str.split(";").apply(lambda roles: "induction" in roles)]
    assert list(zip(induction["layer"], induction["head"])) == [(1, head) for head in range(model.cfg.n_heads)]
    control = next(s for s in report.sections if s.title == "Induction heads vs layer-matched random heads")
    assert control.text == ("No matched control is possible in layer 1: every head there has the role induction, so "
                            "no head without it is left to draw a layer-matched random set from.")
    assert not control.figures and control.table is None and "control_effects" not in seen.returned


def test_the_control_draws_no_head_of_the_role(toy_report):
    """The report's control on a hand-made head table of the toy model: layer 0 has 6 induction heads
    (scores 0.9 ... 0.4), layer 1 all 8. Layer 1 has no head without the role: no matched control
    there, none of its heads tested. Layer 0 keeps 2 heads without the role, so its top 2 induction
    heads are tested, the other 4 left out, and every random set is the only set left, (0, 6) and
    (0, 7), never an induction head; the page says the pool excludes all 14 induction heads and that
    layer 1 has no matched control. The ablations run on the intervention probes."""
    model, report, _ = toy_report
    table = report.table.copy()
    layer0 = table["layer"] == 0
    table.loc[layer0, "role"] = ["induction" if head < 6 else "" for head in table.loc[layer0, "head"]]
    table.loc[layer0, "induction"] = [0.9 - 0.1 * head for head in table.loc[layer0, "head"]]
    assert table.loc[table["layer"] == 1, "role"].str.contains("induction").all()
    probes = probes_for(model, INTERVENTION_PROMPTS + N_PROMPTS, SEQ_LEN, seed=0)
    run = probe_run(model, probes, names=component_hooks(model, lens=True), intervention_prompts=INTERVENTION_PROMPTS)
    first = FirstProbes.of(probes, run, run.metric, INTERVENTION_PROMPTS)
    control = control_module.role_control(model, table, first, n_draws=3)
    assert control.heads == [(0, 0), (0, 1)] and control.left == [(0, h) for h in range(2, 6)]
    assert control.unmatched == [1] and len(control.excluded) == 14
    assert control.found.sets == [[(0, 6), (0, 7)]] * 3
    assert torch.equal(first.probes.tokens, measured_probes(model).tokens)
    text = build.control_report_section(control, "").text
    assert "excludes all 14 induction heads" in text
    assert "No matched control is possible in layer 1: every head there has the role induction" in text


def measured_probes(model):
    return probes_for(model, INTERVENTION_PROMPTS + N_PROMPTS, SEQ_LEN, seed=0).first(INTERVENTION_PROMPTS)


@pytest.fixture(scope="module")
def written(toy_report, tmp_path_factory):
    _, report, _ = toy_report
    return write_report(report, tmp_path_factory.mktemp("toy_report"))


def test_head_roles_csv_carries_each_effects_interval_from_the_intervention_probes(toy_report, written):
    """head_roles.csv's ablation effect and interval are ``ablation_effects``' (the causal check's own
    sweep) on the intervention probes, and its direct effect and interval ``direct_and_total_effects``'
    there (the old CSV had no direct effect, and measured on probes that also chose the roles)."""
    model, _, _ = toy_report
    table = pd.read_csv(written / "head_roles.csv", keep_default_na=False)
    probes = measured_probes(model)
    alone = ablation_effects(model, probes, progress=False).merge(table, on=["layer", "head"], suffixes=("", "_csv"))
    assert len(alone) == model.cfg.n_layers * model.cfg.n_heads
    for column in ("ablation_effect", "ablation_ci_low", "ablation_ci_high"):
        assert alone[f"{column}_csv"].to_numpy() == pytest.approx(alone[column].to_numpy(), abs=2e-6), column
    assert (alone["ablation_n_prompts_csv"] == alone["ablation_n_prompts"]).all()
    effects = direct_and_total_effects(model, probes, None, "mean_aligned", loss_metric(probes.tokens, probes.predictable),
                                       progress=False)
    direct = effects.astype({"head": int}).merge(table, on=["layer", "head"])
    for ours, theirs in (("direct_effect", "direct"), ("direct_ci_low", "direct_ci_low_x"),
                         ("direct_ci_high", "direct_ci_high_x")):
        assert direct[ours if ours == "direct_effect" else ours + "_y"].to_numpy() == pytest.approx(
            direct[theirs].to_numpy(), abs=2e-6), ours


def effect(row) -> str:
    """An effect and its interval as the report should print it, formatted here by hand."""
    return f"{row.ablation_effect:+.3f} [{row.ablation_ci_low:+.3f}, {row.ablation_ci_high:+.3f}]"


def test_report_md_and_the_page_print_each_role_heads_effect_with_its_interval(toy_report, written):
    _, report, _ = toy_report
    table = report.table
    markdown, page = (written / "report.md").read_text(), (written / "index.html").read_text()
    induction = table[table["role"].str.split(";").apply(lambda roles: "induction" in roles)]
    assert len(induction) >= 1
    line = next(line for line in markdown.splitlines() if line.startswith("- **induction**:"))
    for row in induction.itertuples():
        assert f"L{row.layer}H{row.head} (score {row.induction:.2f}, ablation {effect(row)} nats" in line
        # the page's head table: the effect, then its interval
        low_high = effect(row).split(" ", 1)[1]
        assert f'data-sort="{row.ablation_effect:.6f}">{row.ablation_effect:+.3f} <span class="interval">{low_high}</span>' in page
        assert f" | {effect(row)} | " in markdown  # report.md's head table
    covered = table[(table["ablation_ci_low"] <= 0) & (table["ablation_ci_high"] >= 0)]
    attention_role = covered["role"].str.split(";").apply(lambda roles: any(r in ROLES for r in roles))
    for row in covered[attention_role].itertuples():  # a meaning role's line shows the direct effect instead
        assert f"ablation {effect(row)} nats, no detectable effect)" in markdown


def test_the_role_heatmap_hatches_exactly_the_cells_whose_interval_contains_0(toy_report):
    """The ablation-effect panel of the role heatmaps: a hatched rectangle over (head, layer) exactly
    where the table's interval contains 0 (worked out here from the bounds); none on the score panels."""
    _, report, seen = toy_report
    (figure,) = seen.returned["role_heatmaps"]
    table = report.table
    expected = {(int(r.head), int(r.layer)) for r in table.itertuples() if r.ablation_ci_low <= 0 <= r.ablation_ci_high}
    assert expected and len(expected) < len(table)  # the toy has both kinds of head
    hatched = {}
    for ax in figure.axes:
        cells = {(int(p.get_x()), int(p.get_y())) for p in ax.patches if isinstance(p, Rectangle) and p.get_hatch()}
        hatched[ax.get_title().split("\n")[0]] = cells
    assert hatched.pop("ablation effect") == expected
    assert not any(hatched.values())


def test_the_self_repair_figure_draws_each_effects_interval(toy_report):
    """Error bars: a vertical segment from each head's total effect's ci_low to ci_high at its direct
    effect, a horizontal one for the direct effect's interval."""
    model, _, seen = toy_report
    (figure,) = seen.returned["self_repair_figure"]
    probes = measured_probes(model)
    effects = direct_and_total_effects(model, probes, None, "mean_aligned", loss_metric(probes.tokens, probes.predictable),
                                       progress=False)
    effects = effects[effects["kind"] == "head"]
    segments = [np.array(c.get_segments()) for c in figure.axes[0].collections if isinstance(c, LineCollection)]
    vertical = next(s for s in segments if np.allclose(s[:, 0, 0], s[:, 1, 0]))
    horizontal = next(s for s in segments if np.allclose(s[:, 0, 1], s[:, 1, 1]))
    assert vertical[:, 0, 0] == pytest.approx(effects["direct"].to_numpy(), abs=2e-6)
    assert vertical[:, :, 1] == pytest.approx(effects[["total_ci_low", "total_ci_high"]].to_numpy(), abs=2e-6)
    assert horizontal[:, 0, 1] == pytest.approx(effects["total"].to_numpy(), abs=2e-6)
    assert horizontal[:, :, 0] == pytest.approx(effects[["direct_ci_low", "direct_ci_high"]].to_numpy(), abs=2e-6)


def top_named(cell: str) -> str:
    """The first component of a ``qk_key_top`` cell ('L0H3 0.82; L0H2 0.10; ...')."""
    return cell.split(";")[0].rsplit(" ", 1)[0]


def test_the_induction_heads_name_the_previous_token_head_as_what_their_keys_read(toy_report, written):
    """head_roles.csv's key-side QK attribution of each induction head against an intervention: the
    component whose removal from that head's key input alone drops its attention on the induction
    target the most (``qk_intervention_check``). Where removal singles one out (its drop at least
    twice the next), the CSV names it first; the toy's previous-token head L0H3 is that component
    for most of the induction heads, L1H5 (its strongest) among them. (The old report had no QK
    columns.)"""
    model, _, _ = toy_report
    table = pd.read_csv(written / "head_roles.csv", keep_default_na=False)
    holds = table["role"].str.split(";")
    assert "previous_token" in holds[(table["layer"] == 0) & (table["head"] == 3)].iloc[0]
    induction = table[holds.apply(lambda roles: "induction" in roles)]
    probes = measured_probes(model)
    query, key = role_pairs(probes, "induction", QK_PAIRS)
    by_removal = {}
    for row in induction.itertuples():
        assert row.qk_role == "induction"
        check = qk_intervention_check(model, probes.tokens, row.layer, row.head, query, key, side="key", n_boot=10)
        drops = check.frame.sort_values("drop", ascending=False)
        first, second = drops["drop"].iloc[0], drops["drop"].iloc[1]
        if first >= 2 * second:
            by_removal[(row.layer, row.head)] = drops["component"].iloc[0]
            assert top_named(row.qk_key_top) == drops["component"].iloc[0], (row.layer, row.head)
    assert len(by_removal) >= len(induction) // 2
    strongest = table[(table["layer"] == 1) & (table["head"] == 5)]
    assert by_removal[(1, 5)] == "L0H3" and top_named(strongest["qk_key_top"].iloc[0]) == "L0H3"
    assert sum(component == "L0H3" for component in by_removal.values()) > len(by_removal) / 2


def test_the_qk_contrast_is_the_heads_own_score_contrast(toy_report, written):
    """qk_contrast: the mean over the role's pairs of the head's pre-softmax score at the target minus
    the mean of its scores at the other keys the query sees, read here from the model's own
    ``hook_attn_scores``; the listed shares of a side are of that contrast (the CSV's top three add
    up to at most the whole, within rounding, where they are all positive)."""
    model, _, _ = toy_report
    table = pd.read_csv(written / "head_roles.csv", keep_default_na=False)
    probes = measured_probes(model)
    rows = table[table["qk_role"] != ""]
    assert len(rows) >= 2
    for row in rows.itertuples():
        query, key = role_pairs(probes, row.qk_role, QK_PAIRS)
        _, cache = model.run_with_cache(probes.tokens, names_filter=f"blocks.{row.layer}.attn.hook_attn_scores")
        scores = cache[f"blocks.{row.layer}.attn.hook_attn_scores"][:, row.head].double()
        contrasts = []
        for prompt in range(len(query)):
            for q, k in zip(query[prompt].tolist(), key[prompt].tolist()):
                others = [j for j in range(q + 1) if j != k]
                contrasts.append(scores[prompt, q, k] - scores[prompt, q, others].mean())
        assert float(row.qk_contrast) == pytest.approx(float(torch.stack(contrasts).mean()), rel=1e-4, abs=1e-4)
    markdown = (written / "report.md").read_text()
    assert "## Why the role heads attend" in markdown and "figures/qk.png" in markdown
    assert "| L0H3 -> L1H5.k |" in markdown  # the revealed edge, beside its composition score and path patching
