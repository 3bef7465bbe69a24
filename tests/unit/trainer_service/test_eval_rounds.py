"""Evaluation rounds' bookkeeping: the gap between the modes, and the round numbering a restart continues."""

import json

import pytest

from services.trainer.evaluation import _next_round, dense_gap


def test_the_gap_is_dense_minus_scheduled_for_the_figures_and_sources_both_have():
    dense = {"math": {"prompts": 3, "samples": 12, "avg@4": 0.5, "pass@1": 0.5, "pass@4": 0.75}, "code": {}}
    scheduled = {"math": {"prompts": 3, "samples": 12, "avg@4": 0.25, "pass@1": 0.25}, "gsm8k": {"avg@4": 0.1}}
    assert dense_gap(dense, scheduled) == {"math": pytest.approx({"avg@4": 0.25, "pass@1": 0.25})}
    assert dense_gap(dense, {}) == {}


def test_a_restart_numbers_its_rounds_after_the_last_one_whatever_the_lines_per_round(tmp_path):
    path = tmp_path / "evals.jsonl"
    assert _next_round(path) == 0
    lines = [{"round": r, "mode": m} for r in range(3) for m in ("dense", "schedule")]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"round": 7')  # torn last line: not a round
    assert _next_round(path) == 3
    path.write_text(json.dumps({"round": 0}) + "\n" + json.dumps({"round": 1}) + "\n")  # from before eval.modes
    assert _next_round(path) == 2
