"""Where mixed precision's split comes from (issue 45.1): one forward of ``--prompts`` probes in
float32 against variants, each printed with its time and error (per-token loss, argmax agreement):

- ``mixed``: ``GPTModel.set_precision("mixed")`` as shipped (``interp.precision``);
- ``mixed + unembedding``: also the unembedding's product in bfloat16;
- ``mixed + attention``: also ``scaled_dot_product_attention`` on bfloat16 queries, keys and values;
- ``bfloat16 model``: the whole model cast to bfloat16 (``load_model(dtype="bfloat16")``'s forward);
- ``weights rounded`` / ``inputs rounded`` / ``results rounded``: float32 products with only that
  operand of the linear maps rounded to bfloat16, to split the linear maps' own error.

The variants other than ``mixed`` patch the model's functions inside this script only.

    OMP_NUM_THREADS=1 nice python benchmarks/bench_precision_split.py --model smollm2 --threads 1
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch
import torch.nn.functional as F

import interp.attention
from analyses.core.probes import probes_for
from interp.loading import load_model
from interp.model import GPTModel
from interp.precision import LOW, Linear


SDPA = F.scaled_dot_product_attention  # the original, for the variant that patches it


def rounded(x: torch.Tensor) -> torch.Tensor:
    return x.to(LOW).to(x.dtype)


@contextlib.contextmanager
def patched(owner, name: str, replacement):
    original = getattr(owner, name)
    setattr(owner, name, replacement)
    try:
        yield
    finally:
        setattr(owner, name, original)


def low_unembed(model: GPTModel, resid: torch.Tensor) -> torch.Tensor:
    """``GPTModel.unembed`` (no soft cap) with its product in bfloat16."""
    weight = model.embed.weight if model.cfg.tie_word_embeddings else model.lm_head.weight
    return F.linear(model.ln_final(resid).to(LOW), weight.to(LOW)).float()


def low_attention(query, key, value, **options):
    return SDPA(query.to(LOW), key.to(LOW), value.to(LOW), **options).to(query.dtype)


def linear_with(round_weight=False, round_input=False, round_result=False):
    """A float32 ``Linear.forward`` with the chosen operands rounded to bfloat16."""
    def forward(self, x):
        out = F.linear(rounded(x) if round_input else x, rounded(self.weight) if round_weight else self.weight)
        out = rounded(out) if round_result else out
        return out if self.bias is None else out + self.bias
    return forward


def variants(model: GPTModel) -> dict:
    """name -> a context manager that sets the variant up (the model float32 outside it)."""
    @contextlib.contextmanager
    def mixed(*patches):
        model.set_precision("mixed")
        with contextlib.ExitStack() as stack:
            for patch in patches:
                stack.enter_context(patch)
            yield
        model.set_precision("float32")

    @contextlib.contextmanager
    def whole():
        model.to(torch.bfloat16)
        yield
        model.to(torch.float32)  # the float32 values back (bfloat16's are float32's, rounded): for the last variant only

    return {
        "mixed": lambda: mixed(),
        "mixed + unembedding": lambda: mixed(patched(GPTModel, "unembed", low_unembed)),
        "mixed + attention": lambda: mixed(patched(interp.attention.F, "scaled_dot_product_attention", low_attention)),
        "weights rounded": lambda: patched(Linear, "forward", linear_with(round_weight=True)),
        "inputs rounded": lambda: patched(Linear, "forward", linear_with(round_input=True)),
        "results rounded": lambda: patched(Linear, "forward", linear_with(round_result=True)),
        "bfloat16 model": whole,  # last: it rounds the weights
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="toy")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(args.model).eval()
    probes = probes_for(model, args.prompts, args.seq_len)
    tokens, predictable = probes.tokens, probes.predictable[:, 1:]

    def forward():
        with torch.inference_mode():
            start = time.perf_counter()
            logits = model(tokens).float()
            seconds = time.perf_counter() - start
        losses = -logits[:, :-1].double().log_softmax(-1).gather(-1, tokens[:, 1:, None])[..., 0]
        return logits, losses, seconds

    exact, exact_losses, exact_s = forward()
    print(f"{args.model}: {args.prompts} probes x {tokens.shape[1]} tokens, {args.threads} thread(s); float32 "
          f"forward {exact_s:.2f} s; predictable tokens' mean loss {exact_losses[predictable].mean():.5f}")
    for name, setup in variants(model).items():
        with setup():
            logits, losses, seconds = forward()
        error = (losses - exact_losses).abs()
        print(f"{name:20s} {seconds:6.2f} s ({exact_s / seconds:.2f}x)  loss error mean {error.mean():.4f} "
              f"max {error.max():.3f}; predictable: mean {error[predictable].mean():.4f}, mean loss shift "
              f"{losses[predictable].mean() - exact_losses[predictable].mean():+.5f}; argmax agreement "
              f"{(logits.argmax(-1) == exact.argmax(-1)).float().mean():.4f}", flush=True)


if __name__ == "__main__":
    main()
