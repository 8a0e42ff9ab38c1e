"""Hand-written references the interval tests compare the library with: a hook that zeroes one head
and Efron's percentile bootstrap written out with numpy (no code of analyses.core.stats)."""

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
