"""The sandbox service's config: the jail, the limits a request may ask for, the pool, the API (sparrow.config)."""

from __future__ import annotations

from pydantic import Field, model_validator

from services.common.sections import SecurityConfig
from services.sandbox.jail import Limits
from sparrow.config import ConfigSection, SparrowConfig


class JailConfig(ConfigSection):
    """How programs are jailed."""

    bwrap: str = Field("bwrap", description="The bubblewrap binary (a name on PATH or a path).")
    uid: int = Field(
        65534, ge=1, description="Unprivileged uid (and gid) programs run as when the service runs as root (nobody)."
    )
    proc: bool = Field(
        True,
        description="Mount a fresh /proc of the jail's PID namespace; off in containers whose runtime masks /proc "
        "(Docker's and Kubernetes' default), where the mount is refused: the jail then has no /proc.",
    )
    insecure_local: bool = Field(
        False,
        description="Development only: run programs unjailed (same rlimits, empty environment, but the host's "
        "files and network) where bubblewrap cannot run; a warning is logged at every start.",
    )


class LimitsConfig(ConfigSection):
    """What one test case may use, and the most a request may ask for."""

    timeout_s: float = Field(10.0, gt=0, description="Wall-clock seconds per test case when a request names none.")
    max_timeout_s: float = Field(30.0, gt=0, description="Largest per-case timeout a request may ask for (over: 422).")
    max_request_s: float = Field(
        120.0, gt=0, description="Wall-clock seconds all cases of one request may take; cases left count as failed."
    )
    memory_mb: int = Field(1024, ge=16, description="Address-space limit per case (MiB) when a request names none.")
    max_memory_mb: int = Field(4096, ge=16, description="Largest address-space limit a request may ask for (MiB).")
    max_processes: int = Field(32, ge=1, description="Processes and threads one program may have at once.")
    max_file_mb: int = Field(16, ge=0, description="Largest file a program may write (MiB, RLIMIT_FSIZE).")
    tmpfs_mb: int = Field(64, ge=1, description="Size of the program's writable /tmp (MiB).")
    max_output_bytes: int = Field(
        1 << 20, ge=1024, description="Bytes of stdout (and, apart, of stderr) a case may write before it is killed."
    )
    keep_bytes: int = Field(1024, ge=0, description="First bytes of each case's stdout and stderr put in the answer.")
    max_body_bytes: int = Field(16 << 20, ge=1024, description="Largest request body (over: 413, nothing run).")

    @model_validator(mode="after")
    def _defaults_within_max(self) -> LimitsConfig:
        if self.timeout_s > self.max_timeout_s or self.memory_mb > self.max_memory_mb:
            raise ValueError("limits.timeout_s and limits.memory_mb must not exceed their max_ values")
        return self

    def for_request(self, timeout_s: float | None, memory_mb: int | None) -> Limits:
        """The jail limits of one request (its own timeout and memory, or the defaults)."""
        return Limits(
            timeout_s=timeout_s or self.timeout_s,
            memory_mb=memory_mb or self.memory_mb,
            max_processes=self.max_processes,
            max_file_mb=self.max_file_mb,
            max_output_bytes=self.max_output_bytes,
            tmpfs_mb=self.tmpfs_mb,
        )


class PoolConfig(ConfigSection):
    """The bounded worker pool requests run on."""

    workers: int = Field(4, ge=1, description="Programs run at once (about one CPU core each).")
    queue_limit: int = Field(64, ge=0, description="Requests that may wait for a worker; one more is answered 429.")


class ApiConfig(ConfigSection):
    """The HTTP API (OpenAPI at /docs and /openapi.json), its health checks and /metrics."""

    host: str = Field("127.0.0.1", description="Address the API listens on.")
    port: int = Field(8490, ge=0, le=65535, description="Port of the API, the health checks and /metrics.")
    access_log: bool = Field(
        False, description="Log one line per run request (cases passed, first failing status, seconds); sparrow up: on."
    )


class SandboxConfig(SparrowConfig):
    """`sparrow sandbox`: runs model-written programs against tests, jailed."""

    jail: JailConfig = Field(default_factory=JailConfig, description="How programs are jailed.")
    limits: LimitsConfig = Field(default_factory=LimitsConfig, description="Per-case limits.")
    pool: PoolConfig = Field(default_factory=PoolConfig, description="The worker pool.")
    api: ApiConfig = Field(default_factory=ApiConfig, description="The HTTP API.")
    security: SecurityConfig = Field(default_factory=SecurityConfig, description="The service token.")
