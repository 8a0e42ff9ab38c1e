"""Causal tracing (Meng et al. 2022, "Locating and Editing Factual Associations in GPT"; DESIGN 4.9).

Corrupt the subject: Gaussian noise of ``noise`` (3 by default) times the embedding's standard
deviation is added to the subject tokens' embeddings (``hook_embed``), one seeded draw per noise
sample. Then restore one state of the clean run -- a layer's residual stream (``resid_post``, the
layer's output, or ``resid_pre``, its input), its MLP output or its attention output -- at one
position, and measure the probability of the answer at the last token. The three heatmaps
(layer x position) show where the clean information must flow for the answer to come back.

The embedding's standard deviation is that of ``hook_embed`` over every ordinary token of the
vocabulary (the whole embedding table, as the model sees it).

How it runs: the noise samples are the rows of one batch (the prompt repeated), so the corrupted
run is one forward of ``samples`` rows; every restoration is a variant of the intervention engine
(``analyses.interventions.engine.evaluate_variants``), many per forward, chunked to ``memory_mb``, its
source the clean run's state. On ``GPTModel`` a restoration at layer l starts from the noised run's
residual entering l and computes only the rest; elsewhere the noise hook is on during the full
forward. Each restored (state, layer, position) therefore costs one row batch of at most one
forward, and less where the run starts mid-stream (``trace_rows`` counts them).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product

import numpy as np
import pandas as pd
import torch

from analyses.core.budget import DEFAULT_MEMORY_MB
from analyses.interventions.engine import base_run, cache_run, check_choice, evaluate_variants
from analyses.core.plots import new_figure, token_label
from analyses.tasks.task import single_token
from analyses.core.tokens import encode, model_tokenizer, ordinary_token_ids
from interp.errors import UserError

KINDS = ("resid", "mlp", "attn")
STATES = ("resid_post", "resid_pre")


def state_name(kind: str, layer: int, state: str = "resid_post") -> str:
    """The hook a restoration of ``kind`` at ``layer`` replaces, (batch, pos, d_model)."""
    return {"resid": f"blocks.{layer}.hook_{state}", "mlp": f"blocks.{layer}.hook_mlp_out",
            "attn": f"blocks.{layer}.hook_attn_out"}[kind]


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


def subject_positions(model, prompt: str, subject: str) -> list[int]:
    """The positions (start token = 0) of the tokens that spell ``subject``'s first occurrence in
    ``prompt`` (with the space before it, where one is); a one-line error where ``subject`` is not in
    the prompt or its tokens do not line up with the prompt's."""
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
    return list(range(len(before) + 1, len(through) + 1))


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


def answer_probability(answer: int):
    """Metric: mean over rows of the probability of ``answer`` at the last position."""
    def metric(logits: torch.Tensor) -> torch.Tensor:
        return logits[:, -1].float().softmax(dim=-1)[:, answer].mean()

    metric.read_positions = -1
    return metric


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


def causal_trace(model, prompt: str, subject: str, answer: str | None = None, *, samples: int = 10,
                 noise: float = 3.0, seed: int = 0, state: str = "resid_post",
                 kinds=KINDS, memory_mb: float = DEFAULT_MEMORY_MB, progress: bool | None = None) -> Trace:
    """Causal tracing of ``prompt`` (see the module docstring) -> a ``Trace``.

    ``subject``: text in the prompt whose tokens are noised; ``answer``: the text that continues the
    prompt as one token (e.g. " Paris"; default: the clean run's top token); ``samples``: noise
    draws; ``noise``: the noise's standard deviation in units of the embedding's; ``state``: which
    residual stream "resid" restores ("resid_post" or "resid_pre"); ``kinds``: of ``KINDS``."""
    check_choice("state", state, STATES)
    for kind in kinds:
        check_choice("kind", kind, KINDS)
    if samples < 1:
        raise UserError(f"samples={samples} must be at least 1")
    tokens = encode(model, prompt).tokens  # (1, pos)
    positions = subject_positions(model, prompt, subject)
    n_layers, n_pos = model.cfg.n_layers, tokens.shape[1]
    kinds = tuple(kind for kind in kinds if state_name(kind, 0, state) in model.hook_dict)  # no MLP: not traced
    names = [state_name(kind, layer, state) for kind in kinds for layer in range(n_layers)]
    clean_logits, clean_cache = cache_run(model, tokens, names)
    answer_id = int(clean_logits[0, -1].argmax()) if answer is None else _answer_id(model, prompt, answer)
    std = noise * embedding_std(model)
    hook = noise_hook(draw_noise(model, samples, len(positions), std, seed), positions)
    metric = answer_probability(answer_id)
    rows = tokens.expand(samples, -1)
    sources = {name: value.expand(samples, *value.shape[1:]) for name, value in clean_cache.items()}
    cells = list(product(kinds, range(n_layers), range(n_pos)))
    variants = [[(state_name(kind, layer, state), (pos,))] for kind, layer, pos in cells]
    with model.hooks(fwd_hooks=[("hook_embed", hook)]):
        noised_logits, _, starts = base_run(model, rows)
        values = evaluate_variants(model, rows, variants, sources, metric, starts=starts, memory_mb=memory_mb,
                                   progress=progress, desc="causal trace")
    strings = [model_tokenizer(model).decode([t]) for t in tokens[0].tolist()]
    frame = pd.DataFrame(cells, columns=["kind", "layer", "pos"]).assign(
        token=[strings[pos] for _, _, pos in cells], prob=values.cpu().numpy())
    return Trace(frame, metric(clean_logits).item(), metric(noised_logits).item(), strings, positions, answer_id,
                 kinds, std)


def _answer_id(model, prompt: str, answer: str) -> int:
    """The id of ``answer``, the exact text that continues ``prompt`` as one token."""
    hit = single_token(model_tokenizer(model), prompt, answer, sep="")
    if hit is None or hit[0] != prompt:
        raise UserError(f"answer {answer!r} is not one token after the prompt (give the exact continuation, "
                        "e.g. ' Paris' with its space)")
    return hit[1]


def trace_figure(trace: Trace):
    """Three heatmaps (layer x position) of the restored answer probability, one per kind, the
    subject's tokens marked with *; the clean and noised probabilities in the title."""
    n = len(trace.kinds)
    n_pos = len(trace.tokens)
    fig = new_figure(figsize=(max(6.0, 0.45 * n_pos + 2) * n / 1.6, 4.5), layout="constrained")
    axes = np.atleast_1d(fig.subplots(1, n, sharey=True))
    labels = [token_label(t) + ("*" if i in trace.subject else "") for i, t in enumerate(trace.tokens)]
    titles = {"resid": "hidden state", "mlp": "MLP output", "attn": "attention output"}
    for ax, kind in zip(axes, trace.kinds):
        grid = trace.grid(kind).cpu().numpy()
        image = ax.imshow(grid.T, aspect="auto", cmap={"resid": "Purples", "mlp": "Greens", "attn": "Reds"}[kind],
                          vmin=min(trace.corrupted_prob, float(grid.min())), origin="upper")
        ax.set_yticks(range(n_pos), labels)
        ax.set_xticks(range(grid.shape[0]))
        ax.set_xlabel("layer")
        ax.set_title(f"restored {titles[kind]}")
        fig.colorbar(image, ax=ax, label="p(answer)")
    fig.suptitle(f"causal trace: p(answer) clean {trace.clean_prob:.3f}, noised {trace.corrupted_prob:.3f}")
    return fig
