"""``interp train``: the data, the recipe's determinism, and a shortened run in which induction forms."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re

import pytest
import torch

from interp import GPTModel, load_model
from interp.loading import embedded_checkpoints, toy_checkpoint_dir
from interp.errors import UserError
from interp.train import (
    BOS,
    PRESETS,
    EvalSet,
    Recipe,
    Repeats,
    head_scores,
    icl_score,
    evaluate,
    initialise,
    load_corpus,
    main,
    repeat_batch,
    sinusoids,
    stdlib_files,
    text_batch,
    VARIANT_DEFAULTS,
    train,
)

# The shortened recipe must push these past their starting values within its few steps.
SHORT_INDUCTION_BOUND = 0.5  # best head's induction score (0.03 at initialisation)
SHORT_ICL_BOUND = -0.3  # late minus early held-out loss, nats (about -0.05 at initialisation)
TINY = dataclasses.replace(PRESETS["short"], steps=3, batch_size=4, eval_every=2, eval_batch=4)


def _untrained(recipe: Recipe) -> GPTModel:
    torch.manual_seed(0)
    return GPTModel(recipe.model_config()).eval()


@pytest.fixture(scope="module")
def short_run():
    """The 'short' preset trained once: (model, history, metadata)."""
    return train(PRESETS["short"], progress=False)


def test_repeat_batch_repeats_a_segment_with_varied_period_and_offset():
    repeats = repeat_batch(64, 64, 4, torch.Generator().manual_seed(0))
    assert repeats.tokens.shape == (64, 64) and (repeats.tokens[:, 0] == BOS).all()
    assert len(set(repeats.period.tolist())) > 10 and len(set(repeats.start.tolist())) > 10
    assert (repeats.period >= 4).all() and (repeats.start + 2 * repeats.period <= 64).all()  # two copies fit
    for row, period, start in zip(repeats.tokens, repeats.period.tolist(), repeats.start.tolist()):
        assert torch.equal(row[start + period:], row[start:64 - period])  # token i == token i - p from the 2nd copy
        assert not torch.equal(row[start - 1 + period:], row[start - 1:64 - period])  # ...and not before
    assert (repeats.second_copy().sum(dim=1) <= repeats.period).all()  # fewer where random bytes collide
    assert (repeats.predictable().sum(dim=1) == 63 - repeats.start - repeats.period).all()


def test_text_batch_is_stdlib_source_after_bos():
    files = stdlib_files()
    assert files == sorted(files) and all(f.suffix == ".py" for f in files)
    corpus = torch.frombuffer(bytearray(b"def f(x):\n    return x\n" * 10), dtype=torch.uint8)
    tokens = text_batch(corpus, 3, 16, torch.Generator().manual_seed(0))
    assert (tokens[:, 0] == BOS).all() and bytes(tokens[0, 1:].tolist()).decode() in corpus.numpy().tobytes().decode()


def test_icl_score_is_late_minus_early_loss():
    loss = torch.zeros(2, 63)
    loss[:, 8:16] = 3.0
    loss[:, -8:] = 1.0
    assert icl_score(loss) == pytest.approx(-2.0)


def test_head_scores_find_a_hand_made_induction_pattern():
    """A model whose layer-1 head 0 attends exactly to i - p + 1 on the second copy scores 1.0."""
    model = _untrained(PRESETS["short"])
    repeats = repeat_batch(8, 64, 4, torch.Generator().manual_seed(1))

    def induction_pattern(pattern, hook):
        target = torch.zeros_like(pattern[:, 0])
        for b, (p, s) in enumerate(zip(repeats.period.tolist(), repeats.start.tolist())):
            for i in range(pattern.shape[-1]):
                target[b, i, i - p + 1 if s + p <= i < s + 2 * p else 0] = 1.0
        pattern[:, 0] = target
        return pattern

    with model.hooks(fwd_hooks=[("blocks.1.attn.hook_pattern", induction_pattern)]):
        scores = head_scores(model, repeats)
    assert scores["induction"][1, 0] == pytest.approx(1.0)
    assert scores["induction"][0].max() < 0.5


def _colliding_repeats() -> Repeats:
    """Segment 5 6 9 8 from position 2, period 4, under three prefixes: its 9 also in the prefix,
    no collision, and (segment 5 6 5 8) a token repeated inside the segment."""
    rows = [[BOS, 9, 5, 6, 9, 8, 5, 6, 9, 8, 5, 6],
            [BOS, 1, 5, 6, 9, 8, 5, 6, 9, 8, 5, 6],
            [BOS, 1, 5, 6, 5, 8, 5, 6, 5, 8, 5, 6]]
    return Repeats(torch.tensor(rows), period=torch.tensor([4, 4, 4]), start=torch.tensor([2, 2, 2]))


def test_second_copy_keeps_only_tokens_with_a_unique_earlier_occurrence():
    positions = [row.nonzero()[:, 0].tolist() for row in _colliding_repeats().second_copy()]
    assert positions == [[6, 7, 9], [6, 7, 8, 9], [7, 9]]


def test_a_perfect_induction_head_scores_one_where_random_tokens_collide():
    """An induction head attends from i to every key whose previous token equals token i: where the
    token occurs twice before, it rightly splits its attention, so those queries are no measure."""
    model = _untrained(PRESETS["short"])
    repeats = _colliding_repeats()

    def match_previous_token(pattern, hook):
        target = torch.zeros_like(pattern[:, 0])
        for b, row in enumerate(repeats.tokens.tolist()):
            for i, token in enumerate(row):
                keys = [j for j in range(1, i + 1) if row[j - 1] == token] or [0]
                target[b, i, keys] = 1.0 / len(keys)
        pattern[:, 0] = target
        return pattern

    with model.hooks(fwd_hooks=[("blocks.1.attn.hook_pattern", match_previous_token)]):
        scores = head_scores(model, repeats)
    assert scores["induction"][1, 0] == pytest.approx(1.0)


@pytest.mark.parametrize("field, value", [("steps", 0), ("batch_size", -1), ("synthetic_fraction", 1.5), ("min_period", 1)])
def test_bad_recipe_values_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(Recipe(), **{field: value})


@pytest.mark.parametrize("field, value, message", [
    ("positions", "sinusoidal", "positions='sinusoidal' not supported; allowed: learned, rotary, alibi"),
    ("kv_heads", 3, "kv_heads=3 must be a positive divisor of n_heads=8"),
    ("kv_heads", 0, "kv_heads=0 must be a positive divisor"),
    ("n_heads", 3, "n_heads=3 must be a positive divisor of d_model=128"),
])
def test_bad_variant_values_are_one_line_user_errors(field, value, message):
    with pytest.raises(UserError, match=re.escape(message)) as error:
        dataclasses.replace(Recipe(), **{field: value})
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("positions, kind", [("learned", "standard"), ("rotary", "rotary"), ("alibi", "alibi")])
def test_variant_fields_map_onto_the_model_config(positions, kind):
    recipe = dataclasses.replace(PRESETS["short"], positions=positions, kv_heads=2)
    config = recipe.model_config()
    assert config.positional_embedding_type == kind and config.n_key_value_heads == 2
    torch.manual_seed(0)
    model = initialise(GPTModel(config))
    assert model.blocks[0].attn.W_key.weight.shape == (2 * config.d_head, config.d_model)  # 2 key/value heads
    if positions == "learned":  # only learned positions exist, and get the sinusoidal start
        assert torch.equal(model.pos_embed.weight, 0.02 * sinusoids(config.n_ctx, config.d_model))
    else:
        assert not hasattr(model, "pos_embed")


def test_the_default_recipe_records_and_configures_as_before_the_variant_fields():
    """The shipped model's training.json and config.json predate ``positions`` and ``kv_heads``:
    at their defaults they are neither recorded nor change the model's config."""
    recipe = PRESETS["full"]
    recorded = recipe.record()
    assert "positions" not in recorded and "kv_heads" not in recorded
    assert recorded == {k: v for k, v in dataclasses.asdict(recipe).items() if k not in VARIANT_DEFAULTS}
    config = recipe.model_config()
    assert config.positional_embedding_type == "standard" and config.n_key_value_heads is None
    variant = dataclasses.replace(recipe, positions="alibi", kv_heads=4).record()
    assert variant == {**recorded, "positions": "alibi", "kv_heads": 4}


def test_training_is_deterministic():
    first, history_a, meta_a = train(TINY, progress=False)
    second, history_b, meta_b = train(TINY, progress=False)
    for name, tensor in first.state_dict().items():
        assert torch.equal(tensor, second.state_dict()[name]), name
    assert history_a == history_b and meta_a["final"] == meta_b["final"]
    different, _, _ = train(dataclasses.replace(TINY, seed=1), progress=False)
    assert not torch.equal(first.embed.weight, different.embed.weight)


def test_variant_training_is_deterministic():
    recipe = dataclasses.replace(TINY, positions="alibi", kv_heads=2)
    first, history_a, _ = train(recipe, progress=False)
    second, history_b, _ = train(recipe, progress=False)
    assert history_a == history_b
    for name, tensor in first.state_dict().items():
        assert torch.equal(tensor, second.state_dict()[name]), name


@pytest.mark.parametrize("fails", [False, True], ids=["returns", "raises"])
def test_training_restores_the_thread_count_and_the_global_rng(monkeypatch, fails):
    if fails:  # raise mid-run: after the seed and the thread count have been set
        monkeypatch.setattr("interp.train.learning_rate", lambda recipe, step: 1 / 0)
    threads = torch.get_num_threads()
    torch.set_num_threads(TINY.threads + 1)
    torch.manual_seed(1234)
    rng = torch.get_rng_state()
    try:
        with pytest.raises(ZeroDivisionError) if fails else contextlib.nullcontext():
            train(TINY, progress=False)
        assert torch.get_num_threads() == TINY.threads + 1
        assert torch.equal(torch.get_rng_state(), rng)
    finally:
        torch.set_num_threads(threads)


def test_command_writes_a_loadable_checkpoint_and_curves(tmp_path, capsys):
    assert main(["train", "--preset", "short", "--steps", "3", "--seed", "5", "--out", str(tmp_path), "--quiet"]) == 0
    model = load_model(tmp_path)
    training = json.loads((tmp_path / "training.json").read_text())
    assert training["recipe"]["steps"] == 3 and training["recipe"]["seed"] == 5
    assert model.cfg.n_ctx == PRESETS["short"].n_ctx
    assert (tmp_path / "training_curve.png").stat().st_size > 1000
    assert (tmp_path / "training_curve.csv").read_text().startswith("step,train_loss")
    assert main(["train", "--steps", "0", "--out", str(tmp_path / "bad")]) == 2
    assert "steps=0" in capsys.readouterr().err


@pytest.mark.parametrize("positions, kv_heads", [("rotary", 2), ("alibi", 1), ("learned", 2)])
def test_command_trains_position_and_key_value_variants(tmp_path, positions, kv_heads):
    """``interp train --positions P --kv-heads K``: the checkpoint loads with its config, the
    recipe is recorded, and the history has the head scores."""
    out = tmp_path / positions
    argv = ["train", "--preset", "short", "--steps", "3", "--positions", positions, "--kv-heads", str(kv_heads),
            "--out", str(out), "--quiet"]
    assert main(argv) == 0
    model = load_model(out)
    assert model.cfg.positional_embedding_type == {"learned": "standard"}.get(positions, positions)
    assert model.cfg.n_key_value_heads == kv_heads and model.cfg.n_heads == PRESETS["short"].n_heads
    training = json.loads((out / "training.json").read_text())
    assert training["recipe"].get("positions", "learned") == positions and training["recipe"]["kv_heads"] == kv_heads
    assert training["recipe"] == dataclasses.replace(PRESETS["short"], steps=3, positions=positions, kv_heads=kv_heads).record()
    history = training["history"]
    assert [row["step"] for row in history] == [0, 3]
    for row in history:
        assert 0.0 <= row["induction_score"] <= 1.0 and 0.0 <= row["previous_token_score"] <= 1.0
    assert torch.isfinite(model(torch.tensor([[BOS, 1, 2, 3, 1, 2, 3]]))).all()


def test_command_refuses_a_bad_variant_in_one_line(tmp_path, capsys):
    for flags, message in [(["--positions", "sinusoid"], "positions='sinusoid' not supported"),
                           (["--kv-heads", "3"], "kv_heads=3 must be a positive divisor of n_heads=4"),
                           (["--heads", "3"], "n_heads=3 must be a positive divisor of d_model=64")]:
        assert main(["train", "--preset", "short", *flags, "--out", str(tmp_path / "bad")]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1
    assert not (tmp_path / "bad").exists()


def test_short_recipe_forms_an_induction_head(short_run):
    _, history, _ = short_run
    first, last = history[0], history[-1]
    assert first["induction_score"] < 0.1 and last["induction_score"] > SHORT_INDUCTION_BOUND
    assert last["repeat_loss"] < first["repeat_loss"] - 2.0  # nats: the repeats became predictable
    assert first["icl_score"] > -0.15 and last["icl_score"] < SHORT_ICL_BOUND


def test_save_every_writes_checkpoints_and_leaves_the_run_unchanged(tmp_path, capsys):
    """``--save-every 2`` over 5 steps: checkpoints after steps 2 and 4, loadable; the final weights
    are those of the same recipe trained without snapshots."""
    assert main(["train", "--preset", "short", "--steps", "5", "--save-every", "2", "--out", str(tmp_path), "--quiet"]) == 0
    saved = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert saved == ["step_000002", "step_000004"]
    plain, _, _ = train(dataclasses.replace(PRESETS["short"], steps=5), progress=False)
    final = load_model(tmp_path)
    step2, step4 = (load_model(tmp_path / "checkpoints" / name) for name in saved)
    for name, tensor in plain.state_dict().items():
        assert torch.equal(final.state_dict()[name], tensor), name
    assert not torch.equal(step2.embed.weight, step4.embed.weight)
    assert not torch.equal(step4.embed.weight, final.embed.weight)
    assert main(["train", "--steps", "2", "--save-every", "0", "--out", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err
    assert "--save-every 0 must be a positive number of steps" in err and err.count("\n") == 1
    assert not (tmp_path / "bad").exists()


def test_the_shipped_early_checkpoint_is_step_200_of_the_recorded_run():
    """Evaluated as the recipe evaluates, the shipped checkpoint gives the embedded model's
    recorded history row of step 200 (before the induction phase change)."""
    early = embedded_checkpoints()[200]
    recipe = PRESETS["full"]
    model = load_model(early)
    assert model.cfg == load_model("toy").cfg
    recorded = json.loads((toy_checkpoint_dir() / "training.json").read_text())["history"]
    [row] = [r for r in recorded if r["step"] == 200]
    held_out = load_corpus()[1]
    measured = evaluate(model, EvalSet.build(recipe, held_out))
    for key, value in measured.items():
        assert value == pytest.approx(row[key], abs=1e-4), key
    assert row["induction_score"] < 0.1


def test_command_trains_any_number_of_heads_at_the_same_width(tmp_path):
    """``interp train --heads H``: H heads of d_model / H, the same parameters in number as the preset's."""
    out = tmp_path / "one-head"
    assert main(["train", "--preset", "short", "--steps", "2", "--heads", "1", "--out", str(out), "--quiet"]) == 0
    model = load_model(out)
    assert (model.cfg.n_heads, model.cfg.d_head) == (1, PRESETS["short"].d_model)
    assert json.loads((out / "training.json").read_text())["recipe"]["n_heads"] == 1
    preset = _untrained(PRESETS["short"])
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in preset.parameters())
