"""The control loop against a real Redis that loses its schedule: the schedule in force comes back above its version.

Generators keep the last schedule version they saw and ignore any version not above it, so a schedule
that Redis lost (flushed, or a failover to a replica that missed the last writes) must come back under
a higher version, with the budgets the generators run. Prometheus is unreachable: the loop is blind,
which the schedule store does not depend on.
"""

from __future__ import annotations

import asyncio
import json

import redis

from services.controller.config import ControllerConfig
from services.controller.main import build_loop
from sparrow import metrics_contract as mc
from sparrow.config import load_config
from sparrow.schedule import Schedule
from tests.servers import free_port, redis_server

HELD = [512, 1024, 2048, 4096]


def _blind_loop(redis_url: str):
    overrides = {
        "redis.url": redis_url,
        "prometheus.url": f"http://127.0.0.1:{free_port()}",  # nothing listens there
        "prometheus.timeout_s": 0.5,
    }
    return build_loop(load_config(ControllerConfig, overrides=overrides))


def _run(loop, body) -> None:
    async def main() -> None:
        try:
            await body()
        finally:
            await loop.source.aclose()
            await loop.publisher.client.aclose()

    asyncio.run(main())


def test_a_schedule_redis_lost_or_holds_older_comes_back_above_the_version_in_force():
    with redis_server() as rs, redis.Redis.from_url(rs.url) as r:
        loop = _blind_loop(rs.url)

        def stored() -> dict:
            return json.loads(r.get(mc.SCHEDULE_KEY))

        async def body() -> None:
            await loop.tick()  # publishes the initial schedule: v1
            for _ in range(3):
                await loop.override({"budgets": HELD}, "ops", pause=False)
            assert stored()["version"] == 4

            r.flushdb()
            await loop.tick()
            assert stored()["version"] == 5 and stored()["budgets"] == HELD
            assert loop.schedule.version == 5 and loop.store_error is None
            entry = json.loads(r.lindex(mc.SCHEDULE_HISTORY_KEY, -1))
            assert entry["source"] == "restore" and entry["version"] == 5

            # An older version over the current one (a replica that missed the last writes), history lost too.
            r.delete(mc.SCHEDULE_HISTORY_KEY)
            r.set(mc.SCHEDULE_KEY, Schedule(budgets=(512, 512, 512, 512), version=2).to_json())
            await loop.tick()
            assert stored()["version"] == 6 and stored()["budgets"] == HELD
            assert loop.schedule.version == 6 and list(loop.schedule.budgets) == HELD

        _run(loop, body)


def test_a_schedule_in_redis_whose_pages_do_not_divide_the_budget_grid_is_a_store_error_not_a_failed_tick():
    with redis_server() as rs, redis.Redis.from_url(rs.url) as r:
        loop = _blind_loop(rs.url)

        async def body() -> None:
            await loop.tick()
            # Written by someone else: a valid schedule, but on pages of 48 tokens the grid cannot step on.
            r.set(mc.SCHEDULE_KEY, Schedule(budgets=(480, 960), page_size=48, version=7).to_json())
            await loop.tick()  # raised ValueError out of the tick before
            assert loop.store_error is not None and "page size 48" in loop.store_error
            assert json.loads(r.get(mc.SCHEDULE_KEY))["version"] == 7  # held, not overwritten

        _run(loop, body)
