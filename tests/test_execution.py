"""The execution context: set at an entry point, read below it, restored on exit."""

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
