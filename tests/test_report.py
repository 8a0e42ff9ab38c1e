"""``interp report`` and ``interp attention-map``: the files, byte-for-byte reproducibility, the same
scores from both GPT-2 backends, one-line errors, and the roles of the embedded model."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import re
from pathlib import Path

import pandas as pd
import pytest
import torch
from matplotlib.figure import Figure

import analyses.core.probes
from analyses.roles.classify import MEASURES
from analyses.cli import build_parser, main
from analyses.core.plots import png_bytes
from analyses.report.build import (BACKUP, DISPLAY_TEXT, DISPLAY_TOKENS, HeadReport, ReportSteps, build_report,
                                   write_report)
from analyses.circuits.role_qk import QK_COLUMNS
from analyses.report.qk_section import QK
from analyses.report.page import ReportFigure, Section, decode_patterns, encode_patterns, head_table_html
from analyses.core.tokens import leading_tokens
from interp import GPTConfig, GPTModel, load_model, provenance
from interp.loading import save_checkpoint

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def report(out: Path, model, *extra: str) -> Path:
    assert main(["report", "--model", str(model), "--prompts", "4", "--seq-len", "48", "--out", str(out), *extra]) == 0
    return out


@pytest.fixture(scope="module")
def scratch_report(gpt2_dir, tmp_path_factory):
    return report(tmp_path_factory.mktemp("scratch"), gpt2_dir)


@pytest.fixture(scope="module")
def built(gpt2_dir) -> tuple[HeadReport, list, list[str]]:
    """``build_report`` on the GPT-2 directory at its default progress, once for the module: (the
    report, the arguments of each call of ``repeated_probes`` during it, what it wrote on stderr, one
    entry a line; a StringIO is off a terminal, as pytest's captured stderr is)."""
    drawn, err = [], io.StringIO()
    original = analyses.core.probes.repeated_probes
    with pytest.MonkeyPatch.context() as monkeypatch, contextlib.redirect_stderr(err):
        monkeypatch.setattr(analyses.core.probes, "repeated_probes",
                            lambda *a, **k: drawn.append(a) or original(*a, **k))
        made = build_report(load_model(gpt2_dir), model_name=str(gpt2_dir), n_prompts=4, seq_len=48)
    return made, drawn, err.getvalue().splitlines()


def test_report_writes_every_file_with_one_row_per_head(scratch_report):
    names = sorted(p.relative_to(scratch_report).as_posix() for p in scratch_report.rglob("*"))
    figures = sorted(n.removeprefix("figures/").removesuffix(".png") for n in names if n.startswith("figures/"))
    store = [".sections", ".sections/.lock", ".sections/steps", ".sections/steps.json",
             *[f".sections/steps/{name}.json" for name in ReportSteps.STEPS[1:]]]  # the finished sections (--resume)
    tables = ["head_roles.csv", "copying.csv", *(["backup_pairs.csv"] if "backup" in figures else [])]
    assert names == sorted([*store, "figures", *[f"figures/{f}.png" for f in figures], *tables, "index.html",
                            "meta.json", "report.md"])  # no temporary files left
    always = {"role_scores", "top_heads", "layer_map", "rollout", "null_bands", "self_repair", "dormant", "similarity",
              "dla", "logit_lens", "attention_vs_mlp"}
    assert always <= set(figures) <= always | {"backup", "circuit", "control", "qk"}  # those four need role heads
    table = pd.read_csv(scratch_report / "head_roles.csv", keep_default_na=False)
    expected = (["layer", "head", "head_name", "role", "partial_role"]
                + [f"{m}{s}" for m in MEASURES for s in ("", "_ci_low", "_ci_high")])
    assert list(table.columns[: len(expected)]) == expected
    assert {"ablation_effect", "causal", "induction_null_low", "induction_null_high", "induction_q"} <= set(table.columns)
    assert list(zip(table["layer"], table["head"])) == [(layer, head) for layer in range(2) for head in range(4)]
    assert ((table["induction_ci_low"] <= table["induction"]) & (table["induction"] <= table["induction_ci_high"])).all()
    meta = json.loads((scratch_report / "meta.json").read_text())
    assert meta["prompts"] == 4 and meta["seed"] == 0 and meta["seq_len"] == 48 and "torch" in meta["versions"]
    assert meta["fdr"] == 0.05 and meta["thresholds"] == 0.4 and len(meta["null_seeds"]) >= 2
    html = (scratch_report / "index.html").read_text()
    images = re.findall(r'<img [^>]*src="data:image/png;base64,([A-Za-z0-9+/=]+)"', html)
    assert len(images) == len(figures) and "src=\"figures" not in html
    for name in figures:
        assert (scratch_report / "figures" / f"{name}.png").read_bytes().startswith(PNG_SIGNATURE)
        assert f"figures/{name}.png" in (scratch_report / "report.md").read_text()


def test_same_seed_same_bytes_and_other_impl_same_scores(scratch_report, gpt2_dir, tmp_path):
    again = report(tmp_path / "again", gpt2_dir)
    for path in sorted(p for p in scratch_report.rglob("*.*") if p.is_file()):  # the page and the store (--resume)
        if path.name == "meta.json":  # its cost record holds seconds measured on this run (issue 45.3)
            timed = [json.loads(p.read_text()) | {"cost": None} for p in (path, again / "meta.json")]
            assert timed[0] == timed[1]
            continue
        assert (again / path.relative_to(scratch_report)).read_bytes() == path.read_bytes(), path.name
    bridge = report(tmp_path / "bridge", gpt2_dir, "--impl", "transformer_lens")
    ours, theirs = (pd.read_csv(d / "head_roles.csv", keep_default_na=False) for d in (scratch_report, bridge))
    # QK attribution needs interp's own attention: the bridge's report leaves it out and says why
    left = json.loads((bridge / "meta.json").read_text())["left_out"]
    assert left[QK].startswith("QK attribution needs interp's")
    # so does the backup test (a partner's attribution read through interp's own final readout)
    assert left[BACKUP].startswith("the rise of a partner's direct logit attribution reads the final norm")
    assert not set(QK_COLUMNS) & set(theirs.columns) and set(QK_COLUMNS) <= set(ours.columns)
    ours = ours.drop(columns=QK_COLUMNS)
    numeric = [c for c in ours.columns if ours[c].dtype.kind in "fi"]
    assert "induction" in numeric and (ours[numeric] - theirs[numeric]).abs().max().max() < 1e-4
    assert ours.drop(columns=numeric).equals(theirs.drop(columns=numeric))  # roles and any other text


def test_report_on_texts_scores_text_roles(gpt2_dir, tmp_path):
    texts = tmp_path / "texts.txt"
    texts.write_text("the cat sat on the mat\n\nabc abc abc\n")
    out = report(tmp_path / "texts", gpt2_dir, "--text-file", str(texts))
    table = pd.read_csv(out / "head_roles.csv", keep_default_na=False)
    assert "induction" not in table.columns and "duplicate_token" in table.columns
    assert json.loads((out / "meta.json").read_text())["texts"] == 2


@pytest.mark.parametrize("argv, message", [
    (["report", "--prompts", "1"], "--prompts 1: at least 2 prompts are needed"),
    (["report", "--model", "/nonexistent/model"], "/nonexistent/model"),
    (["report", "--impl", "transformer_lens", "--model", "/nonexistent/model"], "/nonexistent/model"),
    (["report", "--text-file", "/nonexistent/texts.txt"], "texts.txt"),
    (["attention-map", "--text", "", "--out", "x.png"], "text is empty"),
    (["attention-map", "--text-file", "/nonexistent/notes.txt", "--out", "x.png"], "'/nonexistent/notes.txt' does not exist"),
    (["attention-map", "--text-file", "BLANK", "--out", "x.png"], "is empty"),
])
def test_bad_input_is_one_line(argv, message, gpt2_dir, capsys, tmp_path):
    (tmp_path / "blank.txt").write_text(" \n\n")
    argv = [{"x.png": str(tmp_path / "x.png"), "BLANK": str(tmp_path / "blank.txt")}.get(a, a) for a in argv]
    if "--model" not in argv:
        argv += ["--model", str(gpt2_dir)]
    assert main(argv) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line.lower()]  # not HF's load bar
    assert len(errors) == 1 and errors[0].startswith(f"interp {argv[0]}: error: ") and message in errors[0]
    assert not (tmp_path / "x.png").exists()


def test_attention_map_writes_one_png_and_checks_the_layer(gpt2_dir, tmp_path, capsys):
    out = tmp_path / "maps" / "layer1.png"
    assert main(["attention-map", "--model", str(gpt2_dir), "--text", "the cat sat", "--layer", "1", "--out", str(out)]) == 0
    assert out.read_bytes().startswith(PNG_SIGNATURE)
    assert main(["attention-map", "--model", str(gpt2_dir), "--text", "hi", "--layer", "2", "--out", str(out)]) == 2
    assert "layer=2 must be in [0, 2)" in capsys.readouterr().err
    assert main(["attention-map", "--model", str(gpt2_dir), "--text", "x" * 80, "--out", str(out)]) == 2
    assert "n_ctx=64" in capsys.readouterr().err


def test_attention_map_reads_a_text_file_newlines_and_all(gpt2_dir, tmp_path):
    """--text-file draws the same map as --text given the file's whole text, newline included."""
    text = "the cat sat\non the mat"
    (tmp_path / "cat.txt").write_text(text)
    typed, filed, flat = (tmp_path / name for name in ("typed.png", "filed.png", "flat.png"))
    common = ["attention-map", "--model", str(gpt2_dir), "--layer", "1", "--out"]
    assert main([*common, str(typed), "--text", text]) == 0
    assert main([*common, str(filed), "--text-file", str(tmp_path / "cat.txt")]) == 0
    assert main([*common, str(flat), "--text", text.replace("\n", " ")]) == 0
    assert filed.read_bytes() == typed.read_bytes() != flat.read_bytes()


def test_toy_report_names_induction_and_previous_token_heads_that_matter(tmp_path):
    out = tmp_path / "toy"
    assert main(["report", "--model", "toy", "--prompts", "16", "--out", str(out)]) == 0
    table = pd.read_csv(out / "head_roles.csv", keep_default_na=False)
    roles = table["role"].str.split(";")
    induction = table[roles.apply(lambda r: "induction" in r)]
    previous = table[roles.apply(lambda r: "previous_token" in r)]
    assert len(induction) >= 1 and len(previous) >= 1
    # induction heads sit after a previous-token head, and ablating one hurts the predictable tokens
    assert induction["layer"].max() > previous["layer"].min()
    assert induction["ablation_effect"].max() > 0.1
    assert induction["ablation_effect"].max() > table["ablation_effect"].median()
    summary = (out / "report.md").read_text()
    assert re.search(r"\*\*induction\*\*: L\d+H\d+", summary) and re.search(r"\*\*previous_token\*\*: L\d+H\d+", summary)
    # every induction head is in layer 1, whose heads all have the role: no head outside the role to
    # draw a layer-matched random set from, so no ratio
    assert "Induction heads vs layer-matched random heads" in summary
    assert set(induction["layer"]) == {1} and len(induction) == load_model("toy").cfg.n_heads
    assert "No matched control is possible in layer 1" in summary and not re.search(r"ratio [\d.]+x", summary)


def test_a_bug_keeps_its_traceback(monkeypatch, gpt2_dir):
    """Only UserError is a user mistake; a KeyError or RuntimeError from inside is a bug and
    must surface with its traceback, not print as a one-line 'error'."""
    import analyses.cli.report

    for bug in (KeyError("blocks.0.attn.hook_z"), RuntimeError("shape mismatch")):
        def broken(*args, bug=bug, **kwargs):
            raise bug

        monkeypatch.setattr(analyses.cli.report, "build_report", broken)
        with pytest.raises(type(bug)):
            main(["report", "--model", str(gpt2_dir), "--out", "unused"])


def test_report_on_a_byte_model_with_a_short_context(tmp_path):
    """A context shorter than the display text (48 tokens): the text is cut to fit, not refused."""
    model = GPTModel(GPTConfig(d_vocab=257, n_ctx=32, d_model=32, n_heads=4, n_layers=2, attn_only=True))
    directory = save_checkpoint(model, tmp_path / "short")
    out = tmp_path / "report"
    assert main(["report", "--model", str(directory), "--out", str(out), "--prompts", "4"]) == 0
    assert json.loads((out / "meta.json").read_text())["seq_len"] == 32
    assert (out / "figures" / "layer_map.png").read_bytes().startswith(PNG_SIGNATURE)


def test_report_draws_its_probes_once(built):
    _, drawn, _ = built
    assert len(drawn) == 1


def test_report_meta_of_the_scratch_model(scratch_report, gpt2_dir):
    meta = json.loads((scratch_report / "meta.json").read_text())
    assert {key: meta[key] for key in ("family", "impl", "weights_hash")} == provenance(load_model(gpt2_dir))
    assert meta["impl"] == "scratch" and meta["family"] == "gpt2"


@pytest.mark.parametrize("family", ["mistral", "opt"])
def test_attention_map_on_any_family_records_the_model_in_the_png(family_dir, tmp_path, family):
    """A lone PNG has no meta.json beside it: the model's record is its Description text chunk."""
    from PIL import Image

    out = tmp_path / "map.png"
    assert main(["attention-map", "--model", str(family_dir(family)), "--text", "the cat", "--out", str(out)]) == 0
    assert out.read_bytes().startswith(PNG_SIGNATURE)
    meta = json.loads(Image.open(out).text["Description"])
    assert {key: meta[key] for key in ("family", "impl", "weights_hash")} == provenance(load_model(family_dir(family)))


@pytest.mark.parametrize("command", ["report", "attention-map", "ablate", "patch"])
def test_impl_defaults_to_auto(command):
    required = {"attention-map": ["--text", "x", "--out", "x.png"], "ablate": ["--out", "o"], "patch": ["--out", "o"]}
    parser = build_parser()
    assert parser.parse_args([command, *required.get(command, [])]).impl == "auto"
    for impl in ("auto", "scratch", "transformer_lens"):
        assert parser.parse_args([command, "--impl", impl, *required.get(command, [])]).impl == impl


def test_the_page_is_self_contained_and_stores_every_heads_pattern(scratch_report, gpt2_dir):
    """No external reference (a link only to a long table's CSV beside the page), a CSP that forbids any request, CircuitsVis inlined once,
    and the stored patterns of the report's text are the model's own (to the 1/255 quantisation)."""
    page = (scratch_report / "index.html").read_text()
    assert not re.search(r'src\s*=\s*"(?!data:)', page)
    links = re.findall(r'href\s*=\s*"(?!data:|#)([^"]*)"', page)  # only the long tables' CSVs beside the page
    assert all(re.fullmatch(r"[\w.-]+\.csv", link) and (scratch_report / link).is_file() for link in links), links
    assert "default-src 'none'" in page and page.count("var CircuitsVis=") == 1 and "sourceMappingURL" not in page
    data = json.loads(re.search(r'<script type="application/json" id="report-data">(.*?)</script>', page, re.S).group(1))
    assert (data["n_layers"], data["n_heads"]) == (2, 4) and len(data["views"]) == 2
    model = load_model(gpt2_dir)
    tokens = leading_tokens(model, DISPLAY_TEXT, DISPLAY_TOKENS)
    _, cache = model.run_with_cache(tokens[None])
    text = data["views"][1]
    assert len(text["tokens"]) == len(tokens)
    stored = decode_patterns(text["patterns"], 2, 4, len(tokens))
    for layer in range(2):
        assert (stored[layer] - cache[f"blocks.{layer}.attn.hook_pattern"][0]).abs().max() <= 0.5 / 255 + 1e-6


def test_patterns_round_trip_through_the_page_encoding():
    patterns = torch.rand(3, 2, 5, 5, generator=torch.Generator().manual_seed(0)).softmax(-1).tril()
    encoded = encode_patterns(patterns)
    assert len(encoded) == 4 * -(-3 * 2 * 15 // 3)  # base64 of 15 bytes (the lower triangle) per head
    assert (decode_patterns(encoded, 3, 2, 5) - patterns).abs().max() <= 0.5 / 255 + 1e-6


def test_a_section_takes_a_few_lines(built, tmp_path):
    report = dataclasses.replace(built[0], sections=list(built[0].sections))  # the shared report's list untouched
    figure = Figure(figsize=(2, 2))
    figure.subplots().plot([0, 1])
    edges = pd.DataFrame({"sender": ["L0H1"], "receiver": ["L1H2"], "score": [0.5]})
    report.sections.append(Section("Circuit", "The **strongest** edges.",
                                   figures=[ReportFigure("circuit", "edges", png_bytes(figure))], table=edges))
    out = write_report(report, tmp_path / "report")
    markdown, page = (out / "report.md").read_text(), (out / "index.html").read_text()
    assert "## Circuit" in markdown and "![edges](figures/circuit.png)" in markdown and "| L0H1 | L1H2 | 0.500 |" in markdown
    assert '<section id="circuit">' in page and "<strong>strongest</strong>" in page and ">L1H2</td>" in page
    assert '<a href="#circuit">Circuit</a>' in page
    assert (out / "figures" / "circuit.png").read_bytes().startswith(PNG_SIGNATURE)


def test_the_head_table_shows_intervals_and_null_bands():
    table = pd.DataFrame({"layer": [0, 1], "head": [0, 0], "role": ["", "induction"], "induction": [0.1, 0.9],
                          "induction_ci_low": [0.05, 0.85], "induction_ci_high": [0.15, 0.95],
                          "ablation_effect": [0.0, 0.5]})
    plain = head_table_html(table, ["induction"], ["induction"], "t")
    assert "0.900 <span class=\"interval\">[0.85, 0.95]</span>" in plain and "null" not in plain
    banded = head_table_html(table.assign(induction_null_low=[0.01, 0.02], induction_null_high=[0.2, 0.25]),
                             ["induction"], ["induction"], "t")
    assert "null [0.02, 0.25]" in banded and 'data-roles="induction"' in banded


def test_report_writes_a_line_per_step_off_a_terminal(built):
    """Off a terminal (a captured stderr), by default, the report's step-level bar writes one
    plain line as each step begins, naming it with the count of steps done, and one when it ends."""
    total = len(ReportSteps.STEPS)
    lines = [line for line in built[2] if line.startswith("report: ")]
    expected = [f"report: {step} {done}/{total} steps (" for done, step in enumerate(ReportSteps.STEPS)]
    expected.append(f"report: {ReportSteps.STEPS[-1]} {total}/{total} steps (")
    assert [line[:line.index("(") + 1] for line in lines] == expected, lines
    assert lines[-1].endswith(" elapsed), done")


def test_report_roles_are_one_fdr_family_with_the_copying_roles(scratch_report):
    """head_roles.csv shows copying and copy suppression beside the attention roles, and every
    role's q-value is one Benjamini-Hochberg over all (head, role) p-values of the report, the
    meaning roles' included (checked against BH written out here); the role column follows them."""
    table = pd.read_csv(scratch_report / "head_roles.csv", keep_default_na=False)
    roles = [c.removesuffix("_q") for c in table.columns if c.endswith("_q")]
    assert {"induction", "previous_token", "duplicate_token", "copying", "copy_suppression"} <= set(roles)
    p = table[[f"{r}_p" for r in roles]].to_numpy().flatten()
    q = table[[f"{r}_q" for r in roles]].to_numpy().flatten()
    order = p.argsort(kind="stable")
    ranked = p[order] * len(p) / range(1, len(p) + 1)
    expected = [min(1.0, ranked[k:].min()) for k in range(len(p))]  # step-up: the smallest from each rank on
    assert q[order] == pytest.approx(expected, rel=1e-5, abs=1e-9)  # the CSV keeps 6 significant digits
    for role in ("copying", "copy_suppression"):
        named = table["role"].str.split(";").apply(lambda listed: role in listed)
        assert (named == ((table[f"{role}_q"] <= 0.05) & (table[role] >= 0.4))).all()
    markdown = (scratch_report / "report.md").read_text()
    assert all(f"- **{role}** (read from the OV circuit alone" in markdown for role in ("copying", "copy_suppression"))
