"""Circuit discovery scored against Tracr's ground truth (``analyses.circuits.circuit_eval``), and EAP-IG
(``analyses.circuits.path_patching.eap_ig``) against a naive one-edge-at-a-time integrated gradient."""

from __future__ import annotations

import itertools
from functools import lru_cache

import numpy as np
import pandas as pd
import pytest
import torch

pytest.importorskip("tracr", reason="needs the [tracr] extra")

from analyses.circuits.circuit_eval import (  # noqa: E402
    auc_bound, component_scores, evaluate_discovery, faithfulness, invisible_components, output_metric, roc_auc,
    task_pairs,
)
from analyses.circuits.path_patching import eap_ig  # noqa: E402
from analyses.circuits.ground_truth import compile_with_graph, ground_truth  # noqa: E402
from interp import UserError, from_tracr  # noqa: E402
from interp.tracr import encode_inputs  # noqa: E402

PROGRAMS = {"sort_unique": "abc", "frac_prevs": "abc", "shuffle_dyck": "()", "detect_pattern": "abc", "reverse": "abc"}


@lru_cache(maxsize=None)
def task(name: str):
    vocab = list(PROGRAMS[name])
    # inputs one shorter than the compiled length: a zeroed SelectorWidth head reads as the largest
    # width, which would equal the length of inputs as long as the model allows
    compilation = compile_with_graph(name, vocab, 5)
    model = from_tracr(compilation.assembled)
    nodes, edges = ground_truth(compilation, model)
    clean, corrupted = task_pairs(encode_inputs(model, [list(r) for r in itertools.product(vocab, repeat=4)]), seed=0)
    return model, nodes, edges, clean, corrupted


def test_roc_auc_against_hand_counts():
    assert roc_auc([0.9, 0.1, 0.5, 0.5], [True, False, True, False]) == (1 + 1 + 1 + 0.5) / 4
    assert roc_auc([3, 2, 1], [False, True, True]) == 0.0
    assert np.isnan(roc_auc([1, 2], [True, True]))


def test_task_pairs_give_every_prompt_another():
    tokens = torch.arange(10)[:, None].repeat(1, 3)
    clean, corrupted = task_pairs(tokens, seed=1)
    assert (corrupted[:, 0] != clean[:, 0]).all() and sorted(corrupted[:, 0].tolist()) == list(range(10))
    clean, corrupted = task_pairs(tokens[:4], every=True)
    pairs = list(zip(clean[:, 0].tolist(), corrupted[:, 0].tolist()))
    assert sorted(pairs) == [(i, j) for i in range(4) for j in range(4) if i != j] and clean.shape == (12, 3)


def test_auc_bound_against_hand_counts():
    """Two true items, one invisible, two false: the visible one beats both false (2 wins), the
    invisible one at best ties both (2 halves): 3 of 4."""
    assert auc_bound([True, True, False, False], [False, True, False, False]) == 0.75
    assert auc_bound([True, False], [False, False]) == 1.0


def test_every_pair_corruption_reaches_the_bound_and_no_further():
    """reverse on inputs of one length: ``length`` and ``opp_idx`` (length - index - 1, and minus
    one) are the same on every input, so patching and mean ablation see only the aggregating
    head: node AUC 3/5 (the bound), and where no true component is constant (sort_unique) 1.0."""
    compilation = compile_with_graph("reverse", ["a", "b"], 5)
    model = from_tracr(compilation.assembled)
    nodes, edges = ground_truth(compilation, model)
    tokens = encode_inputs(model, [list(r) for r in itertools.product("ab", repeat=4)])
    hidden = invisible_components(model, tokens, nodes)
    from_length = {c for c, op in zip(nodes.component, nodes.op) if op.startswith(("length", "opp_idx"))}
    assert set(hidden.component[hidden.constant]) == from_length and len(from_length) == 4
    assert not hidden.zero.any() and len(hidden) == nodes.true.sum() == 5
    clean, corrupted = task_pairs(tokens, every=True)
    scores = evaluate_discovery(model, nodes, edges, clean, corrupted, steps=2)[0].set_index("method")
    for method in ("patch", "mean_ablate"):
        assert scores.loc[method, "auc"] == scores.loc[method, "bound"] == 0.6
    assert scores.loc["zero_ablate", "auc"] == scores.loc["zero_ablate", "bound"] == 1.0
    model, nodes, edges, clean, _ = task("sort_unique")
    clean, corrupted = task_pairs(torch.unique(clean, dim=0)[:20], every=True)
    scores = evaluate_discovery(model, nodes, edges, clean, corrupted, steps=2)[0].set_index("method")
    assert (scores.loc[["patch", "mean_ablate", "zero_ablate", "path patching"], "auc"] == 1.0).all()


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_exact_methods_find_the_true_circuit(name):
    """Zero ablation ranks every true component above every false one; the true circuit alone
    keeps the task (faithfulness >= 0.99) and its complement does not (<= 0.05)."""
    model, nodes, edges, clean, corrupted = task(name)
    scores, curves = evaluate_discovery(model, nodes, edges, clean, corrupted, steps=3)
    by = scores.set_index("method")
    assert by.loc["zero_ablate", "auc"] == 1.0
    assert by.loc["true circuit", "faithfulness"] >= 0.99
    assert by.loc["complement", "faithfulness"] <= 0.05
    edge = scores[scores.level == "edge"]
    assert (edge.auc.notna() | (edge.n_true == 0)).all() and not edge.note.str.startswith("refused").any()
    scored = scores[scores.auc.notna()]
    assert (scored.auc <= scored.bound + 1e-12).all()
    assert set(scores.level) == {"node", "edge", "edge (all)", "circuit"}
    assert set(curves.method) == {"patch", "mean_ablate", "zero_ablate"} and curves["size"].max() == len(nodes)


def test_faithfulness_ends_and_node_scores_of_zero_components():
    """Tracr pads unused heads with zeros: patching or ablating one changes nothing."""
    model, nodes, _, clean, corrupted = task("sort_unique")
    metric = output_metric(model(clean))
    every = {(k, l, h) for k, l, h in zip(nodes.kind, nodes.layer, nodes["head"])}
    assert faithfulness(model, clean, metric, every) == 1.0 and faithfulness(model, clean, metric, set()) == 0.0
    scores = component_scores(model, clean, corrupted, metric, "patch").merge(nodes, on=["kind", "layer", "head"])
    assert (scores.score[~scores.true] == 0).all() and (scores.score[scores.true] > 0).all()
    with pytest.raises(UserError, match="unknown node method"):
        component_scores(model, clean, corrupted, metric, "zero")


def naive_eap_ig(model, clean, corrupted, metric, sender, receiver, via, steps):
    """One edge: the metric's gradient at the receiver's own input, taken by autograd on a delta
    added there, averaged over the interpolated runs, dotted with the sender's write."""
    _, clean_cache = model.run_with_cache(clean)
    _, corrupt_cache = model.run_with_cache(corrupted)
    layer, head = sender
    write = (clean_cache[f"blocks.{layer}.attn.hook_z"] - corrupt_cache[f"blocks.{layer}.attn.hook_z"])[:, :, head] \
        @ model.blocks[layer].attn.W_O[head]
    base0, source0 = corrupt_cache["blocks.0.hook_resid_pre"], clean_cache["blocks.0.hook_resid_pre"]
    total = 0.0
    for k in range(1, steps + 1):
        delta = torch.zeros_like(write, requires_grad=True)
        hooks = [("blocks.0.hook_resid_pre", lambda resid, hook, a=k / steps: base0 + a * (source0 - base0))]
        if via == "logits":
            hooks.append((f"blocks.{model.cfg.n_layers - 1}.hook_resid_post", lambda resid, hook: resid + delta))
        else:
            model.set_split_qkv_inputs([via])

            def add(inputs, hook):
                inputs = inputs.clone()
                inputs[:, :, receiver[1]] += delta
                return inputs
            hooks.append((f"blocks.{receiver[0]}.hook_{via}_input", add))
        try:
            value = metric(model.run_with_hooks(corrupted, fwd_hooks=hooks))
        finally:
            model.set_split_qkv_inputs([])
        (grad,) = torch.autograd.grad(value, delta)
        total += float((grad * write.detach()).sum()) / steps
    return total


def test_eap_ig_equals_a_naive_per_edge_integrated_gradient():
    model, _, _, clean, corrupted = task("sort_unique")
    metric = output_metric(model(clean))
    frame = eap_ig(model, clean, corrupted, metric, steps=3).set_index(["sender_layer", "sender_head", "receiver_layer",
                                                                        "receiver_head", "via"])
    checked = [((0, 0), (1, 0), "q"), ((0, 0), (1, 0), "k"), ((0, 0), (1, 0), "v"), ((1, 0), (2, -1), "logits"),
               ((0, 0), (2, -1), "logits")]
    for sender, receiver, via in checked:
        expected = naive_eap_ig(model, clean, corrupted, metric, sender, receiver, via, 3)
        got = frame.loc[(*sender, *receiver, via), "attribution"]
        assert got == pytest.approx(expected, rel=1e-4, abs=1e-7), (sender, receiver, via)
    assert frame.attribution.abs().max() > 0
    with pytest.raises(UserError, match="steps=0 must be a positive integer"):
        eap_ig(model, clean, corrupted, metric, steps=0)


@pytest.mark.parametrize("method", ["patch", "eap", "eap_ig"])
def test_full_graph_edge_scores_equal_the_head_edge_tools_on_head_edges(method):
    """On the edges both score (head -> head q/k/v, head -> logits), the full-graph scores equal
    exact path patching, EAP and EAP-IG of ``analyses`` (a separate implementation: per-head
    hook_z writes through W_O, the intervention engine, suffix runs)."""
    from analyses.circuits.circuit_eval import graph_edge_scores
    from analyses.circuits.path_patching import edge_attribution, path_patch
    model, _, _, clean, corrupted = task("sort_unique")
    metric = output_metric(model(clean))
    ours = graph_edge_scores(model, clean, corrupted, metric, method, steps=3)
    ours = ours[(ours.sender_kind == "head") & ours.receiver_kind.isin(["head", "logits"])]
    peer = {"patch": lambda: path_patch(model, clean, corrupted, metric),
            "eap": lambda: edge_attribution(model, clean, corrupted, metric),
            "eap_ig": lambda: eap_ig(model, clean, corrupted, metric, steps=3)}[method]()
    value = peer["effect"] if "effect" in peer else peer["attribution"]
    expected = dict(zip(map(tuple, peer[["sender_layer", "sender_head", "receiver_layer", "receiver_head", "via"]]
                            .itertuples(index=False)), value))
    got = dict(zip(map(tuple, ours[["sender_layer", "sender_head", "receiver_layer", "receiver_head", "via"]]
                       .itertuples(index=False)), ours.score))
    assert got.keys() == expected.keys()
    for key in got:
        assert got[key] == pytest.approx(expected[key], rel=1e-4, abs=1e-6), key
    assert max(abs(v) for v in got.values()) > 0


def test_tracr_command_evaluates_discovery(tmp_path):
    from analyses.cli import main
    assert main(["tracr", "frac_prevs", "--vocab", "a,b", "--max-seq-len", "4", "--out", str(tmp_path), "--evaluate",
                 "--ig-steps", "2", "--pairs", "one"]) == 0
    scores = pd.read_csv(tmp_path / "discovery.csv").set_index("method")
    assert scores.loc["true circuit", "faithfulness"] >= 0.99 and scores.loc["complement", "faithfulness"] <= 0.05
    assert (tmp_path / "faithfulness_vs_size.png").stat().st_size > 0
    nodes = pd.read_csv(tmp_path / "ground_truth" / "nodes.csv")
    assert nodes.true.sum() == 2  # the map MLP and the aggregating head


def library_scores(name: str, vocab: list, max_seq_len: int, steps: int = 5):
    """What ``interp tracr`` stores, computed with the library alone: the truth, every input one
    shorter than the compiled length, every ordered pair of two, ``evaluate_discovery``."""
    from analyses.circuits.circuit_eval import program_inputs
    compilation = compile_with_graph(name, vocab, max_seq_len)
    model = from_tracr(compilation.assembled)
    nodes, edges = ground_truth(compilation, model)
    clean, corrupted = task_pairs(encode_inputs(model, program_inputs(vocab, max_seq_len - 1)), every=True)
    return nodes, edges, *evaluate_discovery(model, nodes, edges, clean, corrupted, steps=steps)


@pytest.fixture(scope="module")
def frac_prevs_dir(tmp_path_factory):
    from analyses.cli import main
    out = tmp_path_factory.mktemp("frac_prevs")
    assert main(["tracr", "frac_prevs", "--vocab", "a,b", "--max-seq-len", "4", "--out", str(out)]) == 0
    return out


def test_a_tracr_checkpoint_keeps_its_truth_and_task(frac_prevs_dir):
    from analyses.circuits.ground_truth import read_truth
    truth = read_truth(frac_prevs_dir)
    nodes, edges, _, _ = library_scores("frac_prevs", ["a", "b"], 4, steps=1)
    def unnumbered(frame):  # RASP numbers its labels per process (map_6 in one compile, map_9 in the next)
        return frame.assign(op=frame.op.str.replace(r"_\d+", "", regex=True))
    pd.testing.assert_frame_equal(unnumbered(truth.nodes), unnumbered(nodes))
    pd.testing.assert_frame_equal(unnumbered(truth.edges), unnumbered(edges))
    assert truth.task["inputs"] == [list(r) for r in itertools.product("ab", repeat=3)]
    assert truth.task["pairs"] == "every" and truth.task["outputs"] is None  # frac_prevs is numerical
    assert read_truth("toy") is None and read_truth(frac_prevs_dir / "ground_truth") is None


def test_circuit_command_scores_a_known_truth_as_the_library_does(frac_prevs_dir, tmp_path, capsys):
    from analyses.cli import main
    assert main(["circuit", "--model", str(frac_prevs_dir), "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    cli = pd.read_csv(tmp_path / "discovery.csv")
    library = library_scores("frac_prevs", ["a", "b"], 4)[2]
    assert list(cli.method) == list(library.method)
    for column in ("auc", "bound", "faithfulness", "n_true", "n_items"):
        np.testing.assert_allclose(cli[column], library[column], rtol=0, atol=1e-12, err_msg=column)
    by = cli.set_index("method")
    assert by.loc["path patching", "auc"] == 1.0 and by.loc["true circuit", "faithfulness"] >= 0.99
    assert f"{by.loc['EAP-IG (all)', 'auc']:.3f}".rstrip("0").rstrip(".") in printed and "true circuit" in printed
    assert (tmp_path / "faithfulness_vs_size.png").stat().st_size > 0


def test_report_of_a_known_truth_is_its_ground_truth_section(frac_prevs_dir, tmp_path, capsys):
    from analyses.cli import main
    assert main(["report", "--model", str(frac_prevs_dir), "--out", str(tmp_path)]) == 0
    page = (tmp_path / "report.md").read_text()
    assert "## Ground truth" in page and "`frac_prevs`" in page and "## Head roles" in page
    assert (tmp_path / "figures" / "faithfulness_vs_size.png").stat().st_size > 0
    library = library_scores("frac_prevs", ["a", "b"], 4)[2]
    np.testing.assert_allclose(pd.read_csv(tmp_path / "discovery.csv").auc, library.auc, rtol=0, atol=1e-12)


def test_per_prompt_effects_do_not_cancel_over_every_pair():
    """sort_freq over every pair of inputs: patching an upstream component (hist, the target
    position) from the clean run helps some pairs exactly as much as it hurts others, so the
    change of the mean metric is exactly 0; the mean absolute change per prompt sees it, and node
    patching finds the whole circuit (AUC 1.0)."""
    compilation = compile_with_graph("sort_freq", ["a", "b"], 5)
    model = from_tracr(compilation.assembled)
    nodes, edges = ground_truth(compilation, model)
    clean, corrupted = task_pairs(encode_inputs(model, [list(r) for r in itertools.product("ab", repeat=4)]), every=True)
    with torch.no_grad():
        logits = model(clean)
    upstream = nodes.true & (nodes.layer < model.cfg.n_layers - 1)
    mean = component_scores(model, clean, corrupted, output_metric(logits), "patch")
    per_prompt = component_scores(model, clean, corrupted, output_metric(logits, per_row=True), "patch")
    assert (mean.score[upstream] == 0).all() and (per_prompt.score[upstream] > 0.1).all()
    assert (per_prompt.score[~nodes.true] == 0).all()
    assert output_metric(logits, per_row=True)(logits.flip(0)).mean() == pytest.approx(float(output_metric(logits)(logits.flip(0))))
    scores = evaluate_discovery(model, nodes, edges, clean, corrupted, steps=2)[0].set_index("method")
    assert scores.loc["patch", "auc"] == 1.0 and scores.loc["edge patching (all)", "auc"] == 1.0
