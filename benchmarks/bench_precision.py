"""Mixed precision against float32 on one model, in one run (issue 45.1): ``GPTModel.set_precision("mixed")``
(the linear maps' products in bfloat16, float32 accumulation, the rest float32; ``interp.precision``).

On ``--prompts`` repeated-segment probes (``probes_for``) it prints, float32 then mixed:
- the forward's time (the best of ``--rounds`` interleaved rounds each) and their ratio;
- the logits' max and mean absolute error, the per-token loss's absolute error (mean, max; over
  every predicted token and over the predictable ones), the predictable tokens' mean loss in each,
  and how often the argmax prediction agrees;
- the role table: ``classify_heads`` + ``assign_roles`` (the fixed threshold) in each precision,
  and the heads whose roles differ;
- every head's single-head ablation effect (``ablation_sweep``, ``method="mean_aligned"``, loss on
  the predictable tokens; ``--layer-step n``: the heads of every n-th layer) in each, a layer at a
  time: how many mixed effects fall outside float32's 95% interval, the largest difference, the
  heads whose effect crosses 0.01 nats in one and not the other; and the sweeps' times.

    OMP_NUM_THREADS=1 nice python benchmarks/bench_precision.py --model smollm2 --prompts 16 --threads 1 --layer-step 3
    python benchmarks/bench_precision.py --model toy
"""

from __future__ import annotations

import argparse
import time

import pandas as pd
import torch

from analyses.core.metrics import loss_metric
from analyses.core.probes import probes_for
from analyses.interventions.ablation import ablation_sweep
from analyses.roles.classify import assign_roles, classify_heads
from interp.loading import load_model

LINE = 0.01  # nats: the smallest effect the report reads


def forward_times(model, tokens: torch.Tensor, rounds: int) -> dict[str, float]:
    """The best of ``rounds`` interleaved forwards in each precision, in seconds."""
    best = {"float32": float("inf"), "mixed": float("inf")}
    for _ in range(rounds):
        for precision in best:
            model.set_precision(precision)
            with torch.inference_mode():
                start = time.perf_counter()
                model(tokens)
                best[precision] = min(best[precision], time.perf_counter() - start)
    return best


def token_losses(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """(batch, pos - 1): each predicted token's cross-entropy, in float64."""
    log_probs = logits[:, :-1].double().log_softmax(-1)
    return -log_probs.gather(-1, tokens[:, 1:, None])[..., 0]


def per_precision(model, probes, precision: str, progress: bool) -> dict:
    """Logits and the role table in one precision."""
    model.set_precision(precision)
    with torch.inference_mode():
        logits = model(probes.tokens).float()
    roles = assign_roles(classify_heads(model, probes=probes, progress=progress))
    return {"logits": logits, "roles": roles.set_index(["layer", "head"])["role"]}


def sweeps(model, probes, layers: list[int], progress: bool) -> tuple[pd.DataFrame, pd.DataFrame, dict]:
    """Every head of ``layers`` ablated alone (``ablation_sweep``, mean_aligned, loss on the
    predictable tokens) in float32 then mixed, a layer at a time, each layer's comparison printed as
    it ends -> (float32 frame, mixed frame, seconds per precision)."""
    metric = loss_metric(probes.tokens, probes.predictable)
    frames, seconds = {"float32": [], "mixed": []}, {"float32": 0.0, "mixed": 0.0}
    for layer in layers:
        for precision in frames:
            model.set_precision(precision)
            start = time.perf_counter()
            frames[precision].append(ablation_sweep(model, probes, [[(layer, h)] for h in range(model.cfg.n_heads)],
                                                    method="mean_aligned", metric=metric, progress=progress))
            seconds[precision] += time.perf_counter() - start
        a, b = frames["float32"][-1], frames["mixed"][-1]
        print(f"  layer {layer}: largest effect difference {(b['effect'] - a['effect']).abs().max():.5f} nats, "
              f"{int(outside(a, b).sum())} outside float32's interval ({seconds['float32']:.0f} s float32, "
              f"{seconds['mixed']:.0f} s mixed so far)", flush=True)
    return pd.concat(frames["float32"], ignore_index=True), pd.concat(frames["mixed"], ignore_index=True), seconds


def outside(a: pd.DataFrame, b: pd.DataFrame) -> pd.Series:
    """Whether each of ``b``'s effects lies outside ``a``'s 95% interval."""
    return (b["effect"] < a["ci_low"]) | (b["effect"] > a["ci_high"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="toy")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=None, help="probe length (default min(n_ctx, 128))")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layer-step", type=int, default=1,
                        help="ablate the heads of every n-th layer from layer 0 (default 1: every head)")
    parser.add_argument("--progress", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(args.model).eval()
    probes = probes_for(model, args.prompts, args.seq_len)
    tokens = probes.tokens
    print(f"{args.model}: {args.prompts} probes x {tokens.shape[1]} tokens, {args.threads} thread(s), "
          f"torch {torch.__version__}")

    times = forward_times(model, tokens, args.rounds)
    print(f"forward: float32 {times['float32']:.3f} s, mixed {times['mixed']:.3f} s, "
          f"ratio {times['float32'] / times['mixed']:.2f}x (best of {args.rounds})")

    f32, mixed = (per_precision(model, probes, p, args.progress) for p in ("float32", "mixed"))
    error = (mixed["logits"] - f32["logits"]).abs()
    loss32, loss_mixed = token_losses(f32["logits"], tokens), token_losses(mixed["logits"], tokens)
    loss_error = (loss_mixed - loss32).abs()
    predictable = probes.predictable[:, 1:]
    agree = (mixed["logits"].argmax(-1) == f32["logits"].argmax(-1)).float().mean().item()
    print(f"logits: max abs error {error.max():.4f}, mean {error.mean():.5f}; argmax agreement {agree:.4f}")
    print(f"per-token loss abs error: all predicted tokens mean {loss_error.mean():.5f} max {loss_error.max():.4f}; "
          f"predictable tokens mean {loss_error[predictable].mean():.5f} max {loss_error[predictable].max():.4f}")
    print(f"predictable tokens' mean loss: float32 {loss32[predictable].mean():.5f}, "
          f"mixed {loss_mixed[predictable].mean():.5f}")

    changed = f32["roles"][f32["roles"] != mixed["roles"]]
    print(f"roles (fixed threshold): {int((f32['roles'] != '').sum())} heads with a role in float32, "
          f"{int((mixed['roles'] != '').sum())} in mixed; {len(changed)} of {len(f32['roles'])} heads differ"
          + "".join(f"\n  L{l}H{h}: float32 {f32['roles'][(l, h)]!r}, mixed {mixed['roles'][(l, h)]!r}"
                    for l, h in changed.index))

    layers = list(range(model.cfg.n_layers))[::args.layer_step]
    print(f"single-head ablation (mean_aligned, loss on the predictable tokens), every head of layers {layers}:")
    a, b, seconds = sweeps(model, probes, layers, args.progress)
    away = outside(a, b)
    crossed = (a["effect"].abs() >= LINE) != (b["effect"].abs() >= LINE)
    difference = (b["effect"] - a["effect"]).abs()
    print(f"  {len(a)} heads: float32 sweeps {seconds['float32']:.1f} s, mixed {seconds['mixed']:.1f} s "
          f"({seconds['float32'] / seconds['mixed']:.2f}x)")
    print(f"  effect difference: max {difference.max():.5f}, mean {difference.mean():.5f} nats; "
          f"float32's interval half-width: median {((a['ci_high'] - a['ci_low']) / 2).median():.5f}; "
          f"{int((a['effect'].abs() >= LINE).sum())} float32 effects of at least {LINE} nats")
    print(f"  {int(away.sum())} of {len(a)} mixed effects outside float32's 95% interval; "
          f"{int(crossed.sum())} cross {LINE} nats in one precision and not the other"
          + "".join(f"\n  {a['target'][i]}: float32 {a['effect'][i]:+.5f} [{a['ci_low'][i]:+.5f}, "
                    f"{a['ci_high'][i]:+.5f}], mixed {b['effect'][i]:+.5f}" for i in a.index[away | crossed]))


if __name__ == "__main__":
    main()
