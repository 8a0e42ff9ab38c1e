"""A fingerprint of a model's weights, recorded in every output (``meta.json``, study specs) so
results can always be traced to the exact weights that produced them, and rows computed from
other weights are never mixed into a resumed file."""

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
