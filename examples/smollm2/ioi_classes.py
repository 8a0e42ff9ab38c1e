"""Wang et al. (2022)'s IOI head classes on SmolLM2, chosen on some prompts and confirmed on others,
each named only where its measured criteria hold with their 95% intervals
(``analyses.circuits.ioi_classes``), else "unclassified"; ABBA and BABA prompts reported apart.

150 prompts of ``ioi_task`` (seed 0: ten per template, half ABBA, half BABA), split by template and
name order (``split_prompts``, seed 0): 45 choose, 105 measure. On the 45 every head's criteria are
measured and classified (attention from the end to IO and S, the OV copying score of the IO name
read after block 0, direct logit attribution, S-inhibition by path patching into the name movers'
queries, the path from duplicate-token and induction heads into the S-inhibition heads' values, the
rise of other heads' DLA when the name movers are mean-ablated with the ABC means); that fixes the
name movers and the S-inhibition heads. On the 105 every criterion is measured again against those
heads, each a mean over the held-out prompts with its bootstrap interval, on all of them and on the
ABBA and BABA prompts apart (``IOIClasses.on``). The model: the Q4_1 GGUF weights dequantised to
float32, prompts without a start token (the model's own format).

    OMP_NUM_THREADS=1 python examples/smollm2/ioi_classes.py   # 13 CPU minutes (42 of wall clock, shared)

Writes docs/smollm2_ioi_classes.png (the classes on the held-out prompts).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from analyses.circuits.ioi_classes import (CLASS_RULES, UNCLASSIFIED, holds, ioi_classes, ioi_classes_figure,
                                           ioi_positions)
from analyses.core.splits import split_prompts
from analyses.tasks.task import ioi_task, task_batch
from setup_smollm2 import head_name, load

N_PROMPTS = 150  # ten per template: one pass ABBA, the next BABA
SELECTION_SHARE = 0.3
FIGURE = Path(__file__).resolve().parents[2] / "docs" / "smollm2_ioi_classes.png"


def criterion_text(criteria, head, name: str) -> str:
    row = criteria.loc[(*head, name)]
    return f"{name} {row.value:+.3f} [{row.ci_low:+.3f}, {row.ci_high:+.3f}]"


def confirmed(criteria, head, name: str) -> bool:
    """Whether every criterion of class ``name`` holds for ``head`` with its interval in ``criteria``."""
    return all((*head, c) in criteria.index and holds(criteria.loc[(*head, c)], side, bound)
               for c, side, bound in CLASS_RULES[name])


def listing(classes) -> str:
    return "; ".join(f"{name}: {', '.join(head_name(l, h) for l, h in zip(rows['layer'], rows['head']))}"
                     for name, rows in classes.groupby("class", sort=False) if name != UNCLASSIFIED) or "none"


def main() -> None:
    torch.set_grad_enabled(False)
    model = load()
    task = ioi_task(model, n=N_PROMPTS, seed=0)
    order = ioi_positions(task, task_batch(model, task)).order()
    split = split_prompts(len(task), SELECTION_SHARE, seed=0,
                          strata=[f"{t}-{o}" for t, o in zip(task.templates, order)])
    held = order[split.measurement.numpy()]
    print(f"IOI, {len(task)} prompts ({(order == 'ABBA').sum()} ABBA, {(order == 'BABA').sum()} BABA); "
          f"{len(split.selection)} choose, {len(split.measurement)} measure ({(held == 'ABBA').sum()} ABBA, "
          f"{(held == 'BABA').sum()} BABA)")
    began = time.monotonic()
    chosen = ioi_classes(model, task.subset(split.selection.tolist()), seed=0)
    print(f"\n== chosen on the selection split ({time.monotonic() - began:.0f} s; left out {chosen.left_out})")
    print(listing(chosen.classes))
    print(f"name movers used downstream: {', '.join(head_name(*h) for h in chosen.movers)} ({chosen.movers_are}); "
          f"S-inhibition receivers: {', '.join(head_name(*h) for h in chosen.s_inhibition) or 'none'}")
    began = time.monotonic()
    measured = ioi_classes(model, task.subset(split.measurement.tolist()), movers=chosen.movers,
                           s_inhibition=chosen.s_inhibition, seed=0)
    parts = {"all": measured, "ABBA": measured.on(measured.order == "ABBA"),
             "BABA": measured.on(measured.order == "BABA")}
    frames = {part: found.criteria.set_index(["layer", "head", "criterion"]) for part, found in parts.items()}
    print(f"\n== measured on the held-out split ({time.monotonic() - began:.0f} s; left out {measured.left_out}; "
          f"{', '.join(f'{p} {len(f.order)}' for p, f in parts.items())} prompts)")
    for name, rule in CLASS_RULES.items():
        heads = [(int(l), int(h)) for l, h, c in chosen.classes[["layer", "head", "class"]].itertuples(index=False)
                 if c == name]
        print(f"{name}: {', '.join(head_name(*h) for h in heads) or 'none formed on the selection split'}")
        for head in heads:
            held_in = [part for part in parts if confirmed(frames[part], head, name)]
            print(f"  {head_name(*head)} confirmed held out on: {', '.join(held_in) or 'none'}")
            for part, criteria in frames.items():
                shown = dict.fromkeys([c for c, _, _ in rule] + ["attn_end_io", "attn_end_s2", "dla"])
                print(f"    {part}: " + "; ".join(criterion_text(criteria, head, c) for c in shown))
    for part, found in parts.items():
        print(f"held-out classes, {part}: {listing(found.classes)}")
    for head in ((23, 3), (29, 1)):  # the two strongest writers by DLA
        print(f"{head_name(*head)} held out: " + "; ".join(
            criterion_text(frames["all"], head, c) for c in ("attn_end_io", "attn_end_s2", "ov_copy", "dla")))
    ioi_classes_figure(measured.classes).savefig(FIGURE, dpi=90, bbox_inches="tight")
    print(f"wrote {FIGURE.relative_to(FIGURE.parents[1])}")


if __name__ == "__main__":
    main()
