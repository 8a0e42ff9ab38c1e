"""Issue 36, item 1: every sweep and the report's device-sensitive steps run with the model on a GPU;
issue 43, item 4: and on MPS, which has no float64.

There is no GPU here, so the model sits on a simulated "cuda:0" or "mps:0"
(``tests/simulated_device.py``): values stay on the CPU, and every torch call is checked by
PyTorch's own device rules on fake tensors (on "mps", with MPS's refusal of float64). The rule the
library keeps (architecture §4.0, §4.11): accumulators and results live on the model's device, in the
widest float it has (``analyses.core.tokens.accumulator_dtype``), until a frame is made on the CPU."""

from __future__ import annotations

import re
from pathlib import Path

import pandas as pd
import pytest
import torch

from analyses.core.metrics import loss_metric
from analyses.core.probes import corrupt_first_copy, probes_for
from interp import load_model
from simulated_device import CUDA, MPS, DeviceMismatch, NoFloat64, SimulatedDevice

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def toy():
    return load_model("toy").eval()


@pytest.fixture(scope="module")
def llama():
    """A random Llama with MLPs (the toy has none), as ours."""
    from interp.convert import from_hf
    from interp.random_models import random_hf_model

    return from_hf(*random_hf_model("llama", seed=5, initializer_range=0.2)).eval()


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


def other_steps(model):
    """The other analyses that cast values to float64 (issue 43, item 4) or make float64 there."""
    from analyses.circuits.composition import composition_scores
    from analyses.components.neurons import neuron_effects
    from analyses.core import hook_check
    from analyses.interventions.attribution import attribution_agreement, attribution_patch_heads
    from analyses.interventions.patching import patch_heads
    from analyses.roles.nulls import role_samples, t_log_upper_tail

    probes = probes_for(model, 4, 24, seed=0)
    metric = loss_metric(probes.tokens, probes.predictable)
    pair = (model, probes.tokens, corrupt_first_copy(probes, seed=1), metric)

    def hooks_checked():  # afresh: the check is kept per model, and the CPU's run came first
        hook_check._checked.pop(model, None)
        return pd.DataFrame({"effect": hook_check.check_hooks(model).effects})

    def agreement():
        return pd.DataFrame([attribution_agreement(attribution_patch_heads(*pair), patch_heads(*pair),
                                                   baseline=float(patch_heads(*pair).mean()))])

    return {
        "neurons": lambda: neuron_effects(model, probes.tokens, metric, 0, exact=3),
        "composition": lambda: composition_scores(model, ["q", "k", "v"], baseline_samples=4),
        "role_samples": lambda: pd.concat({role: pd.DataFrame(sums.flatten(1).cpu().numpy())
                                           for role, sums in role_samples(model, probes).sums.items()}),
        "attribution_agreement": agreement,
        "hook_check": hooks_checked,
        # the meaning nulls' p-values of z on the device (meaning_nulls whole: 25 s here)
        "t_tails": lambda: pd.DataFrame({"log_p": t_log_upper_tail(torch.linspace(-3.0, 40.0, 9, device=model.cfg.device)
                                                                   .float(), 3).numpy()}),
    }


def same(a, b, wide: bool = True) -> None:
    """The same values and dtypes; without ``wide`` (``a`` summed in float32 where ``b`` was in
    float64, as on mps), the same values to float32's rounding (the meaning nulls' z: 4e-5 of 0.17)."""
    tolerance = dict(atol=1e-6, rtol=1e-6) if wide else dict(atol=1e-5, rtol=1e-4)
    if isinstance(a, pd.DataFrame):
        pd.testing.assert_frame_equal(a, b, check_exact=False, check_dtype=wide, **tolerance)
    else:
        torch.testing.assert_close(a, b, check_dtype=wide, **tolerance)


SWEEPS = ["patching", "ablation", "path_patching", "tracing", "direct_effects", "causal_check",
          "attribution_patching", "edge_attribution", "eap_ig", "backup_groups", "pattern_divergence"]
REPORT_STEPS = ["classification", "ov_scores", "qk_positional", "dla", "logit_lens", "dormant"]
OTHER_STEPS = ["neurons", "composition", "role_samples", "attribution_agreement", "hook_check", "t_tails"]


@pytest.mark.parametrize("device", [CUDA, MPS], ids=["cuda", "mps"])
@pytest.mark.parametrize("name", SWEEPS + REPORT_STEPS + OTHER_STEPS)
def test_each_sweep_and_report_step_runs_with_the_model_on_a_gpu_and_gives_the_cpus_numbers(request, name, device):
    """On main of issue 36 every sweep raised at the engine's CPU float64 sums (a CUDA metric added
    into them), and the report's frames called .numpy() on device tensors and gathered device rows
    with CPU token ids; on main of issue 43 every sweep raised on MPS at a .double() of a device
    value (the engine's, the ablation's, backup's, neurons', composition's, dormant's, ...)."""
    steps = sweeps if name in SWEEPS else report_steps if name in REPORT_STEPS else other_steps
    model = request.getfixturevalue("llama" if name == "neurons" else "toy")  # neurons need MLPs
    on_cpu = steps(model)[name]()
    simulated = SimulatedDevice()
    simulated.place_model(model, device)
    try:
        with simulated:
            on_gpu = steps(model)[name]()
            if isinstance(on_gpu, torch.Tensor):  # a result stays on the model's device
                assert simulated.device_of(on_gpu) == device
    finally:
        simulated.place_model(model, "cpu")
    same(on_gpu, on_cpu, wide=device != MPS)  # float32 sums on mps, where the CPU's are float64


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


def test_the_stand_in_refuses_float64_on_mps_as_mps_does():
    """MPS has no float64: making, casting or moving a float64 tensor there raises; float32 there,
    and a float64 copy made on the CPU, are fine."""
    simulated = SimulatedDevice()
    with simulated:
        values = torch.ones(3, device="mps")
        for make in (lambda: torch.zeros(3, dtype=torch.float64, device="mps"), values.double,
                     lambda: values.to(torch.float64), lambda: torch.ones(3, dtype=torch.float64).to("mps"),
                     lambda: torch.arange(3, device="mps", dtype=torch.float64)):
            with pytest.raises(NoFloat64, match="doesn't support float64"):
                make()
        assert simulated.device_of(values.cpu().double()).type == "cpu"
        assert simulated.device_of(torch.zeros(3, dtype=torch.float64).to("mps", torch.float32)) == MPS
        assert simulated.device_of(values + torch.tensor(2.0, dtype=torch.float64)) == MPS  # a CPU 0-dim float64


def test_every_frame_is_made_from_the_cpu():
    """Where a tensor becomes numpy (a frame's column, a page's bytes) it is copied to the CPU first
    (and widened there, never on an mps device): ``.numpy()`` of a CUDA tensor raises."""
    unsafe = [f"{path.relative_to(ROOT)}:{number}" for path in sorted((ROOT / "analyses").rglob("*.py"))
              for number, line in enumerate(path.read_text().splitlines(), start=1)
              if re.search(r"(?<!\.cpu\(\))(?<!\.cpu\(\)\.double\(\))(?<!to_)\.numpy\(\)", line)]
    assert unsafe == []
