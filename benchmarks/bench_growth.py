"""How time, forward-equivalents and memory grow with the model and the batch (issue 24.4).

Each point of a ladder (layers, d_model, heads, vocabulary, prompts; one axis moved at a time from a
base shape) runs each analysis in a fresh subprocess: classification (``classify_heads``), head
patching (``patch_heads``), path patching (``path_patch``, head 0.0 as the sender to every later
head through q, k and v, and the logits), edge attribution (``edge_attribution``, every edge) and the
report (``build_report``). For each it prints the wall time (one thread), the forward-equivalents
(FE: block rows run / (probe rows x layers), counted by ``bench_report.ForwardCounter``, null
models included) and the peak growth of resident memory over the model's (``VmHWM`` after
``/proc/self/clear_refs`` reset it once the model was built), next to the weights' bytes.
The models are randomly initialised Llama-shaped ``GPTModel``s (RMS norm, SwiGLU, rotary,
grouped-query, tied unembedding), so the figures are the toolkit's, not one checkpoint's.

    python benchmarks/bench_growth.py                      # the ladder, a table, benchmarks/growth.png
    python benchmarks/bench_growth.py --llama-1b-width 2   # also d_model 2048, 32/8 heads, 128,256 vocabulary,
                                                           # 2 layers, bfloat16
    python benchmarks/bench_growth.py --only classify,eap  # a subset of the analyses
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

ANALYSES = ("classify", "patch_heads", "path_patch", "eap", "report")


@dataclass(frozen=True)
class Point:
    """One model shape and batch: a Llama-shaped GPTModel and ``prompts`` probes of ``seq_len`` tokens."""

    layers: int = 4
    d_model: int = 256
    heads: int = 8
    kv_heads: int = 2
    vocab: int = 8192
    prompts: int = 8
    seq_len: int = 64
    dtype: str = "float32"

    def label(self) -> str:
        return (f"L{self.layers} d{self.d_model} h{self.heads}/{self.kv_heads} V{self.vocab} "
                f"P{self.prompts}x{self.seq_len} {self.dtype}")


BASE = Point()
LADDER = {
    "layers": [replace(BASE, layers=n) for n in (2, 4, 8)],
    "d_model": [replace(BASE, d_model=d) for d in (128, 256, 512)],
    "heads": [replace(BASE, heads=h, kv_heads=h // 4) for h in (4, 8, 16)],
    "vocab": [replace(BASE, vocab=v) for v in (8192, 32768, 128256)],
    "prompts": [replace(BASE, prompts=p) for p in (4, 8, 16)],
}


def llama_1b_width(layers: int) -> Point:
    """Llama-3.2-1B's width (d_model 2048, 32 query / 8 key-value heads, 128,256 vocabulary) at
    ``layers`` layers, in bfloat16."""
    return Point(layers=layers, d_model=2048, heads=32, kv_heads=8, vocab=128256, prompts=8, seq_len=64,
                 dtype="bfloat16")


def build(point: Point):
    """The point's model: random weights (seed 0), eval mode, in its dtype."""
    import torch

    from interp import GPTConfig, GPTModel

    torch.manual_seed(0)
    cfg = GPTConfig(d_vocab=point.vocab, n_ctx=point.seq_len, d_model=point.d_model, n_heads=point.heads,
                    n_layers=point.layers, n_key_value_heads=point.kv_heads, d_mlp=4 * point.d_model,
                    normalization_type="RMS", act_fn="silu", gated_mlp=True, positional_embedding_type="rotary",
                    qkv_bias=False, attn_out_bias=False, mlp_bias=False, tie_word_embeddings=True)
    return GPTModel(cfg).to(getattr(torch, point.dtype)).eval()


def _status(key: str) -> int:
    """A /proc/self/status figure in bytes."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(key)) * 1024


def run_one(point: Point, analysis: str) -> dict:
    """In this process: build the model, reset the memory high-water mark, run ``analysis`` once
    -> {seconds, fe, peak_growth_mb, weights_mb}."""
    import torch

    from analyses.circuits.path_patching import edge_attribution
    from analyses.roles.classify import classify_heads
    from analyses.core.metrics import loss_metric
    from analyses.interventions.patching import patch_heads
    from analyses.circuits.path_patching import path_patch
    from analyses.core.probes import corrupt_first_copy, probes_for
    from analyses.report.build import build_report
    from bench_report import ForwardCounter, mark_owned, own_new_models

    torch.set_num_threads(1)
    model = build(point)
    own_new_models()
    mark_owned(model)
    probes = probes_for(model, point.prompts, point.seq_len, seed=0)
    clean, corrupted = probes.tokens, corrupt_first_copy(probes, seed=1)
    metric = loss_metric(clean, probes.predictable)
    later = [(layer, head) for layer in range(1, point.layers) for head in range(point.heads)]
    runs = {
        "classify": lambda: classify_heads(model, probes=probes, n_boot=200, progress=False),
        "patch_heads": lambda: patch_heads(model, clean, corrupted, metric, progress=False),
        "path_patch": lambda: path_patch(model, clean, corrupted, metric, senders=[(0, 0)], receivers=later,
                                         progress=False),
        "eap": lambda: edge_attribution(model, clean, corrupted, metric),
        "report": lambda: build_report(model, model_name="growth", n_prompts=point.prompts, seq_len=point.seq_len,
                                       progress=False),
    }
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark restarts from the resident size now
    base = _status("VmRSS:")
    start = time.perf_counter()
    with ForwardCounter(model, probes.tokens) as counter:
        runs[analysis]()
    seconds = time.perf_counter() - start
    fe = sum(counter.block_rows.values())
    return {"seconds": seconds, "fe": fe, "peak_growth_mb": (_status("VmHWM:") - base) / 2**20,
            "weights_mb": weights / 2**20}


def measure(point: Point, analysis: str, timeout: float) -> dict:
    """``run_one`` in a fresh subprocess (its memory is its own) -> its figures, or {"error": ...}."""
    command = [sys.executable, __file__, "--one", json.dumps({"point": asdict(point), "analysis": analysis})]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"over {timeout:.0f} s"}
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["exit %d" % done.returncode])[-1][:120]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def plot(rows: list[dict], path: Path) -> Path:
    """One panel per ladder axis: seconds and peak growth (MB) of each analysis against the axis."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd
    import seaborn as sns

    frame = pd.DataFrame([r for r in rows if "seconds" in r and r["axis"] in LADDER])
    figure, axes = plt.subplots(2, len(LADDER), figsize=(4 * len(LADDER), 7), squeeze=False)
    for column, axis in enumerate(LADDER):
        part = frame[frame["axis"] == axis]
        for row, (value, label) in enumerate((("seconds", "seconds (1 thread)"), ("peak_growth_mb", "peak growth (MB)"))):
            sns.lineplot(part, x="value", y=value, hue="analysis", marker="o", ax=axes[row, column],
                         legend=column == len(LADDER) - 1 and row == 0)
            ax = axes[row, column]
            ax.set_xscale("log", base=2)
            ax.set(yscale="log", xlabel=axis, ylabel=label if column == 0 else "", xticks=sorted(part["value"].unique()))
            ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    figure.suptitle("growth from the base " + BASE.label())
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--only", default=",".join(ANALYSES), help="comma-separated analyses (default all)")
    parser.add_argument("--axes", default=",".join(LADDER), help="comma-separated ladder axes (default all)")
    parser.add_argument("--llama-1b-width", type=int, default=0, metavar="LAYERS",
                        help="also run the Llama-3.2-1B-width model with this many layers, in bfloat16")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per run (default 600)")
    parser.add_argument("--plot", type=Path, default=Path(__file__).with_name("growth.png"))
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args()
    if args.one:
        job = json.loads(args.one)
        print(json.dumps(run_one(Point(**job["point"]), job["analysis"])))
        return
    analyses = [a for a in args.only.split(",") if a]
    points = [(axis, getattr(point, axis), point)
              for axis in args.axes.split(",") if axis for point in LADDER[axis]]
    if args.llama_1b_width:
        point = llama_1b_width(args.llama_1b_width)
        points.append(("llama-1b-width", point.layers, point))
    rows, done = [], {}
    print(f"{'point':<44} {'analysis':<12} {'seconds':>8} {'FE':>8} {'peak MB':>8} {'weights MB':>10}", flush=True)
    for axis, value, point in points:
        for analysis in analyses:
            key = (point, analysis)
            if key not in done:  # the base point sits on every axis: measured once
                done[key] = measure(point, analysis, args.timeout)
            found = done[key]
            rows.append({"axis": axis, "value": value, "analysis": analysis, "point": point.label(), **found})
            if "error" in found:
                print(f"{point.label():<44} {analysis:<12} {found['error']}", flush=True)
            else:
                print(f"{point.label():<44} {analysis:<12} {found['seconds']:>8.1f} {found['fe']:>8.1f} "
                      f"{found['peak_growth_mb']:>8.0f} {found['weights_mb']:>10.0f}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    if any(axis in LADDER for axis, _, _ in points):
        print(f"wrote {plot(rows, args.plot)}")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))  # bench_report, beside this file
    main()
