"""Shared benchmark helpers: paired, interleaved timing (wall and CPU clocks, min and median),
the peers over the same random weights (GPT-2-small shape, Llama shape), and the workloads more
than one script times (the induction patching pair, TransformerLens's sweep, repeated texts)."""

from __future__ import annotations

import contextlib
import functools
import os
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from transformer_lens import patching as tl_patching

from analyses.core.metrics import loss_metric
from analyses.core.budget import DEFAULT_MEMORY_MB
from interp.memory import command_limit_mb, retain_freed_memory_once
from analyses.core.probes import corrupt_first_copy, probes_for
from interp import from_hf
from interp.bridge import boot_bridge
from interp.random_models import make_random_gpt2, random_hf_model

# TransformerLens's sweep draws a progress bar per call and has no switch for it; disabled, so the
# scripts' output stays readable (this only makes the peer's timings, if anything, slightly lower)
tl_patching.tqdm = functools.partial(tl_patching.tqdm, disable=True)

GPT2_SMALL = dict(n_layers=12, d_model=768, n_heads=12, n_ctx=256, d_vocab=2048)
# The Llama shape: grouped-query attention (8 query heads share 2 key/value heads, d_head
# 64), SwiGLU MLP, rotary positions, RMSNorm; Llama's byte-level tokenizer from interp.random_models.
LLAMA_GQA = dict(num_hidden_layers=8, hidden_size=512, num_attention_heads=8, num_key_value_heads=2,
                 intermediate_size=1408, n_ctx=128, d_vocab=2048)

# a benchmark process is ours: tune it as the commands do (at the default budget), for comparable figures
retain_freed_memory_once(command_limit_mb(DEFAULT_MEMORY_MB))


def gpt2_small_peers(seed: int = 0):
    """(HF GPT2LMHeadModel, our GPTModel, TransformerBridge) over the same random weights."""
    hf, tokenizer = make_random_gpt2(**GPT2_SMALL, seed=seed)
    return hf, from_hf(hf, tokenizer), boot_bridge(hf, tokenizer)


def llama_peers(seed: int = 0):
    """(HF LlamaForCausalLM with eager attention, our GPTModel, TransformerBridge) over the same
    random weights of the ``LLAMA_GQA`` shape, all in eval mode."""
    hf, tokenizer = random_hf_model("llama", seed=seed, **LLAMA_GQA)
    return hf.eval(), from_hf(hf, tokenizer).eval(), boot_bridge(hf, tokenizer, name="llama-gqa-random").eval()


@dataclass
class Samples:
    """One candidate's timings, one per interleaved round, in seconds; ``result``: its last return."""

    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    result: object = None

    def min(self, clock: str = "wall") -> float:
        return min(getattr(self, clock))

    def median(self, clock: str = "wall") -> float:
        return statistics.median(getattr(self, clock))

    def paired(self, baseline: "Samples", clock: str = "wall") -> float:
        """Median over rounds of this time / ``baseline``'s time in the same round: the steadiest
        ratio where the machine's speed changes between rounds."""
        return statistics.median(a / b for a, b in zip(getattr(self, clock), getattr(baseline, clock)))


def time_interleaved(candidates: dict[str, Callable[[], object]], repeats: int = 7, warmup: int = 1,
                     mode: Callable[[], contextlib.AbstractContextManager] = torch.inference_mode,
                     budget_s: float = 0.0, max_repeats: int = 50) -> dict[str, Samples]:
    """Each callable round-robin, ``repeats`` rounds after ``warmup`` rounds, so drift in the
    machine's speed hits all alike; then more rounds while the timed rounds have taken less than
    ``budget_s`` in all (up to ``max_repeats``), so quick candidates get many samples. Wall seconds
    and CPU seconds of this process (all its threads; on this VM CPU time also inflates when the
    host slows the machine, so neither clock is free of the neighbours: compare within a round)."""
    samples = {name: Samples() for name in candidates}
    spent, rounds = 0.0, 0
    with mode():
        for _ in range(warmup):
            for fn in candidates.values():
                fn()
        while rounds < repeats or (spent < budget_s and rounds < max_repeats):
            for name, fn in candidates.items():
                start_cpu, start_wall = time.process_time(), time.perf_counter()
                samples[name].result = fn()
                samples[name].cpu.append(time.process_time() - start_cpu)
                samples[name].wall.append(time.perf_counter() - start_wall)
                spent += samples[name].wall[-1]
            rounds += 1
    return samples


def speedup(samples: dict[str, Samples], slow: str, fast: str, clock: str = "wall") -> str:
    """How many times ``fast`` beats ``slow``: paired (median of per-round ratios), of the medians
    and of the minima."""
    a, b = samples[slow], samples[fast]
    return (f"{1 / b.paired(a, clock):.2f}x paired (medians {a.median(clock) / b.median(clock):.2f}x, "
            f"mins {a.min(clock) / b.min(clock):.2f}x)")


def print_table(title: str, samples: dict[str, Samples], baseline: str, clock: str = "wall") -> None:
    """One row per candidate: min and median ms of ``clock``; ratios to ``baseline``: paired (median
    of per-round ratios), of the medians, of the minima."""
    base = samples[baseline]
    print(f"\n{title} ({clock} time, {len(base.wall)} interleaved rounds; ratio = time / {baseline})")
    print(f"  {'':<54}{'min ms':>9}{'median ms':>11}{'paired':>8}{'medians':>9}{'mins':>7}")
    for name, s in samples.items():
        print(f"  {name:<54}{s.min(clock) * 1e3:9.1f}{s.median(clock) * 1e3:11.1f}{s.paired(base, clock):8.2f}"
              f"{s.median(clock) / base.median(clock):9.2f}{s.min(clock) / base.min(clock):7.2f}")


def load_note() -> str:
    """The machine's load average (1, 5, 15 min) on its cores, and the share of the last minute in
    which some runnable task waited for a CPU (Linux PSI): how much the neighbours ran."""
    one, five, fifteen = os.getloadavg()
    note = f"load average {one:.2f} {five:.2f} {fifteen:.2f} on {os.cpu_count()} cores"
    try:
        with open("/proc/pressure/cpu") as f:
            some = dict(kv.split("=") for kv in f.readline().split()[1:])
        return f"{note}, CPU pressure {float(some['avg60']):.0f}% (60 s)"
    except (OSError, KeyError, ValueError):
        return note


def forward_seconds(model, tokens: torch.Tensor, repeats: int = 10) -> float:
    """Median CPU seconds of one plain forward (after a warm-up)."""
    return time_interleaved({"forward": lambda: model(tokens)}, repeats, mode=torch.no_grad)["forward"].median("cpu")


def induction_pair(model, n_prompts: int, seq_len: int):
    """(clean, corrupted, metric): repeated-segment probes, the same with the first copy of the
    segment replaced, and the loss on the predictable second-copy tokens."""
    probes = probes_for(model, n_prompts, seq_len, seed=0)
    return probes.tokens, corrupt_first_copy(probes, seed=1), loss_metric(probes.tokens, probes.predictable)


def tl_sweep(model, clean, corrupted, metric):
    """TransformerLens's head-output patching sweep (one full forward per head), with the clean
    cache it needs."""
    with torch.no_grad():
        _, cache = model.run_with_cache(clean)
        return tl_patching.get_act_patch_attn_head_out_all_pos(model, corrupted, cache, metric)


def repeated_text(rng: random.Random, pos: int) -> str:
    """A text of pos - 1 byte tokens (BOS makes pos): random prefix, a segment twice, filler."""
    period, prefix = rng.randint(pos // 8, pos // 3), rng.randint(1, pos // 8)
    segment = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(period))
    filler = "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ ") for _ in range(pos - 1 - 2 * period))
    return filler[:prefix] + segment + segment + filler[prefix:]


def repeated_texts(model, n: int, pos: int, seed: int = 0) -> list[str]:
    """``n`` repeated texts that each tokenise to exactly ``pos`` tokens on ``model``."""
    rng = random.Random(seed)
    texts = [repeated_text(rng, pos) for _ in range(n)]
    assert all(model.to_tokens(text).shape[1] == pos for text in texts)
    return texts


def tl_direct_path_sweep(bridge, clean, corrupted, metric, senders, via) -> torch.Tensor:
    """TransformerLens's direct-path patching from each sender -> [n_senders, n_layers, n_heads]."""
    with torch.no_grad():
        _, clean_cache = bridge.run_with_cache(clean)
        _, corrupted_cache = bridge.run_with_cache(corrupted)
        return torch.stack([
            tl_patching.get_act_patch_direct_path(bridge, corrupted, clean_cache, corrupted_cache, metric, layer, head,
                                                  via, verbose=False).cpu()
            for layer, head in senders
        ])


def path_grid(frame, senders, n_layers, n_heads) -> torch.Tensor:
    """path_patch's rows -> [n_senders, n_layers, n_heads] in TransformerLens's layout (0 where no pair)."""
    index = {sender: i for i, sender in enumerate(senders)}
    grid = torch.zeros(len(senders), n_layers, n_heads)
    rows = [index[s] for s in zip(frame.sender_layer, frame.sender_head)]
    grid[rows, frame.receiver_layer.tolist(), frame.receiver_head.tolist()] = torch.tensor(frame.value.to_numpy())
    return grid
