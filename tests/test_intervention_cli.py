"""``interp ablate``, ``interp patch`` and ``interp study run`` end to end on a local GPT-2 directory:
every CSV checked against the library call it stands for, or a computation by hand."""

from __future__ import annotations

import json
import re

import pandas as pd
import pytest
import torch
import torch.nn.functional as F

from analyses.interventions.ablation import ablation_sweep, pruning_curve
from analyses.interventions.attribution import attribution_patch_heads, shortlist_patch_heads
from analyses.cli import main
from analyses.core.metrics import loss_metric
from analyses.interventions.patching import patch_heads, patch_patterns, patch_residual
from analyses.core.probes import corrupt_first_copy, probes_for
from interp import load_model, provenance
from interp.tokenizer import as_tokenizer, encode_texts


def common(gpt2_dir, out):
    return ["--model", str(gpt2_dir), "--prompts", "4", "--seq-len", "16", "--out", str(out), "--quiet"]


@pytest.fixture(scope="module")
def model(gpt2_dir):
    return load_model(str(gpt2_dir)).eval()


@pytest.fixture(scope="module")
def probes(model):
    return probes_for(model, 4, 16, seed=0)


def column(frame: pd.DataFrame, name: str) -> torch.Tensor:
    return torch.tensor(frame[name].to_numpy(), dtype=torch.float32)


def test_ablate_each_head_matches_the_library(tmp_path, gpt2_dir, model, probes):
    assert main(["ablate", *common(gpt2_dir, tmp_path), "--method", "zero"]) == 0
    frame = pd.read_csv(tmp_path / "ablation.csv")
    metric = loss_metric(probes.tokens, probes.predictable)
    expected = ablation_sweep(model, probes.tokens, "each_head", "zero", metric, progress=False)
    assert list(frame["target"]) == list(expected["target"])
    torch.testing.assert_close(column(frame, "metric"), column(expected, "metric"), atol=1e-5, rtol=0)
    torch.testing.assert_close(column(frame, "effect"), column(expected, "effect"), atol=1e-5, rtol=0)
    assert (tmp_path / "ablation.png").read_bytes()[:4] == b"\x89PNG"


def test_ablate_cumulative_matches_the_library(tmp_path, gpt2_dir, model, probes):
    assert main(["ablate", *common(gpt2_dir, tmp_path), "--targets", "cumulative"]) == 0
    frame = pd.read_csv(tmp_path / "ablation.csv")
    metric = loss_metric(probes.tokens, probes.predictable)
    expected = pruning_curve(model, probes.tokens, "mean", metric, progress=False)
    assert list(frame["head"].fillna(-1)) == list(expected["head"].fillna(-1))
    torch.testing.assert_close(column(frame, "metric"), column(expected, "metric"), atol=1e-5, rtol=0)


def test_ablate_a_group_matches_the_library(tmp_path, gpt2_dir, model, probes):
    assert main(["ablate", *common(gpt2_dir, tmp_path), "--heads", "1.2,0.3", "--method", "zero"]) == 0
    frame = pd.read_csv(tmp_path / "ablation.csv")
    metric = loss_metric(probes.tokens, probes.predictable)
    expected = ablation_sweep(model, probes.tokens, {"group": [(1, 2), (0, 3)]}, "zero", metric, progress=False)
    assert frame["n_heads"].item() == 2 and frame["target"].item() == "1.2,0.3"
    assert frame["metric"].item() == pytest.approx(expected["metric"].item(), abs=1e-5)
    assert frame["baseline"].item() == pytest.approx(expected["baseline"].item(), abs=1e-5)


def test_ablate_texts_of_unequal_length_mask_the_padding(tmp_path, gpt2_dir, model):
    """The texts' loss counts real tokens only, as the library's does (checked by hand in
    test_ablation's ragged-text test)."""
    texts = ["the cat sat on the mat", "a dog", "birds fly"]
    argv = ["ablate", *common(gpt2_dir, tmp_path), "--method", "mean", "--targets", "each_layer"]
    assert main([*argv, *[arg for text in texts for arg in ("--text", text)]]) == 0
    frame = pd.read_csv(tmp_path / "ablation.csv")
    expected = ablation_sweep(model, texts, "each_layer", "mean", progress=False)
    torch.testing.assert_close(column(frame, "metric"), column(expected, "metric"), atol=1e-5, rtol=0)
    batch = encode_texts(as_tokenizer(model.tokenizer), texts, model.cfg.n_ctx)
    with torch.no_grad():
        logits = model(batch.tokens)
    losses = F.cross_entropy(logits[:, :-1].transpose(1, 2), batch.tokens[:, 1:], reduction="none")
    assert frame["baseline"].iloc[0] == pytest.approx(losses[batch.real[:, 1:]].mean().item(), abs=1e-5)


def test_ablate_text_prompts_preserving_patterns(tmp_path, gpt2_dir, model):
    argv = ["ablate", *common(gpt2_dir, tmp_path), "--text", "abcdefgh", "--text", "ijklmnop", "--method", "resample",
            "--targets", "each_layer", "--preserve-patterns"]
    assert main(argv) == 0
    frame = pd.read_csv(tmp_path / "ablation.csv")
    expected = ablation_sweep(model, ["abcdefgh", "ijklmnop"], "each_layer", "resample", preserve_patterns=True,
                              progress=False)
    assert list(frame["target"]) == ["L0", "L1"] and frame["effect"].abs().max() > 0
    torch.testing.assert_close(column(frame, "metric"), column(expected, "metric"), atol=1e-5, rtol=0)


def test_patch_induction_pair_matches_the_api(tmp_path, gpt2_dir, model, probes):
    assert main(["patch", *common(gpt2_dir, tmp_path), "--attribution"]) == 0
    frame = pd.read_csv(tmp_path / "patching.csv")
    corrupted = corrupt_first_copy(probes, seed=1)
    metric = loss_metric(probes.tokens, probes.predictable)
    expected = patch_heads(model, probes.tokens, corrupted, metric, progress=False)
    torch.testing.assert_close(column(frame, "metric"), expected.flatten(), atol=1e-5, rtol=0)
    attributed = attribution_patch_heads(model, probes.tokens, corrupted, metric)
    torch.testing.assert_close(column(frame, "attribution"), attributed.flatten(), atol=1e-5, rtol=0)
    assert (tmp_path / "patching.png").read_bytes()[:4] == b"\x89PNG"


PATCHES = {"heads_by_position": (patch_heads, {"by_position": True}), "residual": (patch_residual, {}),
           "patterns": (patch_patterns, {})}


@pytest.mark.parametrize("what", list(PATCHES))
def test_patch_other_targets_on_text_match_the_api(tmp_path, gpt2_dir, model, what):
    clean_text, corrupted_text = "The cat sat on the mat", "The dog sat on the mat"
    args = ["--clean", clean_text, "--corrupted", corrupted_text, "--what", what, "--normalize"]
    assert main(["patch", *common(gpt2_dir, tmp_path), *args]) == 0
    frame = pd.read_csv(tmp_path / "patching.csv")
    tokenizer = as_tokenizer(model.tokenizer)
    clean, corrupted = (encode_texts(tokenizer, [t], model.cfg.n_ctx).tokens for t in (clean_text, corrupted_text))
    sweep, options = PATCHES[what]
    expected = sweep(model, clean, corrupted, loss_metric(clean), normalize=True, progress=False, **options)
    torch.testing.assert_close(column(frame, "normalized"), expected.flatten(), atol=1e-5, rtol=0)


def test_patch_shortlist_matches_the_api(tmp_path, gpt2_dir, model, probes, capsys):
    """The CSV is the API's shortlist, and the terminal prints each exact head's effect with its
    interval (the CSV's ``effect, ci_low, ci_high``)."""
    assert main(["patch", *common(gpt2_dir, tmp_path), "--shortlist", "3"]) == 0
    frame = pd.read_csv(tmp_path / "patching.csv")
    printed = capsys.readouterr().out
    for row in frame[frame["exact"]].itertuples():
        assert f"  {row.target}: {row.effect:+.3f} [{row.ci_low:+.3f}, {row.ci_high:+.3f}]" in printed
    corrupted = corrupt_first_copy(probes, seed=1)
    expected = shortlist_patch_heads(model, probes.tokens, corrupted, loss_metric(probes.tokens, probes.predictable),
                                     3, progress=False)
    assert frame["exact"].sum() == 3 and list(frame["layer"]) == list(expected["layer"])
    assert list(frame["head"]) == list(expected["head"])
    torch.testing.assert_close(column(frame, "value"), column(expected, "value"), atol=1e-5, rtol=0)


@pytest.mark.parametrize("command, extra", [("ablate", ["--method", "zero", "--targets", "each_layer"]),
                                            ("patch", ["--what", "residual"])])
def test_outputs_record_the_model(tmp_path, gpt2_dir, model, command, extra):
    assert main([command, *common(gpt2_dir, tmp_path), *extra]) == 0
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert {key: meta[key] for key in ("family", "impl", "weights_hash")} == provenance(model)
    assert meta["model"] == str(gpt2_dir) and meta["command"] == command and meta["seed"] == 0


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_ablate_any_family_by_default(tmp_path, family_dir, family):
    """--impl defaults to auto: any family's directory loads, as ``load_model`` picks."""
    directory = family_dir(family)
    argv = ["--model", str(directory), "--prompts", "4", "--seq-len", "16", "--out", str(tmp_path), "--quiet"]
    assert main(["ablate", *argv, "--targets", "each_layer"]) == 0
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert {key: meta[key] for key in ("family", "impl", "weights_hash")} == provenance(load_model(directory))
    assert len(pd.read_csv(tmp_path / "ablation.csv")) == 2


def test_study_run_command(tmp_path, gpt2_dir, model):
    spec = tmp_path / "spec.toml"
    spec.write_text(f'[model]\nspec = "{gpt2_dir}"\n[prompts]\nn = 4\nseq_len = 16\n'
                    '[ablation]\nmethod = "zero"\ntargets = "each_layer"\n')
    assert main(["study", "run", str(spec), "--out", str(tmp_path / "out"), "--quiet"]) == 0
    results = pd.read_csv(tmp_path / "out" / "results.csv")
    probes = probes_for(model, 4, 16, seed=0)
    expected = ablation_sweep(model, probes.tokens, "each_layer", "zero", loss_metric(probes.tokens, probes.predictable),
                              progress=False)
    torch.testing.assert_close(column(results, "metric"), column(expected, "metric"), atol=1e-5, rtol=0)
    assert main(["study", "run", str(spec), "--out", str(tmp_path / "out"), "--quiet", "--resume"]) == 0
    assert pd.read_csv(tmp_path / "out" / "results.csv").equals(results)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["patch", "--clean", "The cat sat", "--corrupted", "A dog"], "texts tokenise to different lengths|corrupted prompts are"),
        (["patch", "--clean", "The cat sat"], "pass both --clean and --corrupted"),
        (["ablate", "--heads", "1.9"], r"head L1H9 out of range"),
        (["ablate", "--heads", "one"], "--heads 'one'"),
        (["ablate", "--text", "ab", "--text", "abc", "--method", "resample"], "resample ablation needs prompts of equal"),
    ],
)
def test_bad_input_is_one_line(tmp_path, gpt2_dir, capsys, argv, message):
    assert main([argv[0], *common(gpt2_dir, tmp_path), *argv[1:]]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith(f"interp {argv[0]}: error: ")
    assert re.search(message, errors[0]) and "Traceback" not in errors[0]


def test_bad_study_spec_is_one_line(tmp_path, capsys):
    spec = tmp_path / "bad.toml"
    spec.write_text('[ablation]\nmethod = "scramble"\n')
    assert main(["study", "run", str(spec), "--out", str(tmp_path / "out")]) == 2
    assert "[ablation].method is 'scramble'" in capsys.readouterr().err
