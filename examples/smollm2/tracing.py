"""Causal tracing of factual recall on SmolLM2 at Meng et al.'s (2022) scale, with ``analyses.trace_facts``.

The shipped fact set (``analyses.tasks.facts``: capitals, languages, currencies, continents, the
countries of cities and companies, landmarks, founders, authors; 595 facts) is kept to the facts
SmolLM2 answers top-1; each is traced with 10 noise draws of 3 x the standard deviation of the subject
tokens' embeddings, restoring one hidden state, a 10-layer window of MLP or attention outputs, or one
layer's, at one token at a time, grouped into the position classes (first / middle / last subject
token, first subsequent token, further tokens, last token). Prints the average indirect effects of
the subject tokens' MLP windows with their 95% intervals, the verdict, the one-layer MLP restores and
the per-relation lines; writes docs/smollm2_trace.png (Meng et al.'s panels). The same as

    interp trace --model smollm2 --facts builtin --out smollm2-trace

    python examples/smollm2/tracing.py [EVERY]   # trace every EVERY-th fact kept (default 1: all of them)

``python examples/smollm2/tracing.py 2`` traces 104 of the 207 (82 CPU minutes on one thread, 113 of
wall clock on a shared 2-core machine): the numbers in docs/guides/smollm2.md.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from analyses.tasks.facts import builtin_facts, top1_facts
from analyses.tasks.tracing import (facts_figure, mlp_curve, relation_lines, single_layer_text, trace_facts,
                                    trace_verdict)
from setup_smollm2 import load

FIGURE = Path(__file__).resolve().parents[2] / "docs" / "smollm2_trace.png"


def main() -> None:
    model = load()
    facts = builtin_facts()
    kept, _ = top1_facts(model, facts)
    traced = kept[:: int(sys.argv[1]) if len(sys.argv) > 1 else 1]
    print(f"{len(kept)} of {len(facts)} facts answered top-1 by SmolLM2; tracing {len(traced)}")
    began = time.monotonic()
    trace = trace_facts(model, traced)
    print(f"traced in {time.monotonic() - began:.0f} s; noise std {trace.noise_std:.4f}")
    effect, low, high = trace.total_effect()
    print(f"total effect (clean - noised p(answer)): {effect:.4f} [{low:.4f}, {high:.4f}]")
    for name in ("first subject token", "middle subject tokens", "last subject token", "last token"):
        line = mlp_curve(trace.aie, name, trace.window).set_index("layer")
        if len(line):
            best = line["aie"].idxmax()
            print(f"  MLP window at the {name}: peak layer {best}, AIE {line.loc[best, 'aie']:.4f} "
                  f"[{line.loc[best, 'ci_low']:.4f}, {line.loc[best, 'ci_high']:.4f}] (n = {line.loc[best, 'n_prompts']})")
    verdict = trace_verdict(trace)
    print(verdict.text)
    print(single_layer_text(trace))
    print("\n".join(relation_lines(trace)))
    facts_figure(trace, verdict).savefig(FIGURE, dpi=80, bbox_inches="tight")
    print(f"wrote {FIGURE.relative_to(FIGURE.parents[1])}")


if __name__ == "__main__":
    main()
