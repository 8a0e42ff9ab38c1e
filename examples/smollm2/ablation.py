"""Ablation confirms the roles: SmolLM2's induction and previous-token heads, against layer-matched
random heads, each number with its 95% interval, measured on probes that did not choose the heads.

Choosing: the report's own rule (``interp report``'s defaults) on 64 repeated-segment probes
(seed 0): a head has a role when its score beats the role's calibrated nulls at a 5% false
discovery rate (``calibrate_roles`` with the copying roles' nulls, ``joint_fdr``) and reaches the
threshold 0.4 (``assign_roles``). Measuring: 64 other probes (seed 1, a separate draw). The metric
is the next-token loss on the predictable tokens of the second copy, in nats.

Each ablation runs beside 50 random head sets matched to the tested set by layer and by key/value
group (``control_effects``: no tested head is drawn), all as variants of one sweep. Printed: the
tested set's effect, the random sets' mean effect and the ratio, each with its 95% interval
(bootstrap over prompts; the ratio's over prompts and draws together), and the permutation p.
Two ablations: zero, and ``mean_aligned`` (each head's output replaced by its mean over the other
probes at the same place of the probe: same offset in the same segment), the reference the report
uses; plain ``mean`` by absolute position mixes positions of different roles on these probes.

    python examples/smollm2/ablation.py
"""

from __future__ import annotations

import torch

from analyses import loss_metric
from analyses.roles.copying import meaning_nulls
from analyses.interventions.controls import control_effects
from analyses.roles.classify import DEFAULT_THRESHOLD, assign_roles, classify_heads
from analyses.roles.nulls import calibrate_roles, joint_fdr
from setup_smollm2 import head_name, load, probes

N_PROMPTS = 64
N_DRAWS = 50


def report_roles(model, choose) -> dict[str, list[tuple[int, int]]]:
    """role -> the heads the report's rule gives it on the probes ``choose``, strongest first."""
    scores = classify_heads(model, probes=choose, progress=False)
    calibration = joint_fdr(calibrate_roles(model, choose, progress=False), meaning_nulls(model, progress=False))
    roles = assign_roles(scores, DEFAULT_THRESHOLD, calibration=calibration)
    named = {}
    for role in ("induction", "previous_token"):
        holders = roles[roles["role"].str.split(";").apply(lambda held: role in held)][["layer", "head"]]
        rows = scores[scores["measure"] == role].merge(holders).sort_values("score", ascending=False)
        named[role] = [(int(l), int(h)) for l, h in zip(rows["layer"], rows["head"])]
    return named


def zeroed_by_hand(model, tokens: torch.Tensor, heads, metric) -> float:
    """The zero ablation with hand-written hooks on hook_z (batch, pos, head, d_head)."""
    def hook_for(layer):
        def zero(z, hook):
            z = z.clone()
            z[:, :, [h for l, h in heads if l == layer]] = 0
            return z
        return zero
    hooks = [(f"blocks.{l}.attn.hook_z", hook_for(l)) for l in sorted({l for l, _ in heads})]
    with torch.no_grad():
        return metric(model.run_with_hooks(tokens, fwd_hooks=hooks)).item()


def main() -> None:
    torch.set_grad_enabled(False)
    model = load()
    named = report_roles(model, probes(model, N_PROMPTS, seed=0))
    test = probes(model, N_PROMPTS, seed=1)
    metric = loss_metric(test.tokens, positions=test.predictable)
    induction, previous = named["induction"], named["previous_token"]
    before = [h for h in previous if h[0] < min(l for l, _ in induction)]
    print("induction heads (chosen on seed-0 probes):", ", ".join(head_name(*h) for h in induction))
    print("previous-token heads below the first induction layer:", ", ".join(head_name(*h) for h in before))
    cases = [(induction, "induction", "zero"), (induction, "induction", "mean_aligned"),
             (before, "previous-token", "mean_aligned")]
    for heads, role, method in cases:
        control = control_effects(model, test, heads, method, metric, n_draws=N_DRAWS, progress=False)
        print(f"{role}: {control.describe()}")
        if method == "zero":
            by_hand = zeroed_by_hand(model, test.tokens, heads, metric) - control.frame.baseline.iloc[0]
            print(f"  check: the same zero ablation by hand-written hook_z hooks: effect {by_hand:+.4f} nats")


if __name__ == "__main__":
    main()
