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

import numpy as np
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


# ------------------------------------------------------------------------------- the IOI circuit's edges
# examples/smollm2/ioi_circuit.py: on SmolLM2's IOI, L20H0 attends from the last token to the subject's
# second mention and writes into the answer writers' queries; the circuit's faithfulness is measured by
# edge_circuit. Here on 4 prompts, each against hand-written hooks (tests/test_edge_circuit.py's
# naive_value: one hook per removed edge, the senders' writes by z @ W_O, passes instead of one edited
# forward).
from ioi_circuit import attention_from_end, name_positions  # noqa: E402
from test_edge_circuit import naive_value  # noqa: E402

from analyses import path_patch  # noqa: E402
from analyses.circuits.edge_circuit import circuit_values  # noqa: E402
from analyses.circuits.edges import edges_of  # noqa: E402
from analyses.tasks.task import ioi_task, task_batch, task_metric  # noqa: E402

WRITERS = [(23, 3), (29, 1), (23, 0)]


@pytest.fixture(scope="module")
def ioi(smollm2):
    task = ioi_task(smollm2, n=4, seed=0)
    batch = task_batch(smollm2, task)
    return task, batch, task_metric(task, batch.last)


def test_an_edge_into_a_writers_query_equals_a_hand_written_hook_and_its_sender_reads_the_repeated_name(smollm2, ioi):
    task, batch, metric = ioi
    edge = ((20, 0), (23, 0), "q")
    paths = path_patch(smollm2, batch.clean, batch.corrupted, metric, senders=[edge[0]], receivers=[edge[1]], via="q",
                       direction="noise", progress=False)
    assert paths["value"].item() == pytest.approx(naive_value(smollm2, batch.clean, batch.corrupted, metric, [edge],
                                                              passes=1), abs=1e-4)
    attention = attention_from_end(smollm2, batch.clean, name_positions(task, batch), [edge[0]])[edge[0]]
    assert attention["S2"] > 0.4 and attention["S2"] > 3 * max(attention["IO"], attention["S1"])


def test_a_small_circuits_value_equals_hand_written_hooks_and_the_top_writers_logit_edge_carries_most(smollm2, ioi):
    _, batch, metric = ioi
    nodes = [(16, 0), (17, 4), *WRITERS, (29, 0)]
    candidates = edges_of(smollm2, nodes, nodes)
    keys = [(e.sender, e.receiver, e.via) for e in candidates]
    logits = (smollm2.cfg.n_layers, -1)
    circuits = {"L23H3 -> logits": {((23, 3), logits, "logits")},
                "writers' logit edges and L23H3 -> L29H1.v": {((23, 3), logits, "logits"), ((29, 1), logits, "logits"),
                                                                ((23, 0), logits, "logits"), ((23, 3), (29, 1), "v")}}
    masks = [np.array([key in kept for key in keys]) for kept in circuits.values()]
    full, empty, *values = circuit_values(smollm2, batch.clean, batch.corrupted, metric, candidates,
                                          [np.ones(len(keys), dtype=bool), np.zeros(len(keys), dtype=bool), *masks]).tolist()
    for mask, value in zip(masks, values):
        removed = [key for key, kept in zip(keys, mask) if not kept]
        # removed edges chain through the nodes' 4 layers at most (16 -> 17 -> 23 -> 29 -> logits): 5 passes settle them
        assert value == pytest.approx(naive_value(smollm2, batch.clean, batch.corrupted, metric, removed, passes=5),
                                      abs=1e-4)
    assert (values[0] - empty) / (full - empty) > 0.5  # one edge of 45
