"""Causal tracing of factual recall on SmolLM2 (Meng et al. 2022), with ``analyses.causal_trace``.

The subject's token embeddings get Gaussian noise (3 x the embedding's standard deviation, 3
draws); then one clean state -- a layer's residual output, its MLP output or its attention
output, at one position -- is restored, and the answer's probability at the last token measured.
Prompts are kept only where SmolLM2's top next token is the expected answer. Writes
docs/smollm2_trace.png (the Eiffel Tower trace).

    python examples/smollm2/tracing.py
"""

from __future__ import annotations

from pathlib import Path

import torch

from analyses import causal_trace, trace_figure
from analyses.core.tokens import encode, model_tokenizer
from setup_smollm2 import load

FACTS = (  # prompt, subject, expected answer
    ("The Eiffel Tower is in", "The Eiffel Tower", " Paris"),
    ("The Colosseum is located in the city of", "The Colosseum", " Rome"),
    ("The capital of Japan is", "Japan", " Tokyo"),
)
SAMPLES = 3
FIGURE = Path(__file__).resolve().parents[2] / "docs" / "smollm2_trace.png"


def top_token(model, prompt: str) -> str:
    with torch.no_grad():
        logits = model(encode(model, prompt).tokens)
    return model_tokenizer(model).decode([int(logits[0, -1].argmax())])


def summary(trace) -> None:
    last_subject, last = trace.subject[-1], len(trace.tokens) - 1
    print(f"  p(answer): clean {trace.clean_prob:.3f}, subject noised {trace.corrupted_prob:.3f}")
    for kind in trace.kinds:
        grid = trace.grid(kind)  # (layer, pos)
        layer, pos = divmod(int(grid.argmax()), grid.shape[1])
        at_subject, at_last = grid[:, last_subject], grid[:, last]
        print(f"  {kind:5s} best restore: layer {layer} at {trace.tokens[pos]!r} (pos {pos}) -> {grid.max():.3f}; "
              f"at the subject's last token {trace.tokens[last_subject]!r}: best layer {int(at_subject.argmax())} "
              f"-> {at_subject.max():.3f}; at the last token: best layer {int(at_last.argmax())} -> {at_last.max():.3f}")


def main() -> None:
    model = load()
    first = None
    for prompt, subject, answer in FACTS:
        said = top_token(model, prompt)
        if said != answer:
            print(f"{prompt!r}: SmolLM2 says {said!r}, not {answer!r}; not traced")
            continue
        print(f"{prompt!r} -> {answer!r} (SmolLM2's top token); subject {subject!r}")
        trace = causal_trace(model, prompt, subject, answer, samples=SAMPLES, progress=False)
        summary(trace)
        first = first or trace
    if first is not None:
        trace_figure(first).savefig(FIGURE, dpi=80, bbox_inches="tight")
        print(f"wrote {FIGURE.relative_to(FIGURE.parents[1])}")


if __name__ == "__main__":
    main()
