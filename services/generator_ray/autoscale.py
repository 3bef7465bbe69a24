"""Autoscaling generator replicas on the prompt stream's outstanding groups.

Outstanding = the consumer group's lag (entries not yet delivered to any generator) plus its pending
entries (delivered, not yet acked: in flight). The trainer bounds it (it keeps about
`outstanding_steps x groups_per_step` groups on the stream), so it measures demand; the lag alone
would not: it is 0 whenever the generators keep up, and replicas sized on it would shrink until
they fell behind again. Every replica reports the number (one for the whole stream, read from Redis
with XINFO GROUPS) as a custom autoscaling metric; the policy asks for
ceil(outstanding / groups per replica) replicas, groups per replica being about a generator's
`max_in_flight_groups`. Ray Serve applies min/max replicas and the up/downscale delays of the
deployment's autoscaling_config around it. Keep min_replicas >= 1: with no replica left, nothing
reports the number.
"""

from __future__ import annotations

import math
from typing import Any

OUTSTANDING_METRIC = "queue_outstanding_entries"


class OutstandingGroupsPolicy:
    """Ray Serve custom autoscaling policy: replicas = ceil(outstanding / target_groups_per_replica).

    Configured in serve_app.yaml as
    `policy: {policy_function: services.generator_ray.autoscale:OutstandingGroupsPolicy, policy_kwargs: {...}}`.
    """

    def __init__(self, target_groups_per_replica: float = 8.0) -> None:
        if not target_groups_per_replica > 0:
            raise ValueError(f"target_groups_per_replica must be positive, got {target_groups_per_replica}")
        self.target = float(target_groups_per_replica)

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        """The replica count for the outstanding groups the replicas last reported (Ray bounds and delays it)."""
        reported = (ctx.aggregated_metrics or {}).get(OUTSTANDING_METRIC) or {}
        if not reported:
            # No replica has reported yet (starting up): keep the current target.
            return ctx.target_num_replicas, {}
        # Each replica reads the same stream; the largest reading is the freshest upper bound.
        outstanding = max(float(v) for v in reported.values())
        return max(1, math.ceil(outstanding / self.target)), {"outstanding": outstanding}
