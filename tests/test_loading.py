"""load_model: local GPT-2 directories with both impls, our safetensors checkpoints, hub names
offline, and the refusals. No network: the hub is declared unreachable."""

import json
import time

import pytest
import torch
from transformers import GPT2LMHeadModel

import interp.gpt2
from interp import GPTConfig, GPTModel, load_model
from interp.errors import UserError
from interp.loading import load_checkpoint, save_checkpoint


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@torch.no_grad()
def test_a_saved_gpt2_directory_loads_with_both_impls_to_equal_logits(gpt2_dir):
    scratch = load_model(gpt2_dir, impl="scratch")
    bridge = load_model(gpt2_dir, impl="transformer_lens")
    hf = GPT2LMHeadModel.from_pretrained(gpt2_dir, attn_implementation="eager").eval()
    assert isinstance(scratch, GPTModel)
    tokens = scratch.to_tokens("induction heads copy")
    assert torch.equal(tokens, bridge.to_tokens("induction heads copy"))
    torch.testing.assert_close(scratch(tokens), hf(tokens).logits, atol=1e-4, rtol=0)
    torch.testing.assert_close(scratch(tokens), bridge(tokens), atol=1e-4, rtol=0)


def test_a_gpt2_directory_without_tokenizer_still_loads_as_scratch(tmp_path, hf_gpt2):
    hf_gpt2[0].save_pretrained(tmp_path)
    model = load_model(tmp_path)
    tokens = torch.arange(10)[None]
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), hf_gpt2[0](tokens).logits, atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="needs a tokenizer"):
        load_model(tmp_path, impl="transformer_lens")


def test_checkpoint_round_trip(tmp_path):
    torch.manual_seed(0)
    model = GPTModel(GPTConfig(d_vocab=257, n_ctx=32, d_model=32, n_heads=4, n_layers=2, attn_only=True)).eval()
    save_checkpoint(model, tmp_path / "ckpt", training={"steps": 3})
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["config.json", "model.safetensors", "training.json"]
    loaded = load_model(tmp_path / "ckpt")
    assert loaded.cfg == model.cfg
    tokens = model.to_tokens("hello there")
    with torch.no_grad():
        assert torch.equal(loaded(tokens), model(tokens))
    assert json.loads((tmp_path / "ckpt" / "training.json").read_text()) == {"steps": 3}


def test_non_finite_weights_are_refused(tmp_path):
    model = GPTModel(GPTConfig(d_vocab=257, n_ctx=8, d_model=16, n_heads=2, n_layers=1))
    with torch.no_grad():
        model.blocks[0].attn.W_key.weight[0, 0] = float("nan")
    save_checkpoint(model, tmp_path)
    with pytest.raises(ValueError, match="blocks.0.attn.W_key.weight.*non-finite"):
        load_checkpoint(tmp_path)


@pytest.mark.parametrize("name", ["model.pt", "weights.bin", "x.pkl"])
def test_pickle_checkpoints_are_refused(tmp_path, name):
    (tmp_path / name).write_bytes(b"not even looked at")
    with pytest.raises(ValueError, match="refusing to load .*pickle"):
        load_model(tmp_path / name)


def test_a_hub_name_offline_fails_at_once_with_a_way_out():
    start = time.perf_counter()
    with pytest.raises(interp.gpt2.OfflineError, match="'gpt2'.*cannot be reached.*save_pretrained"):
        load_model("gpt2")
    assert time.perf_counter() - start < 10  # no retry loop against an unreachable hub


def test_hub_probe_is_skipped_when_offline_is_declared(monkeypatch):
    monkeypatch.setattr(interp.gpt2.socket, "create_connection", lambda *a, **k: pytest.fail("probed the network"))
    assert interp.gpt2.hub_reachable() is False


@pytest.mark.parametrize(
    "spec, impl, error, message",
    [
        ("toy", "keras", UserError, "unknown impl 'keras'; allowed: scratch, transformer_lens"),
        ("./no/such/dir", "scratch", UserError, "is not a directory"),
    ],
)
def test_bad_specs_get_a_clear_error(spec, impl, error, message):
    with pytest.raises(error, match=message):
        load_model(spec, impl=impl)


def test_a_directory_without_config_is_named(tmp_path):
    with pytest.raises(UserError, match="has no config.json"):
        load_model(tmp_path)


def test_our_checkpoint_cannot_be_bridged(tmp_path):
    save_checkpoint(GPTModel(GPTConfig(d_vocab=257, n_ctx=8, d_model=16, n_heads=2, n_layers=1)), tmp_path)
    with pytest.raises(ValueError, match="only impl='scratch'"):
        load_model(tmp_path, impl="transformer_lens")
