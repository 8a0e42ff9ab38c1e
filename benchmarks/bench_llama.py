"""Our from-scratch GPTModel on a Llama shape against its peers over the same weights: Hugging Face
(eager and SDPA attention), TransformerLens's bridge and TransformerLens's own tools.

Shape (``common.LLAMA_GQA``): 8 layers, d_model 512, 8 query heads sharing 2 key/value heads (d_head
64), SwiGLU MLP 1408, rotary positions, RMSNorm; vocabulary 2048, context 128; random weights and
Llama's byte-level tokenizer (``interp.random_models``). Every ratio is against the peer measured in
this run, candidates interleaved round-robin; tables give the min and the median of the rounds.

- forward: ``GPTModel`` without hooks against ``LlamaForCausalLM`` with eager and with SDPA
  attention, logits compared;
- cache: a full ``run_with_cache`` (and patterns only) against our own forward, the bridge's full
  cache against its forward beside it;
- classify: ``classify_heads`` and ``detect_heads`` on GPTModel, and ``classify_heads`` on the
  bridge, against TransformerLens's ``detect_head`` (3 roles) on the bridge, same number of prompts
  of the same token length, and against one plain batched forward (the floor); ``detect_heads``'
  values against ``detect_head``'s;
- patching: exact head patching, ``patch_heads`` on GPTModel (suffix-only reruns, batched) against
  ``get_act_patch_attn_head_out_all_pos`` on the bridge, values compared (they must agree to 1e-4),
  at a small batch (the induction pair, 2 prompts x 24 tokens) and a realistic one (8 x 64); CPU
  seconds, the clean/corrupted caching runs included. At the small batch also TL's sweep driving
  GPTModel and ``patch_heads`` on the bridge (batched full forwards). The "multiply-add model" says
  what suffix-only reruns can save over one forward per head if time were proportional to
  multiply-adds: ours = 2 full forwards + per head the blocks from its layer on and the
  unembedding; TL = 1 cached forward + one full forward per head.

Everything runs on one thread by default (``--threads``): on this project's 2-core machine, shared
with other work, two threads measure the neighbours rather than the work. Whenever another process
ran, each parallel region waited for the descheduled thread, and a forward that takes 135 ms on two
idle cores took 2.5-3.4 s, with CPU time equal to wall time (one thread spinning). On one thread
the same forward took 255-280 ms of CPU time with the neighbours running.

Defaults take about 5 minutes on 2 shared cores (more when the machine is slowed); ``--repeats``,
``--budget``, ``--classify-repeats`` and ``--patch-repeats`` scale it. Ratios: "paired" is the
median over rounds of the two times of one round (the steadiest where the machine's speed changes
between rounds), beside the ratios of the medians and of the minima.

    .venv/bin/python benchmarks/bench_llama.py [--only forward|cache|classify|patching ...]
        [--batch 4] [--pos 128] [--repeats 7] [--budget 20] [--threads N] [--classify-repeats 3] [--patch-repeats 3]
        [--patch-shapes 2x24,8x64] [--all-patch-rows]
"""

from __future__ import annotations

import argparse
import contextlib
import copy

import torch
from transformer_lens.head_detector import HEAD_NAMES, detect_head

from analyses.roles.classify import classify_heads
from analyses.interventions.patching import patch_heads
from analyses.core.probes import probes_for
from analyses.roles.tl_compat import detect_heads
from common import (forward_seconds, induction_pair, llama_peers, load_note, print_table, repeated_texts, speedup,
                    time_interleaved, tl_sweep)

SECTIONS = ("forward", "cache", "classify", "patching")
TOLERANCE = 1e-4  # the bar for exact patching against TransformerLens


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().float().cpu() - b.detach().float().cpu()).abs().max())


def forward(hf, ours, tokens: torch.Tensor, repeats: int, budget_s: float) -> None:
    sdpa = copy.deepcopy(hf)
    sdpa.set_attn_implementation("sdpa")
    with torch.inference_mode():
        reference = hf(tokens).logits
        diffs = {"HF sdpa": max_diff(sdpa(tokens).logits, reference), "GPTModel": max_diff(ours(tokens), reference)}
    samples = time_interleaved({
        "HF eager LlamaForCausalLM forward": lambda: hf(tokens),
        "HF sdpa LlamaForCausalLM forward": lambda: sdpa(tokens),
        "GPTModel forward (no hooks, SDPA fast path)": lambda: ours(tokens),
    }, repeats, budget_s=budget_s)
    for clock in ("wall", "cpu"):
        print_table("Forward without hooks", samples, "HF eager LlamaForCausalLM forward", clock)
    for peer in ("HF eager", "HF sdpa"):
        print(f"  GPTModel faster than {peer} by {speedup(samples, f'{peer} LlamaForCausalLM forward', 'GPTModel forward (no hooks, SDPA fast path)')}")
    print("  logits, max abs diff vs HF eager: " + ", ".join(f"{k} {v:.1e}" for k, v in diffs.items()))


def cache(ours, bridge, tokens: torch.Tensor, repeats: int, budget_s: float) -> None:
    patterns_only = lambda name: name.endswith("hook_pattern")  # noqa: E731
    samples = time_interleaved({
        "GPTModel forward": lambda: ours(tokens),
        "GPTModel run_with_cache (everything)": lambda: ours.run_with_cache(tokens),
        "GPTModel run_with_cache (patterns only)": lambda: ours.run_with_cache(tokens, names_filter=patterns_only),
        "TransformerBridge forward": lambda: bridge(tokens),
        "TransformerBridge run_with_cache (everything)": lambda: bridge.run_with_cache(tokens),
    }, repeats, budget_s=budget_s)
    mine = {k: v for k, v in samples.items() if k.startswith("GPTModel")}
    print_table("GPTModel caching", mine, "GPTModel forward")
    print_table("Bridge caching (the peer, same rounds)", {k: v for k, v in samples.items() if k.startswith("Transformer")},
                "TransformerBridge forward")
    print(f"  GPTModel full cache faster than the bridge's full cache by "
          f"{speedup(samples, 'TransformerBridge run_with_cache (everything)', 'GPTModel run_with_cache (everything)')}")


def classification(ours, bridge, n_prompts: int, pos: int, repeats: int) -> None:
    tokens = probes_for(ours, n_prompts, seq_len=pos, seed=0).tokens
    texts = repeated_texts(ours, n_prompts, pos)
    assert torch.equal(ours.to_tokens(texts), bridge.to_tokens(texts))
    with torch.no_grad():  # the values: ours on GPTModel must equal TransformerLens's on the bridge
        mine = detect_heads(ours, texts, progress=False)
        # (detect_head cannot drive GPTModel: it reads cfg.dtype, which GPTConfig lacks)
        diffs = {f"{name} vs detect_head on the bridge": max_diff(mine[name], detect_head(bridge, texts, name))
                 for name in HEAD_NAMES}
        scores = [classify_heads(model, n_prompts, pos, progress=False) for model in (ours, bridge)]
    floor, peer = "one plain batched forward of GPTModel (floor)", "detect_head x 3 roles on the bridge (TransformerLens)"
    samples = time_interleaved({
        floor: lambda: ours(tokens),
        "classify_heads on GPTModel (7 measures, bootstrap CIs)": lambda: classify_heads(ours, n_prompts, pos, progress=False),
        "detect_heads on GPTModel (TL-compatible, 3 roles)": lambda: detect_heads(ours, texts, progress=False),
        "classify_heads on the bridge (7 measures, CIs)": lambda: classify_heads(bridge, n_prompts, pos, progress=False),
        peer: lambda: [detect_head(bridge, texts, name) for name in HEAD_NAMES],
    }, repeats, warmup=0)  # the values above were the warm-up
    print(f"\nprompts={n_prompts} pos={pos} threads={torch.get_num_threads()}")
    for clock in ("wall", "cpu"):
        print_table("Head classification", samples, floor, clock)
        for name in list(samples)[1:4]:
            print(f"  {name} faster than detect_head by {speedup(samples, peer, name, clock)}")
    print("\nvalues, max abs diff of detect_heads on GPTModel (same texts):")
    for name, diff in diffs.items():
        print(f"  {name:<58} {diff:.1e}")
    score_diff = max_diff(*(torch.tensor(s["score"].to_numpy()) for s in scores))
    print(f"  classify_heads scores, GPTModel vs bridge (all measures, {len(scores[0])} rows)    {score_diff:.1e}")


def multiply_adds_ceiling(cfg, pos: int) -> tuple[float, float, float]:
    """If time were proportional to multiply-adds per token: (a suffix rerun's mean cost as a
    fraction of one forward, ours in forward-equivalents per head, the ceiling on TL's sweep / ours)."""
    kv_heads = cfg.n_key_value_heads or cfg.n_heads
    attention = cfg.d_model * cfg.d_head * 2 * (cfg.n_heads + kv_heads) + pos * cfg.n_heads * cfg.d_head  # causal: ~pos/2 keys x 2
    mlp = cfg.d_model * cfg.d_mlp * (3 if cfg.gated_mlp else 2)
    block, unembed = attention + mlp, cfg.d_model * cfg.d_vocab
    full = cfg.n_layers * block + unembed
    suffix = sum((cfg.n_layers - layer) * block + unembed for layer in range(cfg.n_layers)) / cfg.n_layers / full
    n = cfg.n_layers * cfg.n_heads
    return suffix, (2 + n * suffix) / n, (1 + n) / (2 + n * suffix)


def patching(ours, bridge, n_prompts: int, seq_len: int, repeats: int, all_rows: bool) -> None:
    clean, corrupted, metric = induction_pair(ours, n_prompts, seq_len)
    assert torch.equal(clean, induction_pair(bridge, n_prompts, seq_len)[0])
    n_heads = ours.cfg.n_layers * ours.cfg.n_heads
    before = {"GPTModel": forward_seconds(ours, corrupted), "bridge": forward_seconds(bridge, corrupted)}
    reference, fast = "TL sweep on the bridge", "patch_heads on GPTModel"
    candidates = {
        reference: lambda: tl_sweep(bridge, clean, corrupted, metric),
        fast: lambda: patch_heads(ours, clean, corrupted, metric, progress=False),
    }
    if all_rows:
        candidates |= {
            "TL sweep driving GPTModel": lambda: tl_sweep(ours, clean, corrupted, metric),
            "patch_heads on the bridge": lambda: patch_heads(bridge, clean, corrupted, metric, progress=False),
        }
    samples = time_interleaved(candidates, repeats, warmup=0, mode=contextlib.nullcontext)
    # the forward again after the sweeps, so load drift during them is averaged in
    fwd = {"GPTModel": (before["GPTModel"] + forward_seconds(ours, corrupted)) / 2,
           "bridge": (before["bridge"] + forward_seconds(bridge, corrupted)) / 2}
    print(f"\nexact head patching, {n_prompts} prompts x {seq_len} tokens, {n_heads} heads [n_layers, n_heads], "
          f"threads={torch.get_num_threads()}, {repeats} interleaved rounds; plain forward (CPU, mean of before and "
          f"after): GPTModel {fwd['GPTModel'] * 1e3:.0f} ms, bridge {fwd['bridge'] * 1e3:.0f} ms")
    print(f"  {'method':<28}{'CPU s min':>10}{'median':>8}{'wall s':>8}{'fwd-eq/head':>12}{'max |diff| vs TL':>18}")
    truth = samples[reference].result
    for name, s in samples.items():
        model = "bridge" if name.endswith("bridge") else "GPTModel"
        diff = max_diff(s.result, truth)
        flag = "" if diff <= TOLERANCE else f"  EXCEEDS {TOLERANCE:g}"
        print(f"  {name:<28}{s.min('cpu'):>10.2f}{s.median('cpu'):>8.2f}{s.median('wall'):>8.2f}"
              f"{s.median('cpu') / fwd[model] / n_heads:>12.3f}{diff:>18.1e}{flag}")
    print(f"  speed-up, patch_heads on GPTModel vs TL sweep on the bridge: {speedup(samples, reference, fast, 'cpu')} CPU, "
          f"{speedup(samples, reference, fast, 'wall')} wall")
    if all_rows:
        print(f"  speed-up, patch_heads on GPTModel vs TL sweep driving GPTModel: "
              f"{speedup(samples, 'TL sweep driving GPTModel', fast, 'cpu')} CPU")
        print(f"  speed-up, patch_heads on the bridge vs TL sweep on the bridge: "
              f"{speedup(samples, reference, 'patch_heads on the bridge', 'cpu')} CPU")
    suffix, per_head, ceiling = multiply_adds_ceiling(ours.cfg, seq_len)
    print(f"  multiply-add model: a suffix rerun costs {suffix:.2f} of a forward on average, so patch_heads on GPTModel "
          f"costs {per_head:.3f} forward-equivalents per head (2 full runs included) and beats a sweep of one forward "
          f"per head (+1 cached) by at most {ceiling:.2f}x once time follows multiply-adds")


def main():
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--only", nargs="+", choices=SECTIONS, default=SECTIONS, help="sections to run (default all)")
    parser.add_argument("--batch", type=int, default=4, help="forward/cache batch (default 4)")
    parser.add_argument("--pos", type=int, default=128, help="forward/cache tokens per prompt (default 128)")
    parser.add_argument("--repeats", type=int, default=7, help="forward/cache: at least this many rounds (default 7)")
    parser.add_argument("--budget", type=float, default=20.0,
                        help="forward/cache: more rounds (up to 50) while a table's rounds took under this many seconds (default 20)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1; see the docstring)")
    parser.add_argument("--prompts", type=int, default=8, help="classification prompts (default 8)")
    parser.add_argument("--classify-pos", type=int, default=64, help="classification prompt tokens (default 64)")
    parser.add_argument("--classify-repeats", type=int, default=3, help="classification rounds (default 3)")
    parser.add_argument("--patch-shapes", default="2x24,8x64", help="patching PROMPTSxTOKENS list (default 2x24,8x64)")
    parser.add_argument("--patch-repeats", type=int, default=3, help="patching rounds (default 3)")
    parser.add_argument("--all-patch-rows", action="store_true",
                        help="TL's sweep driving GPTModel and patch_heads on the bridge at every patching shape, "
                             "not only the first")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    hf, ours, bridge = llama_peers()
    cfg = ours.cfg
    print(f"Llama shape, random weights: {cfg.n_layers} layers, d_model {cfg.d_model}, {cfg.n_heads} query heads / "
          f"{cfg.n_key_value_heads} key-value heads (d_head {cfg.d_head}), MLP {cfg.d_mlp}, vocabulary {cfg.d_vocab}, "
          f"context {cfg.n_ctx}; torch {torch.__version__}, {torch.get_num_threads()} threads; {load_note()}")
    if "forward" in args.only or "cache" in args.only:
        tokens = torch.randint(0, cfg.d_vocab, (args.batch, args.pos), generator=torch.Generator().manual_seed(0))
        print(f"\nbatch={args.batch} pos={args.pos} threads={torch.get_num_threads()}")
        if "forward" in args.only:
            forward(hf, ours, tokens, args.repeats, args.budget)
        if "cache" in args.only:
            cache(ours, bridge, tokens, args.repeats, args.budget)
        print(f"  ({load_note()})")
    if "classify" in args.only:
        classification(ours, bridge, args.prompts, args.classify_pos, args.classify_repeats)
        print(f"  ({load_note()})")
    if "patching" in args.only:
        for i, shape in enumerate(args.patch_shapes.split(",")):
            n_prompts, seq_len = (int(x) for x in shape.split("x"))
            patching(ours, bridge, n_prompts, seq_len, args.patch_repeats, all_rows=args.all_patch_rows or i == 0)
            print(f"  ({load_note()})")


if __name__ == "__main__":
    main()
