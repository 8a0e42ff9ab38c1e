"""Issue 36, item 1: every sweep and the report's device-sensitive steps run with the model on a GPU.

There is no GPU here, so the model sits on a simulated "cuda:0" (``tests/simulated_device.py``):
values stay on the CPU, and every torch call is checked by PyTorch's own device rules on fake
tensors. The rule the library keeps (DESIGN 4.0): accumulators and results live on the model's
device until a frame is made on the CPU."""

from __future__ import annotations

import re
from pathlib import Path

import pandas as pd
import pytest
import torch

from analyses.core.metrics import loss_metric
from analyses.core.probes import corrupt_first_copy, probes_for
from interp import load_model
from simulated_device import CUDA, DeviceMismatch, SimulatedDevice

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def toy():
    return load_model("toy").eval()


def sweeps(model):
    """name -> a call of one sweep on a few probes (made inside the simulated device, so on it)."""
    from analyses.circuits.path_patching import eap_ig, edge_attribution, path_patch
    from analyses.interventions.ablation import prepare_ablation
    from analyses.interventions.attribution import attribution_patch_heads
    from analyses.interventions.patching import patch_heads
    from analyses.report.compare import pattern_divergence
    from analyses.roles.backup import backup_report, direct_and_total_effects
    from interp.random_models import random_like
    from analyses.roles.causal_check import ablation_effects
    from analyses.tasks.tracing import causal_trace

    probes = probes_for(model, 4, 24, seed=0)
    corrupted = corrupt_first_copy(probes, seed=1)
    metric = loss_metric(probes.tokens, probes.predictable)
    pair = (model, probes.tokens, corrupted, metric)
    return {
        "patching": lambda: patch_heads(*pair),
        "ablation": lambda: prepare_ablation(model, probes, "mean", metric).run([[(0, 0)], [(1, 1), (0, 2)], []]),
        "path_patching": lambda: path_patch(*pair, senders=[(0, 1)]),
        "tracing": lambda: causal_trace(model, "When Mary met Tom, Mary said hi to", "Mary", samples=2).frame,
        "direct_effects": lambda: direct_and_total_effects(model, probes, [(0, 0), (1, 1)]),
        "causal_check": lambda: ablation_effects(model, probes),
        "attribution_patching": lambda: attribution_patch_heads(*pair),
        "edge_attribution": lambda: edge_attribution(*pair, senders=[(0, 1)]),
        "eap_ig": lambda: eap_ig(*pair, senders=[(0, 1)]),
        "backup_groups": lambda: backup_report(model, probes, [(0, 0), (0, 3), (1, 1)], min_excess=-1.0)[1],
        "pattern_divergence": lambda: pattern_divergence(model, random_like(model, 1), probes.tokens),
    }


def report_steps(model):
    """The report's steps that made frames of device tensors or mixed devices (issue 36)."""
    from analyses.components.decompose import direct_logit_attribution, logit_lens, next_token_answers
    from analyses.components.meaning import ov_scores, qk_positional_scores
    from analyses.roles.classify import classify_heads
    from analyses.roles.dormant import dormant_heads

    probes = probes_for(model, 4, 24, seed=0)
    answers, positions = next_token_answers(probes.tokens)
    return {
        "classification": lambda: classify_heads(model, probes=probes, n_boot=10),
        "ov_scores": lambda: ov_scores(model, n_tokens=32),
        "qk_positional": lambda: qk_positional_scores(model),
        "dla": lambda: direct_logit_attribution(model, probes.tokens, answers, positions=positions),
        "logit_lens": lambda: logit_lens(model, probes.tokens, answers, positions=positions),
        "dormant": lambda: dormant_heads(model, probes),
    }


def same(a, b) -> None:
    if isinstance(a, pd.DataFrame):
        pd.testing.assert_frame_equal(a, b, check_exact=False, atol=1e-6, rtol=1e-6)
    else:
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


SWEEPS = ["patching", "ablation", "path_patching", "tracing", "direct_effects", "causal_check",
          "attribution_patching", "edge_attribution", "eap_ig", "backup_groups", "pattern_divergence"]
REPORT_STEPS = ["classification", "ov_scores", "qk_positional", "dla", "logit_lens", "dormant"]


@pytest.mark.parametrize("name", SWEEPS + REPORT_STEPS)
def test_each_sweep_and_report_step_runs_with_the_model_on_a_gpu_and_gives_the_cpus_numbers(toy, name):
    """On today's main every sweep raised at the engine's CPU float64 sums (a CUDA metric added into
    them), and the report's frames called .numpy() on device tensors and gathered device rows
    with CPU token ids."""
    steps = sweeps if name in SWEEPS else report_steps
    on_cpu = steps(toy)[name]()
    simulated = SimulatedDevice()
    simulated.place_model(toy)
    try:
        with simulated:
            on_gpu = steps(toy)[name]()
            if isinstance(on_gpu, torch.Tensor):  # a result stays on the model's device
                assert simulated.device_of(on_gpu) == CUDA
    finally:
        simulated.place_model(toy, "cpu")
    same(on_gpu, on_cpu)


def test_the_stand_in_refuses_what_cuda_refuses(toy):
    """The checks themselves: a CUDA 0-dim value added into a CPU accumulator (the engine's old
    sums), a frame of a device tensor, a gather with CPU indices; a CPU 0-dim value into a CUDA op
    and CPU indices of a CUDA tensor are fine, as on CUDA."""
    simulated = SimulatedDevice()
    with simulated:
        value = torch.ones(3, device="cuda").sum()
        sums = torch.zeros(3, dtype=torch.float64)
        with pytest.raises(DeviceMismatch, match="wrong device"):
            sums[0] += value.double()
        with pytest.raises(DeviceMismatch, match="numpy"):
            pd.DataFrame({"value": torch.ones(3, device="cuda").numpy()})
        rows = torch.ones(2, 5, device="cuda")
        with pytest.raises(DeviceMismatch, match="two devices"):
            rows.gather(1, torch.zeros(2, 1, dtype=torch.long))
        assert simulated.device_of(rows * torch.tensor(2.0)) == CUDA
        assert simulated.device_of(rows[torch.tensor([1, 0])]) == CUDA
        assert simulated.device_of(rows.cpu()).type == "cpu" and rows.cpu().numpy().shape == (2, 5)


def test_every_frame_is_made_from_the_cpu():
    """Where a tensor becomes numpy (a frame's column, a page's bytes) it is copied to the CPU first:
    ``.numpy()`` of a CUDA tensor raises."""
    unsafe = [f"{path.relative_to(ROOT)}:{number}" for path in sorted((ROOT / "analyses").rglob("*.py"))
              for number, line in enumerate(path.read_text().splitlines(), start=1)
              if re.search(r"(?<!\.cpu\(\))(?<!to_)\.numpy\(\)", line)]
    assert unsafe == []
