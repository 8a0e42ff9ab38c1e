"""A Hugging Face directory of ``pytorch_model.bin`` weights (or its shards) read tensor by tensor
into the from-scratch model (``interp.convert.stream``, issue 24.2): the same tensors and logits as
``from_hf`` of the model ``from_pretrained`` makes of the same directory, in every family and dtype,
without building the Hugging Face model; a legacy (non-zip) file goes through ``from_pretrained``.
The files are ``torch.save`` of the Hugging Face state dict, as ``save_pretrained(...,
safe_serialization=False)`` wrote them (transformers 5 writes safetensors only). Tiny random
models, no network."""

from __future__ import annotations

import fractions
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

import interp.convert.stream
import interp.loading
from interp import load_model
from interp.errors import UserError
from test_stream_loading import STREAMED, assert_same_model, hf_reference, no_hf_model  # noqa: F401 (a fixture)


def bin_dir(source, target, edit=lambda state: state, **save) -> object:
    """``target``: ``source``'s config and tokenizer, and its weights (as ``from_pretrained`` loads
    them) ``torch.save``d to ``pytorch_model.bin`` after ``edit`` (state -> state); ``save``:
    ``torch.save``'s options."""
    target.mkdir(exist_ok=True)
    for path in source.iterdir():
        if not path.name.endswith(".safetensors"):
            (target / path.name).write_bytes(path.read_bytes())
    state = AutoModelForCausalLM.from_pretrained(source).state_dict()
    torch.save(edit(state), target / "pytorch_model.bin", **save)
    return target


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", STREAMED)
def test_a_bin_directory_read_tensor_by_tensor_is_the_model_from_pretrained_makes(family_dir, family, dtype, tmp_path,
                                                                                  no_hf_model):
    directory = bin_dir(family_dir(family), tmp_path / family)
    ours = load_model(directory, impl="scratch", dtype=dtype)
    reference, hf = hf_reference(directory, dtype)
    assert_same_model(ours, reference)
    assert ours.hf_config.to_dict() == hf.config.to_dict()


def test_a_tied_weight_saved_under_both_names_is_read_once(family_dir, tmp_path, no_hf_model, monkeypatch):
    """GPT-2's ``lm_head`` is its embedding: a ``.bin`` holds both names on one storage."""
    directory = bin_dir(family_dir("gpt2"), tmp_path / "gpt2")
    state = torch.load(directory / "pytorch_model.bin", map_location="meta", weights_only=True)
    assert state["lm_head.weight"].untyped_storage()._checkpoint_offset == \
        state["transformer.wte.weight"].untyped_storage()._checkpoint_offset
    reads = []
    read = interp.convert.stream._read
    monkeypatch.setattr(interp.convert.stream, "_read", lambda entry, dtype: reads.append(entry) or read(entry, dtype))
    ours = load_model(directory, impl="scratch")
    assert len(reads) == len(state) - 1  # every tensor but the tied name
    assert_same_model(ours, hf_reference(directory, torch.float32)[0])


def test_a_sharded_bin_directory_loads(family_dir, tmp_path, no_hf_model):
    """Shards named by ``pytorch_model.bin.index.json``, the tied ``lm_head`` a copy in a shard of
    its own (equal values: ``from_pretrained`` ties them)."""
    source = bin_dir(family_dir("gpt2"), tmp_path / "one")
    directory = bin_dir(family_dir("gpt2"), tmp_path / "sharded")
    (directory / "pytorch_model.bin").unlink()
    state = AutoModelForCausalLM.from_pretrained(family_dir("gpt2")).state_dict()
    names = sorted(state)
    shards = {f"pytorch_model-0000{i + 1}-of-00003.bin": names[i::3] for i in range(3)}
    for file, part in shards.items():
        torch.save({name: state[name].clone() for name in part}, directory / file)
    weight_map = {name: file for file, part in shards.items() for name in part}
    (directory / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert weight_map["lm_head.weight"] != weight_map["transformer.wte.weight"]
    assert interp.convert.stream.weight_files(directory) == [directory / file for file in sorted(shards)]
    ours = load_model(directory, impl="scratch")
    assert_same_model(ours, hf_reference(directory, torch.float32)[0])
    assert_same_model(ours, load_model(source, impl="scratch"))


def test_a_tied_name_holding_another_tensor_is_refused(family_dir, tmp_path, no_hf_model):
    """``from_pretrained`` unties a tied ``lm_head`` whose values differ from the embedding's: the
    tied from-scratch model has no place for it."""
    directory = bin_dir(family_dir("gpt2"), tmp_path / "gpt2",
                        edit=lambda state: state | {"lm_head.weight": state["lm_head.weight"] + 1})
    hf = AutoModelForCausalLM.from_pretrained(directory)
    assert not torch.equal(hf.lm_head.weight, hf.transformer.wte.weight)
    with pytest.raises(UserError, match=r"^gpt2 weights lm_head.weight have no place in the from-scratch model"):
        load_model(directory, impl="scratch")


def test_strided_views_and_storage_offsets_are_read_as_they_lie(family_dir, tmp_path, no_hf_model):
    """``torch.save`` keeps a view as it is: a transposed weight (strides (1, rows)) and one lying
    inside a larger storage, past its start, in bfloat16 (a cast of a strided span)."""
    def edit(state):
        strided = state["model.layers.0.mlp.up_proj.weight"]
        state["model.layers.0.mlp.up_proj.weight"] = strided.t().contiguous().t()
        inner = state["model.layers.0.self_attn.q_proj.weight"]
        state["model.layers.0.self_attn.q_proj.weight"] = torch.cat([torch.ones(7), inner.flatten(), torch.ones(5)])[
            7:7 + inner.numel()].view(inner.shape)
        return state

    directory = bin_dir(family_dir("llama"), tmp_path / "llama", edit=edit)
    state = torch.load(directory / "pytorch_model.bin", map_location="meta", weights_only=True)
    assert not state["model.layers.0.mlp.up_proj.weight"].is_contiguous()
    assert state["model.layers.0.self_attn.q_proj.weight"].storage_offset() == 7
    for dtype in (torch.float32, torch.bfloat16):
        assert_same_model(load_model(directory, impl="scratch", dtype=dtype), hf_reference(directory, dtype)[0])


def test_a_cast_bin_read_a_slice_at_a_time_equals_one_cast(family_dir, tmp_path, monkeypatch, no_hf_model):
    """A float32 ``.bin`` read into bfloat16 through a 96-byte buffer (many slices, a last short one)."""
    monkeypatch.setattr(interp.convert.stream, "CHUNK_BYTES", 96)
    directory = bin_dir(family_dir("llama"), tmp_path / "llama")
    assert_same_model(load_model(directory, impl="scratch", dtype="bfloat16"),
                      hf_reference(directory, torch.bfloat16)[0])


def test_a_legacy_bin_goes_through_from_pretrained(family_dir, tmp_path, monkeypatch):
    """A pre-1.6 (non-zip) pickle holds its tensors inside the pickle stream: it is read by
    ``from_pretrained`` (with ``weights_only=True``) and converted, to the same model."""
    directory = bin_dir(family_dir("llama"), tmp_path / "legacy", _use_new_zipfile_serialization=False)
    assert (directory / "pytorch_model.bin").read_bytes()[:2] == b"\x80\x02"  # pickle protocol 2, no zip
    assert interp.convert.stream.weight_files(directory) == []
    calls = []
    load_hf = interp.loading.load_hf
    monkeypatch.setattr(interp.loading, "load_hf", lambda *args, **kw: calls.append(args) or load_hf(*args, **kw))
    ours = load_model(directory, impl="scratch", dtype="bfloat16")
    assert len(calls) == 1
    assert_same_model(ours, hf_reference(directory, torch.bfloat16)[0])
    read_by_file = load_model(bin_dir(family_dir("llama"), tmp_path / "zip"), impl="scratch", dtype="bfloat16")
    assert_same_model(ours, read_by_file)


def test_a_torch_that_does_not_give_offsets_reads_a_bin_through_from_pretrained(family_dir, tmp_path, monkeypatch):
    """Before torch 2.10, ``torch.load(map_location="meta")`` reads each storage and records no
    offset: the ``.bin`` goes through ``from_pretrained`` as it did, to the same model."""
    directory = bin_dir(family_dir("gpt2"), tmp_path / "gpt2")
    read_by_file = load_model(directory, impl="scratch")
    monkeypatch.setattr(interp.convert.stream, "_meta_load_gives_offsets", lambda: False)
    calls = []
    load_hf = interp.loading.load_hf
    monkeypatch.setattr(interp.loading, "load_hf", lambda *args, **kw: calls.append(args) or load_hf(*args, **kw))
    assert_same_model(load_model(directory, impl="scratch"), read_by_file)
    assert len(calls) == 1


def test_a_bin_of_other_objects_is_refused_in_one_line(family_dir, tmp_path):
    directory = bin_dir(family_dir("gpt2"), tmp_path / "config", edit=lambda state: {"step": 3, **state})
    with pytest.raises(UserError, match=r"pytorch_model.bin holds no state dict of tensors \(\{name: tensor\}\)"):
        load_model(directory, impl="scratch")
    torch.save({"made": fractions.Fraction(1, 3)}, directory / "pytorch_model.bin")  # not unpickled by weights_only
    with pytest.raises(UserError, match=r"pytorch_model.bin is not a readable torch.save file of tensors "
                                        r"\(weights_only=True\): WeightsUnpickler error: Unsupported global: "
                                        r"GLOBAL fractions.Fraction was not an allowed global by default$"):
        load_model(directory, impl="scratch")


def test_a_truncated_bin_is_refused_in_one_line(family_dir, tmp_path):
    directory = bin_dir(family_dir("gpt2"), tmp_path / "gpt2")
    data = (directory / "pytorch_model.bin").read_bytes()
    (directory / "pytorch_model.bin").write_bytes(data[:len(data) // 2])
    with pytest.raises(UserError, match=r"pytorch_model.bin is not a readable torch.save file of tensors "
                                        r"\(weights_only=True\): [^\n]*$"):
        load_model(directory, impl="scratch")


def test_safetensors_are_read_before_a_bin_beside_them(family_dir, tmp_path):
    """As ``from_pretrained`` prefers them."""
    directory = bin_dir(family_dir("gpt2"), tmp_path / "both")
    (directory / "model.safetensors").write_bytes((family_dir("gpt2") / "model.safetensors").read_bytes())
    assert interp.convert.stream.weight_files(directory) == [directory / "model.safetensors"]
