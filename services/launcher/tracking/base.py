"""What every experiment tracker does for a run, and the fan-out that keeps a failing one from the run.

A tracker gets the run's resolved config once, each step's metrics once (flat names, see names.py), each
evaluation round's figures once per mode at the step the round ran after (it ends steps later: training
goes on while it generates), the report's plots at the end, and is closed. `Trackers` gives each tracker
a thread of its own, so a backend that blocks (a tracking server that accepts and never answers) holds
up neither the launcher's supervision nor the other trackers; any failure (an unwritable folder, a full
disk, a server gone) is logged once, and that tracker is dropped for the rest of the run. Tracking never
stops a training run.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path

from services.launcher.tracking.names import tracked_eval_metrics, tracked_metrics
from services.trainer.store import replace_text

log = logging.getLogger("sparrow.up.tracking")

LOG_STEP = "log step "  # a step's call: "log step N"
FINISH_TIMEOUT_S = 120.0  # what a tracker gets at the end to write what it was given, then it is left


class Tracker(ABC):
    """One backend (TensorBoard, W&B, MLflow) for one run."""

    name: str

    @abstractmethod
    def start(self, config: dict) -> None:
        """Open the run and record its resolved config (nested plain data)."""

    @abstractmethod
    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        """Record one step's metrics."""

    def log_eval(self, step: int, metrics: dict[str, float]) -> None:
        """Record an evaluation round's metrics at `step`, the step it ran after (older than the last logged)."""
        self.log_metrics(step, metrics)

    @abstractmethod
    def log_images(self, step: int, images: dict[str, Path]) -> None:
        """Record PNG files (name -> path) at `step`."""

    @abstractmethod
    def close(self) -> None:
        """Flush and end the run."""


class _Worker:
    """One tracker's calls, in order, on a thread of its own; after the first failure the rest are skipped."""

    def __init__(
        self,
        tracker: Tracker,
        failed: Callable[[Tracker, str, Exception], None],
        done: Callable[[Tracker, str], None] = lambda tracker, what: None,
    ) -> None:
        self.tracker = tracker
        self.failed = False
        self._on_failure = failed
        self._on_done = done
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=f"tracking-{tracker.name}", daemon=True)
        self._thread.start()

    def submit(self, what: str, fn: Callable[[Tracker], None]) -> None:
        self._queue.put((what, fn))

    def _run(self) -> None:
        while True:
            what, fn = self._queue.get()
            try:
                if fn is None:
                    return
                if not self.failed:
                    fn(self.tracker)
                    self._on_done(self.tracker, what)
            except Exception as exc:  # whatever a backend raises, the run goes on without it
                self.failed = True
                self._on_failure(self.tracker, what, exc)
                if what != "close":
                    try:
                        self.tracker.close()
                    except Exception:  # it failed already; its close is best effort
                        pass
            finally:
                self._queue.task_done()

    def drain(self, deadline: float) -> bool:
        """Wait until every call submitted so far has run (False when `deadline` passes first)."""
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline or not self._thread.is_alive():
                return False
            time.sleep(0.01)
        return True

    def stop(self, deadline: float) -> bool:
        self._queue.put(("stop", None))
        self._thread.join(max(0.0, deadline - time.monotonic()))
        return not self._thread.is_alive()


class Trackers:
    """Every tracker of a run; each step is logged once, a tracker that fails is reported once and dropped."""

    def __init__(
        self,
        trackers: list[Tracker],
        notify: Callable[[str], None] = lambda message: None,
        record: Path | None = None,
    ) -> None:
        """`record`: a JSON file where the last step each tracker has written is kept (`logged`), so that a resumed
        run gives each one the steps it never got (`catch_up`); other keys of the file are left as they are."""
        self.notify = notify
        self.status: dict[str, str] = {t.name: "ok" for t in trackers}
        self.last_step = 0
        self._record = record
        self._record_lock = threading.Lock()
        self.logged: dict[str, int] = self._read_record().get("logged", {}) if record is not None else {}
        self._workers = [_Worker(t, self._failed, self._done) for t in trackers]

    def _read_record(self) -> dict:
        try:
            data = json.loads(self._record.read_text())
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}

    def _done(self, tracker: Tracker, what: str) -> None:
        if self._record is None or not what.startswith(LOG_STEP):
            return
        step = int(what[len(LOG_STEP) :])
        with self._record_lock:
            if step <= self.logged.get(tracker.name, 0):
                return
            self.logged[tracker.name] = step
            replace_text(self._record, json.dumps(self._read_record() | {"logged": dict(self.logged)}) + "\n")

    def catch_up(self, rows: list[dict]) -> None:
        """A resumed run's history so far: each tracker gets the rows after the last step it wrote (a launcher
        killed with SIGKILL loses what its trackers had queued); later `log_row` calls go on after them."""
        for worker in self._workers:
            done = self.logged.get(worker.tracker.name, 0)
            for row in rows:
                step = row.get("step")
                if isinstance(step, int) and step > done and not worker.failed:
                    metrics = tracked_metrics(row)
                    worker.submit(
                        f"{LOG_STEP}{step}", lambda t, step=step, metrics=metrics: t.log_metrics(step, metrics)
                    )
        steps = [r["step"] for r in rows if isinstance(r.get("step"), int)]
        self.last_step = max([self.last_step, *steps])

    def _failed(self, tracker: Tracker, what: str, exc: Exception) -> None:
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}".rstrip(": ")
        message = f"tracking: {tracker.name} failed to {what} ({error}); disabled for this run"
        log.warning(message)
        self.status[tracker.name] = f"disabled: {error}"
        self.notify(message)

    def _submit(self, what: str, fn: Callable[[Tracker], None]) -> None:
        for worker in self._workers:
            if not worker.failed:
                worker.submit(what, fn)

    def start(self, config: dict) -> None:
        """Open every tracker's run (in the background)."""
        self._submit("start", lambda t: t.start(config))

    def log_row(self, row: dict) -> None:
        """A history row, once per step (a step already logged is skipped); returns at once."""
        step = row.get("step")
        if not isinstance(step, int) or step <= self.last_step:
            return
        self.last_step = step
        metrics = tracked_metrics(row)
        self._submit(f"{LOG_STEP}{step}", lambda t: t.log_metrics(step, metrics))

    def log_eval(self, row: dict) -> None:
        """An evaluation row of the history (one round, one mode), at the step it ran after; returns at once."""
        step = row.get("step")
        if not isinstance(step, int) or step < 0:
            return
        metrics = tracked_eval_metrics(row)
        if metrics:
            what = f"log evaluation round {row.get('round')} ({row.get('mode')})"
            self._submit(what, lambda t: t.log_eval(step, metrics))

    def flush(self, timeout_s: float = FINISH_TIMEOUT_S) -> None:
        """Wait until every tracker has handled what it was given (a blocked one is waited for `timeout_s`)."""
        deadline = time.monotonic() + timeout_s
        for worker in self._workers:
            worker.drain(deadline)

    def finish(self, report_dir: Path | None, timeout_s: float = FINISH_TIMEOUT_S) -> None:
        """The report's plots (at the last step), then close every tracker; one still busy after `timeout_s` is left."""
        images = {f"report/{p.stem}": p for p in sorted(report_dir.glob("*.png"))} if report_dir else {}
        if images:
            self._submit("log the report's plots", lambda t: t.log_images(max(self.last_step, 0), images))
        self._submit("close", lambda t: t.close())
        deadline = time.monotonic() + timeout_s
        for worker in self._workers:
            if not worker.stop(deadline):
                name = worker.tracker.name
                message = f"tracking: {name} did not finish within {timeout_s:.0f} s; what it had not written is lost"
                log.warning(message)
                self.status[name] = "unfinished"
                self.notify(message)
        self._workers = []
