"""SmolLM2's heads on real text: duplicate-token heads on naturally repeated words, bracket and quote
matching heads, attention sinks (the start token, and whether punctuation or newlines are sinks
too), and induction on natural text; each kind scored by interp and, independently, on Hugging
Face's eager attention patterns of the same tokens, then confirmed by an intervention.

The text is ``sample_text.txt`` beside this script (prose written for it: 271 tokens after the
start token, seven lines, with repeated words, parentheses, square brackets and quotes). Scores
(layer, head), each the attention mass on the kind's target keys averaged over the query positions
where the kind is defined (chance: a uniform causal head on the same queries):

    duplicate_token      query: a token that occurred before; target: its earlier occurrences
                         (interp's ``classify_heads(texts=...)`` definition)
    bracket_close        query: a closing ``)``/``]`` token; target: its matching opener
    bracket_before       query: the token before a closer (where the closer is predicted); target: the opener
    quote_close / quote_before   the same for the closing ``"`` of each quoted passage
    bos                  query i >= 1; target: the start token (the first-token attention sink)
    delimiter            query after the first delimiter; targets: every earlier newline or full
                         stop (a sink on tokens other than the first)

Interventions (hand-written hooks; the metric is the next-token loss in nats at the positions named,
computed by hand from the logits): zeroing a kind's top heads (``hook_z``) against as many random
heads (10 draws); for bracket heads, also blocking only their attention from the token before a
closer to its opener (``hook_pattern``, renormalised); for sinks, removing the sink's column of
the pattern with and without renormalising (where the mass goes, against what the sink writes).

Induction on text: ``induction_text_task`` (logit difference, clean against the first copy
shuffled) and the loss on the sample text read twice, with the nine induction heads named on
random-token probes (``classify_heads``, seed 0, score above 0.3) ablated.

    python examples/smollm2/text_heads.py            # writes docs/smollm2_text_heads.png too
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from analyses import classify_heads, logit_diff_metric, patch_heads
from analyses.core.tokens import encode
from analyses.components.rollout import all_patterns
from analyses.interventions.ablation import prepare_ablation
from analyses.tasks.task import induction_text_task, task_batch, task_metric
from ablation import named_heads, random_sets, zeroed_by_hand
from role_scores import role_map
from setup_smollm2 import head_name, hf_eager_model, hf_patterns, load, probes

TEXT = Path(__file__).with_name("sample_text.txt")
FIGURE = Path(__file__).resolve().parents[2] / "docs" / "smollm2_text_heads.png"
KINDS = ("duplicate_token", "bracket_close", "bracket_before", "quote_close", "quote_before", "bos", "delimiter")
N_DRAWS = 10


def text_tokens(model, text: str) -> tuple[torch.Tensor, list[str]]:
    """The start token and ``text`` -> ids (1, pos) and each token's string."""
    tokens = encode(model, text).tokens
    return tokens, model.to_str_tokens(tokens[0])


def matched_pairs(strings: list[str]) -> dict[str, list[tuple[int, int]]]:
    """(opener, closer) token positions of every bracket pair (``()`` and ``[]``, nesting by a stack)
    and every quoted passage (``"`` tokens taken in turns, opening and closing), read character by
    character from the tokens' strings (position 0, the start token, is skipped)."""
    pairs = {"bracket": [], "quote": []}
    stack, quote = [], None
    for position, string in enumerate(strings[1:], start=1):
        for char in string:
            if char in "([":
                stack.append(position)
            elif char in ")]":
                pairs["bracket"].append((stack.pop(), position))
            elif char == '"':
                if quote is None:
                    quote = position
                else:
                    pairs["quote"].append((quote, position))
                    quote = None
    return pairs


def delimiters(strings: list[str]) -> list[int]:
    """Positions of the newline and full-stop tokens (``.``, ``."``, ``\\n``)."""
    return [i for i, s in enumerate(strings) if i > 0 and ("\n" in s or s.strip() in (".", '."'))]


def targets(tokens: torch.Tensor, strings: list[str]) -> dict[str, tuple[list[int], list[list[int]]]]:
    """kind -> (query positions, for each query its target key positions), by the definitions in the
    module docstring."""
    ids = tokens[0].tolist()
    n = len(ids)
    repeats = [i for i in range(1, n) if ids[i] in ids[:i]]
    out = {"duplicate_token": (repeats, [[k for k in range(i) if ids[k] == ids[i]] for i in repeats])}
    for kind, pairs in matched_pairs(strings).items():
        out[f"{kind}_close"] = ([c for _, c in pairs], [[o] for o, _ in pairs])
        out[f"{kind}_before"] = ([c - 1 for _, c in pairs], [[o] for o, _ in pairs])
    out["bos"] = (list(range(1, n)), [[0]] * (n - 1))
    stops = delimiters(strings)
    after = list(range(stops[0] + 1, n))
    out["delimiter"] = (after, [[k for k in stops if k < i] for i in after])
    return out


def kind_scores(patterns: torch.Tensor, where) -> tuple[torch.Tensor, float]:
    """patterns (layer, head, q, k); where = (queries, their targets) -> (layer, head) mean mass on
    the targets, and chance (a uniform causal head's score on the same queries)."""
    queries, keys = where
    mass = torch.stack([patterns[:, :, q, k].sum(-1) for q, k in zip(queries, keys)])
    chance = sum(len(k) / (q + 1) for q, k in zip(queries, keys)) / len(queries)
    return mass.double().mean(0), chance


def top(scores: torch.Tensor, k: int, exclude=()) -> list[tuple[int, int]]:
    n_heads = scores.shape[1]
    order = [(i // n_heads, i % n_heads) for i in scores.flatten().argsort(descending=True).tolist()]
    return [h for h in order if h not in exclude][:k]


def shown(scores: torch.Tensor, heads) -> str:
    return ", ".join(f"{head_name(*h)} {scores[h]:.2f}" for h in heads)


def loss_at(logits: torch.Tensor, tokens: torch.Tensor, positions) -> float:
    """Mean next-token loss (nats) of prompt 0 predicting the token after each of ``positions``,
    by a plain log-softmax (not interp's metric)."""
    positions = torch.tensor(list(positions))
    logp = logits[0, positions].double().log_softmax(-1)
    return -logp.gather(1, tokens[0, positions + 1][:, None]).mean().item()


def pattern_edit(heads, column_of, renormalise: bool) -> list:
    """``hook_pattern`` hooks (batch, head, q, k) that zero, in ``heads`` only, the keys
    ``column_of(q)`` of each query q (a list of key positions, never all of the row's when
    renormalising), renormalising the rest or not."""
    def hook_for(layer):
        def edit(pattern, hook):
            pattern = pattern.clone()
            for head in [h for l, h in heads if l == layer]:
                for q in range(pattern.shape[2]):
                    keys = column_of(q)
                    if keys:
                        pattern[:, head, q, keys] = 0
                if renormalise:
                    pattern[:, head] /= pattern[:, head].sum(-1, keepdim=True)
            return pattern
        return edit
    return [(f"blocks.{l}.attn.hook_pattern", hook_for(l)) for l in sorted({l for l, _ in heads})]


def run(model, tokens, fwd_hooks=()) -> torch.Tensor:
    with torch.no_grad():
        return model.run_with_hooks(tokens, fwd_hooks=list(fwd_hooks)) if fwd_hooks else model(tokens)


def ablation_line(model, tokens, heads, positions, label: str) -> None:
    """Zero ``heads`` and as many random heads (10 draws): the loss increase at ``positions``."""
    def metric(logits):
        return torch.tensor(loss_at(logits, tokens, positions))
    base = metric(run(model, tokens)).item()
    named = zeroed_by_hand(model, tokens, heads, metric) - base
    controls = torch.tensor([zeroed_by_hand(model, tokens, h, metric) - base
                             for h in random_sets(model, heads, len(heads), N_DRAWS)])
    print(f"  zeroing {', '.join(head_name(*h) for h in heads)}: {label} loss {base:.3f} -> {base + named:.3f} "
          f"(+{named:.3f} nats); {len(heads)} random heads: {controls.mean():+.3f} (sd {controls.std():.3f}, "
          f"max {controls.max():+.3f}) over {N_DRAWS} draws")


def cross_check(model, tokens, ours: torch.Tensor, where) -> None:
    """interp's patterns against Hugging Face's eager attention on the same tokens; every kind's
    scores on both, and interp's own duplicate-token score (``classify_heads`` on the text)."""
    theirs = hf_patterns(hf_eager_model(), tokens)[:, 0]
    print(f"interp vs Hugging Face eager attention on the text: max |pattern difference| "
          f"{(ours - theirs).abs().max():.1e}")
    for kind in KINDS:
        a, b = kind_scores(ours, where[kind])[0], kind_scores(theirs, where[kind])[0]
        print(f"  {kind:16s} max |score difference| {(a - b).abs().max():.1e}; top-5 identical: {top(a, 5) == top(b, 5)}")


def classify_duplicate(model, text: str, shape) -> torch.Tensor:
    frame = classify_heads(model, texts=[text], n_boot=10, progress=False)
    rows = frame[frame.measure == "duplicate_token"].sort_values(["layer", "head"])
    return torch.tensor(rows.score.to_numpy()).reshape(shape)


def heads_on_text(model, text: str) -> dict[str, torch.Tensor]:
    tokens, strings = text_tokens(model, text)
    where = targets(tokens, strings)
    patterns = all_patterns(model, tokens[0])
    shape = patterns.shape[:2]
    scores = {}
    print(f"{TEXT.name}: {tokens.shape[1]} tokens; {len(where['duplicate_token'][0])} repeated tokens, "
          f"{len(where['bracket_close'][0])} bracket pairs, {len(where['quote_close'][0])} quoted passages, "
          f"{len(delimiters(strings))} delimiters (newlines, full stops)")
    for kind in KINDS:
        scores[kind], chance = kind_scores(patterns, where[kind])
        print(f"{kind:16s} chance {chance:.3f}; top heads: {shown(scores[kind], top(scores[kind], 6))}")
    dup = classify_duplicate(model, text, shape)
    print(f"interp classify_heads(texts=[the text]) duplicate_token vs this script's: max |difference| "
          f"{(dup - scores['duplicate_token']).abs().max():.1e}")
    cross_check(model, tokens, patterns, where)

    every = range(tokens.shape[1] - 1)
    print("interventions (loss in nats, hand-written hooks; random controls exclude the named heads):")
    repeated = [q for q in where["duplicate_token"][0] if q < tokens.shape[1] - 1]
    ablation_line(model, tokens, top(scores["duplicate_token"], 5), repeated, "at repeated tokens")
    fresh = [q for q in every if q not in set(repeated)]
    ablation_line(model, tokens, top(scores["duplicate_token"], 5), fresh, "at first occurrences")
    closers = [q for q in where["bracket_before"][0] + where["quote_before"][0]]
    before = top(scores["bracket_before"], 3)
    ablation_line(model, tokens, before, closers, "predicting closers")
    ablation_line(model, tokens, before, [q for q in every if q not in closers], "elsewhere")
    at_close = top(scores["bracket_close"], 3)
    ablation_line(model, tokens, at_close, [q + 1 for q in closers], "after the closers")
    openers = {q: k for q, k in zip(closers, where["bracket_before"][1] + where["quote_before"][1])}
    base = loss_at(run(model, tokens), tokens, closers)
    blocked = loss_at(run(model, tokens, pattern_edit(before, lambda q: openers.get(q, []), True)), tokens, closers)
    print(f"  blocking only {', '.join(head_name(*h) for h in before)}'s attention from the token before each "
          f"closer to its opener: loss predicting closers {base:.3f} -> {blocked:.3f} ({blocked - base:+.3f})")

    sinks(model, tokens, where, scores)
    return scores


def sinks(model, tokens, where, scores) -> None:
    """Remove the sink's column in the top sink heads: renormalised (the mass moves to the other
    keys) and not (only what the sink writes is lost); the start token against the delimiters."""
    every = range(tokens.shape[1] - 1)
    base = loss_at(run(model, tokens), tokens, every)
    stops = sorted({k for keys in where["delimiter"][1] for k in keys})
    for label, heads, column in (("start token", top(scores["bos"], 5), lambda q: [0] if q else []),
                                 ("start token, 5 random heads", random_sets(model, top(scores["bos"], 5), 5, 1)[0],
                                  lambda q: [0] if q else []),
                                 ("delimiters", top(scores["delimiter"], 5), lambda q: [k for k in stops if k < q])):
        moved = loss_at(run(model, tokens, pattern_edit(heads, column, True)), tokens, every)
        removed = loss_at(run(model, tokens, pattern_edit(heads, column, False)), tokens, every)
        print(f"  {label} ({', '.join(head_name(*h) for h in heads)}): loss on the text {base:.3f}; mass moved "
              f"off it {moved:.3f} ({moved - base:+.3f}); its write removed {removed:.3f} ({removed - base:+.3f})")


def induction_on_text(model, text: str) -> None:
    shape = (model.cfg.n_layers, model.cfg.n_heads)
    frame = classify_heads(model, probes=probes(model, seed=0), n_boot=10, progress=False)
    induction = named_heads(frame, "induction")
    print(f"induction heads named on random-token probes: {', '.join(head_name(*h) for h in induction)}")

    task = induction_text_task(model)
    batch = task_batch(model, task)
    metric = task_metric(task, batch.last)
    with torch.no_grad():
        logits = model(batch.clean)
    final = logits[torch.arange(len(task)), batch.last]
    diff = final[torch.arange(len(task)), [a[0] for a in task.answers]] - \
        final[torch.arange(len(task)), [d[0] for d in task.distractors]]
    corrupted = metric(run(model, batch.corrupted)).item()
    print(f"induction-text, {len(task)} sentences: logit diff {diff.mean():.2f} (answer above the distractor on "
          f"{(diff > 0).float().mean():.0%}); first copy shuffled: {corrupted:.2f}")
    # texts of unequal token lengths: the ablation pads them and reads each prompt's own last token
    answer = logit_diff_metric([a[0] for a in task.answers], [d[0] for d in task.distractors])
    ablation = prepare_ablation(model, list(task.clean), "mean", answer)
    values = ablation.run([induction, *random_sets(model, induction, len(induction), N_DRAWS)], progress=False)
    gain = values - ablation.baseline
    print(f"  mean-ablating the {len(induction)} induction heads: logit diff {ablation.baseline:.2f} -> "
          f"{values[0]:.2f} ({-gain[0] / ablation.baseline:.0%} lower); as many random heads: {gain[1:].mean():+.2f} "
          f"(sd {gain[1:].std():.2f}) over {N_DRAWS} draws")
    patched = patch_heads(model, batch.clean, batch.corrupted, metric, progress=False) - corrupted
    order = top(patched, 5)
    print(f"  head patching (clean into shuffled): {shown(patched, order)}; "
          f"{sum(h in induction for h in order)} of these 5 are named induction heads")

    tokens, _ = text_tokens(model, text + text)
    half = (tokens.shape[1] - 1) // 2
    first, second = range(1, half), range(half + 1, tokens.shape[1] - 1)
    logits = run(model, tokens)
    print(f"the sample text read twice ({tokens.shape[1]} tokens): loss on the first copy "
          f"{loss_at(logits, tokens, first):.3f}, on the second {loss_at(logits, tokens, second):.3f} nats")
    ablation_line(model, tokens, induction, second, "second copy")


def figure(scores: dict[str, torch.Tensor], path: Path) -> None:
    shown_kinds = ("duplicate_token", "bracket_before", "bracket_close", "quote_close", "bos", "delimiter")
    role_map({kind: scores[kind] for kind in shown_kinds}, path, f"SmolLM2-135M-Instruct on real text ({TEXT.name})",
             "attention on the kind's target keys")


def main() -> None:
    torch.set_num_threads(1)
    model = load()
    text = TEXT.read_text(encoding="utf-8")
    scores = heads_on_text(model, text)
    induction_on_text(model, text)
    if "--no-figure" not in sys.argv:
        figure(scores, FIGURE)
        print(f"wrote {FIGURE.relative_to(FIGURE.parents[1])}")


if __name__ == "__main__":
    main()
