"""The time floor of a report's exact effects on this machine: the rate it multiplies at, and what that
rate says a report at equal findings needs at least.

Measures two rates with ``--threads`` torch threads: float32 matrix products of the shapes a
``GPTModel``'s blocks use (the machine's best case), and one plain forward of ``--prompts`` probes
of ``--seq-len`` tokens through the model with its unembedding (what a suffix run can hope for).
Then prints, at both rates, how long the report's per-component work takes at least: the exact total
effect of every head and MLP is one suffix run from its layer on over the intervention probes plus
the unembedding of the positions the loss counts (``floor_fe``), and a screen that knew in advance
which components matter could skip the rest (``--matter``: the share of components whose effect
reaches the threshold; 201 of 300 on SmolLM2 at 0.01 nats, benchmarks/README.md).

    python benchmarks/bench_floor.py --model smollm2 --threads 2
"""

from __future__ import annotations

import argparse
import time

import torch

from interp.loading import load_model


def gemm_rate(m: int, k: int, n: int, repeats: int = 10) -> float:
    """GFLOP/s of a float32 (m, k) @ (k, n) product, after three warm-up products."""
    a, b = torch.randn(m, k), torch.randn(k, n)
    for _ in range(3):
        a @ b
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * m * k * n * repeats / (time.perf_counter() - start) / 1e9


def forward_flops(cfg, tokens: int) -> float:
    """Multiply-adds x 2 of one forward over ``tokens`` tokens: the blocks' projections and MLP and the
    unembedding, not attention's own (position x position) products (a few % at 128 positions)."""
    d, heads, kv, d_head = cfg.d_model, cfg.n_heads, cfg.n_key_value_heads or cfg.n_heads, cfg.d_head
    mlp = (3 if cfg.gated_mlp else 2) * d * cfg.d_mlp
    block = d * heads * d_head * 2 + d * kv * d_head * 2 + mlp
    return 2 * tokens * (cfg.n_layers * block + d * cfg.d_vocab)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=16, help="the report's intervention probes")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--floor-fe", type=float, default=43.5,
                        help="forward-equivalents of the 64-probe batch the exact total effects need at least "
                             "(SmolLM2 at the defaults: 38.6 of blocks + 4.9 of unembedding)")
    parser.add_argument("--other-fe", type=float, default=14.5,
                        help="forward-equivalents the report's other steps need at least (probe run 1, "
                             "control probes and three null models 4, direct effects 1.5, pairwise ablation 8)")
    parser.add_argument("--matter", type=float, default=201 / 300)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(args.model)
    cfg = model.cfg
    rows = args.prompts * args.seq_len
    shapes = [(rows, cfg.d_model, cfg.d_mlp), (rows, cfg.d_mlp, cfg.d_model), (rows, cfg.d_model, cfg.d_model)]
    best = max(gemm_rate(*shape) for shape in shapes)
    tokens = torch.randint(0, cfg.d_vocab, (args.prompts, args.seq_len))
    with torch.no_grad():
        model(tokens)
        start = time.perf_counter()
        model(tokens)
        seconds = time.perf_counter() - start
    forward = forward_flops(cfg, rows) / seconds / 1e9
    fe_seconds = seconds * 64 / args.prompts  # one forward of the report's 64-probe batch
    print(f"{args.model}: {args.threads} threads; best float32 product {best:.0f} GFLOP/s; a forward of "
          f"{args.prompts} x {args.seq_len} tokens {seconds:.2f} s ({forward:.0f} GFLOP/s), so one FE "
          f"(64 x {args.seq_len}) {fe_seconds:.1f} s")
    for label, fe in (("at the forward's rate", fe_seconds), ("at the best product's rate", fe_seconds * forward / best)):
        every = args.floor_fe * fe
        oracle = (args.floor_fe * args.matter + args.other_fe) * fe
        print(f"  {label}: every total effect exact {every / 60:.1f} min; a perfect screen (only the "
              f"{args.matter:.0%} that matter) plus the other steps {oracle / 60:.1f} min")

if __name__ == "__main__":
    main()
