"""The suite's scheduling weights (tests/durations.py): read from a pytest log, per file, the jail files as one."""

import json

from tests import durations

LOG = """
============================= slowest durations ==============================
120.64s setup    tests/integration/launcher/test_up_resume.py::test_each_kill_landed_where_it_was_armed
76.75s call     tests/integration/deploy/test_dashboards_on_up_run.py::test_every_panel_query_returns_data
10.00s call     tests/integration/launcher/test_up_resume.py::test_one_history[2-1]
8.50s call     tests/unit/sandbox/test_jail.py::test_jails_left_by_a_sandbox_that_died_are_killed
2.25s teardown tests/integration/sandbox/test_sandbox_api.py::test_x
(2 durations < 0.005s hidden.  Use -vv to show these durations.)
"""


def test_seconds_are_summed_per_file_and_the_jail_files_are_one_scope_heaviest_first():
    got = durations.from_log(LOG, ("tests/integration/sandbox/", "tests/unit/sandbox/"))
    assert got == {
        "tests/integration/launcher/test_up_resume.py": 130.6,
        "tests/integration/deploy/test_dashboards_on_up_run.py": 76.8,
        "jail": 10.8,
    }
    assert list(got) == sorted(got, key=lambda k: -got[k])


def test_the_committed_weights_load_and_a_missing_or_bad_file_means_collection_order(tmp_path, monkeypatch):
    committed = durations.load()
    assert committed and all(v >= 0 for v in committed.values())
    assert all(k == "jail" or k.startswith("tests/") for k in committed)
    monkeypatch.setattr(durations, "FILE", tmp_path / "missing.json")
    assert durations.load() == {}
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(["not", "a", "mapping"]))
    monkeypatch.setattr(durations, "FILE", bad)
    assert durations.load() == {}
