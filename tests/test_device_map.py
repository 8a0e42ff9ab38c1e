"""Issue 43, item 12 (suspected): with a ``device_map`` over several devices, are the engine's
accumulators (on the first parameter's device) and the logits (made by the last layers) apart?

No: ``load_model(device_map=...)`` places the Hugging Face model with accelerate, whose hook on the
whole model returns its output on its input's device, and the bridge runs that whole model, so the
logits come back where the tokens are: the first parameter's device, the accumulators'. Checked on
a Llama spread over a simulated cuda:0 and cuda:1 (``SimulatedDevice.place_map``: accelerate's own
hooks) and, as a control, without the whole model's hook, where the logits stay on cuda:1."""

from __future__ import annotations

import pytest
import torch

from analyses.core.metrics import loss_metric
from analyses.core.probes import corrupt_first_copy, probes_for
from analyses.core.tokens import accumulator
from analyses.interventions.patching import patch_heads
from interp.bridge import boot_bridge
from interp.random_models import random_hf_model
from simulated_device import SimulatedDevice

FIRST, LAST = torch.device("cuda", 0), torch.device("cuda", 1)
SPREAD = {"model.embed_tokens": FIRST, "model.layers.0": FIRST, "model.layers.1": LAST, "model.norm": LAST,
          "model.rotary_emb": LAST, "lm_head": LAST}


def spread_bridge(simulated: SimulatedDevice):
    """A random 2-layer Llama's bridge, layer 0 on cuda:0 and the rest on cuda:1, as load_model makes it."""
    hf, tokenizer = random_hf_model("llama")
    assert hf.config.num_hidden_layers == 2 and not hf.config.tie_word_embeddings
    simulated.place_map(hf, SPREAD)
    with simulated:
        return boot_bridge(hf, tokenizer, copy=False)


def test_the_logits_come_back_on_the_accumulators_device_and_a_sweep_runs():
    simulated = SimulatedDevice()
    bridge = spread_bridge(simulated)
    reference = boot_bridge(*random_hf_model("llama"))  # the same weights on the CPU alone
    with simulated:
        probes = probes_for(bridge, 4, 12, seed=0)
        assert simulated.device_of(bridge.W_U) == LAST  # the unembedding is on the last device
        assert simulated.device_of(bridge(probes.tokens)) == FIRST == simulated.device_of(accumulator(bridge, 1))
        metric = loss_metric(probes.tokens, probes.predictable)
        corrupted = corrupt_first_copy(probes, seed=1)
        spread = patch_heads(bridge, probes.tokens, corrupted, metric)
        assert simulated.device_of(spread) == FIRST
    torch.testing.assert_close(spread, patch_heads(reference, probes.tokens, corrupted, metric), atol=1e-6, rtol=1e-6)


def test_without_accelerates_hook_on_the_whole_model_the_logits_would_stay_on_the_last_device():
    """The control: the stand-in does see the logits made on cuda:1; it is accelerate's
    ``io_same_device`` that brings them back."""
    simulated = SimulatedDevice()
    bridge = spread_bridge(simulated)
    bridge.original_model._hf_hook.io_same_device = False
    with simulated:
        tokens = torch.tensor([[1, 40, 41, 42]], device=FIRST)
        assert simulated.device_of(bridge(tokens)) == LAST
