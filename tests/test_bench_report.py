"""``benchmarks/bench_report.py``'s counter must not keep the models it counts alive: it marked every
``GPTModel`` built during a report (the random-initialisation nulls) with a strong reference, so each
null model outlived its step and the bench on Gemma 3 270M's shape grew to 17 GB."""

from __future__ import annotations

import gc
import importlib.util
import sys
import weakref
from pathlib import Path

import pytest
import torch

from interp import GPTConfig, GPTModel

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture
def bench(monkeypatch):
    """benchmarks/bench_report.py as a module; GPTModel.__init__ is restored after the test
    (``own_new_models`` wraps it)."""
    monkeypatch.setattr(GPTModel, "__init__", GPTModel.__init__)
    spec = importlib.util.spec_from_file_location("bench_report_under_test", BENCHMARKS / "bench_report.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module


def tiny(seed: int) -> GPTModel:
    torch.manual_seed(seed)
    return GPTModel(GPTConfig(d_vocab=50, n_ctx=8, d_model=16, n_heads=2, n_layers=2, d_mlp=32)).eval()


def test_the_counter_counts_other_models_apart_and_lets_them_go(bench):
    main = tiny(0)
    bench.own_new_models()
    bench.mark_owned(main)
    tokens = torch.randint(0, 50, (3, 8))
    with torch.no_grad(), bench.ForwardCounter(main, tokens) as counter:
        main(tokens)
        null = tiny(1)  # built while marking, as the report's null models are
        null(tokens)
        null.blocks[1].forward_from_mid(torch.zeros(3, 8, 16))  # a run from the block's MLP: its share is kept
        gone = weakref.ref(null)
        del null
        gc.collect()
        assert gone() is None  # the old counter's marks (and its MLP shares) held every null model alive
    assert sum(counter.block_rows.values()) > 0
    totals = {owner: sum(v for k, v in counter.block_rows.items() if k[0] == owner) for owner in ("main", "other models")}
    mlp = sum(p.numel() for p in main.blocks[1].mlp.parameters()) / sum(p.numel() for p in main.blocks[1].parameters())
    assert totals["main"] == pytest.approx(1.0)  # one forward of the probe batch through every block
    assert totals["other models"] == pytest.approx(1.0 + mlp / 2)  # its forward, and one block's MLP share
    assert sum(counter.passes.values()) == pytest.approx(1.0)  # only the main model's embedding counts
