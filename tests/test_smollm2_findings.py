"""SmolLM2-135M's head roles as interp scores them, against Hugging Face's own attention.

transformers reads the same GGUF file itself and runs its eager attention; the previous-token,
duplicate-token and induction scores are then computed from its patterns by plain loops over the
roles' definitions (examples/smollm2/role_scores.py: ``hand_scores``). interp's ``classify_heads``
must give the same numbers to 1e-4 and name the same strongest heads; and the heads it names
induction must matter for copying: zeroing them costs several times what zeroing as many other
heads costs (hand-written ``hook_z`` hooks).

On real text (examples/smollm2/text_heads.py, the sample's first three lines): the bracket, quote,
duplicate-token and sink scores computed from interp's patterns equal those from Hugging Face's
eager attention; L26H6 is the bracket head, and zeroing the bracket heads costs the closers, not the
rest; the start token is a sink (moving attention off it costs more than removing its write).
Greater-than (examples/smollm2/greater_than.py): the task's probability difference equals a plain
softmax over the ten digits.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from analyses import assign_roles, classify_heads, loss_metric, matched_random_sets
from analyses.components.rollout import all_patterns
from analyses.core.probes import probes_for
from analyses.tasks.task import greater_than_task, task_batch, task_metric
from interp import load_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "smollm2"))
import greater_than  # noqa: E402
import text_heads  # noqa: E402
from ablation import zeroed_by_hand  # noqa: E402
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


def test_role_scores_equal_a_hand_computation_on_hugging_face_eager_attention(smollm2, probes, scores, hf):
    shape = (smollm2.cfg.n_layers, smollm2.cfg.n_heads)
    theirs = hand_scores(hf_patterns(hf, probes.tokens), probes)
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
    roles = assign_roles(scores)  # the fixed rule: score >= 0.4, interval above chance (no calibration here)
    induction = [(int(l), int(h)) for l, h, r in zip(roles["layer"], roles["head"], roles["role"]) if "induction" in r]
    assert len(induction) >= 5
    named = zeroed_by_hand(smollm2, test.tokens, induction, metric) - base
    controls = [zeroed_by_hand(smollm2, test.tokens, heads, metric) - base
                for heads in matched_random_sets(smollm2, induction, n_draws=3)]
    assert named > 3 * max(controls) and named > 2.0  # nats


# ------------------------------------------------------------------ heads on real text (text_heads.py)
@pytest.fixture(scope="module")
def hf():
    return hf_eager_model()


@pytest.fixture(scope="module")
def short_text(smollm2):
    """The sample text's first three lines (a parenthesis, quotes, square brackets, newlines):
    tokens (1, pos), their strings, and interp's patterns (layer, head, q, k)."""
    text = "".join((text_heads.TEXT.read_text(encoding="utf-8").splitlines(keepends=True))[:3])
    tokens, strings = text_heads.text_tokens(smollm2, text)
    return tokens, strings, all_patterns(smollm2, tokens[0])


def test_text_head_scores_equal_hugging_face_eager_attention_and_name_the_bracket_head(short_text, hf):
    tokens, strings, ours = short_text
    theirs = hf_patterns(hf, tokens)[:, 0]
    where = text_heads.targets(tokens, strings)
    assert len(where["bracket_before"][0]) == 4 and len(where["quote_before"][0]) == 2
    for kind in text_heads.KINDS:
        a, b = text_heads.kind_scores(ours, where[kind])[0], text_heads.kind_scores(theirs, where[kind])[0]
        assert (a - b).abs().max() < 1e-4, kind
        assert text_heads.top(a, 3) == text_heads.top(b, 3), kind
    before, chance = text_heads.kind_scores(theirs, where["bracket_before"])
    assert text_heads.top(before, 1) == [(26, 6)] and before[26, 6] > 0.5 > 10 * chance
    bos, delimiter = (text_heads.kind_scores(theirs, where[kind])[0] for kind in ("bos", "delimiter"))
    assert bos.max() > 0.9 and delimiter.max() < 0.6  # the start token is the sink; no delimiter is one


def test_zeroing_the_bracket_heads_costs_the_closers_not_the_rest(smollm2, short_text):
    tokens, strings, patterns = short_text
    where = text_heads.targets(tokens, strings)
    closers = where["bracket_before"][0] + where["quote_before"][0]
    heads = text_heads.top(text_heads.kind_scores(patterns, where["bracket_before"])[0], 3)

    def metric(logits):
        return torch.tensor(text_heads.loss_at(logits, tokens, closers))
    with torch.no_grad():
        base = metric(smollm2(tokens)).item()
    named = zeroed_by_hand(smollm2, tokens, heads, metric) - base
    controls = [zeroed_by_hand(smollm2, tokens, h, metric) - base for h in matched_random_sets(smollm2, heads, n_draws=3)]
    assert named > 1.0 and named > 3 * max(controls)  # nats


def test_the_start_token_is_a_sink_the_heads_need_to_park_attention_on(smollm2, short_text):
    """Moving the top start-token heads' attention off it costs more than removing what it writes."""
    tokens, strings, patterns = short_text
    heads = text_heads.top(text_heads.kind_scores(patterns, text_heads.targets(tokens, strings)["bos"])[0], 5)
    every = range(tokens.shape[1] - 1)
    base, moved, removed = (text_heads.loss_at(text_heads.run(smollm2, tokens, hooks), tokens, every) for hooks in
                            ((), *(text_heads.pattern_edit(heads, lambda q: [0] if q else [], r) for r in (True, False))))
    assert moved - base > 0.05 > abs(removed - base)


# ----------------------------------------------------------------------- greater-than (greater_than.py)
def test_greater_than_prob_diff_by_hand_and_its_mlps(smollm2):
    """The guide's MLP claims were measured on start years 17D9, whose prompts end "... the year 17" and
    compare the decade digit; the task now also draws years 17DY that compare the last digit, so the
    claims are checked on the first 8 decade prompts (``task.clean`` ends in "17")."""
    every = greater_than_task(smollm2, n=15 * 88, seed=0)  # every prompt: 15 nouns x 88 start years
    task = every.subset([i for i, text in enumerate(every.clean) if text.endswith("17")][:8])
    assert len(task) == 8
    batch = task_batch(smollm2, task)
    digits, decade = greater_than.digit_ids(task), greater_than.decades(task)
    by_hand = greater_than.prob_diff(greater_than.digit_probs(smollm2, batch.clean, batch.last, digits), decade).mean().item()
    metric = task_metric(task, batch.last)
    with torch.no_grad():
        assert abs(metric(smollm2(batch.clean)).item() - by_hand) < 1e-4
    assert by_hand > 0.5

    def zeroed(layers):  # hand-written hooks zeroing these MLPs' outputs (batch, pos, d_model)
        hooks = [(f"blocks.{layer}.hook_mlp_out", lambda out, hook: torch.zeros_like(out)) for layer in layers]
        with torch.no_grad():
            logits = smollm2.run_with_hooks(batch.clean, fwd_hooks=hooks)
        probs = logits[torch.arange(len(task)), batch.last].softmax(-1)[:, digits]
        return greater_than.prob_diff(probs, decade).mean().item()
    assert by_hand - zeroed([24]) > 0.2  # the top direct writer among the MLPs
    assert zeroed([24, 29, 26, 23, 22]) < 0  # the top five together turn the answer around


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


def test_l11_mlp_writes_the_sink_and_the_previous_token_heads_key_check_names_it_first(smollm2, hf):
    """docs/guides/smollm2.md (QK attribution): L11 MLP's output at position 0 is the massive
    activation that fills the residual there (read from Hugging Face's own layers, a hook on its
    ``mlp`` and ``output_hidden_states``), and removing it from L16H0's key input moves that
    previous-token head's attention more than removing any other component (interp's check)."""
    from analyses.circuits.qk_check import qk_intervention_check, role_pairs

    measure = probes_for(smollm2, 4, 48, seed=1)
    written = {}
    handle = hf.model.layers[11].mlp.register_forward_hook(lambda module, args, output: written.update(out=output))
    try:
        with torch.no_grad():
            entering = hf(measure.tokens, output_hidden_states=True).hidden_states[16]  # the residual into layer 16
    finally:
        handle.remove()
    norms = written["out"].norm(dim=-1)  # (b, pos)
    assert float(norms[:, 0].min()) > 50 * float(norms[:, 1:].median())
    cosine = torch.nn.functional.cosine_similarity(written["out"][:, 0], entering[:, 0], dim=-1)
    assert float(cosine.min()) > 0.99
    query, key = role_pairs(measure, "previous_token", 8)
    check = qk_intervention_check(smollm2, measure.tokens, 16, 0, query, key, side="key", n_boot=20)
    drops = check.frame.set_index("component")["drop"].sort_values(ascending=False)
    assert drops.index[0] == "L11 MLP" and drops.iloc[0] > 0.3 and drops.iloc[1] < 0.1
