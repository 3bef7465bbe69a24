"""The generator's config: one typed model (sparrow.config) covering the queue, the trainer link, the engine."""

from __future__ import annotations

import os
import socket
from typing import ClassVar, Literal

from pydantic import Field, model_validator

from services.common.sections import GrpcSecurityConfig, RedisConfig
from sparrow.config import ConfigSection, SparrowConfig
from sparrow.speculative import MAX_DRAFTS, MIN_DRAFTS
from sparrow.work import DEAD_LETTER_STREAM, GENERATOR_GROUP, PROMPTS_STREAM


def default_generator_id() -> str:
    """hostname-pid: unique per process on a cluster, readable in Redis consumer lists."""
    return f"{socket.gethostname()}-{os.getpid()}"


class QueueConfig(ConfigSection):
    """The Redis Stream of prompt groups (on the Redis of [redis]) and the retry policy."""

    stream: str = Field(PROMPTS_STREAM, description="Stream the trainer enqueues prompt groups on.")
    group: str = Field(GENERATOR_GROUP, description="Consumer group shared by every generator.")
    dead_letter_stream: str = Field(DEAD_LETTER_STREAM, description="Where groups that cannot be generated go.")
    claim_idle_s: float = Field(
        60.0, gt=0, description="An entry pending this long without a heartbeat is reclaimed from a dead generator."
    )
    max_attempts: int = Field(
        3, ge=1, description="Deliveries that may end in a trainer rejection; the last one's group is dead-lettered."
    )
    max_deliveries: int = Field(
        5, ge=1, description="An entry delivered (claimed) more often than this is dead-lettered as poison."
    )
    read_block_ms: int = Field(100, ge=1, description="How long an idle generator blocks on XREADGROUP (ms).")
    socket_timeout_s: float = Field(5.0, gt=0, description="Timeout of one Redis command, seconds.")


class TrainerConfig(ConfigSection):
    """The trainer's RolloutService (trajectories) and WeightService (policy and adapter files)."""

    address: str = Field("127.0.0.1:50051", description="host:port of the trainer's RolloutService.")
    weights_address: str = Field("", description="host:port of the WeightService; empty: the same as address.")
    reconnect_initial_s: float = Field(0.2, gt=0, description="First reconnect delay after the stream breaks.")
    reconnect_max_s: float = Field(10.0, gt=0, description="Cap of the exponential reconnect delay.")
    weights_dir: str = Field(
        "", description="Folder fetched versions are written to; empty: a folder in the system temp dir."
    )
    fetch_chunk_bytes: int = Field(4 << 20, ge=1024, description="Chunk size asked for when fetching weights.")
    stream_policies: bool = Field(
        True,
        description=(
            "vLLM: read each policy version off the stream into host memory (one copy in the published dtype) "
            "and load it from there, checked on arrival, never written to weights_dir; a relay keeps the disk path."
        ),
    )
    fetch_timeout_s: float = Field(600.0, gt=0, description="Deadline of one policy or adapter download.")
    follow_versions: bool = Field(
        True, description="Fetch and load new versions as the trainer announces them (WatchVersions, hello)."
    )

    @property
    def weights_target(self) -> str:
        """Where the WeightService answers."""
        return self.weights_address or self.address


class RelayConfig(ConfigSection):
    """Serving the policy version this generator holds to peers (read-only WeightService, same token)."""

    enabled: bool = Field(
        False, description="Relay policy versions to peers the trainer sends here, and check every version's digest."
    )
    host: str = Field("0.0.0.0", description="Address the relay listens on.")
    port: int = Field(0, ge=0, le=65535, description="Port of the relay; 0 picks a free one.")
    advertise: str = Field(
        "", description="host:port peers reach the relay at; empty: relay.host (this host's name for 0.0.0.0) and port."
    )
    wait_s: float = Field(
        300.0, gt=0, description="How long a peer's fetch waits for a version this generator is still fetching."
    )
    peer_timeout_s: float = Field(
        300.0, gt=0, description="Deadline of one fetch from a peer; a slower peer is dropped for another source."
    )


class EngineConfig(ConfigSection):
    """Which engine generates, and its limits."""

    kind: Literal["vllm", "reference"] = Field(
        "vllm", description="vllm (production) or reference (the project's own torch decode loop, slow, no vLLM)."
    )
    model_dir: str = Field("models/small", description="HF-format policy checkpoint the engine starts from.")
    policy_version: int = Field(
        0, ge=0, description="Reference engine only: version number of the starting checkpoint (vLLM starts at 0)."
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="Weights and KV dtype. auto: the checkpoint's on an accelerator (vLLM's choice); on CPU bfloat16 "
        "only where the CPU computes it natively (AVX512-BF16, AMX), else float32.",
    )
    max_num_seqs: int = Field(256, ge=1, description="Sequences the engine batches at once.")
    max_model_len: int = Field(40960, ge=16, description="Longest sequence (prompt + response) in tokens.")
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1, description="Share of accelerator memory vLLM may use.")
    cuda_graphs: Literal["off", "piecewise", "full"] = Field(
        "piecewise",
        description=(
            "vLLM on CUDA only (CPU engines run eagerly): off = no CUDA graphs; piecewise = the layers "
            "between attentions as graphs, attention eager; full = also whole steps of pure decodes as "
            "graphs (static decode; not yet run on a GPU)."
        ),
    )
    cpu_compile: bool = Field(
        False,
        description=(
            "vLLM on CPU only: compile the model (torch.compile through vLLM's compilation, attention left eager) "
            "instead of running it eagerly. It cuts the per-step work around attention, which on a small model "
            "is most of a step (models/long at 4K on 2 cores: a draft step 4-6 ms instead of 5-8 ms; "
            "docs/results.md); about a minute more at start."
        ),
    )
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        description=(
            "vLLM only: devices one engine shards the model over (vLLM's multiprocess executor past 1); must "
            "divide the model's attention and KV heads. Past 1, every worker takes each policy, schedule, probe "
            "and adapter; on CPU each worker is bound to its share of the process's CPUs (unless "
            "VLLM_CPU_OMP_THREADS_BIND is set)."
        ),
    )
    enable_lora: bool = Field(True, description="vLLM only: start with LoRA support (DistillSparse adapters).")
    max_lora_rank: int = Field(64, ge=1, description="Largest LoRA rank an adapter may have.")
    seed: int = Field(0, ge=0, description="Seed of the engine's sampler.")
    device: str = Field("auto", description="Reference engine only: cpu, cuda, or auto (cuda when present).")
    kernel_backend: Literal["auto", "torch", "cpu", "triton"] = Field(
        "auto", description="Reference engine only: which sparse-attention kernels run (see kernels.backend)."
    )
    decode: Literal["sparse", "speculative", "dense"] = Field(
        "sparse",
        description=(
            "How decode attends: sparse (the schedule's block-sparse budgets; fast, lossy), speculative (sparse "
            "drafts verified by one dense pass with exact rejection sampling: every token is the dense policy's; "
            "on vLLM every request of the engine, the plugin's CPU attention only so far, no LoRA), "
            "dense (every page: the generator applies no schedule, neither "
            "schedule.initial nor Redis's; sparrow up --dense). Groups marked dense decode densely in every mode."
        ),
    )
    speculative_tokens: int = Field(
        6,
        ge=MIN_DRAFTS,
        le=MAX_DRAFTS,
        description="decode speculative: draft tokens per cycle (k); each cycle emits 1 to k + 1 tokens.",
    )


class ScheduleConfig(ConfigSection):
    """Where the sparsity schedule comes from."""

    initial: str = Field(
        "", description="Preset name or schedule JSON file used until Redis holds one; empty: dense attention."
    )
    follow_redis: bool = Field(True, description="Apply the controller's versions from Redis (key + pub/sub).")
    poll_s: float = Field(10.0, gt=0, description="Backstop: re-read the schedule key this often (seconds).")


class EndpointConfig(ConfigSection):
    """A listening address."""

    host: str = Field("0.0.0.0", description="Address to listen on.")
    port: int = Field(0, ge=0, le=65535, description="Port; 0 picks a free one (logged at start).")


class GeneratorConfig(SparrowConfig):
    """The generator service's whole config (TOML file, SPARROW_* environment, flags)."""

    renamed: ClassVar[dict[str, str]] = {"queue.url": "redis.url"}

    generator_id: str = Field(
        default_factory=default_generator_id,
        min_length=1,
        max_length=200,
        description="This generator's name: its Redis consumer, its hello to the trainer (default hostname-pid).",
    )
    max_in_flight_groups: int = Field(8, ge=1, description="Prompt groups claimed and not yet acked, at most.")
    drain_grace_s: float = Field(
        30.0, ge=0, description="On SIGTERM or Drain: seconds in-flight groups may finish before being handed back."
    )
    redis: RedisConfig = Field(default_factory=RedisConfig, description="Redis of the work stream and the schedule.")
    queue: QueueConfig = Field(default_factory=QueueConfig, description="Work stream and retry policy.")
    trainer: TrainerConfig = Field(default_factory=TrainerConfig, description="The trainer's gRPC services.")
    security: GrpcSecurityConfig = Field(default_factory=GrpcSecurityConfig, description="Service token and TLS.")
    relay: RelayConfig = Field(default_factory=RelayConfig, description="Peer relay of policy versions.")
    engine: EngineConfig = Field(default_factory=EngineConfig, description="The rollout engine.")
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig, description="Sparsity schedule source.")
    metrics: EndpointConfig = Field(
        default_factory=lambda: EndpointConfig(port=9400), description="Prometheus /metrics exporter."
    )
    control: EndpointConfig = Field(
        default_factory=lambda: EndpointConfig(port=50061), description="GeneratorControl gRPC server."
    )

    @model_validator(mode="after")
    def _check(self) -> GeneratorConfig:
        s = self.security
        if bool(s.tls_cert) != bool(s.tls_key):
            raise ValueError("security.tls_cert and security.tls_key must be set together")
        if self.trainer.reconnect_initial_s > self.trainer.reconnect_max_s:
            raise ValueError("trainer.reconnect_initial_s is above trainer.reconnect_max_s")
        return self
