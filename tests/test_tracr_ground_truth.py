"""The ground truth of Tracr-compiled programs (``analyses.circuits.ground_truth``) against the compiled
weights themselves: Tracr gives every operation its own residual dimensions and pads unused heads
and MLPs with zeros, so a component is used exactly when its weights are not all zero, and A
feeds B exactly when what A writes overlaps what B's input reads."""

from __future__ import annotations

from functools import lru_cache

import pytest
import torch

pytest.importorskip("tracr", reason="needs the [tracr] extra")

from analyses.circuits.ground_truth import compile_with_graph, ground_truth  # noqa: E402
from interp import from_tracr  # noqa: E402
from interp.tracr import PROGRAMS, compile_program  # noqa: E402

MAX_SEQ_LEN = 4
VOCABS = {"sort": (1, 2, 3), "pair_balance": ("(", ")"), "shuffle_dyck": ("(", ")"), "shuffle_dyck2": tuple("(){}")}


@lru_cache(maxsize=None)
def truth(name: str):
    compilation = compile_with_graph(name, VOCABS.get(name, ("a", "b", "c")), MAX_SEQ_LEN)
    model = from_tracr(compilation.assembled)
    return model, *ground_truth(compilation, model)


def writes(model, kind: str, layer: int, head: int) -> torch.Tensor:
    """(d_model,) bool: the residual dimensions a component writes."""
    block = model.blocks[layer]
    matrix = block.attn.W_O[head] if kind == "head" else block.mlp.proj.weight.T
    return matrix.abs().sum(0) > 0


def reads(model, kind: str, layer: int, head: int, via: str) -> torch.Tensor:
    """(d_model,) bool: the residual dimensions a component's input reads."""
    block, d_head = model.blocks[layer], model.cfg.d_head
    if via == "logits":
        return model.lm_head.weight.abs().sum(0) > 0
    if kind == "mlp":
        return block.mlp.fc.weight.abs().sum(0) > 0
    linear = {"q": block.attn.W_query, "k": block.attn.W_key, "v": block.attn.W_value}[via]
    return linear.weight[head * d_head:(head + 1) * d_head].abs().sum(0) > 0


def used(model, kind: str, layer: int, head: int) -> bool:
    block = model.blocks[layer]
    if kind == "mlp":
        return bool(block.mlp.fc.weight.abs().sum() > 0)
    return bool(writes(model, kind, layer, head).any())


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_true_nodes_and_edges_are_what_the_weights_connect(name):
    model, nodes, edges = truth(name)
    assert len(nodes) == model.cfg.n_layers * (model.cfg.n_heads + 1)
    for row in nodes.itertuples():
        assert row.true == used(model, row.kind, row.layer, row.head), f"{name} {row.component}"
    true_edges = set(zip(edges.sender_kind, edges.sender_layer, edges.sender_head, edges.receiver_kind,
                         edges.receiver_layer, edges.receiver_head, edges.via))
    found = set()
    components = [(row.kind, row.layer, row.head) for row in nodes.itertuples() if row.true]
    for sender in components:
        written = writes(model, *sender)
        for receiver in components:
            later = receiver[1] > sender[1] or receiver[1] == sender[1] and sender[0] == "head" and receiver[0] == "mlp"
            for via in (("q", "k", "v") if receiver[0] == "head" else ("mlp",)) if later else ():
                if (written & reads(model, *receiver, "q" if via == "mlp" else via)).any():
                    found.add((*sender, *receiver, via))
        if (written & reads(model, "logits", 0, 0, "logits")).any():
            found.add((*sender, "logits", model.cfg.n_layers, -1, "logits"))
    assert true_edges == found, f"{name}: truth only {true_edges - found}, weights only {found - true_edges}"
    assert edges.via.eq("logits").sum() == 1  # one output component


def test_compile_with_graph_compiles_what_tracr_compiles():
    """The passes kept open give the weights Tracr's own compile_rasp_to_model gives."""
    ours = truth("sort_unique")[0]
    theirs = from_tracr(compile_program("sort_unique", ("a", "b", "c"), MAX_SEQ_LEN))
    for (name, a), (_, b) in zip(ours.state_dict().items(), theirs.state_dict().items()):
        assert torch.equal(a, b), name


def test_known_circuits():
    """Two programs whose circuits are small enough to state: hist is one SelectorWidth (a head
    then its MLP, which writes the output); sort_unique a SelectorWidth (target_pos) then an
    Aggregate selecting Select(keys=target_pos, queries=indices), whose key reads that MLP."""
    _, nodes, edges = truth("hist")
    assert sorted(nodes.component[nodes.true]) == ["L0H0", "MLP0"]
    assert set(zip(edges.sender_kind, edges.receiver_kind, edges.via)) == {("head", "mlp", "mlp"), ("mlp", "logits", "logits")}
    _, nodes, edges = truth("sort_unique")
    assert sorted(nodes.component[nodes.true]) == ["L0H0", "L1H0", "MLP0"]
    assert ("mlp", 0, "head", 1, "k") in set(zip(edges.sender_kind, edges.sender_layer, edges.receiver_kind,
                                                  edges.receiver_layer, edges.via))
