"""Fitting a schedule from per-bin p5 tables, and splitting user prompts."""

import pytest
import torch

from offline.calibrate import Measurement, Settings, fit, split_prompts
from sparrow.schedule import Schedule

SETTINGS = Settings(budgets=(64, 128, 256), bin_width=100, tau=0.86, min_bin_tokens=10)


def _table(p5s, tokens=50):
    return [
        {"index": i, "kv_start": i * 100, "kv_end": (i + 1) * 100, "tokens": tokens, "trusted": tokens >= 10, "p5": p}
        for i, p in enumerate(p5s)
        if p is not None
    ]


def test_each_bin_takes_the_smallest_budget_that_holds_tau():
    tables = {64: _table([0.99, 0.9, 0.7, 0.5]), 128: _table([1.0, 0.95, 0.88, 0.7]), 256: _table([1, 1, 0.95, 0.9])}
    schedule, notes = fit(tables, SETTINGS)
    assert isinstance(schedule, Schedule)
    assert schedule.budgets == (64, 64, 128, 256) and schedule.bin_width == 100
    assert (schedule.sink_blocks, schedule.local_blocks, schedule.dense_layers) == (1, 2, (0, 1))
    assert [n["measured_p5"] for n in notes] == [0.99, 0.9, 0.88, 0.9]


def test_the_schedule_never_decreases():
    tables = {64: _table([0.5, 0.99]), 128: _table([0.9, 1.0]), 256: _table([1.0, 1.0])}
    schedule, notes = fit(tables, SETTINGS)
    assert schedule.budgets == (128, 128)
    assert "raised to 128" in notes[1]["reason"]


def test_untrusted_and_empty_bins_do_not_constrain_the_fit():
    # bin 1 holds no token at all; bin 2 only three, with a p5 far below tau
    tables = {
        64: _table([0.99]) + _table([None, None, 0.1], tokens=3),
        128: _table([1.0]) + _table([None, None, 0.3], tokens=3),
    }
    schedule, notes = fit(tables, SETTINGS)
    assert schedule.budgets == (64, 64, 64)
    assert notes[1]["reason"].startswith("too few tokens") and notes[2]["measured_p5"] is None


def test_a_bin_no_budget_rescues_takes_the_largest_and_says_so():
    schedule, notes = fit({64: _table([0.99, 0.5]), 128: _table([1.0, 0.6])}, SETTINGS)
    assert schedule.budgets == (64, 128)
    assert "no measured budget reaches tau" in notes[1]["reason"]


def test_measurement_bins_report_exact_and_top20_statistics():
    kv = torch.tensor([10, 20, 150, 160, 170])
    m = Measurement(kv, torch.tensor([1.0, 0.9, 0.8, 0.7, 0.6]), torch.tensor([0.9, 0.8, 0.7, 0.6, 0.5]), 0.0)
    rows = m.bins(Settings(budgets=(64,), bin_width=100, min_bin_tokens=3))
    assert [(r["index"], r["tokens"], r["trusted"]) for r in rows] == [(0, 2, False), (1, 3, True)]
    assert rows[1]["mean"] == pytest.approx(0.7) and rows[1]["mean_topk"] == pytest.approx(0.6)
    assert rows[1]["p5"] == pytest.approx(0.61)  # linear interpolation at 0.05 * 2


class _WordTokenizer:
    def __call__(self, text):
        return {"input_ids": [1] + [len(w) for w in text.split()]}


def test_user_prompts_split_into_disjoint_sets():
    prompts = [f"prompt number {i}" for i in range(10)]
    calib, held = split_prompts(_WordTokenizer(), prompts, 4, 3, seed=0)
    assert len(calib) == 4 and len(held) == 3
    small_calib, small_held = split_prompts(_WordTokenizer(), prompts[:3], 4, 4, seed=0)
    assert len(small_calib) + len(small_held) == 3 and small_calib and small_held
    with pytest.raises(ValueError, match="at least 2 prompts"):
        split_prompts(_WordTokenizer(), prompts[:1], 4, 4, seed=0)
