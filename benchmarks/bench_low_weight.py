"""What mixed precision's bfloat16 weights cost per call (``interp.precision.Linear``): the best of
``--rounds`` interleaved timings, in milliseconds, of

- ``interp.precision.Linear`` under mixed precision, SmolLM2's shapes: an MLP matrix (576 -> 1536)
  on 1, 64 and 1024 token rows and a vocabulary-sized one (576 -> 49152) on 1 and 64;
- a forward of the embedded toy model (16 x 64 tokens and 1 x 64) in mixed precision and in float32;
- a forward of a random-init SmolLM2-shaped model (30 layers, d_model 576, 9 query heads on 3
  key/value heads, gated MLP 1536, vocabulary 49152) on 1 x 64 tokens and on 1 token, in both precisions.

Run it at two commits to compare the bfloat16 weights' handling (held copy against a cast per call):

    OMP_NUM_THREADS=1 python benchmarks/bench_low_weight.py --rounds 9
"""

from __future__ import annotations

import argparse
import copy
import time
from typing import Callable

import torch

from analyses.core.budget import DEFAULT_MEMORY_MB
from interp import GPTConfig, GPTModel, load_model
from interp.memory import command_limit_mb, retain_freed_memory_once
from interp.precision import Linear

# tuned as the interp commands tune themselves (freed memory kept for reuse), so a product's fresh
# bfloat16 weight costs what it does in a command, not a page fault per page
retain_freed_memory_once(command_limit_mb(DEFAULT_MEMORY_MB))

SMOLLM2_SHAPE = dict(n_layers=30, d_model=576, n_heads=9, n_key_value_heads=3, d_mlp=1536, d_vocab=49152,
                     n_ctx=2048, normalization_type="RMS", act_fn="silu", gated_mlp=True,
                     positional_embedding_type="rotary", qkv_bias=False, attn_out_bias=False, mlp_bias=False)


def best_ms(cases: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Each case's best CPU time of ``rounds`` (this thread's: on a shared machine the wall clock
    counts the other processes' turns), in ms, the cases interleaved within each round."""
    best = dict.fromkeys(cases, float("inf"))
    for _ in range(rounds):
        for name, run in cases.items():
            start = time.thread_time()
            run()
            best[name] = min(best[name], (time.thread_time() - start) * 1e3)
    return best


def linear_cases() -> dict[str, Callable[[], object]]:
    """SmolLM2's MLP-sized (1, 64, 1024 rows) and vocabulary-sized (1, 64 rows) linear maps, mixed."""
    cases = {}
    for d_out, row_counts in ((1536, (1, 64, 1024)), (49152, (1, 64))):
        linear = Linear(576, d_out, bias=False)
        linear.mixed = True
        for rows in row_counts:
            x = torch.randn(rows, 576)
            cases[f"Linear 576->{d_out}, {rows} rows (mixed)"] = lambda linear=linear, x=x: linear(x)
    return cases


def forward_cases(name: str, model: GPTModel, shapes: list[tuple[int, int]]) -> dict[str, Callable[[], object]]:
    """``model``'s forward on random tokens of each (batch, pos) in ``shapes``, in float32 and, on a
    copy set once to mixed precision (switching drops a held copy), in mixed."""
    mixed = copy.deepcopy(model)
    mixed.set_precision("mixed")
    cases = {}
    for batch, pos in shapes:
        tokens = torch.randint(0, model.cfg.d_vocab, (batch, pos), generator=torch.Generator().manual_seed(0))
        for precision, runs in (("float32", model), ("mixed", mixed)):
            cases[f"{name} forward {batch}x{pos} ({precision})"] = lambda runs=runs, tokens=tokens: runs(tokens)
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    torch.manual_seed(0)
    cases = {**linear_cases(), **forward_cases("toy", load_model("toy").eval(), [(16, 64), (1, 64)]),
             **forward_cases("SmolLM2-shaped", GPTModel(GPTConfig(**SMOLLM2_SHAPE)).eval(), [(1, 64), (1, 1)])}
    with torch.inference_mode():
        times = best_ms(cases, args.rounds)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), best CPU time of {args.rounds}")
    for name, ms in times.items():
        print(f"{name:<50} {ms:10.3f} ms")


if __name__ == "__main__":
    main()
