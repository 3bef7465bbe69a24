"""The controller in lossless mode: per bin, the draft budget that makes speculative rollouts cheapest.

With `engine.decode = "speculative"` every emitted token is the dense policy's, whatever the draft
budget: there is no tail to hold, only throughput to win. A cycle of k drafts at budget B emits
(1 - a^(k+1)) / (1 - a) tokens on average, where a, the mean acceptance of one draft, grows with B,
and costs k draft steps at B plus one dense verify over k + 1 positions. A small budget makes drafts
cheap and rejected; a large one makes them accepted and dear. Both are priced in the seconds the
generators timed their cycles in (`CycleTimeModel`: the verify as measured in the bin, a draft step
fitted over the bins and budgets read as a fixed part plus a slope in its attention eFLOPs), and until
those span enough to fit, by the cost model (`sparrow.cost.speculative_step_speedup` at the bin's middle
KV length, with the step overhead the timed cycles imply: `StepOverheadEstimate`). The generators
measure a per bin (`sparrow_generator_draft_alpha`).

Acceptance is learned as y = -ln(1 - a), the log of how rarely a draft is rejected: the attention mass
a budget misses, and with it the rejections, falls by about a constant factor per doubling of the
budget, so y is close to linear in log2(budget) where a itself flattens out near 1.

Each tick, for every bin whose reading was made under its current budget (the generators run the
schedule version that set it, and a whole window has passed since, so the window holds no drafts of
the old budget) and covers `min_drafts` drafted positions, the reading joins the bin's memory (one
per window: overlapping windows would count the same drafts twice). Its acceptance-vs-budget curve
is the same monotone fit of y in log2(budget) as the tail mode's p5 curve (`curve.py`, `memory.py`):
more budget never makes the draft farther from the dense policy; beyond the observed budgets it is
extrapolated with the slope `rejection_ratio_per_doubling` implies. Once the bin has held its
budget for `hold_s` and `min_readings` readings, it moves to the grid budget within
`max_step_ratio` whose predicted tokens per cost is highest, if that beats the current budget's
(fitted at its own readings) by `min_gain`. A budget tried and found worse than predicted keeps
its reading, so the bin does not go back to it while the curve holds. The schedule is then
repaired non-decreasing, as in tail mode; a raise that repair would carry into later bins is made only
if the bins it moves are, together, predicted to decode faster (each weighted by its dense step's cost).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from services.controller.config import LosslessConfig, RetuneConfig
from services.controller.curve import Point
from services.controller.memory import BinMemory
from services.controller.readings import BinStatus, DraftReading, Proposal, Snapshot
from services.controller.retune import finish_proposal
from sparrow.cost import StepTimeFit, bin_middle, fit_step_times
from sparrow.schedule import Schedule
from sparrow.speculative import expected_tokens

# gain(schedule, bin index, draft budget, acceptance) -> tokens per cost over dense decoding's in that bin
GainModel = Callable[[Schedule, int, int, float], float]
# Acceptance is kept below 1 by this much on the y scale (a reading of exactly 1 would be infinitely far).
MAX_ACCEPTANCE = 1.0 - 1e-6


def to_y(alpha: float) -> float:
    """The curve's scale: -ln(1 - alpha)."""
    return -math.log1p(-min(alpha, MAX_ACCEPTANCE))


def to_alpha(y: float) -> float:
    """Back from the curve's scale to an acceptance in [0, 1]."""
    return -math.expm1(-max(y, 0.0))


# solve(schedule, {bin: (timed cycles, seconds of their k draft steps, seconds of the rest)}) -> the step
# overhead in multiples of 2P those times imply, pooled (None: none), and per bin: sparrow.cost.binned_step_overhead.
OverheadSolver = Callable[[Schedule, dict], "tuple[float | None, dict[int, float]]"]
MIN_TIMED_CYCLES = 8  # timed cycles a bin's window needs before its times price the overhead


class StepOverheadEstimate:
    """The step overhead the gain is priced with: the one the generators' own cycle times imply, or the configured.

    Each tick, every bin whose window holds `min_cycles` timed cycles gives the overhead at which the cost model's
    draft step and verify cost what they took, relative to each other (`solve`); the estimate is their mean,
    weighted by timed cycles. A tick without one keeps the last. Until the first (or with `measure` off) the
    configured figure is priced.
    """

    def __init__(self, configured: float, solve: OverheadSolver, measure: bool = True,
                 min_cycles: float = MIN_TIMED_CYCLES) -> None:  # fmt: skip
        self.configured, self.solve, self.measure = configured, solve, measure
        self.min_cycles = min_cycles
        self.measured: float | None = None
        self.per_bin: dict[int, float] = {}

    @property
    def value(self) -> float:
        """The overhead priced now."""
        return self.measured if self.measure and self.measured is not None else self.configured

    def observe(self, schedule: Schedule, readings: dict[int, DraftReading]) -> None:
        """Solve the overhead from the timed cycles of these bins' readings."""
        timed = {i: (r.timed_cycles, r.draft_seconds, r.verify_seconds) for i, r in readings.items()
                 if r.timed_cycles >= self.min_cycles}  # fmt: skip
        pooled, per_bin = self.solve(schedule, timed)
        if pooled is not None:
            self.measured, self.per_bin = pooled, per_bin

    def status(self) -> dict:
        """What the status page shows of it."""
        return {"priced": self.value, "configured": self.configured, "measured": self.measured,
                "measuring": self.measure, "per_bin": {str(i): o for i, o in sorted(self.per_bin.items())}}  # fmt: skip


# attention(schedule, bin index, draft budget) -> a draft step's attention eFLOPs at the bin's middle KV length
# (budget 0: a dense step): sparrow.cost.step_attention_cost.
AttentionCost = Callable[[Schedule, int, int], float]


class CycleTimeModel:
    """A bin's cycle priced in the seconds the generators measured it in, where the cost model's eFLOPs mislead.

    The verify's seconds per cycle are measured in every bin as they are (they do not depend on the draft
    budget). A draft step's are fitted over every bin and budget read: `fixed` seconds plus a slope times the
    step's attention eFLOPs (`sparrow.cost.fit_step_times`), so a budget not yet tried, and the dense step
    (budget 0, what the gain is relative to), are priced from the ones that were. The dense step is the fit
    extrapolated far past the budgets read: it ranks budgets (which does not depend on it), but its "x dense"
    is no forecast (on a 2-core CPU 1.45-2.2x where about 1.0x was measured). One observation per
    (KV length, budget): the latest window's; observations older than `memory_s` go. Until the attention costs
    read span enough to tell the fixed part from the slope, and for a bin whose verify is not measured yet,
    `gain` returns None and the cost model prices it.
    """

    def __init__(self, attention: AttentionCost, k: int, memory_s: float, enabled: bool = True,
                 min_cycles: float = MIN_TIMED_CYCLES) -> None:  # fmt: skip
        self.attention, self.k, self.memory_s, self.enabled = attention, k, memory_s, enabled
        self.min_cycles = min_cycles
        self._draft: dict[tuple[int, int], tuple[float, float, float, float]] = {}  # (kv, budget): a, s, w, when
        self._verify: dict[int, tuple[float, float]] = {}  # kv: (seconds per cycle, when)
        self.fit: StepTimeFit | None = None

    def observe(self, schedule: Schedule, readings: dict[int, DraftReading], now: float) -> None:
        """Take these bins' timed cycles (each read under the bin's current budget) and fit again."""
        for i, r in readings.items():
            if r.timed_cycles < self.min_cycles or not 0 <= i < schedule.num_bins:
                continue
            kv, budget = bin_middle(schedule, i), schedule.budgets[i]
            step = r.draft_seconds / (self.k * r.timed_cycles)
            self._draft[(kv, budget)] = (self.attention(schedule, i, budget), step, r.timed_cycles, now)
            self._verify[kv] = (r.verify_seconds / r.timed_cycles, now)
        self._draft = {key: v for key, v in self._draft.items() if now - v[3] <= self.memory_s}
        self._verify = {kv: v for kv, v in self._verify.items() if now - v[1] <= self.memory_s}
        self.fit = fit_step_times([(a, t, w) for a, t, w, _ in self._draft.values()])

    def gain(self, schedule: Schedule, index: int, budget: int, alpha: float) -> float | None:
        """Tokens per second of speculative decoding over dense decoding's in bin `index` at this draft budget,
        as the measured times price it (None: not priced yet)."""
        verify = self._verify.get(bin_middle(schedule, index))
        if not self.enabled or self.fit is None or verify is None:
            return None
        draft = self.fit.seconds(self.attention(schedule, index, budget))
        dense = self.fit.seconds(self.attention(schedule, index, 0))
        return expected_tokens(alpha, self.k) * dense / (self.k * draft + verify[0])

    def status(self) -> dict:
        """What the status page shows of it: the fit, and the verify's measured seconds per bin's KV length."""
        fit = self.fit
        return {
            "pricing": self.enabled,
            "fitted": fit is not None,
            "draft_fixed_s": fit.fixed if fit else None,
            "draft_s_per_attention_eflop": fit.per_eflop if fit else None,
            "observations": len(self._draft),
            "verify_s": {str(kv): v[0] for kv, v in sorted(self._verify.items())},
        }


@dataclass
class _Bin:
    budget: int
    since_version: int  # the schedule version that set this budget: drafts counted before it are another's
    memory: BinMemory
    fresh_since: float | None = None
    last_reading: float | None = None  # when the last reading joined the memory
    readings: int = 0  # readings at this budget since it was set


class LosslessRetuner:
    """Per-bin acceptance curves and the throughput rule above; pure logic, driven by readings and the clock."""

    def __init__(
        self,
        retune: RetuneConfig,
        lossless: LosslessConfig,
        window_s: float,
        gain: GainModel,
        overhead: StepOverheadEstimate | None = None,
        timing: CycleTimeModel | None = None,
        weight: Callable[[Schedule, int], float] | None = None,
    ) -> None:
        self.config, self.lossless = retune, lossless
        # weight(schedule, bin): what a dense step costs there, relative to the other bins (None: alike)
        self.weight = weight
        # observed each tick, before the gains are priced (`gain` reads them)
        self.overhead, self.timing = overhead, timing
        self.window_s = window_s
        self.gain = gain
        self.grid = retune.grid
        self.prior_slope = -math.log(lossless.rejection_ratio_per_doubling)
        self.min_slope = -math.log(lossless.min_rejection_ratio_per_doubling)
        self._bins: list[_Bin] = []
        self._shape: tuple[int, int, int] | None = None

    def sync(self, schedule: Schedule) -> None:
        """Follow `schedule`: a bin whose budget moved waits for readings of the new one."""
        shape = (schedule.num_bins, schedule.bin_width, schedule.page_size)
        if shape != self._shape:
            self._shape = shape
            c, reset = self.config, self.lossless.curve_reset_delta
            self._bins = [
                _Bin(b, schedule.version, BinMemory(c.average_readings, reset, c.curve_memory_s))
                for b in schedule.budgets
            ]
            return
        for state, budget in zip(self._bins, schedule.budgets, strict=True):
            if budget != state.budget:
                state.budget, state.since_version = budget, schedule.version
                state.fresh_since = state.last_reading = None
                state.readings = 0

    def points(self, index: int) -> list[Point]:
        """The observations behind bin `index`'s curve (budget, mean -ln(1 - acceptance))."""
        return list(self._bins[index].memory.points)

    def acceptance(self, index: int, budget: int) -> float | None:
        """Bin `index`'s fitted acceptance at `budget`, in [0, 1] (None before its first reading)."""
        memory = self._bins[index].memory
        if not memory.points:
            return None
        return to_alpha(memory.curve(self.prior_slope, self.min_slope).predict(budget))

    def mean_acceptance(self) -> float | None:
        """The drafts-weighted mean of the bins' acceptance at their current budgets (None before any reading)."""
        pairs = [(self.acceptance(i, s.budget), p.weight) for i, s in enumerate(self._bins)
                 for p in s.memory.points if p.budget == s.budget]  # fmt: skip
        total = sum(w for _, w in pairs)
        return sum(a * w for a, w in pairs) / total if total > 0 else None

    def step(self, schedule: Schedule, snapshot: Snapshot | None, now: float) -> Proposal:
        """Observe `snapshot` (None: blind) at time `now` and propose the next draft budgets for `schedule`."""
        self.sync(schedule)
        statuses, desired, reasons = [], list(schedule.budgets), {}
        fresh: dict[int, tuple[_Bin, BinStatus]] = {}
        for i, state in enumerate(self._bins):
            status = BinStatus(bin=i, budget=state.budget, since_version=state.since_version)
            statuses.append(status)
            reading = snapshot.bins.get(i) if snapshot is not None else None
            if not isinstance(reading, DraftReading):
                continue
            if not self._fresh(state, status, reading, snapshot.trainer_version, now):
                continue
            if state.last_reading is None or now - state.last_reading >= self.window_s:
                point = Point(state.budget, to_y(reading.alpha), reading.drafts, now)
                state.memory.add(point, now, self.prior_slope, self.min_slope)
                state.last_reading, state.readings = now, state.readings + 1
            status.estimate = to_alpha(state.memory.mean(state.budget))
            status.readings, status.noise = state.readings, state.memory.noise
            fresh[i] = state, status
        if fresh:
            # Only bins whose window holds cycles of their current budget alone: their times are that budget's.
            readings = {i: snapshot.bins[i] for i in fresh}
            if self.overhead is not None:
                self.overhead.observe(schedule, readings)
            if self.timing is not None:
                self.timing.observe(schedule, readings, now)
        for i, (state, status) in fresh.items():
            move = self._decide(schedule, i, state, status, now)
            if move is not None:
                desired[i], reasons[i] = move
        self._keep_raises_that_pay(schedule, desired, reasons)
        return finish_proposal(schedule, desired, reasons, statuses)

    def _keep_raises_that_pay(self, schedule: Schedule, desired: list[int], reasons: dict[int, str]) -> None:
        """Drop a raise the non-decreasing repair would carry into later bins, unless the bins it moves together
        are predicted to decode faster: a short bin, where drafts barely pay, must not take the long bins, where
        the time goes, off their cheapest budgets for a gain of its own of a few percent."""
        for i in sorted(i for i, why in reasons.items() if why.startswith("raise")):
            without = list(desired)
            without[i] = schedule.budgets[i]
            spent_with, spent_without = self._decode_cost(schedule, desired), self._decode_cost(schedule, without)
            if spent_with is not None and spent_without is not None and spent_with > spent_without:
                desired[i] = schedule.budgets[i]
                del reasons[i]

    def _decode_cost(self, schedule: Schedule, desired: list[int]) -> float | None:
        """The predicted cost of decoding one position in each bin under `desired` once repaired non-decreasing,
        relative to dense decoding (each bin's weight over its gain); bins with no acceptance yet left out."""
        total, budget = 0.0, 0
        for i, want in enumerate(desired):
            budget = max(budget, want)
            alpha = self.acceptance(i, budget) if i < len(self._bins) else None
            if alpha is None:
                continue
            gain = self.gain(schedule, i, budget, alpha)
            if not (math.isfinite(gain) and gain > 0):
                return None
            total += (self.weight(schedule, i) if self.weight else 1.0) / gain
        return total

    def probe_budgets(self, schedule: Schedule, ratio: float) -> dict[int, int]:
        """No probes in lossless mode: a budget is tried by the bin itself, at no risk to the samples."""
        return {}

    def _fresh(self, state: _Bin, status: BinStatus, r: DraftReading, version: int | None, now: float) -> bool:
        status.p5, status.tokens = r.alpha, r.drafts  # the reading (mean acceptance) and what it covers
        if version is None or version < state.since_version:
            status.state, state.fresh_since = "waiting", None
            return False
        if state.fresh_since is None:
            state.fresh_since = now
        # increase(...[W]) still counts drafts of the old budget until W has passed since the generators took it.
        if now - state.fresh_since < self.window_s:
            status.state = "waiting"
            return False
        if r.drafts < self.lossless.min_drafts:
            status.state = "few_tokens"
            return False
        status.state, status.source = "fresh", "drafts"
        return True

    def _candidates(self, schedule: Schedule, index: int, budget: int) -> list[int]:
        c = self.config
        # A budget over the bin's KV drafts densely: lowering it to the KV changes nothing, so steps count from there.
        kv = bin_middle(schedule, index)
        low = max(c.min_budget, self.grid.up(min(budget, kv) / c.max_step_ratio))
        high = min(c.max_budget, budget * c.max_step_ratio)
        out, b = [], low
        while b <= high:
            out.append(b)
            b = self.grid.next_above(b)
        return out

    def _decide(self, schedule: Schedule, index: int, state: _Bin, status: BinStatus, now: float):
        b, cfg = state.budget, self.lossless
        gains = {}
        for candidate in sorted(set(self._candidates(schedule, index, b)) | {b}):
            gain = self.gain(schedule, index, candidate, self.acceptance(index, candidate))
            if math.isfinite(gain):
                gains[candidate] = gain
        if b not in gains:
            return None
        best = max(gains, key=lambda x: (gains[x], -abs(math.log2(x / b))))  # ties: the nearest budget
        status.predicted_cheapest, status.predicted_gain = best, gains[b]
        held = state.readings >= cfg.min_readings and now - state.fresh_since >= self.window_s + cfg.hold_s
        if not held:
            status.state = "confirming"
            return None
        if best == b or gains[best] <= gains[b] * (1 + cfg.min_gain):
            return None
        a_now, a_best = self.acceptance(index, b), self.acceptance(index, best)
        how = (
            f"acceptance {a_now:.4f} at {b} -> {a_best:.4f} predicted at {best}, "
            f"tokens per cost {gains[b]:.3f}x -> {gains[best]:.3f}x dense"
        )
        return best, f"{'raise' if best > b else 'lower'}: {how}"
