"""The Ray Serve deployment: one generator per replica, its health, status and lag for the autoscaler.

    serve run deploy/ray/serve_app.yaml            # or: serve deploy, or a KubeRay RayService

The replica builds the generator's config like `sparrow generator` does (TOML file, SPARROW_*
environment, then overrides), gives each replica its own generator id and, since replicas share a
node's ports, lets the OS pick the control and metrics ports unless the config pins them. The engine
loop runs in a thread of the replica (the generator keeps every engine call on that one thread);
`GET /` answers the status of whichever replica takes the request.
"""

from __future__ import annotations

import logging
import socket
from typing import Any

from ray import serve

from services.generator.work_queue import consumer_group_backlog
from services.generator_ray.autoscale import OUTSTANDING_METRIC

log = logging.getLogger("sparrow.generator_ray")


def replica_overrides(overrides: dict[str, Any], replica_unique_id: str) -> dict[str, Any]:
    """The config overrides of one replica: the given ones, plus a distinct id and free ports by default."""
    out = dict(overrides)
    out.setdefault("generator_id", f"{socket.gethostname()}-{replica_unique_id}")
    out.setdefault("control.port", 0)
    out.setdefault("metrics.port", 0)
    return out


@serve.deployment(name="SparrowGenerator", max_ongoing_requests=16, health_check_period_s=10)
class GeneratorReplica:
    """One Sparrow generator (engine, queue consumer, trajectory stream, control server) per replica."""

    def __init__(self, config_path: str | None = None, overrides: dict[str, Any] | None = None) -> None:
        import redis

        from services.generator.config import GeneratorConfig
        from services.generator.main import Generator
        from sparrow.config import load_config

        replica_id = serve.get_replica_context().replica_id.unique_id
        self.config = load_config(GeneratorConfig, config_path, replica_overrides(overrides or {}, replica_id))
        log.info("replica %s: generator %s", replica_id, self.config.generator_id)
        self.generator = Generator(self.config)
        self.thread = self.generator.run_in_background()
        q = self.config.queue
        self._redis = redis.Redis.from_url(self.config.redis.url, socket_timeout=q.socket_timeout_s)

    def status(self) -> dict[str, Any]:
        """Who this replica is and what it serves."""
        versions = self.generator.service.serving
        return {
            "generator_id": self.config.generator_id,
            "alive": self.thread.is_alive(),
            "control_port": self.generator.control.port if self.generator.control is not None else 0,
            "metrics_port": self.generator.metrics_port,
            "policy_version": versions.policy_version,
            "adapter_version": versions.adapter_version,
            "schedule_version": versions.schedule_version,
        }

    async def __call__(self, request: Any = None) -> dict[str, Any]:
        return self.status()

    def check_health(self) -> None:
        """Ray Serve's health probe: a replica whose engine loop ended is restarted."""
        if not self.thread.is_alive():
            raise RuntimeError(f"generator {self.config.generator_id}: the engine loop has stopped")

    def record_autoscaling_stats(self) -> dict[str, float]:
        """The stream's outstanding groups (lag + pending), for OutstandingGroupsPolicy."""
        q = self.config.queue
        backlog = consumer_group_backlog(self._redis, q.stream, q.group)
        return {OUTSTANDING_METRIC: float(backlog.outstanding if backlog is not None else 0)}

    def __del__(self) -> None:
        # Ray Serve calls this on graceful shutdown: drain (finish or hand back groups), then free the engine.
        generator = getattr(self, "generator", None)
        if generator is None:
            return
        if self.thread.is_alive():
            generator.service.request_drain(self.config.drain_grace_s, exit_after=True)
            self.thread.join(self.config.drain_grace_s + 30)
        generator.close()
        generator.engine.close()
        self._redis.close()


def build_app(args: dict[str, Any]) -> serve.Application:
    """Serve application builder (`import_path: services.generator_ray.app:build_app`).

    args: `config_path` (a generator TOML file, optional) and `overrides` (dotted config keys).
    """
    unknown = set(args) - {"config_path", "overrides"}
    if unknown:
        raise ValueError(f"unknown application args: {', '.join(sorted(unknown))} (known: config_path, overrides)")
    return GeneratorReplica.bind(args.get("config_path"), dict(args.get("overrides") or {}))
