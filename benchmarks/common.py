"""Shared benchmark helpers: interleaved timing and the GPT-2-small-shaped peers."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

from interp import GPTModel, from_hf
from interp.bridge import boot_bridge
from interp.random_models import make_random_gpt2

GPT2_SMALL = dict(n_layers=12, d_model=768, n_heads=12, n_ctx=256, d_vocab=2048)


def gpt2_small_peers(seed: int = 0):
    """(HF GPT2LMHeadModel, our GPTModel, TransformerBridge) over the same random weights."""
    hf, tokenizer = make_random_gpt2(**GPT2_SMALL, seed=seed)
    return hf, from_hf(hf, tokenizer), boot_bridge(hf, tokenizer)


def time_interleaved(candidates: dict[str, Callable[[], object]], repeats: int = 7, warmup: int = 1) -> dict[str, float]:
    """Median wall seconds of each callable, run round-robin so drift hits all alike."""
    times: dict[str, list[float]] = {name: [] for name in candidates}
    with torch.inference_mode():
        for _ in range(warmup):
            for fn in candidates.values():
                fn()
        for _ in range(repeats):
            for name, fn in candidates.items():
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def print_table(title: str, seconds: dict[str, float], baseline: str) -> None:
    """One row per candidate: median ms and ratio to ``baseline``."""
    print(f"\n{title} (ratio = time / {baseline})")
    for name, s in seconds.items():
        print(f"  {name:<48} {s * 1e3:9.1f} ms   {s / seconds[baseline]:6.2f}x")
