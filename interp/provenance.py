"""Where a model's numbers come from, recorded in every output (``meta.json``, study records):
its family, the implementation that runs it, and a fingerprint of its weights, so results can be
traced to the exact weights that produced them and rows from other weights are never mixed into
a resumed file."""

from __future__ import annotations

import hashlib

import torch


def weights_hash(model: torch.nn.Module) -> str:
    """SHA-256 of every tensor in ``model.state_dict()`` (name, dtype, shape and bytes, in name
    order), as ``"sha256:<hex>"``. Independent of the device the weights are on."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        tensor = tensor.detach().cpu().contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return f"sha256:{digest.hexdigest()}"


def model_family(model) -> str:
    """The Hugging Face ``model_type`` a model was loaded as ("gpt2", "llama", ...), or
    "interp-gpt" for a checkpoint of our own. A ``GPTModel`` carries it as ``family``; a
    ``TransformerBridge`` reads it from the Hugging Face model it wraps."""
    family = getattr(model, "family", None)
    if family is None:
        family = model.original_model.config.model_type
    return str(family)


def model_impl(model) -> str:
    """"scratch" for our ``GPTModel``, "transformer_lens" for a ``TransformerBridge``."""
    return getattr(model, "impl", "transformer_lens")


def provenance(model) -> dict:
    """``{"family", "impl", "weights_hash"}`` of a hooked model, for output metadata, and
    ``"source_file"`` for a model read from a single file (GGUF: its path, SHA-256 and tensor types)."""
    found = {"family": model_family(model), "impl": model_impl(model), "weights_hash": weights_hash(model)}
    if getattr(model, "source_file", None) is not None:
        found["source_file"] = model.source_file
    return found
