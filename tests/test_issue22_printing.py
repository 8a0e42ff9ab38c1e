"""Issue 22, item 7: numbers that printed wrong.

- p-values far below 1e-16 came out exactly 0 (the tail was 1 minus a number that rounds to 1);
  they are computed in log space now, checked against mpmath's incomplete beta function at 60
  digits, and written to the report's CSV with significant digits;
- a token such as ``<!--`` followed by ``<script`` in the page's embedded JSON made the HTML
  parser run past the end of its <script> element;
- ``interp attention-map`` on a long text drew a figure past matplotlib's image size limit;
- ``.to(torch.bfloat16)`` rounded the rotary frequencies and ALiBi slopes to bfloat16.
"""

from __future__ import annotations

import json
import re

import mpmath
import pandas as pd
import pytest
import torch

from analyses.components.rollout import all_patterns
from analyses.report.attention_map import attention_map
from analyses.roles.nulls import RoleSamples, layer_null, role_nulls, t_upper_tail
from analyses.roles.classify import ROLES
from analyses.core.plots import DPI
from analyses.report.page import PatternView, explorer_data, explorer_html, write_report_files
from interp import GPTConfig, GPTModel
from interp.attention import alibi_slopes

mpmath.mp.dps = 60


def mp_upper_tail(t: float, dof: int) -> mpmath.mpf:
    """P(T >= t) = I_x(dof/2, 1/2) / 2 with x = dof / (dof + t^2), by mpmath at 60 digits."""
    x = mpmath.mpf(dof) / (dof + mpmath.mpf(t) ** 2)
    tail = mpmath.betainc(mpmath.mpf(dof) / 2, mpmath.mpf(1) / 2, 0, x, regularized=True) / 2
    return tail if t >= 0 else 1 - tail


# ---------------------------------------------------------------------------------- p-values
@pytest.mark.parametrize("dof", [1, 2, 3, 7, 35, 63, 400])
def test_the_t_tail_is_right_down_to_the_smallest_double(dof):
    t = [-30.0, -2.0, -0.3, 0.0, 0.3, 1.0, 1.7, 1.8, 2.5, 4.0, 8.0, 40.0, 1e3, 1e6, 1e12, 1e30]
    got = t_upper_tail(torch.tensor(t, dtype=torch.double), dof)
    for value, tail in zip(t, got.tolist()):
        expected = mp_upper_tail(value, dof)
        if expected < mpmath.mpf("1e-300"):
            continue  # below float64's range: p is 0 there, its log is in log10_p
        assert tail > 0 and abs(tail - float(expected)) <= 1e-11 * float(expected), (value, tail, float(expected))


def test_a_head_far_above_its_null_gets_its_tiny_p_and_log10_p():
    """One head's score 0.9 against a random-init null of mean 0.1 and spread ~1e-3: z in the
    hundreds, p far below 1e-300; p's log is still right."""
    n_prompts, seeds = 8, 3
    sums = {role: torch.full((n_prompts, 1, 2), 0.1, dtype=torch.double) for role in ROLES}
    sums["previous_token"][:, 0, 0] = 0.9
    counts = {role: torch.ones(n_prompts, dtype=torch.double) for role in ROLES}
    null = torch.tensor([[[0.100, 0.101]], [[0.099, 0.1005]], [[0.1012, 0.0991]]], dtype=torch.double)
    frame = role_nulls(RoleSamples(sums, counts), {role: null for role in ROLES}, None)
    row = frame[(frame["role"] == "previous_token") & (frame["head"] == 0)].iloc[0]
    center, spread, dof = layer_null(null)  # the null the frame's z and p use (tested in test_nulls)
    z = (0.9 - center.item()) / spread.item()
    expected = mp_upper_tail(z, int(dof.item()))
    assert row["z"] == pytest.approx(z, rel=1e-12)
    assert row["log10_p"] == pytest.approx(float(mpmath.log10(expected)), rel=1e-9)
    assert row["p"] == pytest.approx(float(expected), rel=1e-9)  # 0 only where expected < 1e-308


def test_the_head_table_csv_writes_small_p_values_with_their_digits(tmp_path):
    table = pd.DataFrame({"layer": [0, 0], "head": [0, 1], "induction": [0.912345678, 0.1],
                          "induction_p": [4.1195224e-31, 0.25], "induction_q": [8.2e-31, 0.5]})
    write_report_files(tmp_path, "t", "s", [], {}, {"head_roles.csv": table})
    rows = (tmp_path / "head_roles.csv").read_text().splitlines()
    assert rows[1] == "0,0,0.912346,4.11952e-31,8.2e-31"
    assert rows[2] == "0,1,0.100000,0.25,0.5"
    back = pd.read_csv(tmp_path / "head_roles.csv")
    assert back["induction_p"][0] == pytest.approx(4.1195224e-31, rel=1e-5)


# ---------------------------------------------------------------------------- embedded JSON
HOSTILE_TOKENS = ["<bos>", "<!--", "<script", ">", " a", "</script>", "&amp;", "\u2028", "-->", "<\\/"]


def _page_json(page: str) -> str:
    start = page.index('id="report-data">') + len('id="report-data">')
    return page[start:page.index("</script>", start)]


def test_no_token_can_break_the_pages_embedded_json():
    n = len(HOSTILE_TOKENS)
    patterns = torch.tril(torch.ones(1, 2, n, n)) / torch.arange(1, n + 1)[:, None]
    table = pd.DataFrame({"layer": [0, 0], "head": [0, 1], "induction": [0.5, 0.25], "role": ["", ""]})
    data = explorer_data(table, ["induction"], ["induction"], [PatternView("text", HOSTILE_TOKENS, patterns)],
                         (0, 0), "induction")
    page = explorer_html(data, "hint")
    payload = _page_json(page)
    assert not set(payload) & set("<>&") and payload.isascii()
    assert json.loads(payload) == data  # what JSON.parse reads: the tokens as they were
    assert page.endswith("</script>") and page.count("</script>") == 1


# ---------------------------------------------------------------------------- attention map
def test_an_attention_map_of_a_long_text_stays_within_the_image_size_limit():
    torch.manual_seed(0)
    model = GPTModel(GPTConfig(d_vocab=300, n_ctx=2048, d_model=32, n_heads=4, n_layers=1)).eval()
    text = "the cat sat on the mat. " * 46  # 1105 tokens with the start token
    figure = attention_map(model, text, 0)
    assert max(figure.get_size_inches()) * DPI < 2 ** 16  # matplotlib refuses to draw 2 ** 16 pixels
    title = figure._suptitle.get_text()
    shown = int(re.search(r"the first (\d+) of the text's 1105 tokens", title).group(1))
    assert 16 <= shown < 1105
    image = torch.tensor(figure.axes[0].images[0].get_array())
    full = all_patterns(model, model.to_tokens(text)[0])[0, 0]
    torch.testing.assert_close(image.float(), full[:shown, :shown].float())


# -------------------------------------------------------------------------- float32 buffers
def test_rotary_frequencies_and_alibi_slopes_stay_float32_in_bfloat16():
    cfg = dict(d_vocab=300, n_ctx=8192, d_model=64, n_heads=4, n_layers=1)
    rotary = GPTModel(GPTConfig(**cfg, positional_embedding_type="rotary")).to(torch.bfloat16)
    module = rotary.blocks[0].attn.rotary
    assert rotary.blocks[0].attn.W_query.weight.dtype == torch.bfloat16 and module.inv_freq.dtype == torch.float32
    cos, sin = module.cos_sin(4000, 1, like=torch.zeros(1))
    inv_freq = 1.0 / 10_000.0 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16)  # float64, by hand
    angle = 4000 * inv_freq
    error = torch.atan2(sin[0, :8].double(), cos[0, :8].double()) - torch.atan2(angle.sin(), angle.cos())
    assert error.abs().max() < 1e-3  # in bfloat16 frequencies: 1.75 rad

    # 12 heads: the last four slopes are 2 ** -0.5, 2 ** -1.5, ... (BLOOM's series for 16), not
    # powers of two, which bfloat16 would round
    alibi = GPTModel(GPTConfig(**cfg | dict(n_heads=12, d_model=48), positional_embedding_type="alibi"))
    slopes = alibi.to(torch.bfloat16).blocks[0].attn.alibi_slopes
    expected = torch.tensor([2.0 ** -(k / 1) for k in range(1, 9)] + [2.0 ** -(k / 2) for k in (1, 3, 5, 7)])
    assert slopes.dtype == torch.float32 and torch.equal(slopes, alibi_slopes(12))
    torch.testing.assert_close(slopes, expected, rtol=1e-7, atol=0)
    back = alibi.to(torch.float32).blocks[0].attn.alibi_slopes  # and back: nothing was rounded on the way
    assert torch.equal(back, alibi_slopes(12))


# -------------------------------------------------------------------------- empty ablation
def test_nothing_ablated_reads_back_as_an_effect_of_exactly_zero(tmp_path):
    """Step 0 of a pruning curve ablates nothing: its metric is the baseline, in the table and in
    the CSV a reader computes the effect from (float32 metrics beside a float64 baseline printed
    4.949646 against 4.94964599609375: an effect of ~4e-9)."""
    from analyses.interventions.ablation import ablation_sweep, pruning_curve
    from analyses.report.intervention_figures import save_csv
    from analyses.core.probes import probes_for
    from interp import load_model

    model = load_model("toy")
    probes = probes_for(model, 6, 32, seed=0)
    curve = pruning_curve(model, probes, "zero", progress=False)
    assert curve["effect"].iloc[0] == 0.0 and curve["metric"].iloc[0] == curve["baseline"].iloc[0]
    back = pd.read_csv(save_csv(curve, tmp_path / "curve.csv"))
    assert (back["metric"] - back["baseline"]).iloc[0] == 0.0
    assert (back["metric"] - back["baseline"]).tolist() == back["effect"].tolist()  # each effect as printed
    sweep = ablation_sweep(model, probes, {"none": [], "L0H0": [(0, 0)]}, "zero", progress=False)
    back = pd.read_csv(save_csv(sweep, tmp_path / "sweep.csv"))
    assert (back["metric"] - back["baseline"]).tolist() == back["effect"].tolist() and back["effect"][0] == 0.0


# ------------------------------------------------------------ figures of every head (item 8)
def test_figures_of_every_head_of_a_large_model_stay_within_the_image_size_limit():
    """The calibration figures grew 0.2 inch per head: 1700 heads (a 13B model has 1600, a 70B one
    5120) drew past matplotlib's 2 ** 16 pixels. Past MAX_INCHES the heads' labels are left out."""
    from analyses.report.calibration_figures import dormant_figure, null_band_figure, similarity_figure
    from analyses.roles.dormant import Similarity

    n_layers, n_heads = 34, 50
    layer, head = torch.meshgrid(torch.arange(n_layers), torch.arange(n_heads), indexing="ij")
    heads = pd.DataFrame({"layer": layer.flatten().numpy(), "head": head.flatten().numpy()})
    scores = torch.rand(len(heads), generator=torch.Generator().manual_seed(0)).numpy()
    calibration = heads.assign(role="induction", score=scores, null_low=0.1, null_high=0.3, significant=scores > 0.3)
    dormant = heads.assign(relative_norm=scores * 2, no_op=scores < 0.05)
    labels = [f"L{l}H{h}" for l, h in heads.itertuples(index=False)]
    similarity = Similarity(labels, torch.eye(len(labels)), list(range(len(labels))))
    figures = {"null_bands": null_band_figure(calibration), "dormant": dormant_figure(dormant),
               "similarity": similarity_figure({"output": similarity, "pattern": similarity})}
    for name, figure in figures.items():
        assert max(figure.get_size_inches()) * DPI <= 10_000, name
    assert "too many to label" in figures["dormant"].axes[0].get_xlabel()
    assert "labels left out" in figures["similarity"].axes[0].get_title()


def test_a_text_file_line_with_a_comment_and_a_script_tag_leaves_the_report_page_whole(tmp_path):
    from analyses.cli import main

    texts = tmp_path / "texts.txt"
    texts.write_text("the cat sat <!--<script>alert(1)</script> on the mat & the rug\n", encoding="utf-8")
    out = tmp_path / "report"
    assert main(["report", "--model", "toy", "--prompts", "4", "--seq-len", "24", "--text-file", str(texts),
                 "--out", str(out)]) == 0
    page = (out / "index.html").read_text(encoding="utf-8")
    payload = _page_json(page)
    assert not set(payload) & set("<>&")
    shown = "".join(json.loads(payload)["views"][1]["tokens"])
    assert "<!--<script>alert(1)</script>" in shown.replace("\u2423", " ")
    assert "<!--" not in page  # nothing in the page can open a comment inside a script
