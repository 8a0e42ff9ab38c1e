"""GGUF files (llama.cpp's format, as llama.cpp, Ollama and LM Studio hold models) read tensor by
tensor (architecture §3.3, §4.11).

A GGUF file is a header (metadata key/values: the architecture's hyper-parameters and the
tokenizer's vocabulary), a table of tensors (name, shape, ggml type, offset) and the tensors'
bytes, each in its ggml type: plain floats (F32, F16, BF16) or blocks of quantized values (Q8_0,
Q4_1, the K-quants, ...). Reading one:

- the header and table with the ``gguf`` package's ``GGUFReader`` (llama.cpp's own reader), once,
  checked before any weight is read: a file that is not GGUF or is truncated, an architecture
  interp does not read (``readable_architectures``), a tensor type ``gguf`` cannot dequantize, no
  tokenizer in the metadata, each refused in one line (``GGUFFile``);
- the config and the tokenizer as transformers rebuilds them from that metadata
  (``AutoConfig``/``AutoTokenizer.from_pretrained(folder, gguf_file=name)``), so a model reads the
  file's hyper-parameters exactly as transformers' own GGUF load does (but for ``DERIVED``, below);
- each tensor by plain file reads, a slice of rows at a time, dequantized by ``gguf``
  (``gguf.quants.dequantize``: float32) and cast into the asked dtype as it goes, so loading holds
  the model in that dtype and a slice or two, never the file's float32 expansion
  (``GGUFWeights``);
- llama.cpp's tensor names (``blk.3.attn_q.weight``) mapped back onto Hugging Face's, through
  ``gguf``'s own table of names (``TensorNameMap``), and the layout changes llama.cpp's converter
  makes undone (``UNDO``): the rows of Llama's rotary query and key weights are interleaved per
  head, BLOOM's packed query/key/value rows are grouped by projection, GPT-2's ``Conv1D`` weights
  are stored transposed, Gemma 2 and 3's norm weights are stored plus 1;
- Llama 3's scaled RoPE, which llama.cpp keeps only as the tensor ``rope_freqs.weight`` (one
  divisor per rotary frequency), put on the config (``GGUFFile.hf_config``) for the conversion to
  divide the frequencies by; transformers' own load drops it (``check_transformers_load``);
- metadata llama.cpp writes and transformers' config leaves out (``DROPPED_METADATA``: Gemma 2's
  soft caps, Gemma 3's local RoPE base, its layer pattern and its global layers' RoPE scaling):
  where the file's value is not what the config holds, both loads would run another model than
  llama.cpp's, and the file is refused in one line (``GGUFFile.check_metadata``);
- hyper-parameters a config needs and a file does not hold (``DERIVED``: the number Gemma 2 and 3
  divide attention scores by the square root of, ``query_pre_attn_scalar``), derived from the
  file's shapes as llama.cpp derives them and put on the config (``GGUFFile.hf_config``), so both
  the from-scratch model and transformers' load under the bridge run llama.cpp's scores, not the
  config class's default (256);

The result is the Hugging Face state dict the family table (``interp.convert.CONVERTERS``) reads,
so a family the from-scratch model implements is built from it directly; other architectures go
through transformers' own GGUF load and the TransformerLens bridge (``interp.loading``).

What the model is: the quantized weights as llama.cpp runs them, dequantized; not the original
weights the file was made from.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from einops import rearrange

from interp.errors import UserError, first_line

SUFFIX = ".gguf"
ROWS_BYTES = 1 << 24  # a tensor is dequantized this many float32 bytes of rows at a time
# llama.cpp stores Llama 3's scaled RoPE only as this tensor: one divisor per rotary frequency (the
# metadata names no scaling); ``GGUFFile.hf_config`` puts it on the config as ``ROPE_DIVISORS``,
# which the conversion reads (``interp.convert.common.convert``)
ROPE_FREQS = "rope_freqs.weight"
ROPE_DIVISORS = "gguf_rope_divisors"
# llama.cpp's unembedding and embeddings: a tied model's file may hold both (BLOOM's always does)
OUTPUT, EMBEDDINGS = "output.weight", "token_embd.weight"
# llama.cpp architectures transformers reads from GGUF whose checkpoints have no place in a hooked
# attention model: encoder-decoders, state-space models, and mixtures of experts (their experts are
# stacked in one tensor that transformers splits by hand)
REFUSED = {"t5": "an encoder-decoder", "t5encoder": "an encoder", "umt5": "an encoder-decoder",
           "mamba": "a state-space model without attention", "lfm2": "a hybrid of convolutions and attention",
           "qwen2moe": "a mixture of experts", "qwen3moe": "a mixture of experts",
           "gpt-oss": "a mixture of experts", "minimax-m2": "a mixture of experts",
           "qwen35": "a hybrid of linear (gated delta-net) and full attention",
           "qwen35moe": "a hybrid of linear and full attention with a mixture of experts"}


def _interleaved_rotary(heads_key: str):
    """Undo llama.cpp's permutation of a rotary projection's output rows: within each of the
    ``config[heads_key]`` heads it stores the two rotated halves interleaved, pair by pair
    (``(h half two)``), where Hugging Face keeps them as halves (``(h two half)``)."""
    def undo(tensor: torch.Tensor, config) -> torch.Tensor:
        heads = getattr(config, heads_key) or config.num_attention_heads
        return rearrange(tensor, "(h half two) ... -> (h two half) ...", h=heads, two=2)
    return undo


def _per_head_qkv(tensor: torch.Tensor, config) -> torch.Tensor:
    """Undo llama.cpp's grouping of BLOOM's packed query/key/value rows by projection
    (``(three h d)``): Hugging Face packs them per head (``(h three d)``)."""
    return rearrange(tensor, "(three h d) ... -> (h three d) ...", three=3, h=config.n_head)


def _transposed(tensor: torch.Tensor, config) -> torch.Tensor:
    """GPT-2's ``Conv1D`` weights are (in, out); llama.cpp stores them as a linear layer's (out, in)."""
    return tensor.t()


def _less_one(tensor: torch.Tensor, config) -> torch.Tensor:
    """Gemma's RMSNorms multiply by ``1 + weight``; llama.cpp stores ``1 + weight`` (its norm
    multiplies by the weight): Hugging Face's weight is the stored one less 1."""
    return tensor - 1


# the RMSNorm weights of Gemma 2 and 3 (the last two: Gemma 3's query and key norms)
_GEMMA_NORMS = ("attn_norm.weight", "post_attention_norm.weight", "ffn_norm.weight", "post_ffw_norm.weight",
                "output_norm.weight", "attn_q_norm.weight", "attn_k_norm.weight")
# llama.cpp architecture -> {the end of a GGUF tensor name: what undoes llama.cpp's change to it}
UNDO = {
    "llama": {"attn_q.weight": _interleaved_rotary("num_attention_heads"),
              "attn_k.weight": _interleaved_rotary("num_key_value_heads")},
    "bloom": {"attn_qkv.weight": _per_head_qkv, "attn_qkv.bias": _per_head_qkv},
    "gpt2": {name: _transposed for name in ("attn_qkv.weight", "attn_output.weight", "ffn_up.weight",
                                             "ffn_down.weight")},
    "gemma2": {name: _less_one for name in _GEMMA_NORMS},
    "gemma3": {name: _less_one for name in _GEMMA_NORMS},
}


def _sliding_layers(config) -> list[bool]:
    """Per layer, whether the config's layer is local (a sliding window): Gemma 2 and 3's ``layer_types``."""
    return [kind == "sliding_attention" for kind in config.layer_types]


def _pattern_layers(value, config) -> list[bool]:
    """llama.cpp's ``sliding_window_pattern`` as one flag per layer (True: sliding): a flag per layer,
    or a period n (the first n - 1 layers of every n slide, as in Hugging Face's Gemma 3; 0: all)."""
    if isinstance(value, list):
        return [bool(flag) for flag in value]
    return [value == 0 or layer % value < value - 1 for layer in range(config.num_hidden_layers)]


def _rope_kind(value, config) -> str:
    """llama.cpp's ``rope.scaling.type`` in transformers' spelling ("none" is the plain RoPE)."""
    return "default" if value == "none" else value


def _as_float(value, config) -> float:
    return float(value)


# metadata llama.cpp's converter writes that transformers' GGUF config leaves out, per architecture:
# key (after "{arch}.") -> (the file's value as the config would hold it, what the config holds)
DROPPED_METADATA = {
    "gemma2": {"attn_logit_softcapping": (_as_float, lambda config: config.attn_logit_softcapping),
               "final_logit_softcapping": (_as_float, lambda config: config.final_logit_softcapping)},
    "gemma3": {"final_logit_softcapping": (_as_float, lambda config: config.final_logit_softcapping),
               "rope.freq_base_swa": (_as_float, lambda config: config.rope_parameters["sliding_attention"]["rope_theta"]),
               "attention.sliding_window_pattern": (_pattern_layers, _sliding_layers),
               "rope.scaling.type": (_rope_kind, lambda config: config.rope_parameters["full_attention"]["rope_type"])},
}


def _gemma_query_scalar(layers_of_27b: int):
    """llama.cpp's Gemma score scale, as the ``query_pre_attn_scalar`` its reciprocal square root
    is: ``embedding_length // head_count`` for the model llama.cpp takes as the 27B one (by its
    layer count, ``layers_of_27b``), the key width (``attention.key_length``; without it
    ``embedding_length // head_count``, llama.cpp's default) for every other."""
    def derive(metadata: dict, architecture: str) -> int:
        def key(name):
            return metadata[f"{architecture}.{name}"]
        heads = key("attention.head_count")
        heads = heads[0] if isinstance(heads, list) else heads  # a count per layer: llama.cpp reads layer 0's
        per_head_of_d_model = key("embedding_length") // heads
        if key("block_count") == layers_of_27b:
            return per_head_of_d_model
        return metadata.get(f"{architecture}.attention.key_length", per_head_of_d_model)
    return derive


# hyper-parameters a config needs that llama.cpp's files do not hold, per architecture: config
# attribute -> how llama.cpp derives it from the metadata ({key: value}, and the architecture)
DERIVED = {
    "gemma2": {"query_pre_attn_scalar": _gemma_query_scalar(layers_of_27b=46)},
    "gemma3": {"query_pre_attn_scalar": _gemma_query_scalar(layers_of_27b=62)},
}


def _same(first, second) -> bool:
    """Equal, numbers to float32 precision (the file stores float32)."""
    if isinstance(first, float) and isinstance(second, (int, float)):
        return math.isclose(first, second, rel_tol=1e-6)
    return first == second


@functools.cache
def dequantizable() -> frozenset:
    """The ggml types ``gguf`` can dequantize: each type tried once on one zero block."""
    import gguf

    found = set()
    for kind, (_, block_bytes) in gguf.GGML_QUANT_SIZES.items():
        try:
            gguf.quants.dequantize(np.zeros((1, block_bytes), np.uint8), kind)
        except NotImplementedError:
            continue
        found.add(kind)
    return frozenset(found)


@functools.cache
def readable_architectures() -> tuple[str, ...]:
    """The llama.cpp architectures (``general.architecture``, llama.cpp's spelling) interp loads:
    those transformers reads from GGUF and has a config class for, whose tensor names ``gguf``
    knows, but for the ones ``REFUSED``. (transformers' list also holds names llama.cpp never
    writes, as "mistral", and others it has no model for, as "deci".)"""
    import gguf
    from transformers import CONFIG_MAPPING
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    named = set(gguf.MODEL_ARCH_NAMES.values())
    return tuple(name for name in GGUF_SUPPORTED_ARCHITECTURES
                 if name in named and name in CONFIG_MAPPING and name not in REFUSED)


@dataclass(frozen=True)
class Entry:
    """Where one tensor lies: its absolute byte offset and size, its ggml type, its shape in torch
    order (rows first: the file lists ggml's dimensions innermost first)."""

    offset: int
    n_bytes: int
    kind: object  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]


class GGUFFile:
    """A GGUF file's header and tensor table, read once and checked: every tensor lies within the
    file and is of a type ``gguf`` can dequantize, the architecture is one interp reads
    (``readable_architectures``: transformers reads it, and a hooked model can hold it), and the
    metadata has a tokenizer. Each failure is one line.

    Attributes:
        path: the file.
        architecture: llama.cpp's name for it (``general.architecture``: "llama", "gpt2", ...).
        entries: ``{GGUF tensor name: Entry}``.
        add_bos_token: the file's ``tokenizer.ggml.add_bos_token`` (whether llama.cpp begins a text
            with the start token), None where it has none.
    """

    def __init__(self, path: str | os.PathLike):
        from gguf import GGUFReader

        self.path = Path(path)
        if not self.path.is_file():
            raise UserError(f"no such GGUF file {str(path)!r}")
        try:
            reader = GGUFReader(self.path)
        except Exception as error:  # the reader raises whatever its parse meets: ValueError, struct.error, ...
            raise UserError(f"{self.path} is not a readable GGUF file ({first_line(error)}); is it truncated or "
                            "corrupt?") from None
        if "general.architecture" not in reader.fields:
            raise UserError(f"{self.path} names no architecture (general.architecture), which every GGUF model has")
        self.architecture = str(reader.fields["general.architecture"].contents())
        self.metadata = {name: field.contents() for name, field in reader.fields.items()
                         if name.startswith(f"{self.architecture}.")}  # the architecture's hyper-parameters
        flag = reader.fields.get("tokenizer.ggml.add_bos_token")
        self.add_bos_token = None if flag is None else bool(flag.contents())
        self.entries = {t.name: Entry(int(t.data_offset), int(t.n_bytes), t.tensor_type,
                                      tuple(int(n) for n in reversed(t.shape.tolist()))) for t in reader.tensors}
        self._check(reader)

    def _check(self, reader) -> None:
        size = self.path.stat().st_size
        beyond = [name for name, entry in self.entries.items() if entry.offset + entry.n_bytes > size]
        if beyond:
            raise UserError(f"{self.path} is truncated: tensor {beyond[0]!r} runs past the end of its {size} bytes")
        if self.architecture in REFUSED:
            raise UserError(f"{self.path}: GGUF architecture {self.architecture!r} is {REFUSED[self.architecture]}, "
                            "which interp cannot hook as an attention model")
        if self.architecture not in readable_architectures():
            raise UserError(f"{self.path}: GGUF architecture {self.architecture!r} is not one interp reads "
                            f"(it reads: {', '.join(readable_architectures())})")
        odd = sorted({entry.kind.name for entry in self.entries.values() if entry.kind not in dequantizable()})
        if odd:
            raise UserError(f"{self.path} holds tensors of type {', '.join(odd)}, which the gguf package cannot "
                            f"dequantize (it can: {', '.join(sorted(k.name for k in dequantizable()))})")
        if "tokenizer.ggml.model" not in reader.fields or "tokenizer.ggml.tokens" not in reader.fields:
            raise UserError(f"{self.path} has no tokenizer in its metadata (tokenizer.ggml.model and "
                            "tokenizer.ggml.tokens); interp needs one to turn text into tokens")

    def quantization(self) -> dict[str, int]:
        """``{ggml type name: how many tensors are stored in it}``, e.g. ``{"Q4_1": 210, "F32": 61}``."""
        return dict(sorted(Counter(entry.kind.name for entry in self.entries.values()).items()))

    def sha256(self) -> str:
        """The file's SHA-256, as ``"sha256:<hex>"``."""
        return f"sha256:{file_sha256(self.path)}"

    def record(self) -> dict:
        """What an output's ``meta.json`` records of the file: its name, SHA-256 and tensor types."""
        return {"path": str(self.path), "sha256": self.sha256(), "quantization": self.quantization()}

    def hf_config(self):
        """The Hugging Face config transformers rebuilds from the metadata, with what the file does
        not hold derived from it as llama.cpp derives it (``DERIVED``), and the file's
        ``rope_freqs`` divisors (a list of rotary_dim // 2 floats) as ``gguf_rope_divisors`` where
        it has them (transformers reads no such tensor)."""
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(str(self.path.parent), gguf_file=self.path.name)
        for attribute, derive in DERIVED.get(self.architecture, {}).items():
            setattr(config, attribute, derive(self.metadata, self.architecture))
        if ROPE_FREQS in self.entries:
            setattr(config, ROPE_DIVISORS, read_tensor(self.path, self.entries[ROPE_FREQS], torch.float32).tolist())
        self.check_metadata(config)
        return config

    def check_metadata(self, hf_cfg) -> None:
        """Raise where the file's metadata holds a value that transformers' config leaves out
        (``DROPPED_METADATA``) and that is not what that config ``hf_cfg`` holds: transformers' own
        load, and ours from its config, would run another model than llama.cpp's."""
        for key, (as_config, held) in DROPPED_METADATA.get(self.architecture, {}).items():
            name = f"{self.architecture}.{key}"
            if name in self.metadata and not _same(as_config(self.metadata[name], hf_cfg), held(hf_cfg)):
                raise UserError(f"{self.path}: its metadata {name}={self.metadata[name]!r}, which transformers' GGUF "
                                f"reader drops, is not what its {hf_cfg.model_type} config then holds "
                                f"({held(hf_cfg)!r}); neither load would run llama.cpp's model")

    def check_transformers_load(self, hf_cfg) -> None:
        """Raise when transformers' own load of the file (``hf_cfg``: ``hf_config()``) would run
        another model than llama.cpp's: it drops the ``rope_freqs`` divisors, so a file whose
        divisors are not all 1 is refused in one line."""
        divisors = getattr(hf_cfg, ROPE_DIVISORS, None)
        if divisors is not None and any(d != 1.0 for d in divisors):
            raise UserError(f"{self.path} scales its rotary frequencies ({ROPE_FREQS}, divisors {min(divisors):g} to "
                            f"{max(divisors):g}), which transformers' GGUF load drops; use impl='scratch'")

    def tokenizer(self, hf_cfg):
        """The Hugging Face tokenizer transformers rebuilds from the metadata, for the model of
        ``hf_cfg`` (``hf_config()``: given, transformers does not read the file's config again)."""
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(self.path.parent), gguf_file=self.path.name, config=hf_cfg)


def file_sha256(path: Path) -> str:
    """The hex SHA-256 of a file, read a megabyte at a time."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_tensor(path: Path, entry: Entry, dtype: torch.dtype) -> torch.Tensor:
    """One tensor of the file, dequantized and cast into ``dtype``, shape ``entry.shape``: read
    ``ROWS_BYTES`` of float32 rows at a time (a row is whole quantization blocks: ggml quantizes
    along the innermost dimension)."""
    import gguf

    columns = entry.shape[-1]
    rows = int(np.prod(entry.shape[:-1], dtype=np.int64))  # 1 for a vector
    out = torch.empty((rows, columns), dtype=dtype)
    row_bytes = entry.n_bytes // rows
    step = max(1, ROWS_BYTES // (4 * columns))
    with open(path, "rb", buffering=0) as file:
        file.seek(entry.offset)
        for start in range(0, rows, step):
            count = min(step, rows - start)
            raw = np.empty((count, row_bytes), np.uint8)
            if file.readinto(memoryview(raw).cast("B")) != raw.size:
                raise UserError(f"{path} is truncated: a tensor's data runs past its end")
            values = gguf.quants.dequantize(raw, entry.kind).reshape(count, columns)
            out[start:start + count] = torch.from_numpy(values)
    return out.reshape(entry.shape)


class GGUFWeights:
    """A GGUF file's tensors as a Hugging Face state dict ``{name: tensor}`` read on demand, in
    ``dtype``, with llama.cpp's layout changes undone: what ``interp.convert.common.convert`` reads
    in place of a state dict in memory. The names come from ``gguf``'s table of tensor names,
    matched against the Hugging Face model the config describes (built on the meta device: no
    memory). A file tensor with no Hugging Face name, or of another shape than it, is refused in
    one line; so is a tied model's unembedding (``output.weight``) unless it is a copy of the
    embeddings (the same type and bytes), which is then left out. ``unread()`` lists the tensors
    the family table never read."""

    def __init__(self, file: GGUFFile, hf_cfg, dtype: torch.dtype):
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            meta = AutoModelForCausalLM.from_config(hf_cfg)
        expected = {name: tuple(t.shape) for name, t in meta.state_dict().items()}
        ours = _hf_names(file.architecture, hf_cfg.num_hidden_layers, expected)
        nameless = [name for name in file.entries if name not in ours and name != ROPE_FREQS]  # in hf_cfg
        if nameless:
            raise UserError(f"{file.path}: tensor {nameless[0]!r} has no place in the {hf_cfg.model_type} model "
                            f"its metadata describes ({len(nameless)} such tensors)")
        copy = OUTPUT if hf_cfg.tie_word_embeddings and OUTPUT in file.entries else None
        if copy is not None and (EMBEDDINGS not in file.entries
                                 or not _same_bytes(file.path, file.entries[OUTPUT], file.entries[EMBEDDINGS])):
            raise UserError(f"{file.path}: tensor {OUTPUT!r} differs from {EMBEDDINGS!r}, but the "
                            f"{hf_cfg.model_type} model its metadata describes ties its unembedding to its embeddings")
        self.file, self.config, self.dtype, self.read = file, hf_cfg, dtype, set()
        # HF name -> GGUF name
        self.names = {ours[name]: name for name in file.entries if name in ours and name != copy}
        self.undo = UNDO.get(file.architecture, {})
        misshaped = [hf for hf, name in self.names.items()
                     if _undone_shape(file.entries[name].shape, self._undo_of(name)) != expected[hf]]
        if misshaped:
            raise UserError(f"{file.path}: tensor {self.names[misshaped[0]]!r} has shape "
                            f"{file.entries[self.names[misshaped[0]]].shape}, not the {expected[misshaped[0]]} of "
                            f"{misshaped[0]} in the model its metadata describes")

    def _undo_of(self, name: str):
        return next((undo for end, undo in self.undo.items() if f".{name}".endswith(f".{end}")), None)

    def __contains__(self, name: str) -> bool:
        return name in self.names

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.names:
            raise UserError(f"{self.file.path} has no tensor for {name!r}, which the {self.config.model_type} "
                            "model needs")
        self.read.add(name)
        gguf_name = self.names[name]
        tensor = read_tensor(self.file.path, self.file.entries[gguf_name], self.dtype)
        undo = self._undo_of(gguf_name)
        return undo(tensor, self.config).contiguous() if undo is not None else tensor

    def unread(self) -> list[str]:
        """The file's tensors (as Hugging Face names) that were never read."""
        return [name for name in self.names if name not in self.read]


def _same_bytes(path: Path, first: Entry, second: Entry) -> bool:
    """Whether two of the file's tensors are stored alike: one type, one shape, the same bytes
    (compared ``ROWS_BYTES`` at a time)."""
    if (first.kind, first.shape, first.n_bytes) != (second.kind, second.shape, second.n_bytes):
        return False
    with open(path, "rb") as file:
        for start in range(0, first.n_bytes, ROWS_BYTES):
            size = min(ROWS_BYTES, first.n_bytes - start)
            file.seek(first.offset + start)
            chunk = file.read(size)
            file.seek(second.offset + start)
            if chunk != file.read(size):
                return False
    return True


def _undone_shape(shape: tuple[int, ...], undo) -> tuple[int, ...]:
    """A tensor's shape once ``undo`` is applied (only a transpose changes it)."""
    return tuple(reversed(shape)) if undo is _transposed else shape


def _hf_names(architecture: str, n_layers: int, expected: dict) -> dict[str, str]:
    """``{GGUF tensor name: Hugging Face name}`` for every name of ``expected`` (a Hugging Face
    state dict's names) that ``gguf``'s table of names knows, tried whole and without its leading
    module prefixes (the table spells some families' names from their base model on)."""
    import gguf

    arch = next(key for key, value in gguf.MODEL_ARCH_NAMES.items() if value == architecture)
    table = gguf.get_tensor_name_map(arch, n_layers)
    found = {}
    for hf_name in expected:
        module, _, kind = hf_name.rpartition(".")
        parts = module.split(".")
        for start in range(len(parts)):
            gguf_name = table.get_name(".".join(parts[start:]))
            if gguf_name is not None:
                found.setdefault(f"{gguf_name}.{kind}", hf_name)
                break
    return found
