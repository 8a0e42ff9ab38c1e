"""Exact head patching against TransformerLens's sweep, and attribution against exact patching.

GPT-2-small shape (12 layers, d_model 768, 12 heads; vocabulary 2048; random weights) on the
induction pair (repeated segments vs first copy replaced). TransformerLens's
``get_act_patch_attn_head_out_all_pos`` runs one full forward per head; ours batches the patches
and, on ``GPTModel``, runs only the blocks from the patched layer on. Every ratio is measured in
this run, candidates interleaved round-robin. Times are CPU seconds of this process on one
thread (``time.process_time``): on a shared machine wall time mostly measures the neighbours,
CPU time the work (wall seconds are printed too). Timings include the clean/corrupted caching
runs each method needs. Forward-equivalents = time / one plain forward of the same batch on the
same model.

    .venv/bin/python benchmarks/bench_patching.py [--prompts 2] [--seq-len 24] [--repeats 1]
"""

from __future__ import annotations

import argparse
import contextlib

import torch

from analyses.interventions.attribution import attribution_agreement, attribution_patch_heads, unpatched_value
from analyses.interventions.patching import patch_heads
from common import Samples, forward_seconds, induction_pair, load_note, time_interleaved, tl_sweep
from interp import from_hf, load_model
from interp.bridge import boot_bridge
from interp.random_models import make_random_gpt2
from interp.loading import toy_checkpoint_dir


def interleaved(candidates: dict, repeats: int) -> dict[str, Samples]:
    """Round-robin, no warm-up round (each candidate is seconds long); CPU medians are the figures."""
    return time_interleaved(candidates, repeats, warmup=0, mode=contextlib.nullcontext)


def exact_vs_transformer_lens(scratch, bridge, args):
    clean, corrupted, metric = induction_pair(scratch, args.prompts, args.seq_len)
    n_heads = scratch.cfg.n_layers * scratch.cfg.n_heads
    forward = {"scratch": forward_seconds(scratch, corrupted), "bridge": forward_seconds(bridge, corrupted)}
    print(f"plain forward ({args.prompts} x {args.seq_len} tokens, CPU time): GPTModel {forward['scratch'] * 1e3:.0f} ms, "
          f"bridge {forward['bridge'] * 1e3:.0f} ms")
    samples = interleaved({
        "TL sweep on bridge": lambda: tl_sweep(bridge, clean, corrupted, metric),
        "TL sweep on GPTModel": lambda: tl_sweep(scratch, clean, corrupted, metric),
        "ours on GPTModel": lambda: patch_heads(scratch, clean, corrupted, metric, progress=False),
        "ours on bridge": lambda: patch_heads(bridge, clean, corrupted, metric, progress=False),
    }, args.repeats)
    seconds = {name: s.median("cpu") for name, s in samples.items()}
    wall = {name: s.median("wall") for name, s in samples.items()}
    results = {name: s.result for name, s in samples.items()}
    # the forward measured again after the sweeps, so load drift during them is averaged in
    forward = {name: (secs + forward_seconds(m, corrupted)) / 2
               for (name, secs), m in zip(forward.items(), (scratch, bridge))}
    print(f"plain forward, mean of before and after: GPTModel {forward['scratch'] * 1e3:.0f} ms, "
          f"bridge {forward['bridge'] * 1e3:.0f} ms")
    reference = results["TL sweep on bridge"].cpu()
    print(f"\nexact head patching, {n_heads} heads (median of {args.repeats}, interleaved)")
    print(f"{'method':<24}{'CPU s':>8}{'wall s':>8}{'fwd-eq/head':>13}{'max |diff| vs TL':>18}")
    for name, secs in seconds.items():
        model = "bridge" if "bridge" in name else "scratch"
        diff = (results[name].cpu() - reference).abs().max().item()
        print(f"{name:<24}{secs:>8.2f}{wall[name]:>8.2f}{secs / forward[model] / n_heads:>13.3f}{diff:>18.2e}")
    print(f"speed-up, ours on GPTModel vs TL sweep on GPTModel: {seconds['TL sweep on GPTModel'] / seconds['ours on GPTModel']:.2f}x")
    print(f"speed-up, ours on GPTModel vs TL sweep on bridge:   {seconds['TL sweep on bridge'] / seconds['ours on GPTModel']:.2f}x")
    print(f"speed-up, ours on bridge vs TL sweep on bridge:     {seconds['TL sweep on bridge'] / seconds['ours on bridge']:.2f}x")
    return (clean, corrupted, metric), results["ours on GPTModel"], forward["scratch"], seconds["ours on GPTModel"]


def attribution_vs_exact(label, model, clean, corrupted, metric, exact, forward, exact_seconds, repeats):
    attribute = lambda: attribution_patch_heads(model, clean, corrupted, metric)  # noqa: E731
    attribute()  # warm-up: autograd's first call pays one-time costs
    samples = interleaved({"attribution": attribute}, max(3, repeats))["attribution"]
    agreement = attribution_agreement(samples.result, exact, baseline=unpatched_value(model, clean, corrupted, metric))
    secs = samples.median("cpu")
    print(f"\nattribution vs exact on {label}: attribution {secs:.2f} s = {secs / forward:.2f} forward-equivalents, "
          f"exact {exact_seconds:.2f} s -> {exact_seconds / secs:.1f}x faster")
    print("agreement with exact: " + ", ".join(f"{k} {v:.3f}" for k, v in agreement.items()))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    hf, tokenizer = make_random_gpt2(n_layers=12, d_model=768, n_heads=12, n_ctx=64, d_vocab=2048, seed=0)
    scratch = from_hf(hf.eval(), tokenizer).eval()  # its cfg.device is what TL reads
    bridge = boot_bridge(hf, tokenizer).eval()
    print(f"GPT-2-small shape, random weights; torch threads {torch.get_num_threads()}; {load_note()}")
    pair, exact, forward, exact_seconds = exact_vs_transformer_lens(scratch, bridge, args)
    attribution_vs_exact("GPT-2-small shape (GPTModel)", scratch, *pair, exact, forward, exact_seconds, args.repeats)

    if (toy_checkpoint_dir() / "model.safetensors").is_file():
        toy = load_model("toy").eval()
        clean, corrupted, metric = induction_pair(toy, 16, min(64, toy.cfg.n_ctx))
        exact = interleaved({"exact": lambda: patch_heads(toy, clean, corrupted, metric, progress=False)}, args.repeats)["exact"]
        attribution_vs_exact("the embedded toy model", toy, clean, corrupted, metric, exact.result,
                             forward_seconds(toy, corrupted), exact.median("cpu"), args.repeats)
    else:
        print("\n(the embedded toy model is not installed: its attribution comparison is skipped)")


if __name__ == "__main__":
    main()
