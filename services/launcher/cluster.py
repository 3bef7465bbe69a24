"""Process supervision: start each service as a child in its own process group, wait for health, stop all.

Every child gets a session (and so a process group) of its own: a Ctrl-C in the terminal reaches
the launcher only, which then stops the services in order (generators first, so they hand their
unfinished groups back while Redis is up; Redis last). Stopping a service sends SIGTERM to its
whole group, waits `stop_grace_s`, then SIGKILLs the group, so nothing a service started itself
is left behind. On Linux each child also gets SIGTERM should the launcher die without stopping it.

`RUN_DIR/processes.json` lists every child (pid, process group, log, exit status) as it changes.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from services.common.exits import describe_exit

log = logging.getLogger("sparrow.up.cluster")

PROCESSES_FILE = "processes.json"
# Stop order: lower first, equal ones together. Generators hand work back through Redis, so Redis goes last;
# the sandbox outlives the trainer, whose last rewards may still be running.
STOP_ORDER = {"generator": 0, "controller": 0, "trainer": 1, "sandbox": 2, "monitor": 2, "store": 3}


class StartError(RuntimeError):
    """A service did not come up: it exited, or was not healthy in time; the message ends with its log."""


@dataclass
class ServiceSpec:
    """How to run one service and how to tell that it is ready."""

    name: str
    role: str  # store, monitor, sandbox, trainer, generator, controller (decides the stop order)
    argv: list[str]
    log: Path
    ready: Callable[[], bool]
    env: dict[str, str] | None = None
    cwd: Path | None = None
    ports: dict[str, int] = field(default_factory=dict)


@dataclass
class Child:
    """A started service."""

    spec: ServiceSpec
    process: subprocess.Popen
    started: float
    ready: bool = False
    stopping: bool = False
    reported: bool = False  # its exit has been handed to the caller
    restarts: int = 0  # times it was started again after it exited

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def returncode(self) -> int | None:
        return self.process.poll()

    def log_tail(self, chars: int = 1500) -> str:
        """The end of the service's log."""
        try:
            return self.spec.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


def _die_with_parent() -> None:  # runs in the child between fork and exec
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Cluster:
    """The children of one run, started in order and stopped in STOP_ORDER."""

    def __init__(self, run_dir: Path, stop_grace_s: float) -> None:
        self.run_dir = run_dir
        self.stop_grace_s = stop_grace_s
        self.children: dict[str, Child] = {}

    def start(self, spec: ServiceSpec) -> Child:
        """Start `spec` (not waiting for health)."""
        if spec.name in self.children:
            raise ValueError(f"service {spec.name} is started already")
        spec.log.parent.mkdir(parents=True, exist_ok=True)
        with spec.log.open("ab") as out:
            process = subprocess.Popen(
                spec.argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=spec.env,
                cwd=spec.cwd,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        child = Child(spec, process, time.monotonic())
        self.children[spec.name] = child
        log.info("started %s (pid %d), log %s", spec.name, process.pid, spec.log)
        self._write()
        return child

    def restart(self, name: str) -> Child:
        """Start the exited child `name` again from its spec (not waiting for health); its log goes on."""
        old = self.children.pop(name)
        if old.returncode is None:
            self.children[name] = old
            raise ValueError(f"service {name} is still running")
        _signal_group(old.process.pid, signal.SIGKILL)  # what the dead one started (its jailed programs) goes too
        try:
            child = self.start(old.spec)
        except BaseException:
            self.children[name] = old
            raise
        child.restarts = old.restarts + 1
        self._write()
        return child

    def poll_ready(self) -> list[Child]:
        """Children (restarted ones) that turned healthy since the last look; never waits."""
        out = []
        for child in self.children.values():
            if not child.ready and child.returncode is None and child.spec.ready():
                child.ready = True
                log.info("%s is ready (%.1f s)", child.name, time.monotonic() - child.started)
                out.append(child)
        if out:
            self._write()
        return out

    def wait_ready(self, timeout_s: float, poll_s: float = 0.25, go_on: Callable[[], None] = lambda: None) -> None:
        """Block until every child is healthy; StartError when one exits first or `timeout_s` passes.

        `go_on` is called before every poll; what it raises (the launcher's interrupt) ends the wait.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            go_on()
            waiting = [c for c in self.children.values() if not c.ready]
            for child in waiting:
                code = child.returncode
                if code is not None:
                    child.reported = True
                    self._write()
                    raise StartError(f"{child.name} exited ({describe_exit(code)}) while starting:\n{child.log_tail()}")
                if child.spec.ready():
                    child.ready = True
                    log.info("%s is ready (%.1f s)", child.name, time.monotonic() - child.started)
                    self._write()
            if all(c.ready for c in self.children.values()):
                return
            if time.monotonic() > deadline:
                slow = [c for c in self.children.values() if not c.ready]
                names = ", ".join(c.name for c in slow)
                raise StartError(f"not healthy after {timeout_s:.0f} s: {names}\n{slow[0].log_tail()}")
            time.sleep(poll_s)

    def exited(self) -> list[Child]:
        """Children that exited since the last call (stopped ones excluded)."""
        out = []
        for child in self.children.values():
            if not child.reported and not child.stopping and child.returncode is not None:
                child.reported = True
                out.append(child)
        if out:
            self._write()
        return out

    def alive(self, role: str) -> list[Child]:
        """Running children of `role`."""
        return [c for c in self.children.values() if c.spec.role == role and c.returncode is None]

    def stop(self, roles: tuple[str, ...] | None = None) -> None:
        """Stop the children of `roles` (all when None), in STOP_ORDER, each role's children together."""
        chosen = [c for c in self.children.values() if roles is None or c.spec.role in roles]
        for order in sorted({STOP_ORDER.get(c.spec.role, 0) for c in chosen}):
            batch = [c for c in chosen if STOP_ORDER.get(c.spec.role, 0) == order]
            for child in batch:
                child.stopping = True
                if child.returncode is None:
                    log.info("stopping %s (pid %d)", child.name, child.process.pid)
                    _signal_group(child.process.pid, signal.SIGTERM)
            deadline = time.monotonic() + self.stop_grace_s
            for child in batch:
                try:
                    child.process.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    log.warning("%s did not stop in %.0f s: killing it", child.name, self.stop_grace_s)
                # Whatever is left of its group (its own children) goes too.
                _signal_group(child.process.pid, signal.SIGKILL)
                child.process.wait()
        self._write()

    def _write(self) -> None:
        entries = [
            {
                "name": c.name,
                "role": c.spec.role,
                "pid": c.process.pid,
                "pgid": c.process.pid,  # start_new_session: the child leads its own group
                "log": str(c.spec.log),
                "ports": c.spec.ports,
                "ready": c.ready,
                "restarts": c.restarts,
                "returncode": c.process.returncode,
            }
            for c in self.children.values()
        ]
        tmp = self.run_dir / f".{PROCESSES_FILE}.tmp"
        tmp.write_text(json.dumps(entries, indent=1) + "\n")
        os.replace(tmp, self.run_dir / PROCESSES_FILE)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass  # the group is gone already
