"""Check what ``interp report --model smollm2`` named against computations that do not use interp.

Reads a report directory's ``head_roles.csv`` and ``meta.json``, draws the report's own probes with
the report's own functions (``drawn_probes`` and ``probe_rows`` of ``analyses.report.split``, from
meta.json's ``probe_split`` and ``seq_len``: the one draw the report made, split into the selection rows
that chose the roles and the measurement rows every effect was measured on), and, on Hugging Face's own
reading of the same GGUF file:

1. scores every head from its eager attention patterns on the selection rows (``role_scores.hand_scores``:
   attention mass on the previous token, the earlier copy of the token, the token after it) and asks
   whether the heads the report names for a role include the strongest heads of that role by these
   patterns, and whether any named head's pattern score is near zero;
2. zeroes the named induction heads with hand-written forward hooks on each layer's ``o_proj``
   input (Hugging Face's modules, not interp's hooks) and compares the loss on the predictable tokens
   of the first 16 measurement rows with zeroing as many random heads (20 draws).

    python examples/smollm2/report_check.py /path/to/report [--top 5] [--near-zero 0.05]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import torch

from analyses.core.probes import RepeatedProbes
from analyses.report.split import drawn_probes, probe_rows
from role_scores import hand_scores
from setup_smollm2 import head_name, hf_eager_model, hf_patterns, load

N_DRAWS = 20


def named(table: pd.DataFrame, role: str) -> list[tuple[int, int]]:
    """The heads whose ``role`` (';'-joined) includes ``role``."""
    has = table["role"].fillna("").str.split(";").map(lambda roles: role in roles)
    return [(int(l), int(h)) for l, h in table.loc[has, ["layer", "head"]].itertuples(index=False)]


def report_probes(model, meta: dict) -> tuple[RepeatedProbes, RepeatedProbes]:
    """The report's (selection rows, measurement rows), drawn as the report drew them from its meta.json."""
    split = meta["probe_split"]
    probes = drawn_probes(model, split, meta["seq_len"])
    return probe_rows(probes, split, "selection"), probe_rows(probes, split, "measurement")


def hf_scores(hf_model, probe, rows: int = 16) -> dict[str, torch.Tensor]:
    """role -> (layer, head) pattern score over every probe: ``hand_scores`` of chunks of ``rows``
    probes, pooled with each chunk weighted by the positions it scored (every position for the
    previous token, the second copy's for the others)."""
    sums: dict[str, torch.Tensor] = {}
    counts = {"previous_token": 0, "duplicate_token": 0, "induction": 0}
    for start in range(0, len(probe.tokens), rows):
        tokens, period = probe.tokens[start:start + rows], probe.period[start:start + rows]
        part = SimpleNamespace(period=period, segment_start=probe.segment_start[start:start + rows])
        weights = {"previous_token": tokens.numel() - len(tokens), "duplicate_token": int(period.sum()),
                   "induction": int(period.sum())}
        for role, score in hand_scores(hf_patterns(hf_model, tokens), part).items():
            sums[role] = sums.get(role, 0) + weights[role] * score
            counts[role] += weights[role]
    return {role: sums[role] / counts[role] for role in sums}


def hf_loss(hf_model, tokens: torch.Tensor, predictable: torch.Tensor, zeroed: list[tuple[int, int]]) -> float:
    """Mean next-token loss on the predictable tokens with the ``zeroed`` heads' outputs set to zero
    by forward pre-hooks on each layer's ``o_proj`` (its input is the heads' outputs side by side)."""
    cfg = hf_model.config
    d_head = cfg.hidden_size // cfg.num_attention_heads
    handles = []
    for layer in {l for l, _ in zeroed}:
        heads = [h for l, h in zeroed if l == layer]

        def zero(module, args, heads=heads):
            x = args[0].clone()
            for h in heads:
                x[..., h * d_head:(h + 1) * d_head] = 0
            return (x,)

        handles.append(hf_model.model.layers[layer].self_attn.o_proj.register_forward_pre_hook(zero))
    try:
        with torch.no_grad():
            logits = hf_model(tokens).logits.float()
    finally:
        for handle in handles:
            handle.remove()
    log_probs = logits[:, :-1].log_softmax(-1).gather(-1, tokens[:, 1:, None])[..., 0]
    return float(-log_probs[predictable[:, 1:]].mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", type=Path)
    parser.add_argument("--top", type=int, default=5, help="the strongest heads by the patterns to look for")
    parser.add_argument("--near-zero", type=float, default=0.05, help="a pattern score at most this is 'near zero'")
    parser.add_argument("--ablation-prompts", type=int, default=16,
                        help="the first this many measurement rows for the ablation")
    args = parser.parse_args()
    torch.set_num_threads(2)
    table = pd.read_csv(args.report / "head_roles.csv", keep_default_na=False)
    meta = json.loads((args.report / "meta.json").read_text())
    model = load()
    selection, measurement = report_probes(model, meta)
    hf_model = hf_eager_model()
    scores = hf_scores(hf_model, selection)
    for role in ("induction", "previous_token", "duplicate_token"):
        heads = named(table, role)
        score = scores[role]
        order = sorted(((float(score[l, h]), (l, h)) for l in range(score.shape[0]) for h in range(score.shape[1])),
                       reverse=True)
        strongest = [head for _, head in order[:args.top]]
        found = [head_name(*h) for h in strongest if h in heads]
        lowest = min((float(score[h]) for h in heads), default=float("nan"))
        print(f"{role}: the report names {len(heads)}; the {args.top} strongest by Hugging Face's patterns on the "
              f"{selection.n_prompts} selection rows "
              f"{', '.join(f'{head_name(*h)} {s:.2f}' for s, h in order[:args.top])}; named among them: "
              f"{len(found)} ({', '.join(found) or 'none'}); the lowest pattern score of a named head {lowest:.3f}; "
              f"named heads at or under {args.near_zero}: {sum(float(score[h]) <= args.near_zero for h in heads)}")
    induction = named(table, "induction")
    n = args.ablation_prompts
    tokens, predictable = measurement.tokens[:n], measurement.predictable[:n]
    clean = hf_loss(hf_model, tokens, predictable, [])
    ablated = hf_loss(hf_model, tokens, predictable, induction)
    generator = torch.Generator().manual_seed(0)
    every = [(l, h) for l in range(model.cfg.n_layers) for h in range(model.cfg.n_heads)]
    others = [h for h in every if h not in induction]
    random = torch.tensor([hf_loss(hf_model, tokens, predictable,
                                   [others[i] for i in torch.randperm(len(others), generator=generator)[:len(induction)]])
                           for _ in range(N_DRAWS)]) - clean
    print(f"zeroing the {len(induction)} named induction heads by hand-written Hugging Face hooks on the first "
          f"{len(tokens)} measurement rows: loss {clean:.3f} -> {ablated:.3f} (+{ablated - clean:.3f} nats); {len(induction)} random other "
          f"heads: +{random.mean():.3f} (sd {random.std():.3f}, max {random.max():.3f}) over {N_DRAWS} draws; "
          f"ratio {(ablated - clean) / random.mean():.1f}x")


if __name__ == "__main__":
    main()
