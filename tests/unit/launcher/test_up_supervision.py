"""Process supervision with real child processes: health waits, stop order, SIGTERM then SIGKILL of the whole
process group, unexpected exits, and children that do not outlive a launcher killed with SIGKILL."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from services.launcher.cluster import PROCESSES_FILE, Cluster, ServiceSpec, StartError
from services.launcher.run import Interrupts
from tests.cli_runner import REPO
from tests.servers import wait_until


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _spec(tmp_path: Path, name: str, role: str, code: str, ready=None) -> ServiceSpec:
    log = tmp_path / "logs" / f"{name}.log"

    def logged_ready() -> bool:
        return log.exists() and "ready" in log.read_text()

    argv = [sys.executable, "-u", "-c", textwrap.dedent(code)]
    return ServiceSpec(name, role, argv, log, ready or logged_ready)


# Ignores SIGTERM and leaves a grandchild in its process group: only SIGKILL of the group ends both.
STUBBORN = """
    import signal, subprocess, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1000)"])
    print("grandchild", child.pid, "ready", flush=True)
    time.sleep(1000)
"""


def _records_sigterm(path: Path, name: str) -> str:
    return f"""
    import signal, sys, time
    def bye(*_):
        with open({str(path)!r}, "a") as f:
            f.write({name!r} + "\\n")
        sys.exit(0)
    signal.signal(signal.SIGTERM, bye)
    print("ready", flush=True)
    time.sleep(1000)
"""


def test_a_child_ignoring_sigterm_is_killed_with_its_whole_group_after_the_grace(tmp_path):
    cluster = Cluster(tmp_path, stop_grace_s=0.5)
    child = cluster.start(_spec(tmp_path, "stubborn", "trainer", STUBBORN))
    cluster.wait_ready(30)
    grandchild = int(child.spec.log.read_text().split()[1])
    assert _alive(child.process.pid) and _alive(grandchild)
    cluster.stop()
    assert child.returncode == -signal.SIGKILL
    wait_until(lambda: not _alive(grandchild), 10, "the grandchild gone")
    (entry,) = json.loads((tmp_path / PROCESSES_FILE).read_text())
    assert entry["name"] == "stubborn" and entry["pid"] == child.process.pid and entry["ready"]
    assert entry["returncode"] == -signal.SIGKILL


def test_services_stop_in_order_generators_first_redis_last(tmp_path):
    order = tmp_path / "order.txt"
    cluster = Cluster(tmp_path, stop_grace_s=10)
    for name, role in (("redis", "store"), ("prometheus", "monitor"), ("trainer", "trainer"), ("gen-0", "generator")):
        cluster.start(_spec(tmp_path, name, role, _records_sigterm(order, name)))
    cluster.wait_ready(30)
    cluster.stop(("generator", "trainer"))
    assert order.read_text().split() == ["gen-0", "trainer"]
    assert [c.name for c in cluster.children.values() if c.returncode is None] == ["redis", "prometheus"]
    cluster.stop()
    assert order.read_text().split() == ["gen-0", "trainer", "prometheus", "redis"]
    assert all(c.returncode == 0 for c in cluster.children.values())


def test_a_child_that_exits_while_starting_fails_the_start_with_its_log(tmp_path):
    cluster = Cluster(tmp_path, stop_grace_s=1)
    cluster.start(_spec(tmp_path, "broken", "trainer", "import sys; print('boom: bad config'); sys.exit(3)"))
    with pytest.raises(StartError, match=r"broken exited \(exit 3\) while starting:\n.*boom: bad config"):
        cluster.wait_ready(30)


def test_a_child_never_healthy_fails_the_start_naming_it(tmp_path):
    cluster = Cluster(tmp_path, stop_grace_s=1)
    cluster.start(_spec(tmp_path, "slow", "generator", "import time; time.sleep(1000)", ready=lambda: False))
    try:
        with pytest.raises(StartError, match="not healthy after 1 s: slow"):
            cluster.wait_ready(1)
    finally:
        cluster.stop()


def test_an_unexpected_exit_is_reported_once_and_a_stopped_child_never(tmp_path):
    cluster = Cluster(tmp_path, stop_grace_s=5)
    quitter = cluster.start(_spec(tmp_path, "gen-1", "generator", "print('ready', flush=True); raise SystemExit(1)"))
    keeper = cluster.start(_spec(tmp_path, "gen-0", "generator", _records_sigterm(tmp_path / "o", "gen-0")))
    wait_until(lambda: quitter.returncode is not None, 30, "gen-1 exited")
    assert [c.name for c in cluster.exited()] == ["gen-1"]
    assert cluster.exited() == []
    assert [c.name for c in cluster.alive("generator")] == ["gen-0"]
    wait_until(lambda: "ready" in keeper.spec.log.read_text(), 30, "gen-0 up")
    cluster.stop()
    assert cluster.exited() == []


LAUNCHER = """
    import sys, time
    from pathlib import Path
    from services.launcher.cluster import Cluster, ServiceSpec
    run = Path(sys.argv[1])
    cluster = Cluster(run, stop_grace_s=5)
    child = cluster.start(ServiceSpec("sleeper", "store", [sys.executable, "-c", "import time; time.sleep(1000)"],
                                      run / "sleeper.log", lambda: True))
    print(child.process.pid, flush=True)
    time.sleep(1000)
"""


def test_children_do_not_outlive_a_launcher_killed_with_sigkill(tmp_path):
    launcher = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(LAUNCHER), str(tmp_path)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    child = 0
    try:
        child = int(launcher.stdout.readline())
        assert _alive(child)
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(30)
        wait_until(lambda: not _alive(child), 15, "the child gone after its launcher died")
    finally:
        launcher.kill()
        launcher.wait()
        if child and _alive(child):
            os.kill(child, signal.SIGKILL)  # the test failed: leave nothing behind


def test_a_sigterm_whose_keyboard_interrupt_is_swallowed_still_ends_the_start(tmp_path):
    # The signal lands in code that swallows the KeyboardInterrupt (here a health check; in the wild a
    # finalizer run by the garbage collector). The wait must end on it all the same, not time out or go on.
    interrupts = Interrupts()
    checks = []

    def swallowing_check() -> bool:
        checks.append(1)
        try:
            if len(checks) == 2:
                os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(5):  # the handler runs in here, inside the try (another thread may take the signal)
                time.sleep(0.01)
        except KeyboardInterrupt:
            pass
        return False

    cluster = Cluster(tmp_path, stop_grace_s=1)
    cluster.start(_spec(tmp_path, "gen-0", "generator", "import time; time.sleep(1000)", ready=swallowing_check))
    interrupts.install()
    try:
        with pytest.raises(KeyboardInterrupt):
            cluster.wait_ready(30, poll_s=0.05, go_on=interrupts.check)
    finally:
        interrupts.restore()
        cluster.stop()
    assert len(checks) == 2 and interrupts.received.is_set()
    assert signal.getsignal(signal.SIGTERM) is not interrupts._handle  # restored


def test_a_signal_while_a_child_starts_comes_after_the_child_is_recorded(tmp_path, monkeypatch):
    # The child sends the launcher SIGTERM between fork and exec, while Popen waits for the exec: the
    # interrupt must come only once the child is recorded (to be stopped), as `UpRun.start` starts children.
    import services.launcher.cluster as cluster_module

    original = cluster_module._die_with_parent

    def signal_the_launcher_first() -> None:
        os.kill(os.getppid(), signal.SIGTERM)
        original()

    monkeypatch.setattr(cluster_module, "_die_with_parent", signal_the_launcher_first)
    interrupts = Interrupts()
    cluster = Cluster(tmp_path, stop_grace_s=10)
    stopped = tmp_path / "stopped.txt"
    interrupts.install()
    try:
        with pytest.raises(KeyboardInterrupt), interrupts.deferred():
            cluster.start(_spec(tmp_path, "gen-0", "generator", _records_sigterm(stopped, "gen-0")))
    finally:
        interrupts.restore()
    assert list(cluster.children) == ["gen-0"]
    cluster.wait_ready(30)
    cluster.stop()
    assert stopped.read_text().split() == ["gen-0"] and cluster.children["gen-0"].returncode == 0
