"""`sparrow bench rollout --decode speculative --engine reference`: dense, lossy sparse and speculative on the
reference engine and the model's chain task, one run (the vLLM engine's is in tests/integration/generator)."""

import json

from tests.cli_runner import sparrow

AGGRESSIVE = {"name": "aggressive", "budgets": [48, 64], "bin_width": 64, "dense_layers": []}
TASK = ("--task-pairs", "16", "--task-min-hops", "12", "--task-hops", "16")


def test_the_three_modes_on_the_models_own_task_and_greedy_speculation_equal_to_dense(tmp_path):
    schedule = tmp_path / "s.json"
    schedule.write_text(json.dumps(AGGRESSIVE))
    r = sparrow(
        "bench", "rollout", "--decode", "speculative", "--engine", "reference", "--model", "models/tiny",
        "--schedule", schedule,
        "--prompts", "2", "--samples", "2", "--speculative-tokens", "4", *TASK, "--json",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert "bench rollout: speculative" in r.stderr  # progress on stderr, JSON alone on stdout
    d = json.loads(r.stdout)
    assert set(d["tokens_per_s"]) == {"dense", "sparse", "speculative"} and d["engine"] == "reference"
    assert all(v > 0 for v in d["tokens_per_s"].values()) and d["task"] == "chain task p16-h12..16"
    assert d["ratio_to_dense"]["speculative"] == d["tokens_per_s"]["speculative"] / d["tokens_per_s"]["dense"]
    assert d["speculative_identical_to_dense"] and d["greedy_first_difference"] == [None, None]
    bins = d["acceptance_per_bin"]
    assert bins and all(0 < v["alpha_mean"] <= 1 and 1 <= v["tokens_per_cycle"] <= 5 for v in bins.values())
    assert sum(v["drafts"] for v in bins.values()) % 4 == 0  # cycles of k drafts
    drafts = sum(v["drafts"] for v in bins.values())
    weighted = sum(v["alpha_mean"] * v["drafts"] for v in bins.values()) / drafts
    assert abs(weighted - d["acceptance"]) < 1e-9 and 0.2 < d["acceptance"] < 1.0


def test_bad_speculative_bench_input_is_refused_in_one_line(tmp_path):
    base = ("bench", "rollout", "--decode", "speculative", "--engine", "reference", "--model", "models/tiny")
    r = sparrow(*base, "--schedule", "qwen3-1.7b-0.86", "--speculative-tokens", "17")
    assert r.returncode == 2 and "--speculative-tokens must be in [1, 16]" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    all_dense = tmp_path / "dense.json"
    all_dense.write_text(json.dumps({**AGGRESSIVE, "dense_layers": [0, 1, 2, 3]}))
    r = sparrow(*base, "--schedule", all_dense)
    assert r.returncode == 2 and "no sparse layer" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = sparrow(*base, "--schedule", "qwen3-1.7b-0.86", "--samples", "0")
    assert r.returncode == 2 and "--samples must be positive" in r.stderr


def test_the_vllm_speculative_bench_refuses_a_k_out_of_range_before_any_engine_starts():
    r = sparrow("bench", "rollout", "--decode", "speculative", "--speculative-tokens", "0")
    assert r.returncode == 2 and "--speculative-tokens must be in [1, 16], got 0" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
