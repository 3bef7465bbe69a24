"""Probe requests: parsing and refusals, resolution against a schedule, and the share counter."""

import json
import time

import pytest
import torch

from sparrow.probe import Probe, ProbeError, ShareCounter
from sparrow.schedule import Schedule

SCHEDULE = Schedule(budgets=(64, 128, 256), bin_width=100, version=7)


def _probe(**kw) -> Probe:
    fields = {"schedule_version": 7, "share": 0.25, "budgets": (48, None, 128), "expires_at": time.time() + 60}
    fields.update(kw)
    return Probe(**fields)


def test_the_controllers_json_round_trips_and_resolves_against_its_schedule():
    probe = _probe()
    again = Probe.from_json(probe.to_json())
    assert again == probe and json.loads(probe.to_json())["budgets"] == [48, None, 128]
    plan = probe.plan(SCHEDULE)
    assert plan.budgets == (48, 128, 128) and plan.pages() == [3, 8, 8] and plan.share == 0.25
    assert [plan.budget_for(kv) for kv in (0, 99, 100, 250, 10_000)] == [48, 48, 128, 128, 128]
    assert plan.budget_tokens(torch.tensor([5, 150, 900])).tolist() == [48, 128, 128]
    # Not non-decreasing (bin 0 above bin 1) is allowed: a probe goes below one bin only.
    assert _probe(budgets=(64, 48, None)).plan(SCHEDULE).budgets == (64, 48, 256)


def test_it_applies_only_to_its_schedule_version_and_only_when_it_changes_something():
    assert _probe(schedule_version=6).plan(SCHEDULE) is None
    assert _probe().plan(None) is None
    assert _probe(budgets=(None, 128, None)).plan(SCHEDULE) is None
    assert _probe(expires_at=time.time() - 1).expired() and not _probe().expired()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[1]", "JSON object"),
        ("{", "malformed JSON"),
        ('{"schedule_version": 1, "share": 0.1, "budgets": [48]}', "missing field(s) 'expires_at'"),
        ('{"schedule_version": 1, "share": 0.1, "budgets": [48], "expires_at": 1, "x": 1}', "unknown field(s) 'x'"),
        ('{"schedule_version": 1, "share": 0, "budgets": [48], "expires_at": 1}', "share"),
        ('{"schedule_version": 1, "share": 1.5, "budgets": [48], "expires_at": 1}', "share"),
        ('{"schedule_version": -1, "share": 0.1, "budgets": [48], "expires_at": 1}', "schedule_version"),
        ('{"schedule_version": 1, "share": 0.1, "budgets": [], "expires_at": 1}', "every bin"),
        ('{"schedule_version": 1, "share": 0.1, "budgets": [-16], "expires_at": 1}', "bin 0"),
        ('{"schedule_version": 1, "share": 0.1, "budgets": [true], "expires_at": 1}', "bin 0"),
        ('{"schedule_version": 1, "share": 0.1, "budgets": "48", "expires_at": 1}', "budgets must be a list"),
        ('{"schedule_version": 1, "share": 0.1, "budgets": [48], "expires_at": "soon"}', "expires_at"),
        # Past the wire's int32 budgets and int64 versions, or nested past the parser's depth.
        ('{"schedule_version": 1, "share": 0.1, "budgets": [2147483648], "expires_at": 1}', "bin 0"),
        ('{"schedule_version": 9223372036854775808, "share": 0.1, "budgets": [48], "expires_at": 1}', "version"),
        (
            '{"schedule_version": 1, "share": 0.1, "budgets": ' + "[" * 100_000 + "]" * 100_000 + ', "expires_at": 1}',
            "nested too deeply",
        ),  # fmt: skip
    ],
)
def test_malformed_requests_are_refused_with_one_line(text, message):
    with pytest.raises(ProbeError) as info:
        Probe.from_json(text)
    assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("budgets", "message"),
    [((48, None), "2 bins"), ((40, None, None), "multiple of the page size"), ((32, None, None), "sink and local")],
)
def test_budgets_the_schedule_cannot_run_are_refused(budgets, message):
    with pytest.raises(ProbeError, match=message):
        _probe(budgets=budgets).plan(SCHEDULE)


def test_the_share_counter_takes_every_nth_sequence_evenly():
    counter = ShareCounter()
    assert [counter.take(0.25) for _ in range(8)] == [False, False, False, True] * 2
    counter = ShareCounter()
    assert sum(counter.take(0.05) for _ in range(1000)) == 50
    counter = ShareCounter()
    assert all(counter.take(1.0) for _ in range(5))
