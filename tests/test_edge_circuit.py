"""Circuits of edges (analyses.circuits.edge_circuit): the metric with only some edges kept, against a
naive computation by hand-written hooks, and its ends against the clean run and path patching."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from analyses.circuits.edge_circuit import circuit_scores, circuit_values, faithfulness_curve, faithfulness_figure
from analyses.circuits.edges import edges_of
from analyses.circuits.path_patching import path_patch
from analyses.core.metrics import loss_metric
from analyses.core.probes import corrupt_first_copy, probes_for
from interp import load_model
from interp.errors import UserError
from interp.random_models import save_random_model


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    directory = save_random_model("llama", tmp_path_factory.mktemp("llama"), seed=3, num_hidden_layers=3,
                                  initializer_range=0.2)
    return load_model(directory).eval()


@pytest.fixture(scope="module")
def pair(llama):
    probes = probes_for(llama, 3, 12, seed=4)
    return probes.tokens, corrupt_first_copy(probes, seed=5), loss_metric(probes.tokens, probes.predictable)


def _z(model, tokens, hooks=()):
    kept = {}

    def keep(layer):
        def store(z, hook):
            kept[layer] = z.detach().clone()
        return store

    with torch.no_grad():
        logits = model.run_with_hooks(tokens, fwd_hooks=[*hooks, *((f"blocks.{l}.attn.hook_z", keep(l))
                                                                   for l in range(model.cfg.n_layers))])
    return logits, kept


def naive_value(model, clean, corrupted, metric, removed, passes: int | None = None) -> float:
    """The clean run with each removed edge (sender, receiver, via) carrying the sender's corrupted
    write, by fixed-point passes: each pass adds (corrupted z - the previous pass's z) of each sender
    through its W_O, one hook per edge, to the receiver's own input. ``passes``: by default as many
    as layers + 1, so every sender's z has settled (a sender's z depends only on earlier layers);
    removed edges that chain at most d deep need d + 1."""
    _, corrupted_z = _z(model, corrupted)
    _, current = _z(model, clean)
    saved = model.split_qkv_inputs
    model.set_split_qkv_inputs(("q", "k", "v"))
    try:
        for _ in range(passes or model.cfg.n_layers + 1):
            hooks = []
            for (sl, sh), (rl, rh), via in removed:
                delta = (corrupted_z[sl][:, :, sh] - current[sl][:, :, sh]) @ model.blocks[sl].attn.W_O[sh].detach()
                if via == "logits":
                    hooks.append((f"blocks.{model.cfg.n_layers - 1}.hook_resid_post",
                                  lambda resid, hook, delta=delta: resid + delta))
                else:
                    def add(resid, hook, delta=delta, rh=rh):
                        resid = resid.clone()
                        resid[:, :, rh] += delta
                        return resid
                    hooks.append((f"blocks.{rl}.hook_{via}_input", add))
            logits, current = _z(model, clean, hooks)
    finally:
        model.set_split_qkv_inputs(saved)
    return float(metric(logits))


def test_a_circuit_equals_a_naive_fixed_point_of_hand_written_hooks(llama, pair):
    clean, corrupted, metric = pair
    candidates = edges_of(llama, via=("q", "k", "v", "logits"))
    rng = np.random.default_rng(0)
    masks = [rng.random(len(candidates)) < share for share in (0.3, 0.7)]
    # a chain: L0H1 -> L1H2.q and L1H2 -> L2H0.v and L1H2 -> logits removed, so L1H2's write along
    # its own removed edges differs from its clean write
    chain = [((0, 1), (1, 2), "q"), ((1, 2), (2, 0), "v"), ((1, 2), (3, -1), "logits")]
    keys = [(e.sender, e.receiver, e.via) for e in candidates]
    masks.append(np.array([key not in chain for key in keys]))
    ours = circuit_values(llama, clean, corrupted, metric, candidates, masks)
    for mask, value in zip(masks, ours.tolist()):
        removed = [key for key, kept in zip(keys, mask) if not kept]
        assert value == pytest.approx(naive_value(llama, clean, corrupted, metric, removed), abs=1e-4)
    assert abs(ours[-1] - circuit_values(llama, clean, corrupted, metric, candidates,
                                         [np.ones(len(candidates), dtype=bool)])[0]) > 1e-3  # the chain matters


def test_the_ends_are_the_clean_run_and_one_edge_removed_is_path_patching_by_noising(llama, pair):
    clean, corrupted, metric = pair
    senders, receivers = [(0, 0), (0, 3), (1, 1)], [(1, 1), (2, 2)]
    paths = path_patch(llama, clean, corrupted, metric, senders=senders, receivers=receivers, direction="noise",
                       progress=False)
    candidates = edges_of(llama, senders, receivers)
    assert len(paths) == len(candidates)
    all_but_one = [np.arange(len(candidates)) != i for i in range(len(candidates))]
    values = circuit_values(llama, clean, corrupted, metric, candidates,
                            [np.ones(len(candidates), dtype=bool), *all_but_one])
    with torch.no_grad():
        assert values[0].item() == pytest.approx(metric(llama(clean)).item(), abs=1e-5)
    assert torch.allclose(values[1:], torch.tensor(paths["value"].to_numpy()), atol=1e-4)


def test_the_curve_reads_its_ends_and_its_complement(llama, pair):
    clean, corrupted, metric = pair
    candidates = edges_of(llama, [(0, 0), (0, 3), (1, 1)], [(1, 1), (2, 2)])
    order = np.arange(len(candidates))[::-1]
    curve = faithfulness_curve(llama, clean, corrupted, metric, candidates, order, [0, 3, len(candidates)])
    assert curve["faithfulness"].iloc[0] == pytest.approx(0.0, abs=1e-6)
    assert curve["faithfulness"].iloc[-1] == pytest.approx(1.0, abs=1e-6)
    assert curve["complement"].iloc[0] == pytest.approx(1.0, abs=1e-6)
    kept = np.zeros(len(candidates), dtype=bool)
    kept[order[:3]] = True
    by_hand = circuit_values(llama, clean, corrupted, metric, candidates, [kept, ~kept])
    assert curve["value"].iloc[1] == pytest.approx(by_hand[0].item(), abs=1e-6)
    assert curve["complement_value"].iloc[1] == pytest.approx(by_hand[1].item(), abs=1e-6)


def test_bad_circuits_and_orders_are_refused_in_one_line(llama, pair):
    clean, corrupted, metric = pair
    candidates = edges_of(llama, [(0, 0)], [(1, 1)])
    with pytest.raises(UserError, match="boolean mask of shape"):
        circuit_values(llama, clean, corrupted, metric, candidates, [np.ones(2, dtype=int)])
    with pytest.raises(UserError, match="rank every one"):
        faithfulness_curve(llama, clean, corrupted, metric, candidates, [0, 0, 1, 2], [1])
    with pytest.raises(UserError, match="sizes must be integers"):
        faithfulness_curve(llama, clean, corrupted, metric, candidates, np.arange(len(candidates)), [99])


def test_the_figure_draws_edge_counts_from_0_and_each_complement_against_the_edges_it_removes(llama, pair):
    clean, corrupted, metric = pair
    candidates = edges_of(llama, [(0, 0), (0, 1), (1, 0)], [(1, 1), (2, 0)])
    sizes = [0, 1, 2, len(candidates)]
    curve = faithfulness_curve(llama, clean, corrupted, metric, candidates, np.arange(len(candidates)), sizes)
    figure = faithfulness_figure({"exact": curve, "by hand": pd.DataFrame(
        {"size": sizes, "faithfulness": [0.0, 0.5, 0.7, 1.0], "complement": [1.0, 0.6, 0.2, 0.0]})},
        len(candidates), "title")
    figure.canvas.draw()
    kept_ax, removed_ax = figure.axes
    for ax in (kept_ax, removed_ax):
        assert ax.get_xlim() == (0, len(candidates))
        ticks = [t.get_text() for t in ax.get_xticklabels() if t.get_visible() and t.get_text()]
        assert ticks and not any("-" in t or "\u2212" in t for t in ticks), ticks  # no negative edge count
        for line in ax.get_lines():
            assert min(line.get_xdata()) >= 0
    assert "kept" in kept_ax.get_xlabel() and "removed" in removed_ax.get_xlabel()
    # each panel holds one curve per ranking: the circuits on the left, their complements on the right
    drawn = [line for line in kept_ax.get_lines() if len(line.get_xdata()) == len(sizes)]
    assert [list(line.get_ydata()) for line in drawn] == [list(curve["faithfulness"]), [0.0, 0.5, 0.7, 1.0]]
    drawn = [line for line in removed_ax.get_lines() if len(line.get_xdata()) == len(sizes)]
    assert [list(line.get_ydata()) for line in drawn] == [list(curve["complement"]), [1.0, 0.6, 0.2, 0.0]]


def test_circuits_are_scored_in_chunks_of_prompts_within_the_budget(llama, pair):
    clean, corrupted, metric = pair
    candidates = edges_of(llama, via=("q", "k", "v", "logits"))
    rng = np.random.default_rng(1)
    masks = [np.zeros(len(candidates), dtype=bool), rng.random(len(candidates)) < 0.5]
    whole = circuit_scores(llama, clean, corrupted, metric, candidates, masks)
    rows = []
    with llama.hooks(fwd_hooks=[("blocks.0.hook_resid_pre", lambda resid, hook: rows.append(len(resid)))]):
        chunked = circuit_scores(llama, clean, corrupted, metric, candidates, masks, memory_mb=1e-3)
    assert rows and max(rows) == 1 < len(clean)  # one prompt per forward, corrupted and clean alike
    assert torch.allclose(chunked.values, whole.values, atol=1e-5)
    assert torch.allclose(chunked.numerators, whole.numerators, atol=1e-5)
    # a hand-written loop of forwards: the fixed point of hooks per circuit, over every prompt at once
    keys = [(e.sender, e.receiver, e.via) for e in candidates]
    for mask, value in zip(masks, chunked.values.tolist()):
        removed = [key for key, kept in zip(keys, mask) if not kept]
        assert value == pytest.approx(naive_value(llama, clean, corrupted, metric, removed), abs=1e-4)
