"""The control loop: read Redis and Prometheus, retune, validate, publish; hold whenever it cannot see."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from services.controller.config import ControllerConfig
from services.controller.lossless import LosslessRetuner
from services.controller.metrics import ControllerMetrics
from services.controller.prometheus_source import PrometheusSource, PrometheusUnavailable
from services.controller.publisher import SchedulePublisher, StoreError, VersionConflict, validated
from services.controller.readings import BinStatus, Decision
from services.controller.retune import Retuner
from sparrow.schedule import Schedule, ScheduleError

log = logging.getLogger("sparrow.controller")


class ControlLoop:
    """One controller: its state, one `tick()` per interval, and the admin actions the API calls."""

    def __init__(
        self,
        config: ControllerConfig,
        publisher: SchedulePublisher,
        source: PrometheusSource,
        initial: Schedule,
        speedup_of: Callable[[Schedule], float],
        clock: Callable[[], float] = time.time,
        retuner: Retuner | LosslessRetuner | None = None,
    ) -> None:
        self.config = config
        self.publisher = publisher
        self.source = source
        self.initial = initial
        self.speedup_of = speedup_of
        self.clock = clock
        self.retuner = retuner or Retuner(config.retune, config.prometheus.window_s)
        self.lossless = isinstance(self.retuner, LosslessRetuner)
        self.metrics = ControllerMetrics()
        self.metrics.target.set(config.retune.target)
        self.schedule: Schedule | None = None
        self.speedup: float | None = None
        self.paused = False
        self.blind = True  # until a tick has seen the trainer's metrics
        self.blind_reason: str | None = "not started"
        self.store_error: str | None = None
        self.trainer_version: int | None = None
        self.bins: list[BinStatus] = []
        self.decisions: deque[dict[str, Any]] = deque(maxlen=config.api.decisions_kept)
        self.probe: dict[str, Any] | None = None  # the last probe request written (None: none)
        self.ticks = 0
        self.last_tick: float | None = None
        # The trainer's p5 gauges hold only its last step: steps that end between two ticks go unseen.
        self.trainer_steps: int | None = None
        self.steps_unseen = 0
        self._lock = asyncio.Lock()
        self._logged_blind: bool | None = None

    async def run(self, stop: asyncio.Event) -> None:
        """Tick every `interval_s` until `stop` is set; a failing tick is logged, never fatal."""
        while not stop.is_set():
            try:
                await self.tick()
            except Exception:  # the loop must outlive any one bad tick; the next one retries
                log.exception("control tick failed")
            try:
                await asyncio.wait_for(stop.wait(), timeout=self.config.interval_s)
            except TimeoutError:
                pass

    async def tick(self) -> None:
        """One round: follow Redis, read Prometheus, decide, publish if anything changed."""
        async with self._lock:
            now = self.clock()
            self.ticks, self.last_tick = self.ticks + 1, now
            schedule = await self._current()
            if schedule is None:
                self.metrics.ticks.labels(outcome="store_error").inc()
                return
            try:
                snapshot = await self.source.read(now)
                self.trainer_version = snapshot.trainer_version
                self._count_steps(snapshot.trainer_steps)
                self.blind, self.blind_reason = not snapshot.bins, None
                if not snapshot.bins:
                    self.blind_reason = "no fresh trainer metrics in Prometheus"
            except PrometheusUnavailable as exc:
                snapshot, self.blind, self.blind_reason = None, True, str(exc)
            self.metrics.blind.set(int(self.blind))
            proposal = self.retuner.step(schedule, None if self.blind else snapshot, now)
            self.bins = proposal.bins
            if self.lossless:
                self.metrics.show_draft_estimates(proposal.bins)
                if self.retuner.overhead is not None:
                    self.metrics.step_overhead.set(self.retuner.overhead.value)
                fit = self.retuner.timing.fit if self.retuner.timing is not None else None
                if fit is not None:
                    self.metrics.draft_fixed.set(fit.fixed)
                self._refresh_speedup()
            else:
                self.metrics.show_estimates({s.bin: s.estimate for s in proposal.bins if s.estimate is not None})
            if self.blind != self._logged_blind:  # transitions only: an outage is one line, not one per tick
                self._logged_blind = self.blind
                if self.blind:
                    log.warning("blind, holding schedule v%d: %s", schedule.version, self.blind_reason)
                else:
                    log.info("trainer metrics readable (trainer schedule v%s)", self.trainer_version)
            if self.blind:
                self.metrics.ticks.labels(outcome="blind").inc()
                return
            if self.paused:
                self.metrics.ticks.labels(outcome="paused").inc()
                return
            outcome = "ok"
            if proposal.changed:
                outcome = await self._publish_proposal(schedule, proposal.budgets, proposal.decisions)
            if self.config.probe.enabled and outcome == "ok":
                await self._probe()
            self.metrics.ticks.labels(outcome=outcome).inc()

    def _count_steps(self, steps: int | None) -> None:
        """Count trainer steps whose readings no tick saw (the step counter jumped by more than one)."""
        if steps is None:  # the counter was not readable: nothing to compare
            return
        last, self.trainer_steps = self.trainer_steps, steps
        if last is None or steps <= last + 1:  # a restarted trainer counts from 0 again
            return
        unseen = steps - last - 1
        if self.steps_unseen == 0:  # once: it is a property of the deployment, not of one tick
            log.warning(
                "%d trainer step(s) ended between two ticks and their readings went unseen; "
                "an interval_s (%.1f s) shorter than a training step avoids it",
                unseen,
                self.config.interval_s,
            )
        self.steps_unseen += unseen
        self.metrics.steps_unseen.inc(unseen)

    async def _current(self) -> Schedule | None:
        """The schedule in Redis (the initial one if it has none, the held one if it lost it); None on failure."""
        held = self.schedule
        try:
            schedule = await self.publisher.current()
            if held is not None and (schedule is None or schedule.version < held.version):
                # Redis lost the schedule in force (flushed, or a replica that missed the last writes took
                # over). Generators ignore any version not above the last one they saw: it goes back above.
                lost = "none" if schedule is None else f"v{schedule.version}"
                reason = f"schedule v{held.version} restored (Redis held {lost})"
                seen = None if schedule is None else schedule.version
                schedule = await self._publish(held, reason, "restore", [], expected=seen, above=held.version)
            elif schedule is None:
                schedule = await self._publish(self.initial, "initial schedule", "initial", [], expected=None)
            quantum = self.config.retune.budget_quantum
            if quantum % schedule.page_size:  # written by someone else: valid, but off the budget grid
                raise ScheduleError(
                    f"schedule v{schedule.version} has page size {schedule.page_size}, "
                    f"which does not divide budget_quantum {quantum}"
                )
        except (StoreError, ScheduleError) as exc:
            self.store_error = str(exc)
            log.error("schedule store: %s; holding", exc)
            return None
        self.store_error = None
        if self.schedule is None or schedule.version != self.schedule.version:
            if self.schedule is not None and schedule.budgets != self.schedule.budgets:
                log.info("following schedule v%d from Redis: %s", schedule.version, schedule.compact())
            self.schedule, self.speedup = schedule, self._speedup(schedule)
            self.metrics.show_schedule(schedule.budgets, schedule.version, self.speedup)
        return schedule

    async def _publish_proposal(self, schedule: Schedule, budgets: tuple[int, ...], decisions: list[Decision]) -> str:
        c = self.config.retune
        try:
            candidate = schedule.with_budgets(budgets)
            for i, b in enumerate(budgets):
                if b != schedule.budgets[i] and not c.min_budget <= b <= c.max_budget:
                    raise ScheduleError(f"bin {i} budget {b} outside [{c.min_budget}, {c.max_budget}]")
        except ScheduleError as exc:  # a bug in the rules, never a reason to publish
            log.error("rejected own proposal %s: %s", list(budgets), exc)
            return "rejected"
        reason = "; ".join(f"bin {d.bin} {d.old}->{d.new} {d.detail}" for d in decisions)
        try:
            await self._publish(candidate, reason, "controller", decisions, expected=schedule.version)
        except VersionConflict as exc:
            log.warning("not published: %s", exc)
            return "conflict"
        except StoreError as exc:
            self.store_error = str(exc)
            log.error("not published: %s", exc)
            return "store_error"
        return "ok"

    async def _publish(
        self,
        schedule: Schedule,
        reason: str,
        source: str,
        decisions: list[Decision],
        expected: int | None,
        above: int = 0,
    ) -> Schedule:
        speedup = self._speedup(schedule)
        entries = [asdict(d) for d in decisions]
        new = await self.publisher.publish(
            schedule, reason, source, entries, speedup, expected_version=expected, above=above
        )
        self.schedule, self.speedup = new, speedup
        self.metrics.show_schedule(new.budgets, new.version, speedup)
        for d in entries or [{"bin": None, "reason": source, "detail": reason}]:
            self.decisions.append({**d, "version": new.version, "time": self.clock()})
            self.metrics.decisions.labels(reason=d["reason"]).inc()
        log.info("published schedule v%d (%s, predicted speedup %.2fx): %s", new.version, source, speedup, reason)
        return new

    async def _probe(self) -> None:
        p, schedule = self.config.probe, self.schedule
        budgets = self.retuner.probe_budgets(schedule, p.ratio)
        try:
            await self.publisher.set_probe(schedule.version, p.share, budgets, schedule.num_bins, p.ttl_s)
        except StoreError as exc:
            log.warning("probe request not written: %s", exc)
            return
        probe = {"schedule_version": schedule.version, "share": p.share, "budgets": budgets} if budgets else None
        if probe != self.probe:
            self.probe = probe
            log.info("probe request: %s", probe if probe else "none")

    def _refresh_speedup(self) -> None:
        """Lossless mode: the predicted speedup rests on the measured acceptance, which moves between publishes."""
        if self.schedule is not None:
            self.speedup = self._speedup(self.schedule)
            self.metrics.show_schedule(self.schedule.budgets, self.schedule.version, self.speedup)

    def _speedup(self, schedule: Schedule) -> float:
        try:
            return self.speedup_of(schedule)
        except (ValueError, ArithmeticError) as exc:  # reporting only: never blocks a publish
            log.warning("cost model failed for v%d: %s", schedule.version, exc)
            return float("nan")

    async def override(self, data: Any, reason: str, pause: bool) -> Schedule:
        """Publish an operator's schedule (validated by the core and the bounds); raises ScheduleError if invalid."""
        schedule = validated(Schedule.from_dict(data))
        c = self.config.retune
        if c.budget_quantum % schedule.page_size:
            raise ScheduleError(f"page size {schedule.page_size} does not divide budget_quantum {c.budget_quantum}")
        for i, b in enumerate(schedule.budgets):
            if not c.min_budget <= b <= c.max_budget:
                bounds = f"[{c.min_budget}, {c.max_budget}]"
                raise ScheduleError(f"budget of bin {i} ({b} tokens) is outside the controller's bounds {bounds}")
        async with self._lock:
            new = await self._publish(schedule, reason, "override", [], expected=None)
            self.set_paused(pause or self.paused)
        return new

    def set_paused(self, paused: bool) -> None:
        """Pause or resume retuning (a paused controller keeps observing, never publishes by itself)."""
        if paused != self.paused:
            log.info("retuning %s", "paused" if paused else "resumed")
        self.paused = paused
        self.metrics.paused.set(int(paused))

    def status(self) -> dict[str, Any]:
        """Everything the status page shows, as plain JSON values."""
        c, s = self.config.retune, self.schedule
        bins = []
        for b in self.bins:
            entry = asdict(b)
            entry["headroom"] = None if b.estimate is None or self.lossless else b.estimate - c.target
            bins.append(entry)
        return {
            "mode": self.config.mode,
            "schedule": s.to_dict() if s else None,
            "compact": s.compact() if s else None,
            "predicted_speedup": self.speedup if self.speedup is not None and math.isfinite(self.speedup) else None,
            "cost": self.config.cost.model_dump(),
            "step_overhead": self.retuner.overhead.status() if getattr(self.retuner, "overhead", None) else None,
            "cycle_times": self.retuner.timing.status() if getattr(self.retuner, "timing", None) else None,
            "tau": c.tau,
            "margin": c.margin,
            "hysteresis": c.hysteresis,
            "target": c.target,
            "blind": self.blind,
            "blind_reason": self.blind_reason,
            "paused": self.paused,
            "store_error": self.store_error,
            "trainer_schedule_version": self.trainer_version,
            "bins": bins,
            "last_decisions": list(reversed(self.decisions)),
            "probe": self.probe,
            "ticks": self.ticks,
            "last_tick": self.last_tick,
            "trainer_steps": self.trainer_steps,
            "trainer_steps_unseen": self.steps_unseen,
        }
