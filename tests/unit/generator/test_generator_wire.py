"""Finished samples on the wire (deterministic ids, every field carried) and the reconnect backoff."""

import random

import pytest

from services.api.sparrow.v1 import rollout_pb2
from services.generator.engine import FINISH_LENGTH, FINISH_STOP, EngineVersions, FinishedSample
from services.generator.trajectory_stream import Backoff, to_trajectory, trajectory_id


def _sample(finish=FINISH_STOP) -> FinishedSample:
    return FinishedSample(
        group_id="g-1",
        sample_index=3,
        prompt_token_ids=[5, 6, 7],
        token_ids=[9, 2],
        logprobs=[-0.5, -1.25],
        top_token_ids=[[9, 4], [2, 9]],
        top_logprobs=[[-0.5, -1.0], [-1.25, -2.0]],
        kv_budgets=[0, 32],
        versions=EngineVersions(4, 2, 9),
        finish_reason=finish,
        queue_seconds=0.25,
        generate_seconds=1.5,
    )


def test_trajectory_carries_every_field_and_a_deterministic_id():
    t = to_trajectory(_sample(), attempt=2, generator_id="gen-a")
    assert t.trajectory_id == trajectory_id("g-1", 2, 3) == "g-1/2/3"
    assert (t.group_id, t.sample_index, t.generator_id) == ("g-1", 3, "gen-a")
    assert list(t.prompt_token_ids) == [5, 6, 7] and list(t.token_ids) == [9, 2]
    assert list(t.logprobs) == [-0.5, -1.25] and list(t.kv_budgets) == [0, 32]
    assert [list(p.token_ids) for p in t.top_logprobs] == [[9, 4], [2, 9]]
    assert [list(p.logprobs) for p in t.top_logprobs] == [[-0.5, -1.0], [-1.25, -2.0]]
    assert (t.versions.policy_version, t.versions.adapter_version, t.versions.schedule_version) == (4, 2, 9)
    assert t.finish_reason == rollout_pb2.FINISH_REASON_STOP
    assert t.timings.queue_seconds == 0.25 and t.timings.generate_seconds == 1.5
    assert to_trajectory(_sample(FINISH_LENGTH), 0, "g").finish_reason == rollout_pb2.FINISH_REASON_LENGTH


def test_top_lists_of_another_length_than_the_tokens_are_refused():
    bad = _sample()
    bad.top_token_ids = [[9]]
    with pytest.raises(ValueError):
        to_trajectory(bad, 0, "g")


def test_backoff_grows_jittered_capped_and_resets():
    b = Backoff(0.1, 1.0, random.Random(0))
    delays = [b.next() for _ in range(8)]
    for i, d in enumerate(delays):
        ceiling = min(1.0, 0.1 * 2**i)
        assert ceiling / 2 <= d <= ceiling
    assert len({round(d, 6) for d in delays[4:]}) > 1  # jitter: capped delays still differ
    b.reset()
    assert 0.05 <= b.next() <= 0.1
