"""``analyses.core.metrics.Metric``: every metric the toolkit builds is one and declares what it can
do; a plain callable is wrapped once (``as_metric``) and what it cannot do is refused in one line,
or, where a sweep scores it, it falls back to every prompt at once with no per-prompt form (NaN
intervals), as documented in docs/guides/metrics.md."""

import pytest
import torch

from analyses.core.execution import executing
from analyses.components.neurons import promotion_metric
from analyses.core.metrics import (CallableMetric, Metric, PromptMeanMetric, as_metric, logit_diff_metric,
                                   loss_metric, metric_for_batch, prompt_scores)
from analyses.interventions.engine import cache_run, head_cells, score_variants
from analyses.tasks.task import ioi_task, task_batch, task_measures, task_metric
from analyses.tasks.tracing import answer_probability
from interp import UserError, load_model


@pytest.fixture(scope="module")
def toy():
    return load_model("toy")


def test_every_built_in_metric_is_a_metric(toy):
    task = ioi_task(toy, n=4)
    last = task_batch(toy, task).last
    tokens = torch.zeros(2, 6, dtype=torch.long)
    built = [loss_metric(tokens), logit_diff_metric(1, 2), task_metric(task, last), *task_measures(task, last).values(),
             promotion_metric([1, 2]), answer_probability(3), answer_probability(3, parts=True)]
    assert all(isinstance(metric, Metric) for metric in built)
    assert all(as_metric(metric) is metric for metric in built)  # never wrapped again
    # what each declares: the loss and logit difference split and restrict; task metrics split
    assert [(m.splits, m.restricts) for m in built[:3]] == [(True, True), (True, True), (True, False)]
    assert not promotion_metric([1, 2]).splits and answer_probability(3, parts=True).splits


def test_a_plain_callable_is_wrapped_and_what_it_cannot_do_is_refused_in_one_line():
    logits = torch.randn(2, 6, 10)

    def fn(logits):
        return logits[:, -1, 0].mean()

    metric = as_metric(fn)
    assert isinstance(metric, CallableMetric) and metric.fn is fn and repr(metric) == repr(fn)
    assert torch.equal(metric(logits), logits[:, -1, 0].mean())
    assert metric.positions(6) is None and not metric.splits and not metric.restricts  # every position
    for refused in (lambda: metric.part(slice(0, 1), None), lambda: metric.rows(slice(0, 1))):
        with pytest.raises(UserError) as error:
            refused()
        assert "\n" not in str(error.value) and repr(fn) in str(error.value)
    # unequal lengths: an undeclared callable gets the padded logits as they are
    assert metric_for_batch(fn, torch.tensor([6, 4]), 6).fn is fn
    fn.read_positions = -1  # a declared fixed position is kept, and falls on padding
    assert as_metric(fn).positions(6).tolist() == [5]
    with pytest.raises(UserError, match=r"reads fixed positions \(\[-1\]\), but the prompts have unequal"):
        metric_for_batch(fn, torch.tensor([6, 4]), 6)
    with pytest.raises(UserError, match="a metric must be a callable .* got int"):
        as_metric(3)


def test_a_plain_callable_in_a_sweep_is_scored_on_every_prompt_without_a_per_prompt_form(toy):
    """The fallback: a sweep in chunks of prompts scores the plain callable on the whole batch at once
    (its value is the hand-computed one on the patched logits, not a mean of chunk values), and keeps no
    per-prompt numerators, where a built-in metric keeps them."""
    torch.manual_seed(0)
    tokens = torch.randint(0, toy.cfg.d_vocab, (6, 8))
    name = "blocks.0.attn.hook_z"
    _, cache = cache_run(toy, tokens, [name])
    zero = {name: torch.zeros_like(cache[name])}

    def fn(logits):  # not a mean over prompts: chunk values could not be pooled
        return logits[:, -1, 0].max()

    def hook(z, hook):
        z[:, :, 1] = 0
        return z

    with torch.no_grad():
        by_hand = toy.run_with_hooks(tokens, fwd_hooks=[(name, hook)])[:, -1, 0].max()
    with executing(memory_mb=0.01):
        plain = score_variants(toy, tokens, [head_cells([(0, 1)])], zero, fn)
        built = score_variants(toy, tokens, [head_cells([(0, 1)])], zero, logit_diff_metric(0, 1))
    assert plain.numerators is None and plain.counts is None
    torch.testing.assert_close(plain.values[0], by_hand.float())
    assert built.numerators.shape == (1, 6) and built.counts.tolist() == [1.0] * 6


def test_a_metric_of_ones_own_splits_over_chunks_of_prompts(toy):
    """A ``PromptMeanMetric`` with part scores is split like the built-in ones: its per-prompt
    numerators are each prompt's own score, computed here by hand on the unpatched logits."""
    torch.manual_seed(1)
    tokens = torch.randint(0, toy.cfg.d_vocab, (5, 7))
    metric = PromptMeanMetric(lambda logits: logits[:, -1, 2].float(), read_positions=-1,
                              part_scores=lambda rows, read: lambda logits: logits[:, -1, 2].float())
    with torch.no_grad():
        logits = toy(tokens)
    scores = prompt_scores(metric, logits)
    torch.testing.assert_close(scores.numerators, logits[:, -1, 2].float())
    torch.testing.assert_close(scores.values, logits[:, -1, 2].float().mean())
    assert prompt_scores(lambda logits: logits[:, -1, 2].mean(), logits).numerators is None
