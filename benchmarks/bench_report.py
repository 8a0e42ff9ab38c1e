"""What one ``interp report`` costs, step by step, counted in forward-equivalents.

A forward-equivalent (FE) is one forward of the report's probe batch through every block: each call
of a transformer block adds (rows it ran) / (rows of the probe batch x n_layers), where a row is one
token of one prompt; a run that starts after a block's attention (path patching) adds that block's
MLP share. The unembedding is not counted. Counted apart:

- ``probe passes``: how many times the probe batch itself was embedded, i.e. started from the first
  block (chunks add their share of the prompts): the "identical-batch full forwards" of issue 23,
  whose floor is one;
- the main model and the other models the report builds (the random-initialisation nulls);
- ``peak MB``: the largest resident memory seen while the step ran (a sampling thread reads it every
  0.1 s with the main thread's stack), so the step that grew the process shows it;
- ``s``: the seconds the main thread spent in the step (the same sampler: the time since its last
  sample goes to the step it finds now, so steps shorter than 0.1 s are blurred).

Each count is charged to the report step whose call it happened in (the function ``build_report``
called, then the one that called below it), read from the Python stack. Runs on ``GPTModel`` (the
blocks are ours to count). Prints one table per model and writes nothing.

    python benchmarks/bench_report.py                       # the embedded model, 16 prompts
    python benchmarks/bench_report.py --model smollm2 --prompts 64   # a real model at the report's defaults
    python benchmarks/bench_report.py --shape gpt2-small --prompts 16 --vocab 50257
    python benchmarks/bench_report.py --shape llama-1b-width --prompts 8 --seq-len 64 --dtype bfloat16
    python benchmarks/bench_report.py --shape gemma3-270m --prompts 64   # Gemma 3 270M's shape, random init
    python benchmarks/bench_report.py --shape qwen2-0.5b --prompts 64 --precision mixed --threads 2 --memory-mb 3072
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
import weakref
from collections import defaultdict

import torch

from analyses.core.probes import probes_for
from analyses.report.build import build_report
from interp import GPTConfig, GPTModel, from_hf, load_model
from interp.precision import PRECISIONS
from interp.random_models import random_hf_model
from interp.model import TransformerBlock

SHAPES = {
    "gpt2-small": dict(n_layers=12, d_model=768, n_heads=12, n_ctx=1024),
    # Llama-3.2-1B's width (its vocabulary is the --vocab default of this shape) at 2 layers
    "llama-1b-width": dict(n_layers=2, d_model=2048, n_heads=32, n_key_value_heads=8, n_ctx=1024, d_mlp=8192,
                           normalization_type="RMS", act_fn="silu", gated_mlp=True, positional_embedding_type="rotary",
                           rotary_base=500_000.0, qkv_bias=False, attn_out_bias=False, mlp_bias=False),
}
SHAPE_VOCAB = {"gpt2-small": 50257, "llama-1b-width": 128256}
# Hugging Face families at a real model's shape, random init, converted from scratch (interp.from_hf):
# (family, config keys). Gemma 3 270M: 18 layers of 4 query heads over 1 key/value head, d_head 256,
# d_model 640, vocabulary 262,144, five sliding-window layers (512) to one global, tied embeddings.
HF_SHAPES = {
    "gemma3-270m": ("gemma3_text", dict(
        hidden_size=640, num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
        intermediate_size=2048, query_pre_attn_scalar=256, sliding_window=512, rope_theta=1_000_000.0,
        rope_local_base_freq=10_000.0, layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 3)),
    # Qwen2.5-0.5B: 24 layers of 14 query heads over 2 key/value heads (d_head 64), d_model 896, MLP 4,864,
    # vocabulary 151,936, untied output (the "0.5B class"; 494M parameters, 136M of them each end)
    "qwen2-0.5b": ("qwen2", dict(
        hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
        intermediate_size=4864, rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)),
}
HF_VOCAB = {"gemma3-270m": 262144, "qwen2-0.5b": 151936}


class ForwardCounter:
    """Counts block rows and probe-batch embeddings per (model, step, substep) while installed."""

    def __init__(self, main_model: GPTModel, probe_tokens: torch.Tensor):
        self.main = main_model
        self.probe_rows = {tuple(row.tolist()) for row in probe_tokens}
        self.batch_rows = probe_tokens.numel()
        self.n_prompts = probe_tokens.shape[0]
        self.block_rows: dict[tuple, float] = defaultdict(float)
        self.passes: dict[tuple, float] = defaultdict(float)
        self.peak_mb: dict[tuple, float] = {}
        self.seconds: dict[tuple, float] = defaultdict(float)
        self.reported_peak = 0.0
        self._main_thread = threading.main_thread().ident
        self._sampling = True
        self._mlp_share = weakref.WeakKeyDictionary()  # block -> its MLP's share (a null model's block dies with it)

    def __enter__(self):
        self._sampler = threading.Thread(target=self._sample_memory, daemon=True)
        self._sampler.start()
        self._handle = torch.nn.modules.module.register_module_forward_pre_hook(self._pre_hook)
        self._from_mid, self._forward = TransformerBlock.forward_from_mid, TransformerBlock.forward
        self._in_forward: set[int] = set()  # blocks inside their own forward, which calls forward_from_mid itself
        counter = self

        def counted_from_mid(block, resid_mid):
            if id(block) not in counter._in_forward:  # a run that starts after this block's attention
                counter._charge(block, resid_mid, counter._mlp_fraction(block))
            return counter._from_mid(block, resid_mid)

        def marked_forward(block, *args, **kwargs):
            counter._in_forward.add(id(block))
            try:
                return counter._forward(block, *args, **kwargs)
            finally:
                counter._in_forward.discard(id(block))

        TransformerBlock.forward_from_mid = counted_from_mid
        TransformerBlock.forward = marked_forward
        return self

    def __exit__(self, *exc):
        self._sampling = False
        self._sampler.join()
        self._handle.remove()
        TransformerBlock.forward_from_mid, TransformerBlock.forward = self._from_mid, self._forward

    def _pre_hook(self, module, args):
        if isinstance(module, TransformerBlock):
            self._charge(module, args[0], 1.0)
        elif isinstance(module, torch.nn.Embedding) and owner(module) is self.main and args[0].dim() == 2:
            matched = sum(tuple(row.tolist()) in self.probe_rows for row in args[0])
            if matched:
                self.passes[self._step()] += matched / self.n_prompts

    def _charge(self, block, resid, share):
        model = "main" if owner(block) is self.main else "other models"
        rows = resid.numel() / resid.shape[-1]
        step = self._step()
        self.block_rows[(model, *step)] += share * rows / (self.batch_rows * self.main.cfg.n_layers)

    def _mlp_fraction(self, block):
        if block not in self._mlp_share:
            mlp = sum(p.numel() for p in block.mlp.parameters())
            self._mlp_share[block] = mlp / sum(p.numel() for p in block.parameters())
        return self._mlp_share[block]

    def _sample_memory(self) -> None:
        """Every 0.1 s: the resident memory, charged to the step the main thread is in; printed as it
        grows (a run that runs out of memory prints nothing else)."""
        last = begun = time.perf_counter()
        current = None
        while self._sampling:
            frame = sys._current_frames().get(self._main_thread)
            step = self._step(frame)
            now = time.perf_counter()
            if step[0] != current:  # a trace that survives a run cut short
                main = sum(v for k, v in self.block_rows.items() if k[0] == "main")
                print(f"  {now - begun:7.0f} s, {time.process_time():7.0f} s CPU, {main:7.2f} FE main: {step[0]}",
                      file=sys.stderr, flush=True)
                current = step[0]
            self.seconds[step] += now - last
            last = now
            with open("/proc/self/status") as status:
                rss = next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024
            self.peak_mb[step] = max(self.peak_mb.get(step, 0), rss)
            del frame  # it would keep the main thread's locals (a null model) alive through the sleep
            if rss > self.reported_peak + 256:
                print(f"  {rss:.0f} MB in {' / '.join(step)}", file=sys.stderr, flush=True)
                self.reported_peak = rss
            time.sleep(0.1)

    @staticmethod
    def _step(frame=None) -> tuple[str, str]:
        """(step, substep): the analyses function build_report called, and the two below it on the stack."""
        names = []
        frame = sys._getframe(2) if frame is None else frame
        while frame is not None:
            module = frame.f_globals.get("__name__", "")
            if frame.f_code.co_name == "build_report":
                break
            if module.startswith("analyses."):
                names.append(frame.f_code.co_name)
            frame = frame.f_back
        names.reverse()
        return (names[0] if names else "?", "/".join(names[1:3]))


# module -> a weak reference to the model it belongs to: neither keeps the report's null models alive (a
# strong reference kept every one, ~1 GB each at Gemma 3 270M's shape, and grew the bench to 17 GB)
OWNER: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def mark_owned(model: GPTModel) -> None:
    reference = weakref.ref(model)
    OWNER.update((module, reference) for module in model.modules())


def owner(module: torch.nn.Module) -> GPTModel | None:
    """The model ``module`` was marked as part of (None: unmarked, or that model is gone)."""
    reference = OWNER.get(module)
    return None if reference is None else reference()


def own_new_models() -> None:
    """Every GPTModel built from now on (the report's null models) marks its modules as its own."""
    original = GPTModel.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        mark_owned(self)

    GPTModel.__init__ = init


def subject(args) -> GPTModel:
    if args.model is not None:
        return load_model(args.model).eval()
    if args.shape == "toy":
        return load_model("toy").eval()
    if args.shape in HF_SHAPES:
        family, keys = HF_SHAPES[args.shape]
        hf, tokenizer = random_hf_model(family, d_vocab=args.vocab or HF_VOCAB[args.shape], n_ctx=2048, **keys)
        model = from_hf(hf, tokenizer)
        del hf  # its weights are not the report's: only the converted model's stay resident
        return model.to(getattr(torch, args.dtype)).eval()
    torch.manual_seed(0)
    config = GPTConfig(d_vocab=args.vocab or SHAPE_VOCAB[args.shape], **SHAPES[args.shape])
    return GPTModel(config).to(getattr(torch, args.dtype)).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="toy", choices=["toy", *SHAPES, *HF_SHAPES])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=None,
                        help="vocabulary of a --shape model (default the shape's: 50,257; 128,256)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="the --shape model's weights")
    parser.add_argument("--precision", default="float32", choices=PRECISIONS,
                        help="the model's precision (GPTModel.set_precision; 'mixed': the linear maps' products in bfloat16)")
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--model", default=None, help="a model spec load_model takes (a Hugging Face directory, "
                        "'smollm2'): counted instead of --shape (it must load as a GPTModel)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1, as the tables so far)")
    parser.add_argument("--memory-mb", type=float, default=None,
                        help="the report's memory_mb (default the report's own, 1,024)")
    parser.add_argument("--intervention-prompts", type=int, default=None,
                        help="the report's intervention_prompts (default the report's own)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = subject(args)
    model.set_precision(args.precision)
    own_new_models()
    mark_owned(model)
    probes = probes_for(model, args.prompts, args.seq_len, seed=0)
    start, cpu = time.perf_counter(), time.process_time()
    with ForwardCounter(model, probes.tokens) as counter:
        build_report(model, model_name=args.model or args.shape, n_prompts=args.prompts, seq_len=args.seq_len, seed=0,
                     progress=False, **({} if args.intervention_prompts is None else
                                        {"intervention_prompts": args.intervention_prompts}),
                     **({} if args.memory_mb is None else {"memory_mb": args.memory_mb}))
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    print(f"{args.model or args.shape}: {args.prompts} prompts x {probes.seq_len} tokens, {model.cfg.n_layers} layers, "
          f"vocabulary {model.cfg.d_vocab}, {next(model.parameters()).dtype} ({model.cfg.precision}); report {seconds:.1f} s wall, "
          f"{cpu:.1f} s CPU ({args.threads} thread{'s' if args.threads > 1 else ''})")
    steps = list(dict.fromkeys([*counter.peak_mb, *counter.passes, *(key[1:] for key in counter.block_rows)]))
    print(f"{'step':<28} {'substep':<44} {'probe passes':>12} {'FE main':>9} {'FE other':>9} {'peak MB':>8} {'s':>7}")
    for step in steps:
        print(f"{step[0]:<28} {step[1]:<44} {counter.passes.get(step, 0):>12.2f} "
              f"{counter.block_rows.get(('main', *step), 0):>9.2f} {counter.block_rows.get(('other models', *step), 0):>9.2f} "
              f"{counter.peak_mb.get(step, 0):>8.0f} {counter.seconds.get(step, 0):>7.1f}")
    total = lambda owner: sum(v for k, v in counter.block_rows.items() if k[0] == owner)
    print(f"{'total':<73} {sum(counter.passes.values()):>12.2f} {total('main'):>9.2f} {total('other models'):>9.2f}")


if __name__ == "__main__":
    main()
