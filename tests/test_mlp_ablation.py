"""MLPs as ablation targets (issue 26.2): in sweeps, groups with heads, ``interp ablate``,
``interp patch --what mlps`` and study specs, each checked against hand-written hooks (one forward
per ablation, the replacement computed here) or TransformerLens's patching."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from analyses.cli import main
from analyses.core.metrics import loss_metric
from analyses.core.probes import corrupt_first_copy, probes_for
from analyses.interventions.ablation import MLP, ablation_sweep, prepare_ablation, resample_index
from analyses.studies.runner import run_study
from interp import GPTConfig, GPTModel, load_model
from interp.errors import UserError


def _tokens(n_batch=3, n_pos=8, seed=4):
    return torch.randint(0, 256, (n_batch, n_pos), generator=torch.Generator().manual_seed(seed))


def naive_replacement(activation: torch.Tensor, method: str) -> torch.Tensor:
    """What replaces an activation (batch, pos, ...), written out: zeros, the mean over the other
    prompts at each position, or another prompt's (the library's seeded derangement, seed 0)."""
    n = activation.shape[0]
    if method == "zero":
        return torch.zeros_like(activation)
    if method == "mean":
        return torch.stack([activation[[j for j in range(n) if j != i]].mean(0) for i in range(n)])
    return activation[resample_index(n, n, True, 0)]


def naive_value(model, tokens, metric, edits: dict) -> float:
    """The metric of one forward whose hooks write ``edits`` {hook name: (index, replacement)}."""
    def hook_for(index, replacement):
        def hook(activation, hook):
            edited = activation.clone()
            edited[(slice(None), *index)] = replacement[(slice(None), *index)]
            return edited
        return hook

    hooks = [(name, hook_for(index, replacement)) for name, (index, replacement) in edits.items()]
    with torch.no_grad():
        return metric(model.run_with_hooks(tokens, fwd_hooks=hooks)).item()


@pytest.mark.parametrize("impl", ["scratch", "bridge"])
@pytest.mark.parametrize("method", ["zero", "mean", "resample"])
def test_mlp_ablation_equals_a_naive_hook_run(impl, method, scratch_gpt2, bridge_gpt2):
    """Each MLP at every position, at each position, and an MLP ablated with a head: one forward
    per row with a hook writing the replacement, on both implementations, to 1e-5."""
    model = scratch_gpt2 if impl == "scratch" else bridge_gpt2
    tokens = _tokens()
    metric = loss_metric(tokens)
    _, cache = model.run_with_cache(tokens)
    mlp = {layer: naive_replacement(cache[f"blocks.{layer}.hook_mlp_out"], method) for layer in range(2)}
    z = naive_replacement(cache["blocks.0.attn.hook_z"], method)

    whole = ablation_sweep(model, tokens, "each_mlp", method, metric, progress=False)
    assert list(whole["target"]) == ["L0 MLP", "L1 MLP"] and whole["n_heads"].tolist() == [0, 0]
    for layer in range(2):
        expected = naive_value(model, tokens, metric, {f"blocks.{layer}.hook_mlp_out": ((), mlp[layer])})
        assert whole["metric"][layer] == pytest.approx(expected, abs=1e-5)

    by_position = ablation_sweep(model, tokens, "each_mlp_by_position", method, metric, memory_mb=1, progress=False)
    assert len(by_position) == 2 * 8 and by_position["effect"].abs().max() > 1e-4
    for layer, position in [(0, 0), (0, 5), (1, 3), (1, 7)]:
        row = by_position[(by_position["layer"] == layer) & (by_position["position"] == position)]
        assert row["target"].item() == f"L{layer} MLP@{position}"
        expected = naive_value(model, tokens, metric, {f"blocks.{layer}.hook_mlp_out": ((position,), mlp[layer])})
        assert row["metric"].item() == pytest.approx(expected, abs=1e-5)

    group = ablation_sweep(model, tokens, {"both": [(0, 2), "mlp1@6"]}, method, metric, progress=False)
    expected = naive_value(model, tokens, metric, {"blocks.0.attn.hook_z": ((slice(None), 2), z),
                                                   "blocks.1.hook_mlp_out": ((6,), mlp[1])})
    assert group["metric"].item() == pytest.approx(expected, abs=1e-5)
    assert (group["n_heads"].item(), group["n_mlps"].item()) == (1, 1) and pd.isna(group["layer"].item())


def test_mlp_ablation_with_frozen_patterns_equals_hooks(scratch_gpt2):
    """preserve_patterns with an MLP target: the later layer's patterns held at their clean values."""
    tokens = _tokens()
    metric = loss_metric(tokens)
    _, cache = scratch_gpt2.run_with_cache(tokens)
    frame = ablation_sweep(scratch_gpt2, tokens, [[MLP(0)]], "zero", metric, preserve_patterns=True, progress=False)
    edits = {"blocks.0.hook_mlp_out": ((), torch.zeros_like(cache["blocks.0.hook_mlp_out"]))}
    edits |= {f"blocks.{l}.attn.hook_pattern": ((), cache[f"blocks.{l}.attn.hook_pattern"]) for l in range(2)}
    assert frame["metric"].item() == pytest.approx(naive_value(scratch_gpt2, tokens, metric, edits), abs=1e-5)
    free = ablation_sweep(scratch_gpt2, tokens, [[MLP(0)]], "zero", metric, progress=False)
    assert abs(free["metric"].item() - frame["metric"].item()) > 1e-6  # the patterns did react


def test_mlp_patching_by_position_equals_transformer_lens_on_the_cli(tmp_path, gpt2_dir):
    """``interp patch --what mlps_by_position`` (and ``mlps``) against TransformerLens's
    ``get_act_patch_mlp_out`` on a bridge over the same weights; ``--attribution`` covers MLPs."""
    from transformer_lens import patching as tl_patching

    from analyses.interventions.attribution import attribution_patch_mlps

    bridge = load_model(str(gpt2_dir), impl="transformer_lens").eval()
    probes = probes_for(bridge, 4, 16, seed=0)
    corrupted = corrupt_first_copy(probes, seed=1)
    metric = loss_metric(probes.tokens, probes.predictable)
    _, clean_cache = bridge.run_with_cache(probes.tokens)
    theirs = tl_patching.get_act_patch_mlp_out(bridge, corrupted, clean_cache, metric).float()
    common = ["--model", str(gpt2_dir), "--prompts", "4", "--seq-len", "16", "--quiet"]
    assert main(["patch", *common, "--out", str(tmp_path / "pos"), "--what", "mlps_by_position",
                 "--attribution"]) == 0
    frame = pd.read_csv(tmp_path / "pos" / "patching.csv")
    assert list(frame.columns[:2]) == ["layer", "pos"] and len(frame) == theirs.numel()
    ours = torch.tensor(frame["metric"].to_numpy(), dtype=torch.float32).reshape(theirs.shape)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    scratch = load_model(str(gpt2_dir)).eval()
    attributed = attribution_patch_mlps(scratch, probes.tokens, corrupted, metric, by_position=True)
    torch.testing.assert_close(torch.tensor(frame["attribution"].to_numpy(), dtype=torch.float32),
                               attributed.flatten(), atol=1e-5, rtol=0)
    assert main(["patch", *common, "--out", str(tmp_path / "whole"), "--what", "mlps"]) == 0
    whole = pd.read_csv(tmp_path / "whole" / "patching.csv")
    torch.testing.assert_close(torch.tensor(whole["metric"].to_numpy(), dtype=torch.float32),
                               _whole_layer_patch(bridge, corrupted, clean_cache, metric), atol=1e-4, rtol=0)
    assert (tmp_path / "whole" / "patching.png").read_bytes()[:4] == b"\x89PNG"


def _whole_layer_patch(bridge, corrupted, clean_cache, metric) -> torch.Tensor:
    from transformer_lens import patching as tl_patching
    return tl_patching.generic_activation_patch(
        bridge, corrupted, clean_cache, metric, lambda corrupted_act, index, clean_act: clean_act,
        "mlp_out", index_axis_names=("layer",)).float()


def test_ablate_cli_mlp_targets_match_the_library(tmp_path, gpt2_dir):
    model = load_model(str(gpt2_dir)).eval()
    probes = probes_for(model, 4, 16, seed=0)
    metric = loss_metric(probes.tokens, probes.predictable)
    common = ["--model", str(gpt2_dir), "--prompts", "4", "--seq-len", "16", "--quiet", "--method", "zero"]
    assert main(["ablate", *common, "--out", str(tmp_path / "a"), "--targets", "each_mlp_by_position"]) == 0
    frame = pd.read_csv(tmp_path / "a" / "ablation.csv")
    expected = ablation_sweep(model, probes.tokens, "each_mlp_by_position", "zero", metric, progress=False)
    assert list(frame["target"]) == list(expected["target"]) and frame["position"].max() == 15
    assert frame["metric"].to_numpy() == pytest.approx(expected["metric"].to_numpy(), abs=1e-5)
    assert main(["ablate", *common, "--out", str(tmp_path / "b"), "--heads", "1.2,mlp0"]) == 0
    group = pd.read_csv(tmp_path / "b" / "ablation.csv")
    expected = ablation_sweep(model, probes.tokens, [[(1, 2), MLP(0)]], "zero", metric, progress=False)
    assert group["metric"].item() == pytest.approx(expected["metric"].item(), abs=1e-5)
    assert (group["n_heads"].item(), group["n_mlps"].item()) == (1, 1)
    assert main(["ablate", *common, "--out", str(tmp_path / "c"), "--heads", "1.2,mlpx"]) == 2


def test_study_with_mlp_targets_names_them_and_equals_the_library(tmp_path, gpt2_dir):
    spec = tmp_path / "spec.toml"
    spec.write_text(f"""
[model]
spec = "{gpt2_dir}"
impl = "scratch"
[prompts]
n = 4
seq_len = 16
[ablation]
method = "mean"
targets = [[1, 2], "mlp0", "mlp1@9"]
""")
    frame = pd.read_csv(run_study(spec, tmp_path / "out", progress=False))
    assert list(frame["target"]) == ["L1H2", "L0 MLP", "L1 MLP@9", "group"]
    assert frame["n_heads"].tolist() == [1, 0, 0, 1] and frame["head"].isna().tolist() == [False, True, True, True]
    assert frame["layer"].tolist()[:3] == [1, 0, 1]
    model = load_model(str(gpt2_dir)).eval()
    probes = probes_for(model, 4, 16, seed=0)
    expected = ablation_sweep(model, probes, [[(1, 2)], ["mlp0"], ["mlp1@9"], [(1, 2), "mlp0", "mlp1@9"]], "mean",
                              loss_metric(probes.tokens, probes.predictable), progress=False)
    assert frame["metric"].to_numpy() == pytest.approx(expected["metric"].to_numpy(), abs=1e-6)

    grid = tmp_path / "grid.toml"
    grid.write_text(spec.read_text().replace('targets = [[1, 2], "mlp0", "mlp1@9"]',
                                             'targets = ["each_mlp", ["mlp1"]]'))
    cells = pd.read_csv(run_study(grid, tmp_path / "grid", progress=False))
    assert list(cells["cell"].unique()) == ["targets=each_mlp", 'targets=["mlp1"]']
    assert list(cells["target"]) == ["L0 MLP", "L1 MLP", "L1 MLP"]
    assert cells["metric"].iloc[1] == cells["metric"].iloc[2]


@pytest.mark.parametrize("targets, message", [
    ('["mlp"]', r"\[ablation\].targets is 'mlp'; allowed"),
    ('["mlp2"]', r"\[ablation\].targets: MLP 2 out of range"),
    ('["mlp1@16"]', r"\[ablation\].targets: MLP 1 at position 16"),
    ('"each_mlps"', r"\[ablation\].targets is 'each_mlps'"),
])
def test_study_mlp_targets_are_checked_in_one_line(tmp_path, gpt2_dir, targets, message):
    spec = tmp_path / "spec.toml"
    spec.write_text(f'[model]\nspec = "{gpt2_dir}"\nimpl = "scratch"\n[prompts]\nn = 4\nseq_len = 16\n'
                    f'[ablation]\nmethod = "zero"\ntargets = {targets}\n')
    with pytest.raises(UserError, match=message) as error:
        run_study(spec, tmp_path / "out", progress=False)
    assert "\n" not in str(error.value)


def test_bad_mlp_targets_are_refused(scratch_gpt2):
    tokens = _tokens()
    for targets, message in [([["mlp9"]], "MLP 9 out of range"), ([["mlp0@8"]], "position 8"),
                             ([["attn0"]], "a component is a"), ("each_mlps", "unknown targets")]:
        with pytest.raises(UserError, match=message):
            ablation_sweep(scratch_gpt2, tokens, targets, progress=False)
    ablation = prepare_ablation(scratch_gpt2, tokens)  # heads only
    with pytest.raises(UserError, match="mlps=True"):
        ablation.run([[MLP(0)]])
    attention_only = GPTModel(GPTConfig(d_vocab=300, n_ctx=16, d_model=16, n_heads=2, n_layers=1, attn_only=True))
    with pytest.raises(UserError, match="attention-only"):
        ablation_sweep(attention_only, tokens, "each_mlp", progress=False)
