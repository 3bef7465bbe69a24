"""Evaluation during training: a held-out set through the (sampling) generator before step 1, every step and
after the last, dense and under the schedule; avg@k and pass@k per source and mode in evals.jsonl and on
/metrics; eval groups are never trained."""

import json

import pytest
import redis as redis_client

from sparrow.evaluation import pass_at_k
from sparrow.tasks import ChainTask
from sparrow.tasks.dataset import chain_rows, write_parquet
from sparrow.work import PROMPTS_STREAM, PromptGroup
from tests.integration.trainer_service.test_trainer_steps import _config, _metrics, _running, _steps
from tests.servers import redis_server, wait_until


@pytest.mark.slow
def test_eval_rounds_report_avg_and_pass_at_k_dense_and_under_the_schedule(tmp_path):
    heldout = write_parquet(chain_rows(ChainTask(8, 8, 4), 3, seed=1, split="heldout"), tmp_path / "test.parquet")
    extra = {"data.eval_files": [str(heldout)], "eval.every": 1, "eval.k": 4, "eval.modes": ["dense", "schedule"]}
    config = _config(tmp_path / "run", "", **extra, steps=2)
    with redis_server() as redis:
        config = config.model_copy(update={"redis": config.redis.model_copy(update={"url": redis.url})})
        with _running(config, True, tmp_path / "gen") as (service, _generator, _address):
            wait_until(lambda: len(service.evaluator.results) >= 6, 180, "three evaluation rounds, two modes each")
            metrics = _metrics(service)
        entries = redis_client.Redis.from_url(redis.url).xrange(PROMPTS_STREAM)
    # Each round's prompts go out once per mode: dense ones ask the generators for dense attention, scheduled
    # ones for the schedule; both are evaluation groups (never probes). Training groups are neither.
    groups = [PromptGroup.from_fields(fields) for _, fields in entries]
    kinds = {("-eval" in g.group_id, g.dense, g.evaluation) for g in groups}
    assert kinds == {(True, True, True), (True, False, True), (False, False, False)}
    assert sum(g.dense for g in groups) == sum(g.evaluation and not g.dense for g in groups) == 3 * 3
    evals = [json.loads(line) for line in (tmp_path / "run" / "evals.jsonl").read_text().splitlines()]
    # One line per round and mode, the round's modes in the config's order, the same step and policy version.
    assert [(e["round"], e["mode"], e["step"]) for e in evals] == [
        (r, m, r) for r in range(3) for m in ("dense", "schedule")
    ]
    assert all(e["complete"] and e["dense"] == (e["mode"] == "dense") for e in evals)
    assert [e["policy_version"] for e in evals] == [1, 1, 2, 2, 3, 3]
    for e in evals:
        chain = e["sources"]["chain"]
        assert chain["prompts"] == 3 and chain["samples"] == 12
        assert set(chain) == {"prompts", "samples", "avg@4", "pass@1", "pass@2", "pass@4"}
        assert 0 <= chain["pass@1"] <= chain["pass@2"] <= chain["pass@4"] <= 1
        assert chain["pass@1"] == pytest.approx(chain["avg@4"])  # 0/1 rewards: pass@1 is the mean
    for dense, scheduled in zip(evals[::2], evals[1::2], strict=True):
        # The gap rides on the scheduled line: dense minus scheduled, figure by figure.
        assert "dense_gap" not in dense
        d, s = dense["sources"]["chain"], scheduled["sources"]["chain"]
        assert scheduled["dense_gap"]["chain"] == pytest.approx(
            {key: d[key] - s[key] for key in ("avg@4", "pass@1", "pass@2", "pass@4")}
        )
    for e in evals[-2:]:
        last, mode = e["sources"]["chain"], e["mode"]
        assert metrics[f"sparrow_trainer_eval_pass_ratio{{k=4,mode={mode},source=chain}}"] == pytest.approx(
            last["pass@4"]
        )
        assert metrics[f"sparrow_trainer_eval_avg_reward{{mode={mode},source=chain}}"] == pytest.approx(last["avg@4"])
    trained = {gid for s in _steps(tmp_path / "run") for gid in s["groups"]}
    assert not any("-eval" in gid for gid in trained)
    assert pass_at_k(4, 1, 4) == 1.0


FLAKY_REWARD = """
import math, time
from pathlib import Path

def score(response, ground_truth, extras):
    # A call counter shared across worker processes (a killed worker's successor continues it).
    log = Path(extras["options"]["log"])
    with log.open("a") as f:
        f.write("x")
    n = len(log.read_text()) - 1
    if n % 4 == 0:
        time.sleep(60)
    if n % 4 == 1:
        raise RuntimeError("grader crashed")
    if n % 4 == 2:
        return math.nan
    return 1.0
"""


@pytest.mark.slow
def test_rewards_that_hang_raise_or_return_nan_score_zero_and_the_step_completes(tmp_path):
    reward_file = tmp_path / "flaky.py"
    reward_file.write_text(FLAKY_REWARD)
    name = f"{reward_file}:score"
    extra = {
        "steps": 1,
        "reward.name": name,
        "reward.workers": 1,
        "reward.timeout_s": 1.0,
        "reward.options": {name: {"log": str(tmp_path / "calls.log")}},
    }
    with redis_server() as redis:
        config = _config(tmp_path / "run", redis.url, **extra)
        with _running(config, True, tmp_path / "gen") as (service, _generator, _address):
            wait_until(lambda: len(_steps(tmp_path / "run")) >= 1, 240, "the step, whatever the rewards did")
            metrics = _metrics(service)
    [step] = _steps(tmp_path / "run")
    # Rewards run as trajectories arrive, for the next groups too: which calls the step's samples got varies,
    # but every sample scored either 1 or 0 with an error counted.
    assert step["samples"] == 8
    assert step["reward_errors"] + round(step["reward_mean"] * 8) == 8
    # One worker runs the calls in turn: the step's 8 scores mean calls 0-7 all ended, two of each failure.
    for reason in ("timeout", "raised", "non_finite"):
        assert metrics[f"sparrow_trainer_reward_errors_total{{reason={reason}}}"] >= 2
