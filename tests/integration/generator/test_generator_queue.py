"""The generator's work queue against a real Redis: claim, ack, retry, dead-letter, reclaim, heartbeat, poison."""

import json
import time
import uuid

import pytest
import redis

from services.generator.config import QueueConfig
from services.generator.metrics import GeneratorMetrics
from services.generator.work_queue import DEAD_LETTERED, RETRIED, Backlog, WorkQueue
from sparrow.work import PromptGroup
from tests.servers import redis_server


@pytest.fixture(scope="module")
def redis_url():
    with redis_server() as server:
        yield server.url


@pytest.fixture
def client(redis_url):
    c = redis.Redis.from_url(redis_url)
    yield c
    c.close()


@pytest.fixture
def config():
    name = uuid.uuid4().hex[:8]
    return QueueConfig(stream=f"t:{name}", dead_letter_stream=f"t:{name}:dead", claim_idle_s=0.3, max_attempts=3)


def _queue(client, config, consumer="gen-a", **changes):
    return WorkQueue(client, config.model_copy(update=changes), consumer, GeneratorMetrics())


def _group(gid, attempt=0) -> PromptGroup:
    return PromptGroup(gid, (1, 2, 3), 2, 0, attempt=attempt)


def _dead(client, config) -> list[dict]:
    return [{k.decode(): v.decode() for k, v in f.items()} for _, f in client.xrange(config.dead_letter_stream)]


def _pending(client, config) -> int:
    return client.xpending(config.stream, config.group)["pending"]


def _count(q, outcome) -> float:
    return q.metrics.groups.labels(outcome=outcome)._value.get()


def test_entries_enqueued_before_the_group_exists_are_claimed_in_order_and_acked(client, config):
    for i in range(3):
        client.xadd(config.stream, _group(f"g{i}").to_fields())
    q = _queue(client, config)
    q.ensure_group()
    q.ensure_group()  # idempotent
    first = q.claim(2)
    assert [c.group.group_id for c in first] == ["g0", "g1"]
    assert all(not c.reclaimed and c.deliveries == 1 for c in first)
    assert q.backlog() == Backlog(lag=1, pending=2) and q.backlog().outstanding == 3 and _pending(client, config) == 2
    assert q.metrics.queue_wait._sum.get() >= 0
    q.ack(first[0].entry_id)
    assert _pending(client, config) == 1 and _count(q, "done") == 1
    assert [c.group.group_id for c in q.claim(5)] == ["g2"]
    assert q.claim(5, block_ms=50) == []


def test_malformed_entries_are_dead_lettered_with_the_reason_and_the_rest_is_kept(client, config):
    q = _queue(client, config)
    q.ensure_group()
    client.xadd(config.stream, {"other": "x"})
    client.xadd(config.stream, {"group": "not json"})
    client.xadd(config.stream, {"group": json.dumps({"group_id": "bad", "prompt_token_ids": [], "n": 1})})
    client.xadd(config.stream, _group("good").to_fields())
    claimed = q.claim(10)
    assert [c.group.group_id for c in claimed] == ["good"]
    dead = _dead(client, config)
    assert [d["reason"] for d in dead] == [
        "malformed prompt group: stream entry has no 'group' field",
        "malformed prompt group: prompt group is not JSON: Expecting value: line 1 column 1 (char 0)",
        "malformed prompt group: group bad: prompt_token_ids must be a non-empty list",
    ]
    assert json.loads(dead[0]["group"]) == {"other": "x"} and dead[1]["group"] == "not json"
    assert all(d["generator_id"] == "gen-a" and d["entry_id"] for d in dead)
    assert _pending(client, config) == 1 and _count(q, DEAD_LETTERED) == 3


def test_rejected_groups_are_retried_with_the_next_attempt_then_dead_lettered_at_the_limit(client, config):
    q = _queue(client, config)
    q.ensure_group()
    client.xadd(config.stream, _group("r").to_fields())
    attempts = []
    for _ in range(3):
        (c,) = q.claim(1)
        attempts.append(c.group.attempt)
        outcome = q.retry(c, "stale policy")
    assert attempts == [0, 1, 2] and outcome == DEAD_LETTERED
    assert _count(q, RETRIED) == 2 and _count(q, DEAD_LETTERED) == 1
    (dead,) = _dead(client, config)
    assert dead["reason"] == "rejected on attempt 3 of 3: stale policy"
    assert PromptGroup.from_json(dead["group"]).attempt == 2
    assert _pending(client, config) == 0 and q.claim(1) == []


def test_a_silent_generators_entry_is_reclaimed_after_the_idle_timeout(client, config):
    a, b = _queue(client, config, "gen-a"), _queue(client, config, "gen-b")
    a.ensure_group()
    client.xadd(config.stream, _group("k").to_fields())
    (mine,) = a.claim(1)
    assert b.claim(1) == []  # not idle long enough yet
    time.sleep(config.claim_idle_s + 0.2)
    b._next_reclaim = 0.0
    (taken,) = b.claim(1)
    assert taken.entry_id == mine.entry_id and taken.reclaimed and taken.deliveries == 2
    assert _count(b, "reclaimed") == 1
    assert a.heartbeat([mine.entry_id]) == {mine.entry_id}  # a learns it lost the entry
    assert b.heartbeat([mine.entry_id]) == set()


def test_heartbeats_keep_a_live_generators_entry_without_counting_deliveries(client, config):
    a, b = _queue(client, config, "gen-a"), _queue(client, config, "gen-b")
    a.ensure_group()
    client.xadd(config.stream, _group("h").to_fields())
    (mine,) = a.claim(1)
    for _ in range(8):  # 0.8 s in all, well past the 0.3 s idle timeout, touched every 0.1 s
        time.sleep(0.1)
        assert a.heartbeat([mine.entry_id]) == set()
        b._next_reclaim = 0.0
        assert b.claim(1) == []
    (info,) = client.xpending_range(config.stream, config.group, "-", "+", 10)
    assert info["consumer"] == b"gen-a" and info["times_delivered"] == 1


def test_an_entry_that_keeps_killing_generators_is_dead_lettered_as_poison(client, config):
    queues = [_queue(client, config, f"gen-{i}", max_deliveries=2) for i in range(3)]
    queues[0].ensure_group()
    client.xadd(config.stream, _group("poison").to_fields())
    assert len(queues[0].claim(1)) == 1
    time.sleep(config.claim_idle_s + 0.1)
    assert queues[1].claim(1)[0].deliveries == 2
    time.sleep(config.claim_idle_s + 0.1)
    assert queues[2].claim(1) == []
    (dead,) = _dead(client, config)
    assert dead["reason"] == "delivered 3 times without being finished (poison group?)"
    assert _pending(client, config) == 0


def test_hand_back_requeues_the_same_attempt_and_acks_the_old_entry(client, config):
    q = _queue(client, config)
    q.ensure_group()
    client.xadd(config.stream, _group("d", attempt=1).to_fields())
    (c,) = q.claim(1)
    q.hand_back(c)
    assert _pending(client, config) == 0
    (again,) = q.claim(1)
    assert again.entry_id != c.entry_id and again.group == c.group


def test_a_deleted_stream_is_recreated_rather_than_crashing(client, config):
    q = _queue(client, config)
    q.ensure_group()
    client.delete(config.stream)
    assert q.claim(1) == []
    client.xadd(config.stream, _group("after").to_fields())
    assert [c.group.group_id for c in q.claim(1)] == ["after"]


def test_entries_json_cannot_decode_at_all_are_dead_lettered_not_raised(client, config):
    # Nesting past the parser's recursion limit, and an integer past Python's digit limit: json.loads
    # raises RecursionError and a plain ValueError for these, not JSONDecodeError.
    q = _queue(client, config)
    q.ensure_group()
    client.xadd(config.stream, {"group": '{"group_id":' + "[" * 100_000 + "]" * 100_000 + "}"})
    client.xadd(config.stream, {"group": '{"group_id":"g","n":' + "1" * 5000 + "}"})
    client.xadd(config.stream, _group("good").to_fields())
    assert [c.group.group_id for c in q.claim(10)] == ["good"]
    reasons = [d["reason"] for d in _dead(client, config)]
    assert len(reasons) == 2 and all(r.startswith("malformed prompt group: prompt group is not JSON") for r in reasons)
    assert _pending(client, config) == 1 and _count(q, DEAD_LETTERED) == 2


def test_an_entry_whose_created_at_overflows_a_float_is_dead_lettered_not_raised(client, config):
    q = _queue(client, config)
    q.ensure_group()
    huge = {"group_id": "huge", "prompt_token_ids": [1], "n": 1, "policy_version": 0, "created_at": 10**400}
    client.xadd(config.stream, {"group": json.dumps(huge)})
    client.xadd(config.stream, _group("good").to_fields())
    assert [c.group.group_id for c in q.claim(10)] == ["good"]
    (dead,) = _dead(client, config)
    assert dead["reason"] == "malformed prompt group: group huge: created_at must be a finite number"
    assert _pending(client, config) == 1


def test_an_entry_without_a_group_and_with_bytes_that_are_not_utf8_is_dead_lettered_whole(client, config):
    q = _queue(client, config)
    q.ensure_group()
    client.xadd(config.stream, {b"other\xff": b"\xfe\x00x"})
    client.xadd(config.stream, _group("good").to_fields())
    assert [c.group.group_id for c in q.claim(10)] == ["good"]
    (dead,) = _dead(client, config)
    assert dead["reason"] == "malformed prompt group: stream entry has no 'group' field"
    assert json.loads(dead["group"]) == {"other\\xff": "\\xfe\x00x"}
    assert _pending(client, config) == 1
