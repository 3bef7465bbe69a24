"""What the controller remembers of one bin: a running mean of p5 per budget it has observed.

Readings at one budget are averaged (the newest keeps at least 1/`average_readings` of the weight),
which smooths the noise of a per-step p5. The policy and the adapter drift, so the memory follows:
when the current budget's mean moves, every other budget's point moves by as much (the curve is
assumed to shift as a whole), and a reading that breaks monotonicity against the fit by more than
`reset_delta`, twice in a row, wipes what came before it. The first readings after the bin comes to
a budget mostly correct that budget's own old estimate (one reading, or a mean shifted while the bin
was elsewhere), so they pass on only a part of their move, growing with the readings of this visit
to the whole after `average_readings`. Passed on whole, those corrections hand every budget's
estimation error to every other: in simulation a point ended 0.1 off its true level after a few
visits back and forth. Passed on not at all, a curve that drifts while the bin hops between budgets
never moves its other points, and raises come too small.

One step's p5 scatters around its budget's mean (a few thousand correlated tokens per reading), so
the memory also learns that scatter: the spread of each repeated reading around the mean it joins
(an RMS, exponentially weighted once it has 1/NOISE_WEIGHT deviations). A reading counts as
revealing a moved curve only beyond `RESET_SIGMAS` of that scatter as well as beyond
`reset_delta`; within it, it is noise to be averaged, and wiping the memory on it would throw away
the curve the averaging has built. The scatter is a property of the measurement, not of the
curve, so it outlives a reset.
"""

from __future__ import annotations

import math

from services.controller.curve import Curve, Point

MAX_POINTS = 64  # distinct budgets per bin; the least recently observed go first
RESET_SIGMAS = 4.0  # a reading further than this many scatters from the fit means the curve moved
NOISE_WEIGHT = 0.05  # least weight of the newest squared deviation in the scatter estimate (plain mean before)


class BinMemory:
    """Points (budget -> mean p5, weight, last time) of one bin and the curve fitted through them."""

    def __init__(self, average_readings: int, reset_delta: float, memory_s: float) -> None:
        self.average_readings = average_readings
        self.reset_delta = reset_delta
        self.memory_s = memory_s
        self.points: list[Point] = []
        self._noise_var: float | None = None  # mean squared deviation of a reading from its budget's mean
        self._noise_n = 0
        self._visit: tuple[int, int] | None = None  # (budget, consecutive own readings there)
        self._far_before = False  # the bin's last reading lay beyond the reset threshold from the fit

    @property
    def noise(self) -> float | None:
        """The learned scatter (RMS) of one reading around its budget's mean; None before a repeat."""
        return None if self._noise_var is None else math.sqrt(self._noise_var)

    def reset_threshold(self) -> float:
        """How far from the fitted curve a reading must fall to mean that the curve moved."""
        noise = self.noise
        return self.reset_delta if noise is None else max(self.reset_delta, RESET_SIGMAS * noise)

    def add(self, point: Point, now: float, prior_slope: float, min_slope: float, probe: bool = False) -> bool:
        """Take one reading; returns True when it revealed that the curve moved (older points dropped).

        A probe's reading (a share of the sequences, at a budget the bin does not run) only joins the
        fit at its own budget, however far from it it lies: it neither wipes nor shifts the other
        points, and says nothing of the scatter of the bin's own readings.
        """
        kept = [p for p in self.points if now - p.time <= self.memory_s]
        visit = 0
        if not probe:
            visit = self._visit[1] + 1 if self._visit is not None and self._visit[0] == point.budget else 1
            self._visit = (point.budget, visit)
        same = next((p for p in kept if p.budget == point.budget), None)
        threshold = self.reset_threshold()
        # The scatter is learned before the reset test, from every reading (otherwise one wider than
        # reset_delta is never learned), but a deviation counts at most up to the reset threshold: an
        # outlier or a moved curve is not scatter, and one such reading would otherwise widen the
        # threshold past the next far reading, so that the curve never resets.
        if same is not None and not probe:
            self._noise_n += 1
            w = max(NOISE_WEIGHT, 1 / self._noise_n)
            deviation = min(abs(point.p5 - same.p5), threshold)
            self._noise_var = (1 - w) * (self._noise_var or 0.0) + w * deviation**2
        reset = False
        if kept and not probe:
            fitted = Curve.from_points(kept, prior_slope, min_slope).points
            x, d = math.log2(point.budget), threshold
            far = any((px <= x and py > point.p5 + d) or (px >= x and py < point.p5 - d) for px, py in fitted)
            # One far reading may be an outlier (a step's p5 has heavier tails than a normal law: the
            # cluster showed a 4-scatter dip that wiped a settled bin and doubled its budget); a moved
            # curve reads far again. The first is averaged in like any reading.
            if far and self._far_before:
                kept, same, reset = [], None, True
            self._far_before = far and not reset
        if same is not None:
            old_weight = min(same.weight, (self.average_readings - 1) * point.weight)
            mean = (same.p5 * old_weight + point.p5 * point.weight) / (old_weight + point.weight)
            # A probe's few sequences do not move the curve; a mean this visit has not yet renewed moves
            # it only in part (its first readings mostly correct that budget's own old estimate).
            shift = 0.0 if probe else (mean - same.p5) * min(1.0, (visit - 1) / self.average_readings)
            kept = [Point(p.budget, p.p5 + shift, p.weight, p.time, p.readings) for p in kept if p is not same]
            point = Point(point.budget, mean, old_weight + point.weight, point.time, same.readings + point.readings)
        self.points = sorted(kept + [point], key=lambda p: p.time)[-MAX_POINTS:]
        return reset

    def mean(self, budget: int) -> float | None:
        """The running mean of p5 at `budget` (None when never observed)."""
        return next((p.p5 for p in self.points if p.budget == budget), None)

    def standard_error(self, budget: int) -> float | None:
        """How far the mean at `budget` may be from the level it estimates: scatter / sqrt(readings).

        None when the budget was never observed or no scatter has been learned yet (no evidence of
        doubt: the mean is taken as it stands). The count is not capped at `average_readings`, so a
        budget read again and again is, in the end, judged by its mean.
        """
        point = next((p for p in self.points if p.budget == budget), None)
        noise = self.noise
        if point is None or noise is None:
            return None
        return noise / math.sqrt(point.readings)

    def curve(self, prior_slope: float, min_slope: float) -> Curve:
        """The isotonic fit through the points."""
        return Curve.from_points(self.points, prior_slope, min_slope)
