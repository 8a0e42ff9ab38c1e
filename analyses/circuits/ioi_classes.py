"""IOI head classes as a task analysis (Wang et al. 2022): each class's criteria measured for every
head, each a mean over prompts with its 95% interval, and a class only where they hold with it.

Positions (``ioi_positions``), per clean prompt, from its tokens: IO, the one position holding the
answer id (the indirect object's name); S1 < S2, the two holding the distractor id (the subject's
name); END, the last real token. A prompt where IO is not exactly once or S not exactly twice before
END (a byte tokenizer's letter names also occur as capitals of the template's words) is left out
and counted (``IOIClasses.left_out``).

The criteria (``CRITERIA``; one row per head and criterion, ``value`` the mean over prompts, with
``ci_low``, ``ci_high`` from ``analyses.core.stats.bootstrap_ratio`` and ``n_prompts``):

- ``attn_end_io``, ``attn_end_s1``, ``attn_end_s2`` (attention): the clean run's attention from END
  to IO, S1, S2; ``attn_io_minus_s``: END->IO minus END->S1 minus END->S2;
- ``ov_copy`` (weights): the residual after block 0 at IO's position of the clean run (the name's
  token embedding after the first MLP, block 0's attention included, as Wang et al. take it) through
  the head's OV circuit as the model computes it (its layer's ``ln1``, ``W_V`` and ``b_V``, ``W_O``),
  then the final norm (its bias left out: it is the same for every head) and the unembedding: the
  IO name's logit minus the mean logit of the task's other names (every answer and distractor id of
  the task). Positive: the head copies the name; negative: it suppresses it;
- ``dla`` (DLA): the head's direct logit attribution onto logit(IO) - logit(S) at END
  (``prompt_dla``: ``analyses.components.decompose.direct_logit_attribution``, the final norm frozen);
- ``s_inhibition`` (intervention): path patching from the head into the movers' queries only
  (noising: the head's ABC-run output minus its clean output added to the movers' query input, keys
  and values clean, ``analyses.circuits.path_patching.receiver_activations``): the change of the
  movers' attention END->IO minus END->S1 minus END->S2, averaged over the movers after the head's
  layer. The movers are the name movers that formed, or, where none did, the ``N_WRITERS`` heads of
  largest DLA whose DLA holds (``IOIClasses.movers_are`` says which);
- ``v_path`` (intervention): path patching (noising) from the head into every S-inhibition head's
  value input at once (every position: an S-inhibition head reads S2 from END), each receiver's
  output then replaced by the one it computes from that value, the rest of the run recomputed: the
  change of the logit difference; ``attn_s2_s1`` and ``attn_s2_s1_next`` (attention): the clean
  run's attention from S2 to S1 (a duplicate-token head) and to the token after S1 (an induction
  head);
- ``backup_rise`` (intervention): the head's DLA with the movers mean-ablated (``mean_corrupted``:
  the ABC prompts' means at matched template positions) minus its DLA unablated, both in their own
  run (the final norm at that run's scale); NaN for the movers themselves.

The classes (``CLASS_RULES``): a head gets a class when every criterion of the class holds with its
interval (the bound on the class's side beyond the threshold); a head with none is
``"unclassified"``. ``classify_ioi`` applies the rules to any criteria frame.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np
import pandas as pd
import torch
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from analyses.circuits.edges import edges_of
from analyses.circuits.path_patching import prepare_paths, receiver_activations, receiver_z
from analyses.components.decompose import component_hooks, direct_logit_attribution
from analyses.core.execution import executing
from analyses.core.hook_names import pattern_name, z_name
from analyses.core.plots import new_figure
from analyses.core.stats import N_BOOT, bootstrap_ratio
from analyses.core.tokens import as_batch
from analyses.interventions.ablation import replacements
from analyses.core.checks import check_heads
from analyses.interventions.engine import cache_run, collect_variants, head_cells, score_variants
from analyses.tasks.task import Task, TaskBatch, task_ablation, task_batch, task_metric
from interp.errors import UserError
from interp.weights import expand_kv_heads

Head = tuple[int, int]

# A tenth of the head's attention from one position on one token: uniform attention over an IOI prompt
# of 15-25 tokens gives each token 0.04-0.07, and Wang et al.'s name movers put most of END's on IO.
ATTENTION_MIN = 0.1
# nats of logit difference a head must write directly (a name mover) or against the answer (a negative
# one): below a tenth of a nat a head moves the probability of IO over S by under 10%.
DLA_MIN = 0.1
# a shift of the movers' attention (IO minus S) by 0.02 of its mass: smaller moves change no mover's
# choice between the names.
SHIFT_MIN = 0.02
# nats of logit difference a path into the S-inhibition heads' values must carry (as DLA_MIN, halved:
# a path's effect is one of several that add up).
PATH_MIN = 0.05
# nats a head's DLA must rise when the movers are ablated: as DLA_MIN.
RISE_MIN = 0.1
N_WRITERS = 3  # the movers where no name mover formed: the heads of largest DLA that holds

# criterion -> its evidence
CRITERIA = {
    "attn_end_io": "attention", "attn_end_s1": "attention", "attn_end_s2": "attention",
    "attn_io_minus_s": "attention", "ov_copy": "weights", "dla": "dla", "s_inhibition": "intervention",
    "v_path": "intervention", "attn_s2_s1": "attention", "attn_s2_s1_next": "attention",
    "backup_rise": "intervention",
}
ABOVE, BELOW = ">", "<"
# class -> [(criterion, side, threshold)]: the criterion holds when its interval's bound on that side
# lies beyond the threshold (ci_low > threshold for ">", ci_high < threshold for "<").
CLASS_RULES = {
    "name mover": [("attn_end_io", ABOVE, ATTENTION_MIN), ("attn_io_minus_s", ABOVE, 0.0), ("ov_copy", ABOVE, 0.0),
                   ("dla", ABOVE, DLA_MIN)],
    "negative name mover": [("attn_end_io", ABOVE, ATTENTION_MIN), ("attn_io_minus_s", ABOVE, 0.0),
                            ("ov_copy", BELOW, 0.0), ("dla", BELOW, -DLA_MIN)],
    "s-inhibition": [("s_inhibition", BELOW, -SHIFT_MIN)],
    "duplicate-token": [("v_path", BELOW, -PATH_MIN), ("attn_s2_s1", ABOVE, ATTENTION_MIN)],
    "induction": [("v_path", BELOW, -PATH_MIN), ("attn_s2_s1_next", ABOVE, ATTENTION_MIN)],
    "backup name mover": [("backup_rise", ABOVE, RISE_MIN)],
}
UNCLASSIFIED = "unclassified"
CRITERIA_COLUMNS = ["layer", "head", "criterion", "value", "ci_low", "ci_high", "n_prompts", "evidence"]


@dataclass(frozen=True)
class IOIPositions:
    """Per prompt of a task: ``io``, ``s1``, ``s2``, ``end`` (batch,) long positions in its clean
    tokens (-1 where left out) and ``kept`` (batch,) bool, whether IO is there once and S twice."""

    io: torch.Tensor
    s1: torch.Tensor
    s2: torch.Tensor
    end: torch.Tensor
    kept: torch.Tensor

    def take(self, kept: torch.Tensor) -> "IOIPositions":
        return IOIPositions(self.io[kept], self.s1[kept], self.s2[kept], self.end[kept], self.kept[kept])

    def order(self) -> np.ndarray:
        """(batch,) each prompt's name order: "ABBA" where the indirect object is named first (IO
        before S1), "BABA" where the subject is; "" where the prompt is left out."""
        return np.where(~self.kept.cpu().numpy(), "", np.where((self.io < self.s1).cpu().numpy(), "ABBA", "BABA"))


def ioi_positions(task: Task, batch: TaskBatch) -> IOIPositions:
    """IO, S1, S2 and END of each clean prompt of ``batch`` (the tokens of ``task``), found from its
    tokens: the answer id once, the distractor id twice (S1 < S2), both before END (its last real
    token); a prompt where they are not is marked not ``kept``. A task whose answers or distractors
    are not one id per prompt is refused."""
    if any(len(ids) != 1 for ids in (*task.answers, *task.distractors)):
        raise UserError(f"task {task.name!r}: IOI classes need one answer id (IO) and one distractor id (S) per prompt")
    rows = []
    for tokens, end, (io,), (s,) in zip(batch.clean.cpu(), batch.last.tolist(), task.answers, task.distractors):
        seen = tokens[:end]
        io_at, s_at = (seen == io).nonzero()[:, 0].tolist(), (seen == s).nonzero()[:, 0].tolist()
        kept = io != s and len(io_at) == 1 and len(s_at) == 2
        rows.append((io_at[0], *s_at, end, True) if kept else (-1, -1, -1, end, False))
    io, s1, s2, end, kept = zip(*rows)
    return IOIPositions(*(torch.tensor(column) for column in (io, s1, s2, end)), torch.tensor(kept))


def _attention(pattern: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """pattern (..., batch, head, q, k) -> (..., batch, head) float32: prompt b's attention from
    ``query[b]`` to ``key[b]`` ((batch,) positions)."""
    rows = torch.arange(pattern.shape[-4])
    moved = pattern.movedim(-4, 0)  # (batch, ..., head, q, k)
    return moved[rows, ..., query.to(pattern.device), key.to(pattern.device)].movedim(0, -2).float()


def io_preference(pattern: torch.Tensor, at: IOIPositions) -> torch.Tensor:
    """pattern (..., batch, head, q, k) -> (..., batch, head): attention END->IO minus END->S1 minus END->S2."""
    return (_attention(pattern, at.end, at.io) - _attention(pattern, at.end, at.s1)
            - _attention(pattern, at.end, at.s2))


def attention_criteria(model, cache, at: IOIPositions) -> dict[str, torch.Tensor]:
    """The attention criteria -> {criterion: (batch, layer, head)}, from the clean run's patterns."""
    pattern = torch.stack([cache[pattern_name(layer)] for layer in range(model.cfg.n_layers)])  # (layer, batch, ...)
    reads = {"attn_end_io": (at.end, at.io), "attn_end_s1": (at.end, at.s1), "attn_end_s2": (at.end, at.s2),
             "attn_s2_s1": (at.s2, at.s1), "attn_s2_s1_next": (at.s2, at.s1 + 1)}
    values = {name: _attention(pattern, query, key) for name, (query, key) in reads.items()}
    values["attn_io_minus_s"] = io_preference(pattern, at)
    return {name: value.transpose(0, 1).cpu() for name, value in values.items()}


def value_bias(model) -> torch.Tensor:
    """The stacked value bias (n_layers, n_kv_heads, d_head); zeros where the model has none (a
    bridge over a bias-free checkpoint exposes no ``b_V``)."""
    try:
        return model.b_V.detach()
    except AttributeError:
        return model.W_V.new_zeros(model.W_V.shape[0], model.W_V.shape[1], model.W_V.shape[3])


@torch.no_grad()
def ov_copy_scores(model, resid: torch.Tensor, io: torch.Tensor, names: torch.Tensor) -> torch.Tensor:
    """The OV copying score of every head (module docstring) -> (batch, layer, head) float32.

    resid (batch, d_model): each prompt's residual after block 0 at its IO position; io (batch,) the
    IO ids; names (k,) the task's name ids (IO's among them): IO's logit minus the mean of the others'."""
    n_heads = model.cfg.n_heads
    W_V, b_V = expand_kv_heads(model.W_V.detach(), n_heads), expand_kv_heads(value_bias(model), n_heads)
    W_O, W_U = model.W_O.detach(), model.W_U.detach()[:, names.to(model.W_U.device)]
    bias = model.ln_final(resid.new_zeros(1, resid.shape[-1]))
    own = (names.to(io.device)[None] == io[:, None]).float()  # (batch, k)
    scores = []
    for layer in range(model.cfg.n_layers):
        normed = model.blocks[layer].ln1(resid[:, None])[:, 0]  # (batch, d_model)
        value = torch.einsum("bm,hmd->bhd", normed.to(W_V.dtype), W_V[layer]) + b_V[layer]
        out = torch.einsum("bhd,hdm->bhm", value, W_O[layer])  # (batch, head, d_model)
        logits = ((model.ln_final(out) - bias) @ W_U.to(out.dtype)).float()  # (batch, head, k)
        io_logit = (logits * own[:, None].to(logits.device)).sum(-1)
        others = (logits.sum(-1) - io_logit) / (len(names) - 1)
        scores.append(io_logit - others)
    return torch.stack(scores, dim=1)


def prompt_dla(model, cache, task: Task, last: torch.Tensor) -> torch.Tensor:
    """Each head's direct logit attribution onto logit(IO) - logit(S) at each prompt's ``last``
    position (``direct_logit_attribution`` of ``cache``) -> (batch, layer, head) float32."""
    positions = sorted(set(last.tolist()))
    io = torch.tensor([ids[0] for ids in task.answers])[:, None].expand(-1, len(positions))
    s = torch.tensor([ids[0] for ids in task.distractors])[:, None].expand(-1, len(positions))
    frame = direct_logit_attribution(model, cache, io, s, positions=positions)
    own = frame["head"].notna() & (frame["position"].to_numpy() == last.cpu().numpy()[frame["prompt"].to_numpy()])
    heads = frame[own]
    out = torch.full((len(last), model.cfg.n_layers, model.cfg.n_heads), float("nan"))
    where = [torch.tensor(heads[column].to_numpy(int, copy=True)) for column in ("prompt", "layer", "head")]
    out[tuple(where)] = torch.tensor(heads["dla"].to_numpy(copy=True), dtype=torch.float32)
    return out


def _later(heads: Sequence[Head], layer: int) -> list[Head]:
    return [head for head in heads if head[0] > layer]


def _senders(model, receivers: Sequence[Head]) -> list[Head]:
    """Every head of a layer before the last receiver's."""
    return [(layer, head) for layer in range(max(l for l, _ in receivers)) for head in range(model.cfg.n_heads)]


def s_inhibition_shift(model, batch: TaskBatch, at: IOIPositions, metric, movers: Sequence[Head],
                       clean_cache) -> torch.Tensor:
    """The ``s_inhibition`` criterion (module docstring) of every head -> (batch, layer, head) float32,
    NaN for a head with no mover after its layer. ``clean_cache``: the clean run's ``hook_pattern``s
    of the movers' layers."""
    senders = _senders(model, movers)
    setup = prepare_paths(model, batch.clean, batch.corrupted, metric, edges_of(model, senders, movers, "q"), "noise")
    total = torch.zeros(len(batch.clean), model.cfg.n_layers, model.cfg.n_heads)
    count = torch.zeros(model.cfg.n_layers, model.cfg.n_heads)
    for layer in sorted({l for l, _ in movers}):
        heads = [h for l, h in movers if l == layer]
        sending = [s for s in senders if s[0] < layer]
        patterns = receiver_activations(model, setup, layer, [(s, "q") for s in sending],
                                        pattern_name(layer))  # (senders, batch, head, q, k)
        clean = io_preference(clean_cache[pattern_name(layer)], at)[:, heads]  # (batch, movers)
        moved = (io_preference(patterns, at)[..., heads] - clean).sum(-1).cpu()  # (senders, batch)
        for (l, h), change in zip(sending, moved):
            total[:, l, h] += change
            count[l, h] += len(heads)
    return total / count  # 0 / 0: NaN where no mover comes later


def value_path_effects(model, batch: TaskBatch, metric, receivers: Sequence[Head]) -> torch.Tensor:
    """The ``v_path`` criterion (module docstring) of every head into ``receivers`` together ->
    (batch, layer, head) float32 per-prompt changes of the metric, NaN for a head with no receiver
    after its layer."""
    senders = _senders(model, receivers)
    setup = prepare_paths(model, batch.clean, batch.corrupted, metric, edges_of(model, senders, receivers, "v"),
                          "noise")
    edits = {sender: [] for sender in senders}
    for layer in sorted({l for l, _ in receivers}):
        sending = [s for s in senders if s[0] < layer]
        z = receiver_z(model, setup, layer, [(s, "v") for s in sending])
        for sender in sending:
            edits[sender] += [(z_name(layer), (slice(None), h), z[sender, "v"][:, :, h])
                              for l, h in receivers if l == layer]
    with executing(progress=False):
        scored = score_variants(model, setup.tokens, list(edits.values()), {}, metric, starts=setup.starts)
    changes = (scored.numerators - setup.baseline_scores().numerators).cpu()  # (senders, batch)
    out = torch.full((len(batch.clean), model.cfg.n_layers, model.cfg.n_heads), float("nan"))
    for (l, h), change in zip(edits, changes):
        out[:, l, h] = change.float()
    return out


def backup_rise(model, task: Task, batch: TaskBatch, movers: Sequence[Head], clean_cache) -> torch.Tensor:
    """The ``backup_rise`` criterion (module docstring) -> (batch, layer, head) float32, NaN for the
    movers. ``clean_cache``: the clean run's ``component_hooks`` (those the model fires)."""
    reference, _ = task_ablation(task, batch, "mean_corrupted")
    names = sorted({z_name(layer) for layer, _ in movers})
    sources = replacements(model, as_batch(model, batch.clean), "mean_corrupted", names, reference)
    fired = [name for name in component_hooks(model) if name in clean_cache]
    ablated = collect_variants(model, batch.clean, [head_cells(movers)], sources, fired)
    rise = (prompt_dla(model, {name: value[0] for name, value in ablated.items()}, task, batch.last)
            - prompt_dla(model, clean_cache, task, batch.last))
    for layer, head in movers:
        rise[:, layer, head] = float("nan")
    return rise


def criteria_frame(values: dict[str, torch.Tensor], *, n_boot: int = N_BOOT, seed: int = 0) -> pd.DataFrame:
    """{criterion: per-prompt values (batch, layer, head)} -> the tidy ``CRITERIA_COLUMNS`` rows: each
    criterion's mean over prompts with its percentile bootstrap interval (NaN where not measured)."""
    frames = []
    for criterion, per_prompt in values.items():
        batch, n_layers, n_heads = per_prompt.shape
        estimate, low, high = bootstrap_ratio(per_prompt.reshape(batch, -1).cpu().double(), torch.ones(batch),
                                              n_boot=n_boot, seed=seed)
        layer, head = np.divmod(np.arange(n_layers * n_heads), n_heads)
        frames.append(pd.DataFrame({"layer": layer, "head": head, "criterion": criterion, "value": estimate.cpu().numpy(),
                                    "ci_low": low.cpu().numpy(), "ci_high": high.cpu().numpy(), "n_prompts": batch,
                                    "evidence": CRITERIA[criterion]}))
    return pd.concat(frames, ignore_index=True)[CRITERIA_COLUMNS]


def holds(row, side: str, threshold: float) -> bool:
    """Whether a criterion row's interval lies beyond ``threshold`` on ``side`` (NaN: it does not)."""
    return bool(row["ci_low"] > threshold) if side == ABOVE else bool(row["ci_high"] < threshold)


def classify_ioi(criteria: pd.DataFrame) -> pd.DataFrame:
    """A criteria frame (``CRITERIA_COLUMNS``) -> one row per (head, class) it holds, ``layer, head,
    class, evidence`` (the evidence of the criteria that held: "attention: attn_end_io, ...; weights:
    ov_copy"), in ``CLASS_RULES`` order; a head holding none has one row of class ``"unclassified"``
    and evidence "". A criterion a frame lacks does not hold."""
    indexed = criteria.set_index(["layer", "head", "criterion"])
    rows = []
    for layer, head in criteria[["layer", "head"]].drop_duplicates().itertuples(index=False):
        held = []
        for name, rule in CLASS_RULES.items():
            if all((layer, head, criterion) in indexed.index and holds(indexed.loc[(layer, head, criterion)], side, bound)
                   for criterion, side, bound in rule):
                held.append((name, _evidence([criterion for criterion, _, _ in rule])))
        rows += [(layer, head, name, evidence) for name, evidence in held] or [(layer, head, UNCLASSIFIED, "")]
    return pd.DataFrame(rows, columns=["layer", "head", "class", "evidence"])


def _evidence(criteria: Sequence[str]) -> str:
    kinds = dict.fromkeys(CRITERIA[c] for c in criteria)
    return "; ".join(f"{kind}: {', '.join(c for c in criteria if CRITERIA[c] == kind)}" for kind in kinds)


def heads_of(classes: pd.DataFrame, name: str) -> list[Head]:
    """The (layer, head) of every head of class ``name`` in a ``classify_ioi`` frame."""
    chosen = classes[classes["class"] == name]
    return [(int(l), int(h)) for l, h in zip(chosen["layer"], chosen["head"])]


@dataclass
class IOIClasses:
    """``ioi_classes``' result: ``criteria`` (``CRITERIA_COLUMNS``, one row per head and criterion),
    ``classes`` (``classify_ioi``), ``movers`` (the heads S-inhibition and backup are measured
    against) and ``movers_are`` (what they are), ``s_inhibition`` (the receivers of ``v_path``),
    ``left_out`` (prompts whose names' positions were ambiguous), ``notes`` (criteria not measured,
    and why), ``per_prompt`` ({criterion: (prompt, layer, head) float32}, the values the criteria
    average, over the prompts kept) and ``order`` ((prompt,) "ABBA" or "BABA", ``IOIPositions.order``)."""

    criteria: pd.DataFrame
    classes: pd.DataFrame
    movers: list[Head]
    movers_are: str
    s_inhibition: list[Head]
    left_out: int
    notes: list[str]
    per_prompt: dict[str, torch.Tensor]
    order: np.ndarray

    def on(self, rows, *, n_boot: int = N_BOOT, seed: int = 0) -> "IOIClasses":
        """The criteria and classes over the kept prompts ``rows`` alone (indices, or a (prompt,) bool
        mask such as ``order == "ABBA"``), each mean with its interval over those prompts. The movers
        and S-inhibition receivers stay the whole run's, and so do the ABC means ``backup_rise``
        ablates with and the names ``ov_copy`` compares IO's with (a run on those prompts alone would
        take both from them)."""
        rows = np.asarray(rows)
        index = np.flatnonzero(rows) if rows.dtype == bool else rows.astype(int)
        if rows.dtype == bool and len(rows) != len(self.order):
            raise UserError(f"rows: a mask of {len(rows)} for {len(self.order)} prompts; give one per kept prompt")
        if not len(index) or index.min() < 0 or index.max() >= len(self.order):
            raise UserError(f"rows: {len(index)} prompt(s) in [0, {len(self.order)}) needed, got {index.tolist()[:5]}")
        values = {name: value[torch.as_tensor(index)] for name, value in self.per_prompt.items()}
        criteria = criteria_frame(values, n_boot=n_boot, seed=seed).sort_values(["layer", "head"], kind="stable",
                                                                                ignore_index=True)
        return replace(self, criteria=criteria, classes=classify_ioi(criteria), per_prompt=values,
                       order=self.order[index])


def clean_reads(model) -> list[str]:
    """What the clean run is read for: every ``hook_pattern``, block 0's output and the components DLA reads."""
    return [*(pattern_name(layer) for layer in range(model.cfg.n_layers)), "blocks.0.hook_resid_post",
            *component_hooks(model)]


def ioi_classes(model, task: Task, *, movers: Sequence[Head] | None = None,
                s_inhibition: Sequence[Head] | None = None, n_boot: int = N_BOOT, seed: int = 0,
                memory_mb: float | None = None) -> IOIClasses:
    """Every head's IOI criteria and classes on ``task`` (an IOI task: one answer, the indirect
    object, and one distractor, the subject, per prompt; see the module docstring), an ``IOIClasses``
    value.

    ``movers``: the heads whose attention S-inhibition moves and whose ablation backup heads answer
    (default: the name movers that formed, else the ``N_WRITERS`` heads of largest DLA that holds);
    ``s_inhibition``: the receivers of ``v_path`` (default: the S-inhibition heads that formed).
    ``n_boot`` / ``seed``: the bootstrap over prompts; ``memory_mb``: the interventions' budget (None:
    the current execution's, ``analyses.core.execution``)."""
    batch = task_batch(model, task)
    at = ioi_positions(task, batch)
    kept = at.kept
    if not kept.any():
        raise UserError(f"task {task.name!r}: no prompt has its IO name once and its S name twice in its tokens")
    if not kept.all():
        task = task.subset(kept.nonzero()[:, 0].tolist())
        batch, at = task_batch(model, task), at.take(kept)
    metric = task_metric(task, batch.last)
    _, cache = cache_run(model, batch.clean, clean_reads(model), logits=False)
    values = attention_criteria(model, cache, at)
    rows = torch.arange(len(at.io))
    names = torch.tensor(sorted({ids[0] for ids in (*task.answers, *task.distractors)}))
    io = torch.tensor([ids[0] for ids in task.answers])
    values["ov_copy"] = ov_copy_scores(model, cache["blocks.0.hook_resid_post"][rows, at.io.to(rows.device)], io, names)
    values["dla"] = prompt_dla(model, cache, task, batch.last)
    frames = [criteria_frame(values, n_boot=n_boot, seed=seed)]
    first = classify_ioi(frames[0])
    notes = []
    movers, movers_are = _movers(model, first, frames[0][frames[0]["criterion"] == "dla"], movers)
    later = {}
    with executing(memory_mb):  # the interventions' budget
        if movers:
            later["backup_rise"] = backup_rise(model, task, batch, movers, cache)
        else:
            notes.append("backup_rise not measured: no mover formed")
        if movers and max(l for l, _ in movers) > 0:
            later["s_inhibition"] = s_inhibition_shift(model, batch, at, metric, movers, cache)
        else:
            notes.append("s_inhibition not measured: no mover after layer 0")
        if s_inhibition is None and "s_inhibition" in later:
            shift = criteria_frame({"s_inhibition": later["s_inhibition"]}, n_boot=n_boot, seed=seed)
            s_inhibition = heads_of(classify_ioi(shift), "s-inhibition")
        s_inhibition = check_heads(model, s_inhibition or [])
        if s_inhibition and max(l for l, _ in s_inhibition) > 0:
            later["v_path"] = value_path_effects(model, batch, metric, s_inhibition)
        else:
            notes.append("v_path not measured: no S-inhibition head after layer 0")
    if later:
        frames.append(criteria_frame(later, n_boot=n_boot, seed=seed))
    criteria = pd.concat(frames, ignore_index=True).sort_values(["layer", "head"], kind="stable", ignore_index=True)
    return IOIClasses(criteria, classify_ioi(criteria), movers, movers_are, s_inhibition, int((~kept).sum()), notes,
                      {**values, **later}, at.order())


def _movers(model, first: pd.DataFrame, dla: pd.DataFrame, given: Sequence[Head] | None) -> tuple[list[Head], str]:
    """The movers (``ioi_classes``) and what they are."""
    if given is not None:
        return check_heads(model, given), "given"
    formed = heads_of(first, "name mover")
    if formed:
        return formed, "name movers"
    writers = dla[dla["ci_low"] > DLA_MIN].nlargest(N_WRITERS, "value")
    return ([(int(l), int(h)) for l, h in zip(writers["layer"], writers["head"])],
            f"the {N_WRITERS} heads of largest DLA above {DLA_MIN} (no name mover formed)")


CLASS_COLOURS = {UNCLASSIFIED: "#eeeeee", "name mover": "#1b9e77", "negative name mover": "#d95f02",
                 "s-inhibition": "#7570b3", "duplicate-token": "#e7298a", "induction": "#66a61e",
                 "backup name mover": "#e6ab02"}


def ioi_classes_figure(classes: pd.DataFrame) -> Figure:
    """A layer x head grid of a ``classify_ioi`` frame, each cell coloured by the head's first class
    (``CLASS_RULES`` order; a head of several is marked "+"), with a legend of the classes present."""
    order = list(CLASS_COLOURS)
    first = classes.assign(rank=classes["class"].map(order.index)).sort_values("rank", kind="stable")
    per_head = first.groupby(["layer", "head"], sort=False)
    n_layers, n_heads = int(classes["layer"].max()) + 1, int(classes["head"].max()) + 1
    grid = np.zeros((n_layers, n_heads))
    figure = new_figure(figsize=(max(4.0, 0.45 * n_heads + 2.5), max(3.0, 0.3 * n_layers + 1.0)))
    ax = figure.subplots()
    for (layer, head), rows in per_head:
        grid[layer, head] = rows["rank"].iloc[0]
        if len(rows) > 1:
            ax.text(head, layer, "+", ha="center", va="center", fontsize=8)
    ax.imshow(grid, cmap=ListedColormap(list(CLASS_COLOURS.values())), vmin=-0.5, vmax=len(order) - 0.5,
              aspect="auto", interpolation="nearest")
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_title("IOI head classes (a class only where its criteria hold with their 95% intervals)", fontsize=9)
    present = [name for name in order if name in set(classes["class"])]
    ax.legend(handles=[Patch(color=CLASS_COLOURS[name], label=name) for name in present], loc="upper left",
              bbox_to_anchor=(1.01, 1.0), fontsize=8)
    return figure
