"""Hand-written references the interval tests compare the library with: a hook that zeroes one head,
Efron's percentile bootstrap written out with numpy (no code of analyses.core.stats), and a model
built by hand in which one head backs another up."""

from __future__ import annotations

import numpy as np
import torch

from analyses.core.stats import N_BOOT


def zero_head(layer: int, head: int):
    """A hand-written hook zeroing one head's output at every position -> (hook name, hook)."""
    def hook(z, hook):
        z = z.clone()
        z[:, :, head] = 0.0
        return z
    return f"blocks.{layer}.attn.hook_z", hook


def add_to_embed(draw: torch.Tensor, positions):
    """A hand-written ``hook_embed`` hook adding ``draw`` (len(positions), d_model) to prompt 0's
    embeddings at ``positions`` (a copy: the hook's input is left as it was)."""
    def add_noise(embed, hook):
        embed = embed.clone()
        embed[0, positions] += draw
        return embed
    return add_noise


def bootstrap_by_hand(effects: np.ndarray, counts: np.ndarray, seed: int = 0) -> tuple[float, float]:
    """Efron's percentile interval of sum(effects) / sum(counts) over prompts drawn with replacement
    (the draws of ``analyses.core.stats.resample_weights``: one seeded randint)."""
    draws = torch.randint(len(effects), (N_BOOT, len(effects)), generator=torch.Generator().manual_seed(seed)).numpy()
    ratios = effects[draws].sum(axis=1) / counts[draws].sum(axis=1)
    return float(np.quantile(ratios, 0.025)), float(np.quantile(ratios, 0.975))


def compensating_model(covers: bool = True):
    """A 2-layer attention-only ``GPTModel`` (no norm, no positions, 300 tokens, d_model 4) built so
    that L1H0 covers for L0H0: every head attends uniformly (zero queries and keys); L0H0 writes +1
    along e0 whatever it reads (its value bias); L1H0 writes 1 - (the e0 component of what it reads)
    along e0 (with ``covers``; else a constant 0); the unembedding reads e0 as token 1's logit, every
    other weight is 0. Zeroing L0H0 removes its +1 and raises L1H0's write by exactly 1."""
    from interp import GPTConfig, GPTModel

    cfg = GPTConfig(d_vocab=300, n_ctx=8, d_model=4, n_heads=2, n_layers=2, attn_only=True, normalization_type=None,
                    positional_embedding_type="rotary", tie_word_embeddings=False)
    model = GPTModel(cfg).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.zero_()
        for layer, value_weight, value_bias in ((0, 0.0, 1.0), (1, -1.0 * covers, 1.0 * covers)):
            attn = model.blocks[layer].attn
            attn.W_value.weight[0, 0] = value_weight  # head 0's first value dim reads e0 (d_head 2)
            attn.W_value.bias[0] = value_bias
            attn.out_proj.weight[0, 0] = 1.0  # and writes it to e0
        model.lm_head.weight[1, 0] = 1.0
    return model
