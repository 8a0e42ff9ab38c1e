"""Is a superadditive pair of SmolLM2 heads a backup pair? Wang et al.'s (2022) test on the pair the
guide's review named, L17H3 and L18H6 (docs/guides/smollm2.md, "backup").

On the first ``--probes`` repeated-segment probes of 64 tokens (seed 0, as the other SmolLM2 scripts),
the copy loss, position-aligned mean ablation (``mean_aligned``): the pair's single and joint effects
and the excess (``pairwise_ablation``), then each head's direct logit attribution and its rise when the
other is ablated (``direct_effect_rises``: the write beyond the ablated value, read through the
unablated run's readout), each with its 95% interval over the probes.

    OMP_NUM_THREADS=1 python examples/smollm2/backup_rise.py            # 8 probes, about 2.5 minutes
"""

from __future__ import annotations

import argparse

import torch

from analyses.core.metrics import loss_metric
from analyses.interventions.ablation import prepare_ablation
from analyses.roles.backup import direct_effect_rises, pairwise_ablation
from setup_smollm2 import load, probes

PAIR = ((17, 3), (18, 6))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--probes", type=int, default=8)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    model = load()
    test = probes(model, n_prompts=args.probes)
    metric = loss_metric(test.tokens, test.predictable)
    pair = pairwise_ablation(model, test, list(PAIR), "mean_aligned", metric, progress=False).iloc[0]
    print(f"{pair.a} + {pair.b} (mean_aligned, copy loss, {args.probes} probes): alone {pair.effect_a:+.3f} and "
          f"{pair.effect_b:+.3f}, together {pair.joint:+.3f}; excess {pair.excess:+.3f} "
          f"[{pair.excess_ci_low:+.3f}, {pair.excess_ci_high:+.3f}] nats")
    rises = direct_effect_rises(prepare_ablation(model, test, "mean_aligned", metric), [PAIR, PAIR[::-1]])
    for row in rises.itertuples():
        print(f"  {row.head} ablated: {row.partner}'s attribution {row.partner_dla:+.4f} -> "
              f"{row.partner_dla_ablated:+.4f}, rise {row.rise:+.4f} [{row.rise_ci_low:+.4f}, {row.rise_ci_high:+.4f}]"
              f" ({row.head}'s own {row.head_dla:+.4f} [{row.head_dla_ci_low:+.4f}, {row.head_dla_ci_high:+.4f}]); "
              f"compensates: {'yes' if row.compensates else 'no'}")


if __name__ == "__main__":
    main()
