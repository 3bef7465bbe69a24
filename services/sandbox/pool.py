"""A bounded pool: `workers` threads run programs, at most `queue_limit` requests wait, the next is refused.

Refusing at once (429) rather than queueing without bound keeps a burst of rewards from piling up
minutes of work in one replica; the callers back off and retry, and the autoscaler sees the queue.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from services.sandbox.metrics import SandboxMetrics

T = TypeVar("T")


class QueueFull(RuntimeError):
    """The pool's queue is at its limit; the request was not taken."""


class BoundedPool:
    """Runs blocking jobs on `workers` threads with a queue of at most `queue_limit`."""

    def __init__(self, workers: int, queue_limit: int, metrics: SandboxMetrics) -> None:
        self.workers, self.queue_limit, self.metrics = workers, queue_limit, metrics
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sandbox")
        self._lock = threading.Lock()
        self._waiting = 0
        self._running = 0
        metrics.workers.set(workers)

    @property
    def waiting(self) -> int:
        """Requests taken but not yet started."""
        return self._waiting

    async def run(self, job: Callable[[], T]) -> T:
        """Run `job` on a worker; QueueFull at once when every worker is busy and the queue is full."""
        with self._lock:
            if self._running + self._waiting >= self.workers + self.queue_limit:
                raise QueueFull(f"{self._running} running and {self._waiting} waiting (queue_limit {self.queue_limit})")
            self._waiting += 1
            self.metrics.queue_depth.set(self._waiting)

        def started() -> T:
            with self._lock:
                self._waiting -= 1
                self._running += 1
                self.metrics.queue_depth.set(self._waiting)
                self.metrics.busy_workers.set(self._running)
            try:
                return job()
            finally:
                with self._lock:
                    self._running -= 1
                    self.metrics.busy_workers.set(self._running)

        return await asyncio.get_running_loop().run_in_executor(self._executor, started)

    def close(self) -> None:
        """Wait for the running jobs and stop the threads."""
        self._executor.shutdown(wait=True, cancel_futures=True)
