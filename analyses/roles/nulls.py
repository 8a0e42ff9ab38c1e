"""Null distributions for the role scores, p-values and Benjamini-Hochberg roles (architecture §4.7).

"Would a head score this by chance?" has two answers here, and a role must beat each that applies:

- **random initialisation** (every role): the same architecture at a few random initialisations
  (``interp.random_models.random_like``), scored on the *same* probes. A head that does not do
  the role is taken to score like a random-init head of the same layer. Heads of one model are
  correlated (they share its embeddings and norms), so the null is two-level, a model effect
  plus a head effect (``layer_null``): ``z = (score - null mean) / predictive spread`` and
  ``p = P(T >= z)`` for Student's t with Satterthwaite's degrees of freedom (between seeds - 1
  and seeds x heads - 1). The normal assumption is what lets a real head reach the small
  p-values Benjamini-Hochberg needs across all heads x roles: a rank among a few seeds x heads
  of null samples could never go below 1 / (samples + 1).
- **control probes** (the content roles ``duplicate_token`` and ``induction``): the model itself
  on the same probes with each second copy permuted (``analyses.core.probes.shuffle_second_copy``):
  the same positions, periods and tokens, but the role's target keys no longer hold the repeated
  token. Prompt by prompt, the head's score on the probes minus its score on the controls is
  what the repeat adds; ``z = mean paired difference / its standard error`` (ratio estimator,
  linearised over prompts) and ``p = P(T >= z)`` with (prompts - 1) degrees of freedom. A
  control cannot break a positional role (previous_token, self, bos: defined by position
  alone), so those face the random-initialisation null only.

So ``p`` is the probability that a head that is not doing the role (one like a random-init head
of its layer, or like itself without the repeat) scores at least this high. For a content role the
reported p is the larger of the two (a role must beat both nulls), and ``z``, ``null_center``,
``null_spread`` and the null band come from that binding null (``null``). Roles are the (head, role)
pairs whose Benjamini-Hochberg q-value over all heads x roles is at most ``fdr``: among the roles
assigned, the expected share of false ones is at most ``fdr`` (and a model with no real role gets
any at all with probability at most ``fdr``). This answers "not chance", not "strong": a
threshold on the score can be asked for as well (``analyses.roles.classify.assign_roles``). The null band
``[null_low, null_high]`` is centre +- 1.96 spread (a score above ``null_high`` has z > 1.96).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence, TypeVar

import pandas as pd
import torch

from analyses.core.budget import DEFAULT_MEMORY_MB, left_after, model_mb
from analyses.roles.classify import DEFAULT_FDR, ROLES, check_fdr, per_prompt_scores, probe_targets, prompt_counts_and_chance
from analyses.core.probes import RepeatedProbes, probes_for, shuffle_second_copy
from analyses.core.execution import executing
from analyses.core.progress import progress_bar
from analyses.interventions.run import Run
from interp.errors import UserError
from interp.random_models import random_like

CONTENT_ROLES = ("duplicate_token", "induction")  # the roles the control probes break
DEFAULT_NULL_SEEDS = (1001, 1002, 1003)  # random initialisations; far from the seeds tests build models with
BAND_Z = 1.96  # the null band is centre +- BAND_Z spread
T = TypeVar("T")


@dataclass
class RoleSamples:
    """Per-prompt role scores of one model on one set of probes.

    sums: role -> (batch, layer, head) per-prompt numerators; counts: role -> (batch,) query
    positions where the role is defined (a head's score is sum(sums) / sum(counts))."""

    sums: dict[str, torch.Tensor]
    counts: dict[str, torch.Tensor]


def role_samples(model, probes: RepeatedProbes, run: Run | None = None) -> RoleSamples:
    """Every head's per-prompt numerators for every role in ``ROLES`` (patterns only, no logits;
    ``run``: a ``Run`` of the probes that reduced them already, see ``per_prompt_scores``)."""
    targets = probe_targets(probes)
    sums = per_prompt_scores(model, probes.tokens, targets, ROLES, run)
    counts, _ = prompt_counts_and_chance(targets, ROLES)
    return RoleSamples({r: s.cpu().double() for r, s in sums.items()}, {r: c.cpu().double() for r, c in counts.items()})


def ratio_and_error(sums: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The pooled ratio ``sum(sums) / sum(counts)`` and its standard error, linearised over prompts.

    sums: (batch, ...) per-prompt numerators; counts: (batch,). Returns (ratio, se), each
    ``sums.shape[1:]``: se**2 = n / (n - 1) * sum_b (sums_b - ratio counts_b)**2 / sum(counts)**2.
    """
    n = sums.shape[0]
    total = counts.sum()
    ratio = sums.sum(0) / total
    residual = sums - ratio[None] * counts.reshape(-1, *[1] * (sums.ndim - 1))
    variance = (residual ** 2).sum(0) * n / max(n - 1, 1) / total ** 2
    return ratio, variance.sqrt()


def t_upper_tail(t: torch.Tensor, dof: int | torch.Tensor) -> torch.Tensor:
    """P(T >= t) for Student's t with ``dof`` degrees of freedom (positive integers: one, or a
    tensor that broadcasts with ``t``), float64 on the CPU: ``exp(t_log_upper_tail)``, exact to float64's
    smallest number (about 1e-308), 0 only below it."""
    return t_log_upper_tail(t, dof).exp()


def t_log_upper_tail(t: torch.Tensor, dof: int | torch.Tensor) -> torch.Tensor:
    """log P(T >= t) for Student's t with ``dof`` degrees of freedom (positive integers: one, or a
    tensor that broadcasts with ``t``), float64 on the CPU (mps has none), computed in log space: a head far above its null
    gets its true (tiny) p-value's log, never log(0) from a tail that rounded to 0. -inf only for
    t = +inf (a null with no spread)."""
    t, dof = torch.broadcast_tensors(t.cpu().double(), torch.as_tensor(dof).cpu().double())
    bad = dof[(dof < 1) | (dof != dof.floor())]
    if bad.numel():
        raise UserError(f"degrees of freedom {bad[0].item():g} must be a positive integer (>= 1)")
    return _t_log_upper_tail(t, dof)


def _t_log_upper_tail(t: torch.Tensor, dof: torch.Tensor) -> torch.Tensor:
    """log P(T >= t) for ``dof`` degrees of freedom (float64, ``t``'s shape), every element at once.

    P(T >= |t|) = I_x(dof / 2, 1 / 2) / 2 with x = dof / (dof + t^2) (I: the regularised incomplete
    beta function). Where x < (a + 1) / (a + b + 2) (a, b = dof / 2, 1 / 2: |t| above about
    sqrt(3)) its continued fraction gives log I_x directly, however small; below, the tail is at
    least a few percent and I_x = 1 - I_{1-x}(b, a). Negative t: P(T >= t) = 1 - P(T >= |t|).
    """
    a, b = dof / 2, torch.full_like(dof, 0.5)
    log_t2 = 2 * t.abs().log() - dof.log()  # log(t^2 / dof)
    log_x, log_1mx = -_softplus(log_t2), -_softplus(-log_t2)  # log x, log(1 - x)
    far = log_x.exp() < (a + 1) / (a + b + 2)
    log_tail = torch.empty_like(t)  # each continued fraction only where it converges fast
    log_tail[far] = _log_beta_inc(log_x[far], log_1mx[far], a[far], b[far])
    log_tail[~far] = (1 - _log_beta_inc(log_1mx[~far], log_x[~far], b[~far], a[~far]).exp()).clamp(min=0).log()
    log_tail = log_tail - torch.log(torch.tensor(2.0, dtype=torch.double))
    return torch.where(t >= 0, log_tail, torch.log1p(-log_tail.exp()))


def _softplus(u: torch.Tensor) -> torch.Tensor:
    """log(1 + e^u) to float64's precision for every u (torch's softplus returns u itself above 20)."""
    return u.clamp(min=0) + torch.log1p(torch.exp(-u.abs()))


def _log_beta_inc(log_x: torch.Tensor, log_1mx: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                  steps: int = 2000) -> torch.Tensor:
    """log I_x(a, b), the regularised incomplete beta function, elementwise (all float64 tensors of
    one shape), from log x and log(1 - x), for x < (a + 1) / (a + b + 2) where its continued
    fraction converges fast (DLMF 8.17.22):
    I_x = x^a (1 - x)^b / (a B(a, b)) / (1 + d_1 / (1 + d_2 / (1 + ...))) with
    d_{2m+1} = -(a + m)(a + b + m) x / ((a + 2m)(a + 2m + 1)), d_{2m} = m (b - m) x / ((a + 2m - 1)(a + 2m)),
    evaluated by the modified Lentz method (float64; stops once every element has converged)."""
    x = log_x.exp()
    tiny = 1e-300
    log_front = (a * log_x + b * log_1mx - torch.special.gammaln(a) - torch.special.gammaln(b)
                 + torch.special.gammaln(a + b) - a.log())
    value, c, d = torch.ones_like(x), torch.ones_like(x), torch.zeros_like(x)
    for step in range(1, steps + 1):
        m = step // 2
        if step % 2:
            coefficient = -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))
        else:
            coefficient = m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m))
        d = 1 + coefficient * d
        d = torch.where(d.abs() < tiny, torch.full_like(d, tiny), d).reciprocal()
        c = 1 + coefficient / c
        c = torch.where(c.abs() < tiny, torch.full_like(c, tiny), c)
        value = value * c * d
        if ((c * d - 1).abs() < 1e-16).all():
            break
    return log_front - value.log()


def z_score(excess: torch.Tensor, spread: torch.Tensor) -> torch.Tensor:
    """excess / spread, with 0 / 0 = 0 and x / 0 = +-inf (a null with no spread at all)."""
    infinite = torch.nan_to_num(excess.sign() * torch.inf, nan=0.0, posinf=torch.inf, neginf=-torch.inf)
    return torch.where(spread > 0, excess / spread.clamp(min=1e-300), infinite)


def benjamini_hochberg(p: torch.Tensor) -> torch.Tensor:
    """Benjamini-Hochberg adjusted p-values (q-values) of a flat (m,) tensor: rejecting every
    hypothesis with q <= alpha controls the false discovery rate at alpha."""
    m = p.numel()
    order = p.argsort()
    scaled = p[order] * m / torch.arange(1, m + 1, dtype=p.dtype)
    monotone = scaled.flip(0).cummin(0).values.flip(0).clamp(max=1)
    q = torch.empty_like(p)
    q[order] = monotone
    return q


def random_init_null(model, probes: RepeatedProbes, seeds: Sequence[int] = DEFAULT_NULL_SEEDS,
                     memory_mb: float = DEFAULT_MEMORY_MB) -> dict[str, torch.Tensor]:
    """Scores of every head of ``model``'s architecture at each random initialisation in ``seeds``
    on ``probes`` -> role -> (n_seeds, layer, head). One null model is alive at a time, counted in
    ``memory_mb`` (its forwards get what it leaves)."""
    check_null_seeds(seeds)
    scores = score_random_models(model, seeds, lambda null: null_role_scores(null, probes, memory_mb))
    return {role: torch.stack([one[role] for one in scores]) for role in ROLES}


def check_null_seeds(seeds: Sequence[int]) -> None:
    """Refuse fewer than 2 random initialisations (a null spread needs 2), in one line."""
    if len(seeds) < 2:
        raise UserError(f"null_seeds={tuple(seeds)}: a null spread needs at least 2 random initialisations")


def score_random_models(model, seeds: Sequence[int], score: Callable[[object], T]) -> list[T]:
    """``score(null)`` for ``model``'s architecture at each random initialisation in ``seeds``
    (``random_like``), in order: each null model is made once, scored, and let go before the next
    (one alive at a time; ``score`` must keep no reference to it). A bar over the seeds, shown per
    the current execution's progress."""
    scores = []
    for seed in progress_bar(seeds, desc="random-init nulls", unit="model"):
        null = random_like(model, seed)
        scores.append(score(null))
        del null
    return scores


def null_role_scores(null, probes: RepeatedProbes, memory_mb: float = DEFAULT_MEMORY_MB) -> dict[str, torch.Tensor]:
    """One null model's pooled score of every head on ``probes`` -> role -> (layer, head), float64;
    ``memory_mb`` counts the null model itself (its forward gets what it leaves)."""
    with executing(progress=False):
        with executing(memory_mb=left_after(memory_mb, model_mb(null))):
            samples = role_samples(null, probes)
    return {role: ratio_and_error(samples.sums[role], samples.counts[role])[0] for role in ROLES}


def role_nulls(observed: RoleSamples, random_scores: dict[str, torch.Tensor],
               control: RoleSamples | None) -> pd.DataFrame:
    """Score, null and p-value per head and role (see the module docstring).

    observed: the model on the probes; random_scores: role -> (seeds, layer, head) from
    ``random_init_null`` on the same probes; control: the model on the control probes (None: no
    control null). Returns one row per (layer, head, role): ``layer, head, role, score, null``
    (which null binds: ``random_init`` or ``control``), ``null_center, null_spread, null_low,
    null_high, z, p, log10_p`` (p's log, computed in log space: right where p is below float64's
    smallest number, about 1e-308, and prints as 0).
    """
    frames = []
    for role in ROLES:
        score, _ = ratio_and_error(observed.sums[role], observed.counts[role])
        center, spread, dof = layer_null(random_scores[role])
        log_p = t_log_upper_tail(z_score(score - center, spread), dof)
        binds_control = torch.zeros_like(score, dtype=torch.bool)
        if control is not None and role in CONTENT_ROLES:
            if not torch.equal(control.counts[role], observed.counts[role]):
                raise UserError("control probes must define the role at the same positions as the probes")
            control_score, _ = ratio_and_error(control.sums[role], control.counts[role])
            _, diff_se = ratio_and_error(observed.sums[role] - control.sums[role], observed.counts[role])
            control_log_p = t_log_upper_tail(z_score(score - control_score, diff_se), len(observed.counts[role]) - 1)
            binds_control = control_log_p > log_p
            center = torch.where(binds_control, control_score, center)
            spread = torch.where(binds_control, diff_se, spread)
            log_p = torch.maximum(log_p, control_log_p)
        frames.append(head_frame(score, {
            "role": role, "score": score, "null": binds_control, "null_center": center, "null_spread": spread,
            "null_low": center - BAND_Z * spread, "null_high": center + BAND_Z * spread,
            "z": z_score(score - center, spread), "p": log_p.exp(), "log10_p": log_p / math.log(10),
        }))
    frame = pd.concat(frames, ignore_index=True)
    frame["null"] = frame["null"].map({True: "control", False: "random_init"})
    return frame


def layer_null(null_scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-layer random-initialisation null from ``null_scores`` (seeds S, layer, head H) ->
    (centre, predictive spread, degrees of freedom), each (layer, 1).

    Heads of one model share it (its embeddings, its norms), so their scores are correlated: a
    head's score is a model effect (variance sb2) plus a head effect (sw2). From the mean square
    of the per-seed means B (S - 1 degrees of freedom) and the within-seed variance W (S (H - 1)),
    sw2 = W and sb2 = max(B - W / H, 0); a new head of a new model differs from the grand mean by
    variance sb2 (1 + 1/S) + sw2 (1 + 1/(S H)). Its degrees of freedom are Satterthwaite's, rounded
    down: S - 1 when the model effect dominates, up to S H - 1 when it is absent."""
    n_seeds, _, n_heads = null_scores.shape
    seed_means = null_scores.mean(2)  # (S, layer)
    between = seed_means.var(0)
    within = null_scores.var(2).mean(0) if n_heads > 1 else torch.zeros_like(between)
    model_effect = (between - within / n_heads).clamp(min=0)
    c_between = 1 + 1 / n_seeds
    c_within = 1 - 1 / n_heads  # (1 + 1/(S H)) - (1 + 1/S) / H, the within part left once B stands for sb2
    variance = torch.where(model_effect > 0, c_between * between + c_within * within,
                           within * (1 + 1 / (n_seeds * n_heads)))
    parts = torch.where(model_effect > 0, (c_between * between) ** 2 / max(n_seeds - 1, 1)
                        + (c_within * within) ** 2 / max(n_seeds * (n_heads - 1), 1), variance ** 2 / (n_seeds * n_heads - 1))
    dof = (variance ** 2 / parts.clamp(min=1e-300)).floor().clamp(1, n_seeds * n_heads - 1)
    return seed_means.mean(0)[:, None], variance.sqrt()[:, None], dof[:, None]


def head_frame(like: torch.Tensor, columns: dict) -> pd.DataFrame:
    """One row per head of ``like`` (layer, head): ``layer, head`` and ``columns`` (tensors that
    broadcast to (layer, head), or scalars)."""
    n_layers, n_heads = like.shape
    layer, head = torch.meshgrid(torch.arange(n_layers), torch.arange(n_heads), indexing="ij")
    data = {"layer": layer.flatten().cpu().numpy(), "head": head.flatten().cpu().numpy()}
    for name, value in columns.items():
        data[name] = value.expand(n_layers, n_heads).flatten().cpu().numpy() if torch.is_tensor(value) else value
    return pd.DataFrame(data)


def add_fdr(nulls: pd.DataFrame, fdr: float = DEFAULT_FDR) -> pd.DataFrame:
    """``nulls`` with ``q`` (Benjamini-Hochberg over every row: all heads x roles) and
    ``significant`` (q <= fdr)."""
    check_fdr(fdr)
    q = benjamini_hochberg(torch.tensor(nulls["p"].to_numpy(), dtype=torch.double))
    return nulls.assign(q=q.cpu().numpy(), significant=q.cpu().numpy() <= fdr)


def joint_fdr(*calibrations: pd.DataFrame, fdr: float = DEFAULT_FDR) -> pd.DataFrame:
    """Calibration tables of the same heads (``calibrate_roles``'s attention roles,
    ``analyses.roles.copying.meaning_nulls``' copying roles) as one, with ``q`` and
    ``significant`` recomputed by one Benjamini-Hochberg over all their rows: every (head, role)
    test in one false-discovery family, as the report decides roles: a tidy frame. A role twice is
    refused."""
    joined = pd.concat([c.drop(columns=["q", "significant"], errors="ignore") for c in calibrations],
                       ignore_index=True)
    twice = joined.duplicated(["layer", "head", "role"])
    if twice.any():
        first = joined[twice].iloc[0]
        raise UserError(f"role {first['role']!r} of head L{first['layer']}H{first['head']} is in more than one "
                        "calibration table; join tables of different roles")
    return add_fdr(joined, fdr)


def calibrate_roles(model, probes: RepeatedProbes | None = None, *, n_prompts: int = 64, seq_len: int | None = None,
                    seed: int = 0, null_seeds: Sequence[int] = DEFAULT_NULL_SEEDS, fdr: float = DEFAULT_FDR,
                    memory_mb: float | None = None, progress: bool | None = None,
                    run: Run | None = None, random_scores: dict[str, torch.Tensor] | None = None) -> pd.DataFrame:
    """Every head's role scores against their nulls, with Benjamini-Hochberg roles (``run``: a
    ``Run`` of the probes whose pattern sums serve the model's own scores, see ``per_prompt_scores``;
    the control probes and the null models run their own forwards; ``random_scores``: the null
    models' scores on these probes at ``null_seeds``, role -> (seeds, layer, head) as
    ``random_init_null`` returns them, measured here where None).

    probes: made once by the caller (else ``probes_for(model, n_prompts, seq_len, seed)``); the
    control probes are drawn from them with ``seed``. null_seeds: the random initialisations.
    Costs one pattern-only pass of the model over the probes and the controls, and one per seed.

    Returns a tidy frame, the ``role_nulls`` table with ``q`` and ``significant`` (see ``add_fdr``), one row
    per (layer, head, role in ``ROLES``).
    ``memory_mb``, ``progress``: the execution's (``analyses.core.execution``; None: the current one's).
    """
    check_fdr(fdr)
    probes = probes if probes is not None else probes_for(model, n_prompts, seq_len, seed=seed)
    with executing(memory_mb, progress) as execution:
        observed = role_samples(model, probes, run)
        control = role_samples(model, shuffle_second_copy(probes, seed))
        if random_scores is None:
            random_scores = random_init_null(model, probes, null_seeds, execution.memory_mb)
    return add_fdr(role_nulls(observed, random_scores, control), fdr)
