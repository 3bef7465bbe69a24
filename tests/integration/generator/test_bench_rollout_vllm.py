"""`sparrow bench rollout` on the vLLM engine at a tiny size: dense then sparse on the same prompts, progress on
stderr, the figures alone on stdout, and every sequence generated to the full length on both sides."""

import json

from tests.cli_runner import sparrow_process


def test_dense_then_sparse_rollouts_of_the_same_batch_with_progress_shown():
    r = sparrow_process(
        "bench", "rollout", "--model", "models/small", "--prompt-len", "16", "--gen-len", "40", "--batch", "2",
        "--schedule", "services/launcher/schedules/small-default.json", "--json",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    progress = [line for line in r.stderr.splitlines() if line.startswith("bench rollout: ")]
    assert progress[0].startswith("bench rollout: engine ready; 2 sequences of 16 + 40 tokens")
    assert any(line.startswith("bench rollout: dense step 40 (40 tokens per sequence)") for line in progress)
    assert progress[-1].startswith("bench rollout: sparse step 40 (40 tokens per sequence)")
    d = json.loads(r.stdout)  # stdout is the JSON object alone
    assert (d["model"], d["schedule"], d["prompt_len"], d["gen_len"], d["batch"]) == (
        "models/small", "small-default", 16, 40, 2)  # fmt: skip
    for side in ("dense", "sparse"):  # 2 x 40 tokens each side, EOS ignored
        assert abs(d[f"{side}_tokens_per_s"] * d[f"{side}_seconds"] - 80) < 1e-6
    assert abs(d["speedup"] - d["sparse_tokens_per_s"] / d["dense_tokens_per_s"]) < 1e-12
    assert d["layers"] == 4 and d["dense_layers"] == [0, 1]
    # Layers 0-1 whole; at 16-56 tokens of KV the sparse layers' budget (at least 64) covers the context too.
    assert d["attended_kv_fraction"] == 1.0
    assert d["speculative"] == {} and d["prompts"] == "random"
    # The cost model beside the measurement: every position attended whole, so the paper's terms predict 1.0x and no
    # step overhead explains a measured ratio (none above 1, 0 at or above it).
    c = d["cost"]
    assert c["paper_speedup"] == 1.0 and c["gen_len_priced"] == 40 and c["measured_speedup"] == d["speedup"]
    assert c["implied_step_overhead"] == (None if d["speedup"] <= 1 else 0.0)


def test_speculative_rollouts_of_the_models_task_are_lossless_and_counted(tmp_path):
    schedule = tmp_path / "aggressive.json"
    schedule.write_text(json.dumps({"name": "aggressive", "budgets": [48, 64], "bin_width": 64, "dense_layers": []}))
    r = sparrow_process(
        "bench", "rollout", "--decode", "speculative", "--speculative-tokens", "4", "--model", "models/tiny",
        "--task", "--task-pairs", "16", "--task-min-hops", "12", "--task-hops", "16", "--batch", "2",
        "--greedy-check", "200", "--schedule", schedule, "--json",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert "bench rollout: speculative engine ready, k = 4" in r.stderr
    d = json.loads(r.stdout)
    assert d["prompts"].startswith("chain task p16-h12..16") and d["batch"] == 2
    s = d["speculative"]
    assert s["speculative_tokens"] == 4 and s["greedy_tokens_compared"] == min(200, d["gen_len"])
    # Greedy speculative decoding is dense greedy decoding, to each response's EOS.
    assert s["speculative_identical_to_dense"] and s["greedy_first_difference"] == [None, None]
    assert 0 < s["acceptance"] < 1 and 1 <= s["tokens_per_cycle"] <= 5 and s["cycles"] > 0
    assert s["tokens_per_s"] > 0 and abs(s["ratio_to_dense"] - s["tokens_per_s"] / d["dense_tokens_per_s"]) < 1e-9
    c = d["cost"]
    assert c["paper_speedup"] > 0 and c["measured_speedup"] == d["speedup"]
    if c["implied_step_overhead"] is None:  # the sparse run was not faster: nothing to calibrate
        assert d["speedup"] <= 1 and "speculative_predicted" not in c
    else:
        assert c["implied_step_overhead"] >= 0 and c["speculative_predicted"] > 0
    assert c["speculative_measured"] == s["ratio_to_dense"]
    # The engine timed its cycles (decodes alone), per bin of the schedule; the overhead they imply is priced.
    timed = s["timed_cycles"]
    assert timed and set(timed) <= {"0", "1"} and sum(t["cycles"] for t in timed.values()) > 0
    assert all(t["draft_seconds"] > 0 and t["verify_seconds"] > 0 for t in timed.values())
    assert c["cycle_step_overhead"] >= 0 and c["speculative_predicted_from_cycles"] > 0


def test_a_model_of_ones_own_needs_its_schedule_named():
    r = sparrow_process("bench", "rollout", "--model", "models/small")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "--model models/small: name its --schedule" in r.stderr
