"""Selection apart from measurement (architecture §4.12): heads chosen on one split of the prompts, their
effects measured on another.

Choosing the heads with the largest effect and then printing that effect on the same prompts prints
the winner's luck with it: on a model with no real effect, the best of many heads has an interval
that excludes 0 on the prompts it was chosen on and covers 0 on fresh ones (``tests/test_splits.py``
shows both). ``split_prompts`` draws the two disjoint splits, seeded; where prompts come from
templates (or any other groups), each group is split in the same proportion, so neither split holds
templates the other lacks. Where prompts come in clusters of near-copies (``clusters``: prompts that
differ only in what the behaviour does not depend on), whole clusters are split, so no cluster has
prompts on both sides; the intervals then resample clusters
(``analyses.core.stats.bootstrap_cluster_ratio``). The measurement split, whose effects are printed with intervals over its
prompts, must hold at least ``MIN_INTERVAL_PROMPTS`` of them (``check_split``). ``PromptSplit.record``
is the split as data for ``meta.json``.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Hashable, Sequence

import torch

from analyses.core.stats import MIN_INTERVAL_PROMPTS, cluster_index
from interp.errors import UserError

DEFAULT_SELECTION_SHARE = 0.5  # of the prompts, for choosing; the rest measure


@dataclass(frozen=True)
class PromptSplit:
    """Two disjoint sets of prompt indices covering ``n_prompts``: ``selection`` (to choose heads,
    circuits, thresholds on) and ``measurement`` (to report their effects on), each (n,) long, sorted;
    how they were drawn: ``seed``, ``share`` (the selection's target share), ``stratified``,
    ``n_clusters`` (the clusters split whole, None where each prompt was split on its own)."""

    selection: torch.Tensor
    measurement: torch.Tensor
    n_prompts: int
    seed: int
    share: float
    stratified: bool
    n_clusters: int | None = None

    def record(self) -> dict:
        """The split for ``meta.json``: how it was drawn, the sizes, the selection's indices (the
        measurement holds the others) and the SHA-256 of both index lists."""
        selection, measurement = self.selection.tolist(), self.measurement.tolist()
        digest = hashlib.sha256(json.dumps([selection, measurement]).encode()).hexdigest()
        return {"seed": self.seed, "share": self.share, "stratified": self.stratified, "n_prompts": self.n_prompts,
                "n_clusters": self.n_clusters, "sizes": {"selection": len(selection), "measurement": len(measurement)},
                "selection": selection, "sha256": digest}


def check_split(n_prompts: int, share: float = DEFAULT_SELECTION_SHARE) -> int:
    """The selection's size for ``n_prompts`` split at ``share``: round(share * n_prompts), at least 1.
    Refused in one line where the prompts are too few for both splits or the rest, the measurement
    split, would be fewer than ``MIN_INTERVAL_PROMPTS``."""
    if not isinstance(n_prompts, int) or n_prompts < 2:
        raise UserError(f"n_prompts={n_prompts}: a selection and a measurement split need at least 2 prompts")
    if not 0 < share < 1:
        raise UserError(f"share={share} must be in (0, 1): the selection's share of the prompts")
    wanted = max(math.floor(share * n_prompts + 0.5), 1)
    if n_prompts - wanted < MIN_INTERVAL_PROMPTS:
        raise UserError(f"n_prompts={n_prompts} split at share={share:g} leaves {n_prompts - wanted} prompt(s) to "
                        f"measure on; the measurement split's intervals need at least {MIN_INTERVAL_PROMPTS}")
    return wanted


def split_prompts(n_prompts: int, share: float = DEFAULT_SELECTION_SHARE, seed: int = 0,
                  strata: Sequence[Hashable] | None = None,
                  clusters: Sequence[Hashable] | None = None) -> PromptSplit:
    """Split prompts 0..n_prompts-1 into a selection and a disjoint measurement split, seeded.

    The selection gets ``check_split``'s count: round(share * n_prompts), at least 1, leaving the
    measurement at least ``MIN_INTERVAL_PROMPTS`` (else refused).
    ``strata``: a label per prompt (its template, say); each stratum gives the selection the floor
    of share x its size, and the prompts still owed go one each to the strata with the largest
    remainders (ties drawn at random), so every stratum is split within one prompt of the share.
    Within a stratum the prompts are drawn at random.
    ``clusters``: a label per prompt; then the clusters are split as prompts would be (the count,
    the strata and the check are of clusters, each cluster in one stratum) and each prompt goes
    where its cluster goes. A cluster whose prompts are of several strata is refused.
    """
    if clusters is None:
        chosen = _chosen(n_prompts, share, seed, strata, check_split(n_prompts, share))
        return PromptSplit(chosen.nonzero()[:, 0], (~chosen).nonzero()[:, 0], n_prompts, seed, share,
                           strata is not None)
    if len(clusters) != n_prompts:
        raise UserError(f"clusters has {len(clusters)} labels for {n_prompts} prompts; give one per prompt")
    index = cluster_index(clusters)
    n_clusters = int(index.max()) + 1 if n_prompts else 0
    members: list[list[int]] = [[] for _ in range(n_clusters)]
    for prompt, cluster in enumerate(index.tolist()):
        members[cluster].append(prompt)
    cluster_strata = None
    if strata is not None:
        if len(strata) != n_prompts:
            raise UserError(f"strata has {len(strata)} labels for {n_prompts} prompts; give one per prompt")
        cluster_strata = []
        for group in members:
            labels = list(dict.fromkeys(strata[i] for i in group))
            if len(labels) > 1:
                raise UserError(f"cluster {clusters[group[0]]!r} holds prompts of strata {labels[0]!r} and "
                                f"{labels[1]!r}; a split stratified by these strata needs each cluster within one")
            cluster_strata.append(labels[0])
    chosen_clusters = _chosen(n_clusters, share, seed, cluster_strata, check_clusters(n_clusters, share))
    chosen = chosen_clusters[index]
    return PromptSplit(chosen.nonzero()[:, 0], (~chosen).nonzero()[:, 0], n_prompts, seed, share,
                       strata is not None, n_clusters)


def check_clusters(n_clusters: int, share: float = DEFAULT_SELECTION_SHARE) -> int:
    """``check_split`` for clusters split whole: the selection's count of clusters, refused in one
    line where the measurement would hold fewer than ``MIN_INTERVAL_PROMPTS`` clusters (an interval
    resampling clusters needs as many)."""
    if n_clusters < 2:
        raise UserError(f"{n_clusters} cluster(s) of near-copy prompts: a selection and a measurement split need at "
                        "least 2")
    if not 0 < share < 1:
        raise UserError(f"share={share} must be in (0, 1): the selection's share of the prompts")
    wanted = max(math.floor(share * n_clusters + 0.5), 1)
    if n_clusters - wanted < MIN_INTERVAL_PROMPTS:
        raise UserError(f"{n_clusters} clusters of near-copy prompts split at share={share:g} leave "
                        f"{n_clusters - wanted} cluster(s) to measure on; the measurement split's intervals (over "
                        f"clusters) need at least {MIN_INTERVAL_PROMPTS}")
    return wanted


def _chosen(n_units: int, share: float, seed: int, strata: Sequence[Hashable] | None, wanted: int) -> torch.Tensor:
    """(n_units,) bool: the ``wanted`` units drawn for the selection, seeded, each stratum within one
    unit of ``share`` (see ``split_prompts``)."""
    labels = [0] * n_units if strata is None else list(strata)
    if len(labels) != n_units:
        raise UserError(f"strata has {len(labels)} labels for {n_units} prompts; give one per prompt")
    groups: dict[Hashable, list[int]] = {}
    for index, label in enumerate(labels):
        groups.setdefault(label, []).append(index)
    generator = torch.Generator().manual_seed(seed)
    exact = [share * len(members) for members in groups.values()]
    taken = [math.floor(value) for value in exact]
    tie_breaks = torch.rand(len(groups), generator=generator).tolist()
    by_remainder = sorted(range(len(groups)), key=lambda g: (taken[g] - exact[g], tie_breaks[g]))
    for g in by_remainder[:wanted - sum(taken)]:
        taken[g] += 1
    selection = []
    for members, count in zip(groups.values(), taken):
        order = torch.randperm(len(members), generator=generator)[:count]
        selection += [members[i] for i in order.tolist()]
    chosen = torch.zeros(n_units, dtype=torch.bool)
    chosen[selection] = True
    return chosen
