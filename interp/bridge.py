"""TransformerLens ``TransformerBridge``s over in-memory Hugging Face models (no network: the
config comes from the model and the tokenizer is passed in)."""

from __future__ import annotations

import copy

from interp.errors import UserError


def boot_bridge(hf_model, tokenizer, name: str = "model"):
    """A ``TransformerBridge`` over a copy of ``hf_model`` (any family the bridge supports).
    Booting rewires the model it is given, so it gets a copy and ``hf_model`` stays usable, e.g.
    for ``interp.from_hf``."""
    from transformer_lens.model_bridge import TransformerBridge

    if tokenizer is None:
        raise UserError(f"a TransformerBridge of {name!r} needs a tokenizer offline, and none was found or given")
    return TransformerBridge.boot_transformers(name, hf_model=copy.deepcopy(hf_model).eval(), tokenizer=tokenizer)
