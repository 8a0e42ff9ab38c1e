"""Intervals over prompts: the statistics every printed effect stands on (architecture §4.12).

An effect measured on a batch is a pooled mean over prompts: per prompt a numerator (the summed
change of the metric over the entries the prompt counts) and a denominator (how many entries it
counts: 1 for a logit difference read at one position, the number of counted tokens for a loss).
Its interval is a seeded percentile bootstrap over prompts (Efron's percentile interval, which is
what TransformerLens's peers do not print and what Wang et al. 2022 report): prompts are drawn with
replacement, the pooled mean recomputed, and the 2.5% and 97.5% quantiles of the resamples kept.

``bootstrap_ratio`` is the one resampler; ``EFFECT_COLUMNS`` names the columns it fills in a frame;
``effect_intervals`` bootstraps the effects of a sweep's interventions from the per-prompt scores
(``analyses.core.metrics.PromptScores``) of each and of the unedited run;
``control_intervals`` bootstraps a control's mean effect and the ratio of a tested effect to it over
the same prompts (paired), for "these heads matter N times as much as random heads"; ``control_z``
gives the tested effect's distance from the random sets' effects in units of their spread, with its
interval from the same resamples, and ``normal_p_value`` its p-value under a normal null, at the
interval's bound nearest 0.

Where prompts come in clusters of near-copies (prompts that differ only in what the behaviour does
not depend on), the prompts of one cluster are not independent draws: ``bootstrap_cluster_ratio``
draws clusters with replacement and pools the numerators and counts of their prompts (with one
prompt per cluster it is ``bootstrap_ratio``, draw for draw). ``paired_difference`` gives the
interval of the difference between two conditions measured on the same prompts, both resampled with
the same draws: two marginal intervals that overlap say nothing about their difference.
"""

from __future__ import annotations

import math
from typing import Hashable, Sequence

import torch

from analyses.core.metrics import PromptScores
from interp.errors import UserError

N_BOOT = 1000  # bootstrap resamples over prompts, everywhere an interval is printed
LEVEL = 0.95  # the intervals' coverage
EFFECT_COLUMNS = ("ci_low", "ci_high", "n_prompts")  # beside each effect's mean, in every effect frame
# the fewest prompts an interval over prompts is printed for: every resample of one prompt is that
# prompt, so its interval has zero width and "excludes 0" whenever the effect is not 0
MIN_INTERVAL_PROMPTS = 2


def check_interval_prompts(n_prompts: int, what: str, unit: str = "prompts") -> None:
    """Refuse, in one line, ``n_prompts`` below ``MIN_INTERVAL_PROMPTS`` where an interval is to be
    bootstrapped over them. ``what``: the count and where it came from ("--limit 1"); ``unit``: what
    the prompts are called there ("facts")."""
    if n_prompts < MIN_INTERVAL_PROMPTS:
        raise UserError(f"{what}: an interval over {unit} needs at least {MIN_INTERVAL_PROMPTS} {unit}, since one "
                        f"{unit[:-1]}'s resamples are all that {unit[:-1]} (a zero-width interval)")


def resample_weights(n_prompts: int, n_boot: int = N_BOOT, seed: int = 0) -> torch.Tensor:
    """How often each prompt is drawn in each bootstrap resample: (n_boot, n_prompts) float64, each
    row summing to n_prompts. Seeded, and the same for every quantity resampled with the same seed,
    so intervals of paired quantities (an effect and its control) use the same prompts."""
    generator = torch.Generator().manual_seed(seed)
    draws = torch.randint(n_prompts, (n_boot, n_prompts), generator=generator)
    return torch.zeros(n_boot, n_prompts, dtype=torch.float64).scatter_add_(
        1, draws, torch.ones(n_boot, n_prompts, dtype=torch.float64))


def percentile_bounds(resampled: torch.Tensor, level: float = LEVEL) -> tuple[torch.Tensor, torch.Tensor]:
    """The (low, high) percentile bounds over the first dim of ``resampled`` (n_boot, ...)."""
    tail = (1 - level) / 2
    bounds = torch.nanquantile(resampled.double(), torch.tensor([tail, 1 - tail], dtype=torch.float64), dim=0)
    return bounds[0], bounds[1]


def bootstrap_ratio(sums: torch.Tensor, counts: torch.Tensor, n_boot: int = N_BOOT, seed: int = 0,
                    level: float = LEVEL) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pooled ratio sum(sums) / sum(counts) with a percentile bootstrap over prompts.

    sums: (batch, ...) per-prompt numerators; counts: (batch,) per-prompt denominators.
    Returns (estimate, ci_low, ci_high), each of shape sums.shape[1:], float64 on the CPU.
    """
    return _weighted_ratio(sums, counts, resample_weights(sums.shape[0], n_boot, seed), level)


def effect_intervals(scores: PromptScores, baseline: PromptScores, n_batch: int, *,
                     scale: torch.Tensor | None = None, seed: int = 0,
                     n_boot: int = N_BOOT) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Seeded 95% percentile bootstrap intervals over prompts (``bootstrap_ratio``)
    of the effects ``scores.values - baseline.values`` of one metric on the same ``n_batch`` prompts
    -> (ci_low, ci_high), each of ``scores.values``' shape, float64 on the CPU, and n_prompts.

    Each prompt's effect numerator is its numerator under the intervention minus its baseline
    numerator, over its count (the same in both: one metric, one batch), so a resample's effect is
    sum(differences) / sum(counts) over the prompts drawn, the pooled mean the effect itself is.
    For a normalised effect, (value - baseline) / (clean - corrupted), the denominators are ``scale``
    (batch,) instead: each prompt's clean minus corrupted numerator. Prompts that count nothing are
    left out; n_prompts counts the rest. A metric that does not split (``analyses.core.metrics.Metric.splits``:
    a plain callable) gets NaN intervals and n_prompts ``n_batch``. The cells are
    resampled a few thousand at a time, each time with the same draws (``seed``)."""
    shape = scores.values.shape
    if scores.numerators is None or baseline.numerators is None:
        nan = torch.full(shape, float("nan"), dtype=torch.float64)
        return nan, nan.clone(), n_batch
    counted = (baseline.counts > 0).cpu()
    differences = (scores.numerators - baseline.numerators).reshape(-1, n_batch).T.cpu()[counted]  # (n, cells)
    denominators = (baseline.counts if scale is None else scale).cpu()[counted]
    low = torch.empty(differences.shape[1], dtype=torch.float64)
    high = torch.empty_like(low)
    step = max(1, 2**22 // n_boot)  # cells per resampling: (n_boot, step) float64, about 32 MB
    for start in range(0, differences.shape[1], step):
        cells = slice(start, start + step)
        _, low[cells], high[cells] = bootstrap_ratio(differences[:, cells], denominators, n_boot=n_boot, seed=seed)
    return low.reshape(shape), high.reshape(shape), int(counted.sum())


def cluster_index(clusters: Sequence[Hashable]) -> torch.Tensor:
    """(n_prompts,) long: each prompt's cluster, the clusters numbered 0, 1, ... by first appearance."""
    numbers: dict[Hashable, int] = {}
    return torch.tensor([numbers.setdefault(label, len(numbers)) for label in clusters], dtype=torch.long)


def cluster_resample_weights(clusters: Sequence[Hashable], n_boot: int = N_BOOT, seed: int = 0) -> torch.Tensor:
    """How often each prompt is drawn when whole clusters are drawn with replacement: (n_boot,
    n_prompts) float64, each prompt weighing as often as its cluster (``clusters``: one label per
    prompt) is drawn in that resample. The clusters are drawn as ``resample_weights`` draws prompts
    (numbered by first appearance), so with one prompt per cluster the two are equal."""
    index = cluster_index(clusters)
    n_clusters = int(index.max()) + 1 if len(index) else 0
    return resample_weights(n_clusters, n_boot, seed)[:, index]


def bootstrap_cluster_ratio(sums: torch.Tensor, counts: torch.Tensor, clusters: Sequence[Hashable],
                            n_boot: int = N_BOOT, seed: int = 0,
                            level: float = LEVEL) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``bootstrap_ratio`` resampling clusters of prompts: sums (batch, ...) per-prompt numerators,
    counts (batch,) denominators, clusters one label per prompt. Each resample draws as many clusters
    as there are, with replacement, and pools sum(sums) / sum(counts) over their prompts. Returns
    (estimate, ci_low, ci_high), each of shape sums.shape[1:], float64 on the CPU."""
    if len(clusters) != sums.shape[0]:
        raise UserError(f"{len(clusters)} cluster labels for {sums.shape[0]} prompts; give one per prompt")
    return _weighted_ratio(sums, counts, cluster_resample_weights(clusters, n_boot, seed), level)


def paired_difference(sums_a: torch.Tensor, counts_a: torch.Tensor, sums_b: torch.Tensor, counts_b: torch.Tensor,
                      clusters: Sequence[Hashable] | None = None, n_boot: int = N_BOOT, seed: int = 0,
                      level: float = LEVEL) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Condition A minus condition B, measured on the same prompts, with the 95% interval of the difference.

    sums_a, sums_b: (batch, ...) per-prompt numerators of each condition (prompt i the same prompt in
    both); counts_a, counts_b: (batch,) their denominators. Every resample draws the prompts (or, given
    ``clusters``, one label per prompt, the clusters) once and pools both conditions over that draw, so
    what the prompts share cancels. Returns (difference, ci_low, ci_high) of sum(a)/sum(counts_a) -
    sum(b)/sum(counts_b), each of shape sums_a.shape[1:], float64 on the CPU."""
    batch = sums_a.shape[0]
    if sums_b.shape != sums_a.shape or len(counts_a) != batch or len(counts_b) != batch:
        raise UserError(f"paired conditions need the same prompts: A's sums {tuple(sums_a.shape)} and counts "
                        f"({len(counts_a)},), B's {tuple(sums_b.shape)} and ({len(counts_b)},)")
    labels = range(batch) if clusters is None else clusters
    if len(labels) != batch:
        raise UserError(f"{len(labels)} cluster labels for {batch} prompts; give one per prompt")
    weights = cluster_resample_weights(labels, n_boot, seed)
    mean_a, resampled_a = _pooled(sums_a, counts_a, weights)
    mean_b, resampled_b = _pooled(sums_b, counts_b, weights)
    low, high = percentile_bounds(resampled_a - resampled_b, level)
    shape = sums_a.shape[1:]
    return (mean_a - mean_b).reshape(shape), low.reshape(shape), high.reshape(shape)


def _pooled(sums: torch.Tensor, counts: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """sums (batch, ...), counts (batch,), weights (n_boot, batch) -> (the pooled ratio (cells,), each
    resample's pooled ratio (n_boot, cells)), float64 on the CPU."""
    flat = sums.detach().reshape(sums.shape[0], -1).cpu().double()  # an interval is a number, never part of a graph
    counts = counts.detach().cpu().double()
    return flat.sum(0) / counts.sum(), (weights @ flat) / (weights @ counts)[:, None]


def _weighted_ratio(sums: torch.Tensor, counts: torch.Tensor, weights: torch.Tensor,
                    level: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pooled ratio and its percentile bounds over the resamples ``weights`` (n_boot, batch),
    each reshaped to sums.shape[1:]."""
    estimate, resampled = _pooled(sums, counts, weights)
    low, high = percentile_bounds(resampled, level)
    shape = sums.shape[1:]
    return estimate.reshape(shape), low.reshape(shape), high.reshape(shape)


def control_intervals(tested: torch.Tensor, control: torch.Tensor, counts: torch.Tensor, n_boot: int = N_BOOT,
                      seed: int = 0, level: float = LEVEL) -> tuple[tuple[float, float], tuple[float, float]]:
    """The 95% intervals of a control's mean effect and of the ratio tested / control, one paired bootstrap.

    tested: (batch,) the tested set's per-prompt effect numerators; control: (batch, draws) each random
    draw's on the same prompts; counts: (batch,) each prompt's denominator. Each resample draws prompts
    (seed ``seed``, both together) and draws (seed ``seed + 1``), so the intervals carry both sources of
    noise. Returns ((control_low, control_high), (ratio_low, ratio_high)); a ratio whose control mean is
    0 is infinite or undefined (nan) in that resample.
    """
    tested, control, counts = tested.cpu().double(), control.cpu().double(), counts.cpu().double()
    batch, draws = control.shape
    prompts = resample_weights(batch, n_boot, seed)  # (n_boot, batch)
    of_draws = resample_weights(draws, n_boot, seed + 1)  # (n_boot, draws)
    counted = prompts @ counts  # (n_boot,)
    tested_means = prompts @ tested / counted
    control_means = torch.einsum("bp,pd,bd->b", prompts, control, of_draws) / (draws * counted)
    control_low, control_high = percentile_bounds(control_means, level)
    ratio_low, ratio_high = percentile_bounds(tested_means / control_means, level)
    return (float(control_low), float(control_high)), (float(ratio_low), float(ratio_high))


def control_z(tested: torch.Tensor, control: torch.Tensor, counts: torch.Tensor, n_boot: int = N_BOOT, seed: int = 0,
              level: float = LEVEL) -> tuple[float, float, float]:
    """How far a tested set's effect lies from matched random sets' effects, in units of their spread,
    with its 95% interval: z = (tested - mean) / sd, mean and sd (n - 1 in the denominator) over the
    draws' effects, each effect a pooled mean over prompts.

    tested: (batch,) the tested set's per-prompt effect numerators; control: (batch, draws) each
    draw's on the same prompts; counts: (batch,) each prompt's denominator. The interval resamples
    the prompts (seed ``seed``, every set on the same draw of prompts) and the draws (seed ``seed +
    1``, as weights on the draws' effects) as ``control_intervals`` does. Returns (z, z_low, z_high);
    infinite or NaN where the draws' effects do not vary (one possible set, or a resample that draws
    one set only). Needs at least 2 draws."""
    tested, control, counts = tested.cpu().double(), control.cpu().double(), counts.cpu().double()
    batch, draws = control.shape
    if draws < 2:
        raise UserError(f"{draws} random set: a z against the random sets needs at least 2, for their spread")
    effects = control.sum(0) / counts.sum()
    z = float((tested.sum() / counts.sum() - effects.mean()) / effects.std())
    prompts = resample_weights(batch, n_boot, seed)  # (n_boot, batch)
    of_draws = resample_weights(draws, n_boot, seed + 1)  # (n_boot, draws)
    counted = prompts @ counts  # (n_boot,)
    resampled = (prompts @ control) / counted[:, None]  # (n_boot, draws): each draw's effect in each resample
    mean = (of_draws * resampled).sum(1) / draws
    sd = ((of_draws * (resampled - mean[:, None]) ** 2).sum(1) / (draws - 1)).sqrt()
    low, high = percentile_bounds((prompts @ tested / counted - mean) / sd, level)
    return z, float(low), float(high)


def normal_p_value(low: float, high: float) -> float:
    """The two-sided standard normal tail beyond a z's 95% interval [low, high] at its bound nearest 0:
    the p-value of a z whose null is normal, read where the z is least far from 0, so that neither
    the prompts' noise nor a spread known from few random sets makes it small (1 where the interval
    holds 0 or is unknown)."""
    if math.isnan(low) or math.isnan(high) or low <= 0 <= high:
        return 1.0
    return math.erfc(min(abs(low), abs(high)) / math.sqrt(2))


def effect_text(value: float, low: float, high: float, digits: int = 3) -> str:
    """A value with its 95% interval as every command and page words it, ``+0.123 [+0.050, +0.200]``,
    or the value and ``[no interval]`` where the interval is unknown (NaN: a first-order estimate,
    or a metric without a per-prompt form)."""
    interval = ("[no interval]" if math.isnan(low) or math.isnan(high) else
                f"[{low:+.{digits}f}, {high:+.{digits}f}]")
    return f"{value:+.{digits}f} {interval}"


def excludes_zero(low, high):
    """Whether an interval [low, high] lies wholly on one side of 0 (works on floats, arrays, Series)."""
    return (low > 0) | (high < 0)
