"""The generator's Prometheus metrics, on a registry of its own, served over HTTP.

Names are fixed (dashboards are written against them); labels stay few-valued (a length bin, a
mode, an outcome: never a generator or group id, Prometheus adds `instance` itself).

A generated token is *sparse* when its KV budget was positive and below its context length (the
KV length when it was produced); otherwise the step attended to everything (dense). The attended
and context KV counters per length bin give, as a ratio of their rates, the share of the KV cache
decode attention actually read in that bin. Tokens are counted in the engine step that generated them
(not when their sequence finishes), so tokens and engine time accrue together and their ratio over any
window is the window's throughput.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from sparrow import metrics_contract as mc
from sparrow.schedule import DEFAULT_BIN_WIDTH, Schedule
from sparrow.timing import OTHER

if TYPE_CHECKING:
    from services.generator.engine import CycleTime, FinishedSample

SWAP_KINDS = ("policy", "adapter", "schedule", "probe")
SWAP_OUTCOMES = ("ok", "refused")
FETCH_FAILURE_REASONS = ("unavailable", "refused", "digest", "delta")
TRAJECTORY_STATUSES = ("accepted", "duplicate", "rejected")
GROUP_OUTCOMES = ("done", "retried", "dead_lettered", "reclaimed")
WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class GeneratorMetrics:
    """Tokens by attention mode, attended KV per bin, speculation per bin, queue, in-flight, versions, swaps,
    outcomes, step time, time by phase."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        b = [mc.BIN_LABEL]
        self.tokens = Counter("sparrow_generator_tokens", "Generated tokens by attention mode.", ["mode"], registry=r)
        self.attended_kv = Counter(
            "sparrow_generator_attended_kv_tokens",
            "KV tokens decode attention read, summed over generated tokens, per context-length bin.",
            b,
            registry=r,
        )
        self.context_kv = Counter(
            "sparrow_generator_context_kv_tokens",
            "KV tokens in context, summed over generated tokens, per context-length bin.",
            b,
            registry=r,
        )
        self.kv_budget = Gauge("sparrow_generator_kv_budget_tokens", "Schedule budget in force per bin.", b, registry=r)
        self.queue_lag = Gauge(
            "sparrow_generator_queue_lag_entries", "Stream entries not yet delivered to any generator.", registry=r
        )
        self.queue_pending = Gauge(
            "sparrow_generator_queue_pending_entries",
            "Stream entries delivered to a generator and not yet acked (in flight, or a dead one's until reclaimed).",
            registry=r,
        )
        self.queue_wait = Histogram(
            "sparrow_generator_queue_wait_seconds",
            "Age of a stream entry when this generator claimed it.",
            buckets=WAIT_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge(
            "sparrow_generator_in_flight_sequences", "Unfinished sequences in the engine.", registry=r
        )
        self.policy_version = Gauge("sparrow_generator_policy_version", "Policy version being served.", registry=r)
        self.adapter_version = Gauge("sparrow_generator_adapter_version", "Adapter version (0: none).", registry=r)
        self.schedule_version = Gauge(mc.GENERATOR_SCHEDULE_VERSION_GAUGE, "Schedule version in force.", registry=r)
        self.swaps = Counter(
            "sparrow_generator_swaps", "Hot swaps by kind and outcome.", ["kind", "outcome"], registry=r
        )
        self.policy_fetch_bytes = Counter(
            "sparrow_generator_policy_fetch_bytes",
            "Bytes of policy versions received, by kind (full, delta) and source (trainer, peer).",
            ["kind", "source"],
            registry=r,
        )
        self.policy_fetch_failures = Counter(
            "sparrow_generator_policy_fetch_failures",
            "Policy fetches from one source that failed, by reason (unavailable, refused, digest, delta).",
            ["reason"],
            registry=r,
        )
        self.policy_sync_seconds = Gauge(
            "sparrow_generator_policy_sync_seconds",
            "Seconds from the trainer publishing the served policy version to this generator serving it.",
            registry=r,
        )
        self.trajectories = Counter(
            "sparrow_generator_trajectories", "Trajectories the trainer acked, by status.", ["status"], registry=r
        )
        self.groups = Counter("sparrow_generator_groups", "Prompt groups by outcome.", ["outcome"], registry=r)
        self.probe_sequences = Counter(
            "sparrow_generator_probe_sequences", "Finished sequences generated at probe budgets.", registry=r
        )
        self.draft_tokens = Counter(
            mc.DRAFT_TOKENS_COUNTER,
            "Speculative decoding: tokens the sparse draft proposed, per context-length bin of the draft step.",
            b,
            registry=r,
        )
        self.accepted_draft_tokens = Counter(
            mc.ACCEPTED_DRAFT_TOKENS_COUNTER,
            "Speculative decoding: drafts the dense verify accepted, per bin (over draft_tokens: the acceptance rate).",
            b,
            registry=r,
        )
        self.speculative_cycles = Counter(
            mc.SPECULATIVE_CYCLES_COUNTER,
            "Speculative decoding: draft-and-verify cycles, per bin of their first draft (accepted drafts over "
            "cycles: the mean accepted length; each cycle also emits one token of the verify).",
            b,
            registry=r,
        )
        self.draft_alpha = Histogram(
            mc.DRAFT_ALPHA_HISTOGRAM,
            "Speculative decoding: sum_x min(p, q) of the dense and draft distributions at each drafted position.",
            b,
            buckets=mc.ALPHA_BUCKETS,
            registry=r,
        )
        self.draft_seconds = Counter(
            mc.DRAFT_SECONDS_COUNTER,
            "Speculative decoding: seconds of the k draft steps of timed cycles (decodes alone), per bin of the "
            "cycle's mean KV length.",
            b,
            registry=r,
        )
        self.verify_seconds = Counter(
            mc.VERIFY_SECONDS_COUNTER,
            "Speculative decoding: seconds of the rest of timed cycles (the dense verify, rejection sampling, the "
            "engine's own work), per bin.",
            b,
            registry=r,
        )
        self.timed_cycles = Counter(
            mc.TIMED_CYCLES_COUNTER, "Speculative decoding: cycles timed, per bin (batch cycles, not rows).", b,
            registry=r,
        )  # fmt: skip
        self.step_seconds = Histogram(
            "sparrow_generator_step_seconds", "Wall time of one engine step.", buckets=STEP_BUCKETS, registry=r
        )
        self.phase_seconds = Counter(
            mc.GENERATOR_PHASE_SECONDS,
            "Seconds of the generator's loop by phase (sparrow.timing): engine prefill, decode and sampling, "
            "weight sync, idle, other.",
            [mc.PHASE_LABEL],
            registry=r,
        )
        for phase in (*mc.GENERATOR_PHASES, OTHER):
            self.phase_seconds.labels(**{mc.PHASE_LABEL: phase})
        for mode in ("sparse", "dense"):
            self.tokens.labels(mode=mode)
        for kind in SWAP_KINDS:
            for outcome in SWAP_OUTCOMES:
                self.swaps.labels(kind=kind, outcome=outcome)
        for kind in ("full", "delta"):
            for source in ("trainer", "peer"):
                self.policy_fetch_bytes.labels(kind=kind, source=source)
        for reason in FETCH_FAILURE_REASONS:
            self.policy_fetch_failures.labels(reason=reason)
        for status in TRAJECTORY_STATUSES:
            self.trajectories.labels(status=status)
        for outcome in GROUP_OUTCOMES:
            self.groups.labels(outcome=outcome)
        self._lock = threading.Lock()
        self._bin_width = DEFAULT_BIN_WIDTH
        self._num_bins: int | None = None
        self._server = None

    def show_schedule(self, schedule: Schedule | None) -> None:
        """The schedule now in force: its version, its budget per bin, and the bins tokens are counted in."""
        with self._lock:
            self.kv_budget.clear()
            if schedule is None:
                self.schedule_version.set(0)
                return
            self._bin_width, self._num_bins = schedule.bin_width, schedule.num_bins
            for i, budget in enumerate(schedule.budgets):
                self.kv_budget.labels(**{mc.BIN_LABEL: mc.bin_label(i)}).set(budget)
            self.schedule_version.set(schedule.version)

    def record_tokens(self, prompt_len: int, kv_budgets: list[int], first: int = 0) -> None:
        """Count tokens of one response as they are generated: by mode, and attended and context KV per bin.

        `kv_budgets` are the budgets of its tokens `first`, `first + 1`, ... (token i saw prompt_len + i).
        """
        n = len(kv_budgets)
        if n == 0:
            return
        budget = np.asarray(kv_budgets, dtype=np.int64)
        context = prompt_len + first + np.arange(n, dtype=np.int64)
        sparse = (budget > 0) & (budget < context)
        attended = np.where(sparse, budget, context)
        with self._lock:
            width, num_bins = self._bin_width, self._num_bins
        bins = context // width
        if num_bins is not None:
            bins = np.minimum(bins, num_bins - 1)
        n_sparse = int(sparse.sum())
        self.tokens.labels(mode="sparse").inc(n_sparse)
        self.tokens.labels(mode="dense").inc(n - n_sparse)
        for i in np.unique(bins).tolist():
            mask = bins == i
            label = {mc.BIN_LABEL: mc.bin_label(int(i))}
            self.attended_kv.labels(**label).inc(int(attended[mask].sum()))
            self.context_kv.labels(**label).inc(int(context[mask].sum()))

    def record_speculation(self, sample: FinishedSample) -> None:
        """Count a speculatively decoded sample's drafts, accepted drafts and cycles, and observe alpha, per bin."""
        k = sample.speculative_tokens
        if not k or not sample.draft_kv_lens:
            return
        kv = np.asarray(sample.draft_kv_lens, dtype=np.int64)
        accepted = np.asarray(sample.draft_accepted, dtype=bool)
        with self._lock:
            width, num_bins = self._bin_width, self._num_bins
        bins = kv // width
        if num_bins is not None:
            bins = np.minimum(bins, num_bins - 1)
        starts = np.zeros(len(kv), dtype=bool)
        starts[::k] = True
        for i in np.unique(bins).tolist():
            mask = bins == i
            label = {mc.BIN_LABEL: mc.bin_label(int(i))}
            self.draft_tokens.labels(**label).inc(int(mask.sum()))
            self.accepted_draft_tokens.labels(**label).inc(int((accepted & mask).sum()))
            self.speculative_cycles.labels(**label).inc(int((starts & mask).sum()))
            histogram = self.draft_alpha.labels(**label)
            for a in np.asarray(sample.draft_alphas)[mask].tolist():
                histogram.observe(a)

    def record_cycle(self, cycle: CycleTime) -> None:
        """Add one timed speculative cycle to its bin's seconds of drafting and verifying."""
        if not (cycle.draft_seconds > 0 and cycle.verify_seconds > 0 and cycle.kv_len >= 0):
            return
        with self._lock:
            width, num_bins = self._bin_width, self._num_bins
        index = cycle.kv_len // width
        if num_bins is not None:
            index = min(index, num_bins - 1)
        label = {mc.BIN_LABEL: mc.bin_label(index)}
        self.draft_seconds.labels(**label).inc(cycle.draft_seconds)
        self.verify_seconds.labels(**label).inc(cycle.verify_seconds)
        self.timed_cycles.labels(**label).inc()

    def record_phases(self, seconds: dict[str, float]) -> None:
        """Add one interval's split (`PhaseTimer.take`) to the phase counters."""
        for phase, value in seconds.items():
            self.phase_seconds.labels(**{mc.PHASE_LABEL: phase}).inc(max(0.0, value))

    def show_versions(self, policy: int, adapter: int) -> None:
        """The policy and adapter versions being served."""
        self.policy_version.set(policy)
        self.adapter_version.set(adapter)

    def serve(self, host: str, port: int) -> int:
        """Start the /metrics HTTP exporter; returns the port it listens on."""
        self._server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return self._server.server_port

    def close(self) -> None:
        """Stop the exporter."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
