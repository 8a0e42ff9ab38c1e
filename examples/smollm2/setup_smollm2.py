"""Shared by the SmolLM2 example scripts: the model, the probes, and Hugging Face's own forward.

Every script loads SmolLM2-135M-Instruct once (``interp.load_model("smollm2")``, float32, the
from-scratch ``GPTModel``) and draws the same repeated-segment probes (seed 0), so the numbers the
scripts print refer to the same prompts.
"""

from __future__ import annotations

import torch

import interp
from analyses.core.probes import RepeatedProbes, probes_for

N_PROMPTS = 16
SEQ_LEN = 64


def load():
    """SmolLM2-135M-Instruct as interp's from-scratch hooked ``GPTModel`` (float32, CPU)."""
    torch.manual_seed(0)
    return interp.load_model("smollm2")


def probes(model, n_prompts: int = N_PROMPTS, seq_len: int = SEQ_LEN, seed: int = 0) -> RepeatedProbes:
    """BOS, a random prefix, a random segment, the same segment again, random filler."""
    return probes_for(model, n_prompts, seq_len, seed=seed)


def hf_eager_model():
    """Hugging Face's own reading of the same GGUF file, with the eager attention whose patterns
    ``output_attentions`` returns: an implementation independent of interp's."""
    from transformers import AutoModelForCausalLM

    from interp.loading import shipped_file

    path = shipped_file("smollm2")
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, attn_implementation="eager",
                                                 dtype=torch.float32)
    return model.eval()


def hf_patterns(hf_model, tokens: torch.Tensor) -> torch.Tensor:
    """tokens (batch, pos) -> (layer, batch, head, q, k) attention patterns of Hugging Face's forward."""
    with torch.no_grad():
        out = hf_model(tokens, output_attentions=True)
    return torch.stack(out.attentions)


def head_name(layer: int, head: int) -> str:
    return f"L{layer}H{head}"
