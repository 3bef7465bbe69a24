"""The trainer's Prometheus metrics, on a registry of its own, in base units.

The tail of alpha per length bin comes from `TailMetrics` (names in `sparrow.metrics_contract`, read
by the controller); everything else about a step, the trajectory intake and the work queue is here.
Dashboards are built on these exact names.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, start_http_server

from services.trainer.tail_metrics import TailMetrics
from sparrow import metrics_contract as mc
from sparrow.reward_shapes import REWARD_ERROR_REASONS
from sparrow.timing import OTHER

ACK_STATUSES = ("accepted", "duplicate", "rejected")
# Step time spans seconds (tiny CPU models) to many minutes (long-context GPU steps).
STEP_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200, 3600)


class TrainerMetrics:
    """Every metric the trainer exports; `serve` starts /metrics."""

    def __init__(self, bin_width: int, num_bins: int | None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.tail = TailMetrics(bin_width, num_bins).register(r)
        self.reward_mean = Gauge("sparrow_trainer_reward_mean", "Mean reward of the last step's samples.", registry=r)
        self.accuracy = Gauge(
            "sparrow_trainer_accuracy_ratio", "Fraction of the last step's samples with reward 1.", registry=r
        )
        self.response_length = Gauge(
            "sparrow_trainer_response_length_tokens", "Mean response length of the last step.", registry=r
        )
        self.alpha_mean = Gauge(
            "sparrow_trainer_alpha_mean", "Mean alpha per length bin over the last step.", [mc.BIN_LABEL], registry=r
        )
        self.tis_clip = Gauge(
            "sparrow_trainer_tis_clip_ratio", "Fraction of tokens whose TIS weight hit the cap, last step.", registry=r
        )
        self.kl = Gauge(
            "sparrow_trainer_kl_rollout_dense",
            "k3 estimate of KL(rollout || dense old policy) per token on the sampled tokens, last step.",
            registry=r,
        )
        self.step_seconds = Histogram(
            "sparrow_trainer_step_seconds", "Wall time of a training step.", buckets=STEP_BUCKETS, registry=r
        )
        self.phase_seconds = Counter(
            mc.TRAINER_PHASE_SECONDS,
            "Seconds of the trainer's steps by phase (sparrow.timing); the phases of a step sum to its wall time.",
            [mc.PHASE_LABEL],
            registry=r,
        )
        for phase in (*mc.TRAINER_PHASES, OTHER):
            self.phase_seconds.labels(**{mc.PHASE_LABEL: phase})
        self.world_size = Gauge(
            "sparrow_trainer_world_size", "Trainer processes (torch.distributed ranks) training each step.", registry=r
        )
        self.steps = Counter("sparrow_trainer_steps", "Training steps done by this process.", registry=r)
        self.policy_version = Gauge("sparrow_trainer_policy_version", "Latest published policy version.", registry=r)
        self.staleness = Gauge(
            "sparrow_trainer_staleness_versions",
            "Mean policy-version lag of the last step's samples behind the policy they trained.",
            registry=r,
        )
        self.dropped_stale = Counter(
            "sparrow_trainer_dropped_stale", "Prompt groups dropped for staleness, never trained.", registry=r
        )
        self.trajectories = Counter(
            "sparrow_trainer_trajectories", "Trajectories received, by ack status.", ["status"], registry=r
        )
        self.groups_dead = Counter(
            "sparrow_trainer_groups_dead", "Own prompt groups found in the dead-letter stream.", registry=r
        )
        self.last_step = Gauge(
            "sparrow_trainer_last_step_timestamp_seconds", "Unix time the last step finished.", registry=r
        )
        self.outstanding = Gauge(
            "sparrow_trainer_queue_outstanding_groups",
            "Prompt groups enqueued and not yet taken by a step.",
            registry=r,
        )
        self.reward_errors = Counter(
            "sparrow_trainer_reward_errors",
            "Reward calls that scored 0 because the reward timed out, raised, or returned no finite score.",
            ["reason"],
            registry=r,
        )
        self.reward_extra = Gauge(
            "sparrow_trainer_reward_extra",
            "Mean of a number field a reward returned beside its score (a dict reward's other fields), over the "
            "last step's samples that returned it, per reward and field.",
            ["reward", "field"],
            registry=r,
        )
        self.eval_avg = Gauge(
            "sparrow_trainer_eval_avg_reward",
            "Mean reward over the k samples of every eval prompt (avg@k), last evaluation, per source and mode "
            "(dense or schedule: how the samples decoded).",
            ["source", "mode"],
            registry=r,
        )
        self.eval_pass = Gauge(
            "sparrow_trainer_eval_pass_ratio",
            "Unbiased pass@k (Chen et al.) of the last evaluation, per source, k and mode (dense or schedule).",
            ["source", "k", "mode"],
            registry=r,
        )
        for reason in REWARD_ERROR_REASONS:
            self.reward_errors.labels(reason=reason)
        for status in ACK_STATUSES:
            self.trajectories.labels(status=status)

    def serve(self, host: str, port: int) -> tuple[object, int]:
        """Start /metrics on host:port (0: a free port); returns the HTTP server and its port."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return server, server.server_address[1]

    def exposition(self) -> bytes:
        """The text exposition of every metric here."""
        return generate_latest(self.registry)
