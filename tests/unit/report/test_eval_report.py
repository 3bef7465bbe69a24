"""The report's evaluation section: a row per round and source, and its plot."""

import json

from report.evals import eval_section, read_evals


def test_eval_rounds_in_the_report(tmp_path):
    rounds = [
        {"round": 0, "step": 0, "policy_version": 1, "sources": {"gsm8k": {"prompts": 3, "samples": 12,
         "avg@4": 0.25, "pass@1": 0.25, "pass@2": 0.4, "pass@4": 0.5}}},
        {"round": 1, "step": 2, "policy_version": 3, "sources": {"gsm8k": {"prompts": 3, "samples": 12,
         "avg@4": 0.5, "pass@1": 0.5, "pass@2": 0.7, "pass@4": 0.75}}},
    ]  # fmt: skip
    trainer = tmp_path / "trainer"
    trainer.mkdir()
    (trainer / "evals.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rounds) + '{"torn')
    assert read_evals(trainer) == rounds
    lines = eval_section(rounds, tmp_path)
    # A round from a trainer from before eval.modes reads as dense (its default then).
    assert "| 1 | 2 | v3 | dense | gsm8k | 3 | 0.500 (avg@4) | 0.500 | 0.750 (pass@4) | - |" in lines
    assert (tmp_path / "eval.png").is_file()
    assert eval_section([], tmp_path) == [] and read_evals(tmp_path) == []


def test_a_round_dense_and_under_the_schedule_has_a_row_per_mode_and_the_gap(tmp_path):
    figures = {"prompts": 3, "samples": 12, "avg@4": 0.5, "pass@1": 0.5, "pass@4": 0.75}
    scheduled = {**figures, "avg@4": 0.25, "pass@1": 0.25}
    rounds = [
        {"round": 0, "mode": "dense", "dense": True, "step": 0, "policy_version": 1, "sources": {"gsm8k": figures}},
        {"round": 0, "mode": "schedule", "dense": False, "step": 0, "policy_version": 1,
         "sources": {"gsm8k": scheduled}, "dense_gap": {"gsm8k": {"avg@4": 0.25, "pass@1": 0.25, "pass@4": 0.0}}},
    ]  # fmt: skip
    lines = eval_section(rounds, tmp_path)
    assert "| 0 | 0 | v1 | dense | gsm8k | 3 | 0.500 (avg@4) | 0.500 | 0.750 (pass@4) | - |" in lines
    assert "| 0 | 0 | v1 | schedule | gsm8k | 3 | 0.250 (avg@4) | 0.250 | 0.750 (pass@4) | +0.250 |" in lines
    assert (tmp_path / "eval.png").is_file()
