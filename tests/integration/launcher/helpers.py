"""Running `sparrow up` as a user would, in a child process, and reading what it leaves behind."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.cli_runner import REPO

TINY = REPO / "models" / "tiny"


def tiny_config(
    path: Path,
    schedule: dict | None = None,
    pairs: int = 4,
    top: dict | None = None,
    trainer: dict | None = None,
    extra: str = "",
) -> Path:
    """An up config for fast runs: the reference engine (torch kernels), small groups, 16 new tokens.

    `top` and `trainer` add keys to the top level and the [trainer] table; `extra` is appended TOML."""
    lines = ['engine = "reference"', *(f"{k} = {json.dumps(v)}" for k, v in (top or {}).items())]
    if schedule is not None:
        schedule_file = path.parent / "schedule.json"
        schedule_file.write_text(json.dumps(schedule))
        lines.append(f"schedule = {json.dumps(str(schedule_file))}")
    lines += [
        "[timeouts]",
        "start_s = 240",
        "step_s = 240",
        "stop_grace_s = 15",
        "[trainer]",
        "groups_per_step = 2",
        *(f"{k} = {json.dumps(v)}" for k, v in (trainer or {}).items()),
        "[trainer.task]",
        f"pairs = {pairs}",
        "min_hops = 1",
        "max_hops = 2",
        "[trainer.sampling]",
        "n = 4",
        "max_new_tokens = 16",
        "[trainer.optim]",
        "lr = 0.001",
        "[generator.engine]",
        'device = "cpu"',
        'kernel_backend = "torch"',
    ]
    path.write_text("\n".join(lines) + "\n" + extra)
    return path


class UpProcess:
    """`sparrow up ... --json` in the background; its stdout lines are parsed as they come."""

    def __init__(self, *args: str, sigint_ignored: bool = False) -> None:
        """`sigint_ignored`: start it as a non-interactive shell starts a background job (SIGINT ignored)."""
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sparrow_cli.main", "up", *args],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sigint_ignored else None,
        )
        self.objects: queue.Queue = queue.Queue()
        self.lines: list[dict] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            obj = json.loads(line)  # --json: every stdout line is one JSON object
            self.lines.append(obj)
            self.objects.put(obj)

    def next_object(self, timeout: float) -> dict:
        """The next JSON object printed (TimeoutError when none comes)."""
        try:
            return self.objects.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no output in {timeout:.0f} s; stderr: {self.stderr_so_far()}") from None

    def stderr_so_far(self) -> str:
        return "" if self.proc.poll() is None else self.proc.stderr.read()[-3000:]

    def wait(self, timeout: float) -> int:
        code = self.proc.wait(timeout)
        self._reader.join(10)
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def processes(run_dir: Path) -> dict[str, dict]:
    """RUN_DIR/processes.json by service name."""
    return {p["name"]: p for p in json.loads((run_dir / "processes.json").read_text())}


def wait_for_processes(up: UpProcess, run_dir: Path, names: set[str], timeout: float) -> dict[str, dict]:
    """processes.json once it lists every one of `names`, each healthy."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if up.proc.poll() is not None:
            raise RuntimeError(f"sparrow up exited with {up.proc.returncode}: {up.stderr_so_far()}")
        try:
            found = processes(run_dir)
            if names <= set(found) and all(found[n]["ready"] for n in names):
                return found
        except (OSError, ValueError):
            pass
        time.sleep(0.2)
    raise TimeoutError(f"processes.json never listed {sorted(names)}")


def alive(pid: int) -> bool:
    """True while `pid` is a process that has not exited (zombies count as exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def trained_and_dropped(run_dir: Path) -> tuple[list[list[str]], list[str], set[str]]:
    """The trainer's own record: groups per trained step and dropped (newest checkpoint), and every ledger group."""
    newest = sorted((run_dir / "trainer" / "checkpoints").glob("step-*/meta.json"))[-1]
    meta = json.loads(newest.read_text())
    ledger = set()
    for line in (run_dir / "trainer" / "groups.log").read_text().splitlines():
        entry = json.loads(line)
        if entry["kind"] == "enqueued":
            ledger.add(entry["group"]["group_id"])
    return meta["history"], meta["dropped"], ledger
