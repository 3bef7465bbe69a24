"""`sparrow up --trainer-procs 2`: the trainer starts itself as 2 torchrun ranks (gloo) and the run completes with the
world size in its summary and in the trainer's metric; a trainer that cannot run on the ranks asked for, or on the model
given, is one line, exit 2, before anything starts (the run folder is new, so it holds no checkpoint of another model:
`sparrow trainer` itself checks that, tests/integration/trainer_service/test_trainer_ranks.py)."""

import json
import os
import shutil
import signal
import time
import urllib.request
from pathlib import Path

import pytest

from tests.cli_runner import sparrow_process as sparrow
from tests.integration.launcher.helpers import TINY, UpProcess, alive, processes, tiny_config, wait_for_processes


def _workers(torchrun_pid: int) -> list[int]:
    path = Path(f"/proc/{torchrun_pid}/task/{torchrun_pid}/children")
    return [int(p) for p in path.read_text().split()] if path.is_file() else []


@pytest.mark.slow
def test_two_trainer_processes_run_three_steps(tmp_path):
    run_dir = tmp_path / "run"
    config = tiny_config(tmp_path / "up.toml")
    up = UpProcess(
        "--config", str(config), "--model-size", "tiny", "--trainer-procs", "2", "--steps", "3",
        "--generators", "1", "--no-controller", "--run-dir", str(run_dir), "--json",
    )  # fmt: skip
    try:
        found = wait_for_processes(up, run_dir, {"trainer"}, 300)
        trainer = found["trainer"]
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{trainer['ports']['metrics']}/metrics", timeout=10)
        assert "sparrow_trainer_world_size 2.0" in metrics.read().decode()
        workers = []
        deadline = time.monotonic() + 30
        while len(workers) < 2 and time.monotonic() < deadline:
            workers = _workers(trainer["pid"])
            time.sleep(0.2)
        assert len(workers) == 2, workers  # the two ranks, children of the trainer's own launcher
        code = up.wait(400)
    finally:
        up.kill()
    assert code == 0, up.proc.stderr.read()[-3000:]
    (summary,) = [o for o in up.lines if o["type"] == "summary"]
    assert summary["outcome"] == "completed" and summary["steps_done"] == 3
    assert summary["run"]["trainer_procs"] == 2
    work = summary["work"]
    assert work["lost"] == [] and work["trained_twice"] == [] and work["groups_trained"] == 6
    log = (run_dir / "logs" / "trainer.log").read_text()
    assert "rank 1 of 2 follows rank 0" in log and "rank 1 stops after 3 step(s)" in log
    assert summary["generator_policy_versions"]["gen-0"] >= 2  # published from the ranks' shards
    assert not [pid for pid in [*workers, *(c["pid"] for c in processes(run_dir).values())] if alive(pid)]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--trainer-procs", "0"], "trainer_procs"),
        (["--trainer-procs", "-2"], "trainer_procs"),
        (
            ["--trainer-procs", "3", "--set", "trainer.distributed.even_shares=true"],
            "do not divide over 3 trainer processes",
        ),
    ],
)
def test_trainer_procs_that_cannot_run_are_one_line_exit_2(tmp_path, args, message):
    run_dir = tmp_path / "run"
    config = tiny_config(tmp_path / "up.toml")
    result = sparrow("up", "--config", config, "--model-size", "tiny", "--run-dir", run_dir, *args)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not run_dir.exists()  # nothing started, nothing written


def test_a_model_the_trainer_cannot_build_is_one_line_exit_2_before_anything_starts(tmp_path):
    """The trainer's start checks run in `sparrow up`'s plan: a model folder whose config.json names a model type
    transformers does not know stops the run before Redis or any service starts (they used to start, and the trainer
    exited after them)."""
    model = tmp_path / "model"
    shutil.copytree(TINY, model)
    config = json.loads((model / "config.json").read_text()) | {"model_type": "no-such-model"}
    (model / "config.json").write_text(json.dumps(config))
    run_dir = tmp_path / "run"
    up = tiny_config(tmp_path / "up.toml")
    result = sparrow("up", "--config", up, "--model", model, "--trainer-procs", "2", "--run-dir", run_dir)
    assert result.returncode == 2, result.stderr
    assert "config.json: cannot read the config" in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not run_dir.exists()


def _rank_pid(torchrun_pid: int, rank: int) -> int | None:
    for pid in _workers(torchrun_pid):
        try:
            if f"RANK={rank}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                return pid
        except OSError:
            continue
    return None


def _first_step(up: UpProcess) -> dict:
    """The run's first step row (events before it are skipped)."""
    event = up.next_object(300)
    while event["type"] != "step":
        event = up.next_object(300)
    return event


def _completed_with_nothing_lost(up: UpProcess, code: int, run_dir, steps: int) -> None:
    """The run completed its steps (2 groups each) with no group lost or trained twice, as work.json records."""
    assert code == 0, up.proc.stderr.read()[-3000:]
    (summary,) = [o for o in up.lines if o["type"] == "summary"]
    assert summary["outcome"] == "completed" and summary["steps_done"] == steps
    work = summary["work"]
    assert work["lost"] == [] and work["trained_twice"] == [] and work["groups_trained"] == 2 * steps
    assert json.loads((run_dir / "work.json").read_text()) == work


@pytest.mark.slow
def test_a_trainer_rank_killed_mid_run_is_started_again_and_the_run_completes(tmp_path):
    """SIGKILL to rank 1 after step 1: the trainer's ranks end within the collective timeout, the trainer's launcher
    (under sparrow up) starts them again, they resume from the checkpoint, and the run completes with no group lost or
    trained twice."""
    run_dir = tmp_path / "run"
    config = tiny_config(tmp_path / "up.toml", extra="[trainer.distributed]\ntimeout_s = 20\n")
    up = UpProcess(
        "--config", str(config), "--model-size", "tiny", "--trainer-procs", "2", "--steps", "4",
        "--generators", "1", "--no-controller", "--run-dir", str(run_dir), "--json",
    )  # fmt: skip
    try:
        trainer = wait_for_processes(up, run_dir, {"trainer"}, 300)["trainer"]
        _first_step(up)
        victim = _rank_pid(trainer["pid"], 1)
        assert victim is not None
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        deadline = killed + 20 + 45  # the collective timeout, torchrun's 30 s grace at most
        while time.monotonic() < deadline and (_rank_pid(trainer["pid"], 1) in (None, victim)):
            time.sleep(0.2)
        restarted = _rank_pid(trainer["pid"], 1)
        assert restarted not in (None, victim), "the launcher did not start the ranks again"
        code = up.wait(400)
    finally:
        up.kill()
    _completed_with_nothing_lost(up, code, run_dir, steps=4)
    log = (run_dir / "logs" / "trainer.log").read_text()
    assert log.count("rank 1 of 2 follows rank 0") == 2  # the first ranks and the restarted ones
    assert "starting them again (1 of 3), from the last checkpoint" in log
    assert "resumed from step-" in log


@pytest.mark.slow
def test_a_single_trainer_process_killed_mid_run_is_started_again_and_the_run_completes(tmp_path):
    """SIGKILL to the one trainer process after step 1: sparrow up starts it again, it resumes from its checkpoint,
    and the run completes with no group lost or trained twice."""
    run_dir = tmp_path / "run"
    config = tiny_config(tmp_path / "up.toml")
    up = UpProcess(
        "--config", str(config), "--model-size", "tiny", "--steps", "3",
        "--generators", "1", "--no-controller", "--run-dir", str(run_dir), "--json",
    )  # fmt: skip
    try:
        first = wait_for_processes(up, run_dir, {"trainer"}, 300)["trainer"]
        _first_step(up)
        os.kill(first["pid"], signal.SIGKILL)
        code = up.wait(400)
    finally:
        up.kill()
    _completed_with_nothing_lost(up, code, run_dir, steps=3)
    restarted = processes(run_dir)["trainer"]
    assert restarted["restarts"] == 1 and restarted["pid"] != first["pid"]
    launcher_log = (run_dir / "logs" / "up.log").read_text()
    assert "trainer exited (signal SIGKILL); restarting it in 0 s (1 of 3)" in launcher_log, launcher_log[-3000:]
    assert "resumed from step-" in (run_dir / "logs" / "trainer.log").read_text()
