"""`sparrow up --resume RUN_DIR`: the same run, carried on after its launcher died (a reboot, an OOM kill, a
lost SSH session) or after it ended, to more steps.

What carries the run across, all of it in the run folder:

    config.toml            the resolved config the run started with: the config again. Flags and --set may
                           change only what does not change what is trained (RESUMABLE); --steps may raise
                           the total, never lower it below the trainer's newest checkpoint
    trainer/               the newest checkpoint that loads (its meta names every group trained or dropped),
                           the trajectory store and the group ledger: the trainer resumes as after a crash
    redis/                 Redis writes every change to an append-only file (fsync per write): the prompt
                           stream with its consumer group and pending entries, the controller's schedule and
                           its history, so the controller resumes from the last schedule it published
    metrics.jsonl          the history, read on from where the launcher before had read the trainer's records
                           (history.json); step numbers, elapsed time and the report go on as one run
    tracking.json          the run's tracker key: the same W&B run (resumed by id) and MLflow run (found by tag);
                           TensorBoard writes on into the same folder
    prometheus/data        the metrics Prometheus scraped before

Before anything starts: the folder is not in use (up.lock, held by a running launcher) and the services
of the launcher before are gone (processes.json); they got SIGTERM from the kernel when it died and are
given `timeouts.stop_grace_s` to finish what they were doing (the trainer's checkpoint).
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from pathlib import Path
from typing import IO

from services.launcher.cluster import PROCESSES_FILE
from services.launcher.config import UpConfig
from services.launcher.plan import SetupError
from services.launcher.tracking.names import flat_config

CONFIG_FILE = "config.toml"
LOCK_FILE = "up.lock"

# Settings a resume may change: none of them changes what is trained or how.
RESUMABLE = (
    "steps",
    "run_dir",
    "token",
    "ports.",
    "timeouts.",
    "tracking.",
    "trainer_restarts",
    "sandbox_restarts",
    "scrape_interval_s",
    "promql_window_s",
)


class ResumeError(SetupError):
    """The run folder cannot be resumed as asked; one line."""


def saved_config(run_dir: Path, overrides: dict) -> UpConfig:
    """The run's own config with `overrides` (flags and --set); ResumeError if one would change what is trained."""
    from sparrow.config import ConfigError, load_config

    path = run_dir / CONFIG_FILE
    if not path.is_file():
        raise ResumeError(f"{run_dir} holds no {CONFIG_FILE}: not the folder of a sparrow up run")
    try:
        before = load_config(UpConfig, str(path), {})
        after = load_config(UpConfig, str(path), overrides | {"run_dir": str(run_dir)})
    except ConfigError as exc:
        raise ResumeError(f"{path}: {exc}") from None
    old, new = flat_config(before.dump_public()), flat_config(after.dump_public())
    changed = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
    refused = [k for k in changed if not any(k == r or (r.endswith(".") and k.startswith(r)) for r in RESUMABLE)]
    if refused:
        allowed = ", ".join(r + "*" if r.endswith(".") else r for r in RESUMABLE if r not in ("run_dir", "token"))
        raise ResumeError(
            f"--resume carries on the run as it was configured; these would change what it trains: "
            f"{', '.join(refused)} (a resume may change {allowed})"
        )
    trained = trained_steps(run_dir / "trainer")
    if after.steps < trained:
        raise ResumeError(f"--steps {after.steps} is below the {trained} steps the run has trained already")
    return after


def trained_steps(trainer_dir: Path) -> int:
    """The step of the trainer's newest complete checkpoint (0 without one)."""
    from services.trainer.checkpoint import complete_checkpoints

    for path in reversed(complete_checkpoints(trainer_dir / "checkpoints")):
        try:
            return int(json.loads((path / "meta.json").read_text())["step"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return 0


def hold_run_folder(run_dir: Path) -> IO:
    """Take the run folder for this launcher (kept until the returned file is closed, or the process ends);
    ResumeError if another launcher holds it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    f = (run_dir / LOCK_FILE).open("a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "?"
        f.close()
        raise ResumeError(f"run folder {run_dir} is in use by a running sparrow up (pid {holder})") from None
    f.truncate(0)
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


def wait_for_earlier_services(run_dir: Path, grace_s: float, poll_s: float = 0.2) -> None:
    """Wait until the services of the launcher before have exited; ResumeError naming those left after `grace_s`."""
    try:
        entries = json.loads((run_dir / PROCESSES_FILE).read_text())
    except (OSError, ValueError):
        return  # it started none
    running = {e["name"]: int(e["pid"]) for e in entries if isinstance(e, dict) and e.get("returncode") is None}
    deadline = time.monotonic() + grace_s
    while True:
        left = {name: pid for name, pid in running.items() if _running(pid)}
        if not left:
            return
        if time.monotonic() >= deadline:
            named = ", ".join(f"{name} (pid {pid})" for name, pid in sorted(left.items()))
            raise ResumeError(f"the run's services from before are still running: {named}; stop them, then resume")
        time.sleep(poll_s)


def _running(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie, dead and not yet reaped by its new parent, is not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")
