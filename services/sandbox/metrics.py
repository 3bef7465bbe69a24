"""The sandbox's Prometheus metrics, on a registry of its own (served on /metrics)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

REQUEST_STATUSES = ("ok", "rejected", "invalid", "unauthorized", "error")
"""ok: run and answered; rejected: queue full (429); invalid: a 4xx for the request itself"""
RUN_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class SandboxMetrics:
    """Requests by status, cases by status, the queue and the workers, run seconds."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("sparrow_sandbox_requests", "Requests by how they ended.", ["status"], registry=r)
        self.cases = Counter("sparrow_sandbox_cases", "Test cases run, by their status.", ["status"], registry=r)
        self.queue_depth = Gauge("sparrow_sandbox_queue_depth", "Requests waiting for a worker.", registry=r)
        self.busy_workers = Gauge("sparrow_sandbox_busy_workers", "Workers running a program now.", registry=r)
        self.workers = Gauge("sparrow_sandbox_workers", "Workers of the pool.", registry=r)
        self.run_seconds = Histogram(
            "sparrow_sandbox_run_seconds", "Wall-clock seconds of one test case's run.", buckets=RUN_BUCKETS, registry=r
        )
        for status in REQUEST_STATUSES:
            self.requests.labels(status)

    def render(self) -> bytes:
        """The text exposition format."""
        return generate_latest(self.registry)
