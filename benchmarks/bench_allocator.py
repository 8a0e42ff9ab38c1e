"""What the commands' allocator setting (``interp.memory.retain_freed_memory``) buys on one of the
report's steps: the total and direct effects of every head of a GPT-2-small-shaped model (random
weights, 50,257-token vocabulary) on 8 probes x 128 tokens at a 554 MB budget, each setting in a
fresh process: wall and CPU seconds, minor page faults and peak resident memory.

    python benchmarks/bench_allocator.py            # a random GPT-2-small directory is made first
    python benchmarks/bench_allocator.py --model DIR

Settings: ``untuned`` (glibc's defaults: blocks over its threshold mapped fresh and returned),
``large-blocks-mapped`` (blocks up to 32 MB from the heap, 256 MB kept: the commands' setting, a
quarter of the default budget), ``heap`` (every block from the heap, 256 MB kept: fewer faults on
one step, but a whole report fragments the heap: ``benchmarks/README.md``), ``keep-all``
(``limit_mb=None``)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import textwrap

MEASURE = textwrap.dedent("""
    import ctypes, json, resource, sys, time
    setting, model_dir = sys.argv[1:3]
    libc = ctypes.CDLL(None)
    if setting == "heap":  # M_MMAP_MAX 0, M_TRIM_THRESHOLD and M_TOP_PAD 256 MB
        assert all(libc.mallopt(param, value) == 1 for param, value in ((-4, 0), (-1, 256 << 20), (-2, 256 << 20)))
    elif setting != "untuned":
        import interp.memory
        interp.memory.retain_freed_memory(256 if setting == "large-blocks-mapped" else None)
    import interp
    from analyses.core.metrics import loss_metric
    from analyses.core.probes import probes_for
    from analyses.roles.backup import direct_and_total_effects
    model = interp.load_model(model_dir)
    probes = probes_for(model, 8, 128, seed=0)
    metric = loss_metric(probes.tokens, probes.predictable)
    before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    direct_and_total_effects(model, probes, None, "mean_aligned", metric, memory_mb=554, progress=False)
    after = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({"wall s": time.perf_counter() - start, "user s": after.ru_utime - before.ru_utime,
                      "system s": after.ru_stime - before.ru_stime, "faults": after.ru_minflt - before.ru_minflt,
                      "peak MB": after.ru_maxrss / 1024}))
""")
SETTINGS = ("untuned", "large-blocks-mapped", "heap", "keep-all")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a GPT-2-small-shaped directory (default: made at random)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        model = args.model
        if model is None:
            from interp.random_models import save_random_model
            model = str(save_random_model("gpt2", scratch, d_vocab=50257, n_ctx=1024, n_layer=12, n_embd=768,
                                          n_head=12))
        print(f"{'setting':<20} {'wall s':>8} {'user s':>8} {'system s':>9} {'faults':>11} {'peak MB':>8}")
        for setting in SETTINGS:
            out = subprocess.run([sys.executable, "-c", MEASURE, setting, model], check=True, capture_output=True,
                                 text=True).stdout
            row = json.loads(out.strip().splitlines()[-1])
            print(f"{setting:<20} {row['wall s']:>8.1f} {row['user s']:>8.1f} {row['system s']:>9.1f} "
                  f"{row['faults']:>11,} {row['peak MB']:>8.0f}")


if __name__ == "__main__":
    main()
