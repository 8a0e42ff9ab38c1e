"""TransformerLens ``TransformerBridge``s over in-memory Hugging Face models (no network: the
config comes from the model and the tokenizer is passed in)."""

from __future__ import annotations

import copy as _copy

from interp.errors import UserError


def boot_bridge(hf_model, tokenizer, name: str = "model", copy: bool = True):
    """A ``TransformerBridge`` over ``hf_model`` (any family the bridge supports). Booting rewires
    the model it is given, so by default it gets a copy and ``hf_model`` stays usable, e.g. for
    ``interp.from_hf``; ``copy=False`` boots ``hf_model`` itself (no second set of weights in
    memory, and a model placed over several devices by a ``device_map`` stays where it is)."""
    from transformer_lens.model_bridge import TransformerBridge

    if tokenizer is None:
        raise UserError(f"a TransformerBridge of {name!r} needs a tokenizer offline, and none was found or given")
    model = _copy.deepcopy(hf_model) if copy else hf_model
    return TransformerBridge.boot_transformers(name, hf_model=model.eval(), tokenizer=tokenizer)
