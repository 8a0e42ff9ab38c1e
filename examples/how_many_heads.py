"""How many heads: the embedded model's recipe trained at several head counts at the same d_model
(so the same parameters in number, split into heads of d_model / H), with the loss and the roles
that form in each (issue 37.5; the figure and table in docs/guides/embedded-model.md).

    nice -n 10 .venv/bin/python examples/how_many_heads.py --out runs/heads [--preset short] [--heads 1 2 4 8]
        [--steps N] [--figure docs/how_many_heads.png]

Each run is ``interp train --preset P --heads H --out OUT/hH`` (skipped where OUT/hH already holds
one); then every trained model's heads are scored on 64 repeated-segment probes and given roles by
the fixed rule (``assign_roles``: score >= 0.4 with a bootstrap interval above chance). Prints a
markdown table; draws the repeat-token loss and best induction score over training, per head count.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pandas as pd

from analyses import assign_roles, classify_heads
from analyses.core.plots import new_figure, png_bytes
from interp import load_model
from interp.train import PRESETS, run

PHASE_CHANGE = 0.5  # the phase change: the first evaluation whose best induction score passes this


def trained(preset: str, n_heads: int, steps: int | None, out: Path) -> dict:
    """The training record of ``preset`` at ``n_heads`` heads, trained into ``out`` unless it is there."""
    if not (out / "training.json").exists():
        recipe = dataclasses.replace(PRESETS[preset], n_heads=n_heads, **({"steps": steps} if steps else {}))
        run(recipe, out, progress=False)
    return json.loads((out / "training.json").read_text())


def roles_of(model) -> dict[str, int]:
    """How many heads hold each role (fixed rule), and the heads with none."""
    roles = assign_roles(classify_heads(model, n_prompts=64, progress=False))["role"]
    counted = {role: int(roles.str.contains(role).sum()) for role in ("previous_token", "induction", "duplicate_token")}
    return counted | {"no role": int((roles == "").sum())}


def summary_row(n_heads: int, record: dict, model) -> dict:
    history = pd.DataFrame(record["history"])
    passed = history[history["induction_score"] > PHASE_CHANGE]["step"]
    final = record["final"]
    return {"heads": n_heads, "d_head": model.cfg.d_head, "parameters": sum(p.numel() for p in model.parameters()),
            "phase change step": int(passed.iloc[0]) if len(passed) else None,
            "repeat loss": round(final["repeat_loss"], 3), "text loss": round(final["text_loss"], 3),
            "best induction": round(final["induction_score"], 2),
            "best previous-token": round(final["previous_token_score"], 2), **roles_of(model),
            "train s": record["environment"]["train_seconds"]}


def figure(histories: dict[int, pd.DataFrame]):
    fig = new_figure(figsize=(10, 3.6))
    loss_ax, induction_ax = fig.subplots(1, 2)
    for n_heads, history in histories.items():
        loss_ax.plot(history["step"], history["repeat_loss"], label=f"{n_heads} head{'s' * (n_heads > 1)}")
        induction_ax.plot(history["step"], history["induction_score"], label=f"{n_heads}")
    loss_ax.set(xlabel="step", ylabel="loss on repeated tokens (nats)", title="repeat-token loss")
    induction_ax.set(xlabel="step", ylabel="best induction score", title="best induction head", ylim=(0, 1))
    loss_ax.legend()
    fig.tight_layout()
    return fig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--preset", default="short", choices=sorted(PRESETS))
    parser.add_argument("--heads", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--steps", type=int, help="override the preset's steps")
    parser.add_argument("--figure", type=Path, help="write the figure here (default OUT/how_many_heads.png)")
    args = parser.parse_args()
    rows, histories = [], {}
    for n_heads in args.heads:
        out = args.out / f"h{n_heads}"
        record = trained(args.preset, n_heads, args.steps, out)
        rows.append(summary_row(n_heads, record, load_model(out)))
        histories[n_heads] = pd.DataFrame(record["history"])
    path = args.figure or args.out / "how_many_heads.png"
    path.write_bytes(png_bytes(figure(histories)))
    print(pd.DataFrame(rows).to_markdown(index=False))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
