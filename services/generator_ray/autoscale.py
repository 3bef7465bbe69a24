"""Autoscaling generator replicas on the prompt stream's lag: entries not yet delivered to any generator.

Every replica reports the consumer group's lag (one number for the whole stream, read from Redis
with XINFO GROUPS) as a custom autoscaling metric; the policy asks for ceil(lag / target) replicas.
Ray Serve applies min/max replicas and the up/downscale delays of the deployment's
autoscaling_config around it. Keep min_replicas >= 1: with no replica left, nothing reports the lag.
"""

from __future__ import annotations

import math
from typing import Any

LAG_METRIC = "queue_lag_entries"


def consumer_group_lag(client: Any, stream: str, group: str) -> int:
    """Entries of `stream` not yet delivered to `group` (Redis 7's lag; its pending count when unknown).

    A stream or group that does not exist yet has nothing waiting: 0.
    """
    import redis

    try:
        groups = client.xinfo_groups(stream)
    except redis.ResponseError:  # no such stream yet
        return 0
    for info in groups:
        name = info["name"].decode() if isinstance(info["name"], bytes) else info["name"]
        if name == group:
            lag = info.get("lag")
            return int(lag) if lag is not None else int(info.get("pending", 0))
    return 0


class QueueLagPolicy:
    """Ray Serve custom autoscaling policy: replicas = ceil(lag / target_lag_per_replica).

    Configured in serve_app.yaml as
    `policy: {policy_function: services.generator_ray.autoscale:QueueLagPolicy, policy_kwargs: {...}}`.
    """

    def __init__(self, target_lag_per_replica: float = 32.0) -> None:
        if not target_lag_per_replica > 0:
            raise ValueError(f"target_lag_per_replica must be positive, got {target_lag_per_replica}")
        self.target = float(target_lag_per_replica)

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        """The replica count for the lag the replicas last reported (Ray bounds and delays it)."""
        reported = (ctx.aggregated_metrics or {}).get(LAG_METRIC) or {}
        if not reported:
            # No replica has reported yet (starting up): keep the current target.
            return ctx.target_num_replicas, {}
        # Each replica reads the same stream; the largest reading is the freshest upper bound.
        lag = max(float(v) for v in reported.values())
        return max(1, math.ceil(lag / self.target)), {"lag": lag}
