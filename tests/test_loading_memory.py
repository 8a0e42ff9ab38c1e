"""Loading costs the loaded model's own size (issue 24.2): peak resident memory while loading a
Llama-shaped directory with a 128,256-token vocabulary (d_model 1024, 1 layer, tied: 0.55 GB in
float32), in float32 or cast to bfloat16 (0.27 GB), and a GPT-2 directory (d_model 1024, 50,257
tokens, 2 layers: 0.31 GB, its Conv1D weights transposed) grows the process by at most 1.3x the
loaded model's bytes. Measured in a subprocess
(``VmHWM``, the kernel's high-water mark of resident memory) after the same subprocess has loaded
a tiny model of the same family by the same path, so the runtime (imports, tokenizer, the code the
first load pulls in) is in the baseline and only the weights' cost is measured."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

LIMIT = 1.3  # peak growth / the loaded model's bytes

MAKE = textwrap.dedent("""
    import sys
    from interp.random_models import save_random_model
    shape = dict(num_attention_heads=16, num_key_value_heads=4, intermediate_size=2816, tie_word_embeddings=True,
                 num_hidden_layers=1, hidden_size=1024)
    save_random_model("llama", sys.argv[1], d_vocab=128256, **shape)
    save_random_model("llama", sys.argv[2], d_vocab=128256, **(shape | dict(hidden_size=16, num_attention_heads=4,
                                                                        num_key_value_heads=2, intermediate_size=32)))
""")

MEASURE = textwrap.dedent("""
    import json, sys
    from interp import load_model
    def kb(key):
        return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(key)) * 1024
    big, tiny, impl, ours, dtype = sys.argv[1:6]
    if ours:  # our checkpoint format: written by save_checkpoint (in its own process, not measured here)
        big, tiny = ours + "/big", ours + "/tiny"
    warm = load_model(tiny, impl=impl, dtype=dtype)  # the runtime: imports, tokenizer, everything a load pulls in
    del warm
    base = kb("VmRSS:")
    model = load_model(big, impl=impl, dtype=dtype)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    print(json.dumps({"growth": kb("VmHWM:") - base, "weights": weights}))
""")


@pytest.fixture(scope="module")
def llama_dirs(tmp_path_factory):
    """(a 0.55 GB Llama directory, a tiny one of the same family and vocabulary), written once."""
    root = tmp_path_factory.mktemp("llama128k")
    subprocess.run([sys.executable, "-c", MAKE, str(root / "big"), str(root / "tiny")], check=True,
                   capture_output=True)
    return root / "big", root / "tiny"


def measure(big, tiny, impl: str, ours: str = "", dtype: str = "float32") -> dict:
    out = subprocess.run([sys.executable, "-c", MEASURE, str(big), str(tiny), impl, ours, dtype], check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def gpt2_dirs(tmp_path_factory):
    """(a 0.31 GB GPT-2 directory, a tiny one of the same vocabulary), written once."""
    root = tmp_path_factory.mktemp("gpt2_50k")
    make = textwrap.dedent("""
        import sys
        from interp.random_models import save_random_model
        save_random_model("gpt2", sys.argv[1], d_vocab=50257, n_ctx=1024, n_layer=2, n_embd=1024, n_head=16)
        save_random_model("gpt2", sys.argv[2], d_vocab=50257, n_ctx=1024, n_layer=2, n_embd=16, n_head=2)
    """)
    subprocess.run([sys.executable, "-c", make, str(root / "big"), str(root / "tiny")], check=True, capture_output=True)
    return root / "big", root / "tiny"


BIN_COPY = textwrap.dedent("""
    import shutil, sys, torch
    from pathlib import Path
    from transformers import AutoModelForCausalLM
    for source, target in zip(sys.argv[1:3], sys.argv[3:5]):
        shutil.copytree(source, target, ignore=shutil.ignore_patterns("*.safetensors"))
        state = AutoModelForCausalLM.from_pretrained(source).state_dict()  # a tied weight: one storage, two names
        torch.save(state, Path(target) / "pytorch_model.bin")
""")


def bin_copy(dirs, root) -> tuple:
    """The (big, tiny) directories again with their weights as ``pytorch_model.bin`` (a zip-format
    ``torch.save`` of the Hugging Face state dict, as ``save_pretrained(safe_serialization=False)``
    wrote it), written once per module from the same models."""
    subprocess.run([sys.executable, "-c", BIN_COPY, *map(str, dirs), str(root / "big"), str(root / "tiny")],
                   check=True, capture_output=True)
    return root / "big", root / "tiny"


@pytest.fixture(scope="module")
def llama_bin_dirs(llama_dirs, tmp_path_factory):
    return bin_copy(llama_dirs, tmp_path_factory.mktemp("llama128k_bin"))


@pytest.fixture(scope="module")
def gpt2_bin_dirs(gpt2_dirs, tmp_path_factory):
    return bin_copy(gpt2_dirs, tmp_path_factory.mktemp("gpt2_50k_bin"))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_loading_a_bin_directory_costs_the_models_own_size(llama_bin_dirs, dtype):
    """``pytorch_model.bin`` is read tensor by tensor as the safetensors files are: the float32
    file loaded in bfloat16 is never held whole, and no page of it stays mapped."""
    found = measure(*llama_bin_dirs, "scratch", dtype=dtype)
    assert found["weights"] > (500e6 if dtype == "float32" else 250e6)
    assert found["growth"] <= LIMIT * found["weights"], found


def test_loading_a_gpt2_bin_directory_costs_the_models_own_size(gpt2_bin_dirs):
    found = measure(*gpt2_bin_dirs, "scratch")
    assert found["weights"] > 300e6
    assert found["growth"] <= LIMIT * found["weights"], found


@pytest.mark.parametrize("impl", ["scratch", "transformer_lens"])
def test_loading_a_hugging_face_directory_costs_the_models_own_size(llama_dirs, impl):
    found = measure(*llama_dirs, impl)
    assert found["weights"] > 500e6  # the model is the large one
    assert found["growth"] <= LIMIT * found["weights"], found


def test_a_float32_directory_loaded_in_bfloat16_costs_the_bfloat16_models_size(llama_dirs):
    """The float32 file is never held whole: each tensor is read a slice at a time into bfloat16."""
    found = measure(*llama_dirs, "scratch", dtype="bfloat16")
    assert 250e6 < found["weights"] < 300e6  # two bytes a weight
    assert found["growth"] <= LIMIT * found["weights"], found


def test_loading_a_gpt2_directory_costs_the_models_own_size(gpt2_dirs):
    """GPT-2's Conv1D weights are stored (in, out): each is transposed as it is read, not all at once."""
    found = measure(*gpt2_dirs, "scratch")
    assert found["weights"] > 300e6
    assert found["growth"] <= LIMIT * found["weights"], found


def test_loading_our_checkpoint_costs_the_models_own_size(llama_dirs, tmp_path):
    big, tiny = llama_dirs
    convert = textwrap.dedent("""
        import sys
        from interp import ByteTokenizer, load_model
        from interp.loading import save_checkpoint
        for source, target in zip(sys.argv[1:3], sys.argv[3:5]):
            model = load_model(source, impl="scratch")
            model.tokenizer = ByteTokenizer()  # our format stores byte or fixed-vocabulary tokenizers
            save_checkpoint(model, target)
    """)
    subprocess.run([sys.executable, "-c", convert, str(big), str(tiny), str(tmp_path / "big"), str(tmp_path / "tiny")],
                   check=True, capture_output=True)
    found = measure(big, tiny, "scratch", str(tmp_path))
    assert found["growth"] <= LIMIT * found["weights"], found
