"""Role scores of SmolLM2's 270 heads, by interp and by hand from Hugging Face's eager attention.

interp: ``analyses.classify_heads`` on 16 repeated-segment probes of 64 tokens.
Independent: transformers loads the same GGUF file itself; its eager attention patterns
(``output_attentions=True``) on the same tokens give the previous-token, duplicate-token and
induction scores by the definitions written out below (attention mass on the target key, averaged
over the query positions where the role is defined, pooled over prompts).

Prints the agreement and the strongest heads; writes docs/smollm2_roles.png (the role map).

    python examples/smollm2/role_scores.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from analyses import classify_heads
from setup_smollm2 import head_name, hf_eager_model, hf_patterns, load, probes

ROLES = ("previous_token", "duplicate_token", "induction")
FIGURE = Path(__file__).resolve().parents[2] / "docs" / "smollm2_roles.png"


def hand_scores(patterns: torch.Tensor, probe) -> dict[str, torch.Tensor]:
    """patterns (layer, batch, head, q, k) -> role -> (layer, head) score, written with loops over
    the role's definition, not with interp's target tensors."""
    n_layers, batch, n_heads, n_pos, _ = patterns.shape
    totals = {role: torch.zeros(n_layers, n_heads, dtype=torch.float64) for role in ROLES}
    counts = dict.fromkeys(ROLES, 0)
    for b in range(batch):
        period, start = int(probe.period[b]), int(probe.segment_start[b])
        for i in range(1, n_pos):
            totals["previous_token"] += patterns[:, b, :, i, i - 1].double()
            counts["previous_token"] += 1
        for i in range(start + period, start + 2 * period):  # the second copy
            totals["duplicate_token"] += patterns[:, b, :, i, i - period].double()
            totals["induction"] += patterns[:, b, :, i, i - period + 1].double()
            counts["duplicate_token"] += 1
            counts["induction"] += 1
    return {role: totals[role] / counts[role] for role in ROLES}


def interp_scores(frame, role: str, shape) -> torch.Tensor:
    rows = frame[frame.measure == role].sort_values(["layer", "head"])
    return torch.tensor(rows.score.to_numpy()).reshape(shape)


def top(scores: torch.Tensor, k: int) -> list[str]:
    n_heads = scores.shape[1]
    return [head_name(i // n_heads, i % n_heads) for i in scores.flatten().argsort(descending=True)[:k].tolist()]


def role_map(scores: dict[str, torch.Tensor], path: Path,
             title: str = "SmolLM2-135M-Instruct: role scores (16 probes of 64 tokens)",
             label: str = "attention on the role's target") -> None:
    """One (layer, head) heatmap per entry of ``scores``, side by side, written to ``path``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(scores), figsize=(max(10, 2.4 * len(scores)), 6), sharey=True)
    for ax, (role, score) in zip(axes, scores.items()):
        image = ax.imshow(score.numpy(), vmin=0, vmax=1, cmap="viridis", aspect="auto")
        ax.set_title(role.replace("_", "-"))
        ax.set_xlabel("head")
    axes[0].set_ylabel("layer")
    fig.colorbar(image, ax=axes, shrink=0.8, label=label)
    fig.suptitle(title)
    fig.savefig(path, dpi=90, bbox_inches="tight")
    plt.close(fig)


def main() -> None:
    model = load()
    probe = probes(model)
    frame = classify_heads(model, probes=probe, n_boot=200, progress=False)
    shape = (model.cfg.n_layers, model.cfg.n_heads)
    ours = {role: interp_scores(frame, role, shape) for role in ROLES}
    theirs = hand_scores(hf_patterns(hf_eager_model(), probe.tokens), probe)
    print(f"{probe.n_prompts} probes of {probe.seq_len} tokens, {shape[0]} layers x {shape[1]} heads")
    for role in ROLES:
        diff = (ours[role] - theirs[role]).abs().max().item()
        same = top(ours[role], 10) == top(theirs[role], 10)
        print(f"{role:16s} max |interp - HF eager| = {diff:.2e}; top-10 identical: {same}")
        print(f"{'':16s} top heads: " + ", ".join(f"{name} {ours[role].flatten()[i]:.2f}" for name, i in
                                                 zip(top(ours[role], 10), ours[role].flatten().argsort(descending=True)[:10].tolist())))
        print(f"{'':16s} heads above 0.3: {int((ours[role] > 0.3).sum())}; layers "
              f"{sorted({int(l) for l in (ours[role] > 0.3).nonzero()[:, 0]})}")
    if "--no-figure" not in sys.argv:
        role_map(ours, FIGURE)
        print(f"wrote {FIGURE.relative_to(FIGURE.parents[1])}")


if __name__ == "__main__":
    main()
