"""Small GGUF files for the tests, written with the ``gguf`` package's own writer from a randomly
initialised Hugging Face model, as llama.cpp's converter would write them: its tensor names
(``gguf``'s table), its layout changes (Llama's rotary rows interleaved per head, BLOOM's packed
projections grouped, GPT-2's ``Conv1D`` weights transposed, Gemma's norms stored as ``1 + weight``, Llama 3's scaled
RoPE as the ``rope_freqs`` tensor, BLOOM's embeddings copied into ``output.weight`` tied or not),
the hyper-parameters under the keys transformers reads (its own table, inverted) and a byte-level
BPE tokenizer. Every 2-D weight is stored in the quantization type asked for; vectors stay F32, as
llama.cpp keeps them.

This is test code: it is the inverse of what ``interp.convert.gguf`` undoes, written separately,
and the files it writes are checked against transformers' own GGUF load."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch
from einops import rearrange

# Hugging Face model_type -> llama.cpp architecture
ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "gpt2": "gpt2", "bloom": "bloom",
        "qwen3": "qwen3", "phi3": "phi3", "stablelm": "stablelm", "starcoder2": "starcoder2", "gemma2": "gemma2",
        "gemma3_text": "gemma3", "falcon": "falcon", "nemotron": "nemotron"}
# where the f16 scales lie in a block of each K-quant type (random bytes elsewhere are valid values)
K_SCALES = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
Q = gguf.GGMLQuantizationType
COPIES_EMBEDDINGS = ("bloom",)  # architectures llama.cpp writes with output.weight, tied or not


def write_gguf(model, tokenizer, path: str | Path, kind: str = "F32", name: str = "test model",
               add_bos_token: bool | None = None, chat_template: str | None = None) -> Path:
    """Write ``model`` (a Hugging Face causal LM) and ``tokenizer`` as a GGUF file at ``path``, every
    2-D weight in the ggml type ``kind`` (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 through
    ``gguf``'s quantizer; the K-quants as random blocks with small scales); ``add_bos_token`` and
    ``chat_template``: the tokenizer's ``tokenizer.ggml.add_bos_token`` and ``tokenizer.chat_template``
    (None: the file has none); returns ``path``."""
    config = model.config
    arch = ARCH[config.model_type]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(name)
    _write_config(writer, arch, config)
    _write_tokenizer(writer, tokenizer, config.vocab_size)
    if add_bos_token is not None:
        writer.add_add_bos_token(add_bos_token)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    table = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch),
                                     config.num_hidden_layers)
    state = model.state_dict()
    # a tied unembedding is left out, but for BLOOM: llama.cpp's converter always writes its copy
    tied = getattr(config, "tie_word_embeddings", False) and arch not in COPIES_EMBEDDINGS
    seed = np.random.default_rng(0)
    for hf_name, tensor in state.items():
        if tied and hf_name == "lm_head.weight":
            continue
        gguf_name = _gguf_name(table, hf_name)
        if gguf_name is None:
            continue  # a buffer (rotary frequencies, a causal mask)
        values = _as_llama_cpp(arch, gguf_name, tensor.detach().float(), config).numpy()
        _add(writer, gguf_name, values, kind if values.ndim == 2 else "F32", seed)
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type") == "llama3":  # llama.cpp keeps Llama 3's scaled RoPE as this tensor alone
        writer.add_tensor("rope_freqs.weight", _llama3_rope_factors(config))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def _gguf_name(table, hf_name: str) -> str | None:
    module, _, kind = hf_name.rpartition(".")
    parts = module.split(".")
    for start in range(len(parts)):
        found = table.get_name(".".join(parts[start:]))
        if found is not None:
            return f"{found}.{kind}"
    return None


def _as_llama_cpp(arch: str, name: str, tensor: torch.Tensor, config) -> torch.Tensor:
    """What llama.cpp's converter does to a tensor before it stores it."""
    if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
        heads = config.num_attention_heads if "attn_q" in name else config.num_key_value_heads
        return rearrange(tensor, "(h two half) c -> (h half two) c", h=heads, two=2)
    if arch == "bloom" and ".attn_qkv." in name:
        return rearrange(tensor, "(h three d) ... -> (three h d) ...", three=3, h=config.n_head)
    if arch == "gpt2" and name.endswith(("attn_qkv.weight", "attn_output.weight", "ffn_up.weight", "ffn_down.weight")):
        return tensor.t().contiguous()
    if arch in ("gemma2", "gemma3", "nemotron") and name.endswith("norm.weight"):
        return tensor + 1
    return tensor


def _llama3_rope_factors(config) -> np.ndarray:
    """What llama.cpp's converter stores as ``rope_freqs.weight`` for ``rope_type="llama3"``: per
    rotary frequency the number llama.cpp divides it by, float32 (head_dim // 2,)."""
    rope = config.rope_parameters
    dim = config.head_dim
    frequencies = 1.0 / rope["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
    wavelengths = 2 * np.pi / frequencies
    old_context = rope["original_max_position_embeddings"]
    low_wavelength = old_context / rope["low_freq_factor"]
    high_wavelength = old_context / rope["high_freq_factor"]
    smooth = (old_context / wavelengths - rope["low_freq_factor"]) / (rope["high_freq_factor"] - rope["low_freq_factor"])
    middle = 1 / ((1 - smooth) / rope["factor"] + smooth)
    factors = np.where(wavelengths < high_wavelength, 1.0,
                       np.where(wavelengths > low_wavelength, rope["factor"], middle))
    return factors.astype(np.float32)


def _add(writer, name: str, values: np.ndarray, kind: str, rng) -> None:
    values = np.ascontiguousarray(values, dtype=np.float32)
    if kind == "F32":
        writer.add_tensor(name, values)
    elif kind in K_SCALES:
        block_values, block_bytes = gguf.GGML_QUANT_SIZES[Q[kind]]
        blocks = rng.integers(0, 256, (values.shape[0], values.shape[1] // block_values, block_bytes), dtype=np.uint8)
        for at in K_SCALES[kind]:
            blocks[..., at:at + 2] = np.frombuffer(np.float16(0.002).tobytes(), np.uint8)
        writer.add_tensor(name, blocks.reshape(values.shape[0], -1), raw_dtype=Q[kind])
    else:
        writer.add_tensor(name, gguf.quants.quantize(values, Q[kind]), raw_dtype=Q[kind])


def _write_config(writer, arch: str, config) -> None:
    """Each hyper-parameter under the key transformers maps back onto ``config`` (its GGUF table)."""
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    family = "mistral" if config.model_type == "mistral" else arch
    for key, attribute in GGUF_CONFIG_MAPPING[family if family in GGUF_CONFIG_MAPPING else arch].items():
        value = getattr(config, attribute, None) if isinstance(attribute, str) else None
        if attribute == "rope_theta":  # Gemma 3: the full-attention layers' (llama.cpp fixes the local ones')
            rope = config.rope_parameters
            value = rope["rope_theta"] if "rope_theta" in rope else rope["full_attention"]["rope_theta"]
        if isinstance(value, bool) or value is None:
            continue
        if isinstance(value, int):
            writer.add_uint32(f"{arch}.{key}", value)
        elif isinstance(value, float):
            writer.add_float32(f"{arch}.{key}", value)


def _write_tokenizer(writer, tokenizer, vocab_size: int) -> None:
    """The tokenizer as a byte-level BPE (llama.cpp's "gpt2" kind), padded to the model's vocabulary,
    with one merge ("!" "!" -> "!!", the first padding id: transformers reads a file without merges
    as one whose merges are to be recovered from scores)."""
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer)))) + ["!!"]
    tokens += [f"<unused{i}>" for i in range(vocab_size - len(tokens))]
    special = set(tokenizer.all_special_ids)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i in special else 1 for i in range(len(tokens))])
    writer.add_token_merges(["! !"])
    for kind in ("bos", "eos", "pad", "unk"):
        token_id = getattr(tokenizer, f"{kind}_token_id")
        if token_id is not None:
            getattr(writer, f"add_{kind}_token_id" if kind != "pad" else "add_pad_token_id")(token_id)
