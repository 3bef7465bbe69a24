"""Follows the controller's schedule in Redis (keys in `sparrow.metrics_contract`) and hands new versions on.

Redis is the source of truth: the key `SCHEDULE_KEY` holds the current schedule, and every publish
also goes out on `SCHEDULE_UPDATES_CHANNEL`. Pub/sub drops messages sent while a subscriber is
away, so the watcher subscribes first and then reads the key, on start and after every
reconnect; it also re-reads the key every `poll_s` as a backstop. Only a version above the last
one handed on is passed to `on_schedule` (the engine applies it from its next step). A key that
does not hold a valid schedule is logged and reported to `on_invalid`; the schedule in force stays.

The probe request (`PROBE_KEY`) is read along with the key (so at least every `poll_s`); each
change is handed to `on_probe` as a `Probe`, or None once the key is gone, expired or unreadable
(an unreadable one is logged once).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import redis

from services.generator.trajectory_stream import Backoff
from sparrow import metrics_contract as mc
from sparrow.probe import Probe, ProbeError
from sparrow.schedule import Schedule, ScheduleError

log = logging.getLogger("sparrow.generator.schedule")


class ScheduleWatch:
    """A background thread delivering each new schedule version from Redis to `on_schedule`."""

    def __init__(
        self,
        redis_url: str,
        on_schedule: Callable[[Schedule], None],
        poll_s: float = 10.0,
        on_invalid: Callable[[str], None] | None = None,
        backoff: Backoff | None = None,
        on_probe: Callable[[Probe | None], None] | None = None,
    ) -> None:
        self.redis_url = redis_url
        self.on_schedule = on_schedule
        self.on_invalid = on_invalid
        self.poll_s = poll_s
        self.version = -1  # the last version handed on
        self.on_probe = on_probe
        self.probe: Probe | None = None  # the last probe request handed on
        self._probe_raw: bytes | None = None
        self._bad: str | None = None  # the last invalid text reported, so it is reported once
        self._backoff = backoff or Backoff(0.2, 10.0)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="schedule-watch", daemon=True)

    def start(self) -> ScheduleWatch:
        """Start following in the background; returns self."""
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop following."""
        self._closed.set()
        if self._thread.is_alive():
            self._thread.join(5)

    def _run(self) -> None:
        while not self._closed.is_set():
            client = redis.Redis.from_url(self.redis_url, socket_timeout=5, socket_connect_timeout=5)
            pubsub = client.pubsub(ignore_subscribe_messages=True)
            try:
                pubsub.subscribe(mc.SCHEDULE_UPDATES_CHANNEL)
                self._read_key(client)
                self._backoff.reset()
                next_poll = time.monotonic() + self.poll_s
                while not self._closed.is_set():
                    message = pubsub.get_message(timeout=min(0.5, self.poll_s))
                    if message is not None and message.get("type") == "message":
                        self._offer(message["data"], "pub/sub")
                    if time.monotonic() >= next_poll:
                        self._read_key(client)
                        next_poll = time.monotonic() + self.poll_s
            except redis.RedisError as exc:
                if not self._closed.is_set():
                    log.warning("schedule watch on %s: %s (reconnecting)", self.redis_url, exc)
            except Exception:
                log.exception("schedule watch failed")
            finally:
                pubsub.close()
                client.close()
            if self._closed.wait(self._backoff.next()):
                break

    def _read_key(self, client: redis.Redis) -> None:
        raw = client.get(mc.SCHEDULE_KEY)
        if raw is not None:
            self._offer(raw, "key")
        raw = client.get(mc.PROBE_KEY)
        if raw == self._probe_raw and (self.probe is None or not self.probe.expired()):
            return
        self._probe_raw = raw
        probe = None
        if raw is not None:
            try:
                probe = Probe.from_json(raw)
            except ProbeError as exc:
                log.error("ignoring an unreadable probe request from Redis: %s", exc)
            else:
                if probe.expired():
                    probe = None
        if probe != self.probe:
            self.probe = probe
            if self.on_probe is not None:
                self.on_probe(probe)

    def _offer(self, raw: bytes | str, source: str) -> None:
        text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
        try:
            schedule = Schedule.from_json(text)
        except ScheduleError as exc:
            if text != self._bad:
                self._bad = text
                message = f"ignoring an invalid schedule from Redis ({source}): {exc}"
                log.error("%s", message)
                if self.on_invalid is not None:
                    self.on_invalid(message)
            return
        if schedule.version <= self.version:
            return
        self.version = schedule.version
        log.info("schedule v%d from Redis (%s): %s", schedule.version, source, schedule.compact())
        self.on_schedule(schedule)
