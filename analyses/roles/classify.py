"""Head classification (architecture §4.1): every head's attention-role scores from one batched forward.

Each role is a *target*: for every query position where the role is defined, the keys the role
attends to. A head's score for a role is its attention mass on the target keys, averaged over the
query positions where the role is defined (pooled over prompts), so a perfect head scores 1.0:

    previous_token   query i >= 1, target key i - 1
    duplicate_token  query in the second copy of the probe segment, target its earlier occurrence
                     (texts: any query whose token occurred before, target every earlier occurrence)
    induction        query in the second copy, target the key after its earlier occurrence
    self             query i >= 1, target key i
    bos              query i >= 1, target key 0 (the attention sink)
    entropy          query i >= 1: H(attention row) / log(i + 1), so 1.0 = uniform over the prefix
    distance         query i >= 1: sum_k A[i, k] (i - k), the mean attention distance in tokens

``chance`` is the same score for a uniform causal head (A[i, k] = 1 / (i + 1)) on the same query
positions. Intervals are percentile bootstraps over prompts. Roles (``assign_roles``) are decided
either against calibrated nulls under false-discovery control (``analyses.roles.nulls``) or by the
fixed rule: a threshold and an interval above chance. Patterns come from one forward per
chunk of prompts caching only ``hook_pattern`` and stopping after the last layer's (no logits are
computed); all heads and roles are scored with tensor ops.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import einops
import pandas as pd
import torch

from analyses.core.budget import rows_within
from analyses.core.hook_names import pattern_names
from analyses.interventions.engine import cache_run
from analyses.core.probes import RepeatedProbes, probes_for
from analyses.core.stats import bootstrap_ratio, excludes_zero
from analyses.core.execution import current, executing
from analyses.core.progress import progress_bar
from analyses.interventions.run import Run
from analyses.core.tokens import encode
from interp.errors import UserError
from interp.model import require_causal

ROLES = ("previous_token", "duplicate_token", "induction", "self", "bos")
MEASURES = (*ROLES, "entropy", "distance")
# the roles read from the weights (analyses.components.meaning: each head's OV circuit), decided in the
# same false-discovery family as the attention roles where a calibration holds them
MEANING_ROLES = ("copying", "copy_suppression")
ALL_ROLES = (*ROLES, *MEANING_ROLES)
TEXT_MEASURES = ("previous_token", "duplicate_token", "self", "bos", "entropy", "distance")
DEFAULT_THRESHOLD = 0.4
DEFAULT_FDR = 0.05  # Benjamini-Hochberg false discovery rate of calibrated roles (analyses.roles.nulls)
# a partial role: its score's interval lower bound goes at least this share of the way from its
# null's centre to the role's threshold (an effect size, which significance alone is not; see assign_roles)
PARTIAL_SHARE = 0.5
NO_EFFECT = "no detectable effect"  # a head whose ablation effect's 95% interval covers 0 (no_effect_labels)
# what ``head_table`` reads of an effects frame: each head's ablation effect and its 95% interval
EFFECT_COLUMNS = ("ablation_effect", "ablation_ci_low", "ablation_ci_high", "ablation_n_prompts")


@dataclass
class RoleTargets:
    """Where each role is defined and what it attends to, for a batch of prompts.

    queries: (batch, q) bool, positions that exist and have a predecessor (i >= 1).
    targets: role -> (batch, q, k) float, 1 on the role's target keys of the query positions
        where the role is defined, 0 elsewhere (rows of undefined queries are all 0).
    """

    queries: torch.Tensor
    targets: dict[str, torch.Tensor]

    def __getitem__(self, rows: slice) -> "RoleTargets":
        return RoleTargets(self.queries[rows], {role: t[rows] for role, t in self.targets.items()})


def probe_targets(probes: RepeatedProbes) -> RoleTargets:
    """Targets of all five roles on repeated-segment probes."""
    batch, n_pos = probes.tokens.shape
    pos = torch.arange(n_pos, device=probes.tokens.device)
    queries = (pos >= 1)[None].expand(batch, n_pos)
    earlier = probes.earlier_occurrence  # (batch, q): i - p in the second copy, -1 elsewhere
    targets = _positional_targets(queries)
    targets["duplicate_token"] = _one_hot_keys(earlier, n_pos)
    targets["induction"] = _one_hot_keys(torch.where(earlier >= 0, earlier + 1, -1), n_pos)
    return RoleTargets(queries, targets)


def text_targets(tokens: torch.Tensor, lengths: torch.Tensor) -> RoleTargets:
    """Targets of the roles natural text defines (no induction) on right-padded ``tokens``
    (batch, pos) whose first ``lengths`` (batch,) tokens are real."""
    n_pos = tokens.shape[1]
    pos = torch.arange(n_pos, device=tokens.device)
    real = pos[None] < lengths[:, None]
    queries = real & (pos >= 1)[None]
    targets = _positional_targets(queries)
    causal = pos[None, :, None] > pos[None, None, :]
    same = (tokens[:, :, None] == tokens[:, None, :]) & causal & queries[:, :, None]
    targets["duplicate_token"] = same.float()
    return RoleTargets(queries, targets)


def _positional_targets(queries: torch.Tensor) -> dict[str, torch.Tensor]:
    """previous_token, self and bos targets for query mask (batch, q)."""
    n_pos = queries.shape[1]
    eye = torch.eye(n_pos, device=queries.device)
    rows = queries[:, :, None].float()
    bos = torch.zeros(n_pos, n_pos, device=queries.device)
    bos[:, 0] = 1
    return {"previous_token": rows * eye.roll(-1, dims=1).tril(-1), "self": rows * eye, "bos": rows * bos}


def _one_hot_keys(key: torch.Tensor, n_keys: int) -> torch.Tensor:
    """key (batch, q) long, -1 for none -> (batch, q, k) float one-hot."""
    one_hot = torch.nn.functional.one_hot(key.clamp(min=0), n_keys).float()
    return one_hot * (key >= 0)[..., None]


def prompt_sums(pattern: torch.Tensor, targets: RoleTargets, measures: Sequence[str]) -> dict[str, torch.Tensor]:
    """Per-prompt score numerators for one layer.

    pattern: (batch, head, q, k) post-softmax attention.
    Returns measure -> (batch, head): the sum over the measure's query positions of the per-query
    score (attention mass on the role's targets, normalised entropy, or attention distance).
    """
    n_pos = pattern.shape[-1]
    pos = torch.arange(n_pos, device=pattern.device)
    queries = targets.queries.float()
    sums = {}
    for measure in measures:
        if measure in targets.targets:
            sums[measure] = einops.einsum(pattern, targets.targets[measure], "b h q k, b q k -> b h")
        elif measure == "entropy":
            entropy = -torch.special.xlogy(pattern, pattern).sum(-1)  # (batch, head, q)
            sums[measure] = einops.einsum(entropy, queries / _log_row_size(pos), "b h q, b q -> b h")
        elif measure == "distance":
            offset = (pos[:, None] - pos[None, :]).clamp(min=0).to(pattern.dtype)
            distance = einops.einsum(pattern, offset, "b h q k, q k -> b h q")
            sums[measure] = einops.einsum(distance, queries, "b h q, b q -> b h")
    return sums


def prompt_counts_and_chance(targets: RoleTargets, measures: Sequence[str]) -> tuple[dict, dict]:
    """Per-prompt denominators and uniform-head numerators.

    Returns (counts, chance): measure -> (batch,) number of query positions where it is defined,
    and the sum over those positions of a uniform causal head's per-query score.
    """
    n_pos = targets.queries.shape[1]
    pos = torch.arange(n_pos, device=targets.queries.device, dtype=torch.float)
    queries = targets.queries.float()
    counts, chance = {}, {}
    for measure in measures:
        if measure in targets.targets:
            target = targets.targets[measure]
            counts[measure] = (target.sum(-1) > 0).float().sum(-1)
            chance[measure] = (target.sum(-1) / (pos + 1)).sum(-1)
        else:
            counts[measure] = queries.sum(-1)
            per_query = torch.ones_like(pos) if measure == "entropy" else pos / 2
            chance[measure] = (queries * per_query).sum(-1)
    return counts, chance


def _log_row_size(pos: torch.Tensor) -> torch.Tensor:
    """log(i + 1) per query position, 1 at i = 0 (never a query) to avoid dividing by zero."""
    return torch.where(pos >= 1, torch.log1p(pos.float()), torch.ones_like(pos, dtype=torch.float))


def pattern_chunks(model, tokens: torch.Tensor, memory_mb: float, desc: str):
    """Yield (rows, {hook_pattern name: (chunk, head, q, k)}) for chunks of ``tokens`` (batch, pos)
    that fit ``memory_mb``; each forward stops after the last layer's pattern (no logits). A bar
    ``desc`` over the chunks, shown per the current execution's progress."""
    names = pattern_names(model)
    size = rows_within(model, tokens.shape[1], memory_mb, logits=False, kept_patterns=model.cfg.n_layers)
    for start in progress_bar(range(0, len(tokens), size), desc=desc, unit="chunk"):
        rows = slice(start, start + size)
        yield rows, cache_run(model, tokens[rows], names, logits=False)[1]


class PromptSums:
    """A streaming reducer of a ``Run``'s forward (``Run.make(reducers=...)``): each layer's pattern,
    as the forward passes its ``hook_pattern``, reduced to per-prompt score numerators
    (``prompt_sums``), so no pattern outlives its layer. ``result()``: measure -> (batch, layer, head)."""

    def __init__(self, model, targets: RoleTargets, measures: Sequence[str]):
        require_causal(model, "head classification")
        self.targets, self.measures = targets, tuple(measures)
        self.names = pattern_names(model)
        self.parts: dict[str, list] = {name: [] for name in self.names}  # per layer: (rows, sums) per chunk

    def hooks(self) -> list[tuple[str, object]]:
        def reducer(name):
            def reduce(pattern, rows):
                self.parts[name].append(prompt_sums(pattern.float(), self.targets[rows], self.measures))

            return reduce

        return [(name, reducer(name)) for name in self.names]

    def result(self) -> dict[str, torch.Tensor]:
        layers = [{m: torch.cat([part[m] for part in self.parts[name]]) for m in self.measures} for name in self.names]
        return {m: torch.stack([layer[m] for layer in layers], dim=1) for m in self.measures}


def per_prompt_scores(model, tokens: torch.Tensor, targets: RoleTargets, measures: Sequence[str],
                      run: Run | None = None) -> dict[str, torch.Tensor]:
    """Run ``tokens`` (batch, pos) through ``model`` in chunks, reducing the patterns as they pass.

    Returns measure -> (batch, layer, head) per-prompt numerators (see ``prompt_sums``). A
    non-causal model is refused: the roles' chance levels are those of a causal head. ``run``: a
    ``Run`` of ``tokens`` whose forward fed a ``PromptSums`` of at least ``measures`` (under
    ``reduced["prompt_sums"]``), read instead of a forward. Within the current execution: its memory
    bounds the forward's chunks, its progress shows the forward's bar.
    """
    require_causal(model, "head classification")
    if run is not None and "prompt_sums" in run.reduced:
        run.check_tokens(tokens)
        return {m: run.reduced["prompt_sums"][m] for m in measures}
    sums = PromptSums(model, targets, measures)
    run = Run.make(model, tokens, reducers={"prompt_sums": sums}, starts=False, progress=current().progress,
                   desc="classify heads")
    return run.reduced["prompt_sums"]


def classify_heads(
    model,
    n_prompts: int = 64,
    seq_len: int | None = None,
    seed: int = 0,
    texts: Sequence[str] | None = None,
    *,
    probes: RepeatedProbes | None = None,
    n_boot: int = 1000,
    memory_mb: float | None = None,
    progress: bool | None = None,
    run: Run | None = None,
) -> pd.DataFrame:
    """Score every head of a hooked model on every measure.

    Args:
        model: a hooked model (``GPTModel`` or ``TransformerBridge``).
        n_prompts, seq_len, seed: the repeated-segment probes (``probes_for``); ``seed`` also seeds
            the bootstrap.
        texts: score on these texts instead of probes (all measures but induction); texts of
            unequal lengths are right-padded and the padding never scores.
        probes: score on these probes (made once by the caller) instead of drawing them.
        n_boot: bootstrap resamples over prompts.
        memory_mb: budget for one chunk's cached patterns and activations (None: the current
            execution's, ``analyses.core.execution``).
        progress: see ``analyses.core.progress``.
        run: a ``Run`` of the probes that already reduced their patterns (``per_prompt_scores``).

    Returns a tidy DataFrame, one row per (layer, head, measure), columns
    ``layer, head, measure, score, ci_low, ci_high, chance``, sorted by measure, layer, head.
    """
    require_causal(model, "head classification")
    if isinstance(n_prompts, str):
        raise UserError(f"classify_heads(model, {n_prompts!r}): the second argument is n_prompts, a number of probes; "
                        f"score texts with texts=[...], e.g. classify_heads(model, texts=[{n_prompts!r}])")
    if texts is not None and probes is not None:
        raise UserError("pass probes or texts to classify_heads, not both")
    if texts is not None:
        batch = encode(model, texts)
        tokens, targets, measures = batch.tokens, text_targets(batch.tokens, batch.lengths), TEXT_MEASURES
    else:
        probes = probes if probes is not None else probes_for(model, n_prompts, seq_len, seed=seed)
        tokens, targets, measures = probes.tokens, probe_targets(probes), MEASURES
    with executing(memory_mb, progress):
        sums = per_prompt_scores(model, tokens, targets, measures, run)
    counts, chance = prompt_counts_and_chance(targets, measures)
    return scores_frame(sums, counts, chance, n_boot=n_boot, seed=seed)


def scores_frame(sums: Mapping[str, torch.Tensor], counts: Mapping[str, torch.Tensor],
                 chance: Mapping[str, torch.Tensor], n_boot: int = 1000, seed: int = 0) -> pd.DataFrame:
    """Pool per-prompt numerators (batch, layer, head) into the tidy scores table."""
    frames = []
    for measure, numerators in sums.items():
        if counts[measure].sum() == 0:
            raise UserError(f"no query position defines {measure!r} in these prompts")
        score, low, high = bootstrap_ratio(numerators, counts[measure], n_boot=n_boot, seed=seed)
        n_layers, n_heads = score.shape
        layer, head = torch.meshgrid(torch.arange(n_layers), torch.arange(n_heads), indexing="ij")
        frames.append(pd.DataFrame({
            "layer": layer.flatten().cpu().numpy(),
            "head": head.flatten().cpu().numpy(),
            "measure": measure,
            "score": score.flatten().cpu().numpy(),
            "ci_low": low.flatten().cpu().numpy(),
            "ci_high": high.flatten().cpu().numpy(),
            "chance": float(chance[measure].sum() / counts[measure].sum()),
        }))
    return pd.concat(frames, ignore_index=True)


ROLE_RANK = {role: rank for rank, role in enumerate(ALL_ROLES)}


def assign_roles(scores: pd.DataFrame, thresholds: float | Mapping[str, float] | None = None, *,
                 calibration: pd.DataFrame | None = None, fdr: float = DEFAULT_FDR) -> pd.DataFrame:
    """One row per head with ``role``: its roles in ``ALL_ROLES`` order joined by ';' ('' for none),
    and ``partial_role``, likewise: with ``calibration`` and ``thresholds``, the roles whose score
    beats its nulls at ``fdr``, stays below the threshold, and is large beside the null: its lower
    bound (``ci_low``; the score itself for the ``MEANING_ROLES``, read from the weights without
    sampling) at least ``PARTIAL_SHARE`` of the way from the null's centre (``null_center``) to the
    threshold. A mechanism spread over several heads shows as several partial heads, none strong
    enough for the role; a head a hair above a null with next to no spread (random-init heads that
    all attend alike: any trained head passes, however little it does) is significant but not
    partial. '' under the fixed rule.

    Two rules (architecture §4.7):
    - with ``calibration`` (``analyses.roles.nulls.calibrate_roles``, or that joined with
      ``analyses.roles.copying.meaning_nulls`` by ``analyses.roles.nulls.joint_fdr``): the roles
      whose Benjamini-Hochberg q-value over all heads x roles is at most ``fdr`` (the head beats its
      nulls); the calibration's ``MEANING_ROLES`` rows (copying, copy suppression: scored from the
      weights, so not in ``scores``) take part with their own scores; ``thresholds``, when given,
      also asks for a score of at least the threshold (a strong role, not only a non-random one);
    - without: the fixed rule, a score of at least ``thresholds`` (default ``DEFAULT_THRESHOLD``)
      and a bootstrap interval above chance.

    ``interp report``'s roles are one call: ``analyses.report.build.report_roles`` (``analyses.report_roles``).
    This function gives them only from the report's inputs: scores on the probes it chooses on, a
    calibration that joins the meaning roles' nulls (``joint_fdr``; ``calibrate_roles`` alone has
    the attention roles only, a smaller false-discovery family) and ``thresholds=DEFAULT_THRESHOLD``
    (with a calibration, ``thresholds=None`` asks for significance alone: on the toy model every
    layer-0 head then has ``previous_token;self``). Returns a tidy frame.
    """
    limits = _limits(DEFAULT_THRESHOLD if thresholds is None and calibration is None else thresholds,
                     ROLES if calibration is None else ALL_ROLES)
    roles = scores[scores["measure"].isin(ROLES)].rename(columns={"measure": "role"})
    if calibration is not None:
        check_fdr(fdr)
        nulls = ["layer", "head", "role", "q", "null_center"]
        roles = roles.merge(calibration[nulls], on=["layer", "head", "role"])
        meaning = calibration[calibration["role"].isin(MEANING_ROLES)][[*nulls, "score"]]
        roles = pd.concat([roles, meaning], ignore_index=True)
        beats = roles["q"] <= fdr
    else:
        beats = roles["ci_low"] > roles["chance"]
    strong = beats.copy()
    partial = pd.Series(False, index=roles.index)
    if limits is not None:
        limit = roles["role"].map(limits).fillna(-float("inf"))
        strong &= roles["score"] >= limit
        if calibration is not None:
            lower = roles["ci_low"].where(roles["role"].isin(ROLES), roles["score"])
            center = roles["null_center"]
            partial = beats & ~strong & (lower - center >= PARTIAL_SHARE * (limit - center))
    heads = scores[["layer", "head"]].drop_duplicates().sort_values(["layer", "head"])
    for column, chosen in (("role", roles[strong]), ("partial_role", roles[partial])):
        joined = chosen.assign(rank=chosen["role"].map(ROLE_RANK)).sort_values(["layer", "head", "rank"]) \
            .groupby(["layer", "head"])["role"].agg(";".join)
        heads[column] = [joined.get((layer, head), "") for layer, head in zip(heads["layer"], heads["head"])]
    return heads.reset_index(drop=True)


def check_fdr(fdr: float) -> None:
    if not 0 < fdr < 1:
        raise UserError(f"fdr={fdr} must be in (0, 1)")


def _limits(thresholds: float | Mapping[str, float] | None, roles: Sequence[str] = ROLES) -> dict[str, float] | None:
    """thresholds -> {role: threshold} (a number applies to every role in ``roles``: the attention
    roles, with a calibration also the meaning roles), checked; None stays None."""
    if thresholds is None:
        return None
    limits = dict(thresholds) if isinstance(thresholds, Mapping) else dict.fromkeys(roles, thresholds)
    unknown = sorted(set(limits) - set(roles))
    if unknown:
        raise UserError(f"unknown role(s) {unknown}; allowed: {', '.join(roles)}")
    return limits


def head_table(scores: pd.DataFrame, effects: pd.DataFrame | None = None,
               thresholds: float | Mapping[str, float] | None = None, *, calibration: pd.DataFrame | None = None,
               fdr: float = DEFAULT_FDR) -> pd.DataFrame:
    """The report's wide table, one row per head: ``layer, head``, per measure ``m, m_ci_low,
    m_ci_high``; with ``calibration`` per role ``{role}_null_low, {role}_null_high`` (the null
    band), ``{role}_z, {role}_p, {role}_q`` (and for its ``MEANING_ROLES`` their scores, ``copying``,
    ``copy_suppression``); with ``effects`` (``analyses.roles.causal_check.ablation_effects``' frame)
    ``ablation_effect, ablation_ci_low, ablation_ci_high, ablation_n_prompts`` (``EFFECT_COLUMNS``) and
    ``causal`` (``no_effect_labels``: "no detectable effect" where the effect's 95% interval covers 0); and ``role``
    (see ``assign_roles`` for ``thresholds``, ``calibration`` and ``fdr``, and for how its defaults differ from
    ``interp report``'s, whose table ``analyses.report_roles`` gives in one call). Returns a tidy frame."""
    wide = scores.pivot(index=["layer", "head"], columns="measure", values=["score", "ci_low", "ci_high"])
    columns = {}
    for measure in [m for m in MEASURES if m in scores["measure"].unique()]:
        columns[measure] = wide[("score", measure)]
        columns[f"{measure}_ci_low"] = wide[("ci_low", measure)]
        columns[f"{measure}_ci_high"] = wide[("ci_high", measure)]
    table = pd.DataFrame(columns).reset_index()
    if calibration is not None:
        table = table.merge(null_columns(calibration), on=["layer", "head"], how="left")
    if effects is not None:
        missing = [column for column in EFFECT_COLUMNS if column not in effects.columns]
        if missing:
            raise UserError(f"the effects frame lacks {', '.join(missing)}: 'no detectable effect' is decided by each "
                            "ablation effect's 95% interval (analyses.roles.causal_check.ablation_effects gives it)")
        table = table.merge(effects[["layer", "head", *EFFECT_COLUMNS]], on=["layer", "head"], how="left")
        table["causal"] = no_effect_labels(table["ablation_ci_low"], table["ablation_ci_high"])
    return table.merge(assign_roles(scores, thresholds, calibration=calibration, fdr=fdr), on=["layer", "head"])


def no_effect_labels(ci_low: pd.Series, ci_high: pd.Series) -> pd.Series:
    """"no detectable effect" where an effect's 95% interval [ci_low, ci_high] covers 0, else "": the
    effect is not told apart from none over the prompts, however large its mean (and a small effect
    that every prompt shows is an effect). An unknown interval (NaN: a metric without a per-prompt
    form) claims neither."""
    known = ci_low.notna() & ci_high.notna()
    return (known & ~excludes_zero(ci_low, ci_high)).map({True: NO_EFFECT, False: ""})


def null_columns(calibration: pd.DataFrame) -> pd.DataFrame:
    """The head table's null columns from a calibration table (``analyses.roles.nulls``), one row per
    head: ``layer, head``, each meaning role's score (``copying``: the patterns do not give it), and
    per role ``{role}_null_low, {role}_null_high, {role}_z, {role}_p, {role}_q``."""
    values = ("null_low", "null_high", "z", "p", "q")
    wide = calibration.pivot(index=["layer", "head"], columns="role", values=["score", *values])
    present = [role for role in ALL_ROLES if role in calibration["role"].unique()]
    columns = {role: wide[("score", role)] for role in present if role in MEANING_ROLES}
    columns |= {f"{role}_{value}": wide[(value, role)] for role in present for value in values}
    return pd.DataFrame(columns).reset_index()


def has_role(roles: pd.Series, role: str) -> pd.Series:
    """Whether each of ``roles`` (';'-joined role names) holds ``role``."""
    return roles.str.split(";").apply(lambda names: role in names)
