"""The execution context: set at an entry point, read below it, restored on exit."""

import ast
from pathlib import Path

import pytest

from analyses.core.budget import DEFAULT_MEMORY_MB
from analyses.core.execution import Execution, current, executing
from interp.errors import UserError


def test_outside_every_block_the_default():
    assert current() == Execution(DEFAULT_MEMORY_MB, None)


def test_nested_blocks_set_what_they_name_and_restore_on_exit():
    with executing(memory_mb=256, progress=False) as outer:
        assert outer == current() == Execution(256, False)
        with executing(memory_mb=64):  # progress left as it is
            assert current() == Execution(64, False)
        with executing(progress=None):  # None changes nothing
            assert current() == outer
        assert current() == outer
    assert current() == Execution()


def test_restored_after_an_error():
    with pytest.raises(RuntimeError):
        with executing(memory_mb=8):
            raise RuntimeError
    assert current() == Execution()


@pytest.mark.parametrize("memory_mb", [0, -1, True, "512"])
def test_a_budget_not_above_zero_is_refused_in_one_line(memory_mb):
    with pytest.raises(UserError, match=r"^memory_mb=.* must be a number of MB above 0$"):
        with executing(memory_mb=memory_mb):
            pass


@pytest.fixture(scope="module")
def toy():
    from interp import load_model

    return load_model("toy").eval()


@pytest.fixture
def chunked(monkeypatch):
    """[(budget, number of chunks)] of every ``variant_chunks`` the engine makes while the test runs."""
    from analyses.interventions import engine

    seen, made = [], engine.variant_chunks

    def spy(model, tokens, variants, memory_mb, **options):
        chunks = made(model, tokens, variants, memory_mb, **options)
        seen.append((memory_mb, len(chunks)))
        return chunks

    monkeypatch.setattr(engine, "variant_chunks", spy)
    return seen


def test_an_entry_points_budget_reaches_the_sweep_below_it(toy, chunked):
    """ablation_sweep's memory_mb is what the engine chunks by two calls down (Ablation.scores ->
    score_variants), none passing it: at a budget under one row per forward, 2 ablations (of one
    layer: their runs start there alike) of 4 prompts take 2 x 4 forwards; at the default, one."""
    from analyses import ablation_sweep, loss_metric, probes_for

    probes = probes_for(toy, 4, 16, seed=0)
    metric = loss_metric(probes.tokens, probes.predictable)
    targets = [[(1, 2)], [(1, 3)]]
    ablation_sweep(toy, probes, targets, "zero", metric, memory_mb=1e-3, progress=False)
    ablation_sweep(toy, probes, targets, "zero", metric, progress=False)
    assert chunked == [(1e-3, 2 * 4), (DEFAULT_MEMORY_MB, 1)]


def test_a_step_on_a_share_of_the_budget_says_so_with_executing(toy, chunked):
    """direct_and_total_effects reads its heads' direct effects off the final residual in chunks of
    a quarter of its budget (the readouts keep the rest), its total effects in the whole budget."""
    from analyses import direct_and_total_effects, loss_metric, probes_for

    probes = probes_for(toy, 4, 16, seed=0)
    metric = loss_metric(probes.tokens, probes.predictable)
    direct_and_total_effects(toy, probes, [(0, 1)], "zero", metric, memory_mb=512, progress=False)
    assert [budget for budget, _ in chunked] == [512 / 4, 512]


# The settings reach the code below an entry point through the execution, not through parameters
# that only hand them on (architecture §4.0). What may still hand them on: edge_circuit's two
# wrappers of its public ``circuit_scores`` (a user's keywords passed to a sibling entry point whose
# progress defaults to none), and a Ray actor's budget to its cells (a context variable does not
# cross into another process).
HANDED_ON = {"analyses/circuits/edge_circuit.py:circuit_values", "analyses/circuits/edge_circuit.py:faithfulness_curve",
             "analyses/studies/on_ray.py:__init__"}


def handed_on(function: ast.FunctionDef, setting: str) -> set[str]:
    """The callees (other than ``executing``) ``function`` passes its parameter ``setting`` to, where
    handing it on as a keyword is all it does with it; empty otherwise."""
    uses = [n for n in ast.walk(function) if isinstance(n, ast.Name) and n.id == setting]
    callees = [call.func.id if isinstance(call.func, ast.Name) else getattr(call.func, "attr", "?")
               for call in ast.walk(function) if isinstance(call, ast.Call)
               for keyword in call.keywords if isinstance(keyword.value, ast.Name) and keyword.value.id == setting]
    return set(callees) - {"executing"} if uses and len(uses) == len(callees) else set()


def test_no_function_takes_the_budget_or_progress_only_to_hand_it_on():
    root = Path(__file__).resolve().parents[1]
    found = set()
    for path in sorted((root / "analyses").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef):
                parameters = {a.arg for a in node.args.args + node.args.kwonlyargs}
                for setting in ("memory_mb", "progress"):
                    if setting in parameters and handed_on(node, setting):
                        found.add(f"{path.relative_to(root).as_posix()}:{node.name}")
    assert found == HANDED_ON, f"handed on beyond the execution: {sorted(found - HANDED_ON)}; gone: {sorted(HANDED_ON - found)}"
