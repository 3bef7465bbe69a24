"""`sparrow model eval` on a user's model with its own tokenizer: a dataset (--data) scored by its reward,
and a one-line refusal of the chain difficulties, which only the project's own vocabulary can read."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.cli_runner import sparrow
from tests.fixtures.qwen3_checkpoint import build_qwen3_checkpoint


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return build_qwen3_checkpoint(tmp_path_factory.mktemp("qwen3") / "model")


def test_eval_on_a_dataset(qwen3, tmp_path):
    rows = [
        {"data_source": "toy", "prompt": [{"role": "user", "content": f"What is {i} + 1?"}],
         "reward_model": {"style": "rule", "ground_truth": str(i + 1)}}
        for i in range(3)
    ]  # fmt: skip
    data = tmp_path / "test.parquet"
    pq.write_table(pa.Table.from_pylist(rows), data)
    result = sparrow("model", "eval", "--model", qwen3, "--data", data, "--k", "2", "--max-new-tokens", "8", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["rewards"] == {"toy": "math"}
    figures = report["sources"]["toy"]
    assert figures["prompts"] == 3 and figures["samples"] == 6 and {"avg@2", "pass@1", "pass@2"} <= set(figures)


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--difficulty", "8:8"], "has its own tokenizer"),
        ([], "give --difficulty PAIRS:HOPS (the chain task) or --data FILE"),
        (["--data", "missing.parquet"], "no such data file"),
    ],
)
def test_refusals_are_one_line(qwen3, args, fragment):
    result = sparrow("model", "eval", "--model", qwen3, *args)
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and fragment in result.stderr, result.stderr


def test_bench_heldout_on_a_user_model_run(qwen3, tmp_path):
    from services.trainer.weights import POLICY, WeightStore, save_hf_policy
    from trainer.model_io import load_model

    model = load_model(qwen3)
    store = WeightStore(tmp_path / "run" / "trainer", keep=3)
    for version in (1, 2):
        store.publish(POLICY, version, lambda out: save_hf_policy(model, out, qwen3, "float32"))
    store.close()
    data = tmp_path / "test.parquet"
    rows = [{"prompt": f"What is {i} + 1?", "answer": i + 1} for i in range(2)]
    pq.write_table(pa.Table.from_pylist(rows), data)
    run = tmp_path / "run"
    result = sparrow("bench", "heldout", run, "--data", data, "--k", "2", "--max-new-tokens", "4", "--every", "1",
                     "--json", timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stderr
    points = json.loads(result.stdout)["runs"]["run"]["points"]
    assert [p["version"] for p in points] == [1, 2] and points[0]["sources"]["test"]["prompts"] == 2
    refused = sparrow("bench", "heldout", run, timeout=300)
    assert refused.returncode == 2 and "has its own tokenizer" in refused.stderr and refused.stderr.count("\n") == 1
