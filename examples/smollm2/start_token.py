"""SmolLM2's head roles with and without the start token (issue 44.6; docs/guides/smollm2.md, "The
input format").

SmolLM2's GGUF file says ``tokenizer.ggml.add_bos_token = False``: llama.cpp and Hugging Face hand
the model its text with no ``<|im_start|>`` (its BOS, id 1) in front, and that is what
``load_model("smollm2")`` now does. This script scores every head's roles (``classify_heads``, the
same 16 probes of 64 tokens, seed 0, as the other SmolLM2 scripts) both ways: the model's own
format (no start token) and with the start token prepended, as interp did before. For each role it
prints the Spearman rank correlation of the 270 heads' scores between the two, and the top 5 heads
each way.

    OMP_NUM_THREADS=2 nice python examples/smollm2/start_token.py
"""

from __future__ import annotations

import pandas as pd

from analyses import classify_heads
from analyses.roles.classify import ROLES
from interp.tokenizer import set_start_token, start_token_setting
from setup_smollm2 import N_PROMPTS, SEQ_LEN, head_name, load, probes

TOP = 5


def scores(model, prepend: bool) -> pd.DataFrame:
    """(layer, head) x role: the role scores on the probes with or without the start token."""
    set_start_token(model, prepend, "command line")
    frame = classify_heads(model, probes=probes(model), n_boot=100, progress=False)
    return frame[frame.measure.isin(ROLES)].pivot_table(index=["layer", "head"], columns="measure", values="score")


def main() -> None:
    model = load()
    own = start_token_setting(model)
    print(f"SmolLM2 as loaded: prepend_bos={own[0]} (source: {own[1]}); {N_PROMPTS} probes of {SEQ_LEN} tokens")
    without, with_bos = scores(model, False), scores(model, True)
    print(f"{'role':16} {'Spearman':>8}  top {TOP} without start token | top {TOP} with it")
    for role in ROLES:
        rho = without[role].corr(with_bos[role], method="spearman")
        tops = [", ".join(f"{head_name(l, h)} {s:.2f}" for (l, h), s in frame[role].nlargest(TOP).items())
                for frame in (without, with_bos)]
        print(f"{role:16} {rho:8.3f}  {tops[0]} | {tops[1]}")


if __name__ == "__main__":
    main()
