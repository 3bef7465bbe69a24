"""The cluster's loopback ports: fixed ones checked before anything starts, the rest picked free and reserved
(`services.common.free_ports`: below the ephemeral range, so no client's connection takes one before its service
binds it)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from services.common.free_ports import HOST, free_port, port_in_use
from services.launcher.config import UpConfig


class PortError(ValueError):
    """A fixed port that cannot be used; one line naming the port and its owner."""


@dataclass(frozen=True)
class Ports:
    """Every port of one run."""

    redis: int
    prometheus: int
    trainer_grpc: int
    trainer_metrics: int
    generator_metrics: tuple[int, ...]
    generator_control: tuple[int, ...]
    controller: int
    sandbox: int = 0  # 0: the run starts no sandbox

    def metrics_targets(self, with_controller: bool) -> dict[str, list[str]]:
        """Prometheus scrape jobs: host:port lists per service."""
        jobs = {
            "trainer": [f"{HOST}:{self.trainer_metrics}"],
            "generator": [f"{HOST}:{p}" for p in self.generator_metrics],
        }
        if with_controller:
            jobs["controller"] = [f"{HOST}:{self.controller}"]
        if self.sandbox:
            jobs["sandbox"] = [f"{HOST}:{self.sandbox}"]
        return jobs


def allocate(config: UpConfig) -> Ports:
    """Ports for every service: configured ones checked (in use, clashing, out of range), others free ones."""
    p = config.ports
    n = config.generators
    wanted: dict[str, int] = {}  # owner -> fixed port
    if not config.redis_url:
        wanted["redis"] = p.redis
    if not config.prometheus_url:
        wanted["prometheus"] = p.prometheus
    wanted["trainer_grpc"] = p.trainer_grpc
    wanted["trainer_metrics"] = p.trainer_metrics
    for i in range(n):
        wanted[f"generator_metrics (gen-{i})"] = p.generator_metrics + i if p.generator_metrics else 0
        wanted[f"generator_control (gen-{i})"] = p.generator_control + i if p.generator_control else 0
    if config.uses_controller:
        wanted["controller"] = p.controller
    owners: dict[int, str] = {}
    for owner, port in wanted.items():
        if not port:
            continue
        if port > 65535:
            raise PortError(f"ports.{owner.split(' ')[0]}: port {port} for {owner} is above 65535")
        if port in owners:
            raise PortError(f"port {port} is configured for both {owners[port]} and {owner}")
        if port_in_use(port):
            raise PortError(f"port {port} ({owner}) is in use; free it or choose another in [ports]")
        owners[port] = owner
    taken = set(owners)
    chosen = {}
    for owner, port in wanted.items():
        if not port:
            port = free_port(taken)
            taken.add(port)
        chosen[owner] = port
    return Ports(
        redis=chosen.get("redis", 0),
        prometheus=chosen.get("prometheus", 0),
        trainer_grpc=chosen["trainer_grpc"],
        trainer_metrics=chosen["trainer_metrics"],
        generator_metrics=tuple(chosen[f"generator_metrics (gen-{i})"] for i in range(n)),
        generator_control=tuple(chosen[f"generator_control (gen-{i})"] for i in range(n)),
        controller=chosen.get("controller", 0),
    )


def with_sandbox_port(ports: Ports, fixed: int) -> Ports:
    """`ports` plus the sandbox's: `fixed` checked as `allocate` checks its ports, or a free one.

    Apart from `allocate` because whether a run starts the sandbox is known only once its rewards are
    (the datasets' data_source columns can choose the `code` reward)."""
    taken = {p for p in (ports.redis, ports.prometheus, ports.trainer_grpc, ports.trainer_metrics, ports.controller)}
    taken |= set(ports.generator_metrics) | set(ports.generator_control)
    taken.discard(0)
    if not fixed:
        return replace(ports, sandbox=free_port(taken))
    if fixed in taken:
        raise PortError(f"port {fixed} is configured for both the sandbox and another service of the run")
    if port_in_use(fixed):
        raise PortError(f"port {fixed} (sandbox) is in use; free it or choose another in [ports]")
    return replace(ports, sandbox=fixed)
