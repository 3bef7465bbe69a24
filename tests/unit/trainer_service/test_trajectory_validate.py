"""Trajectory checks: a good trajectory passes; each kind of bad one is refused with a reason naming it."""

import math

import pytest

from services.api.sparrow.v1 import common_pb2, rollout_pb2
from services.trainer.ledger import GroupRecord
from services.trainer.validate import Limits, check_against_group, check_structure

LIMITS = Limits(vocab_size=50, top_k=20)
GROUP = GroupRecord(0, "g0", (1, 7, 8), n=4, answer="x", policy_version=2, max_new_tokens=6)


def good(tokens: int = 3) -> rollout_pb2.Trajectory:
    tops = [
        rollout_pb2.TopLogprobs(token_ids=list(range(10 + p, 30 + p)), logprobs=[-0.1 * (i + 1) for i in range(20)])
        for p in range(tokens)
    ]
    return rollout_pb2.Trajectory(
        trajectory_id="t0",
        group_id="g0",
        sample_index=1,
        prompt_token_ids=[1, 7, 8],
        token_ids=[10 + p for p in range(tokens)],
        logprobs=[-0.1] * tokens,
        top_logprobs=tops,
        kv_budgets=[0] * tokens,
        versions=common_pb2.Versions(policy_version=2, schedule_version=1),
    )


def _check(t):
    return check_structure(t, LIMITS, latest_policy=3, latest_adapter=0) or check_against_group(t, GROUP)


def test_a_good_trajectory_passes_and_tiny_positive_rounding_is_tolerated():
    assert _check(good()) is None
    t = good()
    t.logprobs[0] = 1e-5  # an engine's float rounding of log(1)
    assert _check(t) is None


def _mutate(fn):
    t = good()
    fn(t)
    return t


CASES = {
    "length mismatch: 3 token_ids but 2 logprobs": lambda t: t.logprobs.pop(),
    "length mismatch: 3 token_ids but 2 top_logprobs": lambda t: t.top_logprobs.pop(),
    "length mismatch: 3 token_ids but 4 kv_budgets": lambda t: t.kv_budgets.append(0),
    "logprobs must be finite": lambda t: t.logprobs.__setitem__(1, math.nan),
    "logprobs must be finite (NaN or inf": lambda t: t.logprobs.__setitem__(1, -math.inf),
    "logprobs must be <= 0": lambda t: t.logprobs.__setitem__(0, 0.5),
    "token_ids outside the vocabulary": lambda t: t.token_ids.__setitem__(0, 50),
    "prompt_token_ids outside the vocabulary": lambda t: t.prompt_token_ids.__setitem__(0, -1),
    "at position 2 are not sorted": lambda t: t.top_logprobs[2].logprobs.__setitem__(5, -0.01),
    "at position 1 has 19 entries, expected 20": lambda t: (
        t.top_logprobs[1].token_ids.pop(),
        t.top_logprobs[1].logprobs.pop(),
    ),
    "at position 0: 20 ids but 19 logprobs": lambda t: t.top_logprobs[0].logprobs.pop(),
    "top_logprobs ids outside the vocabulary": lambda t: t.top_logprobs[0].token_ids.__setitem__(3, 99),
    "at position 1 repeat a token id": lambda t: t.top_logprobs[1].token_ids.__setitem__(4, 11),
    "must not hold NaN": lambda t: t.top_logprobs[0].logprobs.__setitem__(19, math.nan),
    "kv_budgets must be >= 0": lambda t: t.kv_budgets.__setitem__(0, -16),
    "policy version 4 is from the future (latest published is 3)": lambda t: setattr(t.versions, "policy_version", 4),
    "adapter version 1 is from the future": lambda t: setattr(t.versions, "adapter_version", 1),
    "no generated tokens": lambda t: (t.ClearField("token_ids"), t.ClearField("logprobs")),
    "trajectory_id must be": lambda t: setattr(t, "trajectory_id", ""),
    "group_id must be": lambda t: setattr(t, "group_id", "x" * 300),
    "sample_index 4 outside [0, 4)": lambda t: setattr(t, "sample_index", 4),
    "sample_index -1 outside": lambda t: setattr(t, "sample_index", -1),
    "prompt_token_ids differ from the prompt enqueued": lambda t: t.prompt_token_ids.__setitem__(2, 9),
}


@pytest.mark.parametrize("reason", list(CASES))
def test_each_bad_trajectory_is_refused_with_its_reason(reason):
    got = _check(_mutate(CASES[reason]))
    assert got is not None and reason in got, got


def test_longer_than_the_group_allows_is_refused():
    assert "7 generated tokens exceed the group's max_new_tokens 6" in _check(good(tokens=7))


def test_a_small_vocabulary_makes_shorter_top_lists_the_right_size():
    small = Limits(vocab_size=5, top_k=20)
    t = rollout_pb2.Trajectory(
        trajectory_id="t",
        group_id="g",
        prompt_token_ids=[1],
        token_ids=[2],
        logprobs=[-0.5],
        top_logprobs=[rollout_pb2.TopLogprobs(token_ids=[2, 0, 1, 3, 4], logprobs=[-0.5, -1, -2, -3, -math.inf])],
        kv_budgets=[0],
    )
    assert check_structure(t, small, 0, 0) is None  # -inf: a token with zero probability
    t.top_logprobs[0].token_ids.append(4)
    t.top_logprobs[0].logprobs.append(-9)
    assert "has 6 entries, expected 5" in check_structure(t, small, 0, 0)
