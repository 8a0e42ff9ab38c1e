"""Causal tracing (Meng et al. 2022, "Locating and Editing Factual Associations in GPT"; architecture §4.9).

Corrupt the subject: Gaussian noise of ``noise`` (3 by default) times the embedding's standard
deviation is added to the subject tokens' embeddings (``hook_embed``), one seeded draw per noise
sample. Then restore one state of the clean run -- a layer's residual stream (``resid_post``, the
layer's output, or ``resid_pre``, its input), its MLP output or its attention output -- at one
position, and measure the probability of the answer at the last token. The three heatmaps
(layer x position) show where the clean information must flow for the answer to come back. The answer
token is taken by one rule for one prompt and for a fact set (``analyses.tasks.facts.answer_token``):
the answer's first token, where a leading space that is a token of its own (a byte tokenizer) moves
onto the prompt, so the token traced is never the space.

The embedding's standard deviation (``noise_from``) is that of ``hook_embed`` over the subject's
tokens (``"subjects"``: every element at every noised position, as ROME's ``collect_embedding_std``
takes it over its facts' subjects), or over every ordinary token of the vocabulary (``"vocabulary"``:
the whole embedding table).

How it runs: the noise samples are the rows of one batch (the prompt repeated), so the corrupted
run is one forward of ``samples`` rows; every restoration is a variant of the intervention engine
(``analyses.interventions.engine.score_variants``), many per forward, chunked to ``memory_mb``, its
source the clean run's state. On ``GPTModel`` a restoration at layer l starts from the noised run's
residual entering l and computes only the rest; elsewhere the noise hook is on during the full
forward. Each restored (state, layer, position) therefore costs one row batch of at most one
forward, and less where the run starts mid-stream (``trace_rows`` counts them).

Over a fact set (``trace_facts``, Meng et al.'s Figure 2): each fact is traced as above with ``samples``
(10) seeded draws, the noise's standard deviation ``noise`` (3) times that of the subject tokens'
embeddings over the whole set (``noise_from="subjects"``, as ROME's ``collect_embedding_std``;
``"vocabulary"`` is the older whole-table rule; ``noise_facts``: the whole set where only some of it
is traced). The restores (``fact_curves``) are of one hidden state (``resid``), of ``window`` (10)
consecutive layers' MLP or attention outputs centred on the layer and clipped at the ends
(``window_layers``, ROME's rule), and of one layer's MLP or attention output alone (window 1: the
first MLP acts as an extension of the embedding, so restoring it alone at a subject token already
undoes part of the noise, and every window that contains layer 0 shares that). Each is restored at
one token at a time, every token from the subject's first on (tokens before it are the same clean
and noised), as ROME's ``trace_important_states``. The per-token curves are grouped into Meng et
al.'s *position classes* (``position_classes``: first, middle and last subject token, first
subsequent token, further tokens, last token), plus every subject token together
(``ALL_SUBJECT``): a class's effect pools its tokens' (ROME's ``add_all``: a fact with three middle
subject tokens adds three). The average indirect effect (AIE) of a cell is that pooled mean of
(restored - noised) answer probability, with a 95% bootstrap interval over facts (at least
``MIN_INTERVAL_PROMPTS`` of them; a cell fewer facts have gets no interval); ``relation_aie`` gives
the same per relation; ``trace_verdict`` says whether the last subject token's MLP window peaks in
the middle layers, apart from the other subject tokens.

Cost: a restore at position p changes nothing before p, so on a model that keeps keys and values
(``GPTModel``: ``past_kv``) those earlier positions are not run again: each draw's noised keys and
values there are cached once (``PrefixCached``) and only the positions from p on run, from the first
restored layer on (``suffix_only_start``). A fact of n tokens whose subject starts at s, with L
layers and C curves (5: the hidden state, two windows, two single layers), costs about
samples x C x L x sum_{p >= s} (n - p) token-blocks x 0.6 (the mean share of layers run), instead of
samples x C x L x (n - s) forwards of all n tokens.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from itertools import product

import numpy as np
import pandas as pd
import torch

from analyses.core.budget import rows_within
from analyses.core.execution import executing
from analyses.core.metrics import Metric, PromptMeanMetric
from analyses.core.plots import new_figure, token_label
from analyses.core.progress import progress_bar
from analyses.core.stats import MIN_INTERVAL_PROMPTS, bootstrap_ratio, check_interval_prompts, effect_text
from analyses.core.tokens import encode, model_tokenizer, ordinary_token_ids, start_ids
from analyses.core.checks import check_choice
from analyses.interventions.engine import Edit, base_run, cache_run, runs_suffix_only, score_variants
from analyses.tasks.facts import Fact, answer_token, traced_facts
from interp.attention import LayerKV
from interp.errors import UserError

KINDS = ("resid", "mlp", "attn")
STATES = ("resid_post", "resid_pre")
NOISE_FROM = ("subjects", "vocabulary")
WINDOW = 10  # Meng et al.'s window of MLP / attention layers restored together
CLASSES = ("first subject token", "middle subject tokens", "last subject token", "first subsequent token",
           "further tokens", "last token")
SUBJECT_CLASSES = CLASSES[:3]
ALL_SUBJECT = "every subject token"  # the subject's tokens pooled, beside the classes
GROUPS = CLASSES + (ALL_SUBJECT,)
TITLES = {"resid": "hidden state", "mlp": "MLP output", "attn": "attention output"}


def state_name(kind: str, layer: int, state: str = "resid_post") -> str:
    """The hook a restoration of ``kind`` at ``layer`` replaces, (batch, pos, d_model)."""
    return {"resid": f"blocks.{layer}.hook_{state}", "mlp": f"blocks.{layer}.hook_mlp_out",
            "attn": f"blocks.{layer}.hook_attn_out"}[kind]


def window_layers(layer: int, n_layers: int, window: int) -> range:
    """The layers a restore "at ``layer``" puts back: ``window`` of them centred on it, clipped at the
    ends, as ROME's ``trace_important_window``: range(max(0, l - w // 2), min(n_layers, l + ceil(w / 2)))
    (w = 10: layers l - 5 .. l + 4)."""
    return range(max(0, layer - window // 2), min(n_layers, layer - (-window // 2)))


def restored_layers(kind: str, layer: int, n_layers: int, window: int) -> range:
    """One hidden state (``resid``), or the window of MLP / attention outputs (``window_layers``)."""
    return range(layer, layer + 1) if kind == "resid" else window_layers(layer, n_layers, window)


def embedding_std(model) -> float:
    """Standard deviation of ``hook_embed`` over every ordinary token id (each once), float32."""
    ids = torch.tensor(ordinary_token_ids(model))
    width = model.cfg.n_ctx
    rows = torch.cat([ids, ids[: (-len(ids)) % width]]).reshape(-1, width)  # wrap to whole rows
    device = next(model.parameters()).device
    values = []
    for start in range(0, len(rows), 64):
        _, kept = cache_run(model, rows[start:start + 64].to(device), ["hook_embed"], logits=False)
        values.append(kept["hook_embed"].float().flatten(0, 1))  # (rows * n_ctx, d_model), in id order
    return float(torch.cat(values)[: len(ids)].std())


def subject_embedding_std(model, prompts: list[str], subjects: list[str]) -> float:
    """Standard deviation (n - 1) of every element of ``hook_embed`` at the subject's positions
    (``subject_positions``) of each prompt, all prompts together, each once, float32: the
    embeddings the noise is added to."""
    values = []
    for prompt, subject in zip(prompts, subjects):
        positions = subject_positions(model, prompt, subject)
        _, kept = cache_run(model, encode(model, prompt).tokens, ["hook_embed"], logits=False)
        values.append(kept["hook_embed"][0, positions].float().flatten())
    return float(torch.cat(values).std())


def noise_scale(model, prompts: list[str], subjects: list[str], noise_from: str) -> float:
    """The embedding standard deviation the noise is measured in (``NOISE_FROM``, module docstring)."""
    check_choice("noise_from", noise_from, NOISE_FROM)
    return subject_embedding_std(model, prompts, subjects) if noise_from == "subjects" else embedding_std(model)


def subject_positions(model, prompt: str, subject: str) -> list[int]:
    """The positions (the start token, where the model's texts have one, is 0) of the tokens that
    spell ``subject``'s first occurrence in ``prompt`` (with the space before it, where one is); a
    one-line error where ``subject`` is not in the prompt or its tokens do not line up with the prompt's."""
    start = prompt.find(subject) if subject.strip() else -1
    if start < 0:
        raise UserError(f"subject {subject!r} does not occur in the prompt {prompt!r}")
    while start > 0 and prompt[start - 1].isspace():
        start -= 1
    tokenizer = model_tokenizer(model)
    whole = tokenizer.encode(prompt)
    before, through = tokenizer.encode(prompt[:start]), tokenizer.encode(prompt[: prompt.find(subject) + len(subject)])
    if whole[: len(before)] != before or whole[: len(through)] != through or len(through) == len(before):
        raise UserError(f"subject {subject!r} does not fall on token boundaries of the prompt {prompt!r}")
    offset = len(start_ids(model))
    return list(range(len(before) + offset, len(through) + offset))


def position_classes(n_pos: int, subject: list[int]) -> dict[str, list[int]]:
    """Meng et al.'s position classes of a prompt of ``n_pos`` tokens whose subject is at the
    contiguous ``subject`` positions -> {class: its positions}, in ``CLASSES`` order, only those the
    prompt has. Tokens before the subject belong to none. Every token is in one class: a one-token
    subject's token is its *last* subject token (no first), and a token right after the subject that
    is the prompt's last is the *last token* (no first subsequent); ROME's summary counted such a
    token in both classes, which makes "first" equal "last" on one-token subjects."""
    first, last, end = subject[0], subject[-1], n_pos - 1
    if last >= end:
        raise UserError(f"the subject must end before the prompt's last token (subject positions {subject}, "
                        f"{n_pos} tokens)")
    found = {"first subject token": [first] if first < last else [],
             "middle subject tokens": list(range(first + 1, last)), "last subject token": [last],
             "first subsequent token": [last + 1] if last + 1 < end else [],
             "further tokens": list(range(last + 2, end)), "last token": [end]}
    return {name: positions for name, positions in found.items() if positions}


@dataclass
class Trace:
    """A causal trace. frame: one row per (kind, layer, pos): ``kind, layer, pos, token, prob``
    (the answer's probability with that state restored, mean over noise samples); clean_prob /
    corrupted_prob: the answer's probability on the clean run / the noised run (mean over
    samples); tokens: the prompt's tokens as strings (start token first); subject: the noised
    positions; answer: the answer's token id; kinds: those traced (no "mlp" on attention-only
    models); noise_std: the noise's standard deviation."""

    frame: pd.DataFrame
    clean_prob: float
    corrupted_prob: float
    tokens: list[str]
    subject: list[int]
    answer: int
    kinds: tuple[str, ...]
    noise_std: float

    def grid(self, kind: str) -> torch.Tensor:
        """The restored probabilities of ``kind`` as [n_layers, pos]."""
        part = self.frame[self.frame["kind"] == kind]
        return torch.tensor(part.pivot(index="layer", columns="pos", values="prob").to_numpy())


def answer_probability(answer: int, parts: bool = False) -> Metric:
    """Metric: mean over rows of the probability of ``answer`` at the last position. With ``parts``
    it can be split over rows (``analyses.core.metrics.Metric.part``), its parts taking the last
    position's logits alone (a sweep then unembeds only that position). Only for sweeps whose runs
    all start from the noised residual (``suffix_only_start``): a chunk of some of a variant's rows
    would misalign the noise hook, which adds draw b to row b of every group of ``samples`` rows."""
    def probabilities(logits: torch.Tensor) -> torch.Tensor:  # (rows, pos, d_vocab) -> (rows,)
        return logits[:, -1].float().softmax(dim=-1)[:, answer]

    return PromptMeanMetric(probabilities, read_positions=-1,
                            part_scores=(lambda rows, read: probabilities) if parts else None)


def noise_hook(noise: torch.Tensor, positions: list[int]):
    """A ``hook_embed`` hook adding ``noise`` (samples, len(positions), d_model) at ``positions`` of
    every row group of ``samples`` rows (variant-major batches)."""
    def hook(embed, hook):
        grouped = embed.unflatten(0, (-1, noise.shape[0])).clone()
        grouped[:, :, positions] += noise.to(embed.dtype)
        return grouped.flatten(0, 1)

    return hook


def draw_noise(model, samples: int, n_subject: int, std: float, seed: int) -> torch.Tensor:
    """(samples, n_subject, d_model) Gaussian noise of standard deviation ``std`` (seeded, CPU draw)."""
    generator = torch.Generator().manual_seed(seed)
    noise = torch.randn(samples, n_subject, model.cfg.d_model, generator=generator) * std
    return noise.to(next(model.parameters()).device)


def _check_options(samples: int, state: str, kinds) -> None:
    check_choice("state", state, STATES)
    for kind in kinds:
        check_choice("kind", kind, KINDS)
    if samples < 1:
        raise UserError(f"samples={samples} must be at least 1")


def traced_kinds(model, kinds, state: str) -> tuple[str, ...]:
    """``kinds`` less those the model has no hook for (no "mlp" on attention-only models)."""
    return tuple(kind for kind in kinds if state_name(kind, 0, state) in model.hook_dict)


def causal_trace(model, prompt: str, subject: str, answer: str | None = None, *, samples: int = 10,
                 noise: float = 3.0, noise_from: str = "subjects", seed: int = 0, state: str = "resid_post",
                 kinds=KINDS, memory_mb: float | None = None, progress: bool | None = None) -> Trace:
    """Causal tracing of ``prompt`` (see the module docstring) -> a ``Trace``.

    ``subject``: text in the prompt whose tokens are noised; ``answer``: the exact text that continues
    the prompt (e.g. " Paris"), of which one token is traced by the rule of ``answer_token`` (a fact
    set's too: its first token, where a leading space that is a token of its own moves onto the
    prompt); default: the clean run's top token; ``samples``: noise
    draws; ``noise``: the noise's standard deviation in units of the embedding's, that of the
    subject's tokens or the vocabulary's (``noise_from``); ``state``: which residual stream "resid"
    restores ("resid_post" or "resid_pre"); ``kinds``: of ``KINDS``. ``memory_mb``, ``progress``: the
    restores' execution (``analyses.core.execution``; None: the current one's)."""
    _check_options(samples, state, kinds)
    if answer is not None:
        prompt, answer_id = answer_token(model, prompt, answer)
    tokens = encode(model, prompt).tokens  # (1, pos)
    positions = subject_positions(model, prompt, subject)
    n_layers, n_pos = model.cfg.n_layers, tokens.shape[1]
    kinds = traced_kinds(model, kinds, state)
    names = [state_name(kind, layer, state) for kind in kinds for layer in range(n_layers)]
    clean_logits, clean_cache = cache_run(model, tokens, names)
    if answer is None:
        answer_id = int(clean_logits[0, -1].argmax())
    std = noise * noise_scale(model, [prompt], [subject], noise_from)
    hook = noise_hook(draw_noise(model, samples, len(positions), std, seed), positions)
    metric = answer_probability(answer_id, parts=runs_suffix_only(model))
    rows = tokens.expand(samples, -1)
    sources = {name: value.expand(samples, *value.shape[1:]) for name, value in clean_cache.items()}
    cells = list(product(kinds, range(n_layers), range(n_pos)))
    variants = [[(state_name(kind, layer, state), (pos,))] for kind, layer, pos in cells]
    with model.hooks(fwd_hooks=[("hook_embed", hook)]):
        noised_logits, _, starts = base_run(model, rows)
        with executing(memory_mb, progress):
            values = score_variants(model, rows, variants, sources, metric, starts=starts, desc="causal trace").values
    strings = [model_tokenizer(model).decode([t]) for t in tokens[0].tolist()]
    frame = pd.DataFrame(cells, columns=["kind", "layer", "pos"]).assign(
        token=[strings[pos] for _, _, pos in cells], prob=values.cpu().numpy())
    return Trace(frame, metric(clean_logits).item(), metric(noised_logits).item(), strings, positions, answer_id,
                 kinds, std)


def trace_figure(trace: Trace):
    """Three heatmaps (layer x position) of the restored answer probability, one per kind, the
    subject's tokens marked with *; the clean and noised probabilities in the title."""
    n = len(trace.kinds)
    n_pos = len(trace.tokens)
    fig = new_figure(figsize=(max(6.0, 0.45 * n_pos + 2) * n / 1.6, 4.5))
    axes = np.atleast_1d(fig.subplots(1, n, sharey=True))
    labels = [token_label(t) + ("*" if i in trace.subject else "") for i, t in enumerate(trace.tokens)]
    for ax, kind in zip(axes, trace.kinds):
        grid = trace.grid(kind).cpu().numpy()
        image = ax.imshow(grid.T, aspect="auto", cmap={"resid": "Purples", "mlp": "Greens", "attn": "Reds"}[kind],
                          vmin=min(trace.corrupted_prob, float(grid.min())), origin="upper")
        ax.set_yticks(range(n_pos), labels)
        ax.set_xticks(range(grid.shape[0]))
        ax.set_xlabel("layer")
        ax.set_title(f"restored {TITLES[kind]}")
        fig.colorbar(image, ax=ax, label="p(answer)")
    fig.suptitle(f"causal trace: p(answer) clean {trace.clean_prob:.3f}, noised {trace.corrupted_prob:.3f}")
    return fig


# ------------------------------------------------------------------------------ a fact set
def caches_keys(model) -> bool:
    """Whether a forward of ``model`` can continue from earlier positions' keys and values
    (``past_kv``, GPTModel) under causal attention, so a restore need not rerun the positions before it."""
    return "past_kv" in inspect.signature(model.forward).parameters and getattr(model.cfg, "causal", True)


class PrefixCached:
    """``model`` continuing a fixed prefix: every forward (token ids, or a residual with
    ``start_at_layer``) is of the positions after it, whose attention reads the prefix's cached keys
    and values ``past`` [(keys, values) per layer, each (draws, kv_head, prefix, d_head)], row b of
    each group of ``draws`` rows (variant-major batches) reading draw b's. Everything else
    (hooks, cfg, unembed) is the model's."""

    def __init__(self, model, past: list[tuple[torch.Tensor, torch.Tensor]]):
        self.model, self.past = model, past

    def __getattr__(self, name: str):
        return getattr(self.model, name)

    def __call__(self, input, **options):
        repeats = input.shape[0] // self.past[0][0].shape[0]
        cached = [LayerKV(keys.repeat(repeats, 1, 1, 1), values.repeat(repeats, 1, 1, 1)) for keys, values in self.past]
        return self.model(input, past_kv=cached, **options)


@dataclass(frozen=True)
class TracedFact:
    """A fact ready to trace: the fact as traced (``traced_facts``), tokens (1, pos), the subject's
    positions, the answer's token (``answer_token``)."""

    fact: Fact
    tokens: torch.Tensor
    subject: list[int]
    answer: int


def prepare_facts(model, facts: list[Fact]) -> list[TracedFact]:
    """Each fact as traced, with its answer token (``traced_facts``), tokenised and its subject
    located; a fact the model's tokenizer cannot trace is refused in one line naming it."""
    prepared = []
    for number, (fact, answer) in enumerate(traced_facts(model, facts), start=1):
        try:
            tokens = encode(model, fact.prompt).tokens
            subject = subject_positions(model, fact.prompt, fact.subject)
            position_classes(tokens.shape[1], subject)
            prepared.append(TracedFact(fact, tokens, subject, answer))
        except UserError as error:
            raise UserError(f"fact {number} ({fact.prompt!r}): {error}") from None
    return prepared


def fact_curves(kinds: tuple[str, ...], window: int) -> tuple[tuple[str, int], ...]:
    """The (kind, width) restores of a fact trace: the hidden state (width 1), the MLP and attention
    windows of ``window`` layers, then (where ``window`` > 1) the MLP and attention outputs of one layer."""
    windowed = tuple((kind, 1 if kind == "resid" else window) for kind in kinds)
    return windowed + tuple((kind, 1) for kind in kinds if kind != "resid" and window > 1)


@dataclass
class FactTrace:
    """Causal tracing over a fact set. aie: one row per (kind, window, layer, position group):
    ``kind, window, layer, position, restored_prob, aie, ci_low, ci_high, n_prompts, n_tokens``
    (``aie_frame``: the pooled mean over the group's tokens of every fact that has it, n_prompts
    facts and n_tokens tokens, the interval NaN under ``MIN_INTERVAL_PROMPTS`` facts); tokens: the
    per-token curves, one row per (fact, kind, window, layer, position from the subject's first on):
    ``fact, relation, kind, window, layer, pos, token, position, subject_token, restored_prob, effect``
    (``subject_token``: 0, 1, .. along the subject, -1 after it); facts: one row per fact:
    ``relation, prompt, subject, answer, answer_token, n_tokens, n_subject_tokens, clean_prob,
    corrupted_prob``; effects: (fact, curve, layer, group) each fact's mean over its tokens of the group
    of restored - noised probability, NaN where it has none; counts: (fact, group) how many tokens;
    curves: the (kind, width) restores (``fact_curves``); kinds, n_layers, window, samples, noise_std:
    the settings; noise_over: what the noise's unit, the embedding standard deviation, was taken over
    ("the subject tokens of 595 facts", "the vocabulary")."""

    aie: pd.DataFrame
    tokens: pd.DataFrame
    facts: pd.DataFrame
    effects: np.ndarray
    counts: np.ndarray
    curves: tuple[tuple[str, int], ...]
    kinds: tuple[str, ...]
    n_layers: int
    window: int
    samples: int
    noise_std: float
    noise_over: str

    def total_effect(self, seed: int = 0) -> tuple[float, float, float]:
        """Mean over facts of clean - noised probability, with its 95% bootstrap interval."""
        return total_effect(self.facts, seed)


def total_effect(facts: pd.DataFrame, seed: int = 0) -> tuple[float, float, float]:
    """Mean over the rows of ``facts`` (``FactTrace.facts``) of clean - noised probability, with its
    95% bootstrap interval over them (NaN under ``MIN_INTERVAL_PROMPTS`` rows)."""
    each = torch.tensor((facts["clean_prob"] - facts["corrupted_prob"]).to_numpy())[:, None]
    estimate, low, high = (float(value[0]) for value in bootstrap_ratio(each, torch.ones(len(each)), seed=seed))
    return (estimate, low, high) if len(facts) >= MIN_INTERVAL_PROMPTS else (estimate, float("nan"), float("nan"))


def fact_seed(seed: int, index: int) -> int:
    """The seed of the noise draws of fact ``index`` in a trace seeded ``seed``."""
    return seed * 1_000_003 + index


def trace_facts(model, facts: list[Fact], *, samples: int = 10, noise: float = 3.0, noise_from: str = "subjects",
                noise_facts: list[Fact] | None = None, window: int = WINDOW, seed: int = 0, state: str = "resid_post",
                kinds=KINDS, memory_mb: float | None = None, progress: bool | None = None) -> FactTrace:
    """Causal tracing over ``facts`` (module docstring) -> a ``FactTrace``.

    Each fact gets ``samples`` noise draws (seed ``seed`` and its index) of standard deviation
    ``noise`` x ``noise_scale`` (``noise_from``) over the subjects of ``noise_facts`` (default:
    ``facts``; give the whole set the traced facts were drawn from, so that a fact's numbers do not
    depend on which others are traced); ``window``: the MLP and attention windows' width (single
    layers are traced beside them, ``fact_curves``); ``state``: the hidden state ``resid`` restores.
    The answer token is ``analyses.tasks.facts.answer_token``'s (filter the set with
    ``analyses.tasks.facts.top1_facts`` first, as Meng et al. trace only facts the model knows).
    Fewer than ``analyses.core.stats.MIN_INTERVAL_PROMPTS`` facts are refused: the AIE's interval is
    over facts. ``memory_mb``, ``progress``: the execution's (``analyses.core.execution``; None: the
    current one's), ``progress`` one bar over the facts."""
    _check_options(samples, state, kinds)
    if window < 1:
        raise UserError(f"window={window} must be at least 1")
    check_interval_prompts(len(facts), f"{len(facts)} fact(s) to trace", unit="facts")
    noise_facts = facts if noise_facts is None else noise_facts
    prepared = prepare_facts(model, facts)
    longest = max(one.tokens.shape[1] for one in prepared)
    with executing(memory_mb, progress) as execution:
        if caches_keys(model) and rows_within(model, longest, execution.memory_mb, logits=True, read=1) < samples:
            raise UserError(f"memory_mb={execution.memory_mb:g} holds fewer than the {samples} rows (noise draws) "
                            f"of {longest} tokens that a restore runs together (their cached keys go with them); "
                            "give a larger budget")
        kinds = traced_kinds(model, kinds, state)
        curves = fact_curves(kinds, window)
        std = noise * noise_scale(model, [f.prompt for f in noise_facts], [f.subject for f in noise_facts], noise_from)
        noise_over = f"the subject tokens of {len(noise_facts)} facts" if noise_from == "subjects" else "the vocabulary"
        n_layers = model.cfg.n_layers
        effects = np.full((len(facts), len(curves), n_layers, len(GROUPS)), np.nan)
        counts = np.zeros((len(facts), len(GROUPS)), dtype=int)
        totals, token_rows = [], []
        tokenizer = model_tokenizer(model)
        with progress_bar(total=len(facts), desc="causal tracing", unit="fact") as bar:
            for index, one in enumerate(prepared):
                draws = draw_noise(model, samples, len(one.subject), std, fact_seed(seed, index))
                clean, corrupted, restored = trace_fact(model, one, draws, curves, state)
                per_token = restored - corrupted  # (curve, layer, pos), NaN before the subject
                for name, positions in position_groups(one.tokens.shape[1], one.subject).items():
                    effects[index, :, :, GROUPS.index(name)] = per_token[:, :, positions].mean(-1)
                    counts[index, GROUPS.index(name)] = len(positions)
                token_rows.append(token_frame(index, one, tokenizer, curves, restored, per_token))
                totals.append((clean, corrupted))
                bar.update(1)
    frame = pd.DataFrame([{"relation": one.fact.relation, "prompt": one.fact.prompt, "subject": one.fact.subject,
                           "answer": one.fact.answer, "answer_token": one.answer, "n_tokens": one.tokens.shape[1],
                           "n_subject_tokens": len(one.subject), "clean_prob": clean, "corrupted_prob": corrupted}
                          for one, (clean, corrupted) in zip(prepared, totals)])
    aie = aie_frame(effects, counts, frame["corrupted_prob"].to_numpy(), curves, seed)
    return FactTrace(aie, pd.concat(token_rows, ignore_index=True), frame, effects, counts, curves, kinds, n_layers,
                     window, samples, std, noise_over)


def position_groups(n_pos: int, subject: list[int]) -> dict[str, list[int]]:
    """``position_classes`` and ``ALL_SUBJECT`` (the subject's positions) -> {group: its positions}."""
    return position_classes(n_pos, subject) | {ALL_SUBJECT: list(subject)}


def token_frame(index: int, one: TracedFact, tokenizer, curves, restored: np.ndarray,
                per_token: np.ndarray) -> pd.DataFrame:
    """Fact ``index``'s per-token curves as ``FactTrace.tokens`` rows. restored, per_token:
    (curve, layer, pos) restored probability and restored - noised, NaN before the subject."""
    n_curves, n_layers, n_pos = restored.shape
    classes = {pos: name for name, positions in position_classes(n_pos, one.subject).items() for pos in positions}
    traced = range(one.subject[0], n_pos)
    grid = pd.DataFrame(list(product(range(n_curves), range(n_layers), traced)), columns=["curve", "layer", "pos"])
    ids = one.tokens[0].tolist()
    return pd.DataFrame({
        "fact": index, "relation": one.fact.relation,
        "kind": [curves[c][0] for c in grid["curve"]], "window": [curves[c][1] for c in grid["curve"]],
        "layer": grid["layer"], "pos": grid["pos"], "token": [tokenizer.decode([ids[p]]) for p in grid["pos"]],
        "position": [classes[p] for p in grid["pos"]],
        "subject_token": [one.subject.index(p) if p in one.subject else -1 for p in grid["pos"]],
        "restored_prob": restored[grid["curve"], grid["layer"], grid["pos"]],
        "effect": per_token[grid["curve"], grid["layer"], grid["pos"]]})


def trace_fact(model, one: TracedFact, draws: torch.Tensor, curves,
               state: str) -> tuple[float, float, np.ndarray]:
    """One fact under the noise ``draws`` (samples, n_subject, d_model) -> (clean probability, noised
    probability (mean over draws), restored probability (len(curves), n_layers, pos), mean over draws,
    NaN before the subject). Each (curve, layer) restore puts back one token; each token's restores
    run one engine sweep (from that token on where the model caches keys, ``PrefixCached``)."""
    n_layers, samples, n_pos = model.cfg.n_layers, draws.shape[0], one.tokens.shape[1]
    names = sorted({state_name(kind, at, state) for kind, _ in curves for at in range(n_layers)})
    clean_logits, clean_cache = cache_run(model, one.tokens, names)
    metric = answer_probability(one.answer, parts=runs_suffix_only(model))
    rows = one.tokens.expand(samples, -1)
    cached = caches_keys(model)
    past = [LayerKV() for _ in range(n_layers)] if cached else None
    with torch.no_grad(), model.hooks(fwd_hooks=[("hook_embed", noise_hook(draws, one.subject))]):
        noised_logits = model(rows, past_kv=past) if cached else model(rows)
    keys = [(layer.keys, layer.values) for layer in past] if cached else None
    restored = np.full((len(curves), n_layers, n_pos), np.nan)
    for pos in range(one.subject[0], n_pos):
        sweep = restore_sweep(model, rows, one.subject, draws, pos, pos if cached else 0, keys, clean_cache, metric,
                              curves, state)
        restored[:, :, pos] = sweep.reshape(len(curves), n_layers).cpu().double().numpy()
    return metric(clean_logits).item(), metric(noised_logits).item(), restored


def restore_sweep(model, rows: torch.Tensor, subject: list[int], draws: torch.Tensor, pos: int, start: int, keys,
                  clean_cache: dict, metric, curves, state: str) -> torch.Tensor:
    """The answer probability (len(curves) * n_layers,) with the clean states of each (kind, width) of
    ``curves`` restored at ``pos`` at each layer (``restored_layers``), the subject noised by
    ``draws``: one ``score_variants`` sweep over the positions from ``start`` on (``keys``: the noised
    run's keys and values per layer, of which the first ``start`` positions are read; None with ``start`` 0),
    within the current execution's memory and without a bar."""
    n_layers, samples = model.cfg.n_layers, draws.shape[0]
    runner = model if start == 0 else PrefixCached(model, [(k[:, :, :start], v[:, :, :start]) for k, v in keys])
    later = [i for i, at in enumerate(subject) if at >= start]  # noise still to add at the embedding
    hooks = [("hook_embed", noise_hook(draws[:, later], [subject[i] - start for i in later]))] if later else []
    variants = [[Edit(state_name(kind, at, state), ([pos - start],))
                 for at in restored_layers(kind, layer, n_layers, width)]
                for kind, width in curves for layer in range(n_layers)]
    sources = {name: value[:, start:].expand(samples, -1, -1) for name, value in clean_cache.items()}
    suffix = rows[:, start:]
    with model.hooks(fwd_hooks=hooks):
        _, _, starts = base_run(runner, suffix)
        with executing(progress=False):
            return score_variants(runner, suffix, variants, sources, metric, starts=starts).values


def aie_frame(effects: np.ndarray, counts: np.ndarray, corrupted: np.ndarray, curves, seed: int = 0) -> pd.DataFrame:
    """The average indirect effect per (curve, layer, position group): the pooled mean over the
    group's tokens of every fact that has it, with its 95% bootstrap interval over those facts
    (``analyses.core.stats.bootstrap_ratio``, seeded; NaN under ``MIN_INTERVAL_PROMPTS`` facts) ->
    the ``FactTrace.aie`` frame. effects: (fact, curve, layer, group) per-fact means; counts: (fact,
    group) their tokens; corrupted: (fact,) noised probabilities."""
    parts = []
    _, _, n_layers, _ = effects.shape
    grid = pd.DataFrame([(kind, width, layer) for kind, width in curves for layer in range(n_layers)],
                        columns=["kind", "window", "layer"])
    for g, name in enumerate(GROUPS):
        have = counts[:, g] > 0
        if not have.any():
            continue
        weights = torch.tensor(counts[have, g], dtype=torch.float64)
        sums = torch.tensor(effects[have, :, :, g]) * weights[:, None, None]
        estimate, low, high = bootstrap_ratio(sums, weights, seed=seed)
        if have.sum() < MIN_INTERVAL_PROMPTS:
            low, high = torch.full_like(low, float("nan")), torch.full_like(high, float("nan"))
        noised = float((corrupted[have] * counts[have, g]).sum() / counts[have, g].sum())
        estimate, low, high = (x.flatten().cpu().numpy() for x in (estimate, low, high))
        parts.append(grid.assign(position=name, restored_prob=estimate + noised, aie=estimate, ci_low=low,
                                 ci_high=high, n_prompts=int(have.sum()),
                                 n_tokens=int(counts[have, g].sum())))
    return pd.concat(parts, ignore_index=True)


def relation_aie(trace: FactTrace, seed: int = 0) -> pd.DataFrame:
    """``trace.aie`` per relation: ``aie_frame`` over each relation's facts alone (in order of first
    appearance; a user's facts without one are the relation ""), a ``relation`` column first."""
    parts = []
    corrupted = trace.facts["corrupted_prob"].to_numpy()
    for relation in trace.facts["relation"].unique():
        rows = (trace.facts["relation"] == relation).to_numpy()
        frame = aie_frame(trace.effects[rows], trace.counts[rows], corrupted[rows], trace.curves, seed)
        parts.append(frame.assign(relation=relation))
    joined = pd.concat(parts, ignore_index=True)
    return joined[["relation", *trace.aie.columns]]


def mlp_curve(aie: pd.DataFrame, position: str, window: int) -> pd.DataFrame:
    """The MLP restores of width ``window`` at ``position`` of an AIE frame, by layer."""
    return aie[(aie["kind"] == "mlp") & (aie["window"] == window) & (aie["position"] == position)].sort_values("layer")


def relation_lines(trace: FactTrace, seed: int = 0) -> list[str]:
    """One line per relation: its facts' total effect (clean - noised probability) and, on a model with
    MLPs, the peak of the last subject token's MLP-window AIE, each with its 95% interval over facts."""
    lines = []
    by_relation = relation_aie(trace, seed)
    for relation, facts in trace.facts.groupby("relation", sort=False):
        line = (f"{relation or '(no relation)'} ({len(facts)} fact{'s' * (len(facts) != 1)}): total effect "
                f"{effect_text(*total_effect(facts, seed), 4)}")
        curve = mlp_curve(by_relation[by_relation["relation"] == relation], "last subject token", trace.window)
        if len(curve):
            best = curve.loc[curve["aie"].idxmax()]
            line += (f"; the last subject token's {trace.window}-layer MLP window peaks at layer {int(best['layer'])}, "
                     f"AIE {effect_text(best['aie'], best['ci_low'], best['ci_high'], 4)}")
        lines.append(line)
    return lines


def single_layer_text(trace: FactTrace) -> str:
    """The last subject token's one-layer MLP restores in a sentence: layer 0's AIE beside the best of
    the later layers', each with its interval, whether layer 0's interval lies above, and why it can."""
    curve = mlp_curve(trace.aie, "last subject token", 1).set_index("layer")
    if curve.empty:
        raise UserError("the one-layer restores read the MLPs' AIE; this model has no MLPs (or they were not traced)")
    first = curve.loc[0]
    text = (f"one MLP layer restored at the last subject token: layer 0 "
            f"{effect_text(first['aie'], first['ci_low'], first['ci_high'], 4)}")
    later = curve.drop(index=0)
    if len(later):
        layer = int(later["aie"].idxmax())
        best = later.loc[layer]
        above = bool(first["ci_low"] > best["ci_high"])
        text += (f", the best later layer {layer} {effect_text(best['aie'], best['ci_low'], best['ci_high'], 4)}: "
                 f"layer 0 {'stands' if above else 'does not stand'} above the rest")
    return text + (" (the first MLP acts as an extended embedding of the subject token, so restoring it alone can "
                   "undo part of the noise, and every MLP window that contains layer 0 includes it)")


# ------------------------------------------------------------------------------ the verdict
def middle_layers(n_layers: int) -> range:
    """The middle layers: all but the first and the last quarter (n_layers // 4 each): 7..22 of 30,
    12..35 of GPT-2 XL's 48 (where Meng et al.'s MLP peak lies)."""
    return range(n_layers // 4, n_layers - n_layers // 4)


@dataclass(frozen=True)
class Verdict:
    """Whether Meng et al.'s picture formed: ``formed``; ``peak_layer`` of the last subject token's
    MLP-window AIE; ``middle``: the middle layers; ``peak``: (aie, ci_low, ci_high) there; ``others``:
    {subject class: (aie, ci_low, ci_high) at the peak layer}; ``text``: the sentence with the numbers."""

    formed: bool
    peak_layer: int
    middle: range
    peak: tuple[float, float, float]
    others: dict
    text: str


def trace_verdict(trace: FactTrace) -> Verdict:
    """"formed" only if the last subject token's MLP-window AIE peaks in the ``middle_layers`` and its
    95% interval there lies above the intervals of the other subject positions (first, middle) at that
    layer (at least one of them present); else "did not form", with the numbers."""
    aie = trace.aie[(trace.aie["kind"] == "mlp") & (trace.aie["window"] == trace.window)]
    if aie.empty:
        raise UserError("the verdict reads the MLP window's AIE; this model has no MLPs (or they were not traced)")
    curve = aie[aie["position"] == "last subject token"].sort_values("layer")
    best = curve.loc[curve["aie"].idxmax()]
    layer, middle = int(best["layer"]), middle_layers(trace.n_layers)
    peak = (float(best["aie"]), float(best["ci_low"]), float(best["ci_high"]))
    at_peak = aie[(aie["layer"] == layer) & aie["position"].isin(SUBJECT_CLASSES[:2])]
    others = {row.position: (row.aie, row.ci_low, row.ci_high) for row in at_peak.itertuples()}
    in_middle = layer in middle
    apart = bool(others) and all(peak[1] > high for _, _, high in others.values())
    described = "; ".join(f"{name} {effect_text(*interval, 4)}" for name, interval in others.items())
    text = (f"{'formed' if in_middle and apart else 'did not form'}: the last subject token's {trace.window}-layer "
            f"MLP window peaks at layer {layer} (middle layers {middle.start}-{middle.stop - 1}: "
            f"{'in' if in_middle else 'outside'}) with AIE {effect_text(*peak, 4)}; "
            f"at that layer {described or 'no other subject position (one-token subjects only)'}: "
            f"{'separated' if apart else 'not separated'} (n = {int(best['n_prompts'])} facts)")
    return Verdict(in_middle and apart, layer, middle, peak, others, text)


def facts_figure(trace: FactTrace, verdict: Verdict | None = None):
    """Meng et al.'s panels: one heatmap (position class x layer) of the AIE per kind (hidden state,
    MLP window, attention window), and the subject tokens' MLP-window AIE over layers, with the last
    subject token's one-layer MLP restores dashed beside it, with 95% bands and the middle layers shaded."""
    fig = new_figure(figsize=(5.2 * (len(trace.kinds) + 1), 4.2))
    axes = fig.subplots(1, len(trace.kinds) + 1)
    present = [name for name in CLASSES if name in set(trace.aie["position"])]
    for ax, kind in zip(axes, trace.kinds):
        width = 1 if kind == "resid" else trace.window
        cells = trace.aie[(trace.aie["kind"] == kind) & (trace.aie["window"] == width)]
        grid = cells.pivot(index="position", columns="layer", values="aie").loc[present]
        image = ax.imshow(grid.to_numpy(), aspect="auto",
                          cmap={"resid": "Purples", "mlp": "Greens", "attn": "Reds"}[kind])
        ax.set_yticks(range(len(present)), present)
        ax.set_xlabel("layer")
        ax.set_title(f"restored {TITLES[kind]}" + ("" if kind == "resid" else f" ({width}-layer window)"))
        fig.colorbar(image, ax=ax, label="AIE")
    ax = axes[-1]
    if "mlp" in trace.kinds:
        lines = [(name, trace.window, "-") for name in SUBJECT_CLASSES if name in present]
        lines += [("last subject token", 1, "--")] if trace.window > 1 else []
        for name, width, style in lines:
            line = mlp_curve(trace.aie, name, width)
            ax.plot(line["layer"], line["aie"], style, marker="o", markersize=3, label=f"{name}, {width}-layer")
            ax.fill_between(line["layer"], line["ci_low"], line["ci_high"], alpha=0.25)
        middle = middle_layers(trace.n_layers)
        ax.axvspan(middle.start - 0.5, middle.stop - 0.5, color="0.9", zorder=0, label="middle layers")
        ax.axhline(0, color="0.5", linewidth=0.8)
        ax.legend(fontsize=7)
    ax.set_xlabel("layer")
    ax.set_ylabel("AIE (95% interval)")
    ax.set_title("MLP restores at the subject")
    n = len(trace.facts)
    fig.suptitle(f"causal tracing over {n} facts ({trace.samples} draws each)"
                 + (f": {verdict.text.split(':')[0]}" if verdict is not None else ""))
    return fig
