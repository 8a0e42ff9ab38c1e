"""GPTModel against its peers on the same weights: Hugging Face eager GPT-2 logits and a
TransformerLens TransformerBridge's caches; and its own paths against each other."""

import json

import pytest
import torch
from transformers import GenerationConfig

from interp import GPTConfig, GPTModel, from_hf
from interp.bridge import boot_bridge
from interp.random_models import make_random_gpt2

SHAPES = [  # (n_layers, d_model, n_heads, n_ctx)
    (1, 32, 2, 32),
    (2, 64, 4, 64),
    (3, 96, 6, 48),
]


@pytest.fixture(scope="module", params=SHAPES, ids=lambda s: "L{}-d{}-H{}-ctx{}".format(*s))
def peers(request):
    n_layers, d_model, n_heads, n_ctx = request.param
    hf, tokenizer = make_random_gpt2(n_layers, d_model, n_heads, n_ctx, seed=n_layers)
    return hf, from_hf(hf, tokenizer), boot_bridge(hf, tokenizer)


def random_tokens(model, batch=3, pos=None, seed=0):
    pos = pos or model.cfg.n_ctx
    return torch.randint(0, model.cfg.d_vocab, (batch, pos), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def test_logits_equal_hugging_face_eager(peers):
    hf, ours, _ = peers
    tokens = random_tokens(ours)
    torch.testing.assert_close(ours(tokens), hf(tokens).logits, atol=1e-4, rtol=0)


def test_every_pattern_and_z_equals_the_transformer_bridge(peers):
    _, ours, bridge = peers
    tokens = random_tokens(ours, pos=ours.cfg.n_ctx - 5)
    _, our_cache = ours.run_with_cache(tokens)
    _, their_cache = bridge.run_with_cache(tokens)
    for layer in range(ours.cfg.n_layers):
        for hook in ("hook_pattern", "hook_z", "hook_q", "hook_k", "hook_v"):
            name = f"blocks.{layer}.attn.{hook}"
            torch.testing.assert_close(our_cache[name], their_cache[name], atol=1e-5, rtol=0, msg=name)
        for hook in ("hook_resid_pre", "hook_attn_out", "hook_resid_mid", "hook_mlp_out", "hook_resid_post"):
            name = f"blocks.{layer}.{hook}"
            torch.testing.assert_close(our_cache[name], their_cache[name], atol=1e-5, rtol=0, msg=name)


@torch.no_grad()
def test_building_a_bridge_leaves_the_hf_model_usable():
    hf, tokenizer = make_random_gpt2(1, 32, 2, 16, seed=7)
    tokens = torch.arange(12)[None]
    before = hf(tokens).logits
    bridge = boot_bridge(hf, tokenizer)
    torch.testing.assert_close(hf(tokens).logits, before)
    torch.testing.assert_close(from_hf(hf, tokenizer)(tokens), bridge(tokens), atol=1e-5, rtol=0)


def test_cache_is_an_activation_cache_with_documented_shapes(scratch_gpt2):
    from transformer_lens.ActivationCache import ActivationCache

    tokens = random_tokens(scratch_gpt2, batch=2, pos=10)
    _, cache = scratch_gpt2.run_with_cache(tokens)
    assert isinstance(cache, ActivationCache)
    cfg = scratch_gpt2.cfg
    assert cache["hook_embed"].shape == (2, 10, cfg.d_model)
    assert cache["blocks.1.attn.hook_q"].shape == (2, 10, cfg.n_heads, cfg.d_head)
    assert cache["blocks.1.attn.hook_attn_scores"].shape == (2, cfg.n_heads, 10, 10)
    assert cache["blocks.0.hook_mlp_out"].shape == (2, 10, cfg.d_model)


def test_names_filter_caches_only_what_was_asked(scratch_gpt2):
    tokens = random_tokens(scratch_gpt2, batch=1, pos=8)
    _, cache = scratch_gpt2.run_with_cache(tokens, names_filter=lambda n: n.endswith("hook_pattern"))
    assert sorted(cache.keys()) == [f"blocks.{l}.attn.hook_pattern" for l in range(scratch_gpt2.cfg.n_layers)]


@torch.no_grad()
def test_fast_path_equals_the_hooked_path(scratch_gpt2):
    tokens = random_tokens(scratch_gpt2, batch=2)
    calls = []
    fast = scratch_gpt2(tokens)
    hooked = scratch_gpt2.run_with_hooks(
        tokens, fwd_hooks=[(lambda n: n.endswith("hook_pattern"), lambda x, hook: calls.append(hook.name))]
    )
    assert len(calls) == scratch_gpt2.cfg.n_layers, "the pattern hook must fire once per layer"
    torch.testing.assert_close(fast, hooked, atol=1e-5, rtol=0)


@torch.no_grad()
def test_a_hook_edit_changes_the_output(scratch_gpt2):
    tokens = random_tokens(scratch_gpt2, batch=1, pos=12)

    def zero_head(z, hook):
        z[:, :, 0] = 0.0
        return z

    edited = scratch_gpt2.run_with_hooks(tokens, fwd_hooks=[("blocks.0.attn.hook_z", zero_head)])
    assert not torch.allclose(edited, scratch_gpt2(tokens))
    # and the hook does not outlive the call
    torch.testing.assert_close(scratch_gpt2(tokens), scratch_gpt2(tokens))
    assert not any(hp.has_hooks() for hp in scratch_gpt2.hook_points())


@torch.no_grad()
def test_start_at_layer_from_a_cached_residual_equals_the_full_forward(scratch_gpt2):
    tokens = random_tokens(scratch_gpt2, batch=2)
    full = scratch_gpt2(tokens)
    _, cache = scratch_gpt2.run_with_cache(tokens, names_filter=lambda n: n.endswith("hook_resid_pre"))
    for layer in range(scratch_gpt2.cfg.n_layers):
        resumed = scratch_gpt2(cache[f"blocks.{layer}.hook_resid_pre"], start_at_layer=layer)
        torch.testing.assert_close(resumed, full, atol=1e-5, rtol=0)
    stopped = scratch_gpt2(tokens, stop_at_layer=1)
    torch.testing.assert_close(stopped, cache["blocks.1.hook_resid_pre"])


@torch.no_grad()
def test_start_at_resid_mid_skips_the_attention_and_equals_the_full_forward(scratch_gpt2):
    tokens = random_tokens(scratch_gpt2, batch=2)
    full = scratch_gpt2(tokens)
    _, cache = scratch_gpt2.run_with_cache(tokens, names_filter=lambda n: n.endswith("hook_resid_mid"))
    fired = []
    spy = [("blocks.1.attn.hook_z", lambda z, hook: fired.append(1)), ("blocks.1.hook_mlp_out", lambda x, hook: None)]
    for layer in range(scratch_gpt2.cfg.n_layers):
        with scratch_gpt2.hooks(fwd_hooks=spy):
            resumed = scratch_gpt2(cache[f"blocks.{layer}.hook_resid_mid"], start_at_layer=layer, start_at_resid_mid=True)
        torch.testing.assert_close(resumed, full, atol=1e-5, rtol=0)
    assert fired == [1], "only the run starting at block 0's resid_mid computes block 1's attention"


@torch.no_grad()
def test_loss_is_next_token_cross_entropy(scratch_gpt2):
    tokens = random_tokens(scratch_gpt2, batch=2, pos=16)
    logits = scratch_gpt2(tokens)
    expected = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    torch.testing.assert_close(scratch_gpt2(tokens, return_type="loss"), expected)
    per_token = scratch_gpt2(tokens, return_type="loss", loss_per_token=True)
    assert per_token.shape == (2, 15)
    torch.testing.assert_close(per_token.mean(), expected)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_kv_cache_generation_equals_uncached(scratch_gpt2, temperature):
    prompt = random_tokens(scratch_gpt2, batch=2, pos=6)
    cached = scratch_gpt2.generate(prompt, 30, temperature=temperature, seed=3)
    uncached = scratch_gpt2.generate(prompt, 30, use_kv_cache=False, temperature=temperature, seed=3)
    assert cached.shape == (2, 36)
    assert torch.equal(cached, uncached)
    assert torch.equal(cached[:, :6], prompt)


def test_generation_matches_hugging_face_greedy(hf_gpt2, scratch_gpt2):
    prompt = random_tokens(scratch_gpt2, batch=1, pos=5)
    ours = scratch_gpt2.generate(prompt, 20)
    # no end-of-sequence token: HF generates all 20 tokens greedily, as ours does (min_new_tokens
    # would instead ban EOS, and differ from ours where EOS is the argmax)
    greedy = GenerationConfig(do_sample=False, max_new_tokens=20, eos_token_id=[], pad_token_id=256)
    theirs = hf_gpt2[0].generate(prompt, attention_mask=torch.ones_like(prompt), generation_config=greedy)
    assert torch.equal(ours, theirs)


def test_text_round_trip(scratch_gpt2):
    tokens = scratch_gpt2.to_tokens("attention heads")
    assert tokens[0, 0].item() == 256  # BOS (<|endoftext|>) first
    assert scratch_gpt2.to_string(tokens[0]) == "attention heads"
    assert scratch_gpt2.to_string(tokens) == ["attention heads"]


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda m: m.to_tokens(""), "non-empty string"),
        (lambda m: m.to_tokens("x" * 100), "101 tokens, longer than the context n_ctx=64"),
        (lambda m: m.to_tokens(["ab", "abc"]), "different lengths"),
        (lambda m: m(torch.tensor([[1, 2, 999]])), "token id 999 out of range \\[0, 257\\)"),
        (lambda m: m(torch.zeros(1, 0, dtype=torch.long)), "empty"),
        (lambda m: m(torch.zeros(1, 65, dtype=torch.long)), "65 long, longer than the context n_ctx=64"),
        (lambda m: m(torch.zeros(1, 4, 64), start_at_layer=3), "start_at_layer=3 out of range \\[0, 2\\]"),
        (lambda m: m(torch.zeros(1, 4, 5), start_at_layer=1), "residual \\(batch, pos, 64\\)"),
        (lambda m: m(torch.zeros(1, 4, 64), start_at_resid_mid=True), "start_at_resid_mid needs start_at_layer"),
        (lambda m: m.generate(torch.zeros(1, 60, dtype=torch.long), 10), "exceed the context"),
    ],
)
def test_bad_input_gets_a_clear_error(scratch_gpt2, call, message):
    with pytest.raises(ValueError, match=message):
        call(scratch_gpt2)


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(d_vocab=10, n_ctx=8, d_model=10, n_heads=3, n_layers=1), "d_model=10 must be divisible by n_heads=3"),
        (dict(d_vocab=10, n_ctx=0, d_model=8, n_heads=2, n_layers=1), "n_ctx=0"),
        (dict(d_vocab=10, n_ctx=8, d_model=8, n_heads=2, n_layers=1, dropout=1.5), "dropout=1.5"),
    ],
)
def test_bad_config_gets_a_clear_error(fields, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig(**fields)


def test_attn_only_model_has_no_mlp_hooks():
    model = GPTModel(GPTConfig(d_vocab=257, n_ctx=16, d_model=32, n_heads=4, n_layers=2, attn_only=True))
    assert "blocks.0.hook_mlp_out" not in model.hook_dict
    assert "blocks.1.attn.hook_pattern" in model.hook_dict
    logits, cache = model.run_with_cache(model.to_tokens("hello"))
    assert logits.shape == (1, 6, 257)
    resid = cache["blocks.1.hook_resid_pre"]
    torch.testing.assert_close(model(resid, start_at_layer=1), logits, atol=1e-5, rtol=0)
    assert not model.resid_mid_start
    with pytest.raises(ValueError, match="blocks are attention-only"):
        model(resid, start_at_layer=1, start_at_resid_mid=True)


def test_cfg_device_follows_the_model_and_stays_out_of_checkpoints():
    """A real device change each way (there is no GPU here: the meta device, then back to the CPU)."""
    model = GPTModel(GPTConfig(d_vocab=257, n_ctx=8, d_model=16, n_heads=2, n_layers=1))
    assert model.cfg.device == "cpu"
    model.to("meta")
    assert model.cfg.device == "meta" and model.embed.weight.is_meta
    model.to_empty(device="cpu")
    assert model.cfg.device == "cpu" and model.embed.weight.device.type == "cpu"
    assert "device" not in model.cfg.to_json()


def test_moving_a_model_leaves_a_shared_config_alone():
    """Each model owns its config: moving or converting one changes neither the caller's object nor
    another model built from it."""
    cfg = GPTConfig(d_vocab=257, n_ctx=8, d_model=16, n_heads=2, n_layers=1)
    moved, other = GPTModel(cfg), GPTModel(cfg)
    moved.to("meta")
    moved.to(torch.float64)
    assert moved.cfg.device == "meta"
    assert other.cfg.device == "cpu" and cfg.device == "cpu"
    assert moved.cfg == other.cfg == cfg  # the same shape; device is not compared


# ---------------------------------------------------------------------------------------------
# the family knobs (architecture §3.4): every combination keeps the model's own paths consistent; the
# families themselves are checked against Hugging Face in tests/test_scratch_families.py

KNOBS = {
    "llama-like": dict(normalization_type="RMS", act_fn="silu", gated_mlp=True, positional_embedding_type="rotary",
                       n_key_value_heads=2, qkv_bias=False, attn_out_bias=False, mlp_bias=False,
                       tie_word_embeddings=False),
    "gemma-like-mqa": dict(normalization_type="RMS", gated_mlp=True, positional_embedding_type="rotary",
                           n_key_value_heads=1, d_head=12, embed_scale=32 ** 0.5),
    "neox-like": dict(positional_embedding_type="rotary", rotary_dim=2, rotary_base=500.0, parallel_attn_mlp=True,
                      act_fn="gelu", tie_word_embeddings=False, unembed_bias=True),
    "alibi-window-embed-ln": dict(positional_embedding_type="alibi", sliding_window=5, post_embedding_ln=True,
                                  act_fn="gelu_new"),
}


@pytest.fixture(scope="module", params=sorted(KNOBS))
def knobbed(request):
    torch.manual_seed(9)
    model = GPTModel(GPTConfig(d_vocab=257, n_ctx=32, d_model=32, n_heads=4, n_layers=2, **KNOBS[request.param]))
    with torch.no_grad():  # larger weights than the default initialisation: attention far from uniform
        for param in model.parameters():
            param.mul_(2.0 if param.ndim == 2 else 1.0)
    return model.eval()


@torch.no_grad()
def test_each_knob_combination_keeps_the_fast_cached_and_suffix_paths_equal(knobbed):
    tokens = random_tokens(knobbed, batch=2, pos=20)
    full, cache = knobbed.run_with_cache(tokens)
    atol = 1e-6 * full.abs().max()  # float32 rounding, on logits of up to ~100
    torch.testing.assert_close(knobbed(tokens), full, atol=atol, rtol=0)  # SDPA fast path vs the hooked one
    for layer in range(knobbed.cfg.n_layers):
        torch.testing.assert_close(knobbed(cache[f"blocks.{layer}.hook_resid_pre"], start_at_layer=layer), full,
                                   atol=atol, rtol=0)
    prompt = tokens[:, :4]
    assert torch.equal(knobbed.generate(prompt, 16), knobbed.generate(prompt, 16, use_kv_cache=False))


def test_each_knob_combination_has_the_documented_hooks(knobbed):
    cfg = knobbed.cfg
    _, cache = knobbed.run_with_cache(random_tokens(knobbed, batch=2, pos=7))
    n_kv = cfg.n_key_value_heads or cfg.n_heads
    assert cache["blocks.1.attn.hook_q"].shape == cache["blocks.1.attn.hook_z"].shape == (2, 7, cfg.n_heads, cfg.d_head)
    assert cache["blocks.1.attn.hook_k"].shape == cache["blocks.1.attn.hook_v"].shape == (2, 7, n_kv, cfg.d_head)
    assert cache["blocks.1.attn.hook_pattern"].shape == (2, cfg.n_heads, 7, 7)
    rotary = cfg.positional_embedding_type == "rotary"
    assert ("blocks.1.attn.hook_rot_k" in cache.keys()) == rotary
    assert ("hook_pos_embed" in cache.keys()) == (cfg.positional_embedding_type == "standard")
    assert ("blocks.1.hook_resid_mid" in cache.keys()) == (not cfg.parallel_attn_mlp)
    if cfg.sliding_window:  # a query sees only its last sliding_window positions
        assert (cache["blocks.0.attn.hook_pattern"][:, :, -1, : 7 - cfg.sliding_window] == 0).all()


def test_gpt2_is_the_default_and_a_config_saved_without_the_knobs_still_loads():
    old = dict(d_vocab=257, n_ctx=64, d_model=128, n_heads=8, n_layers=2, attn_only=True, d_mlp=512, dropout=0.0,
               ln_eps=1e-5, model_name="toy", qkv_bias=True)  # the shipped toy's config.json
    cfg = GPTConfig.from_dict(old)
    assert (cfg.d_head, cfg.n_key_value_heads, cfg.normalization_type) == (16, None, "LN")
    assert (cfg.positional_embedding_type, cfg.act_fn, cfg.embed_scale) == ("standard", "gelu_tanh", 1.0)
    assert cfg.tie_word_embeddings and not cfg.parallel_attn_mlp and not cfg.gated_mlp
    assert GPTConfig.from_dict(json.loads(cfg.to_json())) == cfg


def test_position_embeddings_hook_with_the_batch(scratch_gpt2):
    _, cache = scratch_gpt2.run_with_cache(random_tokens(scratch_gpt2, batch=2, pos=5))
    assert cache["hook_pos_embed"].shape == (2, 5, scratch_gpt2.cfg.d_model)


@pytest.mark.parametrize(
    "knobs, message",
    [
        (dict(normalization_type="BN"), "normalization_type='BN' not supported; allowed: 'LN', 'RMS'"),
        (dict(act_fn="swish"), "act_fn='swish' not supported"),
        (dict(d_vocab_out=5), "d_vocab_out=5 must be positive, and differ from d_vocab=10 only with a separate"),
        (dict(positional_embedding_type="sinusoidal"), "positional_embedding_type='sinusoidal' not supported"),
        (dict(n_key_value_heads=3), "n_key_value_heads=3 must divide n_heads=4"),
        (dict(positional_embedding_type="rotary", rotary_dim=3), "rotary_dim=3 must be even"),
        (dict(sliding_window=0), "sliding_window=0 must be a positive number"),
        (dict(unembed_bias=True), "unembed_bias=True needs a separate unembedding"),
    ],
)
def test_bad_knobs_get_a_clear_error(knobs, message):
    with pytest.raises(ValueError, match=message):
        GPTModel(GPTConfig(d_vocab=10, n_ctx=8, d_model=8, n_heads=4, n_layers=1, **knobs))
