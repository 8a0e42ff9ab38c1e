"""``interp compare A B`` and scores over training: the embedded model's early checkpoint against
its final weights (its previous-token and induction heads appear), paired intervals, the two GPT-2
backends on the same weights, a naive Jensen-Shannon divergence, one-line errors, same bytes."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pandas as pd
import pytest
import torch
from matplotlib.figure import Figure

import analyses.cli
from analyses.roles.classify import MEASURES, classify_heads
from analyses.report.compare import (checkpoint_step, compare_models, js_divergence, pattern_divergence,
                              scores_over_training, training_figure)
from interp import load_model, provenance
from interp.random_models import make_random_gpt2
from interp.loading import embedded_checkpoints

EARLY = embedded_checkpoints()[200]  # the shipped checkpoint of the embedded model's run, before its phase change


@pytest.fixture(scope="module", autouse=True)
def compare_command():
    """``interp compare`` on the CLI, whether or not analyses.cli lists it yet."""
    with pytest.MonkeyPatch.context() as patch:
        if "analyses.cli.compare" not in analyses.cli._COMMANDS:
            patch.setattr(analyses.cli, "_COMMANDS", [*analyses.cli._COMMANDS, "analyses.cli.compare"])
        yield


def compare(a, b, out: Path, *extra: str) -> pd.DataFrame:
    assert analyses.cli.main(["compare", str(a), str(b), "--prompts", "8", "--out", str(out), *extra]) == 0
    return pd.read_csv(out / "heads.csv", keep_default_na=False)


@pytest.fixture(scope="module")
def toy_compare(tmp_path_factory):
    out = tmp_path_factory.mktemp("compare")
    return out, compare(EARLY, "toy", out)


def heads_with(table: pd.DataFrame, column: str, role: str) -> list[tuple[int, int]]:
    return [(int(r.layer), int(r.head)) for r in table.itertuples() if role in getattr(r, column).split(";")]


def test_early_to_final_checkpoint_shows_the_heads_appearing(toy_compare):
    out, table = toy_compare
    assert heads_with(table, "role_a", "previous_token") == [] and heads_with(table, "role_a", "induction") == []
    gained_previous = heads_with(table, "gained", "previous_token")
    gained_induction = heads_with(table, "gained", "induction")
    assert [layer for layer, _ in gained_previous] == [0]  # the layer-0 previous-token head
    assert len(gained_induction) >= 4 and {layer for layer, _ in gained_induction} == {1}
    for layer, head in gained_induction:
        row = table[(table["layer"] == layer) & (table["head"] == head)].iloc[0]
        assert row["induction_delta_ci_low"] > 0.3 and row["divergence"] > 0.3
    # the previous-token head carries the induction circuit: ablating it hurts far more at the end
    assert table.loc[table["previous_token_delta"].idxmax(), "ablation_effect_delta"] > 1.0
    summary = (out / "report.md").read_text()
    assert "**induction** gained: L1H" in summary and "**previous_token** gained: L0H" in summary


def test_deltas_are_b_minus_a_with_paired_intervals_and_the_scores_are_classify_heads(toy_compare):
    _, table = toy_compare
    for measure in MEASURES:
        delta = table[f"{measure}_b"] - table[f"{measure}_a"]
        assert (table[f"{measure}_delta"] - delta).abs().max() < 1e-5
        assert ((table[f"{measure}_delta_ci_low"] <= delta + 1e-5) & (delta - 1e-5 <= table[f"{measure}_delta_ci_high"])).all()
    final = classify_heads(load_model("toy"), n_prompts=8, seed=0, progress=False)
    induction = final[final["measure"] == "induction"].sort_values(["layer", "head"])
    assert (table["induction_b"].to_numpy() - induction["score"].to_numpy()).__abs__().max() < 1e-5
    assert (table["ablation_effect_delta"] - (table["ablation_effect_b"] - table["ablation_effect_a"])).abs().max() < 1e-5


def test_the_directory_records_both_models_and_is_byte_stable(toy_compare, tmp_path):
    out, _ = toy_compare
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == [
        "figures", "figures/score_changes.png", "heads.csv", "index.html", "meta.json", "report.md"]
    meta = json.loads((out / "meta.json").read_text())
    for key, spec in (("a", EARLY), ("b", "toy")):
        assert meta[key]["model"] == str(spec)
        assert {k: meta[key][k] for k in ("family", "impl", "weights_hash")} == provenance(load_model(spec))
    page = (out / "index.html").read_text()
    assert 'id="head-grid"' in page and 'src="http' not in page and "default-src 'none'" in page
    again = tmp_path / "again"
    compare(EARLY, "toy", again)
    for path in sorted(out.rglob("*.*")):
        assert (again / path.relative_to(out)).read_bytes() == path.read_bytes(), path.name


def test_a_model_against_itself_changes_nothing(scratch_gpt2):
    comparison = compare_models(scratch_gpt2, scratch_gpt2, n_prompts=4, seq_len=32, progress=False)
    table = comparison.table
    numeric = [f"{m}{s}" for m in MEASURES for s in ("_delta", "_delta_ci_low", "_delta_ci_high")]
    assert table[numeric + ["divergence", "ablation_effect_delta"]].abs().max().max() < 1e-6
    assert (table["change"] == "").all() and (table["role_a"] == table["role_b"]).all()


def test_both_gpt2_backends_give_the_same_comparison(tmp_path, gpt2_dir):
    model, tokenizer = make_random_gpt2(n_layers=2, d_model=64, n_heads=4, n_ctx=64, seed=5)
    other = tmp_path / "other"
    model.save_pretrained(other)
    tokenizer.save_pretrained(other)
    ours = compare(gpt2_dir, other, tmp_path / "scratch", "--impl", "scratch")
    theirs = compare(gpt2_dir, other, tmp_path / "bridge", "--impl", "transformer_lens")
    numeric = [c for c in ours.columns if ours[c].dtype.kind == "f"]
    assert (ours[numeric] - theirs[numeric]).abs().max().max() < 1e-4
    assert ours["divergence"].min() > 1e-5  # two random models attend near-uniformly, yet not identically


def test_js_divergence_matches_a_naive_computation():
    generator = torch.Generator().manual_seed(0)
    p, q = (torch.rand(3, 5, generator=generator).softmax(-1) for _ in range(2))
    p[0] = torch.tensor([1.0, 0, 0, 0, 0])  # zeros are fine (0 log 0 = 0)
    q[0] = torch.tensor([0, 1.0, 0, 0, 0])  # disjoint -> 1 bit

    def naive(a, b):
        m = [(x + y) / 2 for x, y in zip(a, b)]
        kl = lambda u: sum(x * math.log2(x / z) for x, z in zip(u, m) if x > 0)  # noqa: E731
        return (kl(a) + kl(b)) / 2

    expected = torch.tensor([naive(a.tolist(), b.tolist()) for a, b in zip(p, q)])
    assert torch.allclose(js_divergence(p, q), expected, atol=1e-6) and abs(float(expected[0]) - 1.0) < 1e-9


def test_pattern_divergence_averages_over_rows_after_the_first():
    """Against a copy whose queries are zero (every head attends uniformly over the prefix), the
    divergence is a naive loop's mean over prompts and query rows i >= 1 of JS(pattern row, uniform)."""
    model = load_model("toy")
    tokens = torch.randint(0, model.cfg.d_vocab, (2, 6), generator=torch.Generator().manual_seed(1))
    assert pattern_divergence(model, model, tokens).abs().max() < 1e-6
    uniform_model = copy.deepcopy(model)
    with torch.no_grad():
        for name, param in uniform_model.named_parameters():
            if ".W_query." in name:
                param.zero_()
    _, cache = model.run_with_cache(tokens)
    expected = torch.zeros(2, 8)
    for layer in range(2):
        pattern = cache[f"blocks.{layer}.attn.hook_pattern"]
        for head in range(8):
            rows = [js_divergence(pattern[b, head, i, : i + 1], torch.full((i + 1,), 1.0 / (i + 1)))
                    for b in range(2) for i in range(1, 6)]
            expected[layer, head] = sum(rows) / len(rows)
    ours = pattern_divergence(model, uniform_model, tokens)
    assert ours.shape == (2, 8) and (ours - expected).abs().max() < 1e-5 and expected.min() > 0.05


def test_shape_mismatch_is_one_line(gpt2_dir, capsys, tmp_path):
    assert analyses.cli.main(["compare", "toy", str(gpt2_dir), "--out", str(tmp_path / "x")]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("interp compare: error: the models differ in shape")
    assert "n_heads 8 vs 4" in errors[0]
    assert not (tmp_path / "x").exists()


def test_scores_over_training_follow_each_head():
    steps = [checkpoint_step(EARLY, 0), checkpoint_step("toy", 1) * 1200]
    assert steps == [200, 1200]
    models = [load_model(EARLY), load_model("toy")]
    frame = scores_over_training(models, steps, n_prompts=8, progress=False)
    assert set(frame["step"]) == {200, 1200} and len(frame) == 2 * len(MEASURES) * 16
    for step, model in zip(steps, models):
        direct = classify_heads(model, n_prompts=8, seed=0, progress=False)
        mine = frame[frame["step"] == step].drop(columns="step").reset_index(drop=True)
        assert (mine["score"] - direct["score"]).abs().max() < 1e-6
    induction = frame[frame["measure"] == "induction"].pivot(index=["layer", "head"], columns="step", values="score")
    assert (induction.loc[1, 1200] - induction.loc[1, 200] > 0.5).sum() >= 4
    figure = training_figure(frame)
    assert isinstance(figure, Figure) and [ax.get_title() for ax in figure.axes] == ["previous token", "induction"]
