"""``make bench``: run every ``benchmarks/bench_*.py`` in turn; each prints its own ratios."""

import runpy
import sys
from pathlib import Path

here = Path(__file__).parent
selected = sys.argv[1:]
for script in sorted(here.glob("bench_*.py")):
    if selected and not any(name in script.stem for name in selected):
        continue
    print(f"\n=== {script.name}", flush=True)
    runpy.run_path(str(script), run_name="__main__")
