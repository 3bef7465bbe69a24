"""What every experiment tracker does for a run, and the fan-out that keeps a failing one from the run.

A tracker gets the run's resolved config once, each step's metrics once (flat names, see names.py), the
report's plots at the end, and is closed. `Trackers` calls every tracker and turns any failure (an
unwritable folder, a full disk, a tracking server gone) into one logged message, after which that
tracker is disabled: tracking never stops or slows a training run.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path

from services.launcher.tracking.names import tracked_metrics

log = logging.getLogger("sparrow.up.tracking")


class Tracker(ABC):
    """One backend (TensorBoard, W&B, MLflow) for one run."""

    name: str

    @abstractmethod
    def start(self, config: dict) -> None:
        """Open the run and record its resolved config (nested plain data)."""

    @abstractmethod
    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        """Record one step's metrics."""

    @abstractmethod
    def log_images(self, step: int, images: dict[str, Path]) -> None:
        """Record PNG files (name -> path) at `step`."""

    @abstractmethod
    def close(self) -> None:
        """Flush and end the run."""


class Trackers:
    """Every tracker of a run; each step is logged once, a tracker that fails is reported once and dropped."""

    def __init__(self, trackers: list[Tracker], notify: Callable[[str], None] = lambda message: None) -> None:
        self.trackers = list(trackers)
        self.notify = notify
        self.status: dict[str, str] = {t.name: "ok" for t in trackers}
        self.last_step = 0

    def _call(self, what: str, fn: Callable[[Tracker], None], closing: bool = False) -> None:
        for tracker in list(self.trackers):
            try:
                fn(tracker)
            except Exception as exc:  # whatever a backend raises, the run goes on without it
                error = f"{type(exc).__name__}: {exc}"
                message = f"tracking: {tracker.name} failed to {what} ({error}); disabled for this run"
                log.warning(message)
                self.notify(message)
                self.status[tracker.name] = f"disabled: {error}"
                self.trackers.remove(tracker)
                if closing:
                    continue
                try:
                    tracker.close()
                except Exception:  # it failed already; its close is best effort
                    pass

    def start(self, config: dict) -> None:
        """Open every tracker's run."""
        self._call("start", lambda t: t.start(config))

    def log_row(self, row: dict) -> None:
        """A history row, once per step (a step already logged is skipped)."""
        step = row.get("step")
        if not isinstance(step, int) or step <= self.last_step:
            return
        self.last_step = step
        metrics = tracked_metrics(row)
        self._call(f"log step {step}", lambda t: t.log_metrics(step, metrics))

    def finish(self, report_dir: Path | None) -> None:
        """The report's plots (at the last step), then close every tracker."""
        images = {f"report/{p.stem}": p for p in sorted(report_dir.glob("*.png"))} if report_dir else {}
        if images:
            self._call("log the report's plots", lambda t: t.log_images(max(self.last_step, 0), images))
        self._call("close", lambda t: t.close(), closing=True)
        self.trackers = []
