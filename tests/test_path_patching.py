"""Exact path patching against TransformerLens's ``get_act_patch_direct_path`` on the same weights,
and against a naive three-run implementation where TransformerLens refuses (grouped-query keys and
values, parallel blocks, logits)."""

from __future__ import annotations

import pytest
import torch
from transformer_lens import patching as tl_patching

from analyses.roles.classify import classify_heads
from analyses.core.metrics import loss_metric
from analyses.circuits.edges import VIAS, edges_of
from analyses.circuits.path_patching import path_patch
from analyses.core.probes import corrupt_first_copy, probes_for
from interp import from_hf, load_model
from interp.bridge import boot_bridge
from interp.errors import UserError
from interp.random_models import random_hf_model, save_random_model

N_LAYERS, N_HEADS = 3, 4
# random weights large enough for attention to be far from uniform, so edges have effects well
# above the 1e-4 tolerance
INIT = 0.2


@pytest.fixture(scope="module")
def gpt2_pair():
    hf, tokenizer = random_hf_model("gpt2", seed=5, n_ctx=64, d_vocab=257, n_layer=N_LAYERS, n_embd=64,
                                    n_head=N_HEADS, initializer_range=INIT)
    return from_hf(hf, tokenizer).eval(), boot_bridge(hf, tokenizer).eval()


def induction_pair(model, n_prompts=3, seq_len=12, seed=4):
    probes = probes_for(model, n_prompts, seq_len, seed=seed)
    return probes.tokens, corrupt_first_copy(probes, seed=seed + 1), loss_metric(probes.tokens, probes.predictable)


def column(frame, name) -> torch.Tensor:
    return torch.tensor(frame[name].to_numpy())


def as_grid(frame, n_layers, n_heads) -> torch.Tensor:
    """path_patch rows of one sender and one via -> [n_layers, n_heads] as TransformerLens lays them out."""
    grid = torch.zeros(n_layers, n_heads)
    grid[frame.receiver_layer.tolist(), frame.receiver_head.tolist()] = column(frame, "value")
    return grid


SENDERS = [(0, 1), (0, 3), (1, 2)]


@pytest.mark.parametrize("via", ["q", "k", "v"])
@pytest.mark.parametrize("direction", ["denoise", "noise"])
def test_equals_transformer_lens_direct_path(gpt2_pair, via, direction):
    scratch, bridge = gpt2_pair
    clean, corrupted, metric = induction_pair(scratch)
    # noising is TransformerLens's function with the roles of the two runs swapped
    base, source = (corrupted, clean) if direction == "denoise" else (clean, corrupted)
    _, base_cache = bridge.run_with_cache(base)
    _, source_cache = bridge.run_with_cache(source)
    frames = {name: path_patch(model, clean, corrupted, metric, senders=SENDERS, via=via, direction=direction,
                               progress=False) for name, model in (("scratch", scratch), ("bridge", bridge))}
    base_value = metric(bridge(base)).item()
    for sender in SENDERS:
        tl = tl_patching.get_act_patch_direct_path(bridge, base, source_cache, base_cache, metric, *sender, via,
                                                   verbose=False).cpu()
        later = slice(sender[0] + 1, None)
        assert (tl[later] - base_value).abs().max() > 1e-3  # the paths move the metric: not a vacuous check
        for name, frame in frames.items():
            rows = frame[(frame.sender_layer == sender[0]) & (frame.sender_head == sender[1])]
            assert len(rows) == (N_LAYERS - 1 - sender[0]) * N_HEADS, name
            torch.testing.assert_close(as_grid(rows, N_LAYERS, N_HEADS)[later], tl[later], atol=1e-4, rtol=0)
            torch.testing.assert_close(column(rows, "effect"), column(rows, "value") - base_value, atol=1e-5, rtol=0)


# --------------------------------------------------------------------------- the naive version

def _run(model, tokens, hooks, keep=None):
    """One plain hooked forward -> (logits, the activation ``keep`` as it left its hooks)."""
    kept = {}
    extra = [(keep, lambda act, hook: kept.setdefault("act", act.detach().clone()))] if keep else []
    with torch.no_grad():
        logits = model.run_with_hooks(tokens, fwd_hooks=[*hooks, *extra])
    return logits, kept.get("act")


def _replace(value, index=(...,)):
    def hook(act, hook):
        act = act.clone()
        act[index] = value
        return act
    return hook


def naive_path_value(model, base, source, metric, sender, receiver, via) -> float:
    """One edge, the slow way: the sender's write measured as the change of hook_attn_out when only
    its hook_z slice takes the source value; then three separate runs (patched input -> that
    input's q/k/v -> the receiver's z alone)."""
    (sl, sh), (rl, rh) = sender, receiver
    z_name = f"blocks.{sl}.attn.hook_z"
    _, source_z = _run(model, source, [], keep=z_name)
    _, base_out = _run(model, base, [], keep=f"blocks.{sl}.hook_attn_out")
    _, moved_out = _run(model, base, [(z_name, _replace(source_z[:, :, sh], (slice(None), slice(None), sh)))],
                        keep=f"blocks.{sl}.hook_attn_out")
    write = moved_out - base_out
    if via == "logits":
        final = f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"
        logits, _ = _run(model, base, [(final, lambda act, hook: act + write)])
        return metric(logits).item()
    add_write = [(f"blocks.{rl}.hook_resid_pre", lambda act, hook: act + write)]
    _, patched_input = _run(model, base, add_write, keep=f"blocks.{rl}.attn.hook_{via}")
    _, receiver_z = _run(model, base, [(f"blocks.{rl}.attn.hook_{via}", _replace(patched_input))],
                         keep=f"blocks.{rl}.attn.hook_z")
    patch_z = _replace(receiver_z[:, :, rh], (slice(None), slice(None), rh))
    logits, _ = _run(model, base, [(f"blocks.{rl}.attn.hook_z", patch_z)])
    return metric(logits).item()


EDGES = [((0, 1), (1, 0), "q"), ((0, 1), (1, 3), "k"), ((0, 2), (2, 1), "v"), ((1, 3), (2, 2), "k"),
         ((0, 0), (2, 3), "v"), ((1, 0), None, "logits")]


@pytest.fixture(scope="module")
def family_models(tmp_path_factory):
    made = {}

    def make(family):
        if family not in made:
            directory = save_random_model(family, tmp_path_factory.mktemp(family), seed=3, num_hidden_layers=N_LAYERS,
                                          initializer_range=INIT)
            made[family] = load_model(directory).eval()
        return made[family]

    return make


@pytest.mark.parametrize("family", ["llama", "gpt_neox", "gpt2"])
def test_equals_naive_three_runs(family_models, gpt2_pair, family):
    """Grouped-query keys/values (llama: 4 query heads on 2 key/value heads) and parallel blocks
    (gpt_neox), where TransformerLens refuses, and logits edges everywhere."""
    model = gpt2_pair[0] if family == "gpt2" else family_models(family)
    if family == "llama":
        assert model.cfg.n_key_value_heads < model.cfg.n_heads
    if family == "gpt_neox":
        assert model.cfg.parallel_attn_mlp
    clean, corrupted, metric = induction_pair(model)
    for direction in ("denoise", "noise"):
        base, source = (corrupted, clean) if direction == "denoise" else (clean, corrupted)
        frame = path_patch(model, clean, corrupted, metric, senders=[e[0] for e in EDGES],
                           receivers=[e[1] for e in EDGES if e[1]], direction=direction, progress=False)
        base_value = metric(model(base)).item()
        expected, got = [], []
        for sender, receiver, via in EDGES:
            receiver = receiver or (model.cfg.n_layers, -1)
            row = frame[(frame.sender_layer == sender[0]) & (frame.sender_head == sender[1]) & (frame.via == via)
                        & (frame.receiver_layer == receiver[0]) & (frame.receiver_head == receiver[1])]
            assert len(row) == 1
            got.append(row.value.item())
            expected.append(naive_path_value(model, base, source, metric, sender, receiver, via))
        torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), atol=1e-4, rtol=0)
        assert max(abs(v - base_value) for v in expected) > 1e-3  # not a vacuous comparison


def test_gptmodel_patched_runs_start_after_the_receivers_attention(gpt2_pair):
    """Step 2 on GPTModel starts at the receiver layer's resid_mid: that layer's attention runs in
    the clean and corrupted runs and once for step 1, never per edge."""
    scratch, _ = gpt2_pair
    clean, corrupted, metric = induction_pair(scratch)
    arguments = dict(senders=[(0, 1), (1, 2)], receivers=[(2, 0), (2, 1), (2, 3)], via=("q", "v"), progress=False)
    path_patch(scratch, clean, corrupted, metric, **arguments)  # the hook self-test runs once, here
    calls = []
    handle = scratch.blocks[2].attn.register_forward_pre_hook(lambda module, args: calls.append(args[0].shape[0]))
    try:
        frame = path_patch(scratch, clean, corrupted, metric, **arguments)
    finally:
        handle.remove()
    assert len(frame) == 12 and len(calls) == 3, calls


def test_grouped_query_receiver_changes_only_its_own_attention(family_models):
    """Patching one query head's key input leaves the other head of its key/value group alone."""
    model = family_models("llama")
    clean, corrupted, metric = induction_pair(model)
    # receivers 0 and 1 share key/value head 0; the edge into 0 must differ from the edge into 1
    frame = path_patch(model, clean, corrupted, metric, senders=[(0, 1)], receivers=[(1, 0), (1, 1)], via="k",
                       progress=False)
    assert abs(frame.effect[0] - frame.effect[1]) > 1e-4


def test_normalize_and_sorting(gpt2_pair):
    scratch, _ = gpt2_pair
    clean, corrupted, metric = induction_pair(scratch)
    raw = path_patch(scratch, clean, corrupted, metric, senders=[(0, 2), (1, 1)], progress=False)
    normed = path_patch(scratch, clean, corrupted, metric, senders=[(0, 2), (1, 1)], normalize=True, progress=False)
    clean_value, corrupted_value = metric(scratch(clean)).item(), metric(scratch(corrupted)).item()
    expected = (raw.value - corrupted_value) / (clean_value - corrupted_value)
    expected = torch.tensor(expected.to_numpy())
    torch.testing.assert_close(column(normed, "value"), expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(column(normed, "effect"), expected, atol=1e-5, rtol=0)
    # (0, 2): 2 later layers x 4 heads x q/k/v + logits; (1, 2): 4 x 3 + logits
    assert len(raw) == (8 * 3 + 1) + (4 * 3 + 1)
    keys = list(zip(raw.sender_layer, raw.sender_head, raw.receiver_layer, raw.receiver_head))
    assert keys == sorted(keys)
    logits_rows = raw[raw.via == "logits"]
    assert (logits_rows.receiver_layer == N_LAYERS).all() and (logits_rows.receiver_head == -1).all()
    assert list(raw.columns) == ["sender_layer", "sender_head", "receiver_layer", "receiver_head", "via", "value",
                                 "effect", "ci_low", "ci_high", "n_prompts"]


@pytest.mark.parametrize("via", ["q", ("v", "k"), ("logits", "q", "k", "v"), "logits"])
def test_edges_are_every_pair_once_sorted(gpt2_pair, via):
    scratch, _ = gpt2_pair
    senders = [(1, 3), (0, 2), (1, 3), (2, 0), (0, 0)]  # unsorted, with a repeat
    receivers = [(2, 1), (1, 0), (2, 1), (0, 3), (1, 2)]
    vias = [via] if isinstance(via, str) else list(via)
    expected = {(s, r, VIAS.index(v)) for s in senders for r in receivers for v in vias
                if v != "logits" and s[0] < r[0]}
    expected |= {(s, (N_LAYERS, -1), VIAS.index("logits")) for s in senders if "logits" in vias}
    edges = edges_of(scratch, senders, receivers, via)
    assert [tuple(e) for e in edges] == sorted(expected)
    assert all(e.via == VIAS[e[2]] for e in edges)


def test_bad_input(gpt2_pair):
    scratch, _ = gpt2_pair
    clean, corrupted, metric = induction_pair(scratch)
    with pytest.raises(UserError, match="unknown via 'z'"):
        path_patch(scratch, clean, corrupted, metric, via="z")
    with pytest.raises(UserError, match=r"head L0H9 out of range"):
        path_patch(scratch, clean, corrupted, metric, senders=[(0, 9)])
    with pytest.raises(UserError, match=r"head L5H0 out of range"):
        path_patch(scratch, clean, corrupted, metric, receivers=[(5, 0)])
    with pytest.raises(UserError, match="direction"):
        path_patch(scratch, clean, corrupted, metric, senders=[(0, 0)], direction="sideways")
    with pytest.raises(UserError, match="no edge"):  # a sender after its receiver is no pair
        path_patch(scratch, clean, corrupted, metric, senders=[(2, 0)], receivers=[(1, 0)], via="q")
    frame = path_patch(scratch, clean, corrupted, metric, senders=[(0, 0), (2, 0)], receivers=[(1, 0)], via="q",
                       progress=False)
    assert list(zip(frame.sender_layer, frame.receiver_layer)) == [(0, 1)]


def test_toy_previous_token_head_feeds_induction_heads_through_keys():
    """The embedded model: the previous-token head 0.3 -> the layer-1 induction heads. Noising
    (clean run, the corrupted write into one input) shows what the induction heads need; the
    denoising pair of ``corrupt_first_copy`` cannot be restored through the key alone (the first
    copy's tokens are still corrupted), so necessity is the right question here."""
    toy = load_model("toy").eval()
    probes = probes_for(toy, 8, 48, seed=0)
    scores = classify_heads(toy, probes=probes, n_boot=10, progress=False).set_index(["measure", "layer", "head"]).score
    assert scores["previous_token", 0, 3] > 0.9
    induction = [(1, h) for h in range(toy.cfg.n_heads) if scores["induction", 1, h] > 0.5]
    assert len(induction) >= 4
    clean, corrupted = probes.tokens, corrupt_first_copy(probes, seed=1)
    metric = loss_metric(clean, probes.predictable)
    frame = path_patch(toy, clean, corrupted, metric, senders=[(0, 3)], receivers=induction, via=("q", "k", "v"),
                       direction="noise", progress=False)
    total = frame.groupby("via").effect.apply(lambda e: e.abs().sum())
    assert total["k"] > 5 * total["q"] and total["k"] > 5 * total["v"], total.to_dict()
    by_head = frame.pivot_table(index="receiver_head", columns="via", values="effect")
    assert (by_head["k"] > 0).all() and (by_head["k"] > by_head["q"].abs()).all()


def test_refused_where_head_writes_are_not_z_times_w_o(gpt2_pair, monkeypatch):
    """Where the self-test does not find the heads' z @ W_O adding up to hook_attn_out (e.g. a
    norm between them), a sender's write is unknown: refused in one line, never approximated."""
    import analyses.circuits.edges as module  # where output_weights reads the self-test

    scratch, _ = gpt2_pair
    clean, corrupted, metric = induction_pair(scratch)
    real = module.check_hooks(scratch)
    monkeypatch.setattr(module, "check_hooks", lambda model: type(real)(**{**vars(real), "sum_error": 1.0}))
    with pytest.raises(UserError, match="does not give hook_attn_out"):
        path_patch(scratch, clean, corrupted, metric, senders=[(0, 0)], via="q")


def test_refused_where_an_input_edit_does_not_reach_the_output(gpt2_pair, monkeypatch):
    """A backend whose hook_k edits change nothing would leave every key edge at the base value:
    key edges are refused in one line; query edges, whose edits do reach, still run."""
    import analyses.core.hook_check as hook_check

    scratch, _ = gpt2_pair
    clean, corrupted, metric = induction_pair(scratch)
    real = hook_check.check_hooks(scratch)
    broken = type(real)(**{**vars(real), "reaches_output": {**real.reaches_output, "hook_k": False}})
    monkeypatch.setattr(hook_check, "check_hooks", lambda model: broken)
    with pytest.raises(UserError, match="^path_patch needs edits of hook_k, which do not reach the output"):
        path_patch(scratch, clean, corrupted, metric, senders=[(0, 0)], via=("q", "k"))
    assert len(path_patch(scratch, clean, corrupted, metric, senders=[(0, 0)], via="q", progress=False)) == 8


def test_grouped_query_bridge_equals_gptmodel():
    """Grouped-query keys and values through the bridge (ours; TransformerLens refuses them) equal
    our GPTModel on the same Llama weights."""
    hf, tokenizer = random_hf_model("llama", seed=3, num_hidden_layers=N_LAYERS, initializer_range=INIT)
    bridge, scratch = boot_bridge(hf, tokenizer).eval(), from_hf(hf, tokenizer).eval()
    clean, corrupted, metric = induction_pair(scratch)
    frames = [path_patch(m, clean, corrupted, metric, senders=[(0, 1), (1, 2)], direction="noise", progress=False)
              for m in (bridge, scratch)]
    torch.testing.assert_close(column(frames[0], "value"), column(frames[1], "value"), atol=1e-4, rtol=0)
    assert frames[1].effect.abs().max() > 1e-2
