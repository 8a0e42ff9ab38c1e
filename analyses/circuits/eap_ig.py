"""EAP-IG (Hanna et al. 2024): edge attribution patching with integrated gradients.

EAP (``analyses.circuits.edge_attribution``) scores an edge by the sender's write (source minus base, through
``W_O``) dotted with the gradient of the metric at the receiver's input, taken once, on the base
run. EAP-IG averages that gradient over ``steps`` runs whose input embeddings lie on the straight
line from the base run's to the source run's (the residual entering block 0 at ``alpha = k /
steps``, k = 1..steps; Hanna et al.'s integrated-gradients variant on the inputs), so an edge whose
effect only appears part of the way from corrupted to clean -- a saturated softmax, a ReLU that
opens late, both everywhere in Tracr's compiled models -- is not scored 0 by a gradient taken where
it is flat. Same edges, same sign convention and same frame as ``edge_attribution``; ``steps + 2``
passes (the source forward, then a forward and a backward per step).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Sequence

import pandas as pd
import torch

from analyses.circuits.edge_attribution import attributions, receiver_gradients, receiver_inputs
from analyses.core.hook_names import resid_pre_name, z_names
from analyses.interventions.engine import cache_run
from analyses.core.metrics import Metric
from analyses.circuits.path_patching import VIAS, edges_of, output_weights
from analyses.interventions.patching import base_and_source
from interp.errors import UserError


@contextmanager
def interpolated_inputs(model, base_resid: torch.Tensor, source_resid: torch.Tensor, alpha: float):
    """While open, the residual entering block 0 is ``base + alpha * (source - base)`` (batch, pos,
    d_model), a leaf that carries gradients; the hook stays through the analyses' own
    ``run_with_hooks`` (which removes only temporary hooks) and is removed on exit."""
    point = model.mod_dict[resid_pre_name(0)]

    def interpolate(resid, hook):
        return torch.lerp(base_resid, source_resid, alpha).requires_grad_(True)

    point.add_hook(interpolate, is_permanent=True)
    try:
        yield
    finally:
        point.remove_hooks("fwd", including_permanent=True)


def eap_ig(
    model,
    clean,
    corrupted,
    metric: Metric,
    *,
    steps: int = 5,
    senders=None,
    receivers=None,
    via: str | Sequence[str] = VIAS,
    direction: str = "denoise",
) -> pd.DataFrame:
    """EAP-IG score of every edge -> one row per edge, as ``edge_attribution``'s frame, the score
    in ``attribution``. ``steps``: points on the path (Hanna et al. use 5-50)."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise UserError(f"steps={steps!r} must be a positive integer")
    if not getattr(model, "suffix_only_start", False):
        raise UserError(f"EAP-IG interpolates the residual entering block 0, which needs a GPTModel; got {type(model).__name__}")
    edges = edges_of(model, senders, receivers, via)
    base, source = base_and_source(model, clean, corrupted, direction)
    senders_z = z_names(model)[:int(edges.table[:, 0].max()) + 1]
    first = resid_pre_name(0)
    _, source_cache = cache_run(model, source, [*senders_z, first], logits=False)
    _, base_cache = cache_run(model, base, [*senders_z, first], logits=False)
    inputs = receiver_inputs(model, edges)
    mean = {}
    for k in range(1, steps + 1):
        with interpolated_inputs(model, base_cache[first], source_cache[first], k / steps):
            grads, _ = receiver_gradients(model, base, metric, list(inputs))
        for name, grad in grads.items():
            mean[name] = mean.get(name, 0) + grad / steps
    moved = [source_cache[name] - base_cache[name] for name in senders_z]
    return edges.frame(attribution=attributions(edges, moved, output_weights(model, len(senders_z)), mean, inputs))
