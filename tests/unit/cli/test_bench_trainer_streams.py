"""`sparrow bench trainer-streams` at a small size: one JSON object, every trajectory acked once, health answered."""

import json

from tests.cli_runner import sparrow


def test_a_small_fleet_meets_the_goal_and_prints_its_figures():
    result = sparrow("bench", "trainer-streams", "--generators", "6", "--trajectories", "2", "--hold", "0.5", "--json")
    assert result.returncode == 0, result.stderr[-2000:]
    figures = json.loads(result.stdout)
    assert figures["open_calls"] == 12 and figures["goal_met"] is True
    t = figures["trajectories"]
    assert t["sent"] == t["accepted"] == t["distinct_ids"] == t["stored"] == 12 and t["acked_exactly_once"]
    assert figures["health"]["failures"] == 0 and figures["health"]["checks"] > 0
    assert figures["refused_calls"] == {"too_many_calls": 0, "undecodable": 0}


def test_bad_flags_are_one_line():
    result = sparrow("bench", "trainer-streams", "--generators", "0")
    assert result.returncode == 2 and "--generators must be positive" in result.stderr
