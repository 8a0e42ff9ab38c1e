"""The hook self-test (architecture §2.1): does this model's hook API do what the analyses assume?

A ``TransformerBridge`` wraps Hugging Face modules, and for some families an edit of a hook never
reaches the output (measured: ``hook_pattern`` edits on opt and gpt_neo change nothing at all).
``check_hooks(model)`` runs once per model object and measures, on one short prompt:

- every hook the analyses read fires with its documented shape (``hook_k``/``hook_v`` carry the
  key/value heads of grouped- and multi-query attention; ``mlp.hook_post``, on models with MLPs, one
  value per neuron: as many as ``W_out`` has rows, which the bridge's ``cfg.d_mlp`` can get wrong,
  measured on OPT);
- an edit of ``hook_q``, ``hook_k``, ``hook_v``, ``hook_z`` and ``hook_pattern`` changes the
  model's computation (path patching edits the first three): the layer's own attention output
  ``hook_attn_out``, where an edit of ``hook_attn_out`` itself reaches the logits (then its value
  is what every later layer reads), else the logits. The layer's output, not the logits: one
  probe prompt can leave a program's output where it was while the attention moved (a Tracr
  ``SelectorWidth`` whose width is already the largest, measured on ``count_less_freq``). Every probe *adds* a fixed pattern (``added_pattern``),
  never zeros or scales: an edit that zeroes an activation which is already zero (an MLP with zero
  weights, a pruned or hand-set model) changes nothing while the hook works, and would refuse the
  model falsely. The pattern is as large as the activation itself (its largest entry, at least
  1): a bounded pattern is lost on saturated attention, where queries and keys are huge (Tracr's
  compiled heads: entries of 100, so an added 1..3 left every argmax-like pattern where it was and
  refused path patching on models whose q/k hooks work); scaled, an edit of q or k moves the
  attention scores by as much as they are, however cold the softmax. The last layer is tried
  first, then the earlier ones, so a layer whose weights ignore the edit (a head with zero value
  weights) does not decide alone;
- where the output projection is reachable (``blocks.{l}.attn.W_O`` / ``b_O``), the heads' outputs
  plus its bias add up to ``hook_attn_out``; in a block that norms its attention output before the
  residual (``blocks.{l}.ln1_post``: Gemma 2 and 3), they add up to the output before that norm
  (``attn.hook_out``), and ``hook_attn_out`` is linear in them given the norm's scale from the
  clean run, frozen: weight * (heads + b_O) / scale, scale (batch, pos, 1) fitted per row as the
  final norm's is for direct logit attribution. Each of these errors is measured relative to the
  size of the activation it is compared with (its largest |entry|, at least 1): a trained Gemma's
  attention outputs run into the hundreds and thousands, where float32 rounds in the fourth
  decimal while the decomposition is exact to a few of its epsilons. An analysis that takes a head's write to be its
  ``z @ W_O`` (``HEAD_WRITES``) is refused on such a block: the write the residual receives is
  that map of it. One that applies the map (``HEAD_CONTRIBUTIONS``: direct logit attribution,
  exact path patching, direct effects; ``frozen_output_norm``) runs where the check holds.

``require_edit`` is what interventions call: it refuses, in one line naming the hook and the
family, an intervention whose edit would not reach the output, instead of returning numbers from
an edit that did nothing. A *need* is one of those facts by name (a hook of ``EDITABLE``;
``HEAD_WRITES``: each head's ``z @ W_O`` plus ``b_O`` gives ``hook_attn_out``;
``HEAD_CONTRIBUTIONS``: that, or through the frozen norm on the attention output; ``UNNORMED_ATTN_OUT``:
no such norm), and
``HookCheck.refusal`` is the one place that turns a need the model lacks into its one-line
refusal: the steps that need it raise it (``require``), and a command plans its sections from it
before any sweep (``left_out``).
"""

from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass, field
from typing import Sequence

import pandas as pd
import torch
from einops import einsum

from analyses.core.hook_names import has_mlps
from analyses.core.tokens import model_device, ordinary_token_ids, start_ids
from interp import provenance
from interp.errors import UserError
from interp.precision import rounded_dtype
from interp.provenance import model_family, model_impl

EDITABLE = ("hook_q", "hook_k", "hook_v", "hook_z", "hook_pattern")
NEURONS = "mlp.hook_post"  # the MLP's hidden activation (batch, pos, d_mlp), checked on models with MLPs
# relative change of the logits below which an edit counts as not reaching the output
EDIT_TOLERANCE = 1e-6
# the error allowed in float32 where heads and b_O are added up against the attention's output, relative to that
# output's size (its largest |entry|, at least 1: below 1, the error is absolute)
SUM_TOLERANCE = 1e-4
HEAD_WRITES = "head_writes"  # the need: each head's write is z @ W_O (with b_O they give hook_attn_out)
# the need: each head's contribution to the residual is known from its z: z @ W_O, or in a block that norms its
# attention output, weight * z @ W_O / the norm's scale from the clean run, frozen (``frozen_output_norm``)
HEAD_CONTRIBUTIONS = "head_contributions"
# the need: no norm between the heads and the residual, so that a rerun with a head's z edited moves the residual
# by that head's contribution alone (a norm on the attention output would be recomputed there, not frozen)
UNNORMED_ATTN_OUT = "unnormed_attn_out"
PRE_NORM_OUT = "attn.hook_out"  # a block that norms its attention output: that output before the norm
NEEDS = (*EDITABLE, HEAD_WRITES, HEAD_CONTRIBUTIONS, UNNORMED_ATTN_OUT)
_checked: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass
class HookCheck:
    """What the self-test measured.

    shapes: one row per (hook, layer): the shape that fired (None: it did not fire) and the one
        documented. reaches_output: hook name -> whether an edit of it changed the computation
        (the layer's ``hook_attn_out`` where that is on the path, else the logits), with
        ``effects`` the largest relative change. sum_error: the largest |sum of head outputs +
        b_O - hook_attn_out| over layers (summed in float32), relative to hook_attn_out's size in
        its layer (``relative_error``), None where the projection is not reachable;
        sum_tolerance: what it may be (``SUM_TOLERANCE`` in float32; in a narrower dtype, the
        output's own rounding: 8 of its epsilons). In blocks that norm their attention output
        (``output_normed``) the sum is against ``attn.hook_out``, the output before the norm, and
        norm_error is the largest |weight * (heads + b_O) / scale - hook_attn_out| relative to
        hook_attn_out's size, scale the norm's from the clean run (frozen), with the same
        tolerance; None elsewhere.
    """

    family: str
    impl: str
    shapes: pd.DataFrame
    reaches_output: dict[str, bool]
    effects: dict[str, float]
    sum_error: float | None
    notes: list[str] = field(default_factory=list)
    sum_tolerance: float = SUM_TOLERANCE
    output_normed: bool = False
    norm_error: float | None = None

    @property
    def shapes_ok(self) -> bool:
        return bool(self.shapes["ok"].all())

    @property
    def sums_ok(self) -> bool | None:
        return None if self.sum_error is None else self.sum_error <= self.sum_tolerance

    @property
    def norm_ok(self) -> bool | None:
        return None if self.norm_error is None else self.norm_error <= self.sum_tolerance

    @property
    def ok(self) -> bool:
        """Every hook fires as documented and every edit reaches the output."""
        return (self.shapes_ok and all(self.reaches_output.values()) and self.sums_ok is not False
                and self.norm_ok is not False)

    def refusal(self, need: str, needed_by: str) -> str | None:
        """The one line that refuses ``needed_by`` on this model for want of ``need`` (one of
        ``NEEDS``: an edit of that hook reaching the output, ``HEAD_WRITES``, ``HEAD_CONTRIBUTIONS`` or
        ``UNNORMED_ATTN_OUT``), None where the model has it."""
        if need == UNNORMED_ATTN_OUT:
            if not self.output_normed:
                return None
            return (f"{needed_by} reruns the blocks with a head's z edited, and on this {self.family} model "
                    f"({self.impl}) the norm on the attention output (blocks.{{l}}.ln1_post) would be recomputed "
                    "there, not frozen at the clean run's scale as a head's contribution is defined; see `interp check`")
        if need == HEAD_CONTRIBUTIONS:
            if self.sums_ok and self.norm_ok is not False:
                return None
            if self.sums_ok:
                return (f"{needed_by} needs each head's contribution weight * z @ W_O / scale (the norm on the "
                        f"attention output, its scale from the clean run), and on this {self.family} model "
                        f"({self.impl}) it does not give hook_attn_out (error {self.norm_error:.2g}); see `interp check`")
            return self._unsummed(needed_by)
        if need == HEAD_WRITES:
            if self.output_normed:
                return (f"{needed_by} needs each head's write to the residual to be its z @ W_O, and on this "
                        f"{self.family} model ({self.impl}) a norm lies between them (blocks.{{l}}.ln1_post: the "
                        "write is weight * z @ W_O / the norm's scale); see `interp check`")
            return None if self.sums_ok else self._unsummed(needed_by)
        if need not in EDITABLE:
            raise ValueError(f"unknown need {need!r}; allowed: {', '.join(NEEDS)}")
        if self.reaches_output[need]:
            return None
        return (f"{needed_by} needs edits of {need}, which do not reach the output of this {self.family} model "
                f"({self.impl}); see `interp check`")

    def _unsummed(self, needed_by: str) -> str:
        """The refusal where the heads' z @ W_O plus b_O do not give the attention's output."""
        output = "attn.hook_out" if self.output_normed else "hook_attn_out"
        found = "is not reachable" if self.sums_ok is None else f"does not give {output}"
        return (f"{needed_by} needs each head's write z @ W_O, and on this {self.family} model ({self.impl}) "
                f"blocks.{{l}}.attn.W_O {found}; see `interp check`")

    def _error(self, error: float) -> str:
        return f"max error {error:.1e} of the output's size, {self.sum_tolerance:.0e} allowed"

    def summary(self) -> str:
        """A few lines for a terminal."""
        lines = [f"{self.family} ({self.impl})"]
        bad = self.shapes[~self.shapes["ok"]]
        lines.append("hook shapes: all as documented" if bad.empty else "hook shapes: NOT as documented:\n"
                     + bad.to_string(index=False))
        for hook in EDITABLE:
            verdict = "changes the output" if self.reaches_output[hook] else "changes NOTHING: interventions on it are refused"
            lines.append(f"edit {hook}: {verdict} (relative change {self.effects[hook]:.2e})")
        if self.sum_error is None:
            lines.append("heads + b_O = hook_attn_out: not checked (output projection not reachable)")
        elif not self.output_normed:
            lines.append(f"heads + b_O = hook_attn_out: {'yes' if self.sums_ok else 'NO'} "
                         f"({self._error(self.sum_error)})")
        else:
            lines.append(f"heads + b_O = attn.hook_out (before the norm on the attention output): "
                         f"{'yes' if self.sums_ok else 'NO'} ({self._error(self.sum_error)})")
            lines.append(f"hook_attn_out = weight * (heads + b_O) / scale, the norm's scale from the clean run "
                         f"(frozen): {'yes' if self.norm_ok else 'NO'} ({self._error(self.norm_error)})")
        return "\n".join(lines + self.notes)


def documented_shapes(cfg, batch: int, n_pos: int) -> dict[str, tuple[int, ...]]:
    """Hook suffix -> the shape architecture §2 documents for it."""
    n_kv = getattr(cfg, "n_key_value_heads", None) or cfg.n_heads
    heads, kv = (batch, n_pos, cfg.n_heads, cfg.d_head), (batch, n_pos, n_kv, cfg.d_head)
    square, resid = (batch, cfg.n_heads, n_pos, n_pos), (batch, n_pos, cfg.d_model)
    return {"hook_resid_pre": resid, "attn.hook_q": heads, "attn.hook_k": kv, "attn.hook_v": kv,
            "attn.hook_attn_scores": square, "attn.hook_pattern": square, "attn.hook_z": heads,
            "hook_attn_out": resid}


def probe_tokens(model) -> torch.Tensor:
    """One short fixed prompt (1, pos) of ordinary tokens, the start token first where the model's
    texts begin with one."""
    ordinary = ordinary_token_ids(model)
    start = start_ids(model)
    n_pos = min(model.cfg.n_ctx, 12)
    body = [ordinary[(7 * i + 3) % len(ordinary)] for i in range(n_pos - len(start))]
    return torch.tensor([[*start, *body]], device=model_device(model))


@torch.no_grad()
def measure_shapes(model, tokens: torch.Tensor) -> tuple[pd.DataFrame, torch.Tensor, dict]:
    """-> (one row per hook and layer, the logits, the cache of every checked hook)."""
    expected = documented_shapes(model.cfg, *tokens.shape)
    if has_mlps(model):  # one activation per neuron: as many as the output projection has rows
        expected[NEURONS] = (*tokens.shape, model.blocks[0].mlp.W_out.shape[0])
    if output_norm(model, 0) is not None:
        expected[PRE_NORM_OUT] = expected["hook_attn_out"]
    names = {f"blocks.{layer}.{suffix}": (layer, suffix) for layer in range(model.cfg.n_layers) for suffix in expected}
    names["hook_embed"] = (None, "hook_embed")
    expected["hook_embed"] = (*tokens.shape, model.cfg.d_model)
    logits, cache = model.run_with_cache(tokens, names_filter=lambda name: name in names)
    rows = []
    for name, (layer, suffix) in names.items():
        fired = tuple(cache[name].shape) if name in cache else None
        rows.append({"hook": name, "layer": layer, "shape": fired, "expected": expected[suffix],
                     "ok": fired == expected[suffix]})
    return pd.DataFrame(rows), logits, {name: cache[name] for name in names if name in cache}


@torch.no_grad()
def edit_effect(model, tokens: torch.Tensor, reference: torch.Tensor, name: str, edit,
                observed: str | None = None) -> float:
    """Largest change of the logits (``observed`` None) or of the activation at hook ``observed``
    when ``edit(activation)`` replaces the activation at ``name``, relative to ``reference``'s
    scale (the unedited logits or activation, same shape)."""
    seen = {}
    hooks = [(name, lambda activation, hook: edit(activation))]
    if observed is not None:
        hooks.append((observed, lambda activation, hook: seen.setdefault("value", activation.detach().clone())))
    with warnings.catch_warnings():  # the bridge warns where it discards the edit: that is what is measured
        warnings.simplefilter("ignore", UserWarning)
        edited = model.run_with_hooks(tokens, fwd_hooks=hooks)
    edited = edited if observed is None else seen["value"]
    return float((edited - reference).abs().max() / reference.abs().max().clamp(min=1e-12))


PROBE_LOW, PROBE_HIGH = 1.0, 3.0  # the range of the pattern a probe adds, in units of the activation's size
_GOLDEN = (5 ** 0.5 - 1) / 2


def added_pattern(activation: torch.Tensor) -> torch.Tensor:
    """``activation`` plus a large fixed pattern of its shape: entries in [1, 3) times the
    activation's size (its largest |entry|, at least 1), different at every position, head and
    dimension (a golden-ratio sequence over the flattened tensor), so the edit changes the
    activation whatever its value, moves a softmax's input by different amounts at different keys
    by as much as the input itself (a saturated softmax too), and moves an attention pattern's
    weights by a positive total."""
    index = torch.arange(activation.numel(), dtype=torch.float64)  # on the CPU: float64 (mps has none)
    pattern = PROBE_LOW + (PROBE_HIGH - PROBE_LOW) * torch.frac(index * _GOLDEN)
    size = max(1.0, float(activation.detach().abs().max())) if activation.numel() else 1.0
    return activation + (size * pattern).reshape(activation.shape).to(activation.device, activation.dtype)


@torch.no_grad()
def probe_effect(model, tokens: torch.Tensor, logits: torch.Tensor, names: Sequence[str],
                 observed: dict[str, tuple[str, torch.Tensor]] | None = None) -> float:
    """The relative change (``edit_effect``) when ``added_pattern`` edits the hook at each of
    ``names`` in turn, stopping at the first whose edit exceeds ``EDIT_TOLERANCE``; the largest
    change seen (0.0 for no names). The change of the logits, or for a name in ``observed``
    (name -> (hook, its unedited activation)) of that hook's activation."""
    effect = 0.0
    for name in names:
        hook, reference = (observed or {}).get(name, (None, logits))
        effect = max(effect, edit_effect(model, tokens, reference, name, added_pattern, hook))
        if effect > EDIT_TOLERANCE:
            break
    return effect


def layers_last_first(model, suffix: str) -> list[str]:
    """``blocks.{l}.{suffix}`` for every layer, the last first."""
    return [f"blocks.{layer}.{suffix}" for layer in reversed(range(model.cfg.n_layers))]


def output_norm(model, layer: int):
    """Block ``layer``'s norm on its attention output before the residual (``ln1_post``: Gemma 2 and
    3, on our model and the bridge alike), None where it has none."""
    return getattr(model.blocks[layer], "ln1_post", None)


def output_norm_reads(model, layers: Sequence[int] | None = None) -> list[str]:
    """What ``frozen_output_norm`` reads of a run, for each of ``layers`` (None: every layer) whose
    block norms its attention output: ``blocks.{l}.attn.hook_out`` and ``blocks.{l}.hook_attn_out``."""
    layers = range(model.cfg.n_layers) if layers is None else layers
    return [f"blocks.{layer}.{suffix}" for layer in layers if output_norm(model, layer) is not None
            for suffix in (PRE_NORM_OUT, "hook_attn_out")]


@dataclass
class FrozenNorm:
    """A block's norm on its attention output at a run, frozen: the linear map ``x -> weight * x /
    scale``; weight (d_model,) float32 (Gemma's ``1 + weight``), scale (..., 1) float32, one per row
    of the run (an infinite scale for a row that was all zeros: nothing passes)."""

    weight: torch.Tensor
    scale: torch.Tensor

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., d_model), its leading axes those of ``scale`` -> weight * x / scale, float32."""
        return self.weight * x.float() / self.scale


def norm_weight(norm) -> torch.Tensor:
    """An RMSNorm's weight (d_model,) float32 as it multiplies: Gemma's ``1 + weight`` (folded into
    ``weight`` on our model; a bridge's Gemma norm stores ``weight - 1``)."""
    weight = norm.weight.detach().float()
    return 1.0 + weight if getattr(norm, "uses_weight_offset", False) else weight


def frozen_norm(norm, pre_norm: torch.Tensor, normed: torch.Tensor) -> FrozenNorm:
    """An RMSNorm ``norm`` with its scale frozen from the run in which ``pre_norm`` (..., d_model)
    went in and ``normed`` came out: the scale per row by least squares (as the final norm's is for
    direct logit attribution), so neither eps nor how the backend stores the weight is assumed."""
    weight = norm_weight(norm)
    written = weight * pre_norm.float()
    squares = (written * written).sum(-1, keepdim=True)
    scale = torch.where(squares > 0, squares / (written * normed.float()).sum(-1, keepdim=True), torch.inf)
    return FrozenNorm(weight.to(scale.device), scale)


def frozen_output_norm(model, layer: int, run: dict, rows=slice(None), at=slice(None)) -> FrozenNorm | None:
    """Block ``layer``'s norm on its attention output frozen at a run (``run``: hook name -> activation
    (batch, pos, d_model), holding ``output_norm_reads``), at the prompts ``rows`` and positions ``at``:
    a head's contribution to the residual there is this map of its ``z @ W_O`` (and ``b_O``'s of it).
    None where the block has no such norm (the contribution is ``z @ W_O`` itself)."""
    norm = output_norm(model, layer)
    if norm is None:
        return None
    pre, out = (run[f"blocks.{layer}.{suffix}"][rows][:, at] for suffix in (PRE_NORM_OUT, "hook_attn_out"))
    return frozen_norm(norm, pre, out)


def logit_soft_cap(model) -> float | None:
    """The cap of the model's final logits (``logits -> cap * tanh(logits / cap)``: Gemma 2's, on our
    model and the bridge alike), None where it has none (the bridge writes -1 for none)."""
    cap = getattr(model.cfg, "output_logits_soft_cap", None)
    return float(cap) if cap is not None and cap > 0 else None


def norms_inside_heads(model) -> bool:
    """Whether a norm acts inside the attention, between the weights and what the residual receives:
    on each query and key head (``attn.q_norm``/``k_norm``: Gemma 3) or on the attention output
    (``output_norm``)."""
    return any(getattr(block.attn, "q_norm", None) is not None or getattr(block.attn, "k_norm", None) is not None
               or output_norm(model, layer) is not None for layer, block in enumerate(model.blocks))


def relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    """max |value - reference| (same shape) in float32, over ``reference``'s size: its largest
    |entry|, at least 1 (an activation smaller than that is held to the error itself)."""
    error = (value.float() - reference.float()).abs().max()
    return float(error / reference.float().abs().max().clamp(min=1.0))


@torch.no_grad()
def head_sum_error(model, cache: dict) -> tuple[float | None, float, float | None]:
    """(max over layers of |sum_h z_h @ W_O[h] + b_O - the attention's output|, summed in float32,
    relative to that output's size (``relative_error``), or None where ``W_O`` is not reachable as
    ``blocks.{l}.attn.W_O`` (head, d_head, d_model); the relative error allowed: ``SUM_TOLERANCE``,
    or in a dtype narrower than float32 (or under mixed precision, ``interp.precision.rounded_dtype``:
    bfloat16) 8 of its epsilons, the rounding of the output itself; the norm error). The attention's
    output is ``hook_attn_out``, or in a block that norms it (``output_norm``) ``attn.hook_out``,
    before the norm; there the norm error is max |weight * sum / scale - hook_attn_out|, relative
    to hook_attn_out's size, with the norm's scale (batch, pos, 1) from the clean run
    (``frozen_norm_error``), else None."""
    errors, norm_errors, tolerance = [], [], SUM_TOLERANCE
    for layer in range(model.cfg.n_layers):
        try:
            w_o, b_o = model.blocks[layer].attn.W_O, model.blocks[layer].attn.b_O
        except (AttributeError, TypeError, RuntimeError):
            return None, tolerance, None
        norm = output_norm(model, layer)
        z, out = cache.get(f"blocks.{layer}.attn.hook_z"), cache.get(f"blocks.{layer}.hook_attn_out")
        pre_norm = out if norm is None else cache.get(f"blocks.{layer}.{PRE_NORM_OUT}")
        if w_o is None or z is None or pre_norm is None or tuple(w_o.shape[:2]) != tuple(z.shape[2:]):
            return None, tolerance, None
        total = einsum(z.float(), w_o.float(), "b p h d, h d m -> b p m") + (0 if b_o is None else b_o.float())
        errors.append(relative_error(total, pre_norm))
        if norm is not None:
            norm_errors.append(frozen_norm_error(norm, total, pre_norm.float(), out.float()))
        rounded = rounded_dtype(model, out.dtype)  # mixed precision: float32 outputs of bfloat16 products
        tolerance = max(tolerance, 8 * torch.finfo(rounded).eps)
    return max(errors), tolerance, max(norm_errors) if norm_errors else None


def frozen_norm_error(norm, total: torch.Tensor, pre_norm: torch.Tensor, normed: torch.Tensor) -> float:
    """max |weight * total / scale - normed|, relative to ``normed``'s size (``relative_error``), for
    an RMSNorm ``norm`` with its scale frozen from the clean run (``frozen_norm``): ``pre_norm``
    (batch, pos, d_model) went in and ``normed`` came out. ``total``: the heads' sum plus b_O."""
    return relative_error(frozen_norm(norm, pre_norm, normed)(total), normed)


@torch.no_grad()
def layer_outputs(model, tokens: torch.Tensor, logits: torch.Tensor,
                  cache: dict) -> dict[str, tuple[str, torch.Tensor]] | None:
    """Where edits of ``hook_attn_out`` reach the logits (its value is then what the later layers
    read): ``blocks.{l}.attn.{hook}`` -> (``blocks.{l}.hook_attn_out``, its cached activation) for
    every hook of ``EDITABLE``, for ``probe_effect`` to observe; None (observe the logits) where
    they do not, or where the layer outputs were not cached."""
    outputs = layers_last_first(model, "hook_attn_out")
    if not all(name in cache for name in outputs) or probe_effect(model, tokens, logits, outputs) <= EDIT_TOLERANCE:
        return None
    return {f"blocks.{layer}.attn.{hook}": (f"blocks.{layer}.hook_attn_out", cache[f"blocks.{layer}.hook_attn_out"])
            for layer in range(model.cfg.n_layers) for hook in EDITABLE}


@torch.no_grad()
def check_hooks(model) -> HookCheck:
    """Run the self-test on ``model`` (once per model object; later calls return the result)."""
    if model in _checked:
        return _checked[model]
    tokens = probe_tokens(model)
    shapes, logits, cache = measure_shapes(model, tokens)
    observed = layer_outputs(model, tokens, logits, cache)
    effects = {hook: probe_effect(model, tokens, logits, layers_last_first(model, f"attn.{hook}"), observed)
               for hook in EDITABLE}
    sum_error, sum_tolerance, norm_error = head_sum_error(model, cache)
    result = HookCheck(model_family(model), model_impl(model), shapes,
                       {hook: effect > EDIT_TOLERANCE for hook, effect in effects.items()}, effects,
                       sum_error, sum_tolerance=sum_tolerance, output_normed=output_norm(model, 0) is not None,
                       norm_error=norm_error)
    _checked[model] = result
    return result


def require_edit(model, hook: str, needed_by: str) -> None:
    """Refuse ``needed_by`` in one line when an edit of ``hook`` does not reach ``model``'s output."""
    if hook not in EDITABLE:
        raise ValueError(f"require_edit: unknown hook {hook!r}; allowed: {', '.join(EDITABLE)}")
    require(model, hook, needed_by)


def require(model, need: str, needed_by: str) -> None:
    """Refuse ``needed_by`` in one line (``HookCheck.refusal``) where ``model`` lacks ``need``."""
    reason = check_hooks(model).refusal(need, needed_by)
    if reason is not None:
        raise UserError(reason)


def left_out(model, parts: dict[str, Sequence[str]]) -> dict[str, str]:
    """A command's plan, made before any sweep: of ``parts`` (a part's name -> the ``NEEDS`` its
    steps ``require``), each part ``model`` cannot run -> the refusal of its first unmet need, the
    part's name as what needs it; the parts it can run are absent."""
    check = check_hooks(model)
    reasons = {name: next(filter(None, (check.refusal(need, name) for need in needs)), None)
               for name, needs in parts.items()}
    return {name: reason for name, reason in reasons.items() if reason is not None}


def describe(model) -> dict:
    """The self-test's verdicts as JSON-able data, with the model's provenance, for ``meta.json``."""
    check = check_hooks(model)
    return {**provenance(model), "hooks_as_documented": check.shapes_ok, "edits_reach_output": check.reaches_output,
            "heads_sum_to_attn_out": check.sums_ok, "attn_out_normed": check.output_normed}
