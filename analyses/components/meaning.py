"""What heads move (architecture §4.8): copying and copy suppression from each head's OV circuit, QK
positional scores, and their calibrated roles.

A head's full OV circuit on the tokens (Elhage et al. 2021, "A Mathematical Framework for
Transformer Circuits") is the (vocab x vocab) matrix

    M_h = W_E W_V[h] W_O[h] W_U        row t: what attending to token t adds to every logit

(the stored token embedding and unembedding, norms ignored, as TransformerLens's ``W_E @ OV @ W_U``).
A copying head raises the logit of the token it attends to: M_h has mostly positive eigenvalues. Scores:

- ``copying``: sum(Re eig) / sum(|eig|) of M_h, in [-1, 1] (1: every eigenvalue positive);
  ``copy_suppression``: its negative (a head that lowers the logit of what it attends to). The
  nonzero eigenvalues of ``(W_E W_V)(W_O W_U)`` are those of ``(W_O W_U)(W_E W_V)``, a (d_head x
  d_head) matrix, so no vocab x vocab matrix is ever made (``W_U W_E`` is d_model x d_model;
  ``analyses.roles.copying.ov_eigenvalues``, with the roles' null: the role calibration reads it);
- ``copying_topk``: the share of tokens t whose own logit M_h[t, t] is among the k largest of row t;
  ``suppression_topk``: among the k smallest (rows are computed ``n_tokens`` at a time, a seeded
  sample of tokens where the vocabulary is larger than ``n_tokens``).

QK positional scores (learned position embeddings only): the attention a head would pay from the
position embeddings alone, ``softmax_k(W_pos[q] W_Q W_K^T W_pos[k]^T / sqrt(d_head))`` over k <= q,
averaged over queries q >= 1: its mass on q - 1 (``qk_previous``), on q (``qk_self``), on 0 (``qk_first``).

Roles: ``copying`` and ``copy_suppression`` against the random-initialisation null of the other
roles (``analyses.roles.nulls``: the same architecture at a few random initialisations, a per-layer
two-level null, Student's t), and a threshold on the score. ``meaning_roles`` alone controls the
false discovery rate over all heads x these two roles; the report puts them in ONE family with the
attention roles (``analyses.roles.nulls.joint_fdr`` over ``calibrate_roles`` and
``analyses.roles.copying.meaning_nulls``, read by ``analyses.roles.classify.assign_roles``), so its
head table names them beside induction. From behaviour: ``attended_token_effect`` is a head's direct
effect on the logit of the token it attends to most, from one clean cache.
"""

from __future__ import annotations

from typing import Sequence

import einops
import pandas as pd
import torch

from analyses.roles.classify import DEFAULT_THRESHOLD, MEANING_ROLES, check_fdr
from analyses.components.decompose import final_norm
from analyses.roles.dormant import head_outputs
from analyses.core.hook_names import final_resid_name, pattern_name, z_name
from analyses.roles.copying import copying_from_eigenvalues, embed_unembed, meaning_nulls, ov_eigenvalues
from analyses.roles.nulls import DEFAULT_NULL_SEEDS, add_fdr, head_frame
from analyses.core.budget import DEFAULT_MEMORY_MB
from analyses.core.execution import executing
from analyses.core.progress import progress_bar
from interp.errors import UserError
from interp.weights import expand_kv_heads

DEFAULT_TOP_K = 5
DEFAULT_N_TOKENS = 2048
# the rows of a chunk of tokens and their comparisons within this many MB stay near the CPU's cache: on
# SmolLM2 (49,152 tokens) 32-48 rows at a time count 3x faster than the 1,820 a 1 GB budget allowed
CACHED_ROWS_MB = 12
# vocabulary columns compared at a time: the first span settles whether most tokens' own entries are among
# the top or bottom k (two counts at k), so the rest of the vocabulary is read only for the unsettled tokens
SPAN_COLUMNS = 1024


def _token_sample(n_vocab: int, n_tokens: int, seed: int) -> torch.Tensor:
    if n_tokens <= 0:
        raise UserError(f"n_tokens={n_tokens} must be positive")
    if n_vocab <= n_tokens:
        return torch.arange(n_vocab)
    return torch.randperm(n_vocab, generator=torch.Generator().manual_seed(seed))[:n_tokens].sort().values


def ov_top_k(model, k: int = DEFAULT_TOP_K, *, n_tokens: int = DEFAULT_N_TOKENS, seed: int = 0,
             memory_mb: float = DEFAULT_MEMORY_MB) -> tuple[torch.Tensor, torch.Tensor]:
    """(copying_topk, suppression_topk), each (layer, head): the share of the sampled tokens whose own
    entry of their row of ``W_E W_V W_O W_U`` is among the row's ``k`` largest / ``k`` smallest.

    Each row is ``(W_E[t] W_V) (W_O W_U)``, the product of two d_head-wide factors (float32), so a head
    costs n_tokens x d_head x vocab, not x d_model. Within ``memory_mb``: half holds the left factors
    and a block of vocabulary columns of ``W_O W_U`` (d_head, columns) for a group of heads (a whole
    vocabulary per head where it fits, else a block at a time: Gemma 3's 262,144 tokens make one
    head's 256 MB), a quarter the float32 columns of ``W_U`` being multiplied, a quarter the rows of a
    chunk of tokens. A token's own entry is its left factor dotted with its own column of the readout,
    and each block counts the other columns above and below it, ``SPAN_COLUMNS`` at a time, until both
    counts reach ``k`` (``_count_beyond``): exactly the full count's shares, on SmolLM2 in a fifth of
    the time (20 s against 115 s on two threads), most tokens being settled by their first columns."""
    W_E, W_U = embed_unembed(model)
    d_model, n_vocab = W_U.shape
    if not 1 <= k <= n_vocab:
        raise UserError(f"k={k} must be in [1, {n_vocab}]")
    tokens = _token_sample(W_E.shape[0], n_tokens, seed).to(W_E.device)
    sampled = len(tokens)
    W_O = model.W_O.detach()  # (layer, head, d_head, d_model)
    n_layers, n_heads, d_head = W_O.shape[:3]
    W_V = expand_kv_heads(model.W_V.detach(), n_heads)
    embedded, own_columns = W_E[tokens].float(), W_U[:, tokens].float()  # (n_tokens, d_model), (d_model, n_tokens)
    half, quarter = memory_mb * 2**20 / 2, memory_mb * 2**20 / 4
    group = max(1, int(half // (4 * d_head * (n_vocab + sampled))))  # heads whose factors are held at once
    width = min(n_vocab, max(1, int(half // (4 * d_head * group)) - sampled))  # vocabulary columns of a block
    step = max(1, int(quarter // (4 * (d_model + group * d_head))))  # columns of W_U made float32 at once
    span = min(width, SPAN_COLUMNS)
    chunk = max(1, int(min(quarter, CACHED_ROWS_MB * 2**20) // (6 * span)))  # tokens whose rows (and comparisons) are held at once
    heads = [(layer, head) for layer in range(n_layers) for head in range(n_heads)]
    top, bottom = (torch.zeros(n_layers, n_heads, device=W_E.device) for _ in range(2))
    for first in progress_bar(range(0, len(heads), group), desc="OV circuits",
                              unit="head group"):
        members = heads[first:first + group]
        out = torch.stack([W_O[layer, head] for layer, head in members]).float()  # (group, d_head, d_model)
        left = torch.stack([embedded @ W_V[layer, head].float() for layer, head in members])  # (group, n_tokens, d_head)
        own = einops.einsum(left, out @ own_columns, "g t d, g d t -> g t")  # each token's own entry
        above, below = (torch.zeros(len(members), sampled, dtype=torch.long, device=W_E.device) for _ in range(2))
        for start in range(0, n_vocab, width):
            stop = min(start + width, n_vocab)
            readout = torch.empty(len(members), d_head, stop - start, device=W_E.device)  # (group, d_head, columns)
            for begin in range(start, stop, step):
                end = min(begin + step, stop)
                readout[..., begin - start:end - start] = out @ W_U[:, begin:end].float()
            for member in range(len(members)):
                for lo in range(0, sampled, chunk):
                    hi = min(lo + chunk, sampled)
                    _count_beyond(left[member, lo:hi], own[member, lo:hi], readout[member], tokens[lo:hi] - start,
                                  above[member, lo:hi], below[member, lo:hi], k, span)
        for member, (layer, head) in enumerate(members):
            top[layer, head] = (above[member] < k).float().mean()
            bottom[layer, head] = (below[member] < k).float().mean()
    return top, bottom


def _count_beyond(left: torch.Tensor, mine: torch.Tensor, readout: torch.Tensor, own_column: torch.Tensor,
                  above: torch.Tensor, below: torch.Tensor, k: int, span: int) -> None:
    """Add to ``above`` / ``below`` (n,) how many of a block's columns hold an entry above / below each
    row's own entry ``mine`` (n,), the rows being ``left`` (n, d_head) @ ``readout`` (d_head, columns)
    and ``own_column`` (n,) each row's own column in the block (outside it where the token is not
    there), which is skipped. ``span`` columns at a time; a row whose two counts have both reached
    ``k`` is not counted further (only whether each is below ``k`` is read), so on most heads the
    first ``span`` columns settle most rows and the rest of the vocabulary is read for the few others."""
    open_rows = torch.arange(len(left), device=left.device)
    for begin in range(0, readout.shape[1], span):
        open_rows = open_rows[(above[open_rows] < k) | (below[open_rows] < k)]
        if not len(open_rows):
            return
        rows = left[open_rows] @ readout[:, begin:begin + span]  # (open, span)
        greater, less = rows > mine[open_rows, None], rows < mine[open_rows, None]
        column = own_column[open_rows] - begin
        here = ((column >= 0) & (column < rows.shape[1])).nonzero()[:, 0]
        greater[here, column[here]] = False  # a token's own column is not another's
        less[here, column[here]] = False
        above[open_rows] += greater.sum(1)
        below[open_rows] += less.sum(1)


def qk_positional_scores(model) -> pd.DataFrame:
    """One row per head: ``layer, head, qk_previous, qk_self, qk_first`` (module docstring); a one-line
    refusal for a model without learned position embeddings (``W_pos``)."""
    try:
        W_pos = model.W_pos.detach().float()
    except (AttributeError, ValueError, RuntimeError):
        raise UserError("QK positional scores need learned position embeddings (W_pos); this model has none") from None
    n_heads = model.cfg.n_heads
    W_Q = model.W_Q.detach().float()
    W_K = expand_kv_heads(model.W_K.detach(), n_heads).float()
    queries = einops.einsum(W_pos, W_Q, "p m, l h m d -> l h p d")
    keys = einops.einsum(W_pos, W_K, "p m, l h m d -> l h p d")
    scores = queries @ keys.transpose(-1, -2) / W_Q.shape[-1] ** 0.5
    n_pos = W_pos.shape[0]
    causal = torch.ones(n_pos, n_pos, dtype=torch.bool, device=W_pos.device).tril()
    pattern = scores.masked_fill(~causal, -torch.inf).softmax(-1)[..., 1:, :]  # queries 1.. (layer, head, q, k)
    q = torch.arange(1, n_pos, device=W_pos.device)
    return head_frame(pattern[..., 0, 0], {
        "qk_previous": pattern[..., q - 1, q - 1].mean(-1),
        "qk_self": pattern[..., q - 1, q].mean(-1),
        "qk_first": pattern[..., 0].mean(-1),
    })


def ov_scores(model, k: int = DEFAULT_TOP_K, *, n_tokens: int = DEFAULT_N_TOKENS, seed: int = 0,
              progress: bool | None = None, memory_mb: float | None = None) -> pd.DataFrame:
    """A tidy frame, one row per head: ``layer, head, copying, copy_suppression, copying_topk,
    suppression_topk``. ``memory_mb``, ``progress``: the execution's (``analyses.core.execution``;
    None: the current one's)."""
    with torch.no_grad(), executing(memory_mb, progress) as execution:
        copying = copying_from_eigenvalues(ov_eigenvalues(model, memory_mb=execution.memory_mb)).float()
        top, bottom = ov_top_k(model, k, n_tokens=n_tokens, seed=seed, memory_mb=execution.memory_mb)
    return head_frame(copying, {"copying": copying, "copy_suppression": -copying, "copying_topk": top,
                                "suppression_topk": bottom})


def meaning_roles(model, *, k: int = DEFAULT_TOP_K, n_tokens: int = DEFAULT_N_TOKENS, seed: int = 0,
                  null_seeds: Sequence[int] = DEFAULT_NULL_SEEDS, fdr: float = 0.05,
                  threshold: float | None = DEFAULT_THRESHOLD, progress: bool | None = None) -> pd.DataFrame:
    """One row per head: ``layer, head``, the ``ov_scores`` columns, per role ``{role}_z, {role}_p,
    {role}_q``, and ``meaning_role``: the roles whose q-value (Benjamini-Hochberg over all heads x
    ``MEANING_ROLES``) is at most ``fdr`` and whose score reaches ``threshold`` (None: no threshold),
    joined by ';'."""
    check_fdr(fdr)
    nulls = add_fdr(meaning_nulls(model, null_seeds, progress), fdr)
    keep = nulls["significant"] & (nulls["score"] >= (-torch.inf if threshold is None else threshold))
    named = nulls[keep].groupby(["layer", "head"])["role"].agg(";".join)
    wide = nulls.pivot(index=["layer", "head"], columns="role", values=["z", "p", "q"])
    columns = {f"{role}_{value}": wide[(value, role)] for role in MEANING_ROLES for value in ("z", "p", "q")}
    table = ov_scores(model, k, n_tokens=n_tokens, seed=seed, progress=progress)
    table = table.merge(pd.DataFrame(columns).reset_index(), on=["layer", "head"])
    table["meaning_role"] = [named.get((layer, head), "") for layer, head in zip(table["layer"], table["head"])]
    return table


def attended_hooks(model) -> list[str]:
    """The hooks ``attended_token_effect`` reads: every ``hook_pattern`` and ``hook_z``, the final residual."""
    layers = range(model.cfg.n_layers)
    return [*map(pattern_name, layers), *map(z_name, layers), final_resid_name(model)]


@torch.no_grad()
def attended_token_effect(model, tokens: torch.Tensor, cache=None) -> pd.DataFrame:
    """Each head's direct effect on the logit of the token it attends to most: at every query
    position q >= 1 of ``tokens`` (batch, pos), the head's write (final norm frozen at the clean
    scale, as in ``analyses.components.decompose``) dotted with the unembedding of the token at its argmax key.
    ``cache``: the clean run's, holding ``attended_hooks(model)`` (None: one run caching only those).
    One row per head: ``layer, head, attended_effect`` (mean over prompts and positions; > 0 copies,
    < 0 suppresses)."""
    if cache is None:
        _, cache = model.run_with_cache(tokens, names_filter=attended_hooks(model))
    final = cache[final_resid_name(model)][:, 1:]
    norm = final_norm(model, final)
    W_U = model.W_U.detach().float()
    rows = []
    for layer in range(model.cfg.n_layers):
        writes = head_outputs(model, layer, cache[z_name(layer)][:, 1:].float())  # (batch, q, head, d_model)
        if norm.centre:
            writes = writes - writes.mean(-1, keepdim=True)
        attended = cache[pattern_name(layer)][..., 1:, :].argmax(-1)  # (batch, head, q)
        targets = tokens.gather(1, attended.flatten(1)).reshape(attended.shape)
        directions = W_U.T[targets] * norm.weight  # (batch, head, q, d_model)
        effect = einops.einsum(writes, directions, "b q h m, b h q m -> b h q") / norm.scale[:, None, :, 0]
        rows.append(effect.mean((0, 2)))
    effects = torch.stack(rows)
    return head_frame(effects, {"attended_effect": effects})
