"""Edge attribution patching (EAP; Syed et al. 2023): every edge of ``path_patch`` scored at once
(``path_patch(method="eap")``, ``edge_attribution``; this module is its engine, ``eap_scores``).

An edge's exact effect (``analyses.path_patch``) moves one receiver input -- a head's query, key
or value input, or the unembedding's -- by the sender's write (its source-minus-base output
through ``W_O``, (batch, pos, d_model)). EAP takes the first-order term of that change:

    attribution = sum over batch, pos of  write_sender . d metric / d receiver input

evaluated on the unpatched base run (the corrupted one when denoising, the clean one when
noising), so it predicts ``path_patch``'s ``effect`` with the same signs and directions. Three
passes give every edge: the source forward (its z), the base forward and one backward (activation
gradients only) with per-head q/k/v inputs on (TransformerLens's ``set_use_split_qkv_input``,
which ``GPTModel`` and the bridge both offer, ``GPTModel`` for only the inputs the edges read; the
receiver's input gradient is then one slice of ``blocks.{l}.hook_{q,k,v}_input``). "logits" edges
need only the gradient at the residual leaving the last block. How far the linearisation holds is measured, not assumed: ``edge_agreement`` and
``shortlist_path_patch`` (attribution ranks, exact path patching confirms the top k).

EAP-IG (Hanna et al. 2024; ``path_patch(method="eap_ig", steps=k)``, ``eap_ig``) averages the gradient over
``k`` runs whose input embeddings lie on the straight line from the base run's to the source run's
(the residual entering block 0 at ``alpha = k / steps``, k = 1..steps), so an edge whose effect
only appears part of the way from corrupted to clean -- a saturated softmax, a ReLU that opens
late, both everywhere in Tracr's compiled models -- is not scored 0 by a gradient taken where it
is flat.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Sequence

import numpy as np
import pandas as pd
import torch
from einops import rearrange

from analyses.core.hook_names import final_resid_name, qkv_input_name, resid_pre_name, z_names
from analyses.interventions.engine import activation_gradients, cache_run, gradient_parts
from analyses.core.metrics import Metric
from analyses.circuits.edges import QKV, VIAS, Edges, output_weights, writes_into
from interp.errors import UserError


@contextmanager
def split_qkv_inputs(model, inputs: Sequence[str]):
    """Per-head copies of the q/k/v ``inputs`` for the block (only those where the model can split
    them one by one, ``GPTModel.set_split_qkv_inputs``; all three on a bridge), the model's own
    setting restored after."""
    if not hasattr(model, "set_use_split_qkv_input"):
        raise UserError(f"{type(model).__name__} has no per-head q/k/v inputs (set_use_split_qkv_input), "
                        "which edge attribution through q/k/v needs; via='logits' works without them")
    if hasattr(model, "set_split_qkv_inputs"):
        saved = model.split_qkv_inputs
        switch = model.set_split_qkv_inputs
    else:
        saved = bool(getattr(model.cfg, "use_split_qkv_input", False))
        switch, inputs = model.set_use_split_qkv_input, True
    try:
        switch(inputs)
    except (ValueError, NotImplementedError) as refusal:  # a bridge whose attention has no per-head fork
        raise UserError(f"this model cannot split its q/k/v inputs per head ({refusal}); "
                        "edge attribution through q/k/v needs that; via='logits' works without it") from None
    try:
        yield
    finally:
        switch(saved)


def receiver_inputs(model, edges: Edges) -> dict[str, np.ndarray]:
    """The input each edge's receiver reads -> {hook name: the indices of its edges}."""
    keys = edges.table[:, 2] * len(VIAS) + edges.table[:, 4]  # (receiver layer, via rank)
    found, which = np.unique(keys, return_inverse=True)
    return {_input_name(model, *divmod(int(key), len(VIAS))): np.flatnonzero(which == i) for i, key in enumerate(found)}


def _input_name(model, layer: int, rank: int) -> str:
    return final_resid_name(model) if VIAS[rank] == "logits" else qkv_input_name(layer, VIAS[rank])


def split_kinds(inputs: Sequence[str]) -> list[str]:
    """The q/k/v inputs among ``inputs`` ("q", "k", "v"), which the forward splits per head."""
    return [which for which in QKV if any(name.endswith(f"hook_{which}_input") for name in inputs)]


def receiver_gradients(model, base: torch.Tensor, metric: Metric, inputs: Sequence[str],
                       positions: torch.Tensor | None = None) -> tuple[dict, list]:
    """One forward and backward of ``base`` -> ({input hook name: d metric / d input}, z per layer
    (batch, pos, head, d_head)). ``inputs``: ``blocks.{l}.hook_{q,k,v}_input`` (batch, pos, head,
    d_model) of the receivers' layers, and the final residual (batch, pos, d_model) for logits.
    ``positions``: the only ones unembedded (see ``activation_gradients``)."""
    final = final_resid_name(model)
    split = split_kinds(inputs)
    with split_qkv_inputs(model, split) if split else nullcontext():
        _, activations, grads = activation_gradients(model, base, metric, inputs, also_keep=z_names(model),
                                                     positions=positions)
    for name in inputs:
        if name != final and grads[name].shape[2] != model.cfg.n_heads:
            raise UserError(f"{name} carries {grads[name].shape[2]} heads, not one per query head "
                            f"({model.cfg.n_heads}): this model's key/value inputs are shared, so edge "
                            "attribution through k/v is undefined here; use via='q' or 'logits'")
    return {name: grads[name] for name in inputs}, [activations[name] for name in z_names(model)]


# A chunk of writes (senders, rows, d_model) of about this many bytes stays in the CPU's cache
# while every receiver input's gradient is multiplied into it.
CHUNK_BYTES = 16 * 2**20


def attributions(edges: Edges, moved: Sequence[torch.Tensor], w_o: Sequence[torch.Tensor], grads: dict,
                 inputs: dict[str, np.ndarray], chunk_bytes: int = CHUNK_BYTES) -> torch.Tensor:
    """Each edge's first-order effect -> (len(edges),): the sender's write dotted with the gradient
    of the receiver's input, summed over batch and positions.

    ``moved``: each sender layer's source-minus-base z (batch, pos, head, d_head), from layer 0 up
    to the last sender's; ``w_o``: those layers' ``W_O`` (head, d_head, d_model); ``grads``: {input
    hook name: d metric / d input}, (batch, pos, head, d_model) for q/k/v inputs, (batch, pos,
    d_model) for the final residual; ``inputs``: {hook name: its edges}, as ``receiver_inputs``
    gives. The writes are made a chunk of (batch * pos) rows at a time (``chunk_bytes``), never
    all at once; per chunk, the inputs that read the same senders (one receiver layer's q, k and
    v) share one matrix product with those senders' writes."""
    n_heads = w_o[0].shape[0]
    sender = torch.from_numpy(edges.table[:, 0] * n_heads + edges.table[:, 1])
    receiver = torch.from_numpy(np.maximum(edges.table[:, 3], 0))  # logits: receiver 0
    flat = {name: rearrange(grad if grad.ndim == 4 else grad[:, :, None], "b p r d -> (b p) r d")
            for name, grad in grads.items()}  # (batch * pos, receiver, d_model); logits: one receiver
    groups = {}  # senders read -> the inputs reading them
    for name, members in inputs.items():
        groups.setdefault(int(sender[members].max()) + 1, []).append(name)
    moved = [rearrange(z, "b p h e -> h (b p) e") for z in moved]
    tables = {n: moved[0].new_zeros(sum(flat[name].shape[1] for name in names), n, dtype=torch.float32)
              for n, names in groups.items()}  # accumulated in float32 whatever the model's dtype
    n_rows, d_model = moved[0].shape[1], w_o[0].shape[-1]
    chunk = max(1, chunk_bytes // (4 * d_model * len(moved) * n_heads))
    for start in range(0, n_rows, chunk):
        part = slice(start, start + chunk)
        out = moved[0].new_empty(len(moved) * n_heads, min(chunk, n_rows - start), d_model)
        writes = writes_into(out, [z[:, part] for z in moved], w_o).flatten(1)  # (sender, rows * d_model)
        for n, names in groups.items():
            grad = torch.cat([rearrange(flat[name][part], "n r d -> r (n d)") for name in names])
            tables[n] += grad.float() @ writes[:n].T.float()
    values = torch.empty(len(edges))
    for n, names in groups.items():
        offset = 0
        for name in names:
            members = torch.from_numpy(inputs[name])
            values[members] = tables[n][offset + receiver[members], sender[members]].float().cpu()
            offset += flat[name].shape[1]
    return values


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


def integrated_gradients(model, base: torch.Tensor, metric: Metric, inputs: Sequence[str], base_resid: torch.Tensor,
                         source_resid: torch.Tensor, steps: int, positions: torch.Tensor | None = None) -> dict:
    """The metric's gradient at each of ``inputs`` averaged over ``steps`` runs of ``base`` whose
    residual entering block 0 lies on the line from ``base_resid`` to ``source_resid`` (batch, pos,
    d_model; alpha = k / steps, k = 1..steps) -> {input name: (batch, pos, [head,] d_model)}."""
    mean = {}
    for k in range(1, steps + 1):
        with interpolated_inputs(model, base_resid, source_resid, k / steps):
            grads, _ = receiver_gradients(model, base, metric, inputs, positions)
        for name, grad in grads.items():
            mean[name] = mean.get(name, 0) + grad / steps
    return mean


def eap_scores(model, edges: Edges, base: torch.Tensor, source: torch.Tensor, metric: Metric, steps: int | None,
               memory_mb: float) -> torch.Tensor:
    """The EAP score of each of ``edges`` -> (len(edges),) float64, ``base`` the run the edges
    would be patched into and ``source`` the run patched from (batch, pos). Three passes: the
    source forward, the base forward and its backward. ``steps``: EAP-IG instead, the gradient
    averaged over ``steps`` runs with input embeddings from the base run's to the source run's
    (``integrated_gradients``), ``steps + 2`` passes. ``memory_mb``: the passes run over chunks of
    prompts whose forward and backward fit it (``gradient_parts``; the scores are sums over
    prompts, so the chunks' scores, each weighted by its share of the metric, add up to the
    batch's)."""
    senders_z = z_names(model)[:int(edges.table[:, 0].max()) + 1]  # the source run stops after these
    first = [resid_pre_name(0)] if steps else []  # where EAP-IG interpolates
    inputs = receiver_inputs(model, edges)
    w_o = output_weights(model, len(senders_z))
    copies = 4 if steps is None else 5  # the inputs, their norms, both gradients (EAP-IG: and the running mean)
    per_head_inputs = copies * model.cfg.n_heads * model.cfg.d_model * model.cfg.n_layers * len(split_kinds(inputs))
    # a tenth of the budget for the writes of one chunk of rows (and as much for the gradients they meet)
    chunk_bytes = min(CHUNK_BYTES, int(memory_mb * 2**20 / 10))
    parts, positions = gradient_parts(model, base, metric, 0.8 * memory_mb, per_position=per_head_inputs)
    scores = torch.zeros(len(edges), dtype=torch.float64)
    for part in parts:
        rows = part.rows
        _, source_cache = cache_run(model, source[rows], [*senders_z, *first], logits=False)
        if steps is None:
            grads, base_z = receiver_gradients(model, base[rows], part.metric, list(inputs), positions)
        else:
            _, base_cache = cache_run(model, base[rows], [*senders_z, *first], logits=False)
            base_z = [base_cache[name] for name in senders_z]
            grads = integrated_gradients(model, base[rows], part.metric, list(inputs), base_cache[first[0]],
                                         source_cache[first[0]], steps, positions)
        moved = [source_cache[name] - z for name, z in zip(senders_z, base_z)]
        scores += part.share * attributions(edges, moved, w_o, grads, inputs, chunk_bytes).double()
    return scores


def edge_agreement(frame: pd.DataFrame, top_k: int = 10) -> dict:
    """How well ``attribution`` predicts ``effect`` over the edges of ``frame``: Spearman and
    Pearson correlations, and the share of the ``top_k`` edges by |effect| that are also among the
    ``top_k`` by |attribution| (``top_k`` capped at the number of edges)."""
    missing = {"attribution", "effect"} - set(frame.columns)
    if missing:
        raise UserError(f"edge_agreement needs columns attribution and effect; missing {sorted(missing)}")
    if len(frame) < 2:
        raise UserError(f"edge_agreement needs at least 2 edges, got {len(frame)}")
    k = min(top_k, len(frame))
    pair = frame[["attribution", "effect"]].astype(float)
    top = [set(pair[col].abs().sort_values(ascending=False, kind="stable").index[:k]) for col in pair]
    return {
        "spearman": float(pair.rank().corr().iloc[0, 1]),
        "pearson": float(pair.corr().iloc[0, 1]),
        "top_k_overlap": len(top[0] & top[1]) / k,
        "top_k": k,
    }
