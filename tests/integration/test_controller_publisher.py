"""Schedule publishing against a real Redis: versions only grow, conflicts write nothing, garbage is reported."""

from __future__ import annotations

import asyncio
import json

import pytest
import redis
import redis.asyncio as aioredis

from services.controller.publisher import SchedulePublisher, StoreError, VersionConflict
from sparrow import metrics_contract as mc
from sparrow.schedule import Schedule
from tests.servers import free_port, redis_server


@pytest.fixture(scope="module")
def redis_url():
    with redis_server() as rs:
        yield rs.url


def _run(url, body):
    async def main():
        client = aioredis.from_url(url)
        try:
            return await body(SchedulePublisher(client, history_limit=3))
        finally:
            await client.aclose()

    return asyncio.run(main())


def test_versions_grow_history_is_trimmed_and_conflicts_write_nothing(redis_url):
    sync = redis.Redis.from_url(redis_url)
    sync.flushdb()

    async def body(pub):
        assert await pub.current() is None
        first = await pub.publish(Schedule(budgets=(512, 1024), version=42), "first", "test")
        assert first.version == 1  # assigned from the store, not taken from the caller
        for i in range(4):
            await pub.publish(Schedule(budgets=(512, 1024 + 16 * i)), f"n{i}", "test", expected_version=1 + i)
        assert (await pub.current()).version == 5
        with pytest.raises(VersionConflict):
            await pub.publish(Schedule(budgets=(512, 2048)), "stale", "test", expected_version=3)
        return await pub.history(10)

    history = _run(redis_url, body)
    assert [h["version"] for h in history] == [3, 4, 5]  # history_limit 3
    assert json.loads(sync.get(mc.SCHEDULE_KEY))["budgets"] == [512, 1024 + 48]

    sync.set(mc.SCHEDULE_KEY, "not a schedule")

    async def garbled(pub):
        with pytest.raises(StoreError, match="invalid schedule"):
            await pub.current()
        # An override can replace garbage, and the version continues from the history.
        return await pub.publish(Schedule(budgets=(512,)), "repair", "override")

    assert _run(redis_url, garbled).version == 6
    sync.close()


def test_probe_request_is_written_with_an_expiry_and_cleared(redis_url):
    sync = redis.Redis.from_url(redis_url)

    async def body(pub):
        await pub.set_probe(7, 0.05, {1: 768}, num_bins=3, ttl_s=60)
        written = json.loads(sync.get(mc.PROBE_KEY))
        ttl = sync.pttl(mc.PROBE_KEY)
        await pub.set_probe(7, 0.05, {}, num_bins=3, ttl_s=60)
        return written, ttl

    written, ttl = _run(redis_url, body)
    assert written["budgets"] == [None, 768, None] and written["schedule_version"] == 7 and written["share"] == 0.05
    assert 0 < ttl <= 60000 and sync.get(mc.PROBE_KEY) is None
    sync.close()


def test_an_unreachable_redis_is_a_store_error():
    async def main():
        client = aioredis.from_url(f"redis://127.0.0.1:{free_port()}/0", socket_connect_timeout=1)
        pub = SchedulePublisher(client)
        try:
            with pytest.raises(StoreError):
                await pub.current()
            with pytest.raises(StoreError):
                await pub.publish(Schedule(budgets=(512,)), "x", "test")
        finally:
            await client.aclose()

    asyncio.run(main())


def test_history_entries_that_are_not_json_objects_are_left_out_not_a_failure(redis_url):
    sync = redis.Redis.from_url(redis_url)
    sync.flushdb()

    async def body(pub):
        await pub.publish(Schedule(budgets=(512,)), "first", "initial")
        sync.rpush(mc.SCHEDULE_HISTORY_KEY, b"[1, 2]")
        await pub.publish(Schedule(budgets=(1024,)), "second", "raise")  # the list keeps 3: v1, garbage, v2
        with_json = await pub.history(10)
        sync.lset(mc.SCHEDULE_HISTORY_KEY, 1, b"\xff{torn")
        return with_json, await pub.history(10)

    for history in _run(redis_url, body):
        assert [h["version"] for h in history] == [1, 2]
