"""From a Hugging Face model to our from-scratch ``GPTModel`` (architecture §3.4): one table of families.

``CONVERTERS`` (``interp.convert.families``) holds a row per Hugging Face ``model_type``: where its
weights are and how its config reads into ``GPTConfig`` knobs; ``interp.convert.common.convert``
reads any row. That table is the only code that asks which family a model is. ``load_model`` reads
directories (safetensors or ``.bin`` weights tensor by tensor, ``interp.convert.stream``) and hub ids;
``impl=None`` picks the from-scratch model for the families listed here and the TransformerLens
bridge for every other one. Every config field of each family is implemented (logits equal Hugging
Face's), has no effect there either, or is refused in one line; every Hugging Face weight is read
(docs/guides/families.md; tests/test_converter_options.py).
"""

from __future__ import annotations

import copy

import torch

from interp.convert.common import HFWeights, convert
from interp.convert.families import CONVERTERS, NOT_FROM_SCRATCH
from interp.convert.gguf import GGUFFile, GGUFWeights
from interp.convert.stream import FileWeights
from interp.errors import UserError
from interp.model import GPTModel


def scratch_families() -> tuple[str, ...]:
    """The Hugging Face ``model_type``s our ``GPTModel`` implements."""
    return tuple(CONVERTERS)


def check_scratch_family(family: str) -> None:
    """One line naming ``family`` and the ones the from-scratch model implements."""
    if family not in CONVERTERS:
        reason = f", {NOT_FROM_SCRATCH[family]}" if family in NOT_FROM_SCRATCH else ""
        raise UserError(f"impl='scratch' does not implement the {family!r} family{reason} (it implements: "
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
    model = convert(CONVERTERS[family], hf_model.config, HFWeights(hf_model.state_dict()), tokenizer)
    if not release:
        with torch.no_grad():
            for param in model.parameters():
                param.data = param.data.clone()
    model.hf_config = copy.deepcopy(hf_model.config)
    return model


def from_files(files, hf_cfg, tokenizer, dtype: torch.dtype, source: str) -> GPTModel:
    """A ``GPTModel`` of the Hugging Face config ``hf_cfg`` with the weights of safetensors or
    ``.bin`` ``files`` (``interp.convert.stream.weight_files`` of a directory ``source``), in ``dtype``:
    each tensor is read, cast and placed before the next (peak memory: the model's own size and a
    tensor or two), without building the Hugging Face model; logits equal its eager forward as
    ``from_hf``'s do. Keeps ``hf_cfg`` as ``hf_config``, its ``dtype`` set as ``from_pretrained`` sets it."""
    return _from_weights(hf_cfg, lambda: FileWeights(files, hf_cfg, dtype, source), tokenizer, dtype)


def from_gguf(file: GGUFFile, hf_cfg, tokenizer, dtype: torch.dtype) -> GPTModel:
    """A ``GPTModel`` of the Hugging Face config ``hf_cfg`` (``file.hf_config()``) with the weights
    of a GGUF ``file``, dequantized into ``dtype`` tensor by tensor (``GGUFWeights``), as
    ``from_files`` reads a directory; logits equal transformers' own GGUF load."""
    return _from_weights(hf_cfg, lambda: GGUFWeights(file, hf_cfg, dtype), tokenizer, dtype)


def _from_weights(hf_cfg, weights, tokenizer, dtype: torch.dtype) -> GPTModel:
    """The family's row read over ``weights()`` (made once the family is known to be ours), the
    config kept as ``hf_config`` in ``dtype``."""
    check_scratch_family(hf_cfg.model_type)
    model = convert(CONVERTERS[hf_cfg.model_type], hf_cfg, weights(), tokenizer)
    model.hf_config = copy.deepcopy(hf_cfg)
    model.hf_config.dtype = dtype
    return model
