"""A short run on a user's checkpoint (its own chat template) with verl-shaped chat rows that carry extra columns,
scored by a verl `compute_score` file on one source and a TRL batched function on the other; each reward checks
its own arguments, so a wrong call scores 0 with an error counted. A dict reward's extra numbers reach
steps.jsonl and /metrics."""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.fixtures.qwen3_checkpoint import build_qwen3_checkpoint
from tests.integration.trainer_service.test_trainer_steps import _config, _metrics, _running, _steps
from tests.servers import redis_server, wait_until

VERL_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
    # verl calls by keyword: a call in Sparrow's order would put the response in data_source.
    assert data_source == "verl_math", data_source
    assert isinstance(solution_str, str) and "<|im_start|>" not in solution_str
    assert ground_truth == str(extra_info["a"] + extra_info["b"]), (ground_truth, extra_info)
    assert bonus == 0.5  # [reward.options.<name>] arrive as verl's reward_kwargs
    return {"score": 1.0, "checked": 1.0, "chars": float(len(solution_str))}
"""

TRL_REWARD = """
def reward(prompts, completions, completion_ids, difficulty, **kwargs):
    n = len(completions)
    assert n == 4, n  # the whole group in one call
    assert len(prompts) == len(completion_ids) == len(difficulty) == n
    assert all(p == prompts[0] and p[-1]["role"] == "user" for p in prompts)  # chat rows come as messages
    assert all(c[0]["role"] == "assistant" and isinstance(c[0]["content"], str) for c in completions)
    assert all(isinstance(ids, list) and ids for ids in completion_ids)
    assert kwargs["data_source"] == ["trl_qa"] * n and "prompt" not in kwargs
    assert kwargs["reward_model"][0]["ground_truth"] == kwargs["solution"][0]
    return [d / 10 for d in difficulty]
"""


def _rows(source: str, count: int) -> list[dict]:
    return [
        {
            "data_source": source,
            "prompt": [{"role": "system", "content": "Answer briefly."},
                       {"role": "user", "content": f"What is {i} + {i + 1}?"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(2 * i + 1)},
            "extra_info": {"a": i, "b": i + 1, "split": "train"},
            "solution": str(2 * i + 1),
            "difficulty": 5,
        }
        for i in range(count)
    ]  # fmt: skip


@pytest.mark.slow
def test_verl_and_trl_rewards_score_a_short_run_with_their_own_arguments(tmp_path):
    model = build_qwen3_checkpoint(tmp_path / "model")
    files = []
    for source in ("verl_math", "trl_qa"):
        files.append(tmp_path / f"{source}.parquet")
        pq.write_table(pa.Table.from_pylist(_rows(source, 4)), files[-1])
    (tmp_path / "verl_reward.py").write_text(VERL_REWARD)
    (tmp_path / "trl_reward.py").write_text(TRL_REWARD)
    verl, trl = f"{tmp_path / 'verl_reward.py'}:compute_score", f"{tmp_path / 'trl_reward.py'}:reward"
    extra = {
        "model_dir": str(model),
        "data.train_files": [str(f) for f in files],
        "data.chat_template_kwargs": {"enable_thinking": False},
        "reward.by_source": {"verl_math": verl, "trl_qa": trl},
        "reward.options": {verl: {"bonus": 0.5}},
        "reward.workers": 2,
        "sampling.max_new_tokens": 8,
        "steps": 8,
    }
    run = tmp_path / "run"
    with redis_server() as redis:
        config = _config(run, redis.url, **extra)
        with _running(config, True, tmp_path / "gen") as (service, _generator, _address):

            def both_scored() -> bool:
                return {"verl_math", "trl_qa"} <= {src for s in _steps(run) for src in s["reward_by_source"]}

            wait_until(both_scored, 300, "steps with groups of both sources", explain=service.waiting_for)
            metrics = _metrics(service)
    steps = _steps(run)
    assert sum(s["reward_errors"] for s in steps) == 0  # any assertion of the rewards would have counted here
    by_source: dict[str, set[float]] = {}
    for s in steps:
        for src, mean in s["reward_by_source"].items():
            by_source.setdefault(src, set()).add(round(mean, 6))
    assert by_source["verl_math"] == {1.0}
    assert by_source["trl_qa"] == {0.5}  # the difficulty column, read by TRL's reward, over 10
    extras = [s["reward_extra"][verl] for s in steps if verl in s["reward_extra"]]
    assert extras and all(e["checked"] == 1.0 and e["chars"] >= 0 for e in extras)
    # /metrics was read while steps went on: its gauge holds one of the steps' means.
    assert metrics[f"sparrow_trainer_reward_extra{{field=checked,reward={verl}}}"] == 1.0
    assert metrics[f"sparrow_trainer_reward_extra{{field=chars,reward={verl}}}"] in {e["chars"] for e in extras}
    assert metrics["sparrow_trainer_reward_errors_total{reason=raised}"] == 0
