"""The circuit step (architecture §4.6): edges scored by composition and by path patching, the graph
figure, the report section's data, and ``interp circuit``."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest
import torch
from matplotlib.patches import FancyArrowPatch

from analyses import cli
from analyses.circuits.circuit import (VIA_COLOURS, chosen_edges, circuit_edges, circuit_figure, circuit_section, edge_lines,
                                       induction_pair, role_heads, screen_meta, with_roles)
from analyses.roles.classify import DEFAULT_THRESHOLD, assign_roles, classify_heads
from analyses.roles.nulls import calibrate_roles
from analyses.circuits.path_patching import edge_attribution
from analyses.interventions.attribution import Screen
from analyses.report.build import circuit_report_section
from analyses.report.split import selection_probes
from analyses.circuits.composition import composition_scores
from analyses.core.probes import probes_for
from interp import load_model
from interp.errors import UserError

KEYS = ["sender_layer", "sender_head", "receiver_layer", "receiver_head", "via"]


@pytest.fixture(scope="module")
def toy():
    """The embedded model, its probes and its head-role table."""
    model = load_model("toy").eval()
    probes = probes_for(model, 16, seed=0)
    table = assign_roles(classify_heads(model, probes=probes, seed=0, n_boot=50))
    return model, probes, table


def test_edges_join_composition_and_path_patching(toy):
    model, probes, table = toy
    clean, corrupted, metric = induction_pair(probes)
    senders, receivers = [(0, 3), (0, 5)], [(1, 0), (1, 5)]
    edges = circuit_edges(model, clean, corrupted, metric, senders=senders, receivers=receivers, baseline_samples=8)
    assert len(edges) == 2 * 2 * 3 + 2  # q, k, v per pair, and each sender's logits edge
    scores = composition_scores(model, ("q", "k", "v"), baseline_samples=8).rename(columns={"kind": "via"})
    joined = edges.merge(scores, on=KEYS)
    assert len(joined) == 12 and (joined["composition"] == joined["score"]).all()
    logits = edges[edges["via"] == "logits"]
    assert (logits["receiver_layer"] == 2).all() and logits["composition"].isna().all()
    # noising (the default) patches the clean run: every effect is measured from the clean loss
    base = (edges["value"] - edges["effect"]).to_numpy()
    assert base == pytest.approx(metric(model(clean)).item(), abs=1e-5)


def test_toy_previous_token_to_induction_key_paths_dominate(toy):
    """Measured on the embedded model (noising, loss on the predictable tokens): 0.3 -> 1.x through
    the key raises the loss by 0.09-2.2 nats (1.5 most), through the value by up to ~0.35, through the
    query by < 0.02; 0.3 is the strongest key sender of 7 of the 8 induction heads (0.2 -> 1.6 beats
    0.3 -> 1.6)."""
    model, probes, table = toy
    previous, induction = role_heads(table, "previous_token"), role_heads(table, "induction")
    assert previous == [(0, 3)] and len(induction) >= 4
    clean, corrupted, metric = induction_pair(probes)
    senders = [(0, head) for head in range(model.cfg.n_heads)]
    edges = circuit_edges(model, clean, corrupted, metric, senders=senders, receivers=induction, via=("q", "k", "v"),
                          baseline_samples=8)
    keys = edges[edges["via"] == "k"]
    top = keys.loc[keys["effect"].idxmax()]
    assert (top["sender_layer"], top["sender_head"]) == (0, 3)
    strongest = keys.loc[keys.groupby(["receiver_layer", "receiver_head"])["effect"].idxmax()]
    assert (strongest["sender_head"] == 3).sum() >= 0.75 * len(induction)

    from_previous = edges[edges["sender_head"] == 3].groupby("via")["effect"].sum()
    assert from_previous["k"] > 1.0
    assert from_previous["k"] > 10 * abs(from_previous["q"]) and from_previous["k"] > 3 * from_previous["v"]


@pytest.mark.parametrize("family", ["gpt2", "llama"])  # llama: grouped-query key/value heads
def test_same_edges_on_both_implementations(family_dir, family):
    directory = family_dir(family)
    ours, bridge = load_model(directory, impl="scratch").eval(), load_model(directory, impl="transformer_lens").eval()
    probes = probes_for(ours, 3, 16, seed=4)
    clean, corrupted, metric = induction_pair(probes)
    options = dict(senders=[(0, 0), (0, 2)], receivers=[(1, 1), (1, 3)], baseline_samples=8)
    mine = circuit_edges(ours, clean, corrupted, metric, **options)
    theirs = circuit_edges(bridge, clean, corrupted, metric, **options)
    pd.testing.assert_frame_equal(mine[KEYS], theirs[KEYS])
    for column in ("composition", "value", "effect"):
        torch.testing.assert_close(torch.tensor(mine[column].to_numpy()), torch.tensor(theirs[column].to_numpy()),
                                   rtol=0, atol=1e-4, equal_nan=True)
    assert mine["effect"].abs().max() > 1e-4  # something moved


def _drawn_edges() -> pd.DataFrame:
    """Three hand-made edges of the documented shape: k 0.3 -> 1.5 (+2.0), v 0.3 -> 1.5 (-0.5), q
    0.2 -> 1.1 (+0.1)."""
    rows = [(0, 3, 1, 5, "k", 0.3, 0.2, 2.0), (0, 3, 1, 5, "v", 0.1, 0.0, -0.5), (0, 2, 1, 1, "q", 0.1, 0.0, 0.1)]
    edges = pd.DataFrame(rows, columns=[*KEYS, "composition", "composition_minus_baseline", "effect"])
    table = pd.DataFrame({"layer": [0, 0, 1, 1], "head": [3, 2, 5, 1],
                          "role": ["previous_token", "", "induction", "induction;duplicate_token"]})
    return with_roles(edges, table)


def test_figure_draws_the_strongest_edges_by_width_colour_and_style():
    figure = circuit_figure(_drawn_edges(), top=2)
    arrows = [p for p in figure.axes[0].patches if isinstance(p, FancyArrowPatch)]
    assert len(arrows) == 2
    widest = max(arrows, key=lambda a: a.get_linewidth())
    narrowest = min(arrows, key=lambda a: a.get_linewidth())
    assert widest.get_edgecolor()[:3] == pytest.approx(_rgb(VIA_COLOURS["k"]))
    assert narrowest.get_edgecolor()[:3] == pytest.approx(_rgb(VIA_COLOURS["v"]))
    assert widest.get_linestyle() == "-" and narrowest.get_linestyle() == "--"
    labels = {t.get_text() for t in figure.axes[0].texts}
    assert labels == {"L0H3\nprevious token", "L1H5\ninduction"}  # 0.2 -> 1.1 is not among the top 2


def test_edge_lines_name_the_strongest_edges():
    assert edge_lines(_drawn_edges(), top=2) == [
        "- L0H3 (previous_token) -> L1H5 (induction) via k: effect +2.0000, composition 0.300 (+0.200 over random)",
        "- L0H3 (previous_token) -> L1H5 (induction) via v: effect -0.5000, composition 0.100 (+0.000 over random)",
    ]


def _rgb(name: str):
    from matplotlib.colors import to_rgb
    return to_rgb(name)


def test_role_heads_and_unknown_roles():
    table = pd.DataFrame({"layer": [0, 0, 1, 1], "head": [3, 2, 5, 1],
                          "role": ["previous_token", "", "induction", "induction;duplicate_token"]})
    assert role_heads(table) == [(0, 3), (1, 1), (1, 5)]
    assert role_heads(table, "induction") == [(1, 1), (1, 5)]
    assert role_heads(table, "duplicate_token") == [(1, 1)]
    with pytest.raises(UserError, match="'inductoin' is not a role; allowed: previous_token, "):
        role_heads(table, "inductoin")


def test_sink_only_heads_are_skipped():
    """A head whose only role is a skipped one (an attention sink) is left out; one that also has
    another role stays."""
    table = pd.DataFrame({"layer": [0, 0, 1, 1], "head": [3, 2, 5, 1],
                          "role": ["previous_token", "bos", "induction;bos", "bos;self"]})
    assert role_heads(table) == [(0, 2), (0, 3), (1, 1), (1, 5)]
    assert role_heads(table, skip=("bos",)) == [(0, 3), (1, 1), (1, 5)]
    assert role_heads(table, "induction", skip=("bos",)) == [(1, 5)]
    assert role_heads(table, skip=("bos", "self", "copying")) == [(0, 3), (1, 5)]  # the copying roles count too
    with pytest.raises(UserError, match="skipped role 'sink' is not a role"):
        role_heads(table, skip=("sink",))


def test_report_circuit_leaves_out_sinks_and_says_so(toy):
    """The section skips sink-only heads (their edges are absent) and its text names them."""
    from analyses.report.build import circuit_report_section

    model, probes, table = toy
    sinks = table.assign(role=[role or "bos" for role in table["role"]])  # every role-less head a sink
    section = circuit_section(model, sinks, probes, via="k", baseline_samples=4, skip_roles=("bos",))
    assert section.senders == role_heads(table) and section.skipped == sorted(set(role_heads(sinks)) - set(role_heads(table)))
    assert len(section.skipped) > 0
    text = circuit_report_section(chosen_edges(model, section, selection_probes(model, probes, 8))).text
    assert f"the {len(section.skipped)} role heads with none of the roles" in text and "left out" in text


def test_section_without_role_heads_is_empty(toy):
    model, probes, table = toy
    section = circuit_section(model, table.assign(role=""), probes)
    assert section.edges.empty and section.figure is None and section.senders == []


def _circuit(argv) -> int:
    """``interp circuit ...`` through the real entry point (registered here until cli.py lists it)."""
    commands = cli._COMMANDS if "analyses.cli.circuit" in cli._COMMANDS else [*cli._COMMANDS, "analyses.cli.circuit"]
    original, cli._COMMANDS = cli._COMMANDS, commands
    try:
        return cli.main(["circuit", *argv])
    finally:
        cli._COMMANDS = original


def test_command_writes_edges_figure_and_meta(tmp_path, toy):
    """The command chooses its heads on the selection rows of one draw and path-patches on the
    other rows, as the report does: its edges are the circuit of the roles classified on rows
    [8, 24) measured on rows [0, 8), and meta.json records the split."""
    model, _, _ = toy
    out = tmp_path / "circuit"
    argv = ["--prompts", "16", "--intervention-prompts", "8", "--senders", "previous_token", "--quiet"]
    assert _circuit([*argv, "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["circuit.png", "edges.csv", "meta.json"]
    assert (out / "circuit.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    written = pd.read_csv(out / "edges.csv", keep_default_na=False, na_values=[""])
    probes = probes_for(model, 24, seed=0)
    table = assign_roles(classify_heads(model, probes=probes.after(8), seed=0), DEFAULT_THRESHOLD,
                         calibration=calibrate_roles(model, probes.after(8), seed=0))
    expected = circuit_section(model, table, probes.first(8), sender_role="previous_token").edges
    assert set(written["sender_role"]) == {"previous_token"}
    pd.testing.assert_frame_equal(written[KEYS], expected[KEYS].reset_index(drop=True), check_dtype=False)
    torch.testing.assert_close(torch.tensor(written["effect"].to_numpy()), torch.tensor(expected["effect"].to_numpy(),
                               dtype=torch.float64), rtol=0, atol=1e-6)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["command"] == "circuit" and meta["senders"] == [[0, 3]] and meta["impl"] == "scratch"
    split = meta["probe_split"]
    assert (split["probes_drawn"], split["measurement"], split["selection"]) == (24, [0, 8], [8, 24])
    again = tmp_path / "again"
    assert _circuit([*argv, "--out", str(again)]) == 0
    for name in ("edges.csv", "circuit.png"):  # same seed, same bytes
        assert (again / name).read_bytes() == (out / name).read_bytes()


def test_model_without_the_role_is_one_line(tmp_path, gpt2_dir, capsys):
    """A randomly initialised GPT-2 has no induction head."""
    argv = ["--model", str(gpt2_dir), "--senders", "induction", "--prompts", "4", "--out", str(tmp_path / "out")]
    assert _circuit(argv) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("interp circuit: error: no heads to connect: 0 sender heads "
                                                     "(role induction)")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv, message", [
    (["--senders", "inductoin"], "--senders 'inductoin' is not a role; allowed: previous_token, duplicate_token"),
    (["--receivers", "copy"], "--receivers 'copy' is not a role"),
    (["--via", "k,o"], "unknown via 'o'; allowed: q, k, v, logits"),
])
def test_bad_input_is_one_line(tmp_path, capsys, argv, message):
    assert _circuit([*argv, "--prompts", "4", "--out", str(tmp_path / "out")]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("interp circuit: error: ") and message in errors[0]
    assert not (tmp_path / "out").exists()


def test_a_screened_circuit_is_exact_where_its_rule_says_and_the_page_says_it_is_screened(toy):
    """circuit_edges with a Screen: the edges it path-patched equal the exhaustive run's (1e-5), they
    are the rule's own choice from the attribution (recomputed here from edge_attribution), the
    others are the estimate; the report's circuit page names the screen and meta.json counts it."""
    model, probes, table = toy
    clean, corrupted, metric = induction_pair(probes)
    heads = role_heads(table, skip=("bos",))
    options = dict(senders=heads, receivers=heads, baseline_samples=4)
    every = circuit_edges(model, clean, corrupted, metric, **options)
    screen = Screen(top_k=3, share=0.05)
    screened = circuit_edges(model, clean, corrupted, metric, screen=screen, **options)
    assert every["exact"].all() and 3 <= screened["exact"].sum() < len(screened)
    assert screened[KEYS].equals(every[KEYS])
    exact = screened["exact"].to_numpy()
    assert screened["value"][exact].to_numpy() == pytest.approx(every["value"][exact].to_numpy(), abs=1e-5)
    attribution = edge_attribution(model, clean, corrupted, metric, senders=heads, receivers=heads,
                                   direction="noise").merge(every[KEYS], on=KEYS, how="right")["attribution"]
    gap = metric(model(corrupted)).item() - metric(model(clean)).item()
    chosen = (attribution.abs() >= 0.05 * abs(gap)).to_numpy().copy()
    chosen[attribution.abs().to_numpy().argsort()[::-1][:3]] = True
    assert (exact == chosen).all()
    assert screened["effect"][~exact].to_numpy() == pytest.approx(attribution[~exact].to_numpy(), abs=1e-5)

    section = circuit_section(model, table, probes, baseline_samples=4, skip_roles=("bos",), screen=screen)
    page = circuit_report_section(chosen_edges(model, section, selection_probes(model, probes, 8))).text
    assert f"chose the {int(section.edges['exact'].sum())} path-patched exactly" in page
    lines = edge_lines(screened, top=len(screened))
    assert sum(line.endswith("(estimate)") or "(estimate)," in line for line in lines) == (~exact).sum()
    assert screen_meta(section, [16, 24]) == {"top_k": 3, "share": 0.05, "edges": len(section.edges),
                                              "exact": int(section.edges["exact"].sum()), "screened_on": [16, 24]}


def test_a_screened_circuit_draws_only_its_path_patched_edges(toy):
    """Under the title "path patching" the figure draws only the edges path-patched exactly: a screen
    that patches two of them exactly gives a figure of those two, and its title says how many edges
    at their EAP estimate it left out (the text list still shows them, marked)."""
    model, probes, table = toy
    section = circuit_section(model, table, probes, baseline_samples=4, skip_roles=("bos",),
                              screen=Screen(top_k=2, share=math.inf))
    exact = section.edges[section.edges["exact"].astype(bool)]
    assert len(exact) == 2 and len(section.edges) > 12
    axes = section.figure.axes[0]
    assert len([p for p in axes.patches if isinstance(p, FancyArrowPatch)]) == 2
    ends = {f"L{layer}H{head}" if head >= 0 else "logits"
            for side in ("sender", "receiver") for layer, head in zip(exact[f"{side}_layer"], exact[f"{side}_head"])}
    assert {text.get_text().split("\n")[0] for text in axes.texts} == ends
    assert axes.get_title().startswith("strongest edges by path patching")
    assert f"not drawn: the {len(section.edges) - 2} edges left at their EAP estimate" in axes.get_title()
