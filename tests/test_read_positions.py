"""Interventions unembed only the positions a metric reads (on GPTModel, which starts mid-stream),
for a loss only each prompt's counted tokens: the values equal full-logit runs, the unembedding
sees only those rows, and a metric that reads
beyond what it declares is refused rather than fed NaN silently."""

from __future__ import annotations

import pytest
import torch

from analyses.interventions.engine import base_run, head_cells, score_variants
from analyses.core.metrics import as_metric, logit_diff_metric, loss_metric
from analyses.interventions.patching import patch_heads
from analyses.core.probes import corrupt_first_copy, probes_for
from interp import from_hf
from interp.errors import UserError
from interp.random_models import random_hf_model


@pytest.fixture(scope="module")
def model():
    hf, tokenizer = random_hf_model("gpt2", seed=5, n_ctx=64, d_vocab=257, n_layer=3, n_embd=64, n_head=4,
                                    initializer_range=0.2)
    return from_hf(hf, tokenizer).eval()


@pytest.fixture(scope="module")
def pair(model):
    probes = probes_for(model, 3, 16, seed=4)
    return probes, corrupt_first_copy(probes, seed=5)


def test_declared_positions():
    tokens = torch.zeros(2, 6, dtype=torch.long)
    predicted = torch.zeros(2, 6, dtype=torch.bool)
    predicted[0, 3], predicted[1, 5] = True, True  # tokens 3 and 5 are predicted from logits 2 and 4
    assert loss_metric(tokens, predicted).positions(6).tolist() == [2, 4]
    assert loss_metric(tokens).positions(6) is None  # every position
    assert logit_diff_metric(1, 2).positions(6).tolist() == [5]
    assert logit_diff_metric(1, 2, position=3).positions(6).tolist() == [3]
    assert as_metric(lambda logits: logits.sum()).positions(6) is None  # any other callable: every position


def _unembedded_rows(model, run) -> list[int]:
    """The number of residual rows (every axis but d_model) ``ln_final`` (the unembedding's input)
    saw on each call of ``run``."""
    seen = []
    handle = model.ln_final.register_forward_pre_hook(lambda module, args: seen.append(args[0].shape[:-1].numel()))
    try:
        run()
    finally:
        handle.remove()
    return seen


@pytest.mark.parametrize("which", ["loss", "logit_diff"])
def test_patching_unembeds_only_read_positions_with_equal_values(model, pair, which):
    probes, corrupted = pair
    metric = (loss_metric(probes.tokens, probes.predictable) if which == "loss"
              else logit_diff_metric(5, 7, position=-2))
    n_read = len(metric.positions(probes.tokens.shape[1]))
    assert n_read < probes.tokens.shape[1]
    full_metric = lambda logits: metric(logits)  # noqa: E731  -- undeclared: every position is unembedded
    full = patch_heads(model, probes.tokens, corrupted, full_metric, progress=False)  # runs the hook self-test too
    rows = _unembedded_rows(model, lambda: patch_heads(model, probes.tokens, corrupted, metric, progress=False))
    batch, n_pos = probes.tokens.shape
    # a patched variant unembeds what the metric reads: the loss each prompt's own counted tokens
    # (fewer than every prompt at the union of read positions), the logit difference its position
    per_variant = int(probes.predictable[:, 1:].sum()) if which == "loss" else batch * n_read
    assert per_variant < batch * n_read if which == "loss" else True
    base = (batch * n_read, batch * n_pos)  # the clean and corrupted runs: the read positions, or every one
    assert all(r % per_variant == 0 or r in base for r in rows), (rows, per_variant)
    assert any(r % per_variant == 0 and r < batch * n_pos for r in rows), (rows, per_variant)
    partial = patch_heads(model, probes.tokens, corrupted, metric, progress=False)
    assert (full - full.mean()).abs().max() > 1e-3  # patches move the metric: not a vacuous comparison
    torch.testing.assert_close(partial, full, atol=1e-5, rtol=0)


def test_metric_reading_undeclared_positions_is_refused(model, pair):
    probes, corrupted = pair
    metric = lambda logits: logits[:, 0, 0].mean()  # noqa: E731  -- reads position 0 ...
    metric.read_positions = [5]  # ... but declares position 5
    _, cache, starts = base_run(model, corrupted, ["blocks.1.attn.hook_z"])
    with pytest.raises(UserError, match="outside the positions it declares"):
        score_variants(model, corrupted, [head_cells([(1, 0)])], cache, metric, starts=starts).values
