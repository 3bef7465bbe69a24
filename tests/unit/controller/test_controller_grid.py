"""The budget grid: fine steps at small budgets, coarser per octave, always page-aligned."""

import pytest

from services.controller.grid import BudgetGrid


def test_grid_steps_per_octave():
    grid = BudgetGrid(256, 8)
    values, b = [], 256
    while b < 16384:
        values.append(b)
        b = grid.next_above(b)
    assert values[:16] == list(range(256, 4097, 256))
    assert values[15:24] == [4096, 4608, 5120, 5632, 6144, 6656, 7168, 7680, 8192]
    assert values[24:26] == [9216, 10240]
    assert all(v % 16 == 0 for v in values)


@pytest.mark.parametrize(("x", "up"), [(1, 256), (256, 256), (257, 512), (4095.5, 4096), (4097, 4608), (6208, 6656)])
def test_up_rounds_to_the_next_grid_value(x, up):
    assert BudgetGrid(256, 8).up(x) == up


def test_contains_and_index():
    grid = BudgetGrid(256, 8)
    assert grid.contains(4608) and not grid.contains(4352)
    assert grid.index(256) == 0 and grid.index(4096) == 15 and grid.index(4608) == 16
    with pytest.raises(ValueError):
        BudgetGrid(0, 8)
