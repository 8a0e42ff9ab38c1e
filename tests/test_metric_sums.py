"""The one accumulator of every chunked score (``analyses.interventions.engine.MetricSums``): a metric
pooled over chunks of variants and prompts, fed in any order the engine's chunks come in, against
the metric computed here on every prompt's logits at once (per-prompt numerators and counts: the
cross-entropy by hand)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from analyses.core.metrics import PromptScores, loss_metric
from analyses.interventions.engine import Chunk, MetricSums
from interp.model import GPTConfig, GPTModel

BATCH, N_POS, VOCAB = 5, 6, 11


def model() -> GPTModel:  # only its device matters to the accumulators
    return GPTModel(GPTConfig(d_vocab=VOCAB, n_ctx=8, d_model=8, n_heads=2, n_layers=1))


def data():
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (BATCH, N_POS), generator=generator)
    logits = torch.randn(3, BATCH, N_POS, VOCAB, generator=generator)  # 3 variants
    counted = torch.zeros(BATCH, N_POS, dtype=torch.bool)
    counted[0, 2:5], counted[1, 1], counted[4, 3:] = True, True, True  # prompts 2 and 3 count nothing
    return tokens, logits, counted


def losses_by_hand(tokens, logits, counted) -> tuple[torch.Tensor, torch.Tensor]:
    """Each variant's each prompt's summed cross-entropy over its counted predictions (3, batch),
    and each prompt's count (batch,)."""
    each = F.cross_entropy(logits[:, :, :-1].flatten(0, 2), tokens[:, 1:].repeat(3, 1).flatten(),
                           reduction="none").view(3, BATCH, N_POS - 1)
    mask = counted[:, 1:]
    return (each * mask).sum(-1), mask.sum(-1).float()


def feed(sums: MetricSums, logits: torch.Tensor, chunks) -> PromptScores:
    asked = []

    def chunk_logits(members, rows, positions, compact, entries):
        asked.append(rows)
        return logits[members][:, rows]

    scores = sums.score([Chunk(members, rows) for members, rows in chunks], chunk_logits)
    assert not any(rows in asked for rows in (slice(2, 3), slice(3, 4)))  # parts that count nothing: not run
    return scores


# variants by prompts, prompts by variants, and one prompt at a time with a part that counts nothing
ORDERS = {"variants_together": [([0, 1, 2], slice(0, 5))],
          "rows_then_variants": [([v], rows) for rows in (slice(0, 2), slice(2, 5)) for v in range(3)],
          "variant_then_rows": [([v], slice(b, b + 1)) for v in (2, 0, 1) for b in range(BATCH)]}


def test_a_split_metric_pools_its_parts_as_one_batch_in_any_chunk_order():
    tokens, logits, counted = data()
    numerators, counts = losses_by_hand(tokens, logits, counted)
    for order, chunks in ORDERS.items():
        scores = feed(MetricSums(model(), loss_metric(tokens, counted), 3, BATCH), logits, chunks)
        torch.testing.assert_close(scores.numerators.float(), numerators, msg=order)
        torch.testing.assert_close(scores.counts.float(), counts, msg=order)
        torch.testing.assert_close(scores.values.float(), numerators.sum(-1) / counts.sum(), msg=order)


def test_a_metric_that_does_not_split_is_scored_once_on_every_prompt_joined():
    tokens, logits, _ = data()
    seen = []

    def last_logit(batch_logits):  # a plain callable: cannot be split over chunks of prompts
        seen.append(batch_logits.shape[0])
        return batch_logits[:, -1, 3].mean()

    scores = feed(MetricSums(model(), last_logit, 3, BATCH), logits,
                  [([v], rows) for v in range(3) for rows in (slice(0, 2), slice(2, 5))])
    assert seen == [BATCH] * 3  # each variant once, on all its prompts
    torch.testing.assert_close(scores.values.float(), logits[:, :, -1, 3].mean(-1))
    assert scores.numerators is None and scores.counts is None
