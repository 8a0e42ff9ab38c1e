"""Why SmolLM2's role heads attend: each head's pre-softmax contrast (its score at the role's target
minus the mean score of the other keys the query sees) split exactly over the components of its
input residual (``qk_attribution``, baseline ``mean_other_keys``), and the key side checked by
removal of each component from the head's key input alone (``qk_intervention_check``).

Choosing: the heads are the strongest of each role on ``probes_for(model, 16, 64, seed=0)``
(``role_scores.py``'s draw; the report names them too). Measuring: 8 probes of 64 tokens with seed 1,
a separate draw (checked: no measuring probe is a choosing one), up to 8 pairs per probe. The numbers
are those of ``interp qk --model smollm2 --head L.H --role ROLE --prompts 8 --seq-len 64 --seed 1
--max-pairs 8 [--check]`` (the same functions, probes and bootstrap seed), in one process.

    OMP_NUM_THREADS=1 python examples/smollm2/qk_heads.py [--check L.H ...]
"""

from __future__ import annotations

import argparse
import sys

import torch

from analyses.circuits.qk_check import qk_intervention_check, role_pairs
from analyses.roles.classify import classify_heads
from analyses.cli.qk import attribution_by_chunks, parse_head
from analyses.core.budget import DEFAULT_MEMORY_MB
from setup_smollm2 import head_name, load, probes

ROLES = ("induction", "previous_token", "duplicate_token")
PROMPTS, SEQ_LEN, SEED, PAIRS, TOP = 8, 64, 1, 8, 5


def say(*parts) -> None:
    print(*parts, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--check", type=parse_head, nargs="*", default=[], help="heads whose key side to check")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    model = load()
    choose = probes(model, 16, 64, seed=0)
    scores = classify_heads(model, probes=choose, progress=False)
    measure = probes(model, PROMPTS, SEQ_LEN, seed=SEED)
    assert not (measure.tokens[:, None, :SEQ_LEN] == choose.tokens[None, :, :SEQ_LEN]).all(-1).any()
    heads = {}
    for role in ROLES:
        top = scores[scores["measure"] == role].sort_values("score", ascending=False).iloc[0]
        heads[role] = (int(top["layer"]), int(top["head"]))
        say(f"{role}: chosen {head_name(*heads[role])} (score {top['score']:.2f} on the seed-0 probes)")
    for role, (layer, head) in heads.items():
        query, key = role_pairs(measure, role, PAIRS)
        result = attribution_by_chunks(model, measure.tokens, layer, head, query, key, "mean_other_keys",
                                       DEFAULT_MEMORY_MB)
        contrast = float(result.score.mean())
        say(f"\n{head_name(layer, head)} ({role}): contrast {contrast:.3f} over {len(measure.tokens)} prompts x "
            f"{query.shape[1]} pairs")
        for side, frame in (("key", result.key_side(seed=SEED)), ("query", result.query_side(seed=SEED))):
            say(f"  {side} side (attribution [95%], share of the contrast):")
            for row in frame.head(TOP).itertuples():
                say(f"    {row.component:>16} {row.attribution:+8.3f} [{row.ci_low:+.3f}, {row.ci_high:+.3f}]  "
                    f"{row.attribution / contrast:+.2f}")
    for layer, head in args.check:
        role = next(r for r, h in heads.items() if h == (layer, head))
        query, key = role_pairs(measure, role, PAIRS)
        for side in ("key", "query"):
            check = qk_intervention_check(model, measure.tokens, layer, head, query, key, side=side, k=3, seed=SEED)
            frame = check.frame.sort_values("drop", ascending=False)
            say(f"\n{head_name(layer, head)} {side} side against removal: Spearman {check.spearman:.2f} "
                f"[{check.spearman_ci[0]:.2f}, {check.spearman_ci[1]:.2f}], top-{check.k} overlap {check.overlap:.2f} "
                f"[{check.overlap_ci[0]:.2f}, {check.overlap_ci[1]:.2f}]")
            for row in frame.head(TOP).itertuples():
                say(f"    {row.component:>16} drop {row.drop:+.3f} [{row.drop_ci_low:+.3f}, {row.drop_ci_high:+.3f}]"
                    f"  attribution {row.attribution:+.3f}")


if __name__ == "__main__":
    sys.exit(main())
