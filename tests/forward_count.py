"""Counting forward-equivalents as ``benchmarks/bench_report.py`` does, for the cost-estimate tests.

A forward-equivalent (FE) is one forward of a batch of ``batch_rows`` rows (tokens of prompts)
through every block of an ``n_layers`` model: each call of a ``TransformerBlock`` adds (rows it
ran) / (batch_rows x n_layers); a run that starts after a block's attention
(``forward_from_mid`` called alone) adds that block's MLP share of its parameters. Every model's
blocks count (the report's random-initialisation nulls have the main model's shape). Each count
goes to ``step``, which the test sets as the run moves from step to step.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from interp.model import TransformerBlock


class StepForwardCounter:
    """Counts FE per ``step`` while installed (a context manager); ``fe``: step -> FE."""

    def __init__(self, batch_rows: int, n_layers: int):
        self.unit = batch_rows * n_layers
        self.fe: dict[str, float] = defaultdict(float)
        self.step = "before"

    def __enter__(self) -> "StepForwardCounter":
        self._forward, self._from_mid = TransformerBlock.forward, TransformerBlock.forward_from_mid
        inside: set[int] = set()  # blocks in their own forward, which calls forward_from_mid itself
        counter = self

        def forward(block, resid, *args, **kwargs):
            counter.charge(resid, 1.0)
            inside.add(id(block))
            try:
                return counter._forward(block, resid, *args, **kwargs)
            finally:
                inside.discard(id(block))

        def from_mid(block, resid_mid):
            if id(block) not in inside:
                mlp = sum(p.numel() for p in block.mlp.parameters())
                counter.charge(resid_mid, mlp / sum(p.numel() for p in block.parameters()))
            return counter._from_mid(block, resid_mid)

        TransformerBlock.forward, TransformerBlock.forward_from_mid = forward, from_mid
        return self

    def __exit__(self, *exc) -> None:
        TransformerBlock.forward, TransformerBlock.forward_from_mid = self._forward, self._from_mid

    def charge(self, resid: torch.Tensor, share: float) -> None:
        self.fe[self.step] += share * (resid.numel() / resid.shape[-1]) / self.unit
