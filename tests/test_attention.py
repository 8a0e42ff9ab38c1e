"""The five attention modules: the published reference outputs, an independent naive per-head
loop over the same weights, and the caches."""

import math

import pytest
import torch

from interp import (
    CausalAttention,
    MultiHeadAttention,
    MultiHeadAttentionWrapper,
    SelfAttentionV1,
    SelfAttentionV2,
)
from interp.attention import GroupedQueryAttention, LayerKV

# "Your journey starts with one step", the reference's running example.
INPUTS = torch.tensor(
    [[0.43, 0.15, 0.89], [0.55, 0.87, 0.66], [0.57, 0.85, 0.64],
     [0.22, 0.58, 0.33], [0.77, 0.25, 0.10], [0.05, 0.80, 0.55]]
)
BATCH = torch.stack((INPUTS, INPUTS))

# Outputs printed by the widely published reference implementation (Raschka, "Build a Large
# Language Model (From Scratch)", chapter 3), under the seeds given.
PUBLISHED = {
    "v1": (123, [[0.2996, 0.8053], [0.3061, 0.8210], [0.3058, 0.8203],
                 [0.2948, 0.7939], [0.2927, 0.7891], [0.2990, 0.8040]]),
    "v2": (789, [[-0.0739, 0.0713], [-0.0748, 0.0703], [-0.0749, 0.0702],
                 [-0.0760, 0.0685], [-0.0763, 0.0679], [-0.0754, 0.0693]]),
    "causal": (123, [[-0.4519, 0.2216], [-0.5874, 0.0058], [-0.6300, -0.0632],
                     [-0.5675, -0.0843], [-0.5526, -0.0981], [-0.5299, -0.1081]]),
    "wrapper": (123, [[-0.4519, 0.2216, 0.4772, 0.1063], [-0.5874, 0.0058, 0.5891, 0.3257],
                      [-0.6300, -0.0632, 0.6202, 0.3860], [-0.5675, -0.0843, 0.5478, 0.3589],
                      [-0.5526, -0.0981, 0.5321, 0.3428], [-0.5299, -0.1081, 0.5077, 0.3493]]),
    "mha": (123, [[0.3190, 0.4858], [0.2943, 0.3897], [0.2856, 0.3593],
                  [0.2693, 0.3873], [0.2639, 0.3928], [0.2575, 0.4028]]),
}

BUILDERS = {
    "v1": (lambda: SelfAttentionV1(3, 2), INPUTS),
    "v2": (lambda: SelfAttentionV2(3, 2), INPUTS),
    "causal": (lambda: CausalAttention(3, 2, 6, 0.0), BATCH),
    "wrapper": (lambda: MultiHeadAttentionWrapper(3, 2, 6, 0.0, num_heads=2), BATCH),
    "mha": (lambda: MultiHeadAttention(3, 2, 6, 0.0, num_heads=2), BATCH),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_seeded_modules_reproduce_the_published_reference(name):
    seed, expected = PUBLISHED[name]
    build, x = BUILDERS[name]
    torch.manual_seed(seed)
    out = build()(x)
    rows = out if out.ndim == 2 else out[1]  # the batch holds two identical copies
    torch.testing.assert_close(rows, torch.tensor(expected), atol=5e-5, rtol=0)
    if out.ndim == 3:
        torch.testing.assert_close(out[0], out[1])


def naive_causal_heads(x, w_q, w_k, w_v, n_heads, causal=True):
    """An independent reference: python loops over batch, head, query and key.
    x (b, n, d_in); w_* (d_in, d_out) -> z (b, n, head, d_head), pattern (b, head, n, n)."""
    b, n, _ = x.shape
    d_head = w_q.shape[1] // n_heads
    z = torch.zeros(b, n, n_heads, d_head, dtype=torch.float64)
    pattern = torch.zeros(b, n_heads, n, n, dtype=torch.float64)
    x = x.double()
    for bi in range(b):
        for h in range(n_heads):
            cols = slice(h * d_head, (h + 1) * d_head)
            q, k, v = x[bi] @ w_q[:, cols].double(), x[bi] @ w_k[:, cols].double(), x[bi] @ w_v[:, cols].double()
            for i in range(n):
                keys = range(i + 1) if causal else range(n)
                logits = torch.tensor([q[i] @ k[j] / math.sqrt(d_head) for j in keys], dtype=torch.float64)
                weights = torch.exp(logits - logits.max())
                weights = weights / weights.sum()
                for w, j in zip(weights, keys):
                    pattern[bi, h, i, j] = w
                    z[bi, i, h] += w * v[j]
    return z, pattern


def linear_weight(layer):
    """nn.Linear weight (out, in) -> (in, out)."""
    return layer.weight.detach().T


def test_multi_head_attention_equals_a_naive_per_head_loop():
    torch.manual_seed(0)
    mha = MultiHeadAttention(d_in=8, d_out=12, context_length=10, dropout=0.0, num_heads=3)
    x = torch.randn(2, 7, 8)
    out, cache = mha.run_with_cache(x)
    z, pattern = naive_causal_heads(x, linear_weight(mha.W_query), linear_weight(mha.W_key),
                                    linear_weight(mha.W_value), n_heads=3)
    torch.testing.assert_close(cache["hook_pattern"].double(), pattern, atol=1e-6, rtol=0)
    torch.testing.assert_close(cache["hook_z"].double(), z, atol=1e-6, rtol=0)
    expected_out = z.reshape(2, 7, 12).float() @ linear_weight(mha.out_proj) + mha.out_proj.bias
    torch.testing.assert_close(out, expected_out, atol=1e-5, rtol=0)
    # The fast path (no pattern hook) gives the same output.
    torch.testing.assert_close(mha(x), out, atol=1e-6, rtol=0)


def test_wrapper_heads_equal_a_naive_loop_and_cache_under_their_prefix():
    torch.manual_seed(1)
    wrapper = MultiHeadAttentionWrapper(d_in=5, d_out=4, context_length=8, dropout=0.0, num_heads=3)
    x = torch.randn(2, 6, 5)
    out, cache = wrapper.run_with_cache(x)
    for i, head in enumerate(wrapper.heads):
        z, pattern = naive_causal_heads(x, linear_weight(head.W_query), linear_weight(head.W_key),
                                        linear_weight(head.W_value), n_heads=1)
        torch.testing.assert_close(cache[f"heads.{i}.hook_pattern"].double(), pattern[:, 0], atol=1e-6, rtol=0)
        torch.testing.assert_close(out[..., 4 * i:4 * (i + 1)].double(), z[:, :, 0], atol=1e-6, rtol=0)


def test_v1_and_v2_are_unmasked_and_cache_their_qkv():
    torch.manual_seed(2)
    v2 = SelfAttentionV2(3, 4, qkv_bias=True)
    out, cache = v2.run_with_cache(INPUTS)
    assert set(cache.keys()) == {"hook_q", "hook_k", "hook_v", "hook_attn_scores", "hook_pattern", "hook_z"}
    torch.testing.assert_close(cache["hook_q"], v2.W_query(INPUTS))
    pattern = cache["hook_pattern"]
    assert pattern.shape == (6, 6)
    assert (pattern[0, 1:] > 0).all(), "V2 has no causal mask: row 0 attends to later tokens"
    torch.testing.assert_close(pattern.sum(-1), torch.ones(6))
    torch.testing.assert_close(out, pattern @ cache["hook_v"])


def test_causal_attention_masks_the_future_and_scores_are_scaled():
    torch.manual_seed(3)
    attn = CausalAttention(3, 4, context_length=6, dropout=0.0)
    _, cache = attn.run_with_cache(BATCH)
    scores, pattern = cache["hook_attn_scores"], cache["hook_pattern"]
    future = torch.triu(torch.ones(6, 6, dtype=torch.bool), diagonal=1)
    assert torch.isneginf(scores[:, future]).all()
    assert (pattern[:, future] == 0).all()
    raw = cache["hook_q"] @ cache["hook_k"].transpose(1, 2)
    torch.testing.assert_close(scores[:, ~future], (raw / 2.0)[:, ~future])  # sqrt(d_out=4) = 2


def test_dropout_applies_to_weights_in_training_only():
    torch.manual_seed(4)
    attn = MultiHeadAttention(3, 4, 6, dropout=0.5, num_heads=2)
    attn.train()
    assert not torch.allclose(attn(BATCH), attn(BATCH)), "training-mode dropout should vary between calls"
    attn.eval()
    torch.testing.assert_close(attn(BATCH), attn(BATCH))


def test_incremental_decoding_with_a_kv_cache_equals_the_full_forward():
    torch.manual_seed(5)
    mha = MultiHeadAttention(8, 8, context_length=12, dropout=0.0, num_heads=2)
    x = torch.randn(2, 9, 8)
    full = mha(x)
    past = LayerKV()
    pieces = [mha(x[:, :4], past), mha(x[:, 4:7], past), mha(x[:, 7:8], past), mha(x[:, 8:], past)]
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-6, rtol=0)
    assert past.length == 9


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: MultiHeadAttention(3, 5, 6, 0.0, num_heads=2), "d_out=5 must be divisible by num_heads=2"),
        (lambda: MultiHeadAttention(3, 4, 6, 0.0, num_heads=0), "num_heads=0"),
    ],
)
def test_bad_head_counts_get_a_clear_error(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def paper_alibi_slopes(n_heads):
    """ALiBi's slopes by the paper's reference code (Press et al. 2022): a geometric series from
    2^(-8/n) for a power of two n; else the closest power's series, then every other slope of the
    next power's."""
    if math.log2(n_heads).is_integer():
        start = 2 ** (-2 ** -(math.log2(n_heads) - 3))
        return [start * start ** i for i in range(n_heads)]
    closest = 2 ** math.floor(math.log2(n_heads))
    return paper_alibi_slopes(closest) + paper_alibi_slopes(2 * closest)[0::2][:n_heads - closest]


def naive_rotation(vector, position, rotary_dim, base):
    """RoPE as explicit 2-d rotations: dims (i, i + rotary_dim/2) turned by position * base^(-2i/rotary_dim)."""
    out = vector.clone()
    half = rotary_dim // 2
    for i in range(half):
        angle = torch.tensor(position * base ** (-2 * i / rotary_dim), dtype=torch.float64)
        a, b = vector[i], vector[i + half]
        out[i], out[i + half] = a * angle.cos() - b * angle.sin(), b * angle.cos() + a * angle.sin()
    return out


def naive_grouped_heads(x, w_q, w_k, w_v, n_heads, n_kv, rotary_dim=0, base=10_000.0, alibi=False, window=None):
    """An independent reference for grouped-query attention: python loops over batch, head, query
    and key. Head h reads key/value head h // (n_heads // n_kv); rotary by ``naive_rotation``;
    ALiBi as the paper's -slope * distance; a query sees keys (i - window, i] with a window.
    x (b, n, d_in); w_* (d_in, width) -> z (b, n, head, d_head), pattern (b, head, n, n), rotated
    queries (b, n, head, d_head) and keys (b, n, kv_head, d_head)."""
    b, n, _ = x.shape
    d_head = w_q.shape[1] // n_heads
    x = x.double()
    q = (x @ w_q.double()).reshape(b, n, n_heads, d_head)
    k = (x @ w_k.double()).reshape(b, n, n_kv, d_head)
    v = (x @ w_v.double()).reshape(b, n, n_kv, d_head)
    if rotary_dim:
        q = torch.stack([torch.stack([torch.stack([naive_rotation(q[bi, i, h], i, rotary_dim, base)
                                                   for h in range(n_heads)]) for i in range(n)]) for bi in range(b)])
        k = torch.stack([torch.stack([torch.stack([naive_rotation(k[bi, i, h], i, rotary_dim, base)
                                                   for h in range(n_kv)]) for i in range(n)]) for bi in range(b)])
    slopes = paper_alibi_slopes(n_heads) if alibi else [0.0] * n_heads
    z = torch.zeros(b, n, n_heads, d_head, dtype=torch.float64)
    pattern = torch.zeros(b, n_heads, n, n, dtype=torch.float64)
    for bi in range(b):
        for h in range(n_heads):
            kv = h // (n_heads // n_kv)
            for i in range(n):
                keys = range(0 if window is None else max(0, i - window + 1), i + 1)
                logits = torch.tensor([q[bi, i, h] @ k[bi, j, kv] / math.sqrt(d_head) - slopes[h] * (i - j)
                                       for j in keys], dtype=torch.float64)
                weights = torch.softmax(logits, dim=0)
                for w, j in zip(weights, keys):
                    pattern[bi, h, i, j] = w
                    z[bi, i, h] += w * v[bi, j, kv]
    return z, pattern, q, k


GQA_CASES = {  # name -> (num_heads, num_kv_groups, GroupedQueryAttention keywords)
    "gqa-full-rotary": (4, 2, dict(rotary_dim=8)),
    "gqa-partial-rotary-base500": (4, 2, dict(rotary_dim=4, rotary_base=500.0)),
    "mqa-rotary": (4, 1, dict(rotary_dim=8)),
    "mqa-alibi": (4, 1, dict(alibi=True)),
    "alibi-6-heads": (6, 3, dict(alibi=True)),
    "mha-rotary-window3": (4, 4, dict(rotary_dim=8, sliding_window=3)),
    "gqa-wide-heads-no-out-bias": (4, 2, dict(head_dim=12, out_bias=False, rotary_dim=6)),
}


@pytest.mark.parametrize("case", sorted(GQA_CASES))
def test_grouped_query_attention_equals_a_naive_per_head_loop(case):
    n_heads, n_kv, options = GQA_CASES[case]
    torch.manual_seed(6)
    attn = GroupedQueryAttention(16, 8 * n_heads, 12, 0.0, n_heads, n_kv, qkv_bias=False, **options).eval()
    x = torch.randn(2, 9, 16)
    out, cache = attn.run_with_cache(x)
    z, pattern, rot_q, rot_k = naive_grouped_heads(
        x, linear_weight(attn.W_query), linear_weight(attn.W_key), linear_weight(attn.W_value), n_heads, n_kv,
        options.get("rotary_dim", 0), options.get("rotary_base", 10_000.0), options.get("alibi", False),
        options.get("sliding_window"))
    assert cache["hook_k"].shape == cache["hook_v"].shape == (2, 9, n_kv, attn.head_dim)
    torch.testing.assert_close(cache["hook_pattern"].double(), pattern, atol=1e-6, rtol=0)
    torch.testing.assert_close(cache["hook_z"].double(), z, atol=1e-6, rtol=0)
    if "rotary_dim" in options:
        torch.testing.assert_close(cache["hook_rot_q"].double(), rot_q, atol=1e-6, rtol=0)
        torch.testing.assert_close(cache["hook_rot_k"].double(), rot_k, atol=1e-6, rtol=0)
    else:
        assert "hook_rot_q" not in attn.hook_dict
    # the output is the heads' outputs through W_O, plus b_O where there is one
    per_head = torch.einsum("bphd,hdm->bpm", cache["hook_z"], attn.W_O)
    torch.testing.assert_close(out, per_head + (0 if attn.b_O is None else attn.b_O), atol=1e-5, rtol=0)
    torch.testing.assert_close(attn(x), out, atol=1e-6, rtol=0)  # the fast path


@pytest.mark.parametrize("case", sorted(GQA_CASES))
def test_grouped_query_incremental_decoding_equals_the_full_forward(case):
    n_heads, n_kv, options = GQA_CASES[case]
    torch.manual_seed(7)
    attn = GroupedQueryAttention(16, 8 * n_heads, 12, 0.0, n_heads, n_kv, **options).eval()
    x = torch.randn(2, 11, 16)
    full = attn(x)
    for run in (attn, lambda chunk, past: attn.run_with_cache(chunk, past)[0]):  # fast and hooked paths
        past = LayerKV()
        pieces = [run(x[:, :4], past), run(x[:, 4:7], past), run(x[:, 7:8], past), run(x[:, 8:], past)]
        torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-6, rtol=0)
        assert past.length == 11 and past.keys.shape[1] == n_kv


def test_grouped_query_attention_with_a_group_per_head_is_multi_head_attention():
    torch.manual_seed(8)
    mha = MultiHeadAttention(8, 12, 10, 0.0, num_heads=3, qkv_bias=True)
    torch.manual_seed(8)
    gqa = GroupedQueryAttention(8, 12, 10, 0.0, num_heads=3, num_kv_groups=3, qkv_bias=True)
    x = torch.randn(2, 7, 8)
    assert torch.equal(gqa(x), mha(x))
    (out, cache), (expected, expected_cache) = gqa.run_with_cache(x), mha.run_with_cache(x)
    assert torch.equal(out, expected)
    for name in expected_cache:
        assert torch.equal(cache[name], expected_cache[name]), name


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(num_heads=4, num_kv_groups=3), "num_heads=4 must be divisible by num_kv_groups=3"),
        (dict(num_heads=3, num_kv_groups=3), "d_out=8 must be divisible by num_heads=3"),
        (dict(num_heads=2, num_kv_groups=1, rotary_dim=3), "rotary_dim=3 must be even"),
        (dict(num_heads=2, num_kv_groups=1, rotary_dim=6), "rotary_dim=6 .* head_dim=4"),
    ],
)
def test_bad_grouped_query_options_get_a_clear_error(options, message):
    with pytest.raises(ValueError, match=message):
        GroupedQueryAttention(8, 8, 6, 0.0, **options)


def test_too_long_input_names_the_context_length():
    attn = CausalAttention(3, 2, context_length=4, dropout=0.0)
    with pytest.raises(ValueError, match="6 tokens exceeds the context length 4"):
        attn(BATCH)
