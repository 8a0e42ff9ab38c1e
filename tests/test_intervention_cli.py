"""``interp ablate``, ``interp patch`` and ``interp study run`` end to end on a local GPT-2 directory."""

from __future__ import annotations

import re

import pandas as pd
import pytest
import torch

from analyses.cli import main
from analyses.metrics import loss_metric
from analyses.patching import patch_heads
from analyses.probes import bos_token_id, corrupt_first_copy, probes_for
from interp import load_model


def common(gpt2_dir, out):
    return ["--model", str(gpt2_dir), "--prompts", "4", "--seq-len", "16", "--out", str(out), "--quiet"]


def test_ablate_writes_csv_and_png(tmp_path, gpt2_dir):
    assert main(["ablate", *common(gpt2_dir, tmp_path), "--method", "zero"]) == 0
    frame = pd.read_csv(tmp_path / "ablation.csv")
    assert len(frame) == 8 and {"layer", "head", "metric", "effect"} <= set(frame.columns)
    assert (tmp_path / "ablation.png").read_bytes()[:4] == b"\x89PNG"
    assert main(["ablate", *common(gpt2_dir, tmp_path / "curve"), "--targets", "cumulative"]) == 0
    assert len(pd.read_csv(tmp_path / "curve" / "ablation.csv")) == 9
    assert main(["ablate", *common(gpt2_dir, tmp_path / "group"), "--heads", "1.2,0.3"]) == 0
    assert pd.read_csv(tmp_path / "group" / "ablation.csv")["n_heads"].item() == 2


def test_patch_induction_pair_matches_the_api(tmp_path, gpt2_dir):
    assert main(["patch", *common(gpt2_dir, tmp_path), "--attribution"]) == 0
    frame = pd.read_csv(tmp_path / "patching.csv")
    model = load_model(str(gpt2_dir)).eval()
    probes = probes_for(model, 4, 16, seed=0)
    corrupted = corrupt_first_copy(probes, model.cfg.d_vocab, bos_token_id(model), seed=1)
    expected = patch_heads(model, probes.tokens, corrupted, loss_metric(probes.tokens, probes.predictable), progress=False)
    torch.testing.assert_close(torch.tensor(frame["metric"].to_numpy(), dtype=torch.float32), expected.flatten(),
                               atol=1e-5, rtol=0)
    assert "attribution" in frame and (tmp_path / "patching.png").exists()


@pytest.mark.parametrize("what", ["heads_by_position", "residual", "patterns"])
def test_patch_other_targets_and_text(tmp_path, gpt2_dir, what):
    args = ["--clean", "The cat sat on the mat", "--corrupted", "The dog sat on the mat", "--what", what]
    assert main(["patch", *common(gpt2_dir, tmp_path), *args, "--normalize"]) == 0
    assert "normalized" in pd.read_csv(tmp_path / "patching.csv")


def test_patch_shortlist(tmp_path, gpt2_dir):
    assert main(["patch", *common(gpt2_dir, tmp_path), "--shortlist", "3"]) == 0
    frame = pd.read_csv(tmp_path / "patching.csv")
    assert frame["exact"].sum() == 3 and len(frame) == 8


def test_study_run_command(tmp_path, gpt2_dir):
    spec = tmp_path / "spec.toml"
    spec.write_text(f'[model]\nspec = "{gpt2_dir}"\n[prompts]\nn = 4\nseq_len = 16\n'
                    '[ablation]\nmethod = "zero"\ntargets = "each_layer"\n')
    assert main(["study", "run", str(spec), "--out", str(tmp_path / "out"), "--quiet"]) == 0
    assert len(pd.read_csv(tmp_path / "out" / "results.csv")) == 2
    assert main(["study", "run", str(spec), "--out", str(tmp_path / "out"), "--quiet", "--resume"]) == 0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["patch", "--clean", "The cat sat", "--corrupted", "A dog"], "corrupted prompts are"),
        (["patch", "--clean", "The cat sat"], "pass both --clean and --corrupted"),
        (["ablate", "--heads", "1.9"], r"head \(1, 9\) out of range"),
        (["ablate", "--heads", "one"], "--heads 'one'"),
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


def test_ablate_text_prompts(tmp_path, gpt2_dir):
    argv = ["ablate", *common(gpt2_dir, tmp_path), "--text", "abcdefgh", "--text", "ijklmnop", "--method", "resample",
            "--targets", "each_layer", "--preserve-patterns"]
    assert main(argv) == 0
    frame = pd.read_csv(tmp_path / "ablation.csv")
    assert list(frame["target"]) == ["L0", "L1"] and frame["effect"].abs().max() > 0
