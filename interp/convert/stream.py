"""A Hugging Face directory's weights read tensor by tensor, at the loaded model's own size
(architecture §3.3): ``FileWeights`` is what ``interp.convert.common.convert`` reads in place of an in-memory
state dict, so the from-scratch model is built from the files without building the Hugging Face
model first. The files are safetensors (``model.safetensors`` or its shards) or, where a directory
has none, ``pytorch_model.bin`` (or its shards) as ``torch.save`` has written it since torch 1.6 (a
zip file whose tensors' bytes lie uncompressed, each storage a record of its own).

A tensor is read with plain file reads (no memory map, whose touched pages would stay resident)
straight into a tensor of the target dtype, a slice at a time where it is cast, so loading a float32
file in bfloat16 never holds the float32 copy. Where each tensor lies: a safetensors file's header
(an 8-byte little-endian length, a JSON header ``{name: {"dtype", "shape", "data_offsets"}}``, then
the data: the format's specification); a ``.bin`` file's pickle, read by
``torch.load(map_location="meta", weights_only=True)``, which unpickles nothing but tensors, reads no
tensor data, and gives each storage's byte offset in the file. The names are checked against the
Hugging Face model the config describes (built on the meta device: no memory), as
``from_pretrained`` checks them: a tensor it does not have, or of another shape, is refused in one
line; a missing one is refused when the table asks for it.
"""

from __future__ import annotations

import functools
import io
import json
import pickle
import struct
import sys
import zipfile
from pathlib import Path

import torch

from interp.errors import UserError
from interp.hub import is_constant_buffer, refuse_mismatched_tensors

SAFETENSORS = ("model.safetensors", "model.safetensors.index.json")  # (one file, the index of shards)
BIN = ("pytorch_model.bin", "pytorch_model.bin.index.json")
CHUNK_BYTES = 1 << 24  # a cast tensor is read this many bytes of the file at a time
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


def weight_files(directory: str | Path) -> list[Path]:
    """The weight files of a ``save_pretrained`` directory that can be read tensor by tensor:
    ``model.safetensors`` or the shards its index names; else ``pytorch_model.bin`` or the shards
    its index names, where every one is a zip-format ``torch.save`` file and this torch gives a
    tensor's place in one. ``[]`` where it has neither, or its ``.bin`` files are legacy (pre-1.6,
    non-zip) pickles, whose tensors lie inside the pickle stream, or torch is older than 2.10
    (``from_pretrained`` reads those)."""
    directory = Path(directory)
    files = _listed_files(directory, *SAFETENSORS) or _listed_files(directory, *BIN)
    if files and files[0].suffix == ".bin" and not (_meta_load_gives_offsets() and all(map(_is_zip, files))):
        return []
    return files


@functools.cache
def _meta_load_gives_offsets() -> bool:
    """Whether this torch's ``torch.load(map_location="meta")`` records each storage's byte offset
    in the file (``_checkpoint_offset``) without reading it: torch 2.10 and later (tried once on a
    one-tensor file in memory)."""
    buffer = io.BytesIO()
    torch.save({"probe": torch.zeros(1)}, buffer)
    buffer.seek(0)
    probe = torch.load(buffer, map_location="meta", weights_only=True)["probe"]
    return getattr(probe.untyped_storage(), "_checkpoint_offset", None) is not None


def _is_zip(path: Path) -> bool:
    """Whether a file begins as a zip file does (``torch.save``'s format since torch 1.6; a legacy
    pickle begins with the pickle protocol's mark)."""
    try:
        with open(path, "rb") as file:
            return file.read(4) == b"PK\x03\x04"
    except OSError:
        return False


def _listed_files(directory: Path, single: str, index: str) -> list[Path]:
    """``[directory / single]``, or the shards ``directory / index`` names (its ``weight_map`` of
    tensor name -> file), or ``[]`` where neither is there."""
    if (directory / single).is_file():
        return [directory / single]
    if not (directory / index).is_file():
        return []
    try:
        shards = json.loads((directory / index).read_bytes())["weight_map"].values()
    except (ValueError, KeyError, TypeError, AttributeError):
        raise UserError(f"{directory / index} is not a weights index (a JSON object with a \"weight_map\" of "
                        "tensor name -> file)") from None
    return [directory / name for name in sorted(set(shards))]


class _Entry:
    """Where one tensor lies: its file, the byte offset of its first element, its dtype and shape,
    and its strides where it is not contiguous (a view ``torch.save`` kept as it was)."""

    def __init__(self, path: Path, offset: int, dtype: torch.dtype, shape, stride: tuple | None = None):
        self.path, self.offset, self.dtype, self.shape, self.stride = path, offset, dtype, tuple(shape), stride

    def span(self) -> int:
        """How many elements of the file, from the first, the tensor's elements lie among."""
        if self.stride is None or not all(self.shape):
            return torch.Size(self.shape).numel()
        return 1 + sum((size - 1) * step for size, step in zip(self.shape, self.stride))


def _safetensors_entries(path: Path) -> dict[str, _Entry]:
    """``{file name: entry}`` of one safetensors file, from its header."""
    try:
        with open(path, "rb") as file:
            (length,) = struct.unpack("<Q", file.read(8))
            header = json.loads(file.read(length))
    except (OSError, struct.error, ValueError) as error:
        raise UserError(f"{path} is not a readable safetensors file: {error}") from None
    if not isinstance(header, dict):
        raise UserError(f"{path} is not a readable safetensors file: its header is no JSON object")
    header.pop("__metadata__", None)
    entries = {}
    for name, fields in header.items():
        try:
            dtype, shape = _DTYPES[fields["dtype"]], [int(n) for n in fields["shape"]]
            begin, end = (int(n) for n in fields["data_offsets"])
        except KeyError as missing:
            raise UserError(f"{path}: tensor {name!r} has dtype {fields.get('dtype')!r} or no {missing}; "
                            f"allowed dtypes: {', '.join(_DTYPES)}") from None
        if end - begin != torch.Size(shape).numel() * dtype.itemsize:
            raise UserError(f"{path}: tensor {name!r} of shape {shape} does not fill its {end - begin} bytes")
        entries[name] = _Entry(path, 8 + length + begin, dtype, shape)
    return entries


def _bin_entries(path: Path) -> dict[str, _Entry]:
    """``{file name: entry}`` of one zip-format ``torch.save`` file of a state dict: its pickle read
    with ``weights_only=True`` onto the meta device (no tensor data read), each storage's byte
    offset in the file as ``torch.load`` records it on a meta storage."""
    try:
        state = torch.load(path, map_location="meta", weights_only=True)
        with zipfile.ZipFile(path) as archive:
            order = [archive.read(n) for n in archive.namelist() if n.endswith("/byteorder")]
    except (RuntimeError, pickle.UnpicklingError, OSError, ValueError, EOFError, zipfile.BadZipFile) as error:
        raise UserError(f"{path} is not a readable torch.save file of tensors (weights_only=True): "
                        f"{_reason(error)}") from None
    if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor) for t in state.values()):
        raise UserError(f"{path} holds no state dict of tensors ({{name: tensor}}), which a pytorch_model.bin is")
    if order and order[0].decode() != sys.byteorder:
        raise UserError(f"{path} was written {order[0].decode()}-endian; reading it tensor by tensor needs "
                        f"{sys.byteorder}-endian tensors")
    entries = {}
    for name, tensor in state.items():
        offset = tensor.untyped_storage()._checkpoint_offset + tensor.storage_offset() * tensor.element_size()
        stride = None if tensor.is_contiguous() else tensor.stride()
        entries[name] = _Entry(path, offset, tensor.dtype, tensor.shape, stride)
    return entries


def _reason(error: Exception) -> str:
    """The line of a ``torch.load`` error that says what is wrong: the unpickler's (a global
    ``weights_only`` does not allow, without the advice around it), else the first."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()] or [type(error).__name__]
    found = next((line for line in lines if line.startswith("WeightsUnpickler error:")), lines[0])
    return found.split(". Please use")[0]


def _read(entry: _Entry, dtype: torch.dtype) -> torch.Tensor:
    """One tensor of a file in ``dtype`` (integer and bool tensors keep theirs): read straight into
    the result where the dtypes agree, else ``CHUNK_BYTES`` at a time through one buffer, cast into
    it. A strided view: the bytes it spans, read as they lie, then copied into a contiguous result."""
    target = dtype if entry.dtype.is_floating_point else entry.dtype
    if entry.stride is not None:
        laid = _read(_Entry(entry.path, entry.offset, entry.dtype, (entry.span(),)), entry.dtype)
        return torch.empty(entry.shape, dtype=target).copy_(laid.as_strided(entry.shape, entry.stride))
    out = torch.empty(entry.shape, dtype=target)
    flat = out.view(-1)
    with open(entry.path, "rb", buffering=0) as file:
        file.seek(entry.offset)
        if target == entry.dtype:
            _fill(file, flat, entry.path)
            return out
        step = max(1, CHUNK_BYTES // entry.dtype.itemsize)
        buffer = torch.empty(min(step, flat.numel()), dtype=entry.dtype)
        for start in range(0, flat.numel(), step):
            part = flat[start:start + step]
            _fill(file, buffer[:part.numel()], entry.path)
            part.copy_(buffer[:part.numel()])
    return out


def _fill(file, tensor: torch.Tensor, path: Path) -> None:
    """Fill a contiguous 1-D ``tensor`` with the file's next bytes (a read may return fewer: Linux
    reads at most 2 GiB at once)."""
    view = memoryview(tensor.view(torch.uint8).numpy())
    done = 0
    while done < len(view):
        got = file.readinto(view[done:])
        if not got:
            raise UserError(f"{path} is truncated: a tensor's data runs past its end")
        done += got


def _same_values(one: _Entry, other: _Entry) -> bool:
    """Whether two entries hold the same tensor: the same bytes of a file read the same way, or
    equal bytes, compared ``CHUNK_BYTES`` at a time (neither tensor is held)."""
    if (one.dtype, one.shape, one.stride) != (other.dtype, other.shape, other.stride):
        return False
    if (one.path, one.offset) == (other.path, other.offset):
        return True
    size = one.span() * one.dtype.itemsize
    with open(one.path, "rb") as first, open(other.path, "rb") as second:
        first.seek(one.offset)
        second.seek(other.offset)
        return all(first.read(min(CHUNK_BYTES, size - done)) == second.read(min(CHUNK_BYTES, size - done))
                   for done in range(0, size, CHUNK_BYTES))


class FileWeights:
    """The weights of a Hugging Face directory as ``{name: tensor}`` read on demand, in ``dtype``,
    under the names of the Hugging Face model ``hf_cfg`` describes: each file name renamed as
    ``from_pretrained`` renames it (transformers' own renamings: GPT-NeoX's ``embed_out`` is
    ``lm_head``; a checkpoint saved without the base model's prefix, as GPT-2's on the hub, gets
    it). Records what was read (``[]``; ``in`` is no read) as ``interp.convert.common.HFWeights``
    does, so a tensor no row reads is refused."""

    def __init__(self, files: list[Path], hf_cfg, dtype: torch.dtype, source: str):
        from transformers import AutoModelForCausalLM
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, rename_source_key

        with torch.device("meta"):
            meta = AutoModelForCausalLM.from_config(hf_cfg)
        state = meta.state_dict(keep_vars=True)
        expected = {name: tuple(tensor.shape) for name, tensor in state.items()}
        self.weight_of = {name: id(tensor) for name, tensor in state.items()}  # tied names: one weight
        transforms = get_model_conversion_mapping(meta)
        converters = [t for t in transforms if not isinstance(t, WeightRenaming)]
        if converters:
            raise UserError(f"{source!r}: transformers converts {hf_cfg.model_type} checkpoint tensors "
                            f"({converters[0].source_patterns}) as it loads them, which reading the files tensor by "
                            "tensor does not do; use impl='transformer_lens'")
        self.entries: dict[str, _Entry] = {}
        for path in files:
            for name, entry in (_safetensors_entries if path.suffix == ".safetensors" else _bin_entries)(path).items():
                if not is_constant_buffer(name):
                    ours, _ = rename_source_key(name, transforms, [], meta.base_model_prefix, expected)
                    self.entries[ours] = entry
        misshaped = [name for name, entry in self.entries.items()
                     if name in expected and entry.shape != expected[name]]
        refuse_mismatched_tensors(source, (), set(self.entries) - set(expected), misshaped)
        self.dtype, self.source, self.read = dtype, source, set()

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.entries:
            refuse_mismatched_tensors(self.source, [name], (), ())
        self.read.add(name)
        return _read(self.entries[name], self.dtype)

    def unread(self) -> list[str]:
        """The names in the files never read, but for a tied weight: a name the Hugging Face model
        ties to a read one (its ``lm_head`` is the embedding) holding the same tensor, which
        ``from_pretrained`` ties too (a safetensors file holds a tied weight once, a ``.bin`` file
        under both names). One holding another tensor is unread: ``from_pretrained`` unties it."""
        read = {self.weight_of[name]: self.entries[name] for name in self.read}
        return [name for name, entry in self.entries.items() if name not in self.read
                and not (self.weight_of[name] in read and _same_values(entry, read[self.weight_of[name]]))]
