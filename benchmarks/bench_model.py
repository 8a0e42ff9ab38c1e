"""GPTModel forward and caching against Hugging Face eager GPT-2 and TransformerLens's bridge,
on a GPT-2-small shape (12 layers, d_model 768, 12 heads; vocab 2048) with random weights.

The first run_with_cache tunes the process's allocator (interp.memory), so the caching tables,
the bridge's included, run with freed memory kept up to 1 GB; the last table keeps all of it.

    .venv/bin/python benchmarks/bench_model.py [BATCH] [POS]
"""

import sys

import torch

from interp.memory import retain_freed_memory

from common import gpt2_small_peers, load_note, print_table, time_interleaved

batch, pos = (int(a) for a in (sys.argv[1:3] if len(sys.argv) >= 3 else (4, 128)))
torch.manual_seed(0)
hf, ours, bridge = gpt2_small_peers()
tokens = torch.randint(0, ours.cfg.d_vocab, (batch, pos))
patterns_only = lambda name: name.endswith("hook_pattern")

forward = time_interleaved({
    "HF eager GPT-2 forward": lambda: hf(tokens),
    "GPTModel forward (no hooks, SDPA)": lambda: ours(tokens),
    "TransformerBridge forward": lambda: bridge(tokens),
})
print(f"batch={batch} pos={pos} threads={torch.get_num_threads()}; {load_note()}")
print_table("Forward without hooks", forward, "HF eager GPT-2 forward")

caching = time_interleaved({
    "GPTModel forward": lambda: ours(tokens),
    "GPTModel run_with_cache (everything)": lambda: ours.run_with_cache(tokens),
    "GPTModel run_with_cache (patterns only)": lambda: ours.run_with_cache(tokens, names_filter=patterns_only),
})
print_table("GPTModel caching", caching, "GPTModel forward")

bridge_caching = time_interleaved({
    "TransformerBridge forward": lambda: bridge(tokens),
    "TransformerBridge run_with_cache (everything)": lambda: bridge.run_with_cache(tokens),
})
print_table("Bridge caching (the peer)", bridge_caching, "TransformerBridge forward")

retain_freed_memory(limit_mb=None)
keep_all = time_interleaved({
    "GPTModel forward": lambda: ours(tokens),
    "GPTModel run_with_cache (everything)": lambda: ours.run_with_cache(tokens),
})
print_table("GPTModel caching after retain_freed_memory(None)", keep_all, "GPTModel forward")
print(f"\n{load_note()}")
