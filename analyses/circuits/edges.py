"""The edges circuit tools score (architecture §4.6): a *sender* head joined to a *receiver*, a later
head's query, key or value input or the unembedding ("logits"); ``Edges`` holds thousands of them
as one table, ``edges_of`` selects them, and a sender's write to the residual stream is its z
through its ``W_O`` (``output_weights``, ``writes_into``). Exact path patching
(``analyses.circuits.path_patching``) and edge attribution (``analyses.circuits.edge_attribution``)
both speak it.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product
from typing import NamedTuple, Sequence

import numpy as np
import pandas as pd
import torch

from analyses.core.hook_check import HEAD_WRITES, check_hooks
from analyses.core.checks import check_choice, check_heads
from interp.errors import UserError

VIAS = ("q", "k", "v", "logits")
QKV = ("q", "k", "v")
KEY_COLUMNS = ["sender_layer", "sender_head", "receiver_layer", "receiver_head", "via"]
Head = tuple[int, int]


class Edge(NamedTuple):
    """sender (layer, head) -> receiver (layer, head) through ``via``; a "logits" edge's receiver
    is (n_layers, -1). One row of ``Edges``."""

    sender: Head
    receiver: Head
    rank: int  # VIAS.index(via), so edges sort by it

    @property
    def via(self) -> str:
        return VIAS[self.rank]


@dataclass(frozen=True)
class Edges:
    """Edges as one table, so an analysis over thousands of them needs no Python loop: ``table``
    (edge, 5) int64, the columns ``sender_layer, sender_head, receiver_layer, receiver_head,
    rank`` (``VIAS.index(via)``; a "logits" edge's receiver is (n_layers, -1)), sorted by sender,
    receiver, then via in ``VIAS`` order. ``edges[i]`` is row i as an ``Edge``."""

    table: np.ndarray

    def __len__(self) -> int:
        return len(self.table)

    def __getitem__(self, i: int) -> Edge:
        sender_layer, sender_head, receiver_layer, receiver_head, rank = self.table[i].tolist()
        return Edge((sender_layer, sender_head), (receiver_layer, receiver_head), rank)

    def __iter__(self):
        return (Edge((row[0], row[1]), (row[2], row[3]), row[4]) for row in self.table.tolist())

    def take(self, indices) -> "Edges":
        """The rows ``indices`` (in that order)."""
        return Edges(self.table[np.asarray(indices, dtype=np.int64)])

    def frame(self, **columns) -> pd.DataFrame:
        """One row per edge: ``KEY_COLUMNS`` then ``columns`` (each a sequence in edge order)."""
        keys = pd.DataFrame(self.table[:, :4], columns=KEY_COLUMNS[:4])
        keys = keys.assign(via=np.array(VIAS, dtype=object)[self.table[:, 4]])
        return keys.assign(**{name: torch.as_tensor(values).cpu().numpy() for name, values in columns.items()})


def check_vias(via: str | Sequence[str]) -> tuple[str, ...]:
    """One of ``VIAS`` or a sequence of them -> a tuple in ``VIAS`` order, without repeats."""
    chosen = [via] if isinstance(via, str) else list(via)
    for item in chosen:
        check_choice("via", item, VIAS)
    if not chosen:
        raise UserError(f"via is empty; give one or more of {', '.join(VIAS)}")
    return tuple(v for v in VIAS if v in chosen)


def _all_heads(model) -> list[Head]:
    return list(product(range(model.cfg.n_layers), range(model.cfg.n_heads)))


def edges_of(model, senders=None, receivers=None, via: str | Sequence[str] = VIAS) -> Edges:
    """Every edge between ``senders`` and ``receivers`` (lists of (layer, head); None: all heads)
    through each of ``via``, sorted: a q/k/v edge where the sender's layer is before the
    receiver's; a "logits" edge from every sender. None at all is a one-line error."""
    vias = check_vias(via)
    senders = _all_heads(model) if senders is None else check_heads(model, senders)
    receivers = _all_heads(model) if receivers is None else check_heads(model, receivers)
    ranks = [VIAS.index(v) for v in vias if v in QKV]
    inputs = [(*r, rank) for r in sorted(set(receivers)) for rank in ranks]  # (receiver, via rank), sorted
    inputs += [(model.cfg.n_layers, -1, VIAS.index("logits"))] if "logits" in vias else []  # sorts last
    inputs = np.array(inputs, dtype=np.int64).reshape(-1, 3)
    sources = np.array(sorted(set(senders)), dtype=np.int64).reshape(-1, 2)
    pairs = np.concatenate([np.repeat(sources, len(inputs), axis=0), np.tile(inputs, (len(sources), 1))], axis=1)
    found = pairs[pairs[:, 2] > pairs[:, 0]]  # a logits edge's receiver layer, n_layers, is after every sender
    if not len(found):
        raise UserError(f"no edge: every receiver's layer must come after a sender's (senders {senders}, "
                        f"receivers {receivers}, via {', '.join(vias)})")
    return Edges(found)


def output_weights(model, n_layers: int, need: str = HEAD_WRITES) -> list[torch.Tensor]:
    """The first ``n_layers`` layers' ``W_O`` (head, d_head, d_model), detached: a head's write to
    the residual stream is its z times its slice. Refused in one line where the hook self-test did
    not find the heads' ``z @ W_O`` (plus ``b_O``) adding up to ``hook_attn_out`` (``need``
    ``HEAD_WRITES``), or with ``need`` ``HEAD_CONTRIBUTIONS`` (a caller that applies the frozen norm on
    the attention output where a block has one, ``frozen_output_norm``) not adding up to it so."""
    reason = check_hooks(model).refusal(need, "path patching")
    if reason is not None:
        raise UserError(reason)
    return [model.blocks[layer].attn.W_O.detach() for layer in range(n_layers)]


def writes_into(out: torch.Tensor, moved: Sequence[torch.Tensor], w_o: Sequence[torch.Tensor]) -> torch.Tensor:
    """Fill ``out`` (layer * head, rows, d_model) with each head's write: its moved z, per layer
    (head, rows, d_head), through its ``W_O`` slice; one ``bmm`` per layer, into ``out`` directly
    (no concatenated copy of every layer's ``W_O``)."""
    n_heads = w_o[0].shape[0]
    for layer, (z, weight) in enumerate(zip(moved, w_o)):
        torch.bmm(z, weight.to(z.dtype), out=out[layer * n_heads:(layer + 1) * n_heads])
    return out
