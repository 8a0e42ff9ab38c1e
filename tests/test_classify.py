"""Head classification: scores of known patterns, role assignment, agreement across backends and
with TransformerLens's detect_head, and the batched ablation check against a one-head-at-a-time loop."""

from __future__ import annotations

import hashlib
import random

import pandas as pd
import pytest
import torch
from transformer_lens.head_detector import detect_head

from analyses.roles.causal_check import ablation_effects
from analyses.core.stats import bootstrap_ratio
from analyses.roles.classify import (
    assign_roles,
    classify_heads,
    head_table,
    probe_targets,
    prompt_counts_and_chance,
    prompt_sums,
    scores_frame,
    text_targets,
)
from analyses.core.probes import corrupt_first_copy, probes_for, repeated_probes
from analyses.core.tokens import encode, model_device, ordinary_token_ids, start_token_id
from analyses.roles.tl_compat import TL_HEAD_NAMES, detect_heads
from interp import load_model
from interp.errors import UserError
from interp.random_models import FAMILIES

SEQ_LEN = 48


@pytest.fixture(scope="module")
def scratch(gpt2_dir):
    return load_model(gpt2_dir, impl="scratch")


@pytest.fixture(scope="module")
def bridge(gpt2_dir):
    return load_model(gpt2_dir, impl="transformer_lens")


def one_hot_rows(keys: list[int], n_pos: int) -> torch.Tensor:
    """(q, k) pattern attending from query i to keys[i] (BOS when keys[i] is None or out of range)."""
    pattern = torch.zeros(n_pos, n_pos)
    for query, key in enumerate(keys):
        pattern[query, key if key is not None and 0 <= key <= query else 0] = 1.0
    return pattern


def synthetic_patterns(probes, offset: int) -> torch.Tensor:
    """(batch, 5 heads, q, k): previous-token, induction, fixed offset, uniform, self."""
    n_pos = probes.seq_len
    rows = []
    for period, start in zip(probes.period.tolist(), probes.segment_start.tolist()):
        second = range(start + period, start + 2 * period)
        induction = [i - period + 1 if i in second else 0 for i in range(n_pos)]
        uniform = torch.tril(torch.ones(n_pos, n_pos)) / torch.arange(1, n_pos + 1)[:, None]
        rows.append(torch.stack([
            one_hot_rows([i - 1 for i in range(n_pos)], n_pos),
            one_hot_rows(induction, n_pos),
            one_hot_rows([i - offset for i in range(n_pos)], n_pos),
            uniform,
            torch.eye(n_pos),
        ]))
    return torch.stack(rows)


def score_synthetic(probes, patterns):
    targets = probe_targets(probes)
    measures = ("previous_token", "duplicate_token", "induction", "self", "bos", "entropy", "distance")
    sums = {m: s[:, None] for m, s in prompt_sums(patterns, targets, measures).items()}  # one layer
    counts, chance = prompt_counts_and_chance(targets, measures)
    return scores_frame(sums, counts, chance, n_boot=200, seed=0)


def lookup(scores: pd.DataFrame, head: int, measure: str, column: str = "score") -> float:
    row = scores[(scores["head"] == head) & (scores["measure"] == measure)]
    return float(row[column].iloc[0])


def test_known_patterns_score_one_where_they_match_and_chance_is_the_uniform_head():
    probes = repeated_probes(24, SEQ_LEN, vocab=range(256), start_token_id=256, seed=3)
    offset = 8
    scores = score_synthetic(probes, synthetic_patterns(probes, offset))
    assert lookup(scores, 0, "previous_token") == pytest.approx(1.0)
    assert lookup(scores, 0, "distance") == pytest.approx(1.0)
    assert lookup(scores, 1, "induction") == pytest.approx(1.0)
    assert lookup(scores, 1, "duplicate_token") == pytest.approx(0.0)
    assert lookup(scores, 4, "self") == pytest.approx(1.0)
    assert lookup(scores, 4, "entropy") == pytest.approx(0.0)
    assert lookup(scores, 3, "entropy") == pytest.approx(1.0)
    # chance: a uniform causal head's score on the role's query positions, i.e. mean 1 / (i + 1)
    expected_prev_chance = sum(1 / (i + 1) for i in range(1, SEQ_LEN)) / (SEQ_LEN - 1)
    assert lookup(scores, 0, "previous_token", "chance") == pytest.approx(expected_prev_chance, rel=1e-6)
    second = [i for p, s in zip(probes.period.tolist(), probes.segment_start.tolist()) for i in range(s + p, s + 2 * p)]
    assert lookup(scores, 1, "induction", "chance") == pytest.approx(sum(1 / (i + 1) for i in second) / len(second), rel=1e-6)
    assert lookup(scores, 3, "induction") == pytest.approx(lookup(scores, 3, "induction", "chance"), rel=1e-5)
    assert lookup(scores, 3, "distance") == pytest.approx(lookup(scores, 3, "distance", "chance"), rel=1e-5)


def test_fixed_positional_offset_is_not_induction():
    probes = repeated_probes(32, SEQ_LEN, vocab=range(256), start_token_id=256, seed=4)
    periods = probes.period.tolist()
    offset = max(set(periods), key=periods.count) - 1  # the offset an induction head has most often
    scores = score_synthetic(probes, synthetic_patterns(probes, offset))
    assert lookup(scores, 2, "induction") < 0.4
    roles = assign_roles(scores).set_index("head")["role"]
    assert "induction" not in roles[2].split(";")
    assert roles[1] == "induction;bos"  # it rests on BOS outside the second copy
    assert roles[0] == "previous_token"
    assert roles[3] == ""


def test_hooked_fixed_offset_head_is_not_induction_but_previous_token_is_found(scratch):
    """End to end through a model: overwrite two heads' patterns with hooks."""
    n_pos = SEQ_LEN
    previous = one_hot_rows([i - 1 for i in range(n_pos)], n_pos)
    fixed = one_hot_rows([i - 9 for i in range(n_pos)], n_pos)

    def overwrite(pattern, hook):
        pattern = pattern.clone()
        pattern[:, 0], pattern[:, 1] = fixed, previous
        return pattern

    with scratch.hooks(fwd_hooks=[("blocks.1.attn.hook_pattern", overwrite)]):
        scores = classify_heads(scratch, n_prompts=24, seq_len=SEQ_LEN, seed=1, progress=False)
    head = scores[scores["layer"] == 1]
    assert lookup(head, 1, "previous_token") == pytest.approx(1.0)
    assert lookup(head, 0, "induction") < 0.2
    roles = assign_roles(scores).set_index(["layer", "head"])["role"]
    assert roles[(1, 1)] == "previous_token"
    assert "induction" not in roles[(1, 0)]


def test_assign_roles_needs_threshold_and_interval_above_chance():
    rows = [
        (0, 0, "induction", 0.9, 0.85, 0.95, 0.1),   # clear
        (0, 0, "previous_token", 0.5, 0.45, 0.55, 0.1),  # clear
        (0, 1, "induction", 0.3, 0.25, 0.35, 0.1),   # under threshold
        (1, 0, "bos", 0.6, 0.05, 0.9, 0.1),          # interval reaches chance
        (1, 1, "self", 0.6, 0.5, 0.7, 0.1),
    ]
    scores = pd.DataFrame(rows, columns=["layer", "head", "measure", "score", "ci_low", "ci_high", "chance"])
    roles = assign_roles(scores).set_index(["layer", "head"])["role"].to_dict()
    assert roles == {(0, 0): "previous_token;induction", (0, 1): "", (1, 0): "", (1, 1): "self"}
    assert assign_roles(scores, {"self": 0.65}).set_index(["layer", "head"])["role"][(1, 1)] == ""
    with pytest.raises(UserError, match="unknown role"):
        assign_roles(scores, {"copying": 0.5})


def test_bootstrap_pools_positions_and_collapses_for_constant_ratio():
    sums = torch.tensor([[1.0], [3.0], [6.0]])
    counts = torch.tensor([2.0, 2.0, 4.0])
    estimate, low, high = bootstrap_ratio(sums, counts, n_boot=300)
    assert estimate.item() == pytest.approx(10 / 8)
    assert low.item() < 10 / 8 < high.item()
    constant, low, high = bootstrap_ratio(counts[:, None] * 0.25, counts, n_boot=300)
    assert low.item() == pytest.approx(0.25) and high.item() == pytest.approx(0.25)


def test_text_targets_mark_every_earlier_occurrence():
    a, b, bos = 5, 7, 256
    tokens = torch.tensor([[bos, a, b, a, a, bos], [bos, b, b, bos, bos, bos]])
    targets = text_targets(tokens, torch.tensor([5, 3]))
    duplicate = targets.targets["duplicate_token"]
    assert duplicate[0].nonzero().tolist() == [[3, 1], [4, 1], [4, 3]]
    assert duplicate[1].nonzero().tolist() == [[2, 1]]  # padding (positions >= 3) never counts
    assert targets.queries.tolist() == [[False, True, True, True, True, False], [False, True, True, False, False, False]]


def test_same_scores_on_both_backends_any_chunking_and_same_seed(scratch, bridge):
    scratch_scores = classify_heads(scratch, n_prompts=12, seq_len=SEQ_LEN, seed=5, progress=False)
    chunked = classify_heads(scratch, n_prompts=12, seq_len=SEQ_LEN, seed=5, memory_mb=1e-6, progress=False)
    bridge_scores = classify_heads(bridge, n_prompts=12, seq_len=SEQ_LEN, seed=5, progress=False)
    assert len(scratch_scores) == 2 * 4 * 7
    for column in ("score", "ci_low", "ci_high", "chance"):
        assert (scratch_scores[column] - bridge_scores[column]).abs().max() < 1e-4
        assert (scratch_scores[column] - chunked[column]).abs().max() < 1e-6
    again = classify_heads(scratch, n_prompts=12, seq_len=SEQ_LEN, seed=5, progress=False)
    pd.testing.assert_frame_equal(scratch_scores, again)
    other = classify_heads(scratch, n_prompts=12, seq_len=SEQ_LEN, seed=6, progress=False)
    assert not other["score"].equals(scratch_scores["score"])


def test_texts_score_the_roles_text_defines(scratch):
    scores = classify_heads(scratch, texts=["the cat sat on the mat", "a b a b a b"], progress=False)
    assert set(scores["measure"]) == {"previous_token", "duplicate_token", "self", "bos", "entropy", "distance"}
    with pytest.raises(ValueError, match="non-empty"):
        classify_heads(scratch, texts=["fine", ""], progress=False)
    with pytest.raises(ValueError, match="n_ctx"):
        classify_heads(scratch, texts=["x" * 100], progress=False)


def test_head_table_has_one_row_per_head_and_ci_columns(scratch):
    scores = classify_heads(scratch, n_prompts=4, seq_len=SEQ_LEN, progress=False)
    table = head_table(scores)
    assert len(table) == 8 and list(table.columns[:5]) == ["layer", "head", "previous_token",
                                                            "previous_token_ci_low", "previous_token_ci_high"]
    assert list(table.columns[-2:]) == ["role", "partial_role"]


def repeated_strings(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        segment = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 9)))
        prompts.append("".join(rng.choice("ABCDEFG .") for _ in range(rng.randint(0, 5))) + segment + segment + "!")
    return prompts


@pytest.mark.parametrize("options", [
    {},
    {"exclude_bos": True},
    {"exclude_bos": True, "exclude_current_token": True},
    {"error_measure": "abs"},
    {"error_measure": "abs", "exclude_bos": True, "exclude_current_token": True},
])
def test_compat_mode_reproduces_detect_head_on_bridge_and_scratch(scratch, bridge, options):
    prompts = repeated_strings(5, seed=len(options))
    ours_bridge = detect_heads(bridge, prompts, **options, progress=False)
    ours_scratch = detect_heads(scratch, prompts, **options, progress=False)
    for name in TL_HEAD_NAMES:
        reference = detect_head(bridge, prompts, name, **options)
        assert torch.allclose(ours_bridge[name], reference, atol=1e-5, rtol=0), name
        assert torch.allclose(ours_scratch[name], reference, atol=1e-5, rtol=0), name
    single = detect_heads(bridge, prompts[0], ["induction_head"], **options, progress=False)["induction_head"]
    assert torch.allclose(single, detect_head(bridge, prompts[0], "induction_head", **options), atol=1e-5, rtol=0)


def test_compat_mode_rejects_bad_input(bridge):
    with pytest.raises(UserError, match="unknown detection pattern"):
        detect_heads(bridge, ["ab ab"], ["copy_head"])
    with pytest.raises(ValueError, match="error_measure"):
        detect_heads(bridge, ["ab ab"], error_measure="sq")


def naive_aligned_mean(z: torch.Tensor, places: torch.Tensor) -> torch.Tensor:
    """z (batch, pos, d) -> each prompt and position's mean over the other prompts' positions at the
    same place, else over the other prompts at the same position (loops, as written in the docs)."""
    out = torch.empty_like(z)
    for b in range(z.shape[0]):
        for p in range(z.shape[1]):
            same = [z[o, q] for o in range(z.shape[0]) if o != b for q in range(z.shape[1]) if places[o, q] == places[b, p]]
            out[b, p] = torch.stack(same or [z[o, p] for o in range(z.shape[0]) if o != b]).mean(0)
    return out


@torch.no_grad()
def test_batched_ablation_matches_one_head_at_a_time(scratch, bridge):
    """The causal check (position-aligned mean ablation by default) against a hand loop: one head
    at a time, its output replaced by the mean over the other probes at the same place."""
    probes = probes_for(scratch, 6, seq_len=32, seed=2)
    effects = ablation_effects(scratch, probes, memory_mb=1e-3, progress=False)  # one ablation per forward
    grouped = ablation_effects(scratch, probes, progress=False)  # all heads x prompts in one forward
    assert (grouped["ablation_effect"] - effects["ablation_effect"]).abs().max() < 1e-5
    mask = probes.predictable[:, 1:]
    clean = scratch(probes.tokens, return_type="loss", loss_per_token=True)[mask].mean()
    _, cache = scratch.run_with_cache(probes.tokens, names_filter=lambda name: name.endswith("hook_z"))
    for layer in range(2):
        for head in range(4):
            name = f"blocks.{layer}.attn.hook_z"
            mean = naive_aligned_mean(cache[name][:, :, head], probes.places)

            def ablate(z, hook, head=head, mean=mean):
                z = z.clone()
                z[:, :, head] = mean
                return z

            loss = scratch.run_with_hooks(probes.tokens, return_type="loss", loss_per_token=True,
                                          fwd_hooks=[(name, ablate)])[mask].mean()
            row = effects[(effects["layer"] == layer) & (effects["head"] == head)]
            assert float(row["ablation_effect"].iloc[0]) == pytest.approx(float(loss - clean), abs=1e-5)
    on_bridge = ablation_effects(bridge, probes, progress=False)
    assert (on_bridge["ablation_effect"] - effects["ablation_effect"]).abs().max() < 1e-4


def digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.cpu().long().numpy().tobytes()).hexdigest()


# The probes and their corrupted side as drawn before probes came from ordinary tokens only:
# on byte-level models the ordinary ids are all ids but the start token, so nothing moved.
PINNED_PROBES = {
    "tokens": "a1c454ad006e77db2d8b094fb7c493bf5eda8aefd84b0632c417a11519efd217",
    "corrupted": "eefb05328cb5f707c87ef52bb3696b903d80c8aedc7b4a138bcc9a5c6735bd42",
    "period": "cc1880d8fd53697e556c281b6dd0cf7a35a2cb6d8f37ee1621306779e7b6a957",
    "segment_start": "15cf304534f8f989e2b3a5dd63f95b7ae3f437a50de0a907967080a103163887",
}


@pytest.mark.parametrize("which", ["toy", "gpt2"])
def test_probes_of_byte_level_models_are_unchanged(which, scratch):
    model = load_model("toy") if which == "toy" else scratch
    assert start_token_id(model) == 256
    assert ordinary_token_ids(model) == [t for t in range(model.cfg.d_vocab) if t != 256]
    probes = probes_for(model, 16, 64, seed=7)
    drawn = {"tokens": probes.tokens, "corrupted": corrupt_first_copy(probes, seed=8), "period": probes.period,
             "segment_start": probes.segment_start}
    assert {name: digest(tensor) for name, tensor in drawn.items()} == PINNED_PROBES


# The start token each family's sequences begin with: its BOS, which its tokenizer adds; None: none
# (Qwen2 has no BOS, and its family begins texts without a start token, as its tokenizer does).
START_TOKENS = {"gpt2": 256, "phi": 256, "gpt_neo": 256, "llama": 1, "mistral": 1, "gemma": 2, "gemma2": 2,
                "gemma3_text": 2, "opt": 2, "gpt_neox": 0, "qwen2": None}


@pytest.mark.parametrize("family", FAMILIES)
def test_probes_use_only_ordinary_tokens_on_every_family(family, family_dir):
    """Start token first, then only ordinary tokens: never a special or added token, never an id
    of the padded vocabulary beyond the tokenizer (the models' vocab is 320, the tokenizers' ~260)."""
    from transformers import AutoTokenizer

    model = load_model(family_dir(family))
    hf = AutoTokenizer.from_pretrained(family_dir(family))
    ordinary = set(range(len(hf))) - set(hf.all_special_ids) - set(hf.get_added_vocab().values())
    assert model.cfg.d_vocab > len(hf) and len(ordinary) == 256
    probes = probes_for(model, 8, 32, seed=0)
    corrupted = corrupt_first_copy(probes, seed=1)
    start = [] if START_TOKENS[family] is None else [START_TOKENS[family]]
    for tokens in (probes.tokens, corrupted):
        assert all(row[:len(start)] == start for row in tokens.tolist())
        assert set(tokens[:, len(start):].flatten().tolist()) <= ordinary
    assert not torch.equal(probes.tokens, corrupted)


def test_classify_takes_probes_made_once(scratch):
    probes = probes_for(scratch, 6, SEQ_LEN, seed=3)
    given = classify_heads(scratch, probes=probes, seed=3, n_boot=50, progress=False)
    drawn = classify_heads(scratch, 6, SEQ_LEN, seed=3, n_boot=50, progress=False)
    pd.testing.assert_frame_equal(given, drawn)
    with pytest.raises(UserError, match="probes or texts"):
        classify_heads(scratch, probes=probes, texts=["a b"], progress=False)


@pytest.mark.parametrize("fixture", ["scratch", "bridge"])
def test_classification_computes_no_logits(request, fixture, monkeypatch):
    """Classification reads patterns only: its forwards stop before the unembedding on both
    backends (the bridge computes logits even with return_type=None), so a chunk's memory
    never holds logits of a large vocabulary."""
    model = request.getfixturevalue(fixture)
    unembedded = []
    if fixture == "scratch":
        original = model.unembed
        monkeypatch.setattr(model, "unembed", lambda resid: unembedded.append(1) or original(resid))
        context = model.hooks(fwd_hooks=[])
    else:
        context = model.hooks(fwd_hooks=[("unembed.hook_out", lambda out, hook: unembedded.append(1))])
    with context:
        classify_heads(model, 4, SEQ_LEN, n_boot=10, progress=False)
        classify_heads(model, texts=["the cat sat on the mat", "a b"], n_boot=10, progress=False)
        detect_heads(model, ["ab ab", "xyz xyz"], progress=False)
    assert unembedded == []


def test_texts_of_unequal_length_are_padded_with_the_start_token(bridge):
    batch = encode(bridge, ["a b c d", "a"])
    assert batch.tokens.shape == (2, 8) and batch.lengths.tolist() == [8, 2]
    assert (batch.tokens[1, 2:] == start_token_id(bridge)).all() and batch.tokens.device == model_device(bridge)
