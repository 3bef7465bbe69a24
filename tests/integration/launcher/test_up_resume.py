"""`sparrow up --resume RUN_DIR` after the launcher was killed with SIGKILL at each moment the issue names, for
real (Redis, Prometheus, the controller, a generator and the trainer as processes on loopback; reference engine,
tiny model, TensorBoard and an MLflow file store). One run is killed and resumed in a chain, the kill armed at a
fault point each time (services/common/faults.py), so that CI pays for one run's start-ups, not four runs':

    1. during start        up:start              Redis and Prometheus up, no trainer yet
    2. during publishing   trainer:publish#2     the policy after the first step written, not yet published
    3. during a checkpoint trainer:checkpoint#1  shards written, meta not: a checkpoint never completed
    4. mid-step            up:step#1             the launcher had written one step's row
    5. resumed to the end, with --steps raised

Then the run is one run: every group the trainer had enqueued before each kill (its own ledger, read right after
the kill) is trained, dropped or waiting, none trained twice, none lost (work.json); one history with steps 1..N
and one clock; one report; the controller published its initial schedule once (the resumed controllers found it in
the run's Redis); one MLflow run and one TensorBoard folder with every step.
"""

import json
import os
import subprocess
import sys

import pytest

from report.history import read_history
from tests.cli_runner import REPO
from tests.integration.launcher.helpers import tiny_config, trained_and_dropped
from tests.tracking_readers import mlflow_run, mlflow_series, tensorboard_scalars

pytestmark = pytest.mark.slow

TRACKING = """
[tracking]
backends = ["tensorboard", "mlflow"]
project = "sparrow-resume"
"""
STEPS, MORE_STEPS = 4, 5


def _up(*args: str, fault: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "SPARROW_FAULT"} | {"OMP_NUM_THREADS": "1"}
    if fault:
        env["SPARROW_FAULT"] = fault
    cmd = [sys.executable, "-m", "sparrow_cli.main", "up", *args, "--json"]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def _enqueued(run_dir) -> set[str]:
    path = run_dir / "trainer" / "groups.log"
    out = set()
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            entry = json.loads(line)
        except ValueError:
            continue  # the kill tore the last line
        if entry.get("kind") == "enqueued":
            out.add(entry["group"]["group_id"])
    return out


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("resume")
    run_dir = tmp / "run"
    config = tiny_config(tmp / "up.toml", extra=TRACKING)
    moments = {}
    first = _up("--config", str(config), "--steps", str(STEPS), "--run-dir", str(run_dir), fault="up:start")
    moments["start"] = (first, _enqueued(run_dir), json.loads((run_dir / "processes.json").read_text()))
    faults = {"publish": "trainer:publish#2", "checkpoint": "trainer:checkpoint#1", "step": "up:step#1"}
    for name, fault in faults.items():
        r = _up("--resume", str(run_dir), fault=fault)
        moments[name] = (r, _enqueued(run_dir), json.loads((run_dir / "processes.json").read_text()))
    last = _up("--resume", str(run_dir), "--steps", str(MORE_STEPS))
    return run_dir, moments, last


def test_each_kill_landed_where_it_was_armed(chain):
    run_dir, moments, _ = chain
    for name, (r, _, _) in moments.items():
        assert r.returncode == -9, (name, r.returncode, r.stderr[-2000:])
    started = {p["name"] for p in moments["start"][2]}
    assert {"redis", "prometheus"} <= started and "trainer" not in started  # killed between the two phases
    assert {"trainer", "controller", "gen-0"} <= {p["name"] for p in moments["publish"][2]}
    log = (run_dir / "logs" / "trainer.log").read_text()
    # The checkpoint the kill cut short was set aside by the next start, never resumed from.
    assert log.count("resumed from step-") >= 1


def test_the_resumed_run_completes_with_nothing_lost_or_trained_twice(chain):
    run_dir, moments, last = chain
    assert last.returncode == 0, last.stderr[-3000:]
    summary = json.loads(last.stdout.splitlines()[-1])
    assert summary["type"] == "summary" and summary["outcome"] == "completed"
    assert summary["steps_done"] == MORE_STEPS
    work = json.loads((run_dir / "work.json").read_text())
    assert work["lost"] == [] and work["trained_twice"] == [] and work["trained_and_dropped"] == []
    history, dropped, ledger = trained_and_dropped(run_dir)
    assert len(history) == MORE_STEPS
    trained = {g for step in history for g in step}
    known = trained | set(dropped) | ledger
    for name, (_, enqueued_before, _) in moments.items():
        assert enqueued_before <= known, (name, sorted(enqueued_before - known))
    assert work["groups_trained"] == len(trained) and work["groups_waiting"] == len(ledger - trained - set(dropped))


def test_one_history_one_report_one_schedule_and_one_tracked_run(chain):
    run_dir, _, last = chain
    assert last.returncode == 0, last.stderr[-3000:]
    rows = read_history(run_dir)
    assert [r["step"] for r in rows] == list(range(1, MORE_STEPS + 1))
    elapsed = [r["elapsed_s"] for r in rows]
    assert elapsed == sorted(elapsed)  # one clock across the launchers
    versions = [r["schedule_version"] for r in rows]
    assert versions == sorted(versions) and versions[0] >= 1
    assert (run_dir / "report" / "report.md").is_file() and len(list(run_dir.glob("**/report.md"))) == 1
    assert (run_dir / "config.toml").read_text().count(f"steps = {MORE_STEPS}") == 1
    controller = (run_dir / "logs" / "controller.log").read_text()
    assert controller.count(": initial schedule") == 1, controller[-3000:]

    client, run = mlflow_run((run_dir / "mlruns").resolve().as_uri(), "sparrow-resume")  # the experiment's only run
    assert set(mlflow_series(client, run.info.run_id, "train/reward")) == set(range(1, MORE_STEPS + 1))
    scalars = tensorboard_scalars(run_dir / "tensorboard")
    assert set(range(1, MORE_STEPS + 1)) <= set(scalars["train/reward"])


def test_a_resume_refuses_what_would_change_the_training(chain, tmp_path):
    run_dir, _, _ = chain
    r = _up("--resume", str(run_dir), "--set", "trainer.optim.lr=0.5", "--steps", "9")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "trainer.optim.lr" in r.stderr and "steps" not in r.stderr.split("would change what it trains:")[1][:40]
    r = _up("--resume", str(run_dir), "--steps", "2")
    assert r.returncode == 2 and f"below the {MORE_STEPS} steps" in r.stderr, r.stderr
    r = _up("--resume", str(tmp_path))
    assert r.returncode == 2 and "not the folder of a sparrow up run" in r.stderr, r.stderr
    r = _up("--run-dir", str(run_dir))
    assert r.returncode == 2 and "not empty" in r.stderr, r.stderr
