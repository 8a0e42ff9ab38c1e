"""Composition scores (Elhage et al. 2021) of every (earlier head, later head) pair of a random
GPT-2-small-shaped model (12 layers x 12 heads, d_model 768; vocabulary 2048, which composition
scores never read): ``analyses.composition_scores``' tensor on our GPTModel and on the bridge, against
TransformerLens's ``all_composition_scores`` on the bridge over the same weights, each kind timed
in interleaved rounds on one thread; the largest difference from TransformerLens is printed.

    python benchmarks/bench_composition.py [--repeats 3]
"""

from __future__ import annotations

import argparse

import torch

from analyses.circuits.composition import score_tensor
from common import gpt2_small_peers, load_note, speedup, time_interleaved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    _, ours, bridge = gpt2_small_peers()
    print(f"composition scores, GPT-2-small shape (12 x 12 heads, d_model 768), random weights, 1 thread; {load_note()}")
    for kind in "QKV":
        samples = time_interleaved({
            "TL all_composition_scores (bridge)": lambda: bridge.all_composition_scores(kind).scores.detach(),
            "composition_scores (GPTModel)": lambda: score_tensor(ours, kind.lower()),
            "composition_scores (bridge)": lambda: score_tensor(bridge, kind.lower()),
        }, repeats=args.repeats, warmup=0)
        reference = samples["TL all_composition_scores (bridge)"].result
        for name in ("composition_scores (GPTModel)", "composition_scores (bridge)"):
            diff = (samples[name].result - reference).abs().max().item()
            print(f"  {kind}: {name:<30} {samples[name].median():6.2f} s, TL {samples['TL all_composition_scores (bridge)'].median():6.2f} s: "
                  f"{speedup(samples, 'TL all_composition_scores (bridge)', name)}; max |diff| {diff:.1e}")


if __name__ == "__main__":
    main()
