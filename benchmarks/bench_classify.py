"""Head classification against TransformerLens's ``detect_head`` on one TransformerBridge
(GPT-2-small shape, random weights), and against one plain batched forward over the same prompts
(the floor: every score needs every layer's pattern).

detect_head gets the three roles it knows (previous-token, duplicate-token, induction) over the same
number of prompts of the same token length as classify_heads' probes.

    .venv/bin/python benchmarks/bench_classify.py [PROMPTS] [POS]
"""

import sys

import torch
from transformer_lens.head_detector import HEAD_NAMES, detect_head

from analyses.roles.classify import classify_heads
from analyses.core.probes import probes_for
from analyses.roles.tl_compat import detect_heads
from common import GPT2_SMALL, load_note, print_table, repeated_texts, speedup, time_interleaved
from interp.bridge import boot_bridge
from interp.random_models import make_random_gpt2

n_prompts, pos = (int(a) for a in (sys.argv[1:3] if len(sys.argv) >= 3 else (8, 64)))
torch.manual_seed(0)
bridge = boot_bridge(*make_random_gpt2(**GPT2_SMALL, seed=0))
tokens = probes_for(bridge, n_prompts, seq_len=pos, seed=0).tokens
texts = repeated_texts(bridge, n_prompts, pos)

seconds = time_interleaved({
    "one plain batched forward (floor)": lambda: bridge(tokens),
    "classify_heads (all 7 measures, bootstrap CIs)": lambda: classify_heads(bridge, n_prompts, pos, progress=False),
    "detect_heads (ours, TL-compatible, 3 roles)": lambda: detect_heads(bridge, texts, progress=False),
    "detect_head x 3 roles (TransformerLens)": lambda: [detect_head(bridge, texts, name) for name in HEAD_NAMES],
}, repeats=3)
print(f"prompts={n_prompts} pos={pos} threads={torch.get_num_threads()} shape={GPT2_SMALL}; {load_note()}")
print_table("Head classification, one TransformerBridge", seconds, "one plain batched forward (floor)")
for name in ("classify_heads (all 7 measures, bootstrap CIs)", "detect_heads (ours, TL-compatible, 3 roles)"):
    print(f"  {name} faster than detect_head by {speedup(seconds, 'detect_head x 3 roles (TransformerLens)', name)}")
