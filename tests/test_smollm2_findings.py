"""SmolLM2-135M's head roles as interp scores them, against Hugging Face's own attention.

transformers reads the same GGUF file itself and runs its eager attention; the previous-token,
duplicate-token and induction scores are then computed from its patterns by plain loops over the
roles' definitions (examples/smollm2/role_scores.py: ``hand_scores``). interp's ``classify_heads``
must give the same numbers to 1e-4 and name the same strongest heads; and the heads it names
induction must matter for copying: zeroing them costs several times what zeroing as many other
heads costs (hand-written ``hook_z`` hooks).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from analyses import classify_heads, loss_metric
from analyses.core.probes import probes_for
from interp import load_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "smollm2"))
from ablation import named_heads, random_sets, zeroed_by_hand  # noqa: E402
from role_scores import ROLES, hand_scores, interp_scores, top  # noqa: E402
from setup_smollm2 import hf_eager_model, hf_patterns  # noqa: E402


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2")


@pytest.fixture(scope="module")
def probes(smollm2):
    return probes_for(smollm2, 4, 48, seed=0)


@pytest.fixture(scope="module")
def scores(smollm2, probes):
    return classify_heads(smollm2, probes=probes, n_boot=10, progress=False)


def test_role_scores_equal_a_hand_computation_on_hugging_face_eager_attention(smollm2, probes, scores):
    shape = (smollm2.cfg.n_layers, smollm2.cfg.n_heads)
    theirs = hand_scores(hf_patterns(hf_eager_model(), probes.tokens), probes)
    for role in ROLES:
        ours = interp_scores(scores, role, shape)
        assert (ours - theirs[role]).abs().max() < 1e-4, role
        assert top(ours, 3) == top(theirs[role], 3), role
    induction = interp_scores(scores, "induction", shape)
    assert induction.max() > 0.5 and 17 <= int(induction.argmax()) // shape[1] <= 23  # late-middle layers


def test_zeroing_the_induction_heads_costs_the_copy_several_times_what_random_heads_cost(smollm2, scores):
    test = probes_for(smollm2, 4, 48, seed=1)  # heads named on other probes
    metric = loss_metric(test.tokens, positions=test.predictable)
    with torch.no_grad():
        base = metric(smollm2(test.tokens)).item()
    induction = named_heads(scores, "induction")
    assert len(induction) >= 5
    named = zeroed_by_hand(smollm2, test.tokens, induction, metric) - base
    controls = [zeroed_by_hand(smollm2, test.tokens, heads, metric) - base
                for heads in random_sets(smollm2, induction, len(induction), 3)]
    assert named > 3 * max(controls) and named > 2.0  # nats
