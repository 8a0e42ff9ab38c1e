"""``make bench``: run every ``benchmarks/bench_*.py`` in turn, each in a fresh interpreter (the
first cache tunes the process's allocator, so one script must not set the stage for the next);
each prints its own ratios."""

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
