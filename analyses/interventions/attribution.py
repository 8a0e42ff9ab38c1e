"""Attribution patching, judged (Nanda 2023; Syed et al. 2023): the estimate itself is
``patch_components(method="attribution")`` (exact patching linearised, about three
forward-equivalents for every cell); here are its shortcuts, how well it agrees with exact
patching (measured, never assumed), and the screen that measures exactly only the cells the
estimate says matter (``Screen``, ``screened_patches``; path patching's edges take the same rule,
``analyses.circuits.path_patching.screened_path_patch``), with the shortlist that ranks every head
by attribution and confirms the top ones exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pandas as pd
import torch

from analyses.core.execution import executing
from analyses.core.hook_check import require_edit
from analyses.core.hook_names import z_names
from analyses.core.metrics import Metric, PromptScores
from analyses.core.checks import check_choice
from analyses.interventions.patching import COMPONENTS, base_and_source, patch_components, prepare
from analyses.interventions.run import Contrast, Options, Run
from interp.errors import UserError


def attribution_patch_heads(model, clean_tokens, corrupted_tokens, metric: Metric, **keywords) -> torch.Tensor:
    """The estimated ``patch_heads``, a tensor [n_layers, n_heads]: ``patch_components(..., "heads",
    method="attribution")``."""
    return patch_components(model, clean_tokens, corrupted_tokens, metric, "heads", method="attribution", **keywords)


def attribution_patch_mlps(model, clean_tokens, corrupted_tokens, metric: Metric, **keywords) -> torch.Tensor:
    """The estimated ``patch_mlps``: ``patch_components(..., "mlps", method="attribution")``."""
    return patch_components(model, clean_tokens, corrupted_tokens, metric, "mlps", method="attribution", **keywords)


def attribution_agreement(attributed: torch.Tensor, exact: torch.Tensor, top_k: int = 10, *,
                          baseline: float) -> dict[str, float]:
    """How well attribution matches exact patching (same shape): Pearson and Spearman correlation
    of the cells, the largest absolute error, and the share of exact's ``top_k`` cells by effect
    size (distance from ``baseline``, the unpatched run's metric: ``unpatched_value``) that
    attribution also puts in its top k."""
    if attributed.shape != exact.shape:
        raise UserError(f"shapes differ: attribution {tuple(attributed.shape)} vs exact {tuple(exact.shape)}")
    a = pd.Series(attributed.detach().flatten().cpu().double().numpy())
    e = pd.Series(exact.detach().flatten().cpu().double().numpy())
    k = min(top_k, len(e))
    top = lambda s: set((s - baseline).abs().nlargest(k).index)  # noqa: E731
    return {
        "pearson": float(a.corr(e)),
        "spearman": float(a.rank().corr(e.rank())),
        "max_abs_error": float((a - e).abs().max()),
        f"top{k}_overlap": len(top(a) & top(e)) / k,
    }


def unpatched_value(model, clean_tokens, corrupted_tokens, metric: Metric, *, direction: str = "denoise",
                    normalize: bool = False, memory_mb: float | None = None) -> float:
    """The metric of the run that patching edits (the corrupted run when denoising, the clean one
    when noising): every patched cell's effect is measured from it. Normalised: 0 when denoising,
    1 when noising. ``memory_mb``: the budget of that run (``Run.make``; None: the current
    execution's, ``analyses.core.execution``)."""
    base, _ = base_and_source(model, clean_tokens, corrupted_tokens, direction)
    if normalize:
        return 0.0 if direction == "denoise" else 1.0
    with executing(memory_mb):
        return Run.make(model, base, metric, starts=False).baseline


@dataclass(frozen=True)
class Screen:
    """Which cells of a sweep (patching cells, path-patching edges) are measured exactly when
    attribution screens it: every cell's effect is first estimated to first order (its estimated
    metric minus the unpatched run's); measured exactly are the ``top_k`` cells of largest
    |estimated effect| and every cell whose |estimated effect| reaches ``share`` x |clean -
    corrupted| (``math.inf``: none by share); the other cells keep their estimate. Where clean and
    corrupted give the same metric, every cell reaches the share: all are measured."""

    top_k: int = 20
    share: float = 0.02

    def __post_init__(self):
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise UserError(f"screen top_k={self.top_k!r} must be a whole number >= 0")
        if not self.share > 0:
            raise UserError(f"screen share={self.share!r} must be > 0 (a share of |clean - corrupted|, or inf)")

    def chosen(self, effect: torch.Tensor, gap: float) -> torch.Tensor:
        """The cells measured exactly: ``effect`` (any shape) the estimated effects, ``gap`` clean
        minus corrupted -> bool, ``effect``'s shape."""
        size = effect.detach().abs().flatten().cpu()
        keep = size >= self.share * abs(gap) if math.isfinite(self.share) else torch.zeros_like(size, dtype=torch.bool)
        keep[size.argsort(descending=True, stable=True)[:self.top_k]] = True
        return keep.reshape(effect.shape).to(effect.device)

    def describe(self, unit: str = "cells") -> str:
        """The rule in words, e.g. for a page: "the 20 cells of largest |estimated effect| and every
        cell whose |estimated effect| reaches 0.02 of |clean - corrupted|"."""
        by_share = (f" and every {unit[:-1]} whose |estimated effect| reaches {self.share:g} of |clean - corrupted|"
                    if math.isfinite(self.share) else "")
        return f"the {self.top_k} {unit} of largest |estimated effect|{by_share}"


# the screen of `interp task` and of the report's circuit, measured on SmolLM2-135M's IOI against every
# cell and edge exact (benchmarks/README.md)
DEFAULT_SCREEN = Screen(top_k=20, share=0.02)


@dataclass
class Screened:
    """A screened sweep, each of the sweep's shape: ``values`` (the exact patched metric where
    ``exact``, the estimate elsewhere), ``exact`` (bool) and ``estimate`` (every cell's); and
    ``scores``, the exact cells' per-prompt scores (``PromptScores``, in the flattened order of the
    exact cells), from which their intervals are drawn (``Contrast.intervals``)."""

    values: torch.Tensor
    exact: torch.Tensor
    estimate: torch.Tensor
    scores: PromptScores


def screened_patches(model, clean_tokens, corrupted_tokens, metric: Metric, component: str = "heads", *,
                     by_position: bool = False, screen: Screen = Screen(), estimate: torch.Tensor | None = None,
                     contrast: Contrast | None = None, options: Options | None = None, memory_mb: float | None = None,
                     progress: bool | None = None, **keywords) -> Screened:
    """``patch_components`` screened by attribution: every cell estimated (``method="attribution"``,
    or ``estimate``, the unnormalised estimate given), the cells ``screen`` chooses measured
    exactly (one suffix run each, batched as ``patch_components`` batches them), the others left at
    their estimate. Same shapes, options and execution as ``patch_components``; ``contrast``: one ``prepare``
    made already for the component's hooks (else made here). The exact cells equal
    ``patch_components``'s."""
    check_choice("component", component, COMPONENTS)
    options = Options.of(options, keywords)
    with executing(memory_mb, progress):
        if estimate is None:
            estimate = patch_components(model, clean_tokens, corrupted_tokens, metric, component,
                                        by_position=by_position, method="attribution",
                                        options=options.but(normalize=False))
        if contrast is None:
            contrast = prepare(model, clean_tokens, corrupted_tokens, metric, COMPONENTS[component].names(model),
                               options.direction)
        variants, shape = COMPONENTS[component].variants(model, contrast.tokens.shape[1], by_position)
        if tuple(estimate.shape) != shape:
            raise UserError(f"the estimate has shape {tuple(estimate.shape)}, the sweep {shape}")
        exact = screen.chosen(estimate - contrast.baseline, contrast.clean_value - contrast.corrupted_value)
        chosen = exact.flatten().nonzero()[:, 0].tolist()
        values = estimate.detach().clone().float()
        scores = contrast.score([variants[i] for i in chosen], f"patch {component} (screened)")
    values.view(-1)[chosen] = scores.values.to(values.device)
    if options.normalize:
        values, estimate = contrast.normalize(values), contrast.normalize(estimate)
    return Screened(values, exact, estimate, scores)


def shortlist_patch_heads(
    model,
    clean_tokens,
    corrupted_tokens,
    metric: Metric,
    k: int = 10,
    *,
    direction: str = "denoise",
    normalize: bool = False,
    memory_mb: float | None = None,
    progress: bool | None = None,
    seed: int = 0,
) -> pd.DataFrame:
    """Attribution ranks every head; exact patching confirms the ``k`` with the largest estimated
    effect (``screened_patches`` with ``Screen(k, math.inf)``).

    Returns one row per head, by rank: ``rank, layer, head, attribution`` (estimated patched
    metric), ``value`` (exact where ``exact`` is True, else the attribution estimate), ``exact``,
    ``baseline`` (the unpatched run's metric, in ``value``'s units), and for the exact rows
    ``effect`` (value - baseline) with its 95% bootstrap interval over prompts ``ci_low, ci_high``
    (seeded by ``seed``, as ``patch_effects`` draws it) and ``n_prompts``; an estimate has no
    interval (NaN), being a first-order estimate rather than a measurement.
    Costs about 5 forwards (the attribution's over chunks of prompts within ``memory_mb``) + the
    exact patches of k heads (suffix forwards on GPTModel). ``memory_mb``, ``progress``: the
    execution's (``analyses.core.execution``; None: the current one's).
    """
    require_edit(model, "hook_z", "shortlist_patch_heads")
    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
    if not 0 <= k <= n_layers * n_heads:
        raise UserError(f"k={k} out of range [0, {n_layers * n_heads}] (the model has that many heads)")
    with executing(memory_mb, progress):
        contrast = prepare(model, clean_tokens, corrupted_tokens, metric, z_names(model), direction)
        screened = screened_patches(model, clean_tokens, corrupted_tokens, metric, "heads",
                                    screen=Screen(k, math.inf), contrast=contrast,
                                    options=Options(direction, normalize))
    baseline = contrast.normalize(torch.tensor(contrast.baseline)) if normalize else contrast.baseline
    order = (screened.estimate - baseline).abs().flatten().argsort(descending=True, stable=True).cpu()
    frame = pd.DataFrame([divmod(int(i), n_heads) for i in order], columns=["layer", "head"])
    frame.insert(0, "rank", range(len(frame)))
    frame["attribution"] = screened.estimate.flatten()[order].cpu().numpy()
    frame["value"] = screened.values.flatten()[order].cpu().numpy()
    frame["exact"] = screened.exact.flatten()[order].cpu().numpy()
    frame["baseline"] = float(baseline)
    low, high, n_prompts = contrast.intervals(screened.scores, normalize=normalize, seed=seed)
    exact_cells = screened.exact.flatten().nonzero()[:, 0].cpu()  # the order of ``screened.scores``
    row_of = {int(cell): row for row, cell in enumerate(order.tolist())}
    rows = [row_of[int(cell)] for cell in exact_cells]
    for column, values in (("effect", screened.values.flatten()[exact_cells].cpu().double() - float(baseline)),
                           ("ci_low", low), ("ci_high", high)):
        frame[column] = float("nan")
        frame.loc[rows, column] = values.cpu().numpy()
    frame["n_prompts"] = pd.array([n_prompts if exact else pd.NA for exact in frame["exact"]], dtype="Int64")
    return frame
