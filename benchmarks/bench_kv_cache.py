"""What the key/value cache and grouped queries buy: GPTModel's greedy generation with and without
its KV cache as the sequence grows, and the cache's bytes for multi-head, grouped-query and
multi-query attention at equal d_model, with SmolLM2-135M (9 query heads over 3 key/value heads)
as the real case.

    .venv/bin/python benchmarks/bench_kv_cache.py [--model DIR] [--lengths 16 64 128 256] [--threads 1]

Generation: ``model.generate(prompt, n, use_kv_cache=...)`` for each n in ``--lengths`` after an
8-token prompt, the two interleaved round-robin; the time per generated token is the total / n (with
the cache each step runs the new token alone; without it every step reruns the whole sequence, so
its cost per token grows with the length). Both must give the same tokens (checked, printed).

Cache bytes: the keys and values a forward with ``past_kv`` leaves (``interp.attention.LayerKV``),
summed over layers after a ``--cache-tokens`` prompt, on the model's shape with its key/value heads
set to the query heads' count (MHA), its own (GQA) and one (MQA), random weights; against the formula
2 (keys, values) x layers x kv_heads x d_head x tokens x bytes per value.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import torch

from interp import GPTModel, load_model
from interp.attention import LayerKV

from common import load_note, time_interleaved

PROMPT_TOKENS = 8


def generation_table(model, lengths: list[int], repeats: int) -> None:
    """Per-token milliseconds of greedy generation with and without the cache, per length."""
    prompt = torch.randint(0, model.cfg.d_vocab, (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(0))
    print(f"\nGreedy generation after a {PROMPT_TOKENS}-token prompt, batch 1 (ms per generated token, medians of "
          f"{repeats} interleaved rounds; CPU time of this process beside wall time, steadier on a shared machine)")
    print(f"  {'new tokens':>10}{'cached ms/tok':>15}{'uncached ms/tok':>17}{'uncached/cached':>17}"
          f"{'CPU ms/tok cached':>19}{'uncached':>10}{'ratio':>7}{'same tokens':>13}")
    for n in lengths:
        samples = time_interleaved({
            "cached": lambda: model.generate(prompt, n, use_kv_cache=True),
            "uncached": lambda: model.generate(prompt, n, use_kv_cache=False),
        }, repeats=repeats, warmup=0)
        cached, uncached = samples["cached"], samples["uncached"]
        same = torch.equal(cached.result, uncached.result)
        print(f"  {n:>10}{cached.median() / n * 1e3:15.1f}{uncached.median() / n * 1e3:17.1f}"
              f"{uncached.paired(cached):17.2f}{cached.median('cpu') / n * 1e3:19.1f}"
              f"{uncached.median('cpu') / n * 1e3:10.1f}{uncached.paired(cached, 'cpu'):7.2f}{str(same):>13}")


def cache_bytes(model, n_tokens: int) -> int:
    """Bytes of the keys and values ``model`` caches for a prompt of ``n_tokens`` (batch 1)."""
    past = [LayerKV() for _ in model.blocks]
    with torch.no_grad():
        model(torch.zeros(1, n_tokens, dtype=torch.long), past_kv=past, return_type=None)
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in past)


def formula_bytes(cfg, n_kv: int, n_tokens: int, value_bytes: int = 4) -> int:
    return 2 * cfg.n_layers * n_kv * cfg.d_head * n_tokens * value_bytes


def bytes_table(cfg, n_tokens: int, name: str) -> None:
    """Cache bytes for MHA, the shape's own grouping and MQA at the shape's d_model, measured and by formula."""
    groupings = dict.fromkeys([cfg.n_heads, cfg.n_key_value_heads or cfg.n_heads, 1])
    print(f"\nKV cache of {name}'s shape ({cfg.n_layers} layers, d_model {cfg.d_model}, {cfg.n_heads} query heads of "
          f"d_head {cfg.d_head}), float32, after {n_tokens} tokens, batch 1")
    print(f"  {'attention':<26}{'kv heads':>9}{'measured MB':>13}{'formula MB':>12}{'KB/token':>10}{'vs MHA':>8}")
    mha = None
    for n_kv in groupings:
        shape = dataclasses.replace(cfg, n_key_value_heads=n_kv, d_vocab=256, tie_word_embeddings=True,
                                    d_vocab_out=None, n_ctx=max(cfg.n_ctx, n_tokens))
        measured = cache_bytes(GPTModel(shape).eval(), n_tokens)
        assert measured == formula_bytes(cfg, n_kv, n_tokens), (measured, formula_bytes(cfg, n_kv, n_tokens))
        mha = mha or measured
        kind = "MHA" if n_kv == cfg.n_heads else "MQA" if n_kv == 1 else f"GQA ({cfg.n_heads // n_kv} queries/kv head)"
        print(f"  {kind:<26}{n_kv:>9}{measured / 2**20:13.1f}{formula_bytes(cfg, n_kv, n_tokens) / 2**20:12.1f}"
              f"{measured / n_tokens / 1024:10.1f}{measured / mha:8.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2",
                        help="the model to generate with (default: SmolLM2-135M where present, else toy)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[16, 64, 128, 256])
    parser.add_argument("--cache-tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(args.model).eval()
    name = Path(args.model).name
    n_tokens = min(args.cache_tokens, model.cfg.n_ctx)
    print(f"{args.model}: {model.cfg.n_layers} layers, {model.cfg.n_heads} query heads over "
          f"{model.cfg.n_key_value_heads or model.cfg.n_heads} kv heads; threads={torch.get_num_threads()}; "
          f"{load_note()}")
    measured = cache_bytes(model, n_tokens)
    print(f"its own cache after {n_tokens} tokens: {measured / 2**20:.1f} MB ({measured / n_tokens / 1024:.1f} KB "
          f"per token)")
    bytes_table(model.cfg, n_tokens, name)
    generation_table(model, args.lengths, args.repeats)


if __name__ == "__main__":
    main()
