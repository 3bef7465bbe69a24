"""The code reward in the trainer's reward pool, with the trainer's default timeouts, against a real sandbox
service that goes down: a restart within the call's budget scores as if nothing happened; a sandbox down
past it is the reward's own counted error, raised in time, not a worker killed at the pool's timeout."""

from __future__ import annotations

import time

import pytest

from services.sandbox import reward
from services.trainer.config import RewardConfig
from services.trainer.reward_pool import RewardPool
from sparrow.reward_registry import reward_timeout
from tests.integration.sandbox.service import TOKEN, sandbox_service
from tests.integration.sandbox.test_code_reward import CASES, SUM
from tests.servers import free_port

RIGHT = CASES[0][0]  # sums its input: scores 1 on SUM


@pytest.fixture(autouse=True)
def token(monkeypatch):
    monkeypatch.setenv(reward.TOKEN_ENV, TOKEN)  # before the pool spawns its workers: they inherit it


def test_the_code_reward_gets_a_budget_of_its_own_others_the_default():
    r = RewardConfig()
    assert reward_timeout("code", r.timeout_s, r.timeouts) == 180.0 and reward_timeout("math", r.timeout_s) == 10.0
    assert reward_timeout("code", r.timeout_s, {"code": 30.0}) == 30.0


def test_a_sandbox_restart_within_the_budget_does_not_score_0():
    # the trainer's per-reward budgets, under a default of 2 s (the shipped 10 s would only make the test wait)
    r = RewardConfig(timeout_s=2.0)
    port = free_port()
    extras = {"tests": SUM, "options": {"url": f"http://127.0.0.1:{port}"}}
    pool = RewardPool(1, r.timeout_s, timeouts=r.timeouts)
    try:
        with sandbox_service("--workers", "1", port=port):
            assert pool.submit("code", RIGHT, None, extras).result(timeout=120).score == 1.0  # imported, warm
        # Down (as when killed); back after 3 s, past the 2 s every other reward's call gets.
        future = pool.submit("code", RIGHT, None, extras)
        time.sleep(3)
        assert not future.done(), future.result()
        with sandbox_service("--workers", "1", port=port):
            result = future.result(timeout=120)
        assert (result.score, result.error) == (1.0, None)
        assert pool.error_counts == dict.fromkeys(pool.error_counts, 0)
    finally:
        pool.close()


def test_a_sandbox_down_past_the_budget_is_the_rewards_error_raised_before_the_pool_timeout():
    extras = {"tests": SUM, "options": {"url": f"http://127.0.0.1:{free_port()}"}}
    pool = RewardPool(1, 10.0, timeouts={"code": 6.0})
    try:
        pool.submit("boxed", "\\boxed{1}", "1", {}).result(timeout=120)  # the worker is up
        result = pool.submit("code", RIGHT, None, extras).result(timeout=120)
        # "raised" (SandboxUnavailable, within the budget), not "timeout": no worker was killed
        assert (result.score, result.error) == (0.0, "raised"), result
    finally:
        pool.close()
