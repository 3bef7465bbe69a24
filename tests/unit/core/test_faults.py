"""The fault points (services/common/faults.py): nothing happens unless armed; armed, the Nth reach kills the
launcher named in SPARROW_UP_PID and the process itself (real processes, real SIGKILL)."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from services.common.faults import fault_point

SCRIPT = textwrap.dedent(
    """
    import sys
    from services.common.faults import fault_point
    for i in range(1, 6):
        fault_point("trainer:publish")
        print(i, flush=True)
    """
)


def _reach(env: dict, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT], env=env, cwd=cwd, capture_output=True, text=True, timeout=60)


def test_an_unarmed_or_other_point_does_nothing(monkeypatch):
    monkeypatch.delenv("SPARROW_FAULT", raising=False)
    fault_point("trainer:checkpoint")
    monkeypatch.setenv("SPARROW_FAULT", "up:started")
    fault_point("trainer:checkpoint")


def test_the_nth_reach_kills_the_launcher_and_the_process():
    repo = Path(__file__).resolve().parents[3]
    launcher = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        env = {**os.environ, "PYTHONPATH": str(repo), "SPARROW_FAULT": "trainer:publish#3"}
        env["SPARROW_UP_PID"] = str(launcher.pid)
        r = _reach(env, repo)
        assert r.returncode == -9 and r.stdout.split() == ["1", "2"]
        assert launcher.wait(timeout=10) == -9
        env["SPARROW_FAULT"] = "trainer:publish"  # the first reach; no launcher named: only itself
        del env["SPARROW_UP_PID"]
        r = _reach(env, repo)
        assert r.returncode == -9 and r.stdout == ""
        env["SPARROW_FAULT"] = "trainer:checkpoint"
        r = _reach(env, repo)
        assert r.returncode == 0 and r.stdout.split() == ["1", "2", "3", "4", "5"]
    finally:
        launcher.kill()
