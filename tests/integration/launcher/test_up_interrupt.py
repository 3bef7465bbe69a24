"""Ctrl-C (SIGINT) or SIGTERM to `sparrow up`, mid-run or while starting: every service is stopped in order,
the trainer checkpoints, unfinished work stays accounted for, and no process is left behind."""

import os
import signal
import time

import pytest

from tests.integration.launcher.helpers import UpProcess, alive, processes, tiny_config

pytestmark = pytest.mark.slow


def test_ctrl_c_mid_run_stops_everything_and_keeps_the_work(tmp_path):
    # Started with SIGINT ignored, as CI and `cmd &` in a script start it: the launcher must still stop on it.
    run_dir = tmp_path / "run"
    config = tiny_config(tmp_path / "up.toml")
    up = UpProcess("--config", str(config), "--model-size", "tiny", "--steps", "500", "--no-controller",
                   "--run-dir", str(run_dir), "--json", sigint_ignored=True)  # fmt: skip
    try:
        first = up.next_object(240)
        assert first["type"] == "step"
        up.proc.send_signal(signal.SIGINT)
        code = up.wait(120)
    finally:
        up.kill()
    assert code == 130
    summary = up.lines[-1]
    assert summary["type"] == "summary" and summary["outcome"] == "interrupted"
    assert 1 <= summary["steps_done"] < 500
    assert summary["work"]["lost"] == [] and summary["work"]["trained_twice"] == []
    assert (run_dir / "report" / "report.md").is_file()
    trainer_log = (run_dir / "logs" / "trainer.log").read_text()
    assert "trainer stopped at step" in trainer_log  # a clean stop, with its checkpoint
    assert list((run_dir / "trainer" / "checkpoints").glob("step-*"))
    assert "generator gen-0 stopped" in (run_dir / "logs" / "gen-0.log").read_text()
    assert not [c["name"] for c in processes(run_dir).values() if alive(c["pid"])]


def test_sigterm_while_starting_stops_what_was_started(tmp_path):
    run_dir = tmp_path / "run"
    config = tiny_config(tmp_path / "up.toml")
    up = UpProcess("--config", str(config), "--model-size", "tiny", "--steps", "5", "--generators", "2",
                   "--run-dir", str(run_dir), "--json")  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:  # the generators are started, not yet healthy
            try:
                if "gen-1" in processes(run_dir):
                    break
            except (OSError, ValueError):
                pass
            assert time.monotonic() < deadline and up.proc.poll() is None
            time.sleep(0.05)
        up.proc.send_signal(signal.SIGTERM)
        code = up.wait(120)
    finally:
        up.kill()
    assert code == 130, up.proc.stderr.read()[-3000:]
    summary = up.lines[-1]
    assert summary["outcome"] == "interrupted" and summary["steps_done"] == 0 and summary["report"] is None
    started = processes(run_dir)
    assert {"redis", "prometheus", "gen-0", "gen-1"} <= set(started)
    assert not [c["name"] for c in started.values() if alive(c["pid"])]


def test_a_trainer_that_dies_fails_the_run_and_every_other_service_is_stopped(tmp_path):
    run_dir = tmp_path / "run"
    # No restarts left: the run fails at this death (restarts: test_up_trainer_procs.py).
    config = tiny_config(tmp_path / "up.toml", top={"trainer_restarts": 0})
    up = UpProcess("--config", str(config), "--model-size", "tiny", "--steps", "500", "--no-controller",
                   "--run-dir", str(run_dir), "--json")  # fmt: skip
    try:
        assert up.next_object(240)["type"] == "step"
        os.kill(processes(run_dir)["trainer"]["pid"], signal.SIGKILL)
        code = up.wait(120)
    finally:
        up.kill()
    assert code == 1
    assert up.proc.stderr.read().startswith("sparrow up: error: the trainer exited (signal SIGKILL):")
    summary = up.lines[-1]
    assert summary["outcome"] == "failed" and summary["error"].startswith("the trainer exited (signal SIGKILL)")
    assert summary["work"]["lost"] == []  # what was enqueued is in the trainer's ledger, for a resume
    assert not [c["name"] for c in processes(run_dir).values() if alive(c["pid"])]
