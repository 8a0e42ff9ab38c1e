"""TransformerLens ``TransformerBridge``s over in-memory Hugging Face models (no network: the
config comes from the model and the tokenizer is passed in).

Booting checks the bridge against the model it wraps: a short probe's logits through the bridge
must equal Hugging Face's eager forward (computed before booting), else the load is refused in one
line. A bridge that reads a config option wrongly (TransformerLens 4.3 ignores GPT-2's
``scale_attn_weights=False``) would otherwise be analysed as if it were the model.
"""

from __future__ import annotations

import copy as _copy

import torch

from interp.errors import UserError
from interp.tokenizer import follow_tokenizer, tokenizer_adds_bos

PROBE_TOKENS = 6  # the probe: the first ids of the vocabulary past the specials, one prompt
# how far the bridge's probe logits may be from Hugging Face's, in units of the dtype's epsilon times
# the logits' scale (both run the same eager operations, so they agree to rounding)
PROBE_TOLERANCE_EPS = 64


def boot_bridge(hf_model, tokenizer, name: str = "model", copy: bool = True):
    """A ``TransformerBridge`` over ``hf_model`` (any family the bridge supports), in the model's
    dtype. Booting rewires the model it is given, so by default it gets a copy and ``hf_model``
    stays usable, e.g. for ``interp.from_hf``; ``copy=False`` boots ``hf_model`` itself (no second
    set of weights in memory, and a model placed over several devices by a ``device_map`` stays
    where it is). Refused when the bridge's logits on a short probe differ from Hugging Face's. Its
    ``cfg.default_prepend_bos`` follows the tokenizer's ``add_bos_token`` where it says, else
    TransformerLens's default for the family."""
    from transformer_lens.model_bridge import TransformerBridge

    if tokenizer is None:
        raise UserError(f"a TransformerBridge of {name!r} needs a tokenizer offline, and none was found or given")
    adds_bos = tokenizer_adds_bos(tokenizer)  # before booting, which gives a tokenizer without a BOS its EOS as one
    model = (_copy.deepcopy(hf_model) if copy else hf_model).eval()
    embedding = model.get_input_embeddings().weight
    probe = torch.arange(PROBE_TOKENS, device=embedding.device)[None] % model.config.vocab_size
    probe = (probe + min(len(tokenizer), model.config.vocab_size) // 2) % model.config.vocab_size
    with torch.no_grad():
        expected = model(probe).logits.float()
    bridge = TransformerBridge.boot_transformers(name, hf_model=model, tokenizer=tokenizer, dtype=embedding.dtype)
    with torch.no_grad():
        found = bridge(probe).float().to(expected.device)
    gap = (found - expected).abs().max().item()
    allowed = PROBE_TOLERANCE_EPS * torch.finfo(embedding.dtype).eps * (1.0 + expected.abs().max().item())
    if not gap <= allowed:
        raise UserError(f"the TransformerLens bridge of {name!r} ({model.config.model_type}) computes other logits "
                        f"than Hugging Face on the same weights (max difference {gap:.3g} > {allowed:.2g} on a "
                        f"{PROBE_TOKENS}-token probe); refusing to analyse it (try impl='scratch')")
    follow_tokenizer(bridge, adds_bos)  # the tokenizer's add_bos_token, else TransformerLens's family default
    return bridge
