"""The generator service end to end in one process: real Redis, a real gRPC stand-in trainer, the reference engine.

Each test enqueues prompt groups on the stream and checks what the trainer ends up holding, what is
left in Redis (pending, dead letters) and what the generator exports on /metrics.
"""

import json

from services.api.sparrow.v1 import rollout_pb2
from sparrow import metrics_contract as mc
from sparrow.schedule import Schedule
from sparrow.work import PromptGroup
from tests.integration.generator.harness import group

REJECTED = rollout_pb2.ACK_STATUS_REJECTED


def _ids(trainer, gid):
    return [t.trajectory_id for t in trainer.of_group(gid)]


def test_every_groups_trajectories_arrive_once_entries_are_acked_and_metrics_exported(start, trainer):
    h = start()
    for i in range(3):
        h.enqueue(group(f"g{i}", n=2, seed=i))
    h.wait_settled({"g0": 2, "g1": 2, "g2": 2})
    for i in range(3):
        assert _ids(trainer, f"g{i}") == [f"g{i}/0/0", f"g{i}/0/1"]
    t = trainer.of_group("g0")[0]
    assert t.generator_id == h.config.generator_id and len(t.token_ids) == len(t.logprobs) == len(t.kv_budgets)
    assert len(t.top_logprobs) == len(t.token_ids) and len(t.top_logprobs[0].token_ids) == 20
    assert t.finish_reason in (rollout_pb2.FINISH_REASON_STOP, rollout_pb2.FINISH_REASON_LENGTH)
    assert trainer.hellos[0].generator_id == h.config.generator_id
    assert h.dead() == [] and len(trainer.statuses) == 6
    assert h.metric("sparrow_generator_groups_total", outcome="done") == 3
    assert h.metric("sparrow_generator_trajectories_total", status="accepted") == 6
    tokens = sum(len(t.token_ids) for g in ("g0", "g1", "g2") for t in trainer.of_group(g))
    dense = h.metric("sparrow_generator_tokens_total", mode="dense")
    assert dense + h.metric("sparrow_generator_tokens_total", mode="sparse") == tokens and dense == tokens
    assert h.metric("sparrow_generator_queue_wait_seconds_count") == 3
    assert h.metric("sparrow_generator_step_seconds_count") >= 3
    assert h.metric("sparrow_generator_in_flight_sequences") == 0


def test_a_trainer_restart_mid_run_loses_nothing_and_delivers_nothing_twice(start, trainer):
    trainer.swallow = lambda t: t.group_id == "r0"  # r0 reaches the trainer that dies, unacked
    h = start()
    h.enqueue(group("r0", n=2))
    trainer.wait_for(lambda: len(trainer.swallowed) == 2, 60, "r0 sent")
    trainer.stop()
    trainer.swallow = None
    for i in range(1, 3):
        h.enqueue(group(f"r{i}", n=2, seed=i))
    trainer.start()
    h.wait_settled({"r0": 2, "r1": 2, "r2": 2})
    for i in range(3):
        assert _ids(trainer, f"r{i}") == [f"r{i}/0/0", f"r{i}/0/1"]
    assert h.dead() == [] and h.service.stream.connections >= 2


def test_rejected_groups_are_retried_then_dead_lettered_at_the_limit(start, trainer):
    def reject(t):
        if t.group_id == "always" or (t.group_id == "once" and t.trajectory_id.split("/")[1] == "0"):
            return "stale policy"
        return None

    trainer.reject = reject
    h = start()  # max_attempts 2
    h.enqueue(group("once", n=2))
    h.enqueue(group("always", n=2, seed=2))
    trainer.wait_for(lambda: len(trainer.of_group("once")) == 2, 60, "once accepted on its retry")
    trainer.wait_for(lambda: len(h.dead()) == 1 and h.pending() == 0, 60, "always dead-lettered")
    assert _ids(trainer, "once") == ["once/1/0", "once/1/1"]
    assert trainer.of_group("always") == []
    (dead,) = h.dead()
    assert dead["reason"].startswith("rejected on attempt 2 of 2: always/1/") and dead["reason"].endswith(
        "stale policy"
    )
    assert PromptGroup.from_json(dead["group"]).group_id == "always"
    assert h.metric("sparrow_generator_groups_total", outcome="retried") == 2
    assert h.metric("sparrow_generator_groups_total", outcome="dead_lettered") == 1
    assert h.metric("sparrow_generator_trajectories_total", status="rejected") == 6


def test_malformed_and_unservable_entries_are_dead_lettered_and_the_rest_is_generated(start, trainer):
    h = start()
    h.redis.xadd(h.config.queue.stream, {"group": "{not json"})
    h.enqueue(PromptGroup("huge-id", (1, 99999), 1, 0))  # valid JSON, outside the model's vocabulary
    h.enqueue(group("fine", n=1))
    h.wait_settled({"fine": 1})
    reasons = sorted(d["reason"] for d in h.dead())
    assert reasons[0].startswith("malformed prompt group: prompt group is not JSON")
    assert reasons[1] == "the engine refused the group: prompt token id 99999 is outside the model's vocabulary of 521"
    assert h.thread.is_alive()


def test_a_schedule_published_in_redis_mid_run_reaches_the_next_steps(start, trainer, client):
    first = Schedule(budgets=(48,), bin_width=1000, dense_layers=(), version=1)
    client.set(mc.SCHEDULE_KEY, first.to_json())
    h = start()
    h.trainer.wait_for(lambda: h.service.serving.schedule_version == 1, 30, "v1 applied")
    h.enqueue(group("before", n=1, max_new_tokens=30, pairs=20))
    h.wait_settled({"before": 1})
    second = first.with_budgets([64])
    client.set(mc.SCHEDULE_KEY, second.to_json())
    client.publish(mc.SCHEDULE_UPDATES_CHANNEL, second.to_json())
    h.trainer.wait_for(lambda: h.service.serving.schedule_version == 2, 30, "v2 applied")
    h.enqueue(group("after", n=1, max_new_tokens=30, pairs=20))
    h.wait_settled({"after": 1})
    (before,), (after,) = trainer.of_group("before"), trainer.of_group("after")
    assert before.versions.schedule_version == 1 and after.versions.schedule_version == 2
    assert set(before.kv_budgets[1:]) == {48} and set(after.kv_budgets[1:]) == {64}
    assert before.kv_budgets[0] == after.kv_budgets[0] == 0
    assert h.metric("sparrow_generator_kv_budget_tokens", bin="0") == 64
    assert h.metric("sparrow_generator_schedule_version") == 2
    assert h.metric("sparrow_generator_swaps_total", kind="schedule", outcome="ok") == 2
    assert h.metric("sparrow_generator_tokens_total", mode="sparse") > 0  # 65-token prompts: past both budgets
    assert h.metric("sparrow_generator_attended_kv_tokens_total", bin="0") < h.metric(
        "sparrow_generator_context_kv_tokens_total", bin="0"
    )
    unusable = Schedule(budgets=(96,), page_size=32, version=3)  # valid, but the kernels select 16-token pages
    client.set(mc.SCHEDULE_KEY, unusable.to_json())
    client.publish(mc.SCHEDULE_UPDATES_CHANNEL, unusable.to_json())
    h.trainer.wait_for(
        lambda: h.metric("sparrow_generator_swaps_total", kind="schedule", outcome="refused") == 1, 30, "v3 refused"
    )
    assert h.service.serving.schedule_version == 2 and h.metric("sparrow_generator_kv_budget_tokens", bin="0") == 64


def test_new_policy_and_adapter_versions_are_fetched_loaded_and_a_corrupt_one_refused(start, trainer, tmp_path):
    from tests.integration.generator.harness import SMALL, TINY

    h = start()
    trainer.publish("policy", 1, SMALL)
    trainer.wait_for(lambda: h.service.serving.policy_version == 1, 60, "policy v1 loaded")
    h.enqueue(group("p1", n=1))
    h.wait_settled({"p1": 1})
    assert trainer.of_group("p1")[0].versions.policy_version == 1
    assert h.metric("sparrow_generator_policy_version") == 1
    assert h.metric("sparrow_generator_swaps_total", kind="policy", outcome="ok") == 1

    trainer.publish("policy", 2, SMALL, corrupt=True)
    trainer.wait_for(lambda: ("policy", 2) in trainer.fetches, 30, "v2 fetched")
    trainer.wait_for(
        lambda: h.metric("sparrow_generator_swaps_total", kind="policy", outcome="refused") == 1, 30, "v2 refused"
    )
    h.enqueue(group("p2", n=1))
    h.wait_settled({"p2": 1})
    assert trainer.of_group("p2")[0].versions.policy_version == 1  # the old version keeps serving
    assert not (tmp_path / f"weights-{h.config.generator_id[4:]}" / "policy-v2").exists()

    from peft import LoraConfig, get_peft_model

    from trainer.model_io import load_model

    adapter = tmp_path / "adapter"
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], init_lora_weights=False)
    get_peft_model(load_model(TINY), lora).save_pretrained(adapter)
    trainer.publish("adapter", 1, adapter, lora_rank=4)
    trainer.wait_for(lambda: h.service.serving.adapter_version == 1, 60, "adapter v1 loaded")
    h.enqueue(group("a1", n=1))
    h.wait_settled({"a1": 1})
    v = trainer.of_group("a1")[0].versions
    assert (v.policy_version, v.adapter_version) == (1, 1)


def test_dead_letter_entries_keep_the_groups_json(start, trainer):
    trainer.reject = lambda t: "bad"
    h = start(**{"queue.max_attempts": 1})
    h.enqueue(group("x", n=1))
    trainer.wait_for(lambda: len(h.dead()) == 1, 60, "dead-lettered at once")
    assert json.loads(h.dead()[0]["group"])["group_id"] == "x"
    assert [s for _, s in trainer.statuses] == [REJECTED]


def test_a_step_longer_than_the_idle_timeout_keeps_its_entry_through_heartbeats(start, trainer, client):
    import threading

    from services.generator.work_queue import WorkQueue
    from sparrow.work import Sampling

    h = start(**{"queue.claim_idle_s": 0.3, "engine.max_model_len": 700})
    peer = WorkQueue(client, h.config.queue, "gen-peer")
    stolen, done = [], threading.Event()

    def poll():  # a peer that only takes over idle entries (new ones are the generator's to read)
        while not done.is_set():
            stolen.extend(peer._reclaim(1))
            done.wait(0.05)

    # Temperature 10 samples nearly uniformly: rows rarely meet EOS, so the one step runs to 600 tokens.
    slow = PromptGroup("slow", group("x").prompt_token_ids, 4, 0, Sampling(temperature=10.0, max_new_tokens=600))
    poller = threading.Thread(target=poll)
    poller.start()
    try:
        h.enqueue(slow)
        h.wait_settled({"slow": 4})
    finally:
        done.set()
        poller.join()
    # The scenario happened: the one step outlasted the idle timeout (by ~10x on a 2-core CPU).
    assert max(t.timings.generate_seconds for t in trainer.of_group("slow")) > 0.3
    assert stolen == [] and h.metric("sparrow_generator_groups_total", outcome="done") == 1
    assert [t.generator_id for t in trainer.of_group("slow")] == [h.config.generator_id] * 4


def test_a_group_naming_an_unpublished_policy_does_not_stop_the_generator_following_the_trainer(start, trainer):
    from tests.integration.generator.harness import SMALL

    h = start()
    odd = group("odd", n=1)
    h.enqueue(PromptGroup(odd.group_id, odd.prompt_token_ids, 1, 1_000_000, odd.sampling))
    h.wait_settled({"odd": 1})
    trainer.wait_for(lambda: ("policy", 1_000_000) in trainer.fetches, 30, "v1000000 asked for")
    trainer.publish("policy", 2, SMALL)
    trainer.wait_for(lambda: h.service.serving.policy_version == 2, 60, "policy v2 loaded")
    h.enqueue(group("after", n=1))
    h.wait_settled({"after": 1})
    assert trainer.of_group("after")[0].versions.policy_version == 2


def test_a_drain_with_redis_hung_tries_redis_once_not_once_per_group(start, trainer, caplog):
    import logging
    import os
    import signal

    import redis

    from tests.servers import redis_server

    # Each try waits out the socket timeout: one per group would hold a SIGTERMed generator far past its grace.
    trainer.swallow = lambda t: True  # no group can finish: all of them are to be handed back
    with redis_server() as server:
        client = redis.Redis.from_url(server.url)
        h = start(**{"redis.url": server.url, "queue.socket_timeout_s": 1.0, "max_in_flight_groups": 4})
        for i in range(4):
            client.xadd(h.config.queue.stream, group(f"h{i}", n=1, seed=i).to_fields())
        trainer.wait_for(lambda: len(trainer.swallowed) == 4, 60, "every group sent")
        os.kill(server.process.pid, signal.SIGSTOP)  # Redis hangs: every command waits out its timeout
        try:
            with caplog.at_level(logging.WARNING, logger="sparrow.generator"):
                assert h.service.request_drain(0.0, exit_after=True).result(60) == (0, 4)
                h.thread.join(30)
        finally:
            os.kill(server.process.pid, signal.SIGCONT)
        client.close()
    tries = [r for r in caplog.records if r.getMessage().startswith("cannot hand back")]
    assert len(tries) == 1 and "and 3 more stay pending" in tries[0].getMessage()


def test_a_speculative_generator_sends_dense_tokens_and_exports_its_acceptance_per_bin(start, trainer, tmp_path):
    schedule = tmp_path / "aggressive.json"
    Schedule(budgets=(48, 64), bin_width=64, dense_layers=(), version=2).save(schedule)
    h = start(**{"engine.decode": "speculative", "schedule.initial": str(schedule), "schedule.follow_redis": False})
    h.enqueue(group("s", n=2, max_new_tokens=40, pairs=16))
    h.wait_settled({"s": 2})
    for t in trainer.of_group("s"):
        assert list(t.kv_budgets) == [0] * len(t.token_ids) and len(t.token_ids) > 1
    drafted = sum(h.metric("sparrow_generator_draft_tokens_total", bin=b) for b in ("0", "1"))
    accepted = sum(h.metric("sparrow_generator_accepted_draft_tokens_total", bin=b) for b in ("0", "1"))
    cycles = sum(h.metric("sparrow_generator_speculative_cycles_total", bin=b) for b in ("0", "1"))
    assert drafted == 6 * cycles > 0 and 0 < accepted <= drafted
    assert h.metric("sparrow_generator_draft_alpha_count", bin="0") > 0
    # Every cycle of the batch timed: as many as the longer sample's cycles (the two rows decode together).
    timed = sum(h.metric("sparrow_generator_timed_cycles_total", bin=b) for b in ("0", "1"))
    assert cycles / 2 <= timed <= cycles
    for name in ("sparrow_generator_draft_seconds_total", "sparrow_generator_verify_seconds_total"):
        assert sum(h.metric(name, bin=b) for b in ("0", "1")) > 0, name
    assert h.metric("sparrow_generator_tokens_total", mode="sparse") == 0
