"""The controller's decisions: pure logic, no I/O, driven by readings and the clock it is given.

Each tick, for every bin whose reading was produced under its current budget (fresh) and covers
`min_tokens` tokens, the reading joins the bin's memory and the bin's estimate is the running mean
at its budget. Then:
- raise when the estimate is below target (tau + margin) over `raise_min_readings` readings at
  this budget, or at once when a single reading is below tau (unless the bin's learned scatter
  explains that one dip: see `DIP_SIGMAS`): to the cheapest budget the fitted curve predicts to
  hold the target (at least one grid step more, at most `max_step_ratio` times). The size comes
  from the averaged estimate, not from the one reading: one step's p5 scatters by a few
  hundredths, and sizing by a dip (or raising on a single reading inside the margin) ratchets
  budgets upwards, a grid step at a time, until every bin sits well above the band;
- lower after the estimate stayed at or above target for `lower_hold_s` (and `lower_min_readings`
  readings): to the predicted cheapest budget when a lower budget was seen below target +
  `refine_margin` (the target is bracketed: an interpolation, and never onto or under that budget),
  or to a lower budget a probe saw holding; without such evidence only when the estimate stayed
  above target + hysteresis (an extrapolation). "lower" or "refine" says which side of
  target + hysteresis the estimate was on. A lower budget whose shortfall is within
  `DOUBT_SIGMAS` standard errors of its few readings is no such bound: the bin goes back to it
  ("retry"), and the readings of each try narrow the verdict until it is clear;
- repair: later bins are raised to keep the schedule non-decreasing. Budgets the controller sets are
  on the budget grid (see grid.py) within [min_budget, max_budget].
"""

from __future__ import annotations

from dataclasses import dataclass

from services.controller.config import RetuneConfig
from services.controller.curve import Curve, Point
from services.controller.memory import BinMemory
from services.controller.readings import BinReading, BinStatus, Decision, Proposal, Snapshot
from sparrow.schedule import Schedule

# A budget whose readings' mean falls short of the target by less than this many standard errors
# (scatter / sqrt(readings)) is tried again rather than taken as failing for good.
DOUBT_SIGMAS = 1.0
# A reading under tau that lies less than this many scatters under its budget's mean (which holds
# the target) is noise, not an alarm.
DIP_SIGMAS = 2.0

__all__ = ["BinReading", "BinStatus", "Decision", "Proposal", "Retuner", "Snapshot"]


@dataclass
class _Bin:
    budget: int
    since_version: int  # the schedule version that set this budget: older data was made under another
    memory: BinMemory
    fresh_since: float | None = None
    ok_since: float | None = None
    ok_readings: int = 0
    high_since: float | None = None
    high_readings: int = 0
    readings: int = 0  # distinct fresh readings since this budget was set
    last_raw: tuple | None = None
    last_probe: tuple | None = None
    p5_before: float | None = None  # the reading before the latest one at this budget
    p5_latest: float | None = None


class Retuner:
    """Per-bin memories, timers and freshness, and the rules above."""

    def __init__(self, config: RetuneConfig, window_s: float) -> None:
        self.config = config
        self.window_s = window_s
        self.grid = config.grid
        self._bins: list[_Bin] = []
        self._shape: tuple[int, int, int] | None = None

    def sync(self, schedule: Schedule) -> None:
        """Follow `schedule` (ours, an override or an external change): a bin whose budget moved starts afresh."""
        if self.config.budget_quantum % schedule.page_size:
            raise ValueError(
                f"budget_quantum {self.config.budget_quantum} is not a multiple of page size {schedule.page_size}"
            )
        shape = (schedule.num_bins, schedule.bin_width, schedule.page_size)
        if shape != self._shape:  # other bins: nothing learned applies
            self._shape = shape
            self._bins = [_Bin(b, schedule.version, self._memory()) for b in schedule.budgets]
            return
        for state, budget in zip(self._bins, schedule.budgets, strict=True):
            if budget != state.budget:
                state.budget, state.since_version = budget, schedule.version
                state.fresh_since = state.ok_since = state.high_since = state.last_raw = None
                state.p5_before = state.p5_latest = None
                state.ok_readings = state.high_readings = state.readings = 0

    def _memory(self) -> BinMemory:
        c = self.config
        return BinMemory(c.average_readings, c.curve_reset_delta, c.curve_memory_s)

    def points(self, index: int) -> list[Point]:
        """The observations behind bin `index`'s curve."""
        return list(self._bins[index].memory.points)

    def step(self, schedule: Schedule, snapshot: Snapshot | None, now: float) -> Proposal:
        """Observe `snapshot` (None: blind) at time `now` and propose the next budgets for `schedule`."""
        self.sync(schedule)
        statuses, desired, reasons = [], list(schedule.budgets), {}
        for i, state in enumerate(self._bins):
            status = BinStatus(bin=i, budget=state.budget, since_version=state.since_version)
            statuses.append(status)
            reading = snapshot.bins.get(i) if snapshot is not None else None
            if reading is None:
                continue
            self._observe_probe(state, reading, snapshot.trainer_steps, now)
            p5 = self._choose(state, status, reading, snapshot.trainer_version, now)
            if p5 is None:
                continue
            status.estimate = estimate = self._observe(state, p5, status.tokens, snapshot.trainer_steps, now)
            status.readings, status.noise = state.readings, state.memory.noise
            move = self._decide(state, status, p5, estimate, now)
            if move is not None:
                desired[i], reasons[i] = move
        return finish_proposal(schedule, desired, reasons, statuses)

    def probe_budgets(self, schedule: Schedule, ratio: float) -> dict[int, int]:
        """Budgets to probe, for bins that hold the target with no observation below target under their budget.

        A probe goes to the predicted cheapest budget, but at least `ratio` x below the lowest budget
        seen holding and at most `max_step_ratio` x below the current one: it risks only a share of
        sequences, so it may try what the bin itself would not.
        """
        c, out = self.config, {}
        for i, (state, budget) in enumerate(zip(self._bins, schedule.budgets, strict=True)):
            if state.ok_since is None or not state.memory.points:
                continue
            curve = state.memory.curve(c.prior_slope, c.min_slope)
            if curve.has_point_below(budget, c.target + c.refine_margin):
                continue
            cheapest, _ = curve.cheapest(c.target)
            lowest = min(curve.lowest_holding(c.target) or budget, budget)
            probe = max(self.grid.up(min(cheapest, lowest * ratio)), self.grid.up(budget / c.max_step_ratio))
            probe = max(probe, c.min_budget)
            if probe < budget:
                out[i] = probe
        return out

    def _choose(self, state: _Bin, status: BinStatus, r: BinReading, version: int | None, now: float) -> float | None:
        c = self.config
        status.p5_exact, status.p5_histogram = r.p5_exact, r.p5_histogram
        if r.p5_exact is None and r.p5_histogram is None:
            return None
        if version is None or version < state.since_version:
            status.state, state.fresh_since = "waiting", None
            return None
        if state.fresh_since is None:
            state.fresh_since = now
        candidates = {}
        if r.p5_exact is not None and r.tokens_exact >= c.min_tokens and c.p5_source != "histogram":
            candidates["exact"] = (r.p5_exact, r.tokens_exact)
        # rate(...[W]) mixes in tokens of older budgets until W has passed since the data turned fresh.
        window_fresh = now - state.fresh_since >= self.window_s
        if r.p5_histogram is not None and r.tokens_window >= c.min_tokens and window_fresh:
            candidates["histogram"] = (r.p5_histogram, r.tokens_window)
        if not candidates:
            status.state = "few_tokens"
            return None
        if c.p5_source == "min":
            source = min(candidates, key=lambda k: candidates[k][0])
        else:
            source = "exact" if "exact" in candidates else "histogram"
        status.state, status.source = "fresh", source
        status.p5, status.tokens = candidates[source]
        return status.p5

    def _observe(self, state: _Bin, p5: float, tokens: float, steps: int | None, now: float) -> float:
        c = self.config
        # The same trainer step read again adds nothing. With the trainer's step counter a new step
        # counts even when its reading equals the last one; without it only a different reading does.
        raw = ("steps", steps) if steps is not None else (p5, tokens)
        if raw != state.last_raw:
            state.last_raw = raw
            state.readings += 1
            state.p5_before, state.p5_latest = state.p5_latest, p5
            if state.memory.add(Point(state.budget, p5, tokens, now), now, c.prior_slope, c.min_slope):
                state.ok_since = state.high_since = None
                state.ok_readings = state.high_readings = 0
            estimate = state.memory.mean(state.budget)
            state.ok_since, state.ok_readings = _hold(state.ok_since, state.ok_readings, estimate >= c.target, now)
            high = estimate > c.target + c.hysteresis
            state.high_since, state.high_readings = _hold(state.high_since, state.high_readings, high, now)
        return state.memory.mean(state.budget)

    def _observe_probe(self, state: _Bin, r: BinReading, steps: int | None, now: float) -> None:
        c = self.config
        if r.probe_budget is None or r.probe_p5 is None or r.probe_tokens < c.min_tokens:
            return
        # As for the bin's own reading: one trainer step counts once, even when it equals the last.
        raw = (r.probe_budget, r.probe_p5, r.probe_tokens)
        key = ("steps", steps) if steps is not None else raw
        if key != state.last_probe:
            state.last_probe = key
            # A probe covers a share of the sequences at a budget the bin does not run: its reading
            # joins the fit at that budget but neither wipes nor shifts what the bin's own readings
            # built (one lucky probe at a budget seen failing would otherwise stand alone as "seen
            # holding", and one unlucky one would drag the bin's own mean down and raise it).
            state.memory.add(Point(*raw, now), now, c.prior_slope, c.min_slope, probe=True)

    def _decide(self, state: _Bin, status: BinStatus, p5: float, estimate: float, now: float) -> tuple[int, str] | None:
        c, b = self.config, state.budget
        curve = state.memory.curve(c.prior_slope, c.min_slope)
        cheapest, _ = curve.cheapest(c.target)
        status.predicted_cheapest = self.grid.up(cheapest)
        # A reading under tau raises at once, unless the bin's own scatter explains it: one dip of less
        # than DIP_SIGMAS scatters under the bin's mean, which still holds the target, is one step's
        # noise (at a scatter of 0.03 a bin whose level is 0.90 reads under 0.86 one step in eleven).
        # Two readings under tau in a row are not (one in 120 there), and are what a curve drifting
        # down looks like before the mean has followed it.
        noise = state.memory.noise
        again = state.p5_before is not None and state.p5_before < c.tau
        explained = noise is not None and estimate >= c.target and estimate - p5 <= DIP_SIGMAS * noise
        alarm = p5 < c.tau and (again or not explained)
        if not alarm and estimate < c.target and state.readings < c.raise_min_readings:
            status.state = "confirming"  # under the margin: one step's noise, or the bin's level?
            return None
        if estimate < c.target or alarm:
            # Sized by the averaged estimate: one reading under tau raises at once, but by what the
            # budget's mean says is missing (at least one grid step), not by that reading's own dip.
            if cheapest <= b:  # the pooled fit disagrees with this budget's readings: trust the readings
                cheapest = b * 2 ** ((c.target - estimate) / c.prior_slope)
            new = min(max(cheapest, self.grid.next_above(b)), b * c.max_step_ratio, c.max_budget)
            # A bin under min_budget (a schedule set under other bounds) rises at least into the bounds: the
            # step cap would leave it below them, where the loop refuses to publish it, and the bin never rose.
            new = max(min(self.grid.up(new), c.max_budget), c.min_budget)
            if new <= b:
                status.state = "at_max"
                return None
            if estimate < c.target:
                return new, f"raise: p5 {estimate:.4f} < target {c.target:.4f}"
            return new, f"raise: p5 {p5:.4f} < tau {c.tau:.4f} (mean {estimate:.4f})"
        held = _held(state.ok_since, state.ok_readings, now, c)
        # A budget seen failing, or holding by less than refine_margin, bounds any lowering from below:
        # noise there would make the bin hop. With one, the cheapest budget is an interpolation. One
        # whose shortfall is within the scatter of its few readings is no bound: it is tried again.
        marginal, doubtful = _failing(state.memory, curve, b, c.target + c.refine_margin)
        observed = curve.lowest_holding(c.target + c.refine_margin)
        reason = "lower" if estimate > c.target + c.hysteresis else "refine"
        if held and doubtful is not None:
            se, mean = state.memory.standard_error(doubtful), state.memory.mean(doubtful)
            reason, cheapest = "retry", doubtful
            how = f"retry {doubtful} (mean {mean:.4f}, within {DOUBT_SIGMAS:g} x {se:.4f} of target + refine_margin)"
        elif held and marginal is not None:
            how = f"cheapest fit {cheapest:.0f}, kept above {marginal} (seen under target + refine_margin)"
        elif held and observed is not None and observed < b:
            cheapest, how = observed, f"cheapest {observed} seen holding"
        elif _held(state.high_since, state.high_readings, now, c):
            how = f"cheapest fit {cheapest:.0f} (extrapolated)"
        else:
            return None
        # A bin over max_budget (a schedule set under other bounds) comes down at least into the bounds: the
        # step cap would leave it above them, where the loop refuses to publish it (with the other bins' changes).
        new = min(max(self.grid.up(cheapest), self.grid.up(b / c.max_step_ratio), c.min_budget), c.max_budget)
        if marginal is not None:
            new = max(new, self.grid.next_above(marginal))
        if new >= b or new > c.max_budget:  # into the bounds only through a budget seen failing: stay
            return None
        return new, f"{reason}: p5 {estimate:.4f} >= target {c.target:.4f}, {how}"


def _failing(memory: BinMemory, curve: Curve, budget: int, threshold: float) -> tuple[int | None, int | None]:
    """Budgets under `budget` whose fitted p5 is below `threshold`: (the highest beyond doubt, a doubtful one above it).

    A failure is beyond doubt when the fitted p5 plus DOUBT_SIGMAS standard errors of the budget's
    mean is still under `threshold` (or no scatter is known yet). The doubtful one returned is the
    highest budget above that bound whose shortfall is within its standard errors.
    """
    doubtful = None
    for b, y in curve.failing_below(budget, threshold):
        se = memory.standard_error(int(b))
        if se is None or y + DOUBT_SIGMAS * se < threshold:
            return int(b), doubtful
        if doubtful is None:
            doubtful = int(b)
    return None, doubtful


def _hold(since: float | None, count: int, condition: bool, now: float) -> tuple[float | None, int]:
    """Advance a 'condition held since' timer by one reading."""
    if not condition:
        return None, 0
    return (now if since is None else since), count + 1


def _held(since: float | None, count: int, now: float, c: RetuneConfig) -> bool:
    return since is not None and now - since >= c.lower_hold_s and count >= c.lower_min_readings


def finish_proposal(
    schedule: Schedule, desired: list[int], reasons: dict[int, str], statuses: list[BinStatus]
) -> Proposal:
    """Repair `desired` into a non-decreasing schedule and name every change's reason.

    A bin no sequence reaches (no data at all, such as the bins shorter than every prompt) follows
    the next bin down rather than holding it up: its budget is used by no token, and kept above
    its neighbour it would stop every later bin from ever being lowered.
    """
    desired = list(desired)
    followed: dict[int, int] = {}
    for i in range(len(desired) - 2, -1, -1):
        if statuses[i].state == "no_data" and desired[i + 1] < desired[i]:
            desired[i] = desired[i + 1]
            followed[i] = i + 1
    final: list[int] = []
    for want in desired:
        final.append(max(want, final[-1]) if final else want)
    decisions = []
    for i, (old, new) in enumerate(zip(schedule.budgets, final, strict=True)):
        if new == old:
            continue
        detail = reasons.get(i, "")
        reason = detail.split(":")[0] if detail else "repair"
        if detail and (new > old) != (reason == "raise"):
            reason = "repair"  # an earlier bin's raise outweighed this bin's own lowering
        if reason == "repair" and i in followed and new < old:
            detail = f"repair: no data in this bin, kept at or below bin {followed[i]}"
        elif reason == "repair":
            detail = f"repair: kept non-decreasing after bin {_source_bin(final, i)}"
        elif new != desired[i]:
            detail += f"; kept at {new} >= bin {_source_bin(final, i)}"
        decisions.append(Decision(i, old, new, reason, statuses[i].p5, detail))
    return Proposal(tuple(final), decisions, statuses)


def _source_bin(budgets: list[int], index: int) -> int:
    """The first bin holding `budgets[index]`: the one a repaired bin was raised to match."""
    value = budgets[index]
    return next(j for j in range(index + 1) if budgets[j] == value)
