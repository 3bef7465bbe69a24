"""Publishes schedule versions to Redis, the source of truth the generators read (keys in sparrow.metrics_contract)."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import WatchError

from sparrow import metrics_contract as mc
from sparrow.schedule import Schedule, ScheduleError

log = logging.getLogger("sparrow.controller")


class StoreError(RuntimeError):
    """Redis could not be read or written, or holds something that is not a schedule."""


class VersionConflict(StoreError):
    """The current schedule changed under us (another writer); nothing was written."""


def validated(schedule: Schedule) -> Schedule:
    """`schedule` passed once more through the core's validator in its JSON form, exactly as readers will parse it."""
    return Schedule.from_json(schedule.to_json())


class SchedulePublisher:
    """Reads the current schedule and writes new versions atomically (current, history, notification)."""

    def __init__(self, client: aioredis.Redis, history_limit: int = 1000) -> None:
        self.client = client
        self.history_limit = history_limit

    async def current(self) -> Schedule | None:
        """The schedule in Redis (None when there is none yet)."""
        try:
            raw = await self.client.get(mc.SCHEDULE_KEY)
        except Exception as exc:  # redis-py raises several families (connection, timeout, response)
            raise StoreError(f"cannot read {mc.SCHEDULE_KEY}: {exc}") from None
        if raw is None:
            return None
        try:
            return Schedule.from_json(raw.decode() if isinstance(raw, bytes) else raw)
        except ScheduleError as exc:
            raise StoreError(f"{mc.SCHEDULE_KEY} holds an invalid schedule: {exc}") from None

    async def publish(
        self,
        schedule: Schedule,
        reason: str,
        source: str,
        decisions: list[dict[str, Any]] | None = None,
        predicted_speedup: float | None = None,
        expected_version: int | None = None,
        above: int = 0,
    ) -> Schedule:
        """Write `schedule` as the next version and notify subscribers; returns what was written.

        The version is the stored one plus one (whatever `schedule.version` says), so versions only
        grow; it is also above `above`, a version the caller knows was in force (Redis may have lost
        it). With `expected_version`, nothing is written unless the stored version still equals it.
        Raises ScheduleError (never written) for an invalid schedule and StoreError for Redis trouble.
        """
        validated(schedule)
        try:
            async with self.client.pipeline(transaction=True) as pipe:
                await pipe.watch(mc.SCHEDULE_KEY, mc.SCHEDULE_HISTORY_KEY)
                stored = _stored_version(await pipe.get(mc.SCHEDULE_KEY))
                if expected_version is not None and stored != expected_version:
                    raise VersionConflict(f"schedule is at version {stored}, expected {expected_version}")
                # The history remembers the last version even if the current key was wiped or garbled.
                last = await pipe.lindex(mc.SCHEDULE_HISTORY_KEY, -1)
                base = max(stored or 0, _stored_version(last) or 0, above)
                new = validated(dataclasses.replace(schedule, version=base + 1))
                entry = {
                    "version": new.version,
                    "schedule": new.to_dict(),
                    "reason": reason,
                    "source": source,
                    "decisions": decisions or [],
                    # None, not NaN, when the cost model had no prediction: history is read as strict JSON too
                    "predicted_speedup": predicted_speedup
                    if predicted_speedup is not None and math.isfinite(predicted_speedup)
                    else None,
                    "time": time.time(),
                }
                text = json.dumps(new.to_dict())
                pipe.multi()
                pipe.set(mc.SCHEDULE_KEY, text)
                pipe.rpush(mc.SCHEDULE_HISTORY_KEY, json.dumps(entry))
                pipe.ltrim(mc.SCHEDULE_HISTORY_KEY, -self.history_limit, -1)
                pipe.publish(mc.SCHEDULE_UPDATES_CHANNEL, text)
                await pipe.execute()
        except WatchError:
            raise VersionConflict("schedule changed while publishing; nothing written") from None
        except (ScheduleError, StoreError):
            raise
        except Exception as exc:
            raise StoreError(f"cannot publish the schedule: {exc}") from None
        return new

    async def history(self, limit: int = 100) -> list[dict[str, Any]]:
        """The last `limit` history entries, oldest first."""
        try:
            raws = await self.client.lrange(mc.SCHEDULE_HISTORY_KEY, -limit, -1)
        except Exception as exc:
            raise StoreError(f"cannot read {mc.SCHEDULE_HISTORY_KEY}: {exc}") from None
        entries = []
        for raw in raws:  # an entry someone else wrote badly is left out, not a failure of the whole list
            try:
                entry = json.loads(raw)
            except (ValueError, RecursionError):
                entry = None
            if isinstance(entry, dict):
                entries.append(entry)
            else:
                log.warning("%s holds an entry that is not a JSON object; left out", mc.SCHEDULE_HISTORY_KEY)
        return entries

    async def set_probe(
        self, schedule_version: int, share: float, budgets: dict[int, int], num_bins: int, ttl_s: float
    ) -> None:
        """Ask generators to run `share` of new sequences at `budgets` (bin -> tokens); none clears the request."""
        try:
            if not budgets:
                await self.client.delete(mc.PROBE_KEY)
                return
            request = {
                "schedule_version": schedule_version,
                "share": share,
                "budgets": [budgets.get(i) for i in range(num_bins)],
                "expires_at": time.time() + ttl_s,
            }
            await self.client.set(mc.PROBE_KEY, json.dumps(request), px=int(ttl_s * 1000))
        except Exception as exc:
            raise StoreError(f"cannot write {mc.PROBE_KEY}: {exc}") from None


def _stored_version(raw: bytes | str | None) -> int | None:
    """The version inside a stored schedule or history entry; None when absent or unreadable."""
    if raw is None:
        return None
    try:
        version = json.loads(raw).get("version")
    except (ValueError, AttributeError):
        return None  # garbage in the key: an override may replace it
    return version if isinstance(version, int) and not isinstance(version, bool) else None
