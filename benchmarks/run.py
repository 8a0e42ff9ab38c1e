"""``make bench``: run every ``benchmarks/bench_*.py`` in turn, each in a fresh interpreter (the
first cache tunes the process's allocator, so one script must not set the stage for the next);
each prints its own ratios. ``run.py NAME ...`` runs the scripts whose names contain a NAME:
``model``, ``classify``, ``patching`` (GPT-2-small shape), ``llama`` (our GPTModel on a Llama shape
with grouped-query attention: forward against Hugging Face eager and SDPA, caching, classification
and head patching against TransformerLens on the bridge over the same weights), ``circuits`` (exact
path patching of every (sender, receiver) pair against TransformerLens's ``get_act_patch_direct_path``,
and edge attribution against exact path patching), ``composition`` (composition scores against
TransformerLens's ``all_composition_scores``), ``study`` (a scripted study locally and on Ray with 1
and 2 workers: rows/s and per-block overhead; needs the ``[ray]`` extra), ``kv_cache`` (generation
with and without the KV cache as the sequence grows; cache bytes for MHA, GQA, MQA)."""

import subprocess
import sys
from pathlib import Path

here = Path(__file__).parent
selected = sys.argv[1:]
for script in sorted(here.glob("bench_*.py")):
    if selected and not any(name in script.stem for name in selected):
        continue
    print(f"\n=== {script.name}", flush=True)
    subprocess.run([sys.executable, str(script)], check=True)
