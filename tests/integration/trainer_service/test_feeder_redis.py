"""The feeder against a real redis-server: parseable prompt groups on the stream, answers kept by the trainer,
a bounded queue, an idempotent consumer group, dead letters counted, and a restart that neither repeats
nor skips a prompt."""

import time

import redis

from services.trainer.config import TrainerServiceConfig
from services.trainer.feeder import Feeder, FeedSettings
from services.trainer.ledger import DEAD, GroupLedger
from services.trainer.metrics import TrainerMetrics
from services.trainer.store import TrajectoryStore
from services.trainer.training_data import build_training_data
from sparrow.rewards import chain_reward
from sparrow.tasks import ChainTask, ExampleStream
from sparrow.work import DEAD_LETTER_STREAM, GENERATOR_GROUP, PROMPTS_STREAM, PromptGroup, Sampling
from tests.integration.trainer_service.helpers import TINY
from tests.servers import redis_server
from trainer.model_io import load_tokenizer

TASK = ChainTask(4, 2)
SAMPLING = Sampling(temperature=1.0, top_p=1.0, max_new_tokens=16, top_logprobs=20)


def _data():
    # The chain rows in stream order (no shuffle), so the groups follow ExampleStream(TASK, 7, "train").
    config = TrainerServiceConfig(model_dir=str(TINY), task={"pairs": 4, "min_hops": 1, "max_hops": 2, "seed": 7,
                                                              "count": 64})  # fmt: skip
    return build_training_data(config, load_tokenizer(TINY))


def _feeder(url, run_dir, outstanding=3, version=1, metrics=None, requeue_after_s=900.0, finished=None):
    ledger = GroupLedger(run_dir, finished)
    settings = FeedSettings("run1", _data(), seed=7, n=4, sampling=SAMPLING, outstanding=outstanding,
                            requeue_after_s=requeue_after_s, shuffle=False)  # fmt: skip
    store = TrajectoryStore(run_dir)
    feeder = Feeder(redis.Redis.from_url(url), ledger, store, settings, lambda: version,
                    metrics or TrainerMetrics(2000, 20))  # fmt: skip
    return feeder, ledger


def _stream(client):
    return [(eid, PromptGroup.from_fields(fields)) for eid, fields in client.xrange(PROMPTS_STREAM)]


def test_groups_on_the_stream_parse_and_answers_stay_with_the_trainer(tmp_path):
    with redis_server() as server:
        metrics = TrainerMetrics(2000, 20)
        feeder, ledger = _feeder(server.url, tmp_path, outstanding=3, version=5, metrics=metrics)
        feeder.tick()
        client = redis.Redis.from_url(server.url)
        entries = _stream(client)
        assert all(b"answer" not in fields[b"group"] for _, fields in client.xrange(PROMPTS_STREAM))
        assert len(entries) == 3 and metrics.outstanding._value.get() == 3
        tok = load_tokenizer(TINY)
        expected = ExampleStream(TASK, 7, "train").take(3)
        for (_, group), example in zip(entries, expected, strict=True):
            assert group.n == 4 and group.policy_version == 5 and group.sampling == SAMPLING
            assert tok.decode(list(group.prompt_token_ids), skip_special_tokens=True) == example.prompt
            assert group.prompt_token_ids[0] == tok.bos_token_id
            record = ledger.get(group.group_id)
            assert (record.data_source, record.reward) == ("chain", "chain")
            assert record.answer == example.answer and record.prompt_token_ids == group.prompt_token_ids
            assert chain_reward(f"1 a b ; \\boxed{{ {example.answer} }}", record.answer) == 1.0
        assert len({g.group_id for _, g in entries}) == 3 and all(g.group_id.startswith("run1-") for _, g in entries)
        feeder.tick()  # the bound holds: nothing more until a step takes some
        assert len(_stream(client)) == 3
        ledger.take([entries[0][1].group_id])
        feeder.tick()
        assert len(_stream(client)) == 4
        # The consumer group exists (made idempotently) and hands the entries to a generator.
        feeder.ensure_consumer_group()
        got = client.xreadgroup(GENERATOR_GROUP, "gen-a", {PROMPTS_STREAM: ">"}, count=10)
        assert len(got[0][1]) == 4


def test_a_restart_continues_the_prompt_stream_and_requeues_unconfirmed_groups(tmp_path):
    with redis_server() as server:
        feeder, ledger = _feeder(server.url, tmp_path, outstanding=2)
        feeder.tick()
        trained = [r.group_id for r in ledger.outstanding()]
        ledger.take(trained)
        state = feeder.state()  # what the checkpoint after training them holds
        feeder._new_group()  # a group recorded, then a crash before it reached the stream
        ledger.close()
        feeder.store.close()
        client = redis.Redis.from_url(server.url)
        assert len(_stream(client)) == 2

        again, ledger2 = _feeder(server.url, tmp_path, outstanding=2, finished=dict.fromkeys(trained, "trained"))
        again.restore(state)
        again.tick()
        groups = [g for _, g in _stream(client)]
        # The unconfirmed group went out, then one new one: four distinct prompts, in stream order.
        assert [g.group_id for g in groups] == [f"run1-{i:08d}" for i in range(4)]
        expected = [ex.prompt for ex in ExampleStream(TASK, 7, "train").take(4)]
        assert [g.prompt_text for g in groups] == expected
        assert ledger2.unqueued() == []


def test_dead_letters_of_own_groups_are_counted_once(tmp_path):
    with redis_server() as server:
        metrics = TrainerMetrics(2000, 20)
        feeder, ledger = _feeder(server.url, tmp_path, outstanding=2, metrics=metrics)
        feeder.tick()
        client = redis.Redis.from_url(server.url)
        (_, first), (_, second) = _stream(client)
        client.xadd(DEAD_LETTER_STREAM, {**first.retried().to_fields(), "reason": "engine failed 3 times"})
        client.xadd(DEAD_LETTER_STREAM, {"group_id": "someone-else", "reason": "not ours"})
        client.xadd(DEAD_LETTER_STREAM, {"garbage": "x"})
        feeder.tick()
        assert ledger.state(first.group_id) == DEAD and "3 times" in ledger.dead_reason(first.group_id)
        assert metrics.groups_dead._value.get() == 1
        assert len(ledger.outstanding()) == 2  # a fresh group replaced the dead one
        client.xadd(DEAD_LETTER_STREAM, {**first.to_fields(), "reason": "again"})
        feeder.tick()
        assert metrics.groups_dead._value.get() == 1 and ledger.state(second.group_id) != DEAD


def test_redis_down_is_survived_and_a_stalled_group_is_enqueued_again(tmp_path):
    with redis_server() as server:
        url = server.url
        feeder, ledger = _feeder(url, tmp_path, outstanding=1, requeue_after_s=0.01)
        feeder.tick()
        client = redis.Redis.from_url(url)
        assert len(_stream(client)) == 1
        time.sleep(0.05)
        feeder.tick()  # nobody produced its samples in time: the same group goes out again
        ids = [g.group_id for _, g in _stream(client)]
        assert len(ids) == 2 and len(set(ids)) == 1
    feeder.tick()  # Redis is gone: logged, not raised
    assert len(ledger.outstanding()) == 1


def test_a_flushed_redis_gets_every_waiting_group_back_at_once(tmp_path):
    with redis_server() as server:
        feeder, ledger = _feeder(server.url, tmp_path, outstanding=3)  # requeue_after_s: 15 minutes
        feeder.tick()
        client = redis.Redis.from_url(server.url)
        client.xreadgroup(GENERATOR_GROUP, "gen-a", {PROMPTS_STREAM: ">"}, count=1)  # one is being generated
        waiting = [r.group_id for r in ledger.outstanding()]
        feeder.tick()
        assert len(_stream(client)) == 3  # nothing lost, nothing added twice
        client.flushall()  # or Redis restarted without its data: the queued groups are gone with it
        feeder.tick()
        assert sorted(g.group_id for _, g in _stream(client)) == waiting
        got = client.xreadgroup(GENERATOR_GROUP, "gen-a", {PROMPTS_STREAM: ">"}, count=10)
        assert len(got[0][1]) == 3  # the consumer group is back and hands them out
        assert [r.group_id for r in ledger.outstanding()] == waiting  # the same groups, not new prompts
        feeder.tick()
        assert len(_stream(client)) == 3
