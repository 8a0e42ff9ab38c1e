"""The embedded "code" model: trained by the project's recipe on the pinned standard-library files;
re-running the recipe reproduces the shipped run's first steps, and the shipped checkpoints are
steps of the recorded run."""

import dataclasses
import json

import pytest
import torch

from interp import UserError, load_model
from interp.loading import EMBEDDED, embedded_checkpoints
from interp.train import PRESETS, EvalSet, evaluate, load_corpus, pinned_files, train

CODE = PRESETS["code"]


@pytest.fixture(scope="module")
def training():
    from importlib import resources

    return json.loads((resources.files("interp") / EMBEDDED["code"][0] / "training.json").read_text())


def test_the_code_model_loads_with_the_recipe_shape(training):
    model = load_model("code")
    assert (model.cfg.n_ctx, model.cfg.d_model, model.cfg.n_heads, model.cfg.n_layers) == (128, 128, 4, 2)
    assert model.cfg.model_name == "code" and training["recipe"] == CODE.record()
    assert training["data"]["files"] == 168 and training["recipe"]["synthetic_fraction"] == 0.0


def test_rerunning_the_recipe_reproduces_the_shipped_first_steps(training):
    """Tolerance 1e-4 (same thread count; bitwise on the machine that trained it)."""
    _, history, metadata = train(dataclasses.replace(CODE, steps=100), progress=False)
    assert metadata["data"]["sha256"] == training["data"]["sha256"]
    shipped = {row["step"]: row for row in training["history"]}
    for row in history:
        for key, value in row.items():
            if value is not None:
                assert value == pytest.approx(shipped[row["step"]][key], abs=1e-4), (row["step"], key)


def test_the_shipped_checkpoints_are_steps_of_the_recorded_run(training):
    checkpoints = embedded_checkpoints("code")
    assert sorted(checkpoints) == list(range(1000, CODE.steps + 1, 1000))
    _, held_out, _ = load_corpus(CODE.corpus)
    data = EvalSet.build(CODE, held_out)
    shipped = {row["step"]: row for row in training["history"]}
    for step in (min(checkpoints), max(checkpoints)):
        found = evaluate(load_model(checkpoints[step]), data)
        for key, value in found.items():
            assert value == pytest.approx(shipped[step][key], abs=1e-5), (step, key)
    final = load_model("code")
    last = load_model(checkpoints[CODE.steps])
    assert all(torch.equal(a, b) for a, b in zip(final.state_dict().values(), last.state_dict().values()))


def test_a_missing_or_changed_pinned_file_is_refused_in_one_line(monkeypatch, tmp_path):
    import interp.train

    monkeypatch.setattr(interp.train.sysconfig, "get_paths", lambda: {"stdlib": str(tmp_path)})
    with pytest.raises(UserError, match=r"pinned corpus file .*__future__\.py is missing"):
        pinned_files()
    (tmp_path / "__future__.py").write_text("changed\n")
    with pytest.raises(UserError, match=r"__future__\.py has SHA-256 .* the 'code' recipe needs Python 3\.11\.7"):
        pinned_files()
