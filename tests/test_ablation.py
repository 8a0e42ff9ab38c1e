"""Head ablation against a hand-computed forward, a peer backend, and hand-written hooks."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from analyses.interventions.ablation import (
    ablate_heads,
    ablation_sweep,
    head_importance,
    aligned_mean,
    leave_one_out_mean,
    pruning_curve,
    resample_index,
)
from analyses.interventions.attribution import shortlist_patch_heads
from analyses.roles.causal_check import ablation_effects
from analyses.roles.classify import classify_heads
from analyses.interventions.engine import gradient_parts, rows_per_chunk
from analyses.core.metrics import logit_diff_metric, loss_metric
from analyses.interventions.patching import patch_heads
from analyses.core.probes import RepeatedProbes, probes_for
from interp import ByteTokenizer, GPTConfig, GPTModel, load_model
from interp.errors import UserError
from interp.tokenizer import as_tokenizer, encode_texts


class TinyTokenizer(ByteTokenizer):
    """Ids 0..9 as tokens and 10 as the start token: the tiny model's whole vocabulary."""

    bos_token_id = 10
    vocab_size = 11

    def ordinary_ids(self) -> list[int]:
        return list(range(10))


@pytest.fixture(scope="module")
def tiny():
    """One attention-only layer, two heads: small enough to compute by hand."""
    torch.manual_seed(0)
    cfg = GPTConfig(d_vocab=11, n_ctx=8, d_model=8, n_heads=2, n_layers=1, attn_only=True)
    model = GPTModel(cfg, TinyTokenizer()).eval()
    tokens = torch.tensor([[10, 3, 4, 5, 3, 4], [10, 7, 1, 2, 7, 1], [10, 6, 6, 0, 9, 8]])
    return model, tokens


def hand_forward(model, tokens, replace_head=None, replacement=None):
    """Loss of the tiny model written out with plain tensor ops; head ``replace_head``'s z is
    replaced by ``replacement`` (batch or 1, pos, d_head)."""
    attn, n_pos = model.blocks[0].attn, tokens.shape[1]
    x = model.embed.weight[tokens] + model.pos_embed.weight[:n_pos]
    h = F.layer_norm(x, (8,), model.blocks[0].ln1.weight, model.blocks[0].ln1.bias, 1e-5)
    heads = []
    for head in range(2):
        cols = slice(4 * head, 4 * head + 4)
        q = h @ attn.W_query.weight[cols].T + attn.W_query.bias[cols]
        k = h @ attn.W_key.weight[cols].T + attn.W_key.bias[cols]
        v = h @ attn.W_value.weight[cols].T + attn.W_value.bias[cols]
        scores = q @ k.transpose(1, 2) / math.sqrt(4)
        scores = scores.masked_fill(torch.triu(torch.ones(n_pos, n_pos, dtype=torch.bool), 1), -torch.inf)
        z = scores.softmax(-1) @ v
        heads.append(replacement.expand_as(z) if head == replace_head else z)
    resid = x + torch.cat(heads, -1) @ attn.out_proj.weight.T + attn.out_proj.bias
    logits = F.layer_norm(resid, (8,), model.ln_final.weight, model.ln_final.bias, 1e-5) @ model.embed.weight.T
    return F.cross_entropy(logits[:, :-1].reshape(-1, 11), tokens[:, 1:].reshape(-1)).item(), heads


def test_zero_mean_resample_match_hand_computation(tiny):
    model, tokens = tiny
    with torch.no_grad():
        unablated, heads = hand_forward(model, tokens)
        zero, _ = hand_forward(model, tokens, 1, torch.zeros(1, 6, 4))
        # leave-one-out: prompt b's replacement is the mean of the other two prompts' outputs
        others = torch.stack([(heads[1][1] + heads[1][2]) / 2, (heads[1][0] + heads[1][2]) / 2,
                              (heads[1][0] + heads[1][1]) / 2])
        mean, _ = hand_forward(model, tokens, 1, others)
        index = resample_index(3, 3, same_batch=True, seed=5)
        resample, _ = hand_forward(model, tokens, 1, heads[1][index])
    assert ablate_heads(model, tokens, [], "zero") == pytest.approx(unablated, abs=1e-5)
    assert ablate_heads(model, tokens, [(0, 1)], "zero") == pytest.approx(zero, abs=1e-5)
    assert ablate_heads(model, tokens, [(0, 1)], "mean") == pytest.approx(mean, abs=1e-5)
    assert ablate_heads(model, tokens, [(0, 1)], "resample", seed=5) == pytest.approx(resample, abs=1e-5)
    assert len({zero, mean, resample, unablated}) == 4  # the methods are told apart


def test_resample_index_is_a_seeded_derangement():
    for seed in range(5):
        index = resample_index(6, 6, same_batch=True, seed=seed)
        assert sorted(index.tolist()) == list(range(6)) and (index != torch.arange(6)).all()
        assert torch.equal(index, resample_index(6, 6, same_batch=True, seed=seed))
    assert resample_index(4, 10, same_batch=False, seed=0).max() < 10
    with pytest.raises(ValueError, match="at least 2 prompts"):
        resample_index(1, 1, same_batch=True, seed=0)


def test_reference_batch_for_mean(tiny):
    model, tokens = tiny
    reference = tokens.flip(1)
    with torch.no_grad():
        _, ref_heads = hand_forward(model, reference)
        expected, _ = hand_forward(model, tokens, 0, ref_heads[0].mean(0, keepdim=True))
    assert ablate_heads(model, tokens, [(0, 0)], "mean", reference=reference) == pytest.approx(expected, abs=1e-5)


@pytest.fixture(scope="module")
def prompts():
    return torch.randint(0, 256, (3, 10), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("method", ["zero", "mean", "resample"])
def test_sweeps_agree_across_backends(scratch_gpt2, bridge_gpt2, prompts, method):
    """GPTModel (suffix runs from cached residuals) and the bridge (full forwards) agree."""
    ours = ablation_sweep(scratch_gpt2, prompts, "each_head", method, progress=False)
    peer = ablation_sweep(bridge_gpt2, prompts, "each_head", method, progress=False)
    assert list(ours["target"]) == [f"L{l}H{h}" for l in range(2) for h in range(4)]
    torch.testing.assert_close(torch.tensor(ours["metric"]), torch.tensor(peer["metric"]), atol=1e-4, rtol=0)
    assert ours["effect"].abs().max() > 1e-4


def naive_ablated_loss(model, tokens, heads, real=None):
    """Mean next-token loss over the real predicted tokens with ``heads`` zeroed by hand-written
    hooks on ``hook_z[:, :, h]`` (no analyses code involved)."""
    def zero(head):
        def hook(z, hook):
            z = z.clone()
            z[:, :, head] = 0
            return z

        return hook

    hooks = [(f"blocks.{layer}.attn.hook_z", zero(head)) for layer, head in heads]
    with torch.no_grad():
        logits = model.run_with_hooks(tokens, fwd_hooks=hooks)
    losses = F.cross_entropy(logits[:, :-1].transpose(1, 2), tokens[:, 1:], reduction="none")
    return (losses.mean() if real is None else losses[real[:, 1:]].mean()).item()


def test_layer_and_group_targets(scratch_gpt2, prompts):
    frame = ablation_sweep(scratch_gpt2, prompts, "each_layer", "zero", progress=False)
    assert list(frame["target"]) == ["L0", "L1"] and list(frame["n_heads"]) == [4, 4]
    for layer in range(2):
        expected = naive_ablated_loss(scratch_gpt2, prompts, [(layer, h) for h in range(4)])
        assert frame["metric"].iloc[layer] == pytest.approx(expected, abs=1e-5)
    assert frame["baseline"].iloc[0] == pytest.approx(naive_ablated_loss(scratch_gpt2, prompts, []), abs=1e-5)
    groups = ablation_sweep(scratch_gpt2, prompts, {"pair": [(0, 1), (1, 2)]}, "zero", progress=False)
    assert groups["target"].item() == "pair" and groups["layer"].isna().item()
    assert groups["metric"].item() == pytest.approx(naive_ablated_loss(scratch_gpt2, prompts, [(1, 2), (0, 1)]), abs=1e-5)


def test_pattern_preserving_matches_hand_written_hooks(scratch_gpt2, bridge_gpt2, prompts):
    metric = loss_metric(prompts)
    with torch.no_grad():
        _, cache = scratch_gpt2.run_with_cache(prompts)

        def zero_head(z, hook):
            z = z.clone()
            z[:, :, 1] = 0
            return z

        frozen = [(f"blocks.{l}.attn.hook_pattern", lambda p, hook, l=l: cache[f"blocks.{l}.attn.hook_pattern"])
                  for l in range(2)]
        expected = metric(scratch_gpt2.run_with_hooks(prompts, fwd_hooks=[("blocks.0.attn.hook_z", zero_head), *frozen]))
        free = metric(scratch_gpt2.run_with_hooks(prompts, fwd_hooks=[("blocks.0.attn.hook_z", zero_head)]))
    preserved = ablate_heads(scratch_gpt2, prompts, [(0, 1)], "zero", preserve_patterns=True)
    assert preserved == pytest.approx(expected.item(), abs=1e-5)
    assert abs(expected.item() - free.item()) > 1e-6  # freezing changed something
    on_bridge = ablate_heads(bridge_gpt2, prompts, [(0, 1)], "zero", preserve_patterns=True)
    assert on_bridge == pytest.approx(expected.item(), abs=1e-4)


def test_importance_is_the_gate_derivative(scratch_gpt2, prompts):
    """For one prompt and zero ablation, Michel et al.'s |dL/d gate| by finite differences."""
    one = prompts[:1]
    metric = loss_metric(one)
    importance = head_importance(scratch_gpt2, one, "zero")

    def gated(scale):
        def hook(z, hook):
            z = z.clone()
            z[:, :, 2] *= scale
            return z

        with torch.no_grad():
            return metric(scratch_gpt2.run_with_hooks(one, fwd_hooks=[("blocks.1.attn.hook_z", hook)]).double()).item()

    derivative = (gated(1 + 1e-2) - gated(1 - 1e-2)) / 2e-2
    assert importance[1, 2].item() == pytest.approx(abs(derivative), rel=1e-2, abs=1e-5)


def gate_importance(model, tokens, frozen_patterns=False):
    """Michel et al.'s importance computed independently: a gate per prompt and head multiplies
    the head's output; importance = sum over prompts of |d loss / d gate| at gates = 1. With
    ``frozen_patterns`` every pattern is replaced by its (constant) value in the clean run."""
    gates = torch.ones(2, tokens.shape[0], 4, requires_grad=True)  # (layer, batch, head)
    names = [f"blocks.{l}.attn.hook_pattern" for l in range(2)]
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=lambda name: name in names)
    frozen = [(name, lambda pattern, hook, name=name: cache[name].clone()) for name in names] if frozen_patterns else []

    def gate(layer):
        return lambda z, hook: z * gates[layer][:, None, :, None]

    logits = model.run_with_hooks(tokens, fwd_hooks=[(f"blocks.{l}.attn.hook_z", gate(l)) for l in range(2)] + frozen)
    loss = F.cross_entropy(logits[:, :-1].transpose(1, 2), tokens[:, 1:])
    (grad,) = torch.autograd.grad(loss, gates)
    return grad.abs().sum(dim=1)  # (layer, head)


@pytest.mark.parametrize("fixture", ["scratch_gpt2", "bridge_gpt2"])
@pytest.mark.parametrize("method,preserve_patterns", [("zero", False), ("zero", True), ("resample", False)])
def test_importance_in_chunks_of_prompts_is_the_batch_importance(request, fixture, prompts, method,
                                                                 preserve_patterns):
    """head_importance over chunks of one prompt (memory_mb=1e-6), each chunk's gradient weighted by
    its share of the metric, equals one backward over the batch (4 GB) to 1e-5, for the loss and a
    per-prompt logit difference, with replacements for every prompt (zero) or one per prompt
    (resample); for zero ablation of the loss it is also the independent gate derivative."""
    model = request.getfixturevalue(fixture)
    metrics = [loss_metric(prompts), logit_diff_metric(prompts[:, -1], torch.arange(3) + 5)]
    assert len(gradient_parts(model, prompts, metrics[0], 1e-6)[0]) == 3  # one prompt each: the chunks do happen
    for metric in metrics:
        whole, chunked = (head_importance(model, prompts, method, metric, preserve_patterns=preserve_patterns, seed=1,
                                          memory_mb=budget) for budget in (4096, 1e-6))
        assert whole.max() - whole.min() > 1e-3  # the heads differ: a wrong combination would show
        torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=0)
    if method == "zero":
        chunked = head_importance(model, prompts, "zero", metrics[0], preserve_patterns=preserve_patterns,
                                  memory_mb=1e-6)
        expected = gate_importance(model, prompts, frozen_patterns=preserve_patterns)
        torch.testing.assert_close(chunked, expected, atol=1e-6, rtol=1e-4)


def test_pruning_curve(scratch_gpt2, prompts):
    curve = pruning_curve(scratch_gpt2, prompts, "zero", progress=False)
    assert list(curve["step"]) == list(range(9)) and curve["fraction"].iloc[-1] == 1.0
    importance = gate_importance(scratch_gpt2, prompts)
    expected_order = [divmod(int(i), 4) for i in importance.flatten().argsort(stable=True)]
    order = [tuple(map(int, pair)) for pair in curve[["layer", "head"]].iloc[1:].to_numpy()]
    assert order == expected_order
    torch.testing.assert_close(torch.tensor(curve["importance"].iloc[1:].to_numpy(), dtype=torch.float32),
                               torch.stack([importance[l, h] for l, h in order]), atol=1e-6, rtol=1e-4)
    for step in range(9):  # step i: the first i heads of the order ablated together, by hand
        expected = naive_ablated_loss(scratch_gpt2, prompts, order[:step])
        assert curve["metric"].iloc[step] == pytest.approx(expected, abs=1e-5)
    assert curve["baseline"].iloc[0] == pytest.approx(naive_ablated_loss(scratch_gpt2, prompts, []), abs=1e-5)


def test_pattern_preserving_pruning_orders_by_the_pattern_preserving_importance(scratch_gpt2, bridge_gpt2, prompts):
    """With preserve_patterns, importance is the gate derivative with every pattern held at its
    clean value (the ablation the curve then runs), not the free one."""
    curve = pruning_curve(scratch_gpt2, prompts, "zero", preserve_patterns=True, progress=False)
    frozen = gate_importance(scratch_gpt2, prompts, frozen_patterns=True)
    free = gate_importance(scratch_gpt2, prompts)
    assert (frozen[0] - free[0]).abs().max() > 1e-5  # layer-0 heads act through layer-1 patterns too (float noise ~1e-8)
    expected_order = [divmod(int(i), 4) for i in frozen.flatten().argsort(stable=True)]
    order = [tuple(map(int, pair)) for pair in curve[["layer", "head"]].iloc[1:].to_numpy()]
    assert order == expected_order
    torch.testing.assert_close(torch.tensor(curve["importance"].iloc[1:].to_numpy(), dtype=torch.float32),
                               torch.stack([frozen[l, h] for l, h in order]), atol=1e-6, rtol=1e-4)
    on_bridge = pruning_curve(bridge_gpt2, prompts, "zero", preserve_patterns=True, progress=False)
    assert (on_bridge["importance"] - curve["importance"]).abs().max() < 1e-4


def test_leave_one_out_mean_by_hand():
    """Three prompts of two positions (scalar outputs); the third prompt is padding at position 1."""
    z = torch.tensor([[1.0, 10.0], [3.0, 20.0], [5.0, 99.0]])[..., None]
    real = torch.tensor([[True, True], [True, True], [True, False]])
    expected = torch.tensor([
        [(3 + 5) / 2, 20.0],  # position 1: the third prompt is padding there, so only the second counts
        [(1 + 5) / 2, 10.0],
        [(1 + 3) / 2, (10 + 20) / 2],  # the third prompt's padded position: the others' only real one
    ])[..., None]
    torch.testing.assert_close(leave_one_out_mean(z, real), expected)
    lonely = torch.tensor([[True, True], [True, False], [True, False]])  # position 1 real in prompt 0 only
    assert leave_one_out_mean(z, lonely)[0, 1].item() == pytest.approx((3 + 5) / 2)  # the others' real positions
    with pytest.raises(UserError, match="at least 2 prompts"):
        leave_one_out_mean(z[:1], real[:1])


def test_places_and_position_aligned_mean_by_hand():
    """Two probes of 8 tokens: start, prefix, segment, segment again, filler."""
    tokens = torch.tensor([[0, 9, 1, 2, 1, 2, 8, 7],    # prefix 1, period 2: filler at 6, 7
                           [0, 9, 8, 1, 2, 1, 2, 7]])   # prefix 2, period 2: filler at 7
    probes = RepeatedProbes(tokens, torch.tensor([2, 2]), torch.tensor([2, 3]), torch.arange(1, 10))
    start, prefix, first, second, filler = (region * 8 for region in range(5))
    assert probes.places.tolist() == [
        [start, prefix, first, first + 1, second, second + 1, filler, filler + 1],
        [start, prefix, prefix + 1, first, first + 1, second, second + 1, filler],
    ]
    z = torch.arange(16, dtype=torch.float).reshape(2, 8, 1)  # prompt 0: 0..7, prompt 1: 8..15
    expected = torch.tensor([
        [8, 9, 11, 12, 13, 14, 15, 15],  # prompt 0's filler + 1 (pos 7) has no partner: prompt 1 at pos 7
        [0, 1, 2, 2, 3, 4, 5, 6],       # prompt 1's prefix + 1 (pos 2) has no partner: prompt 0 at pos 2
    ], dtype=torch.float)[..., None]
    torch.testing.assert_close(aligned_mean(z, probes.places), expected)


def test_mean_aligned_ablation_matches_hand_forward(tiny):
    """Position-aligned mean ablation of the tiny model, the replacement written out by hand."""
    model, _ = tiny
    tokens = torch.tensor([[10, 3, 4, 5, 4, 5], [10, 6, 7, 8, 6, 7]])  # periods 2 (prefix 2) and 2 (prefix 1)
    probes = RepeatedProbes(tokens, torch.tensor([2, 2]), torch.tensor([3, 2]), torch.arange(10))
    with torch.no_grad():
        _, heads = hand_forward(model, tokens)
        z = heads[0]  # (batch, pos, d_head)
        # places: prompt 0 = start, prefix, prefix+1, first, first+1, second; prompt 1 = start, prefix,
        # first, first+1, second, second+1
        replacement = torch.stack([
            torch.stack([z[1, 0], z[1, 1], z[1, 2], z[1, 2], z[1, 3], z[1, 4]]),
            torch.stack([z[0, 0], z[0, 1], z[0, 3], z[0, 4], z[0, 5], z[0, 5]]),
        ])
        expected, _ = hand_forward(model, tokens, 0, replacement)
    assert ablate_heads(model, probes, [(0, 0)], "mean_aligned") == pytest.approx(expected, abs=1e-5)
    with pytest.raises(UserError, match="mean_aligned ablation needs the prompts as RepeatedProbes"):
        ablate_heads(model, tokens, [(0, 0)], "mean_aligned")


def test_chunks_count_the_logits_and_their_log_softmax_copy():
    """A 150k vocabulary: a chunk's logits and the metric's log-softmax copy of them fit the budget."""
    cfg = SimpleNamespace(d_vocab=151_936, d_model=896, n_heads=14, d_head=64, d_mlp=4864, n_layers=24, n_ctx=512)
    model = SimpleNamespace(cfg=cfg)
    for batch, n_pos, memory_mb in [(2, 64, 1024), (1, 128, 4096), (4, 32, 512)]:
        variants = rows_per_chunk(model, batch, n_pos, memory_mb)
        assert variants * batch * 2 * (4 * cfg.d_vocab * n_pos) <= memory_mb * 2**20


def test_ragged_texts_are_padded_and_the_padding_masked(scratch_gpt2):
    """Texts of unequal length: right-padded, the loss taken on real tokens only, and the mean
    replacement averaged over the other prompts where each position is real (where none is: over
    every real position of the others)."""
    texts = ["the cat sat on the mat", "a dog", "birds fly south"]
    batch = encode_texts(as_tokenizer(scratch_gpt2.tokenizer), texts, scratch_gpt2.cfg.n_ctx)
    tokens, real = batch.tokens, batch.real
    assert ablate_heads(scratch_gpt2, texts, [], "zero") == pytest.approx(
        naive_ablated_loss(scratch_gpt2, tokens, [], real), abs=1e-5)
    assert ablate_heads(scratch_gpt2, texts, [(1, 2)], "zero") == pytest.approx(
        naive_ablated_loss(scratch_gpt2, tokens, [(1, 2)], real), abs=1e-5)
    with torch.no_grad():
        _, cache = scratch_gpt2.run_with_cache(tokens)
        z = cache["blocks.0.attn.hook_z"][:, :, 3]  # (batch, pos, d_head)
        mean = torch.empty_like(z)
        for b in range(len(texts)):
            others = [o for o in range(len(texts)) if o != b]
            for p in range(tokens.shape[1]):
                there = [z[o, p] for o in others if real[o, p]]
                anywhere = [z[o, q] for o in others for q in range(tokens.shape[1]) if real[o, q]]
                mean[b, p] = torch.stack(there or anywhere).mean(0)
        assert not real[1:, -1].any()  # the last position is real in the first text only: the fallback is used

        def hook(z, hook):
            z = z.clone()
            z[:, :, 3] = mean
            return z

        logits = scratch_gpt2.run_with_hooks(tokens, fwd_hooks=[("blocks.0.attn.hook_z", hook)])
    losses = F.cross_entropy(logits[:, :-1].transpose(1, 2), tokens[:, 1:], reduction="none")
    assert ablate_heads(scratch_gpt2, texts, [(0, 3)], "mean") == pytest.approx(losses[real[:, 1:]].mean().item(), abs=1e-5)
    with pytest.raises(UserError, match="resample ablation needs prompts of equal token length"):
        ablate_heads(scratch_gpt2, texts, [(0, 3)], "resample")


@pytest.mark.parametrize("call", [
    lambda m, t, **progress: ablation_sweep(m, t, "each_layer", **progress),
    lambda m, t, **progress: pruning_curve(m, t, **progress),
    lambda m, t, **progress: patch_heads(m, t, t.flip(0), loss_metric(t), **progress),
    lambda m, t, **progress: shortlist_patch_heads(m, t, t.flip(0), loss_metric(t), k=2, **progress),
    lambda m, t, **progress: ablation_effects(m, probes_for(m, 2, 16), **progress),
    lambda m, t, **progress: classify_heads(m, 2, 16, n_boot=10, **progress),
])
def test_off_a_terminal_progress_is_plain_lines_by_default_and_none_when_off(scratch_gpt2, prompts, capsys, call):
    """pytest's captured stderr is not a terminal: by default no tqdm bar (no carriage returns), the
    analysis's plain lines, the last saying it is done (``analyses.core.progress``); False: nothing."""
    call(scratch_gpt2, prompts)
    err = capsys.readouterr().err
    assert "\r" not in err and err.splitlines()[-1].endswith(" elapsed), done"), err
    call(scratch_gpt2, prompts, progress=False)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda m, t: ablate_heads(m, t, [(0, 0)], "shuffle"), "unknown ablation method 'shuffle'; allowed: zero, mean, mean_aligned, resample"),
        (lambda m, t: ablate_heads(m, t, [(2, 0)]), r"head L2H0 out of range: layer must be in \[0, 2\), head in \[0, 4\)"),
        (lambda m, t: ablate_heads(m, t, [(0, 4)]), r"head L0H4 out of range"),
        (lambda m, t: ablation_sweep(m, t, "each_neuron"), "unknown targets 'each_neuron'"),
        (lambda m, t: ablate_heads(m, t, [(0, 0)], "mean", reference=t[:, :5]), "reference prompts are 5 tokens long"),
    ],
)
def test_bad_inputs_name_the_value(scratch_gpt2, prompts, call, message):
    with pytest.raises(ValueError, match=message):
        call(scratch_gpt2, prompts)


def test_embedded_model_needs_its_second_layer_for_induction():
    """The toy model predicts the second copy of a segment (low repeat loss) and loses that when
    its second layer, where induction heads must sit, is mean-ablated."""
    model = load_model("toy").eval()
    probes = probes_for(model, 16, 64, seed=11)
    metric = loss_metric(probes.tokens, probes.predictable)
    layers = ablation_sweep(model, probes.tokens, "each_layer", "mean", metric, progress=False)
    assert layers["baseline"].iloc[0] < 1.0
    assert layers["effect"].iloc[1] > 1.0
