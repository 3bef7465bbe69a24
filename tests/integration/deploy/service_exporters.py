"""Exporters that serve every metric name the dashboards and alerts use, for a real Prometheus to scrape.

Each exporter is the service's own metrics class (`services.trainer.metrics.TrainerMetrics` with its
`TailMetrics`, `services.generator.metrics.GeneratorMetrics`, `services.controller.metrics.
ControllerMetrics`), fed by the test instead of by a running service: the metric names, types and
labels are the services' real ones, the values are made up. A background thread plays training
steps and engine steps, so every counter and histogram moves and `rate(...)` has something to
measure. To check against the services themselves, point the tests at the Prometheus of a running
cluster (see test_dashboards_live.py).

    with running_cluster(p5={"0": 0.95, "2": 0.70}) as cluster:
        prometheus_server(cluster.scrape_targets) ...
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

import torch
from prometheus_client import start_http_server

from services.controller.metrics import ControllerMetrics
from services.controller.readings import BinStatus
from services.generator.engine import CycleTime, EngineVersions, FinishedSample
from services.generator.metrics import GeneratorMetrics
from services.trainer.metrics import TrainerMetrics
from sparrow.schedule import Schedule
from tests.servers import free_port

BIN_WIDTH = 2000
BINS = ("0", "1", "2", "3")
SCHEDULE = Schedule(budgets=(1024, 2048, 3072, 4096), bin_width=BIN_WIDTH, version=3)


class TrainerExporter:
    """The trainer's metrics; each `tick` is one training step whose bins have the configured p5."""

    def __init__(self, p5: dict[str, float]) -> None:
        self.metrics = TrainerMetrics(BIN_WIDTH, len(BINS))
        self.registry = self.metrics.registry
        self.p5 = p5

    def tick(self, step: int) -> None:
        m = self.metrics
        alpha, kv_lens = [], []
        for b in BINS:
            # 200 tokens per bin whose 5th percentile is the configured p5 (0.97 by default).
            low = self.p5.get(b, 0.97)
            values = torch.cat([torch.full((10,), low), torch.linspace(low, 1.0, 190)])
            alpha.append(values)
            kv_lens.append(torch.full((200,), int(b) * BIN_WIDTH + 100))
            m.alpha_mean.labels(bin=b).set(float(values.mean()))
        bound = torch.cat(alpha).double()
        # A trainer with alpha = "exact": the exact values sit above the bound, a few tokens under 0.5 on both.
        bound[::97] = 0.3
        exact = (bound + 0.02).clamp(max=1.0)
        m.tail.record_step(bound, torch.cat(kv_lens), oldest_schedule_version=SCHEDULE.version, exact=exact)
        m.reward_mean.set(0.4 + 0.01 * (step % 10))
        m.accuracy.set(0.35)
        m.response_length.set(800.0)
        m.tis_clip.set(0.01)
        m.kl.set(0.002)
        m.step_seconds.observe(1.5)
        for phase, seconds in (("wait_groups", 0.5), ("score", 0.25), ("update", 0.5), ("publish", 0.125),
                               ("other", 0.125)):  # fmt: skip
            m.phase_seconds.labels(phase=phase).inc(seconds)
        m.steps.inc()
        m.policy_version.set(step)
        m.staleness.set(0.5)
        m.dropped_stale.inc(step % 2)
        m.trajectories.labels(status="accepted").inc(8)
        m.groups_dead.inc(0)
        m.last_step.set(time.time())
        m.outstanding.set(16)
        # An evaluation round's figures, dense and under the schedule, as the trainer exports them after each round.
        m.eval_avg.labels(source="math", mode="dense").set(0.3)
        m.eval_avg.labels(source="math", mode="schedule").set(0.25)
        m.eval_pass.labels(source="math", k="4", mode="dense").set(0.55)
        m.eval_pass.labels(source="math", k="4", mode="schedule").set(0.5)


class GeneratorExporter:
    """The generator's metrics; each `tick` is one engine step that finished a response."""

    def __init__(self) -> None:
        self.metrics = GeneratorMetrics()
        self.registry = self.metrics.registry
        self.metrics.show_schedule(SCHEDULE)

    def tick(self, step: int) -> None:
        m = self.metrics
        # A response of 40 tokens after a prompt reaching into each bin, under the schedule's budgets.
        for b in BINS:
            m.record_tokens(int(b) * BIN_WIDTH + 1500, [SCHEDULE.budgets[int(b)]] * 40)
        m.queue_lag.set(12)
        m.queue_pending.set(8)
        m.queue_wait.observe(0.3)
        m.in_flight.set(8)
        m.show_versions(policy=step, adapter=1)
        m.swaps.labels(kind="policy", outcome="ok").inc(step % 2)
        m.trajectories.labels(status="accepted").inc()
        m.groups.labels(outcome="done").inc(step % 2)
        m.step_seconds.observe(0.05)
        m.record_phases({"prefill": 0.01, "decode": 0.2, "idle": 0.03, "other": 0.01})
        m.policy_fetch_bytes.labels(kind="delta", source="peer").inc(1 << 20)
        m.policy_fetch_failures.labels(reason="unavailable").inc(step % 2)
        m.policy_sync_seconds.set(1.5)
        # One speculative sample per bin: two cycles of k = 3 drafts, the first cycle's three accepted.
        for b in BINS:
            kv = int(b) * BIN_WIDTH + 1500
            m.record_speculation(
                FinishedSample(
                    group_id=f"s{step}-{b}", sample_index=0, prompt_token_ids=[1], token_ids=[2], logprobs=[0.0],
                    top_token_ids=[[2]], top_logprobs=[[0.0]], kv_budgets=[0], versions=EngineVersions(),
                    finish_reason="stop", speculative_tokens=3, drafted_tokens=6, accepted_tokens=4,
                    draft_alphas=[0.98, 0.97, 0.95, 0.9, 0.6, 0.8], draft_accepted=[True] * 4 + [False] * 2,
                    draft_kv_lens=[kv + i for i in range(6)],
                )
            )  # fmt: skip
            # Two timed cycles of the batch: k = 3 draft steps in 12 ms, the verify and the rest in 10 ms.
            m.record_cycle(CycleTime(rows=8, kv_len=kv, draft_seconds=0.012, verify_seconds=0.010))
            m.record_cycle(CycleTime(rows=8, kv_len=kv + 4, draft_seconds=0.012, verify_seconds=0.010))


class ControllerExporter:
    """The controller's metrics, showing the four-bin schedule."""

    def __init__(self) -> None:
        self.metrics = ControllerMetrics()
        self.registry = self.metrics.registry
        self.metrics.target.set(0.88)
        self.metrics.blind.set(0)
        self.metrics.paused.set(0)

    def tick(self, step: int) -> None:
        self.metrics.show_schedule(SCHEDULE.budgets, version=SCHEDULE.version, speedup=2.4)
        self.metrics.show_estimates({i: 0.9 for i in range(len(BINS))})
        self.metrics.show_draft_estimates(
            [BinStatus(bin=i, budget=b, estimate=0.95, predicted_gain=1.8) for i, b in enumerate(SCHEDULE.budgets)]
        )
        self.metrics.step_overhead.set(120.0)
        self.metrics.draft_fixed.set(0.004)
        self.metrics.ticks.labels(outcome="ok").inc()
        self.metrics.decisions.labels(reason="lower").inc(step % 2)


@dataclass
class Cluster:
    """Stand-in exporters on loopback: `scrape_targets` is job -> host:port list, as prometheus_server takes."""

    trainer: TrainerExporter
    generators: list[GeneratorExporter]
    controller: ControllerExporter
    scrape_targets: dict[str, list[str]] = field(default_factory=dict)


@contextmanager
def running_cluster(p5: dict[str, float] | None = None, generators: int = 2, tick_s: float = 0.25) -> Iterator[Cluster]:
    """Serve a trainer (with per-bin `p5`), `generators` generators and a controller until the block exits."""
    torch.set_num_threads(1)
    cluster = Cluster(TrainerExporter(p5 or {}), [GeneratorExporter() for _ in range(generators)], ControllerExporter())
    parts = {"trainer": [cluster.trainer], "generator": cluster.generators, "controller": [cluster.controller]}
    stop = threading.Event()

    def drive() -> None:
        step = 0
        while not stop.is_set():
            step += 1
            for members in parts.values():
                for part in members:
                    part.tick(step)
            stop.wait(tick_s)

    with ExitStack() as stack:
        for job, members in parts.items():
            for part in members:
                port = free_port()
                server, _ = start_http_server(port, addr="127.0.0.1", registry=part.registry)
                stack.callback(server.server_close)
                stack.callback(server.shutdown)
                cluster.scrape_targets.setdefault(job, []).append(f"127.0.0.1:{port}")
        for members in parts.values():
            for part in members:
                part.tick(0)
        driver = threading.Thread(target=drive, name="service-exporters", daemon=True)
        driver.start()
        stack.callback(driver.join, 5)
        stack.callback(stop.set)
        yield cluster
