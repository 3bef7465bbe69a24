"""The work ledger `sparrow up` writes at the end, read from a real Redis and a trainer run folder."""

import json

import redis

from services.launcher.accounting import account
from sparrow.work import DEAD_LETTER_STREAM, PROMPTS_STREAM, PromptGroup
from tests.servers import redis_server


def _trainer_dir(tmp_path, history, dropped, ledger, dead=()):
    d = tmp_path / "trainer"
    (d / "checkpoints" / "step-000000001").mkdir(parents=True)
    (d / "checkpoints" / "step-000000001" / "meta.json").write_text(json.dumps({"history": [], "dropped": []}))
    (d / "checkpoints" / "step-000000002").mkdir()
    meta = {"run_id": "r", "step": len(history), "history": history, "dropped": dropped}
    (d / "checkpoints" / "step-000000002" / "meta.json").write_text(json.dumps(meta))
    lines = [{"kind": "enqueued", "group": {"group_id": g}} for g in ledger]
    lines += [{"kind": "dead", "group_id": g, "reason": "poison"} for g in dead]
    (d / "groups.log").write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"kind": "enq')  # torn tail
    return d


def test_every_group_on_the_stream_is_trained_dropped_waiting_or_dead_and_none_twice(tmp_path):
    with redis_server() as server:
        client = redis.Redis.from_url(server.url)
        for gid in ("g1", "g2", "g2", "g3", "g4", "g5"):  # g2 was enqueued again (a lost entry)
            client.xadd(PROMPTS_STREAM, PromptGroup(gid, (1, 2, 3), 2, 1).to_fields())
        client.xadd(DEAD_LETTER_STREAM, {"group_id": "g5", "reason": "poison"})
        # An evaluation round's group: scored, never trained, compacted out of the ledger; neither lost nor waiting.
        client.xadd(PROMPTS_STREAM, PromptGroup("eval0000-test-000000", (1, 2), 4, 1).to_fields())
        trainer = _trainer_dir(tmp_path, [["g1"], ["g2"]], ["g3"], ["g3", "g4", "g5"], dead=["g5"])
        work = account(client, trainer)
        assert work == {
            "groups_enqueued": 5,
            "stream_entries": 6,
            "groups_trained": 2,
            "groups_dropped_stale": 1,
            "groups_dead": 1,
            "groups_waiting": 1,
            "pending_entries": 0,
            "lost": [],
            "trained_twice": [],
            "trained_and_dropped": [],
            "eval_groups": 1,
        }

        # A group the trainer has no trace of is lost; one in two steps is trained twice.
        client.xadd(PROMPTS_STREAM, PromptGroup("g6", (1,), 2, 1).to_fields())
        trainer = _trainer_dir(tmp_path / "b", [["g1"], ["g1", "g2"]], ["g2", "g3"], ["g4", "g5"], dead=["g5"])
        work = account(client, trainer)
        assert work["lost"] == ["g6"] and work["trained_twice"] == ["g1"] and work["trained_and_dropped"] == ["g2"]


def test_only_this_runs_groups_count_on_a_shared_redis(tmp_path):
    with redis_server() as server:
        client = redis.Redis.from_url(server.url)
        for gid in ("old-00000000", "r1-00000000", "r1-00000001"):  # "old": another run on the same Redis
            client.xadd(PROMPTS_STREAM, PromptGroup(gid, (1,), 2, 1).to_fields())
        trainer = _trainer_dir(tmp_path, [["r1-00000000"]], [], ["r1-00000001"])
        (trainer / "run.json").write_text(json.dumps({"run_id": "r1"}))
        work = account(client, trainer)
        assert (work["groups_enqueued"], work["groups_trained"], work["groups_waiting"]) == (2, 1, 1)
        assert work["lost"] == []
