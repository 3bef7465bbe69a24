"""Following the controller's schedule in a real Redis: key at start, pub/sub, poll backstop, reconnect, garbage."""

import threading
import time

import pytest
import redis

from services.generator.schedule_watch import ScheduleWatch
from services.generator.trajectory_stream import Backoff
from sparrow import metrics_contract as mc
from sparrow.schedule import Schedule
from tests.servers import redis_server, wait_until


@pytest.fixture(scope="module")
def redis_url():
    with redis_server() as server:
        yield server.url


@pytest.fixture
def client(redis_url):
    c = redis.Redis.from_url(redis_url)
    c.flushdb()
    yield c
    c.close()


class _Seen:
    def __init__(self):
        self.schedules, self.invalid = [], []
        self.lock = threading.Lock()

    def versions(self):
        with self.lock:
            return [s.version for s in self.schedules]


def _watch(redis_url, seen, poll_s):
    def on_schedule(s):
        with seen.lock:
            seen.schedules.append(s)

    return ScheduleWatch(redis_url, on_schedule, poll_s, seen.invalid.append, Backoff(0.05, 0.2)).start()


def _publish(client, schedule, notify=True):
    text = schedule.to_json()
    client.set(mc.SCHEDULE_KEY, text)
    if notify:
        client.publish(mc.SCHEDULE_UPDATES_CHANNEL, text)


def test_key_at_start_then_each_published_version_in_order(client, redis_url):
    _publish(client, Schedule(budgets=(512,), version=3))
    seen = _Seen()
    watch = _watch(redis_url, seen, poll_s=60)
    try:
        wait_until(lambda: seen.versions() == [3], 10, "the stored schedule read at start")
        wait_until(lambda: client.pubsub_numsub(mc.SCHEDULE_UPDATES_CHANNEL)[0][1] == 1, 10, "subscribed")
        _publish(client, Schedule(budgets=(512, 1024), version=4))
        wait_until(lambda: seen.versions() == [3, 4], 10, "v4 through pub/sub")
        assert seen.schedules[-1].budgets == (512, 1024)
        client.publish(mc.SCHEDULE_UPDATES_CHANNEL, Schedule(budgets=(256,), version=2).to_json())  # older: ignored
        _publish(client, Schedule(budgets=(768,), version=5))
        wait_until(lambda: seen.versions()[-1] == 5, 10, "v5")
        assert seen.versions() == [3, 4, 5]
    finally:
        watch.close()


def test_an_invalid_schedule_is_reported_once_and_the_last_good_one_stays(client, redis_url):
    seen = _Seen()
    watch = _watch(redis_url, seen, poll_s=0.2)
    try:
        wait_until(lambda: client.pubsub_numsub(mc.SCHEDULE_UPDATES_CHANNEL)[0][1] == 1, 10, "subscribed")
        _publish(client, Schedule(budgets=(512,), version=1))
        wait_until(lambda: seen.versions() == [1], 10, "v1")
        client.set(mc.SCHEDULE_KEY, '{"budgets": [100], "version": 2}')  # not a multiple of 16
        client.publish(mc.SCHEDULE_UPDATES_CHANNEL, '{"budgets": [100], "version": 2}')
        wait_until(lambda: len(seen.invalid) == 1, 10, "the invalid schedule reported")
        time.sleep(0.6)  # several polls re-read the same garbage
        assert len(seen.invalid) == 1 and "multiple of the page size" in seen.invalid[0]
        assert seen.versions() == [1]
    finally:
        watch.close()


def test_the_poll_backstop_finds_a_version_whose_message_was_lost(client, redis_url):
    seen = _Seen()
    watch = _watch(redis_url, seen, poll_s=0.3)
    try:
        _publish(client, Schedule(budgets=(512,), version=7), notify=False)
        wait_until(lambda: seen.versions() == [7], 10, "v7 by polling the key")
    finally:
        watch.close()


def test_after_a_dropped_connection_the_key_is_read_again(client, redis_url):
    seen = _Seen()
    watch = _watch(redis_url, seen, poll_s=600)  # no polling: only the reconnect can find v2
    try:
        wait_until(lambda: client.pubsub_numsub(mc.SCHEDULE_UPDATES_CHANNEL)[0][1] == 1, 10, "subscribed")
        _publish(client, Schedule(budgets=(512,), version=1))
        wait_until(lambda: seen.versions() == [1], 10, "v1")
        _publish(client, Schedule(budgets=(1024,), version=2), notify=False)
        client.client_kill_filter(_type="pubsub")
        wait_until(lambda: seen.versions() == [1, 2], 10, "v2 read after reconnecting")
    finally:
        watch.close()


def test_the_controllers_probe_request_is_handed_on_when_it_changes_and_cleared_when_gone(client, redis_url):
    import asyncio

    import redis.asyncio as aioredis

    from services.controller.publisher import SchedulePublisher

    async def set_probe(budgets, ttl_s=60.0):  # written by the controller's own publisher
        c = aioredis.Redis.from_url(redis_url)
        try:
            await SchedulePublisher(c).set_probe(3, 0.1, budgets, 2, ttl_s)
        finally:
            await c.aclose()

    probes = []
    watch = ScheduleWatch(redis_url, lambda s: None, 0.2, on_probe=probes.append, backoff=Backoff(0.05, 0.2)).start()
    try:
        asyncio.run(set_probe({1: 64}))
        wait_until(lambda: probes and probes[-1] is not None, 10, "the probe request")
        assert probes[-1].schedule_version == 3 and probes[-1].budgets == (None, 64) and probes[-1].share == 0.1
        time.sleep(0.6)  # polls re-read the same request: not handed on again
        assert len(probes) == 1
        client.set(mc.PROBE_KEY, '{"share": 2}')
        wait_until(lambda: probes[-1] is None, 10, "an unreadable request clears the probe")
        asyncio.run(set_probe({0: 48}, ttl_s=0.5))
        wait_until(lambda: probes[-1] is not None and probes[-1].budgets == (48, None), 10, "a new request")
        wait_until(lambda: probes[-1] is None, 10, "cleared once it expired")
        assert len(probes) == 4
    finally:
        watch.close()
