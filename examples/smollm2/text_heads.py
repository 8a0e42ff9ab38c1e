"""SmolLM2's heads on real text: duplicate-token heads on naturally repeated words, bracket and quote
matching heads, attention sinks (the first token, and whether punctuation or newlines are sinks
too), and induction on natural text; each kind scored by interp and, independently, on Hugging
Face's eager attention patterns of the same tokens, then tested by an intervention on a text that
did not choose the heads.

Two texts beside this script, prose written for it in the model's own input format (no start token:
SmolLM2's GGUF says ``add_bos_token = False``): ``sample_text.txt`` (271 tokens, seven lines)
CHOOSES the heads, ``sample_text_2.txt`` (about as long, ten lines, the same features: repeated
words, parentheses, square brackets, quotes) MEASURES them. Scores (layer, head), each the
attention mass on the kind's target keys averaged over the query positions where the kind is
defined (chance: a uniform causal head on the same queries):

    duplicate_token      query: a token that occurred before; target: its earlier occurrences
                         (interp's ``classify_heads(texts=...)`` definition)
    bracket_close        query: a closing ``)``/``]`` token; target: its matching opener
    bracket_before       query: the token before a closer (where the closer is predicted); target: the opener
    quote_close / quote_before   the same for the closing ``"`` of each quoted passage
    bos                  query i >= 1; target: position 0 (the first token: the start token where one
                         is prepended, else the text's first token; the first-position attention sink)
    delimiter            query after the first delimiter; targets: every earlier newline or full
                         stop (a sink on tokens other than the first)

Interventions (hand-written hooks; the metric is the next-token loss in nats at the positions named,
computed by hand from the logits), all on the held-out text: zeroing a kind's top heads (``hook_z``);
for bracket heads, also blocking only their attention from the token before a closer to its opener
(``hook_pattern``, renormalised); for sinks, removing the sink's column of the pattern with and
without renormalising (where the mass goes, against what the sink writes). Each beside 50 random
head sets matched to it by layer and key/value group, never a tested head
(``analyses.interventions.controls.matched_random_sets``), given the same edit. Every run starts
at the first edited layer from the clean residual stream there (``start_at_layer``; the script
checks it against a full forward once).

Intervals: 95%, a seeded percentile bootstrap (1,000 resamples) over the held-out text's LINES, each
line's counted positions kept together (``bootstrap_ratio`` for the effect,
``analyses.core.stats.control_intervals`` for the random sets' mean and the ratio tested / random,
lines and draws resampled together). Positions of one text are not independent prompts (neighbours
share context), so a bootstrap over positions would be optimistic; lines are coarser units, but still
ten of one text, so the intervals are optimistic too (a percentile bootstrap over ten units covers
less than 95%). p: (1 + random sets whose |effect| is at least the tested one's) / (1 + sets).

Induction on text: the induction heads the report's rule names on 64 random-token probes (seed 0;
``ablation.report_roles``: calibrated nulls at 5% FDR, score >= 0.4), never chosen on text;
``induction_text_task`` (logit difference, clean against the first copy shuffled) mean-ablated with
the means of the shuffled prompts (``task_ablation``'s ``mean_corrupted``) against matched random
sets (``control_effects``: intervals over the sentences); head patching (``patch_effects``); and the
loss on the held-out text read twice with the induction heads zeroed (intervals over the second
copy's lines).

    python examples/smollm2/text_heads.py            # writes docs/smollm2_text_heads.png too
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from analyses import classify_heads, patch_effects
from analyses.core.stats import bootstrap_ratio, control_intervals, control_z, normal_p_value
from analyses.core.tokens import encode
from analyses.components.rollout import all_patterns
from analyses.interventions.controls import control_effects, matched_random_sets, matched_strata, matching_text
from analyses.tasks.task import induction_text_task, task_ablation, task_batch, task_metric
from interp.errors import UserError
from ablation import report_roles
from ioi import share_lower
from role_scores import role_map
from setup_smollm2 import head_name, hf_eager_model, hf_patterns, load, probes

TEXT = Path(__file__).with_name("sample_text.txt")  # chooses the heads
HELD_OUT = Path(__file__).with_name("sample_text_2.txt")  # measures them
FIGURE = Path(__file__).resolve().parents[2] / "docs" / "smollm2_text_heads.png"
KINDS = ("duplicate_token", "bracket_close", "bracket_before", "quote_close", "quote_before", "bos", "delimiter")
N_DRAWS = 50
N_PROBES = 64
N_CHOSEN = {"duplicate_token": 5, "bos": 5, "delimiter": 5}  # heads chosen per kind (3 for the others)


def text_tokens(model, text: str) -> tuple[torch.Tensor, list[str]]:
    """``text`` in the model's input format -> ids (1, pos) and each token's string."""
    tokens = encode(model, text).tokens
    return tokens, model.to_str_tokens(tokens[0])


def matched_pairs(strings: list[str]) -> dict[str, list[tuple[int, int]]]:
    """(opener, closer) token positions of every bracket pair (``()`` and ``[]``, nesting by a stack)
    and every quoted passage (``"`` tokens taken in turns, opening and closing), read character by
    character from the tokens' strings."""
    pairs = {"bracket": [], "quote": []}
    stack, quote = [], None
    for position, string in enumerate(strings):
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
    """Positions of the newline and full-stop tokens (``.``, ``."``, ``\\n``) after the first."""
    return [i for i, s in enumerate(strings) if i > 0 and ("\n" in s or s.strip() in (".", '."'))]


def lines_of(strings: list[str]) -> torch.Tensor:
    """(pos,) each position's line: how many newlines the tokens before it hold."""
    return torch.tensor([0, *(string.count("\n") for string in strings[:-1])]).cumsum(0)


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


def names(heads) -> str:
    return ", ".join(head_name(*h) for h in heads)


def position_losses(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """logits (1, pos, d_vocab) -> (pos - 1,) float64: at each position q the loss (nats) of the next
    token, by a plain log-softmax (not interp's metric)."""
    logp = logits[0, :-1].float().log_softmax(-1)
    return -logp.gather(1, tokens[0, 1:, None].to(logp.device))[:, 0].double().cpu()


def loss_at(logits: torch.Tensor, tokens: torch.Tensor, positions) -> float:
    """Mean next-token loss (nats) of prompt 0 predicting the token after each of ``positions``."""
    return position_losses(logits, tokens)[list(positions)].mean().item()


def layer_hooks(heads, hook: str, edit) -> list:
    """One hook on ``blocks.{l}.attn.{hook}`` per layer l of ``heads`` [(layer, head), ...]:
    edit(activation, that layer's heads) -> the edited activation."""
    def hook_for(layer):
        return lambda activation, hook: edit(activation, [h for l, h in heads if l == layer])
    return [(f"blocks.{l}.attn.{hook}", hook_for(l)) for l in sorted({l for l, _ in heads})]


def zero_edit(heads) -> list:
    """``hook_z`` hooks (batch, pos, head, d_head) zeroing ``heads``."""
    return layer_hooks(heads, "hook_z", lambda z, chosen: z.index_fill(2, torch.tensor(chosen, device=z.device), 0))


def pattern_edit(heads, column_of, renormalise: bool) -> list:
    """``hook_pattern`` hooks (batch, head, q, k) that zero, in ``heads`` only, the keys
    ``column_of(q)`` of each query q (a list of key positions, never all of the row's when
    renormalising), renormalising the rest or not."""
    def edit(pattern, chosen):
        n = pattern.shape[-1]
        cut = torch.zeros(n, n, dtype=torch.bool, device=pattern.device)
        for q in range(n):
            cut[q, column_of(q)] = True
        pattern = pattern.clone()
        part = pattern[:, chosen].masked_fill(cut, 0)
        pattern[:, chosen] = part / part.sum(-1, keepdim=True) if renormalise else part
        return pattern
    return layer_hooks(heads, "hook_pattern", edit)


def run(model, tokens, fwd_hooks=()) -> torch.Tensor:
    with torch.no_grad():
        return model.run_with_hooks(tokens, fwd_hooks=list(fwd_hooks)) if fwd_hooks else model(tokens)


def losses_under(model, tokens: torch.Tensor, edits: list[list], layer: int) -> torch.Tensor:
    """(len(edits), pos - 1) next-token losses with each hook list applied, each run from block
    ``layer`` (no edit below it) on the clean residual stream entering it, cached once."""
    name = f"blocks.{layer}.hook_resid_pre"
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=name)
        return torch.stack([position_losses(model.run_with_hooks(cache[name], start_at_layer=layer, fwd_hooks=hooks),
                                            tokens) for hooks in edits])


@dataclass
class TextEffect:
    """An edit of ``heads`` against the same edit of matched random sets, at counted positions of one
    text: the loss unedited (``base``), the effect (edited - unedited, nats), the random sets' mean
    effect and the ratio, each with its 95% interval over lines; z, the effect's distance from the
    random sets' mean in their standard deviations, with its interval (``control_z``) and normal p;
    the permutation p; how many lines and positions."""

    base: float
    effect: float
    ci: tuple[float, float]
    random: float
    random_ci: tuple[float, float]
    ratio: float
    ratio_ci: tuple[float, float]
    z: tuple[float, float, float]
    p_value: float
    n_lines: int
    n_positions: int

    def describe(self) -> str:
        """One line; the ratio only where the random sets' mean effect is above 0 (its interval
        excludes 0), since a ratio to a mean that may be 0 has no bounded interval."""
        ratio = (f"ratio {self.ratio:.1f}x [{self.ratio_ci[0]:.1f}, {self.ratio_ci[1]:.1f}]" if self.random_ci[0] > 0
                 else "no ratio (the random mean's interval reaches 0)")
        return (f"loss {self.base:.3f}, effect {self.effect:+.3f} [{self.ci[0]:+.3f}, {self.ci[1]:+.3f}]; random "
                f"{self.random:+.3f} [{self.random_ci[0]:+.3f}, {self.random_ci[1]:+.3f}]; {ratio}, z {self.z[0]:+.1f} "
                f"[{self.z[1]:+.1f}, {self.z[2]:+.1f}] (normal p {normal_p_value(*self.z[1:]):.2g}), p {self.p_value:.3f} "
                f"({self.n_lines} lines, {self.n_positions} positions)")


def line_sums(values: torch.Tensor, positions: list[int], lines: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """values (..., pos - 1) -> (their sums over the ``positions`` of each line (lines, ...), how many
    positions each line counts (lines,)), lines numbered from 0 in order."""
    at = torch.tensor(positions)
    unit = torch.unique(lines[at], return_inverse=True)[1]
    n_lines = int(unit.max()) + 1
    sums = torch.zeros(n_lines, *values.shape[:-1], dtype=torch.float64).index_add_(0, unit, values[..., at].movedim(-1, 0))
    return sums, torch.zeros(n_lines, dtype=torch.float64).index_add_(0, unit, torch.ones(len(at), dtype=torch.float64))


def text_effect(losses: torch.Tensor, positions: list[int], lines: torch.Tensor) -> TextEffect:
    """losses (2 + draws, pos - 1): unedited, the tested edit, then each random set's -> ``TextEffect``
    at ``positions`` (query positions), bootstrapped over their ``lines`` (pos,)."""
    sums, counts = line_sums(losses[1:] - losses[0], positions, lines)  # (lines, 1 + draws)
    effect, low, high = bootstrap_ratio(sums[:, 0], counts)
    per_draw = sums[:, 1:].sum(0) / counts.sum()
    random_ci, ratio_ci = control_intervals(sums[:, 0], sums[:, 1:], counts)
    p_value = (1 + int((per_draw.abs() >= effect.abs()).sum())) / (1 + len(per_draw))
    return TextEffect(losses[0, positions].mean().item(), float(effect), (float(low), float(high)),
                      float(per_draw.mean()), random_ci, float(effect / per_draw.mean()), ratio_ci,
                      control_z(sums[:, 0], sums[:, 1:], counts), p_value,
                      len(counts), len(positions))


def edit_sweep(model, tokens, heads, edit) -> torch.Tensor:
    """(2 + N_DRAWS, pos - 1) losses: unedited, ``edit(heads)``, then ``edit`` of each of N_DRAWS
    random sets matched to ``heads`` (layer and key/value group; no tested head)."""
    sets = matched_random_sets(model, heads, N_DRAWS, seed=0)
    return losses_under(model, tokens, [[], edit(heads), *map(edit, sets)], min(l for l, _ in heads))


def suffix_check(model, tokens, heads) -> None:
    """``losses_under`` (a run from the first edited layer) against a full forward with the same hooks."""
    suffix = losses_under(model, tokens, [zero_edit(heads)], min(l for l, _ in heads))[0]
    full = position_losses(run(model, tokens, zero_edit(heads)), tokens)
    print(f"  check: zeroing {names(heads)} run from layer {min(l for l, _ in heads)} vs a full forward: "
          f"max |loss difference| {(suffix - full).abs().max():.1e} nats")


def cross_check(model, tokens, ours: torch.Tensor, where) -> None:
    """interp's patterns against Hugging Face's eager attention on the same tokens; every kind's
    scores on both."""
    theirs = hf_patterns(hf_eager_model(), tokens)[:, 0]
    print(f"interp vs Hugging Face eager attention on {TEXT.name}: max |pattern difference| "
          f"{(ours - theirs).abs().max():.1e}")
    for kind in KINDS:
        a, b = kind_scores(ours, where[kind])[0], kind_scores(theirs, where[kind])[0]
        print(f"  {kind:16s} max |score difference| {(a - b).abs().max():.1e}; top-5 identical: {top(a, 5) == top(b, 5)}")


def classify_duplicate(model, text: str, shape) -> torch.Tensor:
    frame = classify_heads(model, texts=[text], n_boot=10, progress=False)
    rows = frame[frame.measure == "duplicate_token"].sort_values(["layer", "head"])
    return torch.tensor(rows.score.to_numpy()).reshape(shape)


def describe_text(name: str, tokens, strings, where) -> str:
    return (f"{name}: {tokens.shape[1]} tokens, {int(lines_of(strings)[-1]) + 1} lines; {len(where['duplicate_token'][0])} "
            f"repeated tokens, {len(where['bracket_close'][0])} bracket pairs, {len(where['quote_close'][0])} quoted "
            f"passages, {len(delimiters(strings))} delimiters (newlines, full stops)")


def choose_heads(model, text: str) -> dict[str, torch.Tensor]:
    """Every kind's scores (layer, head) on the choosing text, printed with chance and the top heads;
    checked against ``classify_heads`` and Hugging Face."""
    tokens, strings = text_tokens(model, text)
    where = targets(tokens, strings)
    patterns = all_patterns(model, tokens[0])
    print(describe_text(TEXT.name, tokens, strings, where), "(chooses the heads)")
    scores = {}
    for kind in KINDS:
        scores[kind], chance = kind_scores(patterns, where[kind])
        print(f"{kind:16s} chance {chance:.3f}; top heads: {shown(scores[kind], top(scores[kind], 6))}")
    dup = classify_duplicate(model, text, patterns.shape[:2])
    print(f"interp classify_heads(texts=[the text]) duplicate_token vs this script's: max |difference| "
          f"{(dup - scores['duplicate_token']).abs().max():.1e}")
    cross_check(model, tokens, patterns, where)
    return scores


def measure_heads(model, text: str, scores: dict[str, torch.Tensor]) -> None:
    """The heads chosen by ``scores`` scored and intervened on in ``text``, the held-out text."""
    tokens, strings = text_tokens(model, text)
    where, lines = targets(tokens, strings), lines_of(strings)
    patterns = all_patterns(model, tokens[0])
    print(describe_text(HELD_OUT.name, tokens, strings, where), "(measures them)")
    chosen = {kind: top(scores[kind], N_CHOSEN.get(kind, 3)) for kind in KINDS}
    for kind, heads in chosen.items():
        held, chance = kind_scores(patterns, where[kind])
        print(f"  {kind:16s} chance {chance:.3f}; the chosen heads here: {shown(held, heads)}; "
              f"the top here: {shown(held, top(held, 3))}")
    print(f"interventions on {HELD_OUT.name} (loss in nats; each beside {N_DRAWS} matched random sets):")
    suffix_check(model, tokens, chosen["bracket_before"])
    every = list(range(tokens.shape[1] - 1))
    repeated = [q for q in where["duplicate_token"][0] if q < tokens.shape[1] - 1]
    closers = sorted(where["bracket_before"][0] + where["quote_before"][0])
    openers = dict(zip(where["bracket_before"][0] + where["quote_before"][0],
                       where["bracket_before"][1] + where["quote_before"][1]))
    stops = sorted({k for keys in where["delimiter"][1] for k in keys})
    sweeps = [
        ("duplicate_token", "zeroing", zero_edit, [("after repeated tokens", repeated),
                                              ("after first occurrences", [q for q in every if q not in set(repeated)])]),
        ("bracket_before", "zeroing", zero_edit, [("predicting the closers", closers),
                                             ("elsewhere", [q for q in every if q not in closers])]),
        ("bracket_before", "blocking only the token before a closer -> its opener (renormalised) in",
         lambda heads: pattern_edit(heads, lambda q: openers.get(q, []), True), [("predicting the closers", closers)]),
        ("bracket_close", "zeroing", zero_edit, [("after the closers", [q + 1 for q in closers if q + 1 in every])]),
        ("bos", "moving attention off the first token (renormalised) in",
         lambda heads: pattern_edit(heads, lambda q: [0] if q else [], True), [("every position", every)]),
        ("bos", "removing the first token's write (not renormalised) in",
         lambda heads: pattern_edit(heads, lambda q: [0] if q else [], False), [("every position", every)]),
        ("delimiter", "moving attention off the newlines and full stops (renormalised) in",
         lambda heads: pattern_edit(heads, lambda q: [k for k in stops if k < q], True), [("every position", every)]),
        ("delimiter", "removing their write (not renormalised) in",
         lambda heads: pattern_edit(heads, lambda q: [k for k in stops if k < q], False), [("every position", every)]),
    ]
    for kind, action, edit, reads in sweeps:
        losses = edit_sweep(model, tokens, chosen[kind], edit)
        print(f"  {action} the {kind} heads {names(chosen[kind])} "
              f"(random sets {matching_text(matched_strata(model, chosen[kind]))}):")
        for where_read, positions in reads:
            print(f"    {where_read}: {text_effect(losses, positions, lines).describe()}")


def induction_on_text(model, text: str) -> None:
    induction = report_roles(model, probes(model, N_PROBES, seed=0))["induction"]
    print(f"induction heads by the report's rule on {N_PROBES} random-token probes (seed 0): {names(induction)}")

    task = induction_text_task(model)
    batch = task_batch(model, task)
    metric = task_metric(task, batch.last)
    with torch.no_grad():
        logits = model(batch.clean)
    final = logits[torch.arange(len(task)), batch.last]
    diff = final[torch.arange(len(task)), [a[0] for a in task.answers]] - \
        final[torch.arange(len(task)), [d[0] for d in task.distractors]]
    ones = torch.ones(len(task))
    mean, low, high = bootstrap_ratio(diff.double(), ones)
    above = bootstrap_ratio((diff > 0).double(), ones)
    corrupted = metric(run(model, batch.corrupted)).item()
    print(f"induction-text, {len(task)} sentences: logit diff {mean:.2f} [{low:.2f}, {high:.2f}] (answer above the "
          f"distractor on {100 * above[0]:.0f}% [{100 * above[1]:.0f}, {100 * above[2]:.0f}]); first copy shuffled: "
          f"{corrupted:.2f}")
    reference, words = task_ablation(task, batch, "mean_corrupted")
    control = control_effects(model, batch.clean, induction, "mean_corrupted", metric, reference=reference,
                              n_draws=N_DRAWS, progress=False)
    print(f"  mean_corrupted ablation ({words}): {control.describe()}")
    print(f"  the logit difference {share_lower(model, batch, induction, 'mean_corrupted', metric, reference)}")
    patched = patch_effects(model, batch.clean, batch.corrupted, metric).nlargest(5, "effect")
    order = [(int(r.layer), int(r.head)) for r in patched.itertuples()]
    print("  head patching (clean into shuffled; the top 5): " + ", ".join(
        f"{head_name(int(r.layer), int(r.head))} {r.effect:+.2f} [{r.ci_low:+.2f}, {r.ci_high:+.2f}]"
        for r in patched.itertuples()) + f"; {sum(h in induction for h in order)} of these 5 are the induction heads")
    read_twice(model, text, induction)


def read_twice(model, text: str, induction) -> None:
    """The held-out text twice in a row: each copy's loss with its interval over lines, and zeroing
    the induction heads on the second copy against matched random sets; the share of what the repeat
    saves that zeroing undoes (per line: the effect over first-copy loss minus second-copy loss)."""
    tokens, strings = text_tokens(model, text + text)
    once = text_tokens(model, text)[0].shape[1]
    length = tokens.shape[1] - once  # the text's own tokens; the start token (if any) comes once
    start = once - length
    if not torch.equal(tokens[0, start:start + length], tokens[0, start + length:]):
        raise UserError(f"{HELD_OUT.name} twice does not tokenise as two copies of it")
    first, second = list(range(start, start + length - 1)), list(range(start + length, start + 2 * length - 1))
    lines = lines_of(strings)
    lines = torch.cat([lines[:start + length], lines[start:start + length]])  # each copy's positions: the text's lines
    losses = edit_sweep(model, tokens, induction, zero_edit)
    sums, counts = line_sums(losses[0], first, lines)
    sums2, _ = line_sums(losses[0], second, lines)
    one, two = bootstrap_ratio(sums, counts), bootstrap_ratio(sums2, counts)
    print(f"{HELD_OUT.name} read twice ({tokens.shape[1]} tokens): loss on the first copy {one[0]:.3f} "
          f"[{one[1]:.3f}, {one[2]:.3f}], on the second {two[0]:.3f} [{two[1]:.3f}, {two[2]:.3f}] nats")
    effect = text_effect(losses, second, lines)
    print(f"  zeroing the induction heads {names(induction)}, second copy: {effect.describe()}")
    undone, _ = line_sums(losses[1] - losses[0], second, lines)
    share = bootstrap_ratio(undone, sums - sums2)
    print(f"  undoing {100 * share[0]:.0f}% [{100 * share[1]:.0f}, {100 * share[2]:.0f}] of the "
          f"{one[0] - two[0]:.2f} nats the repeat saves")


def figure(scores: dict[str, torch.Tensor], path: Path) -> None:
    shown_kinds = ("duplicate_token", "bracket_before", "bracket_close", "quote_close", "bos", "delimiter")
    role_map({kind: scores[kind] for kind in shown_kinds}, path, f"SmolLM2-135M-Instruct on real text ({TEXT.name})",
             "attention on the kind's target keys")


def main() -> None:
    torch.set_num_threads(1)
    model = load()
    scores = choose_heads(model, TEXT.read_text(encoding="utf-8"))
    held_out = HELD_OUT.read_text(encoding="utf-8")
    measure_heads(model, held_out, scores)
    induction_on_text(model, held_out)
    if "--no-figure" not in sys.argv:
        figure(scores, FIGURE)
        print(f"wrote {FIGURE.relative_to(FIGURE.parents[1])}")


if __name__ == "__main__":
    main()
