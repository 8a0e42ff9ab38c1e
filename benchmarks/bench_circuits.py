"""Exact path patching against TransformerLens's ``get_act_patch_direct_path``, and edge attribution
against exact path patching.

A random GPT-2-shaped model: 12 layers of 12 heads as GPT-2 small, but d_model 384 (d_head 32) and
a 2048-token vocabulary, so TransformerLens's one-forward-per-pair sweep finishes here in minutes
(``--d-model 768`` for the full width, ``--vocab 50257`` for GPT-2's vocabulary). The workload is every (sender, later head) pair through
the query (``--via``; 9,504 pairs on 12 x 12 heads), on the induction pair (repeated segments vs
the first copy replaced), loss on the predictable tokens. TransformerLens runs
``get_act_patch_direct_path`` once per sender on the bridge (one full forward with per-head q/k/v
inputs per pair); ours (``analyses.path_patch``) batches every pair through the intervention
engine and, on ``GPTModel``, runs only the blocks from the receiver's layer on. Both include the
clean and corrupted runs they need. ``--sender-stride N`` keeps every N-th sender for both (a
quicker, per-pair-equivalent comparison). Times are CPU seconds of this process on one thread;
forward-equivalents = time / one plain forward of the same batch on the same model.

    .venv/bin/python benchmarks/bench_circuits.py [--d-model 384] [--prompts 2] [--seq-len 16]
        [--via q] [--sender-stride 1] [--vocab 2048] [--bridge]
"""

from __future__ import annotations

import argparse
import contextlib
import time
from itertools import product

import torch

from analyses.circuits.edge_attribution import edge_agreement
from analyses.circuits.edges import VIAS
from analyses.circuits.path_patching import edge_attribution, path_patch
from common import forward_seconds, induction_pair, load_note, path_grid, time_interleaved, tl_direct_path_sweep
from interp import from_hf
from interp.bridge import boot_bridge
from interp.random_models import make_random_gpt2


def cpu_seconds(fn):
    """(CPU seconds of this process, fn's result)."""
    start = time.process_time()
    result = fn()
    return time.process_time() - start, result


def with_effects(attributed, grid: torch.Tensor, senders, base_value: float):
    """``edge_attribution``'s rows with the exact ``effect`` of each edge beside them: its value in
    ``grid`` ([n_senders, n_layers, n_heads], as ``path_grid`` lays it out) minus ``base_value``."""
    index = {sender: i for i, sender in enumerate(senders)}
    rows = [index[s] for s in zip(attributed.sender_layer, attributed.sender_head)]
    values = grid[rows, attributed.receiver_layer.tolist(), attributed.receiver_head.tolist()]
    return attributed.assign(effect=(values - base_value).numpy())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, default=384)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--via", choices=("q", "k", "v"), default="q")
    parser.add_argument("--sender-stride", type=int, default=1)
    parser.add_argument("--vocab", type=int, default=2048, help="vocabulary size (GPT-2's is 50257)")
    parser.add_argument("--bridge", action="store_true", help="also time ours on the bridge")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    hf, tokenizer = make_random_gpt2(n_layers=12, d_model=args.d_model, n_heads=12, n_ctx=64, d_vocab=args.vocab, seed=0)
    scratch = from_hf(hf.eval(), tokenizer).eval()
    bridge = boot_bridge(hf, tokenizer).eval()
    n_layers, n_heads = scratch.cfg.n_layers, scratch.cfg.n_heads
    senders = list(product(range(n_layers - 1), range(n_heads)))[::args.sender_stride]
    n_pairs = sum((n_layers - 1 - layer) * n_heads for layer, _ in senders)
    print(f"GPT-2 shape, 12 layers x 12 heads, d_model {args.d_model}, vocabulary {args.vocab}, random weights; "
          f"{args.prompts} x "
          f"{args.seq_len} tokens; via {args.via}; {len(senders)} senders, {n_pairs} pairs; torch threads "
          f"{torch.get_num_threads()}; {load_note()}")
    clean, corrupted, metric = induction_pair(scratch, args.prompts, args.seq_len)
    forward = {"scratch": forward_seconds(scratch, corrupted), "bridge": forward_seconds(bridge, corrupted)}
    print(f"plain forward (CPU): GPTModel {forward['scratch'] * 1e3:.1f} ms, bridge {forward['bridge'] * 1e3:.1f} ms")

    def ours(model):
        frame = path_patch(model, clean, corrupted, metric, senders=senders, via=args.via, progress=False)
        return path_grid(frame, senders, n_layers, n_heads)

    runs = {
        "TL direct path on bridge": ("bridge", lambda: tl_direct_path_sweep(bridge, clean, corrupted, metric, senders,
                                                                              args.via)),
        "ours on GPTModel": ("scratch", lambda: ours(scratch)),
    }
    if args.bridge:
        runs["ours on bridge"] = ("bridge", lambda: ours(bridge))
    seconds, results = {}, {}
    for name, (model, run) in runs.items():
        seconds[name], results[name] = cpu_seconds(run)
    reference = results["TL direct path on bridge"]
    print(f"\nexact path patching, {n_pairs} pairs")
    print(f"{'method':<28}{'CPU s':>8}{'fwd-eq/pair':>13}{'max |diff| vs TL':>18}")
    for name, (model, _) in runs.items():
        diff = (results[name] - reference).abs().max().item()
        print(f"{name:<28}{seconds[name]:>8.1f}{seconds[name] / forward[model] / n_pairs:>13.3f}{diff:>18.2e}")
    tl = seconds["TL direct path on bridge"]
    for name in runs:
        if name.startswith("ours"):
            print(f"speed-up, {name} vs TL direct path on bridge: {tl / seconds[name]:.2f}x")

    attributed = edge_attribution(scratch, clean, corrupted, metric, senders=senders, via=args.via)
    with torch.no_grad():
        base_value = metric(scratch(corrupted)).item()
    agreement = edge_agreement(with_effects(attributed, results["ours on GPTModel"], senders, base_value))
    print(f"\nedge attribution on GPTModel, agreement with exact path patching on these {n_pairs} pairs "
          "(random weights): " + ", ".join(f"{k} {v:.3f}" for k, v in agreement.items()))
    print("edge attribution cost (3 passes: clean forward to the last sender's layer, corrupted forward + "
          "backward), every sender; CPU seconds (median of 7), in forwards of the same batch:")
    for n_prompts, seq_len, vias in [(args.prompts, args.seq_len, args.via), (args.prompts, args.seq_len, VIAS),
                                     (8, 64, args.via)]:
        print("  " + attribution_cost(scratch, n_prompts, seq_len, vias))


def attribution_cost(model, n_prompts: int, seq_len: int, via) -> str:
    """One line: EAP of every edge through ``via`` on ``n_prompts`` x ``seq_len`` induction prompts,
    its CPU seconds and forward-equivalents."""
    clean, corrupted, metric = induction_pair(model, n_prompts, seq_len)
    def forward():
        with torch.no_grad():
            model(corrupted)

    candidates = {"forward": forward, "eap": lambda: edge_attribution(model, clean, corrupted, metric, via=via)}
    samples = time_interleaved(candidates, 7, mode=contextlib.nullcontext)
    eap = samples["eap"]
    vias = via if isinstance(via, str) else "+".join(via)
    return (f"{n_prompts} x {seq_len} tokens, via {vias}, {len(eap.result):,} edges: {eap.median('cpu'):.3f} s = "
            f"{eap.paired(samples['forward'], 'cpu'):.2f} forward-equivalents (median over rounds of EAP / the "
            "forward in the same round)")


if __name__ == "__main__":
    main()
