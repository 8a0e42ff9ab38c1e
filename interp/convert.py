"""From a Hugging Face model to our from-scratch ``GPTModel``: one converter per family (DESIGN 3.4).

The only place that asks which family a model is. ``load_model`` reads directories and hub ids and
calls ``from_hf``; ``impl=None`` picks the from-scratch model for the families listed here and
the TransformerLens bridge for every other one.
"""

from __future__ import annotations

from interp.errors import UserError
from interp.gpt2 import gpt2_to_scratch
from interp.model import GPTModel

CONVERTERS = {"gpt2": gpt2_to_scratch}


def scratch_families() -> tuple[str, ...]:
    """The Hugging Face ``model_type``s our ``GPTModel`` implements."""
    return tuple(CONVERTERS)


def check_scratch_family(family: str) -> None:
    """One line naming ``family`` and the ones the from-scratch model implements."""
    if family not in CONVERTERS:
        raise UserError(f"impl='scratch' does not implement the {family!r} family (it implements: "
                        f"{', '.join(CONVERTERS)}); use impl='transformer_lens' or leave impl unset")


def from_hf(hf_model, tokenizer=None) -> GPTModel:
    """A ``GPTModel`` with the weights of an in-memory Hugging Face causal LM (logits equal its
    eager forward); ``tokenizer``: its HF tokenizer (the byte tokenizer when None)."""
    family = hf_model.config.model_type
    check_scratch_family(family)
    return CONVERTERS[family](hf_model, tokenizer)
