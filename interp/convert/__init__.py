"""From a Hugging Face model to our from-scratch ``GPTModel``: one converter per family (DESIGN 3.4).

The converters (``interp.convert.gpt2``, ``interp.convert.llama`` for Llama / Mistral / Qwen2 / Gemma,
``interp.convert.neox``, ``interp.convert.phi``, ``interp.convert.bloom``; their shared parts in ``interp.convert.common``) are
the only code that asks which family a model is: each reads its family's config into
``GPTConfig`` knobs and maps its state dict onto ``GPTModel``. ``load_model`` reads directories and
hub ids and calls ``from_hf``; ``impl=None`` picks the from-scratch model for the families listed
here and the TransformerLens bridge for every other one. Every config field of each family is
implemented (logits equal Hugging Face's), has no effect there either, or is refused in one line;
every Hugging Face weight is read (docs/guides/families.md; tests/test_converter_options.py).
"""

from __future__ import annotations

import copy

import torch

from interp.convert.bloom import bloom_to_scratch
from interp.errors import UserError
from interp.convert.gpt2 import gpt2_to_scratch
from interp.convert.llama import gemma_to_scratch, llama_to_scratch, mistral_to_scratch, qwen2_to_scratch
from interp.model import GPTModel
from interp.convert.neox import gpt_neox_to_scratch
from interp.convert.phi import phi_to_scratch

# Hugging Face model_type -> its converter. A family listed here loads from scratch by default
# (``load_model(impl=None)``); each passes tests/test_scratch_families.py (logits vs Hugging Face,
# every hook vs the TransformerLens bridge) and tests/test_converter_options.py (every config field).
CONVERTERS = {
    "gpt2": gpt2_to_scratch,
    "llama": llama_to_scratch,
    "mistral": mistral_to_scratch,
    "qwen2": qwen2_to_scratch,
    "gemma": gemma_to_scratch,
    "gpt_neox": gpt_neox_to_scratch,
    "phi": phi_to_scratch,
    "bloom": bloom_to_scratch,
}


def scratch_families() -> tuple[str, ...]:
    """The Hugging Face ``model_type``s our ``GPTModel`` implements."""
    return tuple(CONVERTERS)


def check_scratch_family(family: str) -> None:
    """One line naming ``family`` and the ones the from-scratch model implements."""
    if family not in CONVERTERS:
        raise UserError(f"impl='scratch' does not implement the {family!r} family (it implements: "
                        f"{', '.join(CONVERTERS)}); use impl='transformer_lens' or leave impl unset")


def from_hf(hf_model, tokenizer=None, release: bool = False) -> GPTModel:
    """A ``GPTModel`` with the weights of an in-memory Hugging Face causal LM (logits equal its
    eager forward), in its dtype and on its device; ``tokenizer``: its HF tokenizer (the byte
    tokenizer when None). The model keeps the Hugging Face config as ``hf_config``
    (``interp.random_models.random_like`` rebuilds the same architecture from it, as the bridge's
    null does). ``release=True``: the caller drops ``hf_model`` afterwards, so the model takes its
    tensors as they are (no copy, where the layouts agree); by default the weights are copied and
    ``hf_model`` stays independent of the result."""
    family = hf_model.config.model_type
    check_scratch_family(family)
    model = CONVERTERS[family](hf_model, tokenizer)
    if not release:
        with torch.no_grad():
            for param in model.parameters():
                param.data = param.data.clone()
    model.hf_config = copy.deepcopy(hf_model.config)
    return model
