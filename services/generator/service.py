"""The generator's main loop: claim groups, step the engine, stream trajectories, settle entries, drain.

Everything that touches the engine runs in the one thread that calls `run()` (vLLM is not thread
safe). Other threads (the trajectory stream's reader, the schedule watcher, version sync, the
control server) never call the engine: they post events to a queue the loop empties before each
step, so a new schedule or policy applies from the next step on. A group's life:

    claimed (Redis, pending) -> engine.submit -> samples finish -> sent to the trainer
    -> all n acked -> XACK          (any rejected -> retry as attempt + 1, or dead-letter at the limit)

Drain (SIGTERM or the Drain RPC): stop claiming, let in-flight groups finish for `drain_grace_s`,
then abort the rest in the engine and hand their entries back to the stream (re-enqueue with the
same attempt + ack, in one MULTI) so another generator starts them at once rather than after
`claim_idle_s`. If Redis is unreachable then, the entries stay pending and are reclaimed later.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import redis

from services.api.sparrow.v1 import common_pb2, rollout_pb2
from services.generator.config import GeneratorConfig
from services.generator.engine import FINISH_ABORTED, EngineError, EngineVersions, FinishedSample, RolloutEngine
from services.generator.metrics import GeneratorMetrics
from services.generator.trajectory_stream import Backoff, TrajectoryStream, to_trajectory
from services.generator.version_sync import VersionSync
from services.generator.weight_fetch import POLICY
from services.generator.work_queue import Claimed, WorkQueue
from sparrow import metrics_contract as mc
from sparrow.probe import Probe
from sparrow.schedule import Schedule
from sparrow.timing import PhaseTimer

log = logging.getLogger("sparrow.generator")

ACCEPTED, DUPLICATE = rollout_pb2.ACK_STATUS_ACCEPTED, rollout_pb2.ACK_STATUS_DUPLICATE
MAX_STEP_FAILURES = 3  # consecutive engine failures before the process gives up (the engine is broken)
PHASE_FLUSH_S = 0.5  # how often the loop's time split goes to the phase counters


@dataclass
class _Group:
    claimed: Claimed
    acks: dict[int, rollout_pb2.TrajectoryAck] = field(default_factory=dict)
    finished: int = 0
    lost: bool = False  # a peer took the entry over (we looked dead): the trainer dedups, we do not retry
    settle: str = ""  # "ack" | "retry" once decided, until Redis has done it
    reason: str = ""


class GeneratorService:
    """Runs the loop in the calling thread until stopped or drained; thread-safe entry points post events."""

    def __init__(
        self, config: GeneratorConfig, engine: RolloutEngine, work: WorkQueue, metrics: GeneratorMetrics
    ) -> None:
        self.config, self.engine, self.work, self.metrics = config, engine, work, metrics
        self.generator_id = config.generator_id
        t = config.trainer
        self.stream = TrajectoryStream(
            t.address,
            config.security.client(),
            self.hello,
            self._on_trainer_hello,
            Backoff(t.reconnect_initial_s, t.reconnect_max_s),
        )
        self.sync: VersionSync | None = None
        self.schedule: Schedule | None = None
        self._probe_asked: tuple | None = None  # (schedule version, share, budgets) of the probe in force
        self.serving: EngineVersions = engine.versions
        self.draining = False
        self.in_flight_sequences = 0
        self._events: queue.Queue = queue.Queue()
        self._events_lock = threading.Lock()
        self._finished = False
        self._groups: dict[str, _Group] = {}
        self._deferred: list[Claimed] = []  # same group_id as one in flight: the engine keys by it
        self._thread: threading.Thread | None = None
        self._sigterm = False
        self._stop = False
        self._exit_after_drain = False
        self._drain_deadline = 0.0
        self._drain_waiters: list[Future] = []
        self._drain_counts = [0, 0]  # groups finished, groups returned since the drain began
        self._redis_backoff = Backoff(0.2, 5.0)
        self._redis_retry_at = 0.0
        self._group_ready = False
        self._owned: frozenset[str] = frozenset()  # entry ids held, as last published for the heartbeat thread
        self._heartbeat_stop = threading.Event()
        self._next_lag = 0.0
        self._step_failures = 0
        self.phases: PhaseTimer | None = None  # the loop's time split (`run`), flushed to the phase counters
        self._phases_flushed = 0.0
        metrics.show_versions(self.serving.policy_version, self.serving.adapter_version)

    # ---- entry points for other threads -------------------------------------------------------------

    def hello(self) -> rollout_pb2.GeneratorHello:
        """What the generator says when its trajectory stream opens."""
        v = self.serving
        versions = common_pb2.Versions(
            policy_version=v.policy_version, adapter_version=v.adapter_version, schedule_version=v.schedule_version
        )
        return rollout_pb2.GeneratorHello(generator_id=self.generator_id, versions=versions)

    def call(self, fn: Callable[[], object], timeout: float | None = None) -> object:
        """Run `fn` in the engine thread (between steps) and return its result or raise its exception."""
        if threading.current_thread() is self._thread:
            return fn()
        return self._enqueue(fn).result(timeout)

    def post(self, fn: Callable[[], object]) -> None:
        """Run `fn` in the engine thread before the next step, without waiting for it."""
        self._enqueue(fn)

    def _enqueue(self, fn: Callable[[], object]) -> Future:
        future: Future = Future()
        with self._events_lock:  # never enqueue after the loop has failed the last calls: nobody would answer
            if self._finished:
                raise RuntimeError("the generator loop has stopped")
            self._events.put(("call", fn, future))
        return future

    def set_schedule(self, schedule: Schedule | None) -> None:
        """Apply `schedule` from the next step on (from any thread; a refusal is counted and logged)."""

        def apply() -> None:
            try:
                self.apply_schedule(schedule)
            except (EngineError, ValueError) as exc:
                log.error("the engine refused schedule v%s: %s", schedule.version if schedule else 0, exc)

        try:
            self.post(apply)
        except RuntimeError:
            log.info("schedule v%s arrived after the loop stopped", schedule.version if schedule else 0)

    def set_probe(self, probe: Probe | None) -> None:
        """Run `probe` (None: none) from the next submitted sequences (from any thread; a refusal is logged)."""

        def apply() -> None:
            try:
                self.apply_probe(probe)
            except EngineError as exc:
                log.error("the engine refused the probe request: %s", exc)

        try:
            self.post(apply)
        except RuntimeError:
            log.info("a probe request arrived after the loop stopped")

    def load(self, kind: str, folder: Path, version: int) -> EngineVersions:
        """Load a fetched policy or adapter in the engine thread; returns the serving versions (VersionSync's hook)."""
        return self.call(lambda: self._load(kind, folder, version))

    def load_tensors(self, tensors: dict, version: int) -> EngineVersions:
        """Load a streamed policy (host tensors, checked on arrival) in the engine thread (VersionSync's hook)."""
        return self.call(lambda: self._load_tensors(tensors, version))

    def _load_tensors(self, tensors: dict, version: int) -> EngineVersions:
        with self._phase("weight_sync"):
            self.engine.load_policy_tensors(tensors, version)
        self.serving = self.engine.versions
        self.metrics.show_versions(self.serving.policy_version, self.serving.adapter_version)
        return self.serving

    def adapter_folders_in_use(self) -> set[Path]:
        """The engine's adapter folders still needed, asked in the engine thread (VersionSync's sweep)."""
        return self.call(self.engine.adapter_folders_in_use, timeout=30.0)

    def request_drain(self, grace_s: float | None = None, exit_after: bool = False) -> Future:
        """Stop claiming; the future resolves with (groups finished, groups returned) once nothing is in flight."""
        future: Future = Future()
        grace = self.config.drain_grace_s if grace_s is None else grace_s
        with self._events_lock:
            if self._finished:
                future.set_exception(RuntimeError("the generator loop has stopped"))
            else:
                self._events.put(("drain", grace, exit_after, future))
        return future

    def on_sigterm(self, *_args) -> None:
        """Signal handler: only sets a flag (the loop may hold locks the handler would need)."""
        self._sigterm = True

    def stop(self) -> None:
        """Leave the loop at once; claimed entries stay pending in Redis (reclaimed after claim_idle_s)."""
        self._stop = True
        self._events.put(("wake",))

    # ---- the loop ------------------------------------------------------------------------------------

    def run(self) -> None:
        """The engine loop; returns after a drain that was asked to exit, or `stop()`."""
        self._thread = threading.current_thread()
        self.phases = PhaseTimer(mc.GENERATOR_PHASES)
        self.engine.time_phases(self.phases)
        self.stream.start()
        # Heartbeats run beside the loop: one engine step may outlast claim_idle_s (the reference engine
        # generates a whole group per step), and a live generator's entries must never look abandoned.
        heartbeat = threading.Thread(target=self._heartbeat_loop, name="queue-heartbeat", daemon=True)
        heartbeat.start()
        try:
            while not self._stop:
                busy = self.engine.has_work()
                can_claim = self._can_claim()
                # Waiting for events or for work, with nothing in the engine, is idle.
                with self._phase("idle") if not (busy or can_claim) else nullcontext():
                    self._handle_events(0.0 if busy or can_claim else 0.05)
                if self._sigterm and not self._exit_after_drain:
                    self._start_drain(self.config.drain_grace_s, exit_after=True, future=None)
                if self._stop:
                    break
                if self._can_claim():
                    with self._phase("idle") if not busy else nullcontext():
                        self._claim(None if busy else self.config.queue.read_block_ms)
                    self._publish_owned()  # before a step that may be long: heartbeats must cover new entries
                if self.engine.has_work():
                    self._step()
                self._housekeeping()
                self._publish_owned()
                self._flush_phases()
                if self.draining and self._drain_done():
                    if self._exit_after_drain:
                        break
        finally:
            self._flush_phases(force=True)
            self._heartbeat_stop.set()
            with self._events_lock:
                self._finished = True
            self._fail_calls()
            self.stream.close()
            heartbeat.join(5)

    def _handle_events(self, timeout: float) -> None:
        try:
            event = self._events.get(timeout=timeout) if timeout > 0 else self._events.get_nowait()
        except queue.Empty:
            return
        while True:
            kind = event[0]
            if kind == "call":
                _, fn, future = event
                try:
                    future.set_result(fn())
                except Exception as exc:
                    future.set_exception(exc)
            elif kind == "ack":
                self._on_ack(*event[1:])
            elif kind == "drain":
                self._start_drain(*event[1:])
            elif kind == "lost":
                self._mark_lost(event[1])
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                return

    def _fail_calls(self) -> None:
        while True:
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                return
            if event[0] in ("call", "drain") and not event[-1].done():
                event[-1].set_exception(RuntimeError("the generator loop stopped"))

    def _can_claim(self) -> bool:
        room = len(self._groups) + len(self._deferred) < self.config.max_in_flight_groups
        return room and not self.draining and not self._sigterm and time.monotonic() >= self._redis_retry_at

    # ---- claiming and stepping -----------------------------------------------------------------------

    def _claim(self, block_ms: int | None) -> None:
        room = self.config.max_in_flight_groups - len(self._groups) - len(self._deferred)
        try:
            if not self._group_ready:
                self.work.ensure_group()
                self._group_ready = True
            claimed = self.work.claim(room, block_ms)
        except redis.RedisError as exc:
            self._redis_failed(exc)
            return
        for c in claimed:
            self._start(c)

    def _start(self, c: Claimed) -> None:
        gid = c.group.group_id
        if gid in self._groups:
            self._deferred.append(c)
            return
        try:
            self.engine.submit(c.group)
        except (EngineError, ValueError) as exc:
            try:
                self.work.dead_letter(c.entry_id, c.group.to_fields(), f"the engine refused the group: {exc}")
            except redis.RedisError as rexc:
                self._redis_failed(rexc)  # left pending: reclaimed, refused again, poison at the limit
            return
        self._groups[gid] = _Group(c)
        follow = self.config.trainer.follow_versions
        if self.sync is not None and follow and c.group.policy_version > self.serving.policy_version:
            self.sync.offer(c.group.policy_version, 0)
        self._show_in_flight()

    def _phase(self, name: str) -> AbstractContextManager:
        """The loop's `name` phase; nothing when called off the loop's thread (the split is the loop's alone)."""
        if self.phases is None or threading.current_thread() is not self._thread:
            return nullcontext()
        return self.phases.phase(name)

    def _flush_phases(self, force: bool = False) -> None:
        now = time.monotonic()
        if self.phases is not None and (force or now - self._phases_flushed >= PHASE_FLUSH_S):
            self._phases_flushed = now
            self.metrics.record_phases(self.phases.take())

    def _step(self) -> None:
        t0 = time.perf_counter()
        try:
            # Engine time the engine does not charge to prefill or sampling itself is decode.
            with self._phase("decode"):
                finished = self.engine.step()
        except Exception as exc:
            self._step_failed(exc)
            return
        self._step_failures = 0
        self.metrics.step_seconds.observe(time.perf_counter() - t0)
        # Counted in the step that generated them, with the step's time: throughput over any window is honest.
        for g in self.engine.take_generated():
            self.metrics.record_tokens(g.prompt_len, g.kv_budgets, g.first)
        try:
            cycles = self.engine.take_cycle_times()
        except Exception:  # timings the engine could not hand out cost the metrics those cycles, not the loop
            log.warning("could not collect the engine's timed speculative cycles", exc_info=True)
            cycles = []
        for cycle in cycles:
            self.metrics.record_cycle(cycle)
        for sample in finished:
            self._send(sample)
        self._show_in_flight()

    def _send(self, sample: FinishedSample) -> None:
        g = self._groups.get(sample.group_id)
        if g is None or sample.finish_reason == FINISH_ABORTED:
            return
        g.finished += 1
        self.metrics.record_speculation(sample)
        if sample.probe:
            self.metrics.probe_sequences.inc()
        trajectory = to_trajectory(sample, g.claimed.group.attempt, self.generator_id)
        entry, index = g.claimed.entry_id, sample.sample_index
        future = self.stream.send(trajectory)
        future.add_done_callback(lambda f: self._events.put(("ack", entry, index, f)))

    def _step_failed(self, exc: Exception) -> None:
        self._step_failures += 1
        log.exception("engine step failed (%d in a row)", self._step_failures)
        if self._step_failures >= MAX_STEP_FAILURES:
            raise RuntimeError(f"the engine failed {MAX_STEP_FAILURES} steps in a row: {exc}") from exc
        # Which group broke it is unknown: every group in flight is retried (a poison one hits its limit).
        for gid, g in list(self._groups.items()):
            self.engine.abort(gid)
            if not g.settle:
                g.settle, g.reason = "retry", f"engine error: {exc}"
        self._settle_all()

    # ---- acks and settling ---------------------------------------------------------------------------

    def _on_ack(self, entry_id: str, index: int, future: Future) -> None:
        if future.exception() is not None:
            return  # stream closed at shutdown: the entry stays pending and is reclaimed
        ack = future.result()
        g = next((g for g in self._groups.values() if g.claimed.entry_id == entry_id), None)
        status = {ACCEPTED: "accepted", DUPLICATE: "duplicate"}.get(ack.status, "rejected")
        self.metrics.trajectories.labels(status=status).inc()
        if g is None or index in g.acks:
            return
        g.acks[index] = ack
        if status == "rejected":
            log.warning("trainer rejected %s: %s", ack.trajectory_id, ack.reason or "no reason given")
            g.reason = g.reason or f"{ack.trajectory_id}: {ack.reason or 'rejected'}"
        if len(g.acks) == g.claimed.group.n:
            g.settle = "retry" if g.reason else "ack"
            self._settle_all()

    def _settle_all(self) -> None:
        for gid, g in list(self._groups.items()):
            if not g.settle or time.monotonic() < self._redis_retry_at:
                continue
            try:
                if g.settle == "ack":
                    self.work.ack(g.claimed.entry_id)
                elif not g.lost:
                    self.work.retry(g.claimed, g.reason)
            except redis.RedisError as exc:
                self._redis_failed(exc)
                return
            del self._groups[gid]
            self._drain_counts[0] += self.draining
            self._start_deferred(gid)

    def _start_deferred(self, gid: str) -> None:
        for c in self._deferred:
            if c.group.group_id == gid:
                self._deferred.remove(c)
                self._start(c)
                return

    def _redis_failed(self, exc: Exception) -> None:
        delay = self._redis_backoff.next()
        self._redis_retry_at = time.monotonic() + delay
        self._group_ready = False
        log.warning("redis: %s (retrying in %.1f s)", exc, delay)

    def _housekeeping(self) -> None:
        now = time.monotonic()
        if now < self._redis_retry_at:
            return
        try:
            self._settle_all()
            if now >= self._next_lag:
                self._next_lag = now + 2.0
                backlog = self.work.backlog()
                if backlog is not None:
                    if backlog.lag is not None:
                        self.metrics.queue_lag.set(backlog.lag)
                    self.metrics.queue_pending.set(backlog.pending)
            self._redis_backoff.reset()
        except redis.RedisError as exc:
            self._redis_failed(exc)

    def _publish_owned(self) -> None:
        owned = {g.claimed.entry_id for g in self._groups.values()} | {c.entry_id for c in self._deferred}
        self._owned = frozenset(owned)

    def _heartbeat_loop(self) -> None:
        while not self._heartbeat_stop.wait(self.config.queue.claim_idle_s / 3):
            owned = list(self._owned)
            if not owned:
                continue
            try:
                lost = self.work.heartbeat(owned)
            except redis.RedisError as exc:
                log.warning("heartbeat: %s", exc)
                continue
            if lost:
                self._events.put(("lost", lost))

    def _mark_lost(self, lost: set[str]) -> None:
        for g in self._groups.values():
            if g.claimed.entry_id in lost and not g.lost:
                g.lost = True
                log.warning("entry %s was taken over by a peer; finishing it anyway", g.claimed.entry_id)
        # A deferred entry a peer took is the peer's now: forget it.
        self._deferred = [c for c in self._deferred if c.entry_id not in lost]

    def _show_in_flight(self) -> None:
        self.in_flight_sequences = self.engine.in_flight
        self.metrics.in_flight.set(self.in_flight_sequences)

    # ---- drain ---------------------------------------------------------------------------------------

    def _start_drain(self, grace_s: float, exit_after: bool, future: Future | None) -> None:
        if not self.draining:
            self.draining = True
            self._drain_deadline = time.monotonic() + grace_s
            self._drain_counts = [0, 0]
            log.info("draining: %d groups in flight, %.1f s grace", len(self._groups), grace_s)
        else:
            self._drain_deadline = min(self._drain_deadline, time.monotonic() + grace_s)
        self._exit_after_drain |= exit_after
        if future is not None:
            self._drain_waiters.append(future)

    def _drain_done(self) -> bool:
        if self._groups or self._deferred:
            if time.monotonic() < self._drain_deadline:
                return False
            self._hand_back_all()
        counts = tuple(self._drain_counts)
        if self._drain_waiters or self._exit_after_drain:
            log.info("drained: %d groups finished, %d handed back", *counts)
        for future in self._drain_waiters:
            if not future.done():
                future.set_result(counts)
        self._drain_waiters.clear()
        return True

    def _hand_back_all(self) -> None:
        self._settle_all()
        for gid in self._groups:
            self.engine.abort(gid)
        # The trainer holds all of a group settled "ack" (only our XACK failed): leave it pending, as a reclaim
        # costs duplicates only. Redis is tried until it fails once: every later try would wait out the socket
        # timeout too, one per group, holding a SIGTERMed generator far past its grace.
        back = [g.claimed for g in self._groups.values() if g.settle != "ack"] + self._deferred
        self._drain_counts[1] += len(self._groups) + len(self._deferred)
        for i, c in enumerate(back):
            try:
                self.work.hand_back(c)
            except redis.RedisError as exc:
                log.warning(
                    "cannot hand back %s (%s); it and %d more stay pending and will be reclaimed",
                    c.entry_id,
                    exc,
                    len(back) - i - 1,
                )
                break
        self._groups.clear()
        self._deferred.clear()
        self._show_in_flight()

    # ---- swaps (engine thread) -----------------------------------------------------------------------

    def apply_schedule(self, schedule: Schedule | None, swap: bool = True) -> int:
        """Engine thread: use `schedule` from the next step; returns the version in force (refusals raise).

        `swap` False is the start-up schedule, which is not counted as a hot swap.
        """
        try:
            self.engine.set_schedule(schedule)
        except (EngineError, ValueError):
            if swap:
                self.metrics.swaps.labels(kind="schedule", outcome="refused").inc()
            raise
        self.schedule = schedule
        self.serving = self.engine.versions
        self.metrics.show_schedule(schedule)
        if swap:
            self.metrics.swaps.labels(kind="schedule", outcome="ok").inc()
        return schedule.version if schedule is not None else 0

    def apply_probe(self, probe: Probe | None) -> None:
        """Engine thread: hand the probe request to the engine (refusals raise EngineError and keep the last).

        The controller renews its request every tick (a later `expires_at`); only a request that asks for
        something else is counted as a swap and logged.
        """
        what = None if probe is None else (probe.schedule_version, probe.share, probe.budgets)
        try:
            self.engine.set_probe(probe)
        except EngineError:
            self.metrics.swaps.labels(kind="probe", outcome="refused").inc()
            raise
        if what == self._probe_asked:
            return
        self._probe_asked = what
        self.metrics.swaps.labels(kind="probe", outcome="ok").inc()
        if probe is not None:
            log.info(
                "probe request for schedule v%d: share %.3f, budgets %s",
                probe.schedule_version,
                probe.share,
                list(probe.budgets),
            )
        else:
            log.info("probe request cleared")

    def _load(self, kind: str, folder: Path, version: int) -> EngineVersions:
        with self._phase("weight_sync"):
            if kind == POLICY:
                self.engine.load_policy(folder, version)
            else:
                self.engine.load_adapter(folder, version)
        self.serving = self.engine.versions
        self.metrics.show_versions(self.serving.policy_version, self.serving.adapter_version)
        return self.serving

    def _on_trainer_hello(self, hello: rollout_pb2.TrainerHello) -> None:
        if self.sync is not None and self.config.trainer.follow_versions:
            self.sync.offer(hello.latest.policy_version, hello.latest.adapter_version)
