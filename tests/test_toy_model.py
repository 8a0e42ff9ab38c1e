"""The shipped "toy" model: it loads offline, and its head roles are real (issue 3 targets).

Scores are computed here from the architecture §4.1 probes and raw attention patterns, independently of
``interp.train``'s own evaluation: a score is the mean attention from each query position to the
role's target position, over the query positions where the role is defined.
"""

from __future__ import annotations

import json
import platform

import pytest
import torch

from analyses.core.probes import probes_for
from interp import GPTModel, load_model
from interp.loading import toy_checkpoint_dir
from interp.train import PRESETS, TRIED, load_corpus

ROLE_THRESHOLD = 0.7  # the target for a previous-token and an induction head
ABLATION_TARGET = 1.0  # nats added to the predictable-token loss by ablating the induction heads


@pytest.fixture(scope="module")
def toy() -> GPTModel:
    return load_model("toy")


@pytest.fixture(scope="module")
def probes(toy):
    return probes_for(toy, n_prompts=64, seed=1234)


@pytest.fixture(scope="module")
def scores(toy, probes) -> dict[str, torch.Tensor]:
    """Role -> (n_layers, n_heads) scores on the probes."""
    _, cache = toy.run_with_cache(probes.tokens, names_filter=lambda name: name.endswith("hook_pattern"))
    pattern = torch.stack([cache["pattern", layer] for layer in range(toy.cfg.n_layers)])  # (L, b, H, q, k)
    positions = torch.arange(probes.seq_len).expand(probes.n_prompts, -1)
    earlier = probes.earlier_occurrence
    return {
        "previous_token": _mean_attention(pattern, positions - 1, positions >= 1),
        "duplicate_token": _mean_attention(pattern, earlier, probes.second_copy),
        "induction": _mean_attention(pattern, earlier + 1, probes.second_copy),
    }


def _mean_attention(pattern: torch.Tensor, target: torch.Tensor, defined: torch.Tensor) -> torch.Tensor:
    """pattern (L, b, H, q, k); target (b, q) key position per query; defined (b, q) bool
    -> (L, H) mean of pattern[l, b, h, q, target[b, q]] over the defined (b, q)."""
    index = target.clamp(min=0)[None, :, None, :, None].expand(*pattern.shape[:-1], 1)
    to_target = pattern.gather(-1, index)[..., 0]  # (L, b, H, q)
    mask = defined[None, :, None, :].float()
    return (to_target * mask).sum(dim=(1, 3)) / mask.sum(dim=(1, 3))


def _heads(score: torch.Tensor, threshold: float) -> list[tuple[int, int]]:
    return [tuple(index) for index in (score >= threshold).nonzero().tolist()]


def _loss_on(model, probes, positions: torch.Tensor, ablate: list[tuple[int, int]] = ()) -> float:
    """Mean next-token loss on the tokens at ``positions`` (batch, pos) bool, with the given heads'
    hook_z slices zeroed."""

    def zero_head(head):
        def hook(z, hook):
            z[:, :, head] = 0.0
            return z
        return hook

    hooks = [(f"blocks.{layer}.attn.hook_z", zero_head(head)) for layer, head in ablate]
    with torch.no_grad():
        loss = model.run_with_hooks(probes.tokens, return_type="loss", loss_per_token=True, fwd_hooks=hooks)
    return float(loss[positions[:, 1:]].mean())


def _before_the_repeat(probes) -> torch.Tensor:
    """(batch, pos) bool: tokens after BOS and before the second copy (random: nothing predicts them)."""
    pos = torch.arange(probes.seq_len)[None]
    return (pos >= 1) & (pos < (probes.segment_start + probes.period)[:, None])


def test_loads_offline_from_package_data_and_by_path(toy):
    directory = toy_checkpoint_dir()
    config = json.loads((directory / "config.json").read_text())
    assert isinstance(toy, GPTModel) and not toy.training
    assert toy.cfg.n_layers == config["config"]["n_layers"] and toy.cfg.d_vocab == 257
    again = load_model(directory)
    for name, tensor in toy.state_dict().items():
        assert torch.equal(tensor, again.state_dict()[name]), name
    assert sum(f.stat().st_size for f in directory.iterdir()) <= 5 * 1024 * 1024


def test_training_metadata_is_what_interp_train_reproduces():
    """`interp train` (the 'full' preset) reruns exactly the recipe recorded with the shipped model;
    on the same Python, on the same stdlib bytes."""
    training = json.loads((toy_checkpoint_dir() / "training.json").read_text())
    assert training["recipe"] == PRESETS["full"].record() and training["tried"] == list(TRIED)
    assert training["history"][-1] == training["final"] and training["final"]["step"] == PRESETS["full"].steps
    assert training["final"]["text_loss"] < 2.5 and training["final"]["repeat_loss"] < 0.5
    if training["data"]["python"] == platform.python_version():
        assert load_corpus()[2] == training["data"]


def test_pickle_checkpoints_are_refused(tmp_path):
    for name in ("model.pt", "model.pth", "pytorch_model.bin", "weights.pkl"):
        (tmp_path / name).write_bytes(b"not a pickle")
        with pytest.raises(ValueError, match="pickle"):
            load_model(tmp_path / name)


def test_generation_copies_a_random_string_seen_in_context(toy):
    text = "Kq7#Zp2w Kq7"
    assert toy.to_string(toy.generate(text, max_new_tokens=5)[0]) == text + "#Zp2w"


def test_has_a_previous_token_head(scores):
    assert scores["previous_token"].max() >= ROLE_THRESHOLD, scores["previous_token"]


def test_has_an_induction_head(scores):
    assert scores["induction"].max() >= ROLE_THRESHOLD, scores["induction"]


def test_ablating_the_induction_heads_costs_at_least_one_nat(toy, probes, scores):
    induction_heads = _heads(scores["induction"], ROLE_THRESHOLD)
    clean = _loss_on(toy, probes, probes.predictable)
    ablated = _loss_on(toy, probes, probes.predictable, induction_heads)
    assert ablated - clean >= ABLATION_TARGET, (clean, ablated, induction_heads)


def test_without_its_induction_heads_the_repeat_no_longer_helps(toy, probes, scores):
    """Ablated, the model predicts the repeated tokens no better than the random ones before them:
    the induction heads carry the whole in-context advantage."""
    induction_heads = _heads(scores["induction"], ROLE_THRESHOLD)
    random_tokens = _loss_on(toy, probes, _before_the_repeat(probes))
    assert _loss_on(toy, probes, probes.predictable) < random_tokens - 4.0
    assert _loss_on(toy, probes, probes.predictable, induction_heads) > random_tokens - 0.5


def test_previous_token_heads_feed_the_induction_heads(toy, probes, scores):
    """Confirm the previous-token role by ablation: the repeated tokens lose their advantage
    (induction needs to know what preceded each key), the random tokens do not change."""
    previous_heads = _heads(scores["previous_token"], ROLE_THRESHOLD)
    predictable = _loss_on(toy, probes, probes.predictable)
    assert _loss_on(toy, probes, probes.predictable, previous_heads) - predictable >= ABLATION_TARGET
    before = _before_the_repeat(probes)
    assert abs(_loss_on(toy, probes, before, previous_heads) - _loss_on(toy, probes, before)) < 0.1


def test_no_duplicate_token_head_formed(scores):
    """Documented finding: two attention-only layers need no duplicate-token head for induction
    (the previous-token head supplies the key side), and none formed; chance level is ~0.03."""
    assert scores["duplicate_token"].max() < 0.1
