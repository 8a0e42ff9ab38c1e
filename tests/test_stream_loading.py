"""A Hugging Face safetensors directory read tensor by tensor into the from-scratch model
(``interp.convert.stream``, issue 24.2): the same model as converting the Hugging Face model
``from_pretrained`` loads, in every family and dtype, with the layouts transformers accepts (no
base-model prefix, constant buffers, shards, a cast read a slice at a time), without building the
Hugging Face model. Tiny random models, no network."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import interp.convert.stream
import interp.hub
from interp import from_hf, load_model
from interp.convert import scratch_families
from interp.errors import UserError
from interp.random_models import FAMILIES

STREAMED = [f for f in FAMILIES if f in scratch_families()]  # BLOOM: tests/test_scratch_families.py


@pytest.fixture
def no_hf_model(monkeypatch):
    """Loading must not go through the Hugging Face model."""
    def refuse(*_, **__):
        raise AssertionError("the Hugging Face model was built")
    monkeypatch.setattr(interp.hub, "load_hf", refuse)
    monkeypatch.setattr("interp.loading.load_hf", refuse)


def assert_same_model(ours, reference):
    """Every parameter bit for bit (names, dtypes, values), and the logits."""
    theirs = dict(reference.named_parameters())
    assert {n: p.dtype for n, p in ours.named_parameters()} == {n: p.dtype for n, p in theirs.items()}
    for name, param in ours.named_parameters():
        assert torch.equal(param, theirs[name]), name
    tokens = torch.randint(0, ours.cfg.d_vocab, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(ours(tokens), reference(tokens))


def hf_reference(directory, dtype):
    """What the Hugging Face path makes of ``directory``: ``from_pretrained`` in ``dtype``, converted."""
    hf = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager", dtype=dtype).eval()
    return from_hf(hf), hf


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", STREAMED)
def test_a_directory_read_tensor_by_tensor_is_the_model_from_pretrained_makes(family_dir, family, dtype, no_hf_model):
    ours = load_model(family_dir(family), impl="scratch", dtype=dtype)
    reference, hf = hf_reference(family_dir(family), dtype)
    assert_same_model(ours, reference)
    tokens = torch.randint(0, ours.cfg.d_vocab, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # and Hugging Face's eager logits, where float32 makes them comparable
        if dtype == torch.float32:
            torch.testing.assert_close(ours(tokens), hf(tokens).logits, atol=1e-4, rtol=0)
    assert ours.hf_config.to_dict() == hf.config.to_dict()


def test_a_cast_read_a_slice_at_a_time_equals_one_cast(family_dir, monkeypatch, no_hf_model):
    """A float32 file read into bfloat16 through a 96-byte buffer (many slices, a last short one)."""
    monkeypatch.setattr(interp.convert.stream, "CHUNK_BYTES", 96)
    ours = load_model(family_dir("llama"), impl="scratch", dtype="bfloat16")
    assert_same_model(ours, hf_reference(family_dir("llama"), torch.bfloat16)[0])


def test_a_gpt2_file_without_the_base_prefix_and_with_its_constant_buffers_loads(gpt2_dir, tmp_path, no_hf_model):
    """As GPT-2's checkpoint on the hub: ``h.0.attn.c_attn.weight`` (no ``transformer.``) and the
    causal mask ``h.{l}.attn.bias`` saved beside the weights."""
    state = {name.removeprefix("transformer."): tensor for name, tensor in load_file(gpt2_dir / "model.safetensors").items()}
    state |= {f"h.{layer}.attn.bias": torch.ones(1, 1, 64, 64).tril() for layer in range(2)}
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((gpt2_dir / name).read_bytes())
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    assert_same_model(load_model(tmp_path, impl="scratch"), load_model(gpt2_dir, impl="scratch"))


def test_a_sharded_directory_loads(family_dir, tmp_path, no_hf_model):
    hf = AutoModelForCausalLM.from_pretrained(family_dir("gpt_neox"), attn_implementation="eager")
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((family_dir("gpt_neox") / name).read_bytes())
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    assert_same_model(load_model(tmp_path, impl="scratch"), load_model(family_dir("gpt_neox"), impl="scratch"))


def test_a_truncated_file_is_refused_in_one_line(gpt2_dir, tmp_path):
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((gpt2_dir / name).read_bytes())
    data = (gpt2_dir / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[:-100])
    with pytest.raises(UserError, match=r"model.safetensors is truncated: a tensor's data runs past its end$"):
        load_model(tmp_path, impl="scratch")


@pytest.mark.parametrize("family", STREAMED)
def test_a_bin_directory_is_the_same_model_as_its_safetensors(family_dir, family, tmp_path, no_hf_model):
    """``.bin`` weights (here a tied weight saved once, as safetensors hold it) are read tensor by
    tensor too (tests/test_loading_bin.py): the same model as the safetensors files."""
    for path in family_dir(family).iterdir():
        if path.name != "model.safetensors":
            (tmp_path / path.name).write_bytes(path.read_bytes())
    torch.save(load_file(family_dir(family) / "model.safetensors"), tmp_path / "pytorch_model.bin")
    assert_same_model(load_model(tmp_path, impl="scratch"), load_model(family_dir(family), impl="scratch"))

