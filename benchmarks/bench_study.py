"""A scripted study run locally and on Ray with 1 and 2 workers (a local Ray instance with 2 CPUs):
rows per second once rows flow (from the first row on disk to the last, so model loading and
actor start-up are left out and reported apart), and Ray's overhead per block, measured on a warm
actor as the round trip of an empty block and as a one-row block's time minus the row's local
time. Workload: the embedded toy model, mean ablation of every head, 128 repeated prompts of 64
tokens, a grid over 4 prompt seeds (64 rows). The local run uses one thread, as each worker does."""

from __future__ import annotations

import logging
import statistics
import tempfile
import time
from pathlib import Path

import ray
import torch

from analyses.studies.cells import StudyCells
from analyses.studies.runner import run_study
from analyses.studies.on_ray import StudyWorker
from analyses.studies.spec import load_spec

SPEC = """[model]
spec = "toy"
[prompts]
n = 128
seq_len = 64
seed = [0, 1, 2, 3]
[ablation]
method = "mean"
targets = "each_head"
"""


def timed_run(spec: Path, out: Path, **executor) -> tuple[float, float, int]:
    """(seconds in all, seconds from the first row on disk to the last, rows); a Ray run's file
    is checked to be the local run's, byte for byte."""
    stamps = []
    start = time.perf_counter()
    results = run_study(spec, out, progress=False, on_row=lambda i: stamps.append(time.perf_counter()), **executor)
    total = time.perf_counter() - start
    if executor:
        assert results.read_bytes() == (out.parent / "local" / "results.csv").read_bytes()
    return total, stamps[-1] - stamps[0], len(stamps)


def block_overhead(spec: Path, repeats: int = 100) -> tuple[float, float, float]:
    """(empty block round trip, one-row block on Ray, the same row computed here), seconds, medians."""
    cells = load_spec(spec).cells
    actor = StudyWorker.remote(cells)
    ray.get(actor.plan.remote(0))
    empty = []
    for _ in range(repeats):
        start = time.perf_counter()
        ray.get(actor.rows.remote(0, 0, 0))
        empty.append(time.perf_counter() - start)
    local, remote = StudyCells(cells), []
    local.plan(0)
    here = []
    for row in range(16):
        start = time.perf_counter()
        ray.get(actor.rows.remote(0, row, row + 1))
        remote.append(time.perf_counter() - start)
        start = time.perf_counter()
        list(local.rows(0, row, row + 1))
        here.append(time.perf_counter() - start)
    ray.kill(actor)
    return statistics.median(empty), statistics.median(remote), statistics.median(here)


def main() -> None:
    torch.set_num_threads(1)  # the local run on one CPU, as each Ray worker is
    with tempfile.TemporaryDirectory() as directory:
        directory = Path(directory)
        spec = directory / "grid.toml"
        spec.write_text(SPEC)
        total, flowing, rows = timed_run(spec, directory / "local")
        local_rate = rows / flowing
        print(f"local     : {rows} rows, {local_rate:6.2f} rows/s once flowing ({total:.1f} s in all)")
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
        try:
            for workers in (1, 2):
                total, flowing, rows = timed_run(spec, directory / f"ray{workers}", executor="ray", workers=workers)
                print(f"ray x {workers}   : {rows} rows, {rows / flowing:6.2f} rows/s once flowing "
                      f"({rows / flowing / local_rate:.2f}x local; {total:.1f} s in all, start-up included)")
            empty, remote, here = block_overhead(spec)
            print(f"per block : empty round trip {1e3 * empty:.2f} ms; a one-row block {1e3 * remote:.1f} ms on Ray "
                  f"vs {1e3 * here:.1f} ms here ({1e3 * (remote - here):+.1f} ms)")
        finally:
            ray.shutdown()
        total, flowing, rows = timed_run(spec, directory / "local_again")
        print(f"local again: {rows / flowing:6.2f} rows/s once flowing (the machine may be shared: compare the two)")


if __name__ == "__main__":
    main()
