"""A Hugging Face directory's safetensors weights read tensor by tensor, at the loaded model's own
size (issue 24.2): ``SafetensorsWeights`` is what ``interp.convert.common.convert`` reads in place
of an in-memory state dict, so the from-scratch model is built from the files without building the
Hugging Face model first.

A tensor is read with plain file reads (no memory map, whose touched pages would stay resident)
straight into a tensor of the target dtype, a slice at a time where it is cast, so loading a float32
file in bfloat16 never holds the float32 copy. The names are checked against the Hugging Face model
the config describes (built on the meta device: no memory), as ``from_pretrained`` checks them: a
tensor it does not have, or of another shape, is refused in one line; a missing one is refused when
the table asks for it. The safetensors layout (an 8-byte little-endian header length, a JSON header
``{name: {"dtype", "shape", "data_offsets"}}``, then the data) is the format's specification.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

from interp.errors import UserError
from interp.hub import is_constant_buffer, refuse_mismatched_tensors

SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"
CHUNK_BYTES = 1 << 24  # a cast tensor is read this many bytes of the file at a time
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


def safetensors_files(directory: str | Path) -> list[Path]:
    """The safetensors files of a ``save_pretrained`` directory: ``model.safetensors``, or the shards
    its ``model.safetensors.index.json`` names; ``[]`` where it has neither (``.bin`` weights)."""
    directory = Path(directory)
    if (directory / SINGLE).is_file():
        return [directory / SINGLE]
    if not (directory / INDEX).is_file():
        return []
    try:
        shards = json.loads((directory / INDEX).read_bytes())["weight_map"].values()
    except (ValueError, KeyError, TypeError, AttributeError):
        raise UserError(f"{directory / INDEX} is not a safetensors index (a JSON object with a \"weight_map\" of "
                        "tensor name -> file)") from None
    return [directory / name for name in sorted(set(shards))]


class _Entry:
    """Where one tensor lies: its file, the byte offset of its data, its dtype and shape."""

    def __init__(self, path: Path, start: int, header: dict, name: str):
        try:
            self.dtype = _DTYPES[header["dtype"]]
            self.shape = tuple(int(n) for n in header["shape"])
            begin, end = (int(n) for n in header["data_offsets"])
        except KeyError as missing:
            raise UserError(f"{path}: tensor {name!r} has dtype {header.get('dtype')!r} or no {missing}; "
                            f"allowed dtypes: {', '.join(_DTYPES)}") from None
        self.path, self.offset, self.nbytes = path, start + begin, end - begin
        if self.nbytes != torch.Size(self.shape).numel() * self.dtype.itemsize:
            raise UserError(f"{path}: tensor {name!r} of shape {list(self.shape)} does not fill its {self.nbytes} bytes")


def _header(path: Path) -> tuple[int, dict]:
    """(the byte offset of the data, ``{name: header entry}``) of one safetensors file."""
    try:
        with open(path, "rb") as file:
            (length,) = struct.unpack("<Q", file.read(8))
            header = json.loads(file.read(length))
    except (OSError, struct.error, ValueError) as error:
        raise UserError(f"{path} is not a readable safetensors file: {error}") from None
    if not isinstance(header, dict):
        raise UserError(f"{path} is not a readable safetensors file: its header is no JSON object")
    header.pop("__metadata__", None)
    return 8 + length, header


def _read(entry: _Entry, dtype: torch.dtype) -> torch.Tensor:
    """One tensor of a file in ``dtype`` (integer and bool tensors keep theirs): read straight into
    the result where the dtypes agree, else ``CHUNK_BYTES`` at a time through one buffer, cast into it."""
    target = dtype if entry.dtype.is_floating_point else entry.dtype
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


class SafetensorsWeights:
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
        expected = {name: tuple(tensor.shape) for name, tensor in meta.state_dict().items()}
        transforms = get_model_conversion_mapping(meta)
        converters = [t for t in transforms if not isinstance(t, WeightRenaming)]
        if converters:
            raise UserError(f"{source!r}: transformers converts {hf_cfg.model_type} checkpoint tensors "
                            f"({converters[0].source_patterns}) as it loads them, which reading the files tensor by "
                            "tensor does not do; use impl='transformer_lens'")
        self.entries: dict[str, _Entry] = {}
        for path in files:
            start, header = _header(path)
            for name, fields in header.items():
                if not is_constant_buffer(name):
                    ours, _ = rename_source_key(name, transforms, [], meta.base_model_prefix, expected)
                    self.entries[ours] = _Entry(path, start, fields, name)
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
        """The names in the files never read (a file holds a tied weight once)."""
        return [name for name in self.entries if name not in self.read]
