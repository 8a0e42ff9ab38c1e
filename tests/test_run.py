"""The spine (``analyses.interventions.run``): one forward of the probes serves the whole report; a ``Run``-based
call equals the keyword API it replaces; what a ``Run`` reads later (``Run.read``) equals a full
forward's cache; ``Edit`` and the old tuples make the same intervention."""

from __future__ import annotations

import pytest
import torch

from analyses.interventions.ablation import ablation_reads, prepare_ablation, prompts_run
from analyses.roles.backup import direct_and_total_effects, direct_effect_reads
from analyses.roles.classify import MEASURES, PromptSums, per_prompt_scores, probe_targets
from analyses.core.hook_names import qkv_name, z_name, z_names
from analyses.interventions.engine import Edit, cache_run, score_variants
from analyses.core.metrics import loss_metric
from analyses.circuits.edges import edges_of
from analyses.circuits.path_patching import path_patch, path_reads
from analyses.interventions.patching import component_patches, mlp_out_names, patch_heads, patch_mlps, prepare
from analyses.core.probes import corrupt_first_copy, probes_for
from analyses.report.build import DEFAULT_INTERVENTION_PROMPTS, build_report
from analyses.report.split import LIST_PROMPTS
from analyses.core.execution import executing
from analyses.interventions.run import FirstRows, Options, Run
from interp import load_model
from interp.errors import UserError


@pytest.fixture(scope="module")
def toy():
    return load_model("toy").eval()


@pytest.fixture(scope="module")
def probes(toy):
    return probes_for(toy, 6, 24, seed=3)


def test_report_runs_the_probe_batch_once(toy):
    """Count the probe rows the model embeds, as ``benchmarks/bench_report.py`` does (a forward of any
    subset or chunk of the probes counts its share): the report's steps, the components section's 16
    prompts included, all read one ``Run`` of the intervention probes, so those go through the model
    once, and once more for the QK section (one forward stopped at the last role head's layer, which
    keeps the scores, queries and keys the probe run does not: every role head's split reads it); of the probes that choose the roles, only the selection rows the report's lists are chosen
    on (``selection_probes``: ``LIST_PROMPTS`` of them, half the intervention probes) go through again, three more times:
    their run, the backup pairs' first-order screen (a forward with its backward) and the circuit's
    edge attribution on their clean prompts; every other choosing probe once."""
    n_prompts, seq_len = 20, 24
    # one draw: the intervention probes first, then the n_prompts that choose the roles
    drawn = DEFAULT_INTERVENTION_PROMPTS + n_prompts
    batch = probes_for(toy, drawn, seq_len, seed=0).tokens
    rows = {tuple(row.tolist()): index for index, row in enumerate(batch)}
    passes = torch.zeros(drawn)

    def count(module, args):
        tokens = args[0]
        if tokens.dim() == 2:
            for row in tokens:
                if tuple(row.tolist()) in rows:
                    passes[rows[tuple(row.tolist())]] += 1

    handle = toy.embed.register_forward_pre_hook(count)
    try:
        build_report(toy, model_name="toy", n_prompts=n_prompts, seq_len=seq_len, seed=0, progress=False)
    finally:
        handle.remove()
    selection = min(LIST_PROMPTS, DEFAULT_INTERVENTION_PROMPTS, n_prompts)
    assert selection < DEFAULT_INTERVENTION_PROMPTS  # the lists are chosen on fewer rows than measure
    assert passes[:DEFAULT_INTERVENTION_PROMPTS].eq(2).all(), passes
    chosen_on = passes[DEFAULT_INTERVENTION_PROMPTS:]
    assert chosen_on[selection:].eq(1).all() and chosen_on[:selection].eq(4).all(), passes


def test_run_read_equals_a_full_forward(toy, probes):
    """What a Run did not keep is read by a forward of only the blocks it needs, from its starts:
    the same numbers as the full forward's cache."""
    run = Run.make(toy, probes.tokens, None, [z_name(0)])
    names = [qkv_name(1, "q"), qkv_name(1, "v"), z_name(1), "blocks.1.hook_resid_post"]
    _, full = cache_run(toy, probes.tokens, names)
    read = run.read(names)
    for name in names:
        assert torch.equal(read[name], full[name]), name


def test_run_baseline_and_chunks(toy, probes):
    """One forward in chunks of prompts (a tiny budget) keeps the same activations and baseline as one
    unchunked forward (to float precision: chunks change the batch shape), and its reducers see every row."""
    metric = loss_metric(probes.tokens, probes.predictable)
    whole = Run.make(toy, probes.tokens, metric, z_names(toy),
                     reducers={"sums": PromptSums(toy, probe_targets(probes), MEASURES),
                               "first": FirstRows(["blocks.0.attn.hook_pattern"], 4)})
    chunked = Run.make(toy, probes.tokens, metric, z_names(toy), memory_mb=0.05,
                       reducers={"sums": PromptSums(toy, probe_targets(probes), MEASURES),
                                 "first": FirstRows(["blocks.0.attn.hook_pattern"], 4)})
    assert whole.baseline == pytest.approx(chunked.baseline, abs=1e-6)
    for name in z_names(toy):
        torch.testing.assert_close(whole.cache[name], chunked.cache[name], atol=1e-6, rtol=0)
    for measure in MEASURES:
        torch.testing.assert_close(whole.reduced["sums"][measure], chunked.reduced["sums"][measure],
                                   atol=1e-6, rtol=1e-6)
    first = chunked.reduced["first"]["blocks.0.attn.hook_pattern"]
    assert first.shape[0] == 4
    _, full = cache_run(toy, probes.tokens[:4], ["blocks.0.attn.hook_pattern"], logits=False)
    torch.testing.assert_close(first, full["blocks.0.attn.hook_pattern"], atol=1e-6, rtol=0)
    with pytest.raises(UserError, match="not those this run was made of"):
        whole.check_tokens(probes.tokens[:2])


def test_scores_from_a_run_equal_their_own_forward(toy, probes):
    """Per-prompt pattern sums reduced by a Run's forward equal those of per_prompt_scores' own run."""
    targets = probe_targets(probes)
    run = Run.make(toy, probes.tokens, reducers={"prompt_sums": PromptSums(toy, targets, MEASURES)})
    own = per_prompt_scores(toy, probes.tokens, targets, MEASURES)
    read = per_prompt_scores(toy, probes.tokens, targets, MEASURES, run=run)
    for measure in MEASURES:
        assert torch.equal(own[measure], read[measure])


def test_patch_heads_keywords_equal_the_run_api(toy, probes):
    """patch_heads(model, clean, corrupted, metric, by_position=..., direction=...) builds the Contrast
    and Options it then runs on: the same numbers as calling component_patches on them directly."""
    clean, corrupted = probes.tokens, corrupt_first_copy(probes, seed=4)
    metric = loss_metric(clean, probes.predictable)
    keywords = patch_heads(toy, clean, corrupted, metric, by_position=True, direction="noise", progress=False)
    contrast = prepare(toy, clean, corrupted, metric, z_names(toy), "noise")
    with executing(progress=False):
        direct = component_patches(contrast, "heads", Options(direction="noise"), by_position=True)
    assert torch.equal(keywords, direct)
    as_object = patch_heads(toy, clean, corrupted, metric, by_position=True,
                            options=Options(direction="noise"))
    assert torch.equal(keywords, as_object)
    with pytest.raises(TypeError, match="directoin"):
        patch_heads(toy, clean, corrupted, metric, directoin="noise")
    assert contrast.clean_value == contrast.baseline  # noising patches the clean run


@pytest.mark.parametrize("direction", ["denoise", "noise"])
def test_patching_reads_a_clean_run(scratch_gpt2, direction):
    """patch_heads and patch_mlps given a Run of the clean prompts (made with another metric object:
    its value is then read from the last block) equal their own two forwards."""
    probes = probes_for(scratch_gpt2, 4, 16, seed=2)
    clean, corrupted = probes.tokens, corrupt_first_copy(probes, seed=4)
    metric = loss_metric(clean, probes.predictable)
    names = [*z_names(scratch_gpt2), *mlp_out_names(scratch_gpt2)]
    run = Run.make(scratch_gpt2, clean, loss_metric(clean, probes.predictable), names)
    for patch in (patch_heads, patch_mlps):
        own = patch(scratch_gpt2, clean, corrupted, metric, direction=direction, normalize=True, progress=False)
        shared = patch(scratch_gpt2, clean, corrupted, metric, direction=direction, normalize=True, progress=False,
                       clean_run=run)
        assert torch.equal(own, shared)
    with pytest.raises(UserError, match="not those this run was made of"):
        patch_heads(scratch_gpt2, corrupted, clean, metric, direction=direction, progress=False, clean_run=run)


def test_ablation_and_paths_on_a_shared_run(toy, probes):
    """prepare_ablation, direct_and_total_effects and path_patch on one shared Run give exactly what
    each gives with a forward of its own."""
    metric = loss_metric(probes.tokens, probes.predictable)
    run = Run.make(toy, probes.tokens, metric, direct_effect_reads(toy, "mean_aligned"))
    own = prepare_ablation(toy, probes, "mean_aligned", metric)
    shared = prepare_ablation(toy, probes, "mean_aligned", metric, run=run)
    heads = [[(0, 1)], [(1, 2), (1, 3)]]
    with executing(progress=False):
        assert torch.equal(own.run(heads), shared.run(heads))
    assert own.baseline == shared.baseline
    effects = direct_and_total_effects(toy, probes, None, "mean_aligned", metric, progress=False)
    assert effects.equals(direct_and_total_effects(toy, probes, None, "mean_aligned", metric, progress=False, run=run))
    corrupted = corrupt_first_copy(probes, seed=4)
    paths = path_patch(toy, probes.tokens, corrupted, metric, direction="noise", progress=False)
    assert paths.equals(path_patch(toy, probes.tokens, corrupted, metric, direction="noise", progress=False,
                                   base_run=run))
    assert set(ablation_reads(toy, "mean")) <= set(path_reads(toy, edges_of(toy)))
    assert prompts_run(toy, probes, ablation_reads(toy, "zero")).cache == {}


def test_edits_equal_tuples(toy, probes):
    """An Edit and the tuple it replaces make the same intervention (with and without a value)."""
    metric = loss_metric(probes.tokens, probes.predictable)
    _, cache = cache_run(toy, probes.tokens, [z_name(1)])
    sources = {z_name(1): torch.zeros_like(cache[z_name(1)])}
    value = torch.ones(probes.tokens.shape[0], probes.tokens.shape[1], cache[z_name(1)].shape[-1])
    as_tuples = [[(z_name(1), (slice(None), 0))], [(z_name(1), (slice(None), 2), value)]]
    as_edits = [[Edit(z_name(1), (slice(None), 0))], [Edit(z_name(1), (slice(None), 2), value)]]
    one = score_variants(toy, probes.tokens, as_tuples, sources, metric).values
    two = score_variants(toy, probes.tokens, as_edits, sources, metric).values
    assert torch.equal(one, two)


def test_run_keeps_its_first_rows_only(toy):
    """``keep_rows``: the store holds the first prompts only (equal to a run of those prompts alone),
    while the metric and the reducers still see every prompt; the whole batch cannot be read."""
    probes = probes_for(toy, 12, 24, seed=5)
    metric = loss_metric(probes.tokens, probes.predictable)
    partial = Run.make(toy, probes.tokens, metric, z_names(toy), memory_mb=0.05, keep_rows=5,
                       reducers={"sums": PromptSums(toy, probe_targets(probes), MEASURES)})
    alone = Run.make(toy, probes.tokens[:5], None, z_names(toy))
    whole = Run.make(toy, probes.tokens, metric, z_names(toy))
    assert partial.stored == 5
    for name in z_names(toy):
        assert partial.cache[name].shape[0] == 5
        torch.testing.assert_close(partial.first(5).read([name])[name], alone.cache[name], rtol=0, atol=1e-5)
    assert partial.starts  # the tiny budget thins them to layer 0's
    for name, start in partial.starts.items():
        assert start.shape[0] == 5
        torch.testing.assert_close(start, alone.starts[name], rtol=0, atol=1e-5)
    assert partial.baseline == pytest.approx(whole.baseline, abs=1e-5)
    assert partial.reduced["sums"][MEASURES[0]].shape[0] == 12
    with pytest.raises(UserError, match="stores its first 5 of 12"):
        partial.read(z_names(toy))
    with pytest.raises(UserError, match="has no first 6"):
        partial.first(6)


def test_report_intervenes_on_its_first_probes(toy):
    """``build_report(intervention_prompts=k)``: one draw of k + n_prompts probes; the total effects
    (the head table's ``ablation_effect``) are those of ``direct_and_total_effects`` on its first k
    probes alone, with their own loss (the roles are read from the others)."""
    n_prompts, seq_len, k = 20, 24, 6
    report = build_report(toy, model_name="toy", n_prompts=n_prompts, seq_len=seq_len, seed=0,
                          intervention_prompts=k, progress=False)
    first = probes_for(toy, k + n_prompts, seq_len, seed=0).first(k)
    effects = direct_and_total_effects(toy, first, None, "mean_aligned", loss_metric(first.tokens, first.predictable),
                                       progress=False)
    merged = report.table.merge(effects, on=["layer", "head"])
    assert len(merged) == toy.cfg.n_layers * toy.cfg.n_heads
    torch.testing.assert_close(torch.tensor(merged["ablation_effect"].to_numpy()),
                               torch.tensor(merged["total"].to_numpy()), rtol=0, atol=1e-5)
    assert report.meta["intervention_prompts"] == k and report.meta["prompts"] == n_prompts
    with pytest.raises(UserError, match="intervention_prompts=1"):
        build_report(toy, model_name="toy", n_prompts=n_prompts, intervention_prompts=1, progress=False)
