"""Wang et al. (2022)'s IOI head classes on SmolLM2, each named only where its measured criteria hold
with their 95% intervals (``analyses.circuits.ioi_classes``), else "unclassified".

48 prompts of ``ioi_task`` (seed 0). The criteria (attention from the end to IO and S, the OV copying
score of the IO name read after block 0, direct logit attribution, S-inhibition measured by path
patching into the name movers' queries, the path from duplicate-token and induction heads into the
S-inhibition heads' values, the rise of other heads' DLA when the name movers are mean-ablated with
the ABC means) are each a mean over prompts with a bootstrap interval. The heads are classified and
measured on the same 48 prompts: in-sample (about 11 minutes on one thread; a held-out pass fixes
``movers=`` and ``s_inhibition=`` from one split and measures on another).

    OMP_NUM_THREADS=1 python examples/smollm2/ioi_classes.py
"""

from __future__ import annotations

import torch

from analyses.circuits.ioi_classes import CLASS_RULES, UNCLASSIFIED, ioi_classes
from analyses.tasks.task import ioi_task
from setup_smollm2 import head_name, load

N_PROMPTS = 48


def main() -> None:
    torch.set_grad_enabled(False)
    model = load()
    task = ioi_task(model, n=N_PROMPTS, seed=0)
    found = ioi_classes(model, task, seed=0)
    print(f"IOI, {len(task)} prompts; left out {found.left_out}; name movers used downstream: "
          f"{', '.join(head_name(*h) for h in found.movers)} ({found.movers_are})")
    criteria = found.criteria.set_index(["layer", "head", "criterion"])
    for name, rule in CLASS_RULES.items():
        heads = found.classes[found.classes["class"] == name]
        print(f"{name}: {', '.join(head_name(l, h) for l, h in zip(heads['layer'], heads['head'])) or 'none formed'}")
        for layer, head in zip(heads["layer"], heads["head"]):
            shown = dict.fromkeys([criterion for criterion, _, _ in rule] + ["attn_end_io", "attn_end_s2", "dla"])
            print(f"  {head_name(layer, head)}: " + "; ".join(
                f"{c} {criteria.loc[(layer, head, c)].value:+.3f} [{criteria.loc[(layer, head, c)].ci_low:+.3f}, "
                f"{criteria.loc[(layer, head, c)].ci_high:+.3f}]" for c in shown))
    print(f"unclassified: {int((found.classes['class'] == UNCLASSIFIED).sum())} heads")
    for layer, head in ((23, 3), (29, 1)):  # the two strongest writers by DLA
        print(f"{head_name(layer, head)}: " + "; ".join(
            f"{c} {criteria.loc[(layer, head, c)].value:+.3f}" for c in ("attn_end_io", "attn_end_s2", "ov_copy", "dla")))


if __name__ == "__main__":
    main()
