"""What the report's components section shows, computed (``components_overview``): direct logit
attribution to the probes' predictable tokens with its bootstrap intervals (``predictable_dla``,
``dla_intervals``) and the top components chosen on other probes than those that measure them
(``top_dla``), the logit lens, each head's and MLP's direct against total effect
(``component_effects``) and the heads' OV copying scores (``analyses.components.meaning``)."""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd
import torch

from analyses.components.decompose import (component_hooks, components_cache, direct_logit_attribution, logit_lens,
                                           next_token_answers)
from analyses.components.meaning import ov_scores
from analyses.core.probes import RepeatedProbes
from analyses.core.stats import bootstrap_ratio
from analyses.interventions.run import Run
from analyses.roles.calibration import FirstProbes

TOP_DLA = 5  # the components the page lists by direct logit attribution (chosen on the selection probes)


@dataclass
class ComponentsOverview:
    """The components section's numbers. ``dla``: each component's mean DLA on the measuring probes
    with its interval (``predictable_dla``; None where DLA was left out), ``top``: the ``TOP_DLA``
    components chosen on the selection probes with their ``dla`` rows (``top_dla``; None likewise);
    ``lens``: the logit lens frame on the predictable tokens (``logit_lens``); ``effects``: every
    head's and MLP's direct and total effect (``component_effects``), ``direct``: whether the
    direct effects were measured (the plan may leave them out); ``copying``: each head's OV copying
    scores, largest copying first (``ov_scores``)."""

    dla: pd.DataFrame | None
    top: pd.DataFrame | None
    lens: pd.DataFrame
    effects: pd.DataFrame
    direct: bool
    copying: pd.DataFrame


def components_overview(model, probes: RepeatedProbes, effects: pd.DataFrame, *, run: Run | None = None,
                        dla: bool = True,
                        selection: FirstProbes | None = None) -> ComponentsOverview:
    """The components section's numbers on ``probes`` (the report's intervention probes): direct
    logit attribution to the predictable tokens, the logit lens, and the OV copying scores; ``effects``
    (``component_effects``) passed through. ``run``: a ``Run`` of the probes whose ``component_hooks``
    (with the lens) serve instead of a forward. ``dla=False`` leaves direct logit attribution out (a
    model whose heads' writes are not z @ W_O). ``selection``: the probes (with a ``Run`` holding
    ``component_hooks``) the top ``TOP_DLA`` components are chosen on (``top_dla``; None: on
    ``probes``, in-sample), their values read from ``probes``. Within the current execution."""
    tokens = probes.tokens
    answers, positions = next_token_answers(tokens)
    cache = (components_cache(model, tokens, lens=True) if run is None else
             run.read(component_hooks(model, lens=True)))
    means = top = None
    if dla:
        means = predictable_dla(model, probes, cache)
        top = top_dla(means if selection is None else
                      predictable_dla(model, selection.probes, selection.run.read(component_hooks(model, lens=True))),
                      means)
    lens = logit_lens(model, cache, answers, positions=positions, where=probes.predictable[:, 1:])
    del cache
    roles = ov_scores(model)
    copying = roles[["layer", "head", "copying", "copying_topk", "suppression_topk"]].sort_values(
        ["copying", "layer", "head"], ascending=[False, True, True], kind="stable").reset_index(drop=True)
    return ComponentsOverview(dla=means, top=top, lens=lens, effects=effects,
                              direct=bool(effects["direct"].notna().any()), copying=copying)


def predictable_dla(model, probes: RepeatedProbes, cache: dict) -> pd.DataFrame:
    """``dla_intervals`` of the components' direct logit attribution to the next token on the probes'
    predictable tokens, from ``cache`` (``component_hooks`` with the lens, of ``probes``); ``attrs["logits"]``:
    the frame's ``logits`` note (``direct_logit_attribution``)."""
    answers, positions = next_token_answers(probes.tokens)
    found = direct_logit_attribution(model, cache, answers, positions=positions)
    found = found[probes.predictable[:, 1:].reshape(-1).repeat(found["component"].nunique()).cpu().numpy()]
    means = dla_intervals(found)
    means.attrs["logits"] = found["logits"].iloc[0]
    return means


def top_dla(chosen_on: pd.DataFrame, measured: pd.DataFrame, k: int = TOP_DLA) -> pd.DataFrame:
    """The ``k`` components of largest DLA in ``chosen_on`` (``dla_intervals`` of the probes that choose;
    ties by name), best first, with their rows of ``measured`` (``dla_intervals`` of other probes):
    the values the page prints, measured on prompts that did not choose them."""
    order = chosen_on.sort_values(["dla", "component"], ascending=[False, True])["component"].head(k)
    return measured.set_index("component").loc[order].reset_index()


def dla_intervals(found: pd.DataFrame) -> pd.DataFrame:
    """Each component's mean DLA over the (prompt, position) rows of a ``direct_logit_attribution``
    frame, pooled over prompts, with its 95% percentile bootstrap interval over prompts
    (``bootstrap_ratio``): one row per component, ``component, kind, layer, head, dla, ci_low, ci_high``,
    as ``dla_heatmap`` reads them (it hatches the cells whose interval contains 0)."""
    sums = found.groupby(["prompt", "component"])["dla"].sum().unstack("component")  # (prompts, components)
    counts = found.groupby("prompt").size() / found["component"].nunique()  # each prompt's rows per component
    mean, low, high = bootstrap_ratio(torch.tensor(sums.to_numpy()), torch.tensor(counts.loc[sums.index].to_numpy()))
    parts = found.drop_duplicates("component").set_index("component").loc[sums.columns, ["kind", "layer", "head"]]
    return parts.reset_index().assign(dla=mean.cpu().numpy(), ci_low=low.cpu().numpy(), ci_high=high.cpu().numpy())


def component_effects(ablation: dict) -> pd.DataFrame:
    """Every head's and MLP's direct and total ablation effect, as the ablation section measured them
    (its ``effects`` and ``mlp_effects``): ``component, kind, layer, head, total, direct, self_repair, baseline``."""
    return pd.concat([ablation["effects"], ablation["mlp_effects"]], ignore_index=True)
