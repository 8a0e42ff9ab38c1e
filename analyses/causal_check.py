"""The causal check behind head roles (DESIGN 4.1): each head's mean-ablation effect on the loss
of the probes' predictable tokens (the second copy of the segment, minus its first token).

Many ablations share one forward: the prompts are repeated once per head of a group of heads
(batch = heads x prompts), and copy c replaces head c's slice of ``hook_z`` with that head's mean
over the prompts (per position). Forwards are sized to a memory budget: groups of heads when the
whole prompt batch fits, else one head at a time over chunks of prompts.
"""

from __future__ import annotations

import pandas as pd
import torch
from tqdm.auto import tqdm

from analyses.probes import RepeatedProbes

DEFAULT_MEMORY_BYTES = 512 * 2**20


def z_names(model) -> list[str]:
    return [f"blocks.{layer}.attn.hook_z" for layer in range(model.cfg.n_layers)]


def masked_loss(logits: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over the target positions in ``mask``.

    logits: (batch, pos, vocab); tokens, mask: (batch, pos), mask[b, i] selects predicting token i.
    Returns (batch,) per-prompt sums of the selected losses (divide by mask.sum() to pool).
    """
    log_probs = logits[:, :-1].float().log_softmax(-1)
    losses = -log_probs.gather(-1, tokens[:, 1:, None])[..., 0]
    return (losses * mask[:, 1:]).sum(-1)


def rows_per_forward(model, n_pos: int, memory_bytes: int) -> int:
    """How many prompt rows (logits and activations) one forward may hold in ``memory_bytes``."""
    cfg = model.cfg
    per_row = 4 * n_pos * (cfg.d_vocab * 2 + cfg.d_model * 8 + cfg.n_heads * n_pos)
    return max(1, memory_bytes // per_row)


def ablation_hook(mean_z: torch.Tensor, ablate: torch.Tensor, n_prompts: int):
    """A ``hook_z`` hook that mean-ablates one head per copy.

    mean_z: (pos, head, d_head) the layer's mean over prompts; ablate: (copies, head) bool, which
    head each copy ablates in this layer (rows of the batch are copy-major: copy * n_prompts + prompt).
    """
    rows = ablate.repeat_interleave(n_prompts, dim=0)[:, None, :, None]  # (batch, 1, head, 1)

    def hook(z, hook):
        return torch.where(rows, mean_z[None].to(z.dtype), z)

    return hook


@torch.no_grad()
def ablation_effects(model, probes: RepeatedProbes, memory_bytes: int = DEFAULT_MEMORY_BYTES,
                     progress: bool | None = None) -> pd.DataFrame:
    """Mean-ablate each head in turn; return one row per head with ``layer, head,
    ablation_effect`` (ablated minus clean mean loss on the predictable tokens, in nats) and
    ``clean_loss``."""
    cfg = model.cfg
    tokens, mask = probes.tokens, probes.predictable.float()
    n_prompts, n_pos = tokens.shape
    n_targets = mask[:, 1:].sum()
    if n_targets == 0:
        raise ValueError("the probes have no predictable tokens to measure the loss on")
    rows = rows_per_forward(model, n_pos, memory_bytes)
    prompt_chunks = [slice(start, start + rows) for start in range(0, n_prompts, rows)]
    clean_sum, z_sums = 0.0, [0.0] * cfg.n_layers
    for chunk in prompt_chunks:
        logits, cache = model.run_with_cache(tokens[chunk], names_filter=z_names(model))
        clean_sum = clean_sum + masked_loss(logits, tokens[chunk], mask[chunk]).sum()
        z_sums = [total + cache[name].sum(0) for total, name in zip(z_sums, z_names(model))]
    clean = clean_sum / n_targets
    means = [total / n_prompts for total in z_sums]  # each (pos, head, d_head)
    heads = torch.arange(cfg.n_layers * cfg.n_heads, device=tokens.device)
    losses = []
    disable = None if progress is None else not progress
    for group in tqdm(heads.split(max(1, rows // n_prompts)), desc="ablate heads", unit="chunk", disable=disable):
        layer_of, head_of = group // cfg.n_heads, group % cfg.n_heads
        one_hot = torch.nn.functional.one_hot(head_of, cfg.n_heads).bool()  # (copies, head)
        total = torch.zeros(len(group), device=tokens.device)
        for chunk in prompt_chunks:
            n_rows = len(tokens[chunk])
            hooks = [(name, ablation_hook(means[layer], one_hot & (layer_of == layer)[:, None], n_rows))
                     for layer, name in enumerate(z_names(model)) if (layer_of == layer).any()]
            copies = tokens[chunk].repeat(len(group), 1)
            ablated = model.run_with_hooks(copies, fwd_hooks=hooks)
            per_row = masked_loss(ablated, copies, mask[chunk].repeat(len(group), 1))
            total += per_row.view(len(group), n_rows).sum(-1)
        losses.append(total / n_targets)
    ablated_loss = torch.cat(losses).cpu()
    return pd.DataFrame({
        "layer": (heads // cfg.n_heads).cpu().numpy(),
        "head": (heads % cfg.n_heads).cpu().numpy(),
        "ablation_effect": (ablated_loss - clean.cpu()).numpy(),
        "clean_loss": float(clean),
    })
