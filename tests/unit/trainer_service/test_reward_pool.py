"""Rewards in worker processes: a hung, raising or NaN reward scores 0 and is counted; the rest score."""

import math
import time

import pytest
from prometheus_client import CollectorRegistry, Counter

from services.trainer.reward_pool import RewardPool
from sparrow.reward_registry import RewardError, coerce_score, resolve_reward

USER_REWARDS = """
import math, time

def good(response, ground_truth, extras):
    return {"score": float(response == ground_truth), "length": len(response), "note": "kept out"}

def sleeps(response, ground_truth, extras):
    time.sleep(60)
    return 1.0

def raises(response, ground_truth, extras):
    raise RuntimeError("the grader broke")

def nan(response, ground_truth, extras):
    return math.nan
"""


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(USER_REWARDS)
    return path


def test_failures_score_zero_are_counted_and_never_stall(user_file):
    registry = CollectorRegistry()
    errors = Counter("sparrow_trainer_reward_errors", "test", ["reason"], registry=registry)
    pool = RewardPool(workers=2, timeout_s=2.0, errors_counter=errors)
    try:
        start = time.monotonic()
        futures = {
            name: pool.submit(f"{user_file}:{name}", "42", "42", {}) for name in ("sleeps", "raises", "nan", "good")
        }
        results = {name: f.result(timeout=120) for name, f in futures.items()}
        assert time.monotonic() - start < 100  # bounded by the timeout and a worker's start, not the 60 s sleep
        assert results["good"].score == 1.0 and results["good"].info == {"length": 2.0}
        assert [(results[n].score, results[n].error) for n in ("sleeps", "raises", "nan")] == [
            (0.0, "timeout"),
            (0.0, "raised"),
            (0.0, "non_finite"),
        ]
        # the killed worker was replaced: the pool still scores
        assert pool.submit(f"{user_file}:good", "a", "b", {}).result(timeout=120).score == 0.0
        counted = {r: registry.get_sample_value("sparrow_trainer_reward_errors_total", {"reason": r}) for r in
                   ("timeout", "raised", "non_finite")}  # fmt: skip
        assert counted == {"timeout": 1.0, "raised": 1.0, "non_finite": 1.0}
    finally:
        pool.close()


def test_builtin_rewards_in_the_pool():
    pool = RewardPool(workers=1, timeout_s=10.0)
    try:
        cases = [
            ("math", "so the answer is \\boxed{\\frac{1}{2}}", "0.5", 1.0),
            ("math", "the answer is \\boxed{3}", "4", 0.0),
            ("boxed", "\\boxed{1,000}", "1000", 1.0),
            ("chain", "1 a b ; \\boxed{ b }", "b", 1.0),
        ]
        got = [pool.submit(name, text, truth, {}).result(timeout=120).score for name, text, truth, _ in cases]
        assert got == [c[3] for c in cases]
    finally:
        pool.close()


def test_a_reward_worker_imports_what_its_reward_needs_and_not_torch(tmp_path):
    # Each worker is a spawned interpreter: whatever the pool's own modules import, every worker imports again
    # (torch was about 2 s of CPU and 200 MB a worker, paid by every trainer start for rewards that need none).
    path = tmp_path / "probe_rewards.py"
    path.write_text("import sys\n\ndef torch_loaded(response, ground_truth, extras):\n"
                    "    return float('torch' in sys.modules)\n")  # fmt: skip
    pool = RewardPool(workers=1, timeout_s=30.0, preload=("chain",))
    try:
        assert pool.submit(f"{path}:torch_loaded", "x", "x", {}).result(timeout=120).score == 0.0
        assert pool.submit("chain", "1 a b ; \\boxed{ b }", "b", {}).result(timeout=120).score == 1.0
        assert pool.submit(f"{path}:torch_loaded", "x", "x", {}).result(timeout=120).score == 0.0
    finally:
        pool.close()


def test_unknown_or_unimportable_rewards_are_one_line(tmp_path, user_file):
    (tmp_path / "broken.py").write_text("import not_a_module_anywhere\n")
    for name, message in [
        ("exact", "unknown reward 'exact'"),
        (f"{tmp_path}/broken.py:fn", "cannot import .*ModuleNotFoundError"),
        (f"{tmp_path}/none.py:fn", "no such file"),
        (f"{user_file}:missing", "has no function 'missing'"),
        ("json:dumps", r"dumps must take \(response, ground_truth, extras\)"),
        ("sparrow.rewards:boxed_score", None),
    ]:
        if message is None:
            resolve_reward(name)
            continue
        with pytest.raises(RewardError, match=message) as info:
            resolve_reward(name)
        assert "\n" not in str(info.value)


def test_coerce_score():
    assert coerce_score(True) == (1.0, {}, None)
    assert coerce_score({"score": 0.5, "acc": 1}) == (0.5, {"acc": 1.0}, None)
    assert coerce_score({"acc": 1})[2] == "bad_value"
    assert coerce_score("1")[2] == "bad_value"
    assert coerce_score(math.inf)[2] == "non_finite"
    assert coerce_score(10**400)[2] == "non_finite"


def test_preloaded_rewards_are_imported_by_every_worker_before_the_first_call(user_file, tmp_path):
    """The run's rewards start and import in the background: the first step's scores wait on no spawn.
    A preload that cannot import is not fatal: the first call finds it again, scores 0 and counts it."""
    registry = CollectorRegistry()
    errors = Counter("sparrow_trainer_reward_errors", "test", ["reason"], registry=registry)
    missing = f"{tmp_path / 'gone.py'}:fn"
    pool = RewardPool(workers=2, timeout_s=30.0, errors_counter=errors, preload=(f"{user_file}:good", missing))
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not all(f"{user_file}:good" in s.loaded for s in pool.slots):
            time.sleep(0.1)
        assert all(f"{user_file}:good" in s.loaded and s.process.is_alive() for s in pool.slots)
        pids = {s.process.pid for s in pool.slots}
        assert registry.get_sample_value("sparrow_trainer_reward_errors_total", {"reason": "raised"}) is None
        results = [pool.submit(f"{user_file}:good", "42", "42", {}) for _ in range(4)]
        assert [r.result(timeout=60).score for r in results] == [1.0] * 4
        assert {s.process.pid for s in pool.slots} == pids  # served by the preloaded workers
        assert pool.submit(missing, "42", "42", {}).result(timeout=60).error == "raised"
        assert registry.get_sample_value("sparrow_trainer_reward_errors_total", {"reason": "raised"}) == 1.0
    finally:
        pool.close()


BATCHED_REWARDS = """
from pathlib import Path

def per_group(prompts, completions, completion_ids, level, **kwargs):
    # One line per call, naming how many completions it had: a batched reward must see whole groups.
    with Path(kwargs["extra_info"][0]["log"]).open("a") as f:
        f.write(f"{len(completions)}\\n")
    assert all(p == prompts[0] for p in prompts) and level == [2] * len(completions)
    return [float(c == "ok") * l for c, l in zip(completions, level)]

def wrong_length(prompts, completions, **kwargs):
    return [1.0]
"""


class _Decoder:
    """The tokenizer's decode, as the scorer uses it: token ids are indices into WORDS."""

    WORDS = ["ok", "no"]

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(self.WORDS[i] for i in ids)


def _group(tmp_path, reward: str, n: int = 4):
    from services.trainer.ledger import GroupRecord

    extras = {"log": str(tmp_path / "calls.log")}
    return GroupRecord(
        index=0, group_id="g0", prompt_token_ids=(1, 2), n=n, answer="ok", policy_version=1, max_new_tokens=4,
        prompt_text="Say ok.", data_source="toy", reward=reward, extras=extras,
        columns={"data_source": "toy", "level": 2, "extra_info": extras}, row_prompt="Say ok.",
    )  # fmt: skip


def test_a_batched_reward_is_called_once_per_complete_group(tmp_path):
    from types import SimpleNamespace

    from services.trainer.rewarding import RewardScorer

    path = tmp_path / "batched.py"
    path.write_text(BATCHED_REWARDS)
    pool = RewardPool(workers=2, timeout_s=30.0)
    try:
        scorer = RewardScorer(pool, _Decoder(), ledger=None)
        record = _group(tmp_path, f"{path}:per_group")
        samples = [SimpleNamespace(group_id="g0", sample_index=i, token_ids=[i % 2]) for i in range(4)]
        for t in samples[:3]:
            scorer.on_trajectory(t, record)
        time.sleep(1.0)
        assert pool.tasks.qsize() == 0 and not (tmp_path / "calls.log").exists()  # nothing called on 3 of 4
        scorer.on_trajectory(samples[3], record)
        assert [r.score for r in scorer.group_scores(record, samples)] == [2.0, 0.0, 2.0, 0.0]
        # Read back after a restart (never seen arriving): scored in one call, all together.
        assert [r.score for r in scorer.group_scores(record, samples[::-1])] == [0.0, 2.0, 0.0, 2.0]
        assert (tmp_path / "calls.log").read_text().split() == ["4", "4"]
        short = _group(tmp_path, f"{path}:wrong_length")
        assert [r.error for r in scorer.group_scores(short, samples)] == ["bad_value"] * 4
        assert pool.error_counts["bad_value"] == 4
    finally:
        pool.close()
