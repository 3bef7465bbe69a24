"""A bin's p5-vs-budget curve, learned from observations by a monotone (isotonic) fit.

More budget never makes the sparse actor farther from the dense policy, so p5 is taken as
non-decreasing in the budget; noisy readings that break that order are pooled (pool adjacent
violators, weighted by tokens). Between fitted points the curve is linear in log2(budget), the
scale on which p5 moves about evenly (the published presets gain ~0.06-0.08 of p5 per doubling).
Outside them it is extrapolated with a slope, the bin's own secant where it has one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Point:
    """One observation: p5 read at `budget`, over `weight` tokens, at time `time` (seconds).

    `readings` counts the readings merged into it (the memory averages repeated readings at a budget).
    """

    budget: int
    p5: float
    weight: float
    time: float
    readings: int = 1


def isotonic_fit(points: list[tuple[float, float, float]]) -> list[tuple[float, float]]:
    """Weighted non-decreasing least-squares fit of (x, y, weight) points; returns (x, fitted y) per distinct x.

    Points with one x are merged first (weighted mean); then pool adjacent violators: walking up in
    x, a block whose mean is below its predecessor's merges with it until the means are ordered.
    """
    merged: dict[float, list[float]] = {}
    for x, y, w in points:
        if w <= 0 or not math.isfinite(y):
            continue
        acc = merged.setdefault(x, [0.0, 0.0])
        acc[0] += y * w
        acc[1] += w
    xs = sorted(merged)
    # Blocks as [sum of y*w, sum of w, count of x values], merged from the right end backwards.
    blocks: list[list[float]] = []
    for x in xs:
        blocks.append([merged[x][0], merged[x][1], 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            yw, w, n = blocks.pop()
            blocks[-1][0] += yw
            blocks[-1][1] += w
            blocks[-1][2] += n
    fitted: list[tuple[float, float]] = []
    i = 0
    for yw, w, n in blocks:
        for _ in range(int(n)):
            fitted.append((xs[i], yw / w))
            i += 1
    return fitted


class Curve:
    """The fitted curve of one bin, with the slopes used beyond its points."""

    def __init__(self, fitted: list[tuple[float, float]], prior_slope: float, min_slope: float) -> None:
        self.budgets = [x for x, _ in fitted]
        self.points = [(math.log2(x), y) for x, y in fitted]
        self.prior_slope = prior_slope
        self.min_slope = min_slope

    @classmethod
    def from_points(cls, points: list[Point], prior_slope: float, min_slope: float) -> Curve:
        """Fit `points` (isotonic) and wrap the result."""
        fitted = isotonic_fit([(p.budget, p.p5, p.weight) for p in points])
        return cls(fitted, prior_slope, min_slope)

    @property
    def empty(self) -> bool:
        """True when no observation backs the curve."""
        return not self.points

    def _slope(self, a: int, b: int) -> float:
        (xa, ya), (xb, yb) = self.points[a], self.points[b]
        return max((yb - ya) / (xb - xa), self.min_slope)

    def _upper_slope(self) -> float:
        # The secant of the two highest distinct fitted values: the local slope above the data.
        n = len(self.points)
        for a in range(n - 2, -1, -1):
            if self.points[a][1] < self.points[-1][1]:
                return self._slope(a, n - 1)
        return self.prior_slope

    def predict(self, budget: float) -> float:
        """Fitted p5 at `budget` (interpolated in log2 budget; extrapolated beyond the points)."""
        if self.empty:
            raise ValueError("no observations")
        x = math.log2(budget)
        pts = self.points
        if x <= pts[0][0]:
            return pts[0][1] - self.prior_slope * (pts[0][0] - x)
        if x >= pts[-1][0]:
            return pts[-1][1] + self._upper_slope() * (x - pts[-1][0])
        for (x0, y0), (x1, y1) in zip(pts, pts[1:], strict=False):
            if x0 <= x <= x1:
                return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
        raise AssertionError("unreachable: x lies inside the fitted range")

    def cheapest(self, target: float) -> tuple[float, bool]:
        """The smallest budget predicted to hold p5 >= `target`, and whether the data brackets it.

        Bracketed means a fitted point below the target sits at a lower budget than a fitted point at
        or above it, so the answer is an interpolation; otherwise it is an extrapolation.
        """
        if self.empty:
            raise ValueError("no observations")
        pts = self.points
        above = [i for i, (_, y) in enumerate(pts) if y >= target]
        if not above:
            x, y = pts[-1]
            return 2 ** (x + (target - y) / self._upper_slope()), False
        k = above[0]
        if k == 0:
            x, y = pts[0]
            # Below the data only the prior is known: the slope measured higher up says little there.
            return 2 ** (x - (y - target) / self.prior_slope), False
        (x0, y0), (x1, y1) = pts[k - 1], pts[k]
        return 2 ** (x0 + (target - y0) / (y1 - y0) * (x1 - x0)), True

    def lowest_holding(self, target: float) -> float | None:
        """The smallest observed budget whose fitted p5 holds `target` (None when none does)."""
        return next((b for b, (_, y) in zip(self.budgets, self.points, strict=True) if y >= target), None)

    def failing_below(self, budget: float, threshold: float) -> list[tuple[float, float]]:
        """(budget, fitted p5) of observed budgets under `budget` with fitted p5 below `threshold`, highest first."""
        pairs = zip(self.budgets, self.points, strict=True)
        return sorted(((b, y) for b, (_, y) in pairs if b < budget and y < threshold), reverse=True)

    def has_point_below(self, budget: float, target: float) -> bool:
        """True when a fitted point under `target` lies at a budget below `budget`."""
        x = math.log2(budget)
        return any(px < x and py < target for px, py in self.points)
