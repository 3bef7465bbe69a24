"""The budgets the controller may set: multiples of `quantum`, coarser as budgets grow.

p5 moves about evenly per doubling of the budget, so a fixed step would be needlessly fine at 16K
(where 256 tokens move p5 by ~0.001) and coarse at 512. Within each octave [2^k, 2^(k+1)) the step is
2^k / steps_per_doubling, but never below `quantum`: with 256 and 8, steps of 256 up to 4096, then
512 up to 8192, 1024 up to 16384, and so on, much like the published presets. Every grid value is a
multiple of `quantum` (itself a multiple of the page), so page alignment holds.
"""

from __future__ import annotations

import math


class BudgetGrid:
    """Rounding onto the grid and moving along it."""

    def __init__(self, quantum: int, steps_per_doubling: int) -> None:
        if quantum <= 0 or steps_per_doubling <= 0:
            raise ValueError("quantum and steps_per_doubling must be positive")
        self.quantum = quantum
        self.steps_per_doubling = steps_per_doubling

    def step_at(self, budget: float) -> int:
        """The grid step in the octave holding `budget`."""
        octave = 2 ** math.floor(math.log2(max(budget, 1)))
        return max(self.quantum, octave // self.steps_per_doubling)

    def up(self, budget: float) -> int:
        """The smallest grid value >= `budget` (rounding up: the safe side of the target)."""
        step = self.step_at(budget)
        return int(math.ceil(budget / step - 1e-9)) * step

    def next_above(self, budget: float) -> int:
        """The smallest grid value > `budget`."""
        return self.up(math.floor(budget) + 1)

    def contains(self, budget: int) -> bool:
        """True when `budget` is a grid value."""
        return self.up(budget) == budget

    def index(self, budget: int) -> int:
        """Position of grid value `budget` counted from `quantum` (for 'within one step' comparisons)."""
        n, b = 0, self.quantum
        while b < budget:
            b, n = self.next_above(b), n + 1
        return n
