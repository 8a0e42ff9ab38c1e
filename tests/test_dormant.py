"""Dormant heads and redundancy: heads with zeroed weights called dormant, a high-scoring head whose
output never reaches the logits shown as "no detectable effect", output norms and similarities against
hand computations and across backends, the clustering on a hand-made matrix, and the whole
calibration section on every family and both implementations."""

from __future__ import annotations

import copy

import pandas as pd
import pytest
import torch
from matplotlib.figure import Figure

from analyses.report.calibration_figures import calibration_section
from analyses.roles.calibration import CalibrationOptions, calibration_frames
from analyses.core.hook_check import left_out
from analyses.roles.backup import direct_effect_needs
from analyses.roles.causal_check import ablation_effects
from analyses.roles.classify import NO_EFFECT, classify_heads, head_table
from analyses.roles.dormant import clustered, dormant_heads, head_similarities, output_norms
from analyses.core.metrics import loss_metric
from analyses.roles.nulls import calibrate_roles
from analyses.core.plots import png_bytes
from analyses.core.probes import probes_for
from interp import load_model
from interp.random_models import FAMILIES


@pytest.fixture(scope="module")
def toy():
    return load_model("toy")


def silenced(model, layer: int, head: int, where: str):
    """A copy of the toy model with one head's output projection (``where="W_O"``) or value
    weights (``"W_V"``) zeroed."""
    model = copy.deepcopy(model)
    attn, width = model.blocks[layer].attn, model.cfg.d_head
    cols = slice(head * width, (head + 1) * width)
    with torch.no_grad():
        if where == "W_O":
            attn.out_proj.weight[:, cols] = 0
        else:
            attn.W_value.weight[cols] = 0
            attn.W_value.bias[cols] = 0
    return model


@pytest.mark.parametrize("layer, head, where", [(0, 5, "W_O"), (1, 7, "W_V")])
def test_a_head_with_zero_weights_is_dormant(toy, layer, head, where):
    model = silenced(toy, layer, head, where)
    probes = probes_for(model, 16, seed=1)
    frame = dormant_heads(model, probes, "mean_aligned", loss_metric(probes.tokens, probes.predictable),
                          progress=False).set_index(["layer", "head"])
    assert frame.loc[(layer, head), "output_norm"] == pytest.approx(0.0, abs=1e-6)
    assert frame.loc[(layer, head), "dormant"] and frame.loc[(layer, head), "no_op"]
    assert frame["dormant"].sum() == 1  # the toy's other heads all write something


def test_high_pattern_score_without_output_is_no_causal_effect(toy):
    """The toy's previous-token head L0H3 with its output projection zeroed: it still attends to
    i - 1 (role kept), but ablating it changes nothing, and the table says so."""
    model = silenced(toy, 0, 3, "W_O")
    probes = probes_for(model, 32, seed=2)
    scores = classify_heads(model, probes=probes, n_boot=50, progress=False)
    table = head_table(scores, ablation_effects(model, probes, progress=False),
                       calibration=calibrate_roles(model, probes, progress=False)).set_index(["layer", "head"])
    assert table.loc[(0, 3), "previous_token"] > 0.9 and "previous_token" in table.loc[(0, 3), "role"]
    assert table.loc[(0, 3), "ablation_effect"] == pytest.approx(0.0, abs=1e-6)
    assert table.loc[(0, 3), "causal"] == NO_EFFECT
    intact = head_table(scores, ablation_effects(toy, probes, progress=False)).set_index(["layer", "head"])
    assert intact.loc[(0, 3), "causal"] == ""


def test_output_norms_by_hand_and_across_backends(scratch_gpt2, bridge_gpt2):
    tokens = torch.randint(0, 256, (3, 10), generator=torch.Generator().manual_seed(2))
    frame = output_norms(scratch_gpt2, tokens)
    with torch.no_grad():
        _, cache = scratch_gpt2.run_with_cache(tokens)
        for row in frame.itertuples():
            z = cache[f"blocks.{row.layer}.attn.hook_z"][:, :, row.head]  # (batch, pos, d_head)
            weight = scratch_gpt2.blocks[row.layer].attn.out_proj.weight  # (d_model, n_heads * d_head)
            cols = slice(row.head * 16, (row.head + 1) * 16)
            assert row.output_norm == pytest.approx((z @ weight[:, cols].T).norm(dim=-1).mean().item(), rel=1e-5)
    layer_means = frame.groupby("layer")["output_norm"].transform("mean")
    assert (frame["relative_norm"] - frame["output_norm"] / layer_means).abs().max() < 1e-9
    assert (output_norms(bridge_gpt2, tokens)["output_norm"] - frame["output_norm"]).abs().max() < 1e-4


def test_similarities_by_hand_and_across_backends(scratch_gpt2, bridge_gpt2):
    tokens = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(3))
    ours, theirs = head_similarities(scratch_gpt2, tokens), head_similarities(bridge_gpt2, tokens)
    with torch.no_grad():
        _, cache = scratch_gpt2.run_with_cache(tokens)
    a = cache["blocks.0.attn.hook_pattern"][:, 1].flatten()
    b = cache["blocks.1.attn.hook_pattern"][:, 2].flatten()
    pattern = ours["pattern"]
    i, j = pattern.labels.index("L0H1"), pattern.labels.index("L1H2")
    assert pattern.matrix[i, j].item() == pytest.approx(torch.nn.functional.cosine_similarity(a, b, dim=0).item(), abs=1e-5)
    for kind in ("output", "pattern"):
        matrix = ours[kind].matrix
        torch.testing.assert_close(matrix, matrix.T)
        torch.testing.assert_close(matrix.diagonal(), torch.ones(8, dtype=torch.double))
        assert ours[kind].labels == theirs[kind].labels
        assert (ours[kind].matrix - theirs[kind].matrix).abs().max() < 1e-4


def test_clustering_orders_and_cuts_a_hand_made_matrix():
    # heads 0, 2, 4 alike, 1 and 3 alike, 5 alone
    s = torch.eye(6, dtype=torch.double)
    for group, value in (((0, 2, 4), 0.9), ((1, 3), 0.8)):
        for i in group:
            for j in group:
                if i != j:
                    s[i, j] = value
    result = clustered(s, [f"h{i}" for i in range(6)], similar_above=0.5)
    groups = {}
    for label, cluster in zip(result.labels, result.clusters):
        groups.setdefault(cluster, set()).add(label)
    assert sorted(map(sorted, groups.values())) == [["h0", "h2", "h4"], ["h1", "h3"], ["h5"]]
    runs = [result.clusters[i] for i in range(6)]
    assert runs == sorted(runs)  # each cluster is one contiguous block of the order
    assert result.matrix[0, 1].item() == s[int(result.labels[0][1]), int(result.labels[1][1])].item()


def test_calibration_section_of_the_embedded_model(toy):
    probes = probes_for(toy, 16, seed=0)
    section = calibration_section(toy, probes, progress=False)
    assert {"calibration", "pairs", "groups", "effects", "dormant", "output_clusters", "pattern_clusters"} <= set(section.frames)
    assert set(section.figures) == {"null_bands", "backup", "self_repair", "dormant", "similarity"}
    assert set(section.captions) == set(section.figures)
    for figure in section.figures.values():
        assert isinstance(figure, Figure) and png_bytes(figure).startswith(b"\x89PNG")
    for name, figure in section.figures.items():  # laid out once: drawing again gives the same bytes
        assert png_bytes(figure) == png_bytes(figure), name
    # the toy's induction heads are superadditive in pairs, but none writes more when another is
    # ablated (Wang et al.'s test of backup): pairs, no groups
    pairs = section.frames["pairs"]
    assert (pairs["a"] == "L1H5").any() or (pairs["b"] == "L1H5").any()
    assert (pairs["excess_ci_low"] > 0).any() and not pairs["compensates"].any()
    assert section.frames["groups"].empty


def loadable():
    for family in FAMILIES:
        for impl in ("scratch", "transformer_lens"):
            if not (impl == "scratch" and family in ("opt", "gpt_neo")):  # no from-scratch model of these
                yield family, impl


@pytest.mark.parametrize("family, impl", list(loadable()))
def test_calibration_frames_on_every_family(family, impl, family_dir):
    """Nulls, direct and total effects, dormant heads and similarities run on every family and
    both implementations (the figures are drawn from these frames alone, tested above)."""
    model = load_model(family_dir(family), impl=impl)
    probes = probes_for(model, 6, 24, seed=0)
    # the heads' direct effects where the plan keeps them: not on a Gemma bridge, whose rerun would
    # recompute the norm on the attention output (the report leaves them out and says so)
    direct = not left_out(model, {"direct effects": direct_effect_needs(model)})
    assert direct == (impl == "scratch" or family not in ("gemma2", "gemma3_text"))
    frames, similarities = calibration_frames(model, probes, null_seeds=(1, 2), pair_heads=3, progress=False,
                                              direct=direct)
    n_heads = model.cfg.n_layers * model.cfg.n_heads
    for name in ("calibration", "effects", "dormant"):
        numbers = frames[name].select_dtypes("number")
        unmeasured = [c for c in numbers if c.startswith(("direct", "self_repair"))] if not direct else []
        assert len(frames[name]) >= n_heads and numbers.drop(columns=unmeasured).notna().all().all()
        assert numbers[unmeasured].isna().all().all()
    assert not frames["calibration"]["significant"].any()  # a random model: no role
    assert all(len(s.labels) == n_heads for s in similarities.values())


def test_calibration_options_as_an_object_or_as_keywords_give_the_same_tables(toy):
    probes = probes_for(toy, 8, seed=0)
    options = CalibrationOptions(null_seeds=(1, 2), pair_heads=2, intervention_prompts=4, progress=False)
    by_object, _ = calibration_frames(toy, probes, options)
    by_keywords, _ = calibration_frames(toy, probes, null_seeds=(1, 2), pair_heads=2, intervention_prompts=4,
                                        progress=False)
    assert by_object.keys() == by_keywords.keys()
    for name, frame in by_object.items():
        pd.testing.assert_frame_equal(frame, by_keywords[name])
    with pytest.raises(TypeError, match="pair_head"):
        calibration_frames(toy, probes, options, pair_head=3)
