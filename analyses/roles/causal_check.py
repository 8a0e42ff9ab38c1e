"""The causal check behind head roles (architecture §4.1): each head's mean-ablation effect on the loss
of the probes' predictable tokens (the second copy of the segment, minus its first token).

It is one ``ablation_sweep`` (position-aligned mean ablation of each head at ``hook_z``, batched and chunked by the
shared intervention mechanism), reported in the report's terms.
"""

from __future__ import annotations

import pandas as pd

from analyses.interventions.ablation import ablation_sweep
from analyses.core.execution import executing
from analyses.core.metrics import loss_metric
from analyses.core.probes import RepeatedProbes
from interp.errors import UserError


def ablation_effects(model, probes: RepeatedProbes, memory_mb: float | None = None,
                     progress: bool | None = None, *, method: str = "mean_aligned") -> pd.DataFrame:
    """Ablate each head in turn -> one row per head: ``layer, head, ablation_effect`` (ablated minus
    clean mean loss on the predictable tokens, in nats, pooled over the probes), ``ablation_ci_low``,
    ``ablation_ci_high`` (its 95% percentile bootstrap interval over the probes, which decides "no
    detectable effect" in ``head_table``), ``ablation_n_prompts`` (the probes with a predictable token)
    and ``clean_loss``.

    ``method`` (``analyses.interventions.ablation.METHODS``): by default the position-aligned mean, the head's
    mean output over the *other* probes at the same place in their structure (the same region,
    the same offset in it), so neither the prompt's own output nor other regions' leak into it.
    ``memory_mb``, ``progress``: the execution's (``analyses.core.execution``; None: the current one's)."""
    if not probes.predictable[:, 1:].any():
        raise UserError("the probes have no predictable tokens to measure the loss on")
    metric = loss_metric(probes.tokens, probes.predictable)
    with executing(memory_mb, progress):
        sweep = ablation_sweep(model, probes, "each_head", method, metric)
    return pd.DataFrame({
        "layer": sweep["layer"].astype(int).to_numpy(),
        "head": sweep["head"].astype(int).to_numpy(),
        "ablation_effect": sweep["effect"].to_numpy(),
        "ablation_ci_low": sweep["ci_low"].to_numpy(),
        "ablation_ci_high": sweep["ci_high"].to_numpy(),
        "ablation_n_prompts": sweep["n_prompts"].to_numpy(),
        "clean_loss": sweep["baseline"].to_numpy(),
    })
